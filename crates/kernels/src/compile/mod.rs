//! The CUDA C sources (`cuda/*.cu`), their run-time compilation with NVRTC (cached on disk), and
//! the functions loaded from them into a device's context.

mod functions;
pub mod nvrtc;
pub mod sources;

pub(crate) use functions::Functions;
pub use functions::device_arch;
