//! The CUDA C sources (`cuda/*.cu`), their run-time compilation with NVRTC (cached on disk), and
//! the functions loaded from them into a device's context (the low-latency kernels by name:
//! `ll_kernels.rs`). It imports nothing above the device edge and the parameter blocks.

mod functions;
pub(crate) mod ll_kernels;
pub mod nvrtc;
pub mod sources;

pub(crate) use functions::Functions;
pub use functions::device_arch;
