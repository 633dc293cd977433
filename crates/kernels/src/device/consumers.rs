//! [`Consumers`]: the streams whose queued work reads some memory when it is released (outputs
//! dropped while a consumer stream has not run yet), and the fences that release leaves: an
//! event recorded on each consumer stream, which the memory's next writer waits for on the
//! device. This is how buffer sets and cached outputs are released in stream order (the idea of
//! torch's `record_stream`).

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, CudaStream};

use super::context::bind;
use super::events::EventPool;

/// Memory whose release is fenced by its consumers (a buffer set held by outputs, a cached output
/// buffer): what a [`super::DeviceTensor`] view of it holds.
pub(crate) trait Lease: std::fmt::Debug + Send + Sync {
    /// Work enqueued on `stream` (so far, or until the release) reads the memory.
    fn add_consumer(&self, stream: &Arc<CudaStream>);
}

/// The consumer streams of one piece of memory.
#[derive(Debug)]
pub(crate) struct Consumers {
    events: Arc<EventPool>,
    streams: Mutex<Vec<Arc<CudaStream>>>,
}

impl Consumers {
    /// None yet; fences come from `events` (of the memory's context).
    pub(crate) fn new(events: &Arc<EventPool>) -> Self {
        Consumers { events: Arc::clone(events), streams: Mutex::new(Vec::new()) }
    }

    /// `stream` reads the memory (work enqueued on it so far, or later until the release).
    pub(crate) fn add(&self, stream: &Arc<CudaStream>) {
        let mut s = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        if !s.iter().any(|x| Arc::ptr_eq(x, stream)) {
            s.push(Arc::clone(stream));
        }
    }

    /// At release: an event after everything each consumer stream has enqueued so far. If an
    /// event cannot be recorded, that stream is synchronized instead (nothing then to wait for).
    pub(crate) fn fences(&self) -> Vec<Arc<CudaEvent>> {
        self.stream_fences().into_iter().map(|f| f.event).collect()
    }

    /// As [`Consumers::fences`], each with the stream it was recorded on.
    pub(crate) fn stream_fences(&self) -> Vec<StreamFence> {
        let streams = std::mem::take(&mut *self.streams.lock().unwrap_or_else(|e| e.into_inner()));
        if streams.is_empty() || bind(self.events.context()).is_err() {
            return Vec::new();
        }
        streams
            .iter()
            .filter_map(|s| match self.events.record(s) {
                Ok(event) => Some(StreamFence { event, stream: stream_id(s) }),
                Err(_) => {
                    let _ = s.synchronize();
                    None
                }
            })
            .collect()
    }
}

/// A stream's identity, for "same stream, no wait" checks: the driver's unique id of the stream
/// (`cuStreamGetId`, CUDA 12), which a stream created later at the same address does not share
/// (its raw handle would: a fence recorded on a destroyed stream whose work had not yet run
/// would then be skipped by work on the new one). Where the driver has no id to give, the raw
/// handle with the top bit set (never an id the driver numbers).
pub(crate) fn stream_id(stream: &CudaStream) -> usize {
    let mut id: std::ffi::c_ulonglong = 0;
    // SAFETY: `stream` is a live stream of its context (the `CudaStream` holds it); the driver
    // writes one integer into `id`.
    let r = unsafe { cudarc::driver::sys::cuStreamGetId(stream.cu_stream(), &mut id) };
    match r.result() {
        Ok(()) => id as usize,
        Err(_) => stream.cu_stream() as usize | (1usize << (usize::BITS - 1)),
    }
}

/// A fence event with the stream it was recorded on ([`stream_id`]): work enqueued later on
/// that same stream is already ordered after it and needs no wait (a buffer set's next
/// operation on the caller's stream, in `libnccl_ep.so`).
#[derive(Clone, Debug)]
pub(crate) struct StreamFence {
    /// The event, recorded after the memory's last reader.
    pub(crate) event: Arc<CudaEvent>,
    /// Where it was recorded.
    pub(crate) stream: usize,
}
