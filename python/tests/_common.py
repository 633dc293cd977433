"""Shared helpers of the unit tests: the library under test, the repository's header, the C
compiler, and loud skips."""

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import nccl_ep

#: The repository root (python/tests/ -> ../..).
REPO = Path(__file__).resolve().parents[2]
#: epflow's generated C header (override with NCCL_EP_HEADER).
HEADER = Path(os.environ.get("NCCL_EP_HEADER") or REPO / "crates" / "nccl-ep-abi" / "include" / "nccl_ep.h")


def skip_loudly(reason):
    """Prints ``SKIPPED: reason`` on stderr (so a CI log shows it) and skips the test."""
    sys.stderr.write("\nSKIPPED: %s\n" % reason)
    raise unittest.SkipTest(reason)


def compiler():
    """The C compiler (``$CC`` or ``cc``), or a loud skip."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        skip_loudly("no C compiler (%s) on this machine: the header comparison did not run" % cc)
    return cc


def compile_and_run(source, extra_flags=(), header_dir=None, expect_ok=True):
    """Compiles ``source`` (C11) with the header's directory on the include path and runs it;
    returns its stdout. With ``expect_ok=False`` returns ``None`` when it does not compile."""
    cc = compiler()
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "probe.c")
        exe = os.path.join(d, "probe")
        with open(src, "w") as f:
            f.write(source)
        inc = str(header_dir or HEADER.parent)
        r = subprocess.run([cc, "-std=c11", "-Wall", "-I", inc, src, "-o", exe, *extra_flags], capture_output=True, text=True)
        if r.returncode != 0:
            if not expect_ok:
                return None
            raise AssertionError("compiling the probe failed:\n%s\n%s" % (r.stderr, source))
        out = subprocess.run([exe], capture_output=True, text=True, check=True)
        return out.stdout


def library():
    """An :class:`nccl_ep.NCCLLibrary` of ``EPFLOW_LIB``, or a loud skip when it is not set or
    does not load (a failure instead with ``NCCL_EP_REQUIRE_LIBRARY=1``, as CI runs)."""
    required = os.environ.get("NCCL_EP_REQUIRE_LIBRARY") == "1"
    why = None
    if not os.environ.get("EPFLOW_LIB"):
        why = "EPFLOW_LIB is not set: build epflow's library (cargo build -p epflow-nccl-ep-abi) and point it there"
    else:
        try:
            return nccl_ep.NCCLLibrary()
        except nccl_ep.LibraryNotFoundError as e:
            why = str(e)
    if required:
        raise AssertionError("NCCL_EP_REQUIRE_LIBRARY=1: " + why)
    skip_loudly(why)


def gpu_present():
    """Whether a CUDA driver with at least one device is present (then calls that would reach
    a fake communicator must not run)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    if cuda.cuInit(0) != 0:
        return False
    n = ctypes.c_int(0)
    return cuda.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0
