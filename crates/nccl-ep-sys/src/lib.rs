//! # nccl-ep-sys
//!
//! Raw FFI to NVIDIA's NCCL EP (`nccl_ep.h` of the NCCL 2.30 series, NCCL EP 0.1): expert-parallel
//! dispatch/combine/complete on top of NCCL. Nothing is linked at build time: [`NcclEp::load`]
//! opens `libnccl_ep.so` at run time (from `NCCL_EP_LIB`, else the library path), resolves every
//! entry point, and checks the version, with an error that says what was found and what is
//! needed. The functions are the C ones, `unsafe` to call; epflow's NCCL EP backend wraps them.
//!
//! ## Table of contents
//!
//! - [`types`]: the C types of `nccl_ep.h` as released with NCCL 2.30.7 (NCCL EP 0.1.0): tensor
//!   descriptors, the `size`/`magic`-headed config, input, output and layout-info structs (their
//!   `Default` fills both fields), layouts, pass directions, opaque group and handle.
//! - [`library`]: [`NcclEp`], the loaded library and its function pointers; [`LoadError`].

#![deny(missing_docs)]

pub mod library;
pub mod types;

pub use library::{EPFLOW_MARKER, LoadError, NcclEp, SUPPORTED};
pub use types::*;
