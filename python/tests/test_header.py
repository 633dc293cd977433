"""The ctypes structs and constants against C: every v1 struct's sizeof and field offsets, the
enums and macros, compiled with ``cc`` against epflow's ``nccl_ep.h``; the v2 structs against the
sizes and offsets of NVIDIA nccl-extensions' header (API version 2) and issue 66."""

import ctypes
import unittest

import nccl_ep
from nccl_ep import field_offsets

from _common import HEADER, compile_and_run, skip_loudly

# API version 2 (NVIDIA/nccl-extensions nccl_ep/include/nccl_ep.h): sizeof and the offsets of
# the appended fields (the V1 part is unchanged: append-only), as issue 66 lists the sizes.
V2_EXPECTED = {
    "ncclEpGroupConfig_t": (112, {"zero_copy": 96, "overflow_policy": 100, "num_topk": 104, "padding_v2": 108}),
    "ncclEpLayoutInfo_t": (48, {"recv_topk_idx_kind": 40, "padding_v2": 44}),
    "ncclEpCombineInputs_t": (32, {"scales": 24}),
    "ncclEpDispatchConfig_t": (24, {"quant_recipe": 20}),
    "ncclEpCombineConfig_t": (20, {"quant_recipe": 16}),
}
# NVIDIA/nccl's dev branch (2.31): the v1 group config plus zero_copy, 104 bytes (issue 66).
DEV_GROUP_CONFIG = (104, {"zero_copy": 96})

# The v1 enumerators and macros the C probe prints (name -> Python value).
V1_CONSTANTS = [
    "NCCL_EP_MAGIC",
    "NCCL_EP_TENSOR_MAGIC",
    "NCCL_EP_AUTO",
    "NCCL_EP_API_VERSION",
    "NCCL_EP_VERSION_CODE",
    "NCCL_EP_MAJOR",
    "NCCL_EP_MINOR",
    "NCCL_EP_PATCH",
] + [m for e in (nccl_ep.ncclEpAlgorithm_t, nccl_ep.ncclEpLayout_t, nccl_ep.ncclEpPassDir_t) for m in e.__members__]
# In the header's fallback ncclResult_t (ncclTimeout is probed apart: the 0.1.0 fallback lacks it).
RESULTS = ["ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
           "ncclInvalidArgument", "ncclInvalidUsage", "ncclRemoteError", "ncclInProgress"]
DATATYPES = [n for n in nccl_ep.ncclDataType_t.__members__ if n != "ncclFloat4x2"]

INITS = {
    "ncclEpGroupConfig_t": "NCCL_EP_GROUP_CONFIG_INIT",
    "ncclEpLayoutInfo_t": "NCCL_EP_LAYOUT_INFO_INIT",
    "ncclEpDispatchInputs_t": "NCCL_EP_DISPATCH_INPUTS_INIT",
    "ncclEpDispatchOutputs_t": "NCCL_EP_DISPATCH_OUTPUTS_INIT",
    "ncclEpCombineInputs_t": "NCCL_EP_COMBINE_INPUTS_INIT",
    "ncclEpCombineOutputs_t": "NCCL_EP_COMBINE_OUTPUTS_INIT",
    "ncclEpHandleConfig_t": "NCCL_EP_HANDLE_CONFIG_INIT",
    "ncclEpDispatchConfig_t": "NCCL_EP_DISPATCH_CONFIG_INIT",
    "ncclEpCombineConfig_t": "NCCL_EP_COMBINE_CONFIG_INIT",
    "ncclEpCompleteConfig_t": "NCCL_EP_COMPLETE_CONFIG_INIT",
    "ncclEpTensorAllocConfig_t": "NCCL_EP_TENSOR_ALLOC_CONFIG_INIT",
    "ncclEpTensor_t": "NCCL_EP_TENSOR_INIT",
}


def _probe_source():
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "nccl_ep.h"', "int main(void) {"]
    for cname, cls in nccl_ep.STRUCTS_V1.items():
        lines.append('    printf("sizeof %s %%zu\\n", sizeof(%s));' % (cname, cname))
        for field in field_offsets(cls):
            lines.append('    printf("offsetof %s.%s %%zu\\n", offsetof(%s, %s));' % (cname, field, cname, field))
    for name in V1_CONSTANTS + RESULTS + DATATYPES:
        lines.append('    printf("const %s %%lld\\n", (long long)(%s));' % (name, name))
    for cname, macro in INITS.items():
        lines.append("    { %s v = %s;" % (cname, macro))
        lines.append('      printf("init %s.size %%u\\n", v.size);' % cname)
        lines.append('      printf("init %s.magic %%u\\n", v.magic); }' % cname)
    lines.append('    { ncclEpGroupConfig_t v = NCCL_EP_GROUP_CONFIG_INIT; printf("init ncclEpGroupConfig_t.version %u\\n", v.version); }')
    lines += ["    return 0;", "}"]
    return "\n".join(lines) + "\n"


