//! # epflow
//!
//! Async expert-parallel (MoE) dispatch and combine for GPUs, in Rust. This facade re-exports
//! the workspace:
//!
//! - [`core`] (`epflow-core`): config, tensors, validation, routing, the CPU reference, the host
//!   backend.
//! - [`runtime`] (`epflow-async`): the futures, the completion reactor, pipelines. Its main types
//!   are re-exported here: [`Group`], [`Staged`].
//! - [`kernels`] (`epflow-kernels`): the GPU backend (CUDA kernels compiled with NVRTC at run
//!   time, NVLink peer memory, NCCL between hosts, one process for all GPUs or one process per
//!   GPU).
//! - [`nccl_ep`] (`epflow-nccl-ep`): NVIDIA's NCCL EP behind the same futures.
//! - [`moe`] (`epflow-moe`): an expert-parallel MoE layer over epflow (model presets, the CPU
//!   reference, the layer on the host backend and on GPUs).
//! - [`prelude`]: what a program needs in one `use`.
//!
//! ```
//! use epflow::prelude::*;
//!
//! // Two ranks of a host world, each driven by its own task on one executor.
//! let groups: Vec<Group<_>> = HostWorld::create(2, GroupConfig::low_latency(4, 2, 128)).unwrap().into_iter().map(Group::new).collect();
//! futures::executor::block_on(futures::future::join_all(groups.iter().map(|g| async move {
//!     let idx = HostTensor::topk_idx(2, 2, vec![0, 2, 1, 3]); // each token to one expert per rank
//!     let x = HostTensor::tokens(2, 128, vec![bf16::ONE; 256]);
//!     let w = HostTensor::topk_weights(2, 2, vec![0.25, 0.75, 0.5, 0.5]);
//!     let handle = g.create_handle(&idx).await?;
//!     let staged = g.dispatch(&handle, DispatchInputs::new(&x)).send_only().await?; // send half
//!     let received = staged.await?;                                                 // complete half
//!     let y = g.combine(&handle, CombineInputs::new(received.tokens()).with_weights(&w)).await?;
//!     assert!(y.tokens().as_bf16().unwrap().iter().all(|v| v.to_f32() == 1.0));
//!     Ok::<_, epflow::core::Error>(())
//! }))).into_iter().collect::<Result<Vec<_>, _>>().unwrap();
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub use epflow_async as runtime;
pub use epflow_async::{Group, Staged};
pub use epflow_core as core;
pub use epflow_kernels as kernels;
pub use epflow_moe as moe;
pub use epflow_nccl_ep as nccl_ep;

/// The names a program using epflow needs, in one `use epflow::prelude::*;`: the group and its
/// futures, the config, tensors and operation arguments, the handle trait (`num_recv_tokens`),
/// the host backend, the GPU backend's world, rank and tensors, and captured steps
/// (`StepBackend`, `GpuStep`; `Group::replay`).
pub mod prelude {
    pub use epflow_async::{Group, Staged};
    pub use epflow_core::graph::StepBackend;
    pub use epflow_core::handle::RoutingHandle;
    pub use epflow_core::host::{HostRank, HostWorld};
    pub use epflow_core::ops::{
        CombineInputs, CombineOptions, CountsLocation, DispatchInputs, DispatchOptions, HandleOptions, Layout, Pass,
        RecvRows,
    };
    pub use epflow_core::{Algorithm, DType, DispatchDtype, Error, GroupConfig, HostTensor, MaxTokens, Result, bf16};
    pub use epflow_kernels::{DeviceTensor, GpuRank, GpuStep, GpuWorld, Transport};
}
