//! [`OutputCache`]: device memory for high-throughput outputs, whose sizes follow each handle's
//! token counts. Buffers return to the cache when the last tensor viewing them is dropped, so a
//! steady stream of operations allocates nothing after warm-up (`cuMemAlloc` and `cuMemFree` are
//! slow, and `cuMemFree` synchronizes the device).
//!
//! A returned buffer may be handed to the next operation at once. Work still queued on the
//! device that reads it must be declared (its stream a consumer: `Lease::add_consumer`,
//! `record_stream` on the outputs): the buffer then returns with fences, which its next user's
//! writes wait for on the device.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use epflow_core::Error;

use super::consumers::{Consumers, Lease};
use super::events::EventPool;
use super::memory::DeviceBuffer;

/// Allocation granularity of cached buffers.
const GRANULE: usize = 2 << 20;
/// Free buffers kept at most; more are freed.
const MAX_FREE: usize = 8;

/// Free output buffers of one device, with the fences of their last readers.
#[derive(Debug)]
pub(crate) struct OutputCache {
    ctx: Arc<CudaContext>,
    events: Arc<EventPool>,
    free: Mutex<Vec<(DeviceBuffer, Vec<Arc<CudaEvent>>)>>,
}

/// A buffer on loan from an [`OutputCache`]; goes back on drop, with fences on its consumers.
#[derive(Debug)]
pub(crate) struct CachedBuffer {
    buf: Option<DeviceBuffer>,
    /// Allocated by this `take` (not reused).
    fresh: bool,
    /// The previous readers' fences: writers of this buffer wait for them.
    fences: Vec<Arc<CudaEvent>>,
    consumers: Consumers,
    cache: Arc<OutputCache>,
}

impl OutputCache {
    /// An empty cache for the context of `events` (where its buffers' fences come from).
    pub(crate) fn new(events: &Arc<EventPool>) -> Arc<Self> {
        let ctx = Arc::clone(events.context());
        Arc::new(OutputCache { ctx, events: Arc::clone(events), free: Mutex::new(Vec::new()) })
    }

    /// The smallest free buffer of at least `bytes`, or a new one (rounded up to 2 MiB).
    pub(crate) fn take(self: &Arc<Self>, bytes: usize) -> Result<CachedBuffer, Error> {
        let ((buf, fences), fresh) = match take_smallest(&self.free, bytes, |(b, _)| b.bytes()) {
            Some(f) => (f, false),
            None => ((DeviceBuffer::zeroed(&self.ctx, bytes.max(1).next_multiple_of(GRANULE))?, Vec::new()), true),
        };
        let consumers = Consumers::new(&self.events);
        Ok(CachedBuffer { buf: Some(buf), fresh, fences, consumers, cache: Arc::clone(self) })
    }
}

/// Removes and returns the smallest entry of `pool` holding at least `bytes` (`size` says how
/// many an entry holds), if any.
pub(crate) fn take_smallest<T>(pool: &Mutex<Vec<T>>, bytes: usize, size: impl Fn(&T) -> usize) -> Option<T> {
    let mut pool = pool.lock().unwrap_or_else(|e| e.into_inner());
    let best = pool.iter().enumerate().filter(|(_, b)| size(b) >= bytes).min_by_key(|(_, b)| size(b)).map(|(i, _)| i);
    best.map(|i| pool.swap_remove(i))
}

impl CachedBuffer {
    /// The device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.buf.as_ref().map_or(0, DeviceBuffer::ptr)
    }

    /// Whether this loan allocated the buffer (it served no earlier operation).
    pub(crate) fn fresh(&self) -> bool {
        self.fresh
    }

    /// The fences of the buffer's previous readers: work writing it waits for them.
    pub(crate) fn take_fences(&mut self) -> Vec<Arc<CudaEvent>> {
        std::mem::take(&mut self.fences)
    }
}

impl Lease for CachedBuffer {
    /// Work on `stream` reads the buffer: its release fences the stream.
    fn add_consumer(&self, stream: &Arc<CudaStream>) {
        self.consumers.add(stream);
    }
}

impl Drop for CachedBuffer {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            let mut fences = self.consumers.fences();
            fences.append(&mut self.fences);
            let mut free = self.cache.free.lock().unwrap_or_else(|e| e.into_inner());
            free.push((b, fences));
            if free.len() > MAX_FREE {
                // The smallest goes: the cache keeps the buffers large operations need. A
                // buffer with fences is waited for before it is freed (cuMemFree of memory in
                // use would be an error).
                free.sort_by_key(|(b, _)| std::cmp::Reverse(b.bytes()));
                let extra = free.pop();
                drop(free);
                if let Some((b, fences)) = extra {
                    for f in fences {
                        let _ = f.synchronize();
                    }
                    drop(b);
                }
            }
        }
    }
}