class HeaderV1(unittest.TestCase):
    """Compiles a probe against epflow's header and compares every number with ctypes."""

    @classmethod
    def setUpClass(cls):
        if not HEADER.exists():
            skip_loudly("no header at %s (set NCCL_EP_HEADER)" % HEADER)
        cls.c = {}
        for line in compile_and_run(_probe_source()).splitlines():
            kind, name, value = line.split()
            cls.c[(kind, name)] = int(value)

    def test_every_v1_struct_size_and_offset(self):
        self.assertEqual(len(nccl_ep.STRUCTS_V1), 13, "NCCL EP 0.1.0 has 13 structs")
        for cname, cls in nccl_ep.STRUCTS_V1.items():
            with self.subTest(struct=cname):
                self.assertEqual(ctypes.sizeof(cls), self.c[("sizeof", cname)], "sizeof(%s)" % cname)
                for field, off in field_offsets(cls).items():
                    self.assertEqual(off, self.c[("offsetof", "%s.%s" % (cname, field))], "%s.%s" % (cname, field))

    def test_constants_and_enums(self):
        for name in V1_CONSTANTS + RESULTS + DATATYPES:
            with self.subTest(name=name):
                self.assertEqual(int(getattr(nccl_ep, name)), self.c[("const", name)], name)

    def test_constructors_fill_size_magic_version_as_the_init_macros(self):
        for cname, cls in nccl_ep.STRUCTS_V1.items():
            if cname not in INITS:
                continue
            with self.subTest(struct=cname):
                v = cls()
                self.assertEqual(v.size, self.c[("init", cname + ".size")])
                self.assertEqual(v.magic, self.c[("init", cname + ".magic")])
        self.assertEqual(nccl_ep.ncclEpGroupConfig_t().version, self.c[("init", "ncclEpGroupConfig_t.version")])

    def test_ncclTimeout_when_the_header_declares_it(self):
        out = compile_and_run(
            '#include <stdio.h>\n#include "nccl_ep.h"\nint main(void){printf("%d %d\\n",(int)ncclTimeout,(int)ncclNumResults);return 0;}\n',
            expect_ok=False,
        )
        if out is None:
            skip_loudly("%s's fallback ncclResult_t has no ncclTimeout (issue 66 item 1): compared with NCCL 2.30.7 only" % HEADER.name)
        timeout, num = map(int, out.split())
        self.assertEqual(timeout, nccl_ep.ncclTimeout)
        self.assertEqual(num, nccl_ep.ncclNumResults)


