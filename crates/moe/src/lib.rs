//! # epflow-moe
//!
//! An expert-parallel Mixture-of-Experts layer over epflow, the part a Rust inference server
//! embeds around the communication: route, dispatch, run the local experts, combine, add the
//! shared expert. `epflow-kernels` stays a communication library; the model lives here.
//!
//! ## Table of contents
//!
//! - [`preset`](mod@preset): model presets with real shapes (`qwen3-30b-a3b`, `mixtral-8x7b`,
//!   `deepseek-v3`) and their router scoring.
//! - [`weights`]: seeded random BF16 weights of one layer, sized per rank (the gate and the
//!   shared expert on every rank, the routed experts on their owner), and the memory check that
//!   refuses a layer that does not fit, naming the bytes needed.
//! - [`reference`](mod@reference): the CPU reference: the router (gate GEMM, softmax or sigmoid scoring, top-k
//!   with ties to the lower expert id, renormalised weights), a SwiGLU expert, the whole layer.
//! - [`gpu`]: the layer on GPUs: [`gpu::GpuMoeModel`] (a preset's layers on one rank, weights
//!   drawn on the device) and [`gpu::Lane`] (one micro-batch's streams and scratch; the layer's
//!   parts in stream order, and [`gpu::Lane::forward`]), the router's top-k and SwiGLU kernels,
//!   cuBLAS GEMMs. Checked against [`reference`](mod@reference) within a stated BF16 tolerance
//!   (`tests/gpu_layer.rs`).
//! - [`host`]: the layer on epflow's host backend (every rank a [`epflow_core::host::HostRank`]
//!   in a [`epflow_async::Group`]): the reference's router and experts around real dispatch and
//!   combine, bit-identical to [`reference::layer`].
//!
//! Shapes: `B` tokens on a rank, `H` hidden size, `E` routed experts, `K` top-k, `F` an expert's
//! FFN width, `R` ranks, `L = E / R` local experts. Tensors are row-major; BF16 activations and
//! weights, FP32 accumulation.

// Unsafe code lives only at the device edge: `gpu/kernels.rs` (launches) and `gpu/blas.rs`.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod gpu;
pub mod host;
pub mod preset;
pub mod reference;
pub mod weights;

pub use preset::{ModelPreset, PRESETS, Scoring, preset};
pub use weights::{ExpertWeights, LayerWeights};
