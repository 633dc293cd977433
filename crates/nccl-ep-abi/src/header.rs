//! The C headers of this library, generated from the Rust definitions: `include/nccl_ep.h`
//! (NCCL EP 0.1.0, API version 1, the default) and `include/nccl_ep_v2.h` (NCCL EP's API
//! version 2, as NVIDIA/nccl-extensions `nccl_ep/include/nccl_ep.h` lays it out). The
//! constants come from `nccl-ep-sys` and `v2.rs`, each struct's fields are listed once
//! here beside the Rust type they mirror, and each header carries static assertions of every
//! struct's size and every field's offset as Rust lays them out, so a C or C++ compiler checks
//! the two agree (`_Static_assert` in C11, `static_assert` in C++, through one macro). Both
//! compile as C11 and as C++17 (the test `tests/c_api.rs` builds and runs programs against
//! each); in C++ the `_INIT` macros are lambdas instead of C's compound literals, the same in
//! every context. The test `header_is_current` fails when a committed file differs
//! (`EPFLOW_BLESS=1` rewrites them).
//!
//! Choosing the API version: `#include "nccl_ep.h"` declares API v1; defining
//! `NCCL_EP_API_VERSION` to 2 before including it (`-DNCCL_EP_API_VERSION=2`), or including
//! `nccl_ep_v2.h`, declares API v2: the v2 struct layouts, `NCCL_EP_API_VERSION 2` (which
//! `NCCL_EP_GROUP_CONFIG_INIT` writes into `version`), the enums v2 added (zero-copy mode,
//! overflow policy, expert id kind, dispatch and combine quantization recipes), `ncclFloat4x2`,
//! and NVIDIA's `NCCL_EP_<STRUCT>_SIZE`, `_V<n>_SIZE`, `_V<n>_LAST_FIELD`, `_CURRENT_VERSION`,
//! `NCCL_EP_FIELD_END` and `NCCL_EP_HAS_FIELD` macros. One translation unit sees one version:
//! including the v2 header after the v1 one is a `#error`.
//!
//! The headers declare the same names as NVIDIA's; they include `<nccl.h>` and
//! `<cuda_runtime.h>` when they exist, and otherwise declare the few NCCL and CUDA types they
//! use themselves, so C code compiles against them on a machine without CUDA.

use std::fmt::Write;
use std::mem::{offset_of, size_of};

use nccl_ep_sys as ep;

use crate::v2;

/// One field: its C type, name, array suffix (`""` or `"[4]"`), and byte offset in the Rust
/// struct.
struct Field {
    c_type: &'static str,
    name: &'static str,
    dims: &'static str,
    offset: usize,
}

/// One struct: C name, Rust size, fields, whether `size`/`magic` lead it, and its `_INIT`
/// macro's name.
struct Struct {
    name: &'static str,
    size: usize,
    fields: Vec<Field>,
    init: Option<&'static str>,
}

macro_rules! fields {
    ($t:ty: $($c:literal $f:ident),* $(,)?) => {
        vec![$(Field { c_type: $c, name: stringify!($f), dims: "", offset: offset_of!($t, $f) }),*]
    };
}

