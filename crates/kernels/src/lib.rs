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
//! ### The backend
//! - [`GpuWorld`] (`world.rs`): creates a group: one process driving several GPUs, or one
//!   process per GPU ([`GpuWorld::join`]), over a [`Transport`].
//! - [`GpuRank`] (`rank/`): one rank; implements [`epflow_core::backend::Backend`], so the async
//!   runtime drives it.
//! - `state/`: what the operations of a rank share: its state (`state/shared.rs`), its
//!   [`GpuHandle`]s (`state/handle.rs`) and the reports of handles built on the device.
//! - [`GpuDispatchOutput`], [`GpuCombineOutput`] (`outputs.rs`): the results; [`OutputTargets`]:
//!   caller-owned memory to write them into instead.
//!
//! ### Operations (internal rooms)
//! - `ll/`: low-latency: starting an operation (kernel parameters, NCCL exchange,
//!   cancellations) and its launch geometry.
//! - `ht/`: high-throughput: the count exchange that creates a handle, starting dispatch and
//!   combine, the same over NCCL, and the launch geometry.
//! - `op/`: [`GpuOp`], the lifecycle of one operation; its launches; its output assembly.
//! - `graph/`: captured low-latency steps (CUDA graphs): [`GpuRank::graph_handle`],
//!   [`GpuRank::capture`] recording through a [`GpuCapture`], the [`GpuStep`] and its
//!   [`GpuReplay`]s ([`epflow_core::graph::StepBackend`]).
//!
//! ### Transports and process setup
//! - [`transport`]: [`Transport`], NVLink peers (peer access, CUDA IPC) and NCCL.
//! - [`setup`]: the `epflow launch` / torchrun environment, the NCCL bootstrap, the TCP
//!   rendezvous across hosts.
//!
//! ### The device edge
//! - [`device`]: the CUDA driver, [`DeviceTensor`], device and pinned memory, the cache of output
//!   buffers, and [`StreamWork`] (input waits, timing and completion events of any
//!   stream-ordered operation).
//! - [`compile`]: the CUDA sources, NVRTC and the loaded functions.
//! - `params.rs`: the kernels' parameter blocks, mirrored byte for byte; `layout.rs`: buffer
//!   sizes.
//!
//! ### Compute
//! - [`compute`]: per-expert GEMMs (cuBLAS) for examples and benchmarks.
//!
//! ## The protocol on the device
//!
//! It is [`epflow_core::protocol`]'s: per (buffer set, source) an arrival pair, the sender's
//! stamp ([`epflow_core::stamp`]) then its arrival word `(seq + 1) << 1 | cancelled` written with
//! `st.release.sys` after the payload; receivers poll with `ld.acquire.sys` and a `%globaltimer`
//! deadline, skip the data of a source that cancelled or whose stamp disagrees; the last
//! receiving block returns the credits. Timeouts and outcomes are reported in host-mapped
//! memory, never by `trap`.
//!
//! High-throughput operations (`cuda/ht.cu` and its parts) stream rows through a ring per (channel, source)
//! in each receiver's memory, with per-warp tails and a head per ring as flow control, so buffers
//! stay bounded whatever the token count; handle creation exchanges the counts (collective).

pub mod compile;
pub mod compute;
pub mod device;
mod graph;
mod ht;
mod layout;
mod ll;
mod op;
mod outputs;
mod params;
mod rank;
pub mod setup;
mod state;
pub mod transport;
mod world;

pub use compile::device_arch;

/// The most ranks a GPU group may have (the NVLink kernels carry one peer address per rank in
/// fixed arrays of this size): also the most processes `epflow launch -n` starts on one host.
pub const MAX_GPU_RANKS: usize = params::MAX_RANKS;
pub use device::{DeviceTensor, FreeMemory, StreamWork, device_count, sm_count};
pub use graph::{CapturedSend, DeviceNumbering, GpuCapture, GpuReplay, GpuStep, NumberedSend};
pub use op::{GpuOp, GpuOpOutput};
pub use outputs::{GpuCombineOutput, GpuDispatchOutput, OutputTargets};
pub use rank::{BulkStages, CopyRange, ExpertMajorPlan, GpuRank, LaunchCost};
pub use setup::meeting::MeetingSource;
pub use state::handle::GpuHandle;
pub use transport::Transport;
pub use world::GpuWorld;
