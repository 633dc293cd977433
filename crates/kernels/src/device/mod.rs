//! The CUDA edge: the driver and its contexts, device and pinned memory (and a caller's
//! allocator for a rank's local scratch, [`LocalAllocator`]), device tensors, the cache of output
//! buffers, recycled events, what every stream-ordered operation does around its launches, and
//! the host-step diagnostic (`EPFLOW_HOST_STEPS`).

pub(crate) mod cache;
pub(crate) mod consumers;
mod context;
mod events;
pub mod host_steps;
mod local;
mod memory;
mod parked;
mod stream_work;
mod tensor;

pub(crate) use consumers::{Lease, StreamFence, stream_id};
pub use context::{FreeMemory, context, device_count, driver_present, sm_count};
pub(crate) use context::{bind, cuda, pci_key, sm_count_of};
pub use events::EventPool;
pub(crate) use events::event_done;
pub use local::{LOCAL_ALIGN, LocalAllocator};
pub use memory::DeviceBuffer;
pub(crate) use memory::{PinnedBuffer, copy_to_host};
pub(crate) use parked::SharedContext;
pub use stream_work::{OpTiming, StreamWork};
pub use tensor::DeviceTensor;