fn structs() -> Vec<Struct> {
    vec![
        Struct {
            name: "ncclEpTensor_t",
            size: size_of::<ep::NcclEpTensor>(),
            fields: fields!(ep::NcclEpTensor: "unsigned int" size, "unsigned int" magic, "unsigned int" ndim,
                "ncclDataType_t" datatype, "void*" data, "ncclWindow_t" win_hdl, "uint64_t" win_offset, "size_t*" sizes),
            init: None,
        },
        Struct {
            name: "ncclEpTensorAllocConfig_t",
            size: size_of::<ep::NcclEpTensorAllocConfig>(),
            fields: fields!(ep::NcclEpTensorAllocConfig: "unsigned int" size, "unsigned int" magic),
            init: Some("NCCL_EP_TENSOR_ALLOC_CONFIG_INIT"),
        },
        Struct {
            name: "ncclEpAllocConfig_t",
            size: size_of::<ep::NcclEpAllocConfig>(),
            fields: fields!(ep::NcclEpAllocConfig: "ncclEpAllocFn_t" alloc_fn, "ncclEpFreeFn_t" free_fn, "void*" context),
            init: None,
        },
        Struct {
            name: "ncclEpGroupConfig_t",
            size: size_of::<ep::NcclEpGroupConfig>(),
            fields: fields!(ep::NcclEpGroupConfig: "unsigned int" size, "unsigned int" magic, "unsigned int" version,
                "ncclEpAlgorithm_t" algorithm, "unsigned int" num_experts, "unsigned int" max_dispatch_tokens_per_rank,
                "unsigned int" max_recv_tokens_per_rank, "unsigned int" max_token_bytes,
                "unsigned long int" rdma_buffer_size, "unsigned int" num_qp_per_rank, "unsigned int" num_channels,
                "unsigned int" max_num_sms, "ncclEpAllocConfig_t" alloc, "unsigned int" enable_mask,
                "uint64_t" timeout_ns),
            init: Some("NCCL_EP_GROUP_CONFIG_INIT"),
        },
        Struct {
            name: "ncclEpLayoutInfo_t",
            size: size_of::<ep::NcclEpLayoutInfo>(),
            fields: fields!(ep::NcclEpLayoutInfo: "unsigned int" size, "unsigned int" magic,
                "ncclEpTensor_t*" expert_counters, "ncclEpTensor_t*" src_rank_counters,
                "ncclEpTensor_t*" expert_offsets, "ncclEpTensor_t*" recv_total_counter),
            init: Some("NCCL_EP_LAYOUT_INFO_INIT"),
        },
        Struct {
            name: "ncclEpDispatchInputs_t",
            size: size_of::<ep::NcclEpDispatchInputs>(),
            fields: fields!(ep::NcclEpDispatchInputs: "unsigned int" size, "unsigned int" magic,
                "ncclEpTensor_t*" tokens, "ncclEpTensor_t*" topk_weights, "ncclEpTensor_t*" scales),
            init: Some("NCCL_EP_DISPATCH_INPUTS_INIT"),
        },
        Struct {
            name: "ncclEpDispatchOutputs_t",
            size: size_of::<ep::NcclEpDispatchOutputs>(),
            fields: fields!(ep::NcclEpDispatchOutputs: "unsigned int" size, "unsigned int" magic,
                "ncclEpTensor_t*" tokens, "ncclEpTensor_t*" topk_weights, "ncclEpTensor_t*" scales,
                "ncclEpTensor_t*" topk_idx),
            init: Some("NCCL_EP_DISPATCH_OUTPUTS_INIT"),
        },
        Struct {
            name: "ncclEpCombineInputs_t",
            size: size_of::<ep::NcclEpCombineInputs>(),
            fields: fields!(ep::NcclEpCombineInputs: "unsigned int" size, "unsigned int" magic,
                "ncclEpTensor_t*" tokens, "ncclEpTensor_t*" topk_weights),
            init: Some("NCCL_EP_COMBINE_INPUTS_INIT"),
        },
        Struct {
            name: "ncclEpCombineOutputs_t",
            size: size_of::<ep::NcclEpCombineOutputs>(),
            fields: fields!(ep::NcclEpCombineOutputs: "unsigned int" size, "unsigned int" magic,
                "ncclEpTensor_t*" tokens, "ncclEpTensor_t*" topk_weights),
            init: Some("NCCL_EP_COMBINE_OUTPUTS_INIT"),
        },
        Struct {
            name: "ncclEpHandleConfig_t",
            size: size_of::<ep::NcclEpHandleConfig>(),
            fields: fields!(ep::NcclEpHandleConfig: "unsigned int" size, "unsigned int" magic,
                "size_t" dispatch_output_per_expert_alignment),
            init: Some("NCCL_EP_HANDLE_CONFIG_INIT"),
        },
        Struct {
            name: "ncclEpDispatchConfig_t",
            size: size_of::<ep::NcclEpDispatchConfig>(),
            fields: fields!(ep::NcclEpDispatchConfig: "unsigned int" size, "unsigned int" magic,
                "unsigned int" send_only, "unsigned int" round_scales, "ncclEpPassDir_t" pass_direction),
            init: Some("NCCL_EP_DISPATCH_CONFIG_INIT"),
        },
        Struct {
            name: "ncclEpCombineConfig_t",
            size: size_of::<ep::NcclEpCombineConfig>(),
            fields: fields!(ep::NcclEpCombineConfig: "unsigned int" size, "unsigned int" magic,
                "unsigned int" send_only, "ncclEpPassDir_t" pass_direction),
            init: Some("NCCL_EP_COMBINE_CONFIG_INIT"),
        },
        Struct {
            name: "ncclEpCompleteConfig_t",
            size: size_of::<ep::NcclEpCompleteConfig>(),
            fields: fields!(ep::NcclEpCompleteConfig: "unsigned int" size, "unsigned int" magic),
            init: Some("NCCL_EP_COMPLETE_CONFIG_INIT"),
        },
    ]
}

