//! [`OutputCache`]: device memory for high-throughput outputs, whose sizes follow each handle's
//! token counts. Buffers return to the cache when the last tensor viewing them is dropped, so a
//! steady stream of operations allocates nothing after warm-up (`cuMemAlloc` and `cuMemFree` are
//! slow, and `cuMemFree` synchronizes the device).
//!
//! A returned buffer may be handed to the next operation at once: drop an output only when the
//! work that reads it has finished or is ordered before the next epflow operation.

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;
use epflow_core::Error;

use super::memory::DeviceBuffer;

/// Allocation granularity of cached buffers.
const GRANULE: usize = 2 << 20;
/// Free buffers kept at most; more are freed.
const MAX_FREE: usize = 8;

/// Free output buffers of one device.
#[derive(Debug)]
pub(crate) struct OutputCache {
    ctx: Arc<CudaContext>,
    free: Mutex<Vec<DeviceBuffer>>,
}

/// A buffer on loan from an [`OutputCache`]; goes back on drop.
#[derive(Debug)]
pub(crate) struct CachedBuffer {
    buf: Option<DeviceBuffer>,
    cache: Arc<OutputCache>,
}

impl OutputCache {
    /// An empty cache for `ctx`.
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Arc<Self> {
        Arc::new(OutputCache { ctx: Arc::clone(ctx), free: Mutex::new(Vec::new()) })
    }

    /// The smallest free buffer of at least `bytes`, or a new one (rounded up to 2 MiB).
    pub(crate) fn take(self: &Arc<Self>, bytes: usize) -> Result<CachedBuffer, Error> {
        let found = take_smallest(&self.free, bytes);
        let buf = match found {
            Some(b) => b,
            None => DeviceBuffer::zeroed(&self.ctx, bytes.max(1).next_multiple_of(GRANULE))?,
        };
        Ok(CachedBuffer { buf: Some(buf), cache: Arc::clone(self) })
    }
}

/// Removes and returns the smallest buffer of `pool` holding at least `bytes`, if any.
pub(crate) fn take_smallest(pool: &Mutex<Vec<DeviceBuffer>>, bytes: usize) -> Option<DeviceBuffer> {
    let mut pool = pool.lock().unwrap_or_else(|e| e.into_inner());
    let best =
        pool.iter().enumerate().filter(|(_, b)| b.bytes() >= bytes).min_by_key(|(_, b)| b.bytes()).map(|(i, _)| i);
    best.map(|i| pool.swap_remove(i))
}

impl CachedBuffer {
    /// The device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.buf.as_ref().map_or(0, DeviceBuffer::ptr)
    }
}

impl Drop for CachedBuffer {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            let mut free = self.cache.free.lock().unwrap_or_else(|e| e.into_inner());
            if free.len() < MAX_FREE {
                free.push(b);
            } else {
                // The smallest goes: the cache keeps the buffers large operations need.
                free.push(b);
                free.sort_by_key(|b| std::cmp::Reverse(b.bytes()));
                let extra = free.pop();
                drop(free);
                drop(extra);
            }
        }
    }
}
