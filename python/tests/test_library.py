"""Loading the library (EPFLOW_LIB, NCCL_HOME, the library path, NCCL first with RTLD_GLOBAL, a
clear message when missing) and NCCLLibrary's shape. Each loading case runs in a fresh
interpreter, since a process loads a library once."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

import nccl_ep

from _common import compile_and_run, compiler, library, skip_loudly  # noqa: F401

REPORT = textwrap.dedent(
    """
    import json, sys, warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        import nccl_ep
    out = {"have": nccl_ep.HAVE_NCCL_EP, "message": nccl_ep.NCCL_EP_LOAD_MESSAGE,
           "warned": [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]}
    try:
        lib = nccl_ep.NCCLLibrary()
        out.update(path=lib.so_file, epflow=lib.is_epflow, nccl=lib.nccl_path, version=lib.ncclEpGetVersion())
        import ctypes
        out["nccl_global"] = hasattr(ctypes.CDLL(None), "ncclCommInitRank")
    except nccl_ep.LibraryNotFoundError as e:
        out["error"] = str(e)
    print(json.dumps(out))
    """
)


def run_fresh(env_overrides):
    """Imports nccl_ep in a fresh interpreter with ``env_overrides`` (None deletes) and returns
    what it found."""
    env = dict(os.environ)
    for k in ("EPFLOW_LIB", "NCCL_HOME", "EPFLOW_NCCL_LIB", "NCCL_EP_PY_QUIET"):
        env.pop(k, None)
    for k, v in env_overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    # The same nccl_ep as this process imported (installed or the source tree).
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(nccl_ep.__file__)))
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run([sys.executable, "-c", REPORT], capture_output=True, text=True, env=env, cwd=cwd)
    if r.returncode != 0:
        raise AssertionError("the probe failed:\n" + r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


class Loading(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.lib = library()
        cls.path = os.path.realpath(os.environ["EPFLOW_LIB"])

    def test_epflow_lib_is_loaded_and_is_epflows(self):
        self.assertTrue(nccl_ep.HAVE_NCCL_EP, nccl_ep.NCCL_EP_LOAD_MESSAGE)
        self.assertEqual(self.lib.so_file, self.path)
        self.assertTrue(self.lib.is_epflow)
        self.assertEqual(self.lib.epflow_abi_version, nccl_ep.NCCL_EP_VERSION_CODE)
        self.assertEqual(self.lib.ncclEpGetVersion(), nccl_ep.NCCL_EP_VERSION_CODE)

    def test_the_18_functions_have_their_signatures(self):
        names = [f.name for f in nccl_ep.EP_FUNCTIONS]
        self.assertEqual(len(names), 18)
        self.assertEqual(len(set(names)), 18)
        for f in nccl_ep.EP_FUNCTIONS:
            with self.subTest(function=f.name):
                fn = getattr(self.lib.raw, f.name)
                self.assertEqual(fn.argtypes, f.argtypes)
                self.assertIs(fn.restype, f.restype)
                method = getattr(nccl_ep.NCCLLibrary, f.name)
                self.assertTrue(method.__doc__ and f.name in method.__doc__, "%s has no docstring naming it" % f.name)

    def test_missing_library_is_a_message_not_an_exception(self):
        r = run_fresh({"EPFLOW_LIB": "/nonexistent/libnccl_ep.so"})
        self.assertFalse(r["have"])
        self.assertIn("/nonexistent/libnccl_ep.so", r["message"])
        self.assertIn("EPFLOW_LIB", r["message"])
        self.assertTrue(r["warned"], "importing without the library warns")
        self.assertIn("/nonexistent/libnccl_ep.so", r["error"])

    def test_explicit_epflow_lib_does_not_fall_back(self):
        with tempfile.TemporaryDirectory() as home:
            os.makedirs(os.path.join(home, "lib"))
            os.symlink(self.path, os.path.join(home, "lib", "libnccl_ep.so"))
            r = run_fresh({"EPFLOW_LIB": "/nonexistent/libnccl_ep.so", "NCCL_HOME": home})
        self.assertFalse(r["have"])

    def test_epflow_lib_may_name_a_directory(self):
        r = run_fresh({"EPFLOW_LIB": os.path.dirname(self.path)})
        self.assertTrue(r["have"], r["message"])
        self.assertEqual(r["path"], self.path)

    def test_nccl_home(self):
        with tempfile.TemporaryDirectory() as home:
            os.makedirs(os.path.join(home, "lib"))
            os.symlink(self.path, os.path.join(home, "lib", "libnccl_ep.so"))
            r = run_fresh({"NCCL_HOME": home})
        self.assertTrue(r["have"], r["message"])
        self.assertEqual(r["path"], self.path)
        self.assertTrue(r["epflow"])
        self.assertEqual(r["version"], 100)

    def test_library_path(self):
        with tempfile.TemporaryDirectory() as d:
            os.symlink(self.path, os.path.join(d, "libnccl_ep.so"))
            ld = d + (":" + os.environ["LD_LIBRARY_PATH"] if os.environ.get("LD_LIBRARY_PATH") else "")
            r = run_fresh({"LD_LIBRARY_PATH": ld})
        self.assertTrue(r["have"], r["message"])
        self.assertEqual(r["path"], self.path)

    def test_nccl_is_loaded_first_with_rtld_global(self):
        """A stand-in libnccl.so.2 beside the EP library is loaded, and its symbols are visible
        process-wide (RTLD_GLOBAL), as the EP library needs to share the caller's NCCL."""
        cc = compiler()
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "stub.c")
            with open(src, "w") as f:
                f.write("int ncclCommInitRank(void){return 0;}\nint ncclGetVersion(int*v){*v=23007;return 0;}\n")
            subprocess.run([cc, "-shared", "-fPIC", src, "-o", os.path.join(d, "libnccl.so.2")], check=True)
            os.symlink(self.path, os.path.join(d, "libnccl_ep.so"))
            r = run_fresh({"EPFLOW_LIB": os.path.join(d, "libnccl_ep.so")})
            self.assertTrue(r["have"], r["message"])
            self.assertEqual(r["nccl"], os.path.realpath(os.path.join(d, "libnccl.so.2")))
            self.assertTrue(r["nccl_global"], "libnccl.so.2 was not loaded with RTLD_GLOBAL")
            r = run_fresh({"EPFLOW_LIB": os.path.join(d, "libnccl_ep.so"), "EPFLOW_NCCL_LIB": "/nonexistent/libnccl.so.2",
                           "LD_LIBRARY_PATH": None})
            self.assertTrue(r["have"], "a missing NCCL does not stop the EP library from loading")