/// API v2's structs: API v1's, with the fields v2 appended to five of them (`v2.rs`:
/// each v2 struct leads with the v1 struct, at offset 0).
fn structs_v2() -> Vec<Struct> {
    macro_rules! padding {
        ($t:ty) => {
            Field { c_type: "unsigned char", name: "padding_v2", dims: "[4]", offset: offset_of!($t, padding_v2) }
        };
    }
    structs()
        .into_iter()
        .map(|mut s| {
            let (size, grown) = match s.name {
                "ncclEpGroupConfig_t" => {
                    let mut f = fields!(v2::GroupConfig: "ncclEpZeroCopyMode_t" zero_copy,
                        "ncclEpOverflowPolicy_t" overflow_policy, "unsigned int" num_topk);
                    f.push(padding!(v2::GroupConfig));
                    (size_of::<v2::GroupConfig>(), f)
                }
                "ncclEpLayoutInfo_t" => {
                    let mut f = fields!(v2::LayoutInfo: "ncclEpExpertIdKind_t" recv_topk_idx_kind);
                    f.push(padding!(v2::LayoutInfo));
                    (size_of::<v2::LayoutInfo>(), f)
                }
                "ncclEpCombineInputs_t" => {
                    (size_of::<v2::CombineInputs>(), fields!(v2::CombineInputs: "ncclEpTensor_t*" scales))
                }
                "ncclEpDispatchConfig_t" => {
                    (size_of::<v2::DispatchConfig>(), fields!(v2::DispatchConfig: "ncclEpDispQuant_t" quant_recipe))
                }
                "ncclEpCombineConfig_t" => {
                    (size_of::<v2::CombineConfig>(), fields!(v2::CombineConfig: "ncclEpCombQuant_t" quant_recipe))
                }
                _ => return s,
            };
            s.size = size;
            s.fields.extend(grown);
            s
        })
        .collect()
}

// The v1 fields of every v2 struct sit where a v1 struct has them.
const _: () = assert!(
    offset_of!(v2::GroupConfig, v1) == 0
        && offset_of!(v2::LayoutInfo, v1) == 0
        && offset_of!(v2::CombineInputs, v1) == 0
        && offset_of!(v2::DispatchConfig, v1) == 0
        && offset_of!(v2::CombineConfig, v1) == 0
);

/// The exported functions, as declared in the header (name, then the parameter list).
pub const FUNCTIONS: &[(&str, &str)] = &[
    ("ncclEpGetVersion", "int* version"),
    (
        "ncclEpTensorAlloc",
        "ncclEpTensor_t** tensor, unsigned int ndim, ncclDataType_t datatype, const size_t* sizes, const ncclEpTensorAllocConfig_t* config",
    ),
    ("ncclEpTensorDestroy", "ncclEpTensor_t* tensor"),
    ("ncclEpCreateGroup", "ncclEpGroup_t* ep_group, ncclComm_t comm, const ncclEpGroupConfig_t* config"),
    ("ncclEpGroupDestroy", "ncclEpGroup_t ep_group"),
    (
        "ncclEpHandleMemSize",
        "ncclEpGroup_t ep_group, ncclEpLayout_t layout, const ncclEpHandleConfig_t* config, size_t* size_out, int num_topk",
    ),
    (
        "ncclEpInitHandle",
        "ncclEpHandle_t* handle, ncclEpGroup_t ep_group, ncclEpLayout_t layout, const ncclEpHandleConfig_t* config, int num_topk, const ncclEpTensor_t* handle_mem",
    ),
    (
        "ncclEpUpdateHandle",
        "ncclEpHandle_t handle, const ncclEpTensor_t* topk_idx, const ncclEpLayoutInfo_t* layout_info, cudaStream_t stream",
    ),
    (
        "ncclEpCreateHandle",
        "ncclEpHandle_t* handle, ncclEpGroup_t ep_group, ncclEpLayout_t layout, const ncclEpTensor_t* topk_idx, const ncclEpLayoutInfo_t* layout_info, const ncclEpHandleConfig_t* config, cudaStream_t stream",
    ),
    ("ncclEpHandleDestroy", "ncclEpHandle_t handle"),
    (
        "ncclEpDispatch",
        "ncclEpHandle_t handle, const ncclEpDispatchInputs_t* inputs, const ncclEpDispatchOutputs_t* outputs, const ncclEpLayoutInfo_t* layout_info, const ncclEpDispatchConfig_t* config, cudaStream_t stream",
    ),
    (
        "ncclEpCombine",
        "ncclEpHandle_t handle, const ncclEpCombineInputs_t* inputs, const ncclEpCombineOutputs_t* outputs, const ncclEpCombineConfig_t* config, cudaStream_t stream",
    ),
    ("ncclEpComplete", "ncclEpHandle_t handle, const ncclEpCompleteConfig_t* config, cudaStream_t stream"),
    ("ncclEpMaskQuery", "ncclEpGroup_t ep_group, int* mask_status, cudaStream_t stream"),
    ("ncclEpMaskUpdate", "ncclEpGroup_t ep_group, const int* mask, cudaStream_t stream"),
    ("ncclEpMaskClean", "ncclEpGroup_t ep_group, cudaStream_t stream"),
    ("ncclEpGetAsyncError", "ncclEpGroup_t ep_group, int* error_out"),
    ("ncclEpErrorClear", "ncclEpGroup_t ep_group"),
];

