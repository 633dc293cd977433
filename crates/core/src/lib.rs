//! # epflow-core
//!
//! The model of epflow's expert-parallel (EP) operations, with no CUDA and no `unsafe`:
//! what goes where, what is valid, and what the right answer is. The GPU backend
//! (`epflow-kernels`) moves the bytes; the async runtime (`epflow-async`) drives completion.
//!
//! Notation used throughout the docs: `B` tokens on a rank, `H` hidden size, `K` top-k,
//! `E` experts, `R` ranks, `L = E / R` local experts per rank, `M` = max tokens per rank.
//!
//! ## Table of contents
//!
//! - [`config`]: [`GroupConfig`] and its validation.
//! - [`dtype`]: element types.
//! - [`tensor`]: tensor descriptors, NCCL EP's tensor tags, host tensors.
//! - [`ops`]: the inputs and outputs of each operation (dispatch, combine, forward, backward).
//! - [`validate`]: checks of every operation's inputs and outputs against the operation tables.
//! - [`routing`]: validated `topk_idx`, expert placement, send plans and receive layouts.
//! - [`fp8`]: FP8 e4m3 conversion and per-128-channel quantization.
//! - [`nvfp4`]: NVFP4 (FP4 E2M1 with E4M3 block scales and a global scale), the low-latency
//!   combine's quantized transport.
//! - [`reference`](mod@reference): the CPU reference semantics of every operation, for a whole world at once.
//! - [`protocol`]: the buffer-set / signal / credit protocol every backend follows, and slots.
//! - [`stamp`]: what the ranks of a collective must agree on (top-k, pass, handle or dispatch).
//! - [`handle`]: what every backend's routing handle shares, and when a handle may be reused.
//! - [`backend`]: the trait a backend implements so the async runtime can drive it, and the
//!   protocol state every backend's rank holds.
//! - [`mask`]: rank masking — a low-latency group that skips a dead rank instead of poisoning,
//!   how the survivors agree, and how the group recovers.
//! - [`graph`]: captured low-latency steps replayed as a whole (CUDA graphs on GPUs), and
//!   their rules.
//! - [`host`]: the host backend, `R` ranks in one process on host memory.
//! - [`workload`]: seeded random inputs and routings in the style of NCCL EP's `ep_bench`.
//! - [`scenario`]: a whole world's inputs with their reference results.
//! - [`verify`]: comparison of a backend's outputs with the reference.
//! - [`tuning`]: every `EPFLOW_*` knob, read once per process, and a group's [`tuning::Tuning`].
//! - [`error`]: every error type.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod backend;
pub mod config;
pub mod dtype;
pub mod error;
pub mod fp8;
pub mod graph;
pub mod handle;
pub mod host;
pub mod mask;
pub mod nvfp4;
pub mod ops;
pub mod protocol;
pub mod reference;
pub mod routing;
pub mod scenario;
pub mod stamp;
pub mod tensor;
pub mod tuning;
pub mod validate;
pub mod verify;
pub mod workload;

pub use config::{Algorithm, DispatchDtype, GroupConfig, MaxTokens};
pub use dtype::{CombineQuant, DType};
pub use error::{ConfigError, Error, RejoinRefusal, Result, ValidationError};
pub use half::bf16;
pub use tensor::{HostData, HostTensor, TensorDesc, TensorTag};