class StructsV2(unittest.TestCase):
    """v2 and the 2.31 dev-branch group config against NVIDIA's numbers (no v2 header here)."""

    def test_v2_sizes_and_appended_offsets(self):
        for cname, (size, offsets) in V2_EXPECTED.items():
            cls = nccl_ep.STRUCTS_V2[cname]
            with self.subTest(struct=cname):
                self.assertEqual(ctypes.sizeof(cls), size)
                got = field_offsets(cls)
                for field, off in offsets.items():
                    self.assertEqual(got[field], off, "%s.%s" % (cname, field))
                v1 = nccl_ep.STRUCTS_V1[cname]
                self.assertTrue(issubclass(cls, v1), "append-only: the v2 struct extends the v1 one")
                for field, off in field_offsets(v1).items():
                    self.assertEqual(got[field], off, "v1 field %s moved" % field)

    def test_unchanged_structs_are_the_v1_classes(self):
        for cname in nccl_ep.STRUCTS_V1:
            if cname not in V2_EXPECTED:
                self.assertIs(nccl_ep.STRUCTS_V2[cname], nccl_ep.STRUCTS_V1[cname])

    def test_dev_branch_group_config(self):
        size, offsets = DEV_GROUP_CONFIG
        self.assertEqual(ctypes.sizeof(nccl_ep.ncclEpGroupConfig_dev_t), size)
        self.assertEqual(field_offsets(nccl_ep.ncclEpGroupConfig_dev_t)["zero_copy"], offsets["zero_copy"])
        self.assertEqual(nccl_ep.ncclEpGroupConfig_dev_t().version, 1)

    def test_v2_constructors(self):
        g = nccl_ep.v2.ncclEpGroupConfig_t(num_topk=8, overflow_policy=nccl_ep.NCCL_EP_OVERFLOW_DROP)
        self.assertEqual((g.size, g.magic, g.version, g.num_topk, g.overflow_policy), (112, nccl_ep.NCCL_EP_MAGIC, 2, 8, 2))
        for cname, (size, _) in V2_EXPECTED.items():
            v = getattr(nccl_ep.v2, cname)()
            self.assertEqual((v.size, v.magic), (size, nccl_ep.NCCL_EP_MAGIC), cname)
        self.assertEqual(nccl_ep.v2.NCCL_EP_API_VERSION, 2)
        self.assertEqual(nccl_ep.NCCL_EP_API_VERSION, 1)

    def test_v2_enums(self):
        # nccl-extensions' ep_enums.h / nccl_ep.h.
        self.assertEqual([int(nccl_ep.NCCL_EP_OVERFLOW_AUTO), int(nccl_ep.NCCL_EP_OVERFLOW_TRAP), int(nccl_ep.NCCL_EP_OVERFLOW_DROP)], [0, 1, 2])
        self.assertEqual([int(nccl_ep.NCCL_EP_ZERO_COPY_AUTO), int(nccl_ep.NCCL_EP_ZERO_COPY_OFF), int(nccl_ep.NCCL_EP_ZERO_COPY_ON)], [0, 1, 2])
        self.assertEqual([int(nccl_ep.NCCL_EP_EXPERT_ID_AUTO), int(nccl_ep.NCCL_EP_EXPERT_ID_LOCAL), int(nccl_ep.NCCL_EP_EXPERT_ID_GLOBAL)], [0, 1, 2])
        self.assertEqual([int(nccl_ep.NCCL_EP_DISP_QUANT_NONE), int(nccl_ep.NCCL_EP_DISP_QUANT_FWD), int(nccl_ep.NCCL_EP_DISP_QUANT_DS_FP8E3M4)], [0, 1, 2])
        self.assertEqual([int(nccl_ep.NCCL_EP_COMB_QUANT_NONE), int(nccl_ep.NCCL_EP_COMB_QUANT_NVFP4)], [0, 1])
        self.assertEqual(int(nccl_ep.ncclFloat4x2), 12)


class StructBehaviour(unittest.TestCase):
    def test_unknown_field_is_refused(self):
        with self.assertRaises(AttributeError):
            nccl_ep.ncclEpGroupConfig_t(num_expert=8)
        cfg = nccl_ep.ncclEpGroupConfig_t()
        with self.assertRaises(AttributeError):
            cfg.max_tokens_per_rank = 4

    def test_tensor_descriptor(self):
        t = nccl_ep.ncclEpTensor_t(0x1000, nccl_ep.ncclBfloat16, (3, 5, 7))
        self.assertEqual((t.size, t.magic, t.ndim, t.datatype, t.data), (48, nccl_ep.NCCL_EP_TENSOR_MAGIC, 3, 9, 0x1000))
        self.assertEqual(t.shape, (3, 5, 7))
        self.assertEqual((t.numel, t.nbytes), (105, 210))
        self.assertEqual([t.sizes[i] for i in range(3)], [3, 5, 7])
        empty = nccl_ep.ncclEpTensor_t()
        self.assertEqual((empty.size, empty.magic, empty.ndim, empty.shape), (48, nccl_ep.NCCL_EP_TENSOR_MAGIC, 0, ()))
        with self.assertRaises(ValueError):
            t.set_shape((2, -1))

    def test_tensor_fields_store_pointers(self):
        t = nccl_ep.ncclEpTensor_t(0x2000, nccl_ep.ncclInt32, (4,))
        info = nccl_ep.ncclEpLayoutInfo_t(expert_counters=t)
        self.assertEqual(ctypes.addressof(info.expert_counters.contents), ctypes.addressof(t))
        self.assertFalse(info.src_rank_counters)
        with self.assertRaises(TypeError):
            info.recv_total_counter = nccl_ep.ncclEpCompleteConfig_t()
        info.recv_total_counter = None
        self.assertFalse(info.recv_total_counter)
        self.assertEqual(info.fields()["expert_counters"], ctypes.addressof(t))


if __name__ == "__main__":
    unittest.main()