const BANNER_V1: &str = r#"/*
 * nccl_ep.h of epflow's libnccl_ep.so: NCCL EP 0.1.0's C API (API version 1), the same names
 * and layouts as NVIDIA's header. Define NCCL_EP_API_VERSION to 2 before including it for API
 * version 2 (nccl_ep_v2.h). GENERATED by crates/nccl-ep-abi/src/header.rs from the Rust
 * definitions; do not edit (run `EPFLOW_BLESS=1 cargo test -p epflow-nccl-ep-abi header`).
 */
#pragma once

#if defined(NCCL_EP_API_VERSION) && NCCL_EP_API_VERSION == 2
/* API version 2 asked for: its header. */
#include "nccl_ep_v2.h"
#elif defined(NCCL_EP_API_VERSION) && NCCL_EP_API_VERSION != 1
#error "nccl_ep.h: NCCL_EP_API_VERSION must be 1 (the default) or 2"
#else
"#;

const BANNER_V2: &str = r#"/*
 * nccl_ep_v2.h of epflow's libnccl_ep.so: NCCL EP's C API version 2 (NVIDIA/nccl-extensions
 * nccl_ep/include/nccl_ep.h), the same names and layouts as NVIDIA's header; also what
 * nccl_ep.h declares when NCCL_EP_API_VERSION is 2 before it. GENERATED by
 * crates/nccl-ep-abi/src/header.rs from the Rust definitions; do not edit (run
 * `EPFLOW_BLESS=1 cargo test -p epflow-nccl-ep-abi header`).
 */
#pragma once

#if defined(NCCL_EP_API_VERSION) && NCCL_EP_API_VERSION != 2
#error "nccl_ep_v2.h: NCCL_EP_API_VERSION is not 2 (nccl_ep.h of API version 1 included first?)"
#endif
"#;

const COMMON: &str = r#"
#include <stddef.h>
#include <stdint.h>

#if defined(__has_include)
#if __has_include(<nccl.h>)
#include <nccl.h>
#define EPFLOW_NCCL_EP_HAVE_NCCL_H 1
#endif
#if __has_include(<cuda_runtime.h>)
#include <cuda_runtime.h>
#define EPFLOW_NCCL_EP_HAVE_CUDA_RUNTIME_H 1
#endif
#endif

#ifndef EPFLOW_NCCL_EP_HAVE_NCCL_H
/* The NCCL types this header uses, as nccl.h declares them (no NCCL headers here). */
typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
    ncclTimeout = 8,
    ncclNumResults = 9
} ncclResult_t;
typedef struct ncclComm* ncclComm_t;
typedef struct ncclWindow_vidmem* ncclWindow_t;
typedef enum {
    ncclInt8 = 0, ncclChar = 0, ncclUint8 = 1, ncclInt32 = 2, ncclInt = 2, ncclUint32 = 3, ncclInt64 = 4,
    ncclUint64 = 5, ncclFloat16 = 6, ncclHalf = 6, ncclFloat32 = 7, ncclFloat = 7, ncclFloat64 = 8,
    ncclDouble = 8, ncclBfloat16 = 9, ncclFloat8e4m3 = 10, ncclFloat8e5m2 = 11
} ncclDataType_t;
#endif

