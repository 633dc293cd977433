//! The MoE layer on GPUs: epflow's dispatch and combine (low-latency for decode, high-throughput
//! for prefill) around the layer's compute,
//! all of it enqueued in the order of one stream per micro-batch, with nothing read on the
//! host.
//!
//! - [`GpuMoeModel`] (`model.rs`): the first `layers` layers of a preset on one rank: their
//!   weights, drawn on the device by the same counter-based generator as
//!   [`crate::weights::LayerWeights`] (value for value), and refused up front, with the bytes
//!   needed, when they do not fit.
//! - [`Lane`] (`lane.rs`): one micro-batch's streams and scratch; the layer's three stream-ordered
//!   parts ([`Lane::before_dispatch`]: attention stand-in, router, the shared expert on a side
//!   stream; [`Lane::experts`]: the SwiGLU experts on the dispatch's outputs;
//!   [`Lane::after_combine`]: the shared expert added) and the whole layer
//!   ([`Lane::forward`]).
//! - `kernels.rs`: the layer's own kernels (`cuda/moe.cu`): weights, router top-k, SwiGLU
//!   activation reading the per-expert counts on the device, BF16 add. [`MOE`] is the module
//!   `epflow compile` builds.
//! - `grouped.rs`: grouped experts over a high-throughput dispatch's rows (prefill,
//!   [`Lane::forward_grouped`]): rows gathered per expert, cuBLAS grouped GEMMs at the counts
//!   the handle brought to the host, the weighted sum per received row.
//! - `blas.rs`: the GEMMs (cuBLAS, BF16 in, FP32 accumulation; strided-batched and grouped).
//! - `graphs.rs`: a lane's compute pieces captured as CUDA graphs ([`Lane::with_graphs`]).
//! - `steps.rs`: a lane's decode layers captured whole, one CUDA graph per layer with its
//!   dispatch and combine ([`Lane::capture_layers`], [`LayerSteps`]): one launch per layer.
//!
//! Decode's experts are strided-batched GEMMs over the dispatch's padded layout `[L x R*M x H]`:
//! they need no counts on the host, at the price of computing every expert's `R*M` rows (the
//! activation skips the rows past each expert's count, read on the device; the combine reads
//! only the rows that arrived). Prefill's are grouped GEMMs at the exact counts.

#[allow(unsafe_code)]
mod blas;
#[allow(unsafe_code)]
mod graphs;
mod grouped;
#[allow(unsafe_code)]
mod kernels;
mod lane;
mod model;
#[allow(unsafe_code)]
mod steps;

pub use grouped::GroupedInputs;
pub use kernels::{MAX_ROUTER_EXPERTS, MOE};
pub use lane::{Lane, LaneTimes, LayerStep, Routed};
pub use model::{GpuMoeModel, ModelOptions};
pub use steps::LayerSteps;

use epflow_core::Error;

/// A CUDA driver error, with what was being done.
pub(crate) fn cuda(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Backend(format!("CUDA: {what}: {e:?}"))
}
