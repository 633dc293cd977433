//! [`EventPool`]: recycled CUDA events of one context. Every operation records a completion
//! event (and with timing on, timing events) and, when its outputs are released, a fence per
//! consumer stream; creating and destroying each (`cuEventCreate`, `cuEventDestroy`) costs host
//! time on the path of every operation. The pool hands out an event that nobody else holds any
//! more and records it again.
//!
//! Re-recording is safe: a stream that waited for an event (`cuStreamWaitEvent`) waits for the
//! record that was current at that call, not for later ones; and an event is only reused once
//! every `Arc` to it outside the pool is gone, so nobody queries or waits for it any more.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError};

/// Whether `event` (of `ctx`) has completed, for a probe the reactor polls: also true when the
/// context can no longer be bound or the query fails, so that the waiter goes on to read the
/// verdict (which names the failure) instead of waiting for ever.
pub(crate) fn event_done(ctx: &CudaContext, event: &CudaEvent) -> bool {
    super::bind(ctx).is_err() || event.try_is_complete().unwrap_or(true)
}

/// Events kept at most; beyond that, events are created and destroyed as before.
const MAX_POOLED: usize = 256;

/// Recycled events of one context: without timing ([`EventPool::new`]), or with it for the
/// timing events of operations ([`EventPool::timed`]).
#[derive(Debug)]
pub struct EventPool {
    ctx: Arc<CudaContext>,
    events: Mutex<Pooled>,
    /// Events created with timing (`CU_EVENT_DEFAULT`), else without (`CU_EVENT_DISABLE_TIMING`).
    timed: bool,
}

#[derive(Debug, Default)]
struct Pooled {
    events: Vec<Arc<CudaEvent>>,
    /// Where the next search for a free event starts (the oldest hand-outs come free first).
    next: usize,
}

impl EventPool {
    /// An empty pool of `ctx`, of events without timing.
    pub fn new(ctx: &Arc<CudaContext>) -> Arc<Self> {
        Self::empty(ctx, false)
    }

    /// An empty pool of `ctx`, of events with timing (an operation's timing events: read with
    /// `cuEventElapsedTime`).
    pub fn timed(ctx: &Arc<CudaContext>) -> Arc<Self> {
        Self::empty(ctx, true)
    }

    fn empty(ctx: &Arc<CudaContext>, timed: bool) -> Arc<Self> {
        Arc::new(EventPool { ctx: Arc::clone(ctx), events: Mutex::new(Pooled::default()), timed })
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// An event recorded now on `stream` (of this pool's context, bound to the thread): after
    /// everything enqueued there so far.
    pub fn record(&self, stream: &CudaStream) -> Result<Arc<CudaEvent>, DriverError> {
        let event = self.take()?;
        event.record(stream)?;
        Ok(event)
    }

    /// A pooled event nobody else holds, or a new one (pooled while there is room).
    fn take(&self) -> Result<Arc<CudaEvent>, DriverError> {
        let mut p = self.events.lock().unwrap_or_else(|e| e.into_inner());
        let n = p.events.len();
        // Only the pool hands out clones, under this lock: a count of 1 stays 1 until we clone.
        if let Some(i) = (0..n).map(|j| (p.next + j) % n).find(|&i| Arc::strong_count(&p.events[i]) == 1) {
            p.next = (i + 1) % n;
            return Ok(Arc::clone(&p.events[i]));
        }
        let flags = self.timed.then_some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let event = Arc::new(self.ctx.new_event(flags)?);
        if n < MAX_POOLED {
            p.events.push(Arc::clone(&event));
        }
        Ok(event)
    }

    /// Events the pool holds (handed out or free).
    pub fn len(&self) -> usize {
        self.events.lock().unwrap_or_else(|e| e.into_inner()).events.len()
    }

    /// Whether the pool holds no event yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{context, device_count};

    /// GPU 0's context and a new stream of it, or `None` (the test `test` is skipped, loudly)
    /// without a GPU.
    fn gpu_stream(test: &str) -> Option<(Arc<CudaContext>, Arc<CudaStream>)> {
        if device_count() == 0 {
            eprintln!("SKIPPED {test}: no GPU");
            return None;
        }
        let ctx = context(0).expect("context");
        let stream = ctx.new_stream().expect("stream");
        Some((ctx, stream))
    }

    #[test]
    fn reuses_only_events_nobody_holds() {
        let Some((ctx, stream)) = gpu_stream("reuses_only_events_nobody_holds") else { return };
        let pool = EventPool::new(&ctx);
        let a = pool.record(&stream).expect("record");
        let b = pool.record(&stream).expect("record");
        assert!(!Arc::ptr_eq(&a, &b), "a held event was handed out twice");
        assert_eq!(pool.len(), 2);
        let a_ptr = Arc::as_ptr(&a);
        drop(a);
        let c = pool.record(&stream).expect("record");
        assert_eq!(Arc::as_ptr(&c), a_ptr, "the released event is recorded again");
        assert_eq!(pool.len(), 2);
        stream.synchronize().expect("sync");
        assert!(c.try_is_complete().expect("query") && b.try_is_complete().expect("query"));
    }

    #[test]
    fn a_timed_pool_hands_out_events_that_time() {
        let Some((ctx, stream)) = gpu_stream("a_timed_pool_hands_out_events_that_time") else { return };
        let pool = EventPool::timed(&ctx);
        let a = pool.record(&stream).expect("record");
        let b = pool.record(&stream).expect("record");
        let ms = a.elapsed_ms(&b).expect("a timed pool's events have timing");
        assert!(ms >= 0.0, "{ms} ms between two events in stream order");
        // The untimed pool's events do not time.
        let untimed = EventPool::new(&ctx);
        let (c, d) = (untimed.record(&stream).expect("record"), untimed.record(&stream).expect("record"));
        assert!(c.elapsed_ms(&d).is_err(), "events without timing were timed");
    }
}
