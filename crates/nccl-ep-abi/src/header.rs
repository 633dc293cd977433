//! The C header of this library (`include/nccl_ep.h`), generated from the Rust definitions:
//! the constants come from `nccl-ep-sys`, each struct's fields are listed once here beside the
//! Rust type they mirror, and the header carries static assertions of every struct's size and
//! every field's offset as Rust lays them out, so a C or C++ compiler checks the two agree
//! (`_Static_assert` in C11, `static_assert` in C++, through one macro). It compiles as C11 and
//! as C++17 (the test `tests/c_api.rs` builds and runs a program of each); in C++ the `_INIT`
//! macros are lambdas instead of C's compound literals, the same in every context. The test
//! `header_is_current` fails when the committed file differs (`EPFLOW_BLESS=1` rewrites it).
//!
//! The header declares the same names as NVIDIA's `nccl_ep.h` 0.1.0; it includes `<nccl.h>` and
//! `<cuda_runtime.h>` when they exist, and otherwise declares the few NCCL and CUDA types it
//! uses itself, so C code compiles against it on a machine without CUDA.

use std::fmt::Write;
use std::mem::{offset_of, size_of};

use nccl_ep_sys as ep;

/// One field: its C type, name, and byte offset in the Rust struct.
struct Field {
    c_type: &'static str,
    name: &'static str,
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
        vec![$(Field { c_type: $c, name: stringify!($f), offset: offset_of!($t, $f) }),*]
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

const PROLOGUE: &str = r#"/*
 * nccl_ep.h of epflow's libnccl_ep.so: NCCL EP 0.1.0's C API (API version 1), the same names
 * and layouts as NVIDIA's header. GENERATED by crates/nccl-ep-abi/src/header.rs from the Rust
 * definitions; do not edit (run `EPFLOW_BLESS=1 cargo test -p epflow-nccl-ep-abi header`).
 */
#pragma once

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

/// The header's text.
pub fn header() -> String {
    let mut h = String::from(PROLOGUE);
    let code = ep::NCCL_EP_VERSION_CODE;
    let _ = writeln!(h, "\n#define NCCL_EP_MAJOR {}", code / 10000);
    let _ = writeln!(h, "#define NCCL_EP_MINOR {}", code % 10000 / 100);
    let _ = writeln!(h, "#define NCCL_EP_PATCH {}", code % 100);
    h.push_str("#define NCCL_EP_VERSION_CODE (NCCL_EP_MAJOR * 10000 + NCCL_EP_MINOR * 100 + NCCL_EP_PATCH)\n");
    let _ = writeln!(h, "#define NCCL_EP_API_VERSION {}", ep::NCCL_EP_API_VERSION);
    let _ = writeln!(h, "#define NCCL_EP_MAGIC {:#X}u", ep::NCCL_EP_MAGIC);
    let _ = writeln!(h, "#define NCCL_EP_TENSOR_MAGIC {:#X}u", ep::NCCL_EP_TENSOR_MAGIC);
    let _ = writeln!(h, "#define NCCL_EP_AUTO {}", ep::NCCL_EP_AUTO);
    let _ = writeln!(
        h,
        "\ntypedef enum {{\n    NCCL_EP_ALGO_LOW_LATENCY = {},\n    NCCL_EP_ALGO_HIGH_THROUGHPUT = {}\n}} ncclEpAlgorithm_t;",
        ep::NCCL_EP_ALGO_LOW_LATENCY,
        ep::NCCL_EP_ALGO_HIGH_THROUGHPUT
    );
    let _ = writeln!(
        h,
        "\ntypedef enum {{\n    NCCL_EP_LAYOUT_UNSET = {},\n    NCCL_EP_LAYOUT_EXPERT_MAJOR = {},\n    NCCL_EP_LAYOUT_RANK_MAJOR = {},\n    NCCL_EP_LAYOUT_FLAT = {}\n}} ncclEpLayout_t;",
        ep::NCCL_EP_LAYOUT_UNSET,
        ep::NCCL_EP_LAYOUT_EXPERT_MAJOR,
        ep::NCCL_EP_LAYOUT_RANK_MAJOR,
        ep::NCCL_EP_LAYOUT_FLAT
    );
    let _ = writeln!(
        h,
        "\ntypedef enum {{\n    NCCL_EP_FWD_PASS = {},\n    NCCL_EP_BWD_PASS = {}\n}} ncclEpPassDir_t;",
        ep::NCCL_EP_FWD_PASS,
        ep::NCCL_EP_BWD_PASS
    );
    h.push_str("\ntypedef cudaError_t (*ncclEpAllocFn_t)(void** ptr, size_t size, void* context);\n");
    h.push_str("typedef cudaError_t (*ncclEpFreeFn_t)(void* ptr, void* context);\n");
    h.push_str("typedef struct ncclEpGroup* ncclEpGroup_t;\ntypedef struct ncclEpHandle* ncclEpHandle_t;\n");
    for s in structs() {
        let tag = if s.name == "ncclEpTensor_t" {
            "struct ncclEpTensor "
        } else if s.name == "ncclEpCompleteConfig_t" {
            "struct ncclEpCompleteConfig "
        } else {
            "struct "
        };
        let _ = writeln!(h, "\ntypedef {tag}{{");
        for f in &s.fields {
            let _ = writeln!(h, "    {} {};", f.c_type, f.name);
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
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("include/nccl_ep.h");
        let want = header();
        if std::env::var_os("EPFLOW_BLESS").is_some() {
            std::fs::write(&path, &want).expect("write the header");
        }
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            have == want,
            "{} is not the generated header: run `EPFLOW_BLESS=1 cargo test -p epflow-nccl-ep-abi header`",
            path.display()
        );
    }

    #[test]
    fn every_struct_field_is_listed() {
        for s in structs() {
            let last = s.fields.last().expect("fields");
            assert!(last.offset < s.size, "{}", s.name);
            let mut offsets: Vec<usize> = s.fields.iter().map(|f| f.offset).collect();
            offsets.dedup();
            assert_eq!(offsets.len(), s.fields.len(), "{}: fields overlap", s.name);
        }
        assert_eq!(FUNCTIONS.len(), 18);
    }
}