#ifndef EPFLOW_NCCL_EP_HAVE_CUDA_RUNTIME_H
/* The CUDA types this header uses (no CUDA headers here). */
typedef struct CUstream_st* cudaStream_t;
typedef int cudaError_t;
#endif

/* Static assertions in C11 and C++ alike. */
#if defined(__cplusplus)
#define EPFLOW_NCCL_EP_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#elif defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
#define EPFLOW_NCCL_EP_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#else
#define EPFLOW_NCCL_EP_STATIC_ASSERT(cond, msg)
#endif

/* A struct headed by size and magic, zeroed, with both set: a compound literal in C, a lambda
 * in C++ (which has no compound literals), each usable in a declaration, an assignment or an
 * expression. */
#if defined(__cplusplus)
#define EPFLOW_NCCL_EP_STRUCT_INIT(type_, magic_, extra_) \
    ([]() -> type_ { type_ s_{}; s_.size = (unsigned int)sizeof(type_); s_.magic = (magic_); extra_ return s_; }())
#define EPFLOW_NCCL_EP_SET_VERSION s_.version = NCCL_EP_API_VERSION;
#else
#define EPFLOW_NCCL_EP_STRUCT_INIT(type_, magic_, extra_) \
    ((type_){ .size = (unsigned int)sizeof(type_), .magic = (magic_) extra_ })
#define EPFLOW_NCCL_EP_SET_VERSION , .version = NCCL_EP_API_VERSION
#endif

