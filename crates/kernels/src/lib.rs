//! # epflow-kernels
//!
//! The GPU backend of epflow: CUDA C kernels (kept as `.cu` files in this crate) compiled at run
//! time with NVRTC and cached on disk, device memory from `cuMemAlloc` mapped into peers,
//! low-latency dispatch/combine over NVLink with separate send and complete launches, and
//! high-throughput dispatch/combine (forward and backward) streaming through bounded rings. Everything
//! CUDA is loaded at run time (cudarc, dynamic loading): building needs no CUDA, and a machine
//! without a GPU gets [`epflow_core::Error::Unsupported`], never a panic.
//!
//! ## Table of contents
//!
//! - [`GpuWorld`]: creates a group (`create_with` / `join_with` take a [`Transport`]) — one
//!   process driving several GPUs, or one process per GPU
//!   ([`GpuWorld::join`], with [`bootstrap`]: the `epflow launch` environment and NCCL, and
//!   [`rendezvous`]: torchrun's `MASTER_ADDR`/`MASTER_PORT` environment and a TCP exchange of
//!   the NCCL id across hosts).
//! - [`GpuRank`]: one rank; implements [`epflow_core::backend::Backend`], so the async runtime
//!   drives it; [`GpuHandle`], [`GpuDispatchOutput`], [`GpuCombineOutput`].
//! - [`DeviceTensor`]: tensors in device memory; [`compute`]: per-expert GEMMs (cuBLAS) for
//!   examples and benchmarks.
//! - [`nccl`]: the NCCL transport ([`Transport`]): `--backend nccl`, and the ranks of other
//!   hosts (NVLink inside a host, NCCL across).
//! - [`layout`]: buffer sizes (low-latency buffer sets, high-throughput rings); [`sources`]: the CUDA sources; [`nvrtc`]: compilation and cache;
//!   [`driver`]: availability checks; [`memory`]: device and pinned buffers.
//!
//! ## The protocol on the device
//!
//! It is [`epflow_core::protocol`]'s: per (buffer set, source) arrival signals carrying
//! `(seq + 1) << 1 | cancelled`, written with `st.release.sys` after the payload; receivers poll
//! with `ld.acquire.sys` and a `%globaltimer` deadline; the last receiving block returns the
//! credits. Timeouts are reported in host-mapped memory, never by `trap`.
//!
//! High-throughput operations (`cuda/ht.cu`) stream rows through a ring per (channel, source)
//! in each receiver's memory, with per-warp tails and a head per ring as flow control, so buffers
//! stay bounded whatever the token count; handle creation exchanges the counts (collective).

pub mod bootstrap;
mod cache;
pub mod compute;
pub mod driver;
mod ht;
mod kernels;
pub mod layout;
pub mod memory;
pub mod nccl;
pub mod nvrtc;
mod op;
mod outputs;
mod params;
mod rank;
pub mod rendezvous;
pub mod sources;
mod tensor;
mod world;

pub use kernels::device_arch;
pub use nccl::Transport;
pub use op::{GpuOp, GpuOpOutput};
pub use outputs::{GpuCombineOutput, GpuDispatchOutput};
pub use rank::{GpuHandle, GpuRank};
pub use tensor::DeviceTensor;
pub use world::GpuWorld;