class Constants(unittest.TestCase):
    def test_nccl_result_codes(self):
        # NCCL 2.30.7's nccl.h.
        expected = ["ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
                    "ncclInvalidArgument", "ncclInvalidUsage", "ncclRemoteError", "ncclInProgress",
                    "ncclTimeout", "ncclNumResults"]
        self.assertEqual([nccl_ep.result_name(i) for i in range(10)], expected)
        self.assertEqual(int(nccl_ep.ncclTimeout), 8)
        self.assertEqual(nccl_ep.result_name(42), "ncclResult(42)")

    def test_errors_carry_code_and_name(self):
        e = nccl_ep.NcclEpError("ncclEpDispatch", 5)
        self.assertIs(e.code, nccl_ep.ncclInvalidUsage)
        self.assertEqual((e.name, e.function), ("ncclInvalidUsage", "ncclEpDispatch"))
        self.assertIn("ncclEpDispatch failed: ncclInvalidUsage (5)", str(e))
        self.assertIsInstance(e, RuntimeError)
        self.assertEqual(nccl_ep.NcclEpError("f", 77).code, 77)

    def test_streams(self):
        class TorchLikeStream:
            cuda_stream = 0x1234

        self.assertIsNone(nccl_ep.stream_handle(None))
        self.assertEqual(nccl_ep.stream_handle(0x10), 0x10)
        self.assertEqual(nccl_ep.stream_handle(TorchLikeStream()), 0x1234)
        with self.assertRaises(TypeError):
            nccl_ep.stream_handle("stream")


if __name__ == "__main__":
    unittest.main()