#ifdef __cplusplus
extern "C" {
#endif
"#;

/// The macros API v2 added beside its structs (NVIDIA's names).
const V2_MACROS: &str = r#"
/* The end of a field (its offset plus its size), and whether a caller's struct (its size)
 * covers a field. */
#define NCCL_EP_FIELD_END(type_, field_) ((unsigned int)(offsetof(type_, field_) + sizeof(((type_*)0)->field_)))
#define NCCL_EP_HAS_FIELD(ptr_, type_, field_) ((ptr_) != NULL && (ptr_)->size >= NCCL_EP_FIELD_END(type_, field_))
#define NCCL_EP_STATIC_ASSERT(cond_, msg_) EPFLOW_NCCL_EP_STATIC_ASSERT(cond_, msg_)
#define NCCL_EP_STRUCT_INIT(type_, magic_) EPFLOW_NCCL_EP_STRUCT_INIT(type_, magic_, )
"#;

/// `include/nccl_ep.h`: API version 1 (NCCL EP 0.1.0), or the v2 header when
/// `NCCL_EP_API_VERSION` is 2 before it.
pub fn header() -> String {
    let mut h = String::from(BANNER_V1);
    h.push_str(COMMON);
    body(&mut h, ep::NCCL_EP_API_VERSION, &structs());
    h.push_str("\n#endif /* NCCL_EP_API_VERSION */\n");
    h
}

/// `include/nccl_ep_v2.h`: API version 2 (NVIDIA/nccl-extensions).
pub fn header_v2() -> String {
    let mut h = String::from(BANNER_V2);
    h.push_str(COMMON);
    body(&mut h, v2::API_VERSION, &structs_v2());
    h
}

/// One `typedef enum`.
fn enumeration(h: &mut String, name: &str, values: &[(&str, std::ffi::c_int)]) {
    let list: Vec<String> = values.iter().map(|(v, n)| format!("    {v} = {n}")).collect();
    let _ = writeln!(h, "\ntypedef enum {{\n{}\n}} {name};", list.join(",\n"));
}

/// `ncclEpGroupConfig_t` -> `NCCL_EP_GROUP_CONFIG`: the prefix of API v2's per-struct macros.
fn macro_base(name: &str) -> String {
    let mut base = String::from("NCCL_EP");
    for c in name.trim_start_matches("ncclEp").trim_end_matches("_t").chars() {
        if c.is_ascii_uppercase() {
            base.push('_');
        }
        base.push(c.to_ascii_uppercase());
    }
    base
}

/// API v2's size and version macros of one struct headed by `size` and `magic`, checked.
fn v2_struct_macros(h: &mut String, s: &Struct, v1: &Struct) {
    let base = macro_base(s.name);
    let _ = writeln!(h, "#define {base}_SIZE ((unsigned int)sizeof({}))", s.name);
    let mut versions = vec![(1, v1.size, v1.fields.last().expect("fields").name)];
    if s.size != v1.size {
        versions.push((2, s.size, s.fields.last().expect("fields").name));
    }
    for (v, size, last) in &versions {
        let _ = writeln!(h, "#define {base}_V{v}_LAST_FIELD {last}");
        let _ = writeln!(h, "#define {base}_V{v}_SIZE {size}u");
    }
    let _ = writeln!(h, "#define {base}_CURRENT_VERSION {}", versions.len());
    for (v, _, _) in &versions {
        let _ = writeln!(
            h,
            "EPFLOW_NCCL_EP_STATIC_ASSERT(NCCL_EP_FIELD_END({}, {base}_V{v}_LAST_FIELD) == {base}_V{v}_SIZE, \"{} V{v} boundary\");",
            s.name, s.name
        );
    }
}

/// Everything after the common prologue: constants, enums, structs, functions.
fn body(h: &mut String, api_version: std::ffi::c_uint, layouts: &[Struct]) {
    let code = ep::NCCL_EP_VERSION_CODE;
    let _ = writeln!(h, "\n#define NCCL_EP_MAJOR {}", code / 10000);
    let _ = writeln!(h, "#define NCCL_EP_MINOR {}", code % 10000 / 100);
    let _ = writeln!(h, "#define NCCL_EP_PATCH {}", code % 100);
    h.push_str("#define NCCL_EP_VERSION_CODE (NCCL_EP_MAJOR * 10000 + NCCL_EP_MINOR * 100 + NCCL_EP_PATCH)\n");
    let _ = writeln!(h, "#ifndef NCCL_EP_API_VERSION\n#define NCCL_EP_API_VERSION {api_version}\n#endif");
    let _ = writeln!(h, "#define NCCL_EP_MAGIC {:#X}u", ep::NCCL_EP_MAGIC);
    let _ = writeln!(h, "#define NCCL_EP_TENSOR_MAGIC {:#X}u", ep::NCCL_EP_TENSOR_MAGIC);
    let _ = writeln!(h, "#define NCCL_EP_AUTO {}", ep::NCCL_EP_AUTO);
    let v2 = api_version == v2::API_VERSION;
    if v2 {
        let _ = writeln!(
            h,
            "/* Two FP4 values per byte (newer nccl.h declare it). */\n#ifndef ncclFloat4x2\n#define ncclFloat4x2 ((ncclDataType_t){})\n#endif",
            v2::NCCL_FLOAT4X2
        );
        h.push_str(V2_MACROS);
    }
    enumeration(
        h,
        "ncclEpAlgorithm_t",
        &[
            ("NCCL_EP_ALGO_LOW_LATENCY", ep::NCCL_EP_ALGO_LOW_LATENCY),
            ("NCCL_EP_ALGO_HIGH_THROUGHPUT", ep::NCCL_EP_ALGO_HIGH_THROUGHPUT),
        ],
    );
    enumeration(
        h,
        "ncclEpLayout_t",
        &[
            ("NCCL_EP_LAYOUT_UNSET", ep::NCCL_EP_LAYOUT_UNSET),
            ("NCCL_EP_LAYOUT_EXPERT_MAJOR", ep::NCCL_EP_LAYOUT_EXPERT_MAJOR),
            ("NCCL_EP_LAYOUT_RANK_MAJOR", ep::NCCL_EP_LAYOUT_RANK_MAJOR),
            ("NCCL_EP_LAYOUT_FLAT", ep::NCCL_EP_LAYOUT_FLAT),
        ],
    );
    enumeration(
        h,
        "ncclEpPassDir_t",
        &[("NCCL_EP_FWD_PASS", ep::NCCL_EP_FWD_PASS), ("NCCL_EP_BWD_PASS", ep::NCCL_EP_BWD_PASS)],
    );
    if v2 {
        enumeration(
            h,
            "ncclEpOverflowPolicy_t",
            &[
                ("NCCL_EP_OVERFLOW_AUTO", v2::OVERFLOW_AUTO),
                ("NCCL_EP_OVERFLOW_TRAP", v2::OVERFLOW_TRAP),
                ("NCCL_EP_OVERFLOW_DROP", v2::OVERFLOW_DROP),
            ],
        );
        enumeration(
            h,
            "ncclEpZeroCopyMode_t",
            &[
                ("NCCL_EP_ZERO_COPY_AUTO", v2::ZERO_COPY_AUTO),
                ("NCCL_EP_ZERO_COPY_OFF", v2::ZERO_COPY_OFF),
                ("NCCL_EP_ZERO_COPY_ON", v2::ZERO_COPY_ON),
            ],
        );
        enumeration(
            h,
            "ncclEpExpertIdKind_t",
            &[
                ("NCCL_EP_EXPERT_ID_AUTO", v2::EXPERT_ID_AUTO),
                ("NCCL_EP_EXPERT_ID_LOCAL", v2::EXPERT_ID_LOCAL),
                ("NCCL_EP_EXPERT_ID_GLOBAL", v2::EXPERT_ID_GLOBAL),
            ],
        );
        enumeration(
            h,
            "ncclEpDispQuant_t",
            &[
                ("NCCL_EP_DISP_QUANT_NONE", v2::QUANT_NONE),
                ("NCCL_EP_DISP_QUANT_FWD", v2::DISP_QUANT_FWD),
                ("NCCL_EP_DISP_QUANT_DS_FP8E3M4", v2::DISP_QUANT_DS_FP8E3M4),
            ],
        );
        enumeration(
            h,
            "ncclEpCombQuant_t",
            &[("NCCL_EP_COMB_QUANT_NONE", v2::QUANT_NONE), ("NCCL_EP_COMB_QUANT_NVFP4", v2::COMB_QUANT_NVFP4)],
        );
    }
    h.push_str("\ntypedef cudaError_t (*ncclEpAllocFn_t)(void** ptr, size_t size, void* context);\n");
    h.push_str("typedef cudaError_t (*ncclEpFreeFn_t)(void* ptr, void* context);\n");
    h.push_str("typedef struct ncclEpGroup* ncclEpGroup_t;\ntypedef struct ncclEpHandle* ncclEpHandle_t;\n");
    let v1_structs = structs();
    for (s, v1) in layouts.iter().zip(&v1_structs) {
        let tag = if s.name == "ncclEpTensor_t" {
            "struct ncclEpTensor "
        } else if s.name == "ncclEpCompleteConfig_t" {
            "struct ncclEpCompleteConfig "
        } else {
            "struct "
        };
        let _ = writeln!(h, "\ntypedef {tag}{{");
        for f in &s.fields {
            let _ = writeln!(h, "    {} {}{};", f.c_type, f.name, f.dims);
        }
        let _ = writeln!(h, "}} {};", s.name);
        let _ = writeln!(h, "EPFLOW_NCCL_EP_STATIC_ASSERT(sizeof({}) == {}, \"{} size\");", s.name, s.size, s.name);
        for f in &s.fields {
            let _ = writeln!(
                h,
                "EPFLOW_NCCL_EP_STATIC_ASSERT(offsetof({}, {}) == {}, \"{}.{} offset\");",
                s.name, f.name, f.offset, s.name, f.name
            );
        }
        if v2 && s.fields[0].name == "size" {
            v2_struct_macros(h, s, v1);
        }
        if let Some(init) = s.init {
            let _ = writeln!(
                h,
                "#define {init} EPFLOW_NCCL_EP_STRUCT_INIT({}, NCCL_EP_MAGIC, {})",
                s.name,
                if s.name == "ncclEpGroupConfig_t" { "EPFLOW_NCCL_EP_SET_VERSION" } else { "" }
            );
        }
    }
    h.push_str("/* Designated initializers: C, or C++20. */\n");
    h.push_str("#define NCCL_EP_TENSOR_INIT_INLINE .size = (unsigned int)sizeof(ncclEpTensor_t), .magic = NCCL_EP_TENSOR_MAGIC\n");
    h.push_str("#define NCCL_EP_TENSOR_INIT EPFLOW_NCCL_EP_STRUCT_INIT(ncclEpTensor_t, NCCL_EP_TENSOR_MAGIC, )\n\n");
    for (name, params) in FUNCTIONS {
        let _ = writeln!(h, "ncclResult_t {name}({params});");
    }
    h.push_str("\n/* epflow's marker (not in NVIDIA's header): NCCL_EP_VERSION_CODE of the API implemented. */\n");
    let _ = writeln!(h, "extern const int {};", ep::EPFLOW_MARKER);
    h.push_str("\n#ifdef __cplusplus\n}\n#endif\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compares (or with `EPFLOW_BLESS` rewrites) one committed header.
    fn check_current(file: &str, want: &str) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("include").join(file);
        if std::env::var_os("EPFLOW_BLESS").is_some() {
            std::fs::write(&path, want).expect("write the header");
        }
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            have == want,
            "{} is not the generated header: run `EPFLOW_BLESS=1 cargo test -p epflow-nccl-ep-abi header`",
            path.display()
        );
    }

    #[test]
    fn header_is_current() {
        check_current("nccl_ep.h", &header());
        check_current("nccl_ep_v2.h", &header_v2());
    }

    #[test]
    fn every_struct_field_is_listed() {
        for s in structs().iter().chain(&structs_v2()) {
            let last = s.fields.last().expect("fields");
            assert!(last.offset < s.size, "{}", s.name);
            let mut offsets: Vec<usize> = s.fields.iter().map(|f| f.offset).collect();
            offsets.dedup();
            assert_eq!(offsets.len(), s.fields.len(), "{}: fields overlap", s.name);
        }
        assert_eq!(FUNCTIONS.len(), 18);
    }

    #[test]
    fn v2_layouts_are_nvidia_s() {
        // NVIDIA/nccl-extensions nccl_ep.h (API v2): struct sizes and the appended fields'
        // offsets.
        let v2 = structs_v2();
        let get = |name: &str| v2.iter().find(|s| s.name == name).expect(name);
        let tail = |name: &str| -> Vec<(&str, usize)> {
            let v1 = structs().into_iter().find(|s| s.name == name).expect(name).fields.len();
            get(name).fields[v1..].iter().map(|f| (f.name, f.offset)).collect()
        };
        assert_eq!(get("ncclEpGroupConfig_t").size, 112);
        assert_eq!(
            tail("ncclEpGroupConfig_t"),
            [("zero_copy", 96), ("overflow_policy", 100), ("num_topk", 104), ("padding_v2", 108)]
        );
        assert_eq!(get("ncclEpLayoutInfo_t").size, 48);
        assert_eq!(tail("ncclEpLayoutInfo_t"), [("recv_topk_idx_kind", 40), ("padding_v2", 44)]);
        assert_eq!(get("ncclEpCombineInputs_t").size, 32);
        assert_eq!(tail("ncclEpCombineInputs_t"), [("scales", 24)]);
        assert_eq!(get("ncclEpDispatchConfig_t").size, 24);
        assert_eq!(tail("ncclEpDispatchConfig_t"), [("quant_recipe", 20)]);
        assert_eq!(get("ncclEpCombineConfig_t").size, 20);
        assert_eq!(tail("ncclEpCombineConfig_t"), [("quant_recipe", 16)]);
        let unchanged: Vec<&str> =
            v2.iter().zip(structs()).filter(|(a, b)| a.size == b.size).map(|(a, _)| a.name).collect();
        assert_eq!(unchanged.len(), 8, "{unchanged:?}");
        assert_eq!(macro_base("ncclEpTensorAllocConfig_t"), "NCCL_EP_TENSOR_ALLOC_CONFIG");
        assert_eq!(macro_base("ncclEpTensor_t"), "NCCL_EP_TENSOR");
        let h = header_v2();
        for line in [
            "#define NCCL_EP_API_VERSION 2",
            "#define NCCL_EP_GROUP_CONFIG_V1_SIZE 96u",
            "#define NCCL_EP_GROUP_CONFIG_V2_SIZE 112u",
            "#define NCCL_EP_GROUP_CONFIG_V2_LAST_FIELD padding_v2",
            "#define NCCL_EP_COMBINE_CONFIG_CURRENT_VERSION 2",
            "#define NCCL_EP_HANDLE_CONFIG_CURRENT_VERSION 1",
            "    NCCL_EP_OVERFLOW_DROP = 2",
            "    NCCL_EP_EXPERT_ID_GLOBAL = 2",
            "    NCCL_EP_DISP_QUANT_DS_FP8E3M4 = 2",
            "    NCCL_EP_COMB_QUANT_NVFP4 = 1",
            "    unsigned char padding_v2[4];",
        ] {
            assert!(h.contains(line), "the v2 header lacks `{line}`");
        }
        assert!(!header().contains("NCCL_EP_OVERFLOW_DROP"));
    }
}
