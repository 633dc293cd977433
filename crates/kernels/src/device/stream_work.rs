//! [`StreamWork`]: what every stream-ordered operation does around its kernels or library calls,
//! whatever issues them (epflow's kernels, NCCL, NVIDIA's NCCL EP): its stream waits on the
//! device for the inputs' ready events, the inputs stay alive until the operation is done,
//! timing events bracket the send and the complete half, and a completion event marks the end.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, sys};
use epflow_core::Error;

use super::consumers::Lease;
use super::context::{bind, cuda};
use super::events::EventPool;
use super::tensor::DeviceTensor;

/// The timing events of one operation (before the send half, between the halves, after the
/// complete half; the last is absent when the send half did all the work), read on demand.
#[derive(Clone)]
pub struct OpTiming {
    events: TimingEvents,
    one_launch: bool,
}

/// The timing events recorded so far: the start, then the middle (after the send half's
/// launches), then the end (after the complete half's).
#[derive(Clone)]
struct TimingEvents {
    start: Arc<CudaEvent>,
    mid: Option<Arc<CudaEvent>>,
    end: Option<Arc<CudaEvent>>,
}

impl OpTiming {
    /// Device time of the send half and of the complete half; waits until the device has
    /// passed the last event (the operation's end). `None` if an event cannot be read.
    pub fn halves(&self) -> Option<(Duration, Duration)> {
        let TimingEvents { start, mid, end } = &self.events;
        let d =
            |x: &CudaEvent, y: &CudaEvent| x.elapsed_ms(y).ok().map(|ms| Duration::from_secs_f64(f64::from(ms) / 1e3));
        let mid = mid.as_ref()?;
        if self.one_launch {
            return Some((d(start, mid)?, Duration::ZERO));
        }
        Some((d(start, mid)?, d(mid, end.as_ref()?)?))
    }
}

impl std::fmt::Debug for OpTiming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpTiming").field("one_launch", &self.one_launch).finish_non_exhaustive()
    }
}

/// The stream-ordered part of one operation.
pub struct StreamWork {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    waits: Vec<Arc<CudaEvent>>,
    /// Events of [`StreamWork::order_after`], with the stream each was recorded on: waited for
    /// unless the work runs on that stream by then.
    after: Vec<(Arc<CudaEvent>, usize)>,
    /// Fences of memory the work writes (its previous readers): waited for even when the
    /// inputs are released.
    fences: Vec<Arc<CudaEvent>>,
    keep: Vec<Arc<dyn Any + Send + Sync>>,
    /// Leases of inputs that are epflow outputs: released (with this stream as a consumer) once
    /// the send half is enqueued.
    leases: Vec<Arc<dyn Lease>>,
    timing: Option<TimingEvents>,
    done: Option<Arc<CudaEvent>>,
    /// Work on other streams that the completion event must follow (`join_before_done`).
    joins: Vec<Arc<CudaEvent>>,
    /// The stream `done` was recorded on ([`super::stream_id`]).
    done_stream: usize,
    /// Where the events without timing come from (else each is created and destroyed).
    events: Option<Arc<EventPool>>,
    /// Where the timing events come from (else each is created and destroyed).
    timed_events: Option<Arc<EventPool>>,
}

impl std::fmt::Debug for StreamWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamWork")
            .field("waits", &self.waits.len())
            .field("timed", &self.timing.is_some())
            .field("done", &self.done.is_some())
            .finish()
    }
}

impl StreamWork {
    /// Work on `stream` (of `ctx`) reading `inputs`: their ready events are waited for and
    /// their memory kept alive.
    pub fn new(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, inputs: &[&DeviceTensor]) -> Self {
        StreamWork {
            ctx: Arc::clone(ctx),
            stream: Arc::clone(stream),
            waits: inputs.iter().filter_map(|t| t.ready_event().cloned()).collect(),
            after: Vec::new(),
            fences: Vec::new(),
            keep: inputs.iter().filter_map(|t| t.keep_alive()).collect(),
            leases: inputs.iter().filter_map(|t| t.lease().cloned()).collect(),
            timing: None,
            done: None,
            joins: Vec::new(),
            done_stream: 0,
            events: None,
            timed_events: None,
        }
    }

    /// Takes its events (completion, ordering) from `pool`, and its timing events from
    /// `timed` ([`EventPool::timed`]), both of the same context.
    pub fn with_events(mut self, pool: &Arc<EventPool>, timed: &Arc<EventPool>) -> Self {
        self.events = Some(Arc::clone(pool));
        self.timed_events = Some(Arc::clone(timed));
        self
    }

    /// The stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Moves the work to `stream` (of the same context), before anything was enqueued.
    pub fn set_stream(&mut self, stream: &Arc<CudaStream>) {
        self.stream = Arc::clone(stream);
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Keeps `value` alive as long as the work (memory the device reads or writes).
    pub fn keep(&mut self, value: Arc<dyn Any + Send + Sync>) {
        self.keep.push(value);
    }

    /// The inputs are no longer read (a cancelled operation): stop waiting for them and let
    /// them go.
    pub fn release_inputs(&mut self) {
        self.waits.clear();
        self.after.clear();
        self.keep.clear();
        self.leases.clear();
    }

    /// Orders the send half after the work enqueued on `stream` so far: an event recorded there
    /// now is waited for (released with the inputs), unless the work was moved onto `stream`
    /// ([`StreamWork::set_stream`]), where stream order has it.
    pub fn order_after(&mut self, stream: &CudaStream) -> Result<(), Error> {
        bind(&self.ctx)?;
        let e = self.record_on(stream)?;
        self.after.push((e, super::stream_id(stream)));
        Ok(())
    }

    /// Orders the send half after `event`, recorded on the stream whose identity
    /// (`device::stream_id`) is `stream_id`: waited for unless the work runs on that stream by
    /// then (as [`StreamWork::order_after`]'s events; released with the inputs).
    pub fn order_after_event(&mut self, event: Arc<CudaEvent>, stream_id: usize) {
        self.after.push((event, stream_id));
    }

    /// Also waits, before the send half, for `fences` (of memory the work writes: its previous
    /// readers). Kept when the inputs are released.
    pub fn wait_fences(&mut self, fences: impl IntoIterator<Item = Arc<CudaEvent>>) {
        self.fences.extend(fences);
    }

    /// Makes `stream` wait on the device for `events` (the fences of memory it is about to write).
    pub fn wait_on(stream: &CudaStream, events: &[Arc<CudaEvent>]) -> Result<(), Error> {
        for e in events {
            stream.wait(e).map_err(|e| cuda("wait for a fence", e))?;
        }
        Ok(())
    }

    fn event(&self, timed: bool) -> Result<CudaEvent, Error> {
        let flags = if timed { Some(sys::CUevent_flags::CU_EVENT_DEFAULT) } else { None };
        self.ctx.new_event(flags).map_err(|e| cuda("create event", e))
    }

    /// A timing event recorded now on `stream`.
    fn record_timed(&self, stream: &CudaStream) -> Result<Arc<CudaEvent>, Error> {
        self.record_event(stream, true)
    }

    /// With timing on: a timing event recorded now on `stream`, kept in the slot `at` picks
    /// (the middle or the end).
    fn record_timing_point(
        &mut self,
        stream: &CudaStream,
        at: fn(&mut TimingEvents) -> &mut Option<Arc<CudaEvent>>,
    ) -> Result<(), Error> {
        if self.timing.is_some() {
            let event = self.record_timed(stream)?;
            if let Some(t) = &mut self.timing {
                *at(t) = Some(event);
            }
        }
        Ok(())
    }

    /// Before the send half (binds the context): the stream waits for every input's ready
    /// event; with `timing`, the start event is recorded.
    pub fn begin_send(&mut self, timing: bool) -> Result<(), Error> {
        bind(&self.ctx)?;
        for e in &self.waits {
            self.stream.wait(e).map_err(|e| cuda("wait for an input", e))?;
        }
        let here = super::stream_id(&self.stream);
        for (e, _) in self.after.iter().filter(|(_, on)| *on != here) {
            self.stream.wait(e).map_err(|e| cuda("wait for the caller's stream", e))?;
        }
        Self::wait_on(&self.stream, &self.fences)?;
        self.fences.clear();
        if timing {
            let start = self.record_timed(&self.stream)?;
            self.timing = Some(TimingEvents { start, mid: None, end: None });
        }
        Ok(())
    }

    /// After the send half's launches: the middle timing event. The send half has read its
    /// inputs by the end of what is now enqueued: the leases of inputs that are epflow outputs
    /// are released with this stream as a consumer.
    pub fn end_send(&mut self) -> Result<(), Error> {
        let stream = Arc::clone(&self.stream);
        self.record_timing_point(&stream, |t| &mut t.mid)?;
        for l in self.leases.drain(..) {
            l.add_consumer(&self.stream);
        }
        Ok(())
    }

    /// An event recorded now on the stream: after everything enqueued so far (the send half's
    /// launches, for a reader of memory they read).
    pub fn record_now(&self) -> Result<Arc<CudaEvent>, Error> {
        self.record_on(&self.stream)
    }

    /// An event recorded now on `stream`.
    fn record_on(&self, stream: &CudaStream) -> Result<Arc<CudaEvent>, Error> {
        self.record_event(stream, false)
    }

    /// An event with or without timing recorded now on `stream`: from the matching pool if
    /// there is one, else created for it.
    fn record_event(&self, stream: &CudaStream, timed: bool) -> Result<Arc<CudaEvent>, Error> {
        if let Some(pool) = if timed { &self.timed_events } else { &self.events } {
            return pool.record(stream).map_err(|e| cuda("record event", e));
        }
        let e = self.event(timed)?;
        e.record(stream).map_err(|e| cuda("record event", e))?;
        Ok(Arc::new(e))
    }

    /// After the complete half's launches on the work's stream: the end timing event and the
    /// completion event.
    pub fn end_complete(&mut self) -> Result<Arc<CudaEvent>, Error> {
        let stream = Arc::clone(&self.stream);
        self.end_complete_on(&stream)
    }

    /// The complete half of work whose send half did all of it (a high-throughput operation or
    /// handle: nothing is launched between the halves): the completion event only, which is
    /// the middle timing event itself when there is one ([`OpTiming`] then reads the send half
    /// only).
    pub fn end_complete_after_send(&mut self) -> Result<Arc<CudaEvent>, Error> {
        let mid = self.timing.as_ref().and_then(|t| t.mid.clone());
        let done = match mid {
            Some(mid) if self.joins.is_empty() => mid,
            _ => {
                let stream = Arc::clone(&self.stream);
                Self::wait_on(&stream, &self.joins)?;
                self.record_on(&stream)?
            }
        };
        self.done = Some(Arc::clone(&done));
        self.done_stream = super::stream_id(&self.stream);
        Ok(done)
    }

    /// The completion event follows `event` too (work this operation started on another
    /// stream, e.g. a low-latency handle's kernel launched beside its dispatch).
    pub fn join_before_done(&mut self, event: Arc<CudaEvent>) {
        self.joins.push(event);
    }

    /// After the complete half's launches on `stream` (the operation's, or a caller's): the end
    /// timing event and the completion event.
    pub fn end_complete_on(&mut self, stream: &CudaStream) -> Result<Arc<CudaEvent>, Error> {
        Self::wait_on(stream, &self.joins)?;
        self.record_timing_point(stream, |t| &mut t.end)?;
        let done = self.record_on(stream)?;
        self.done = Some(Arc::clone(&done));
        self.done_stream = super::stream_id(stream);
        Ok(done)
    }

    /// The completion event, once the complete half was enqueued.
    pub fn done(&self) -> Option<&Arc<CudaEvent>> {
        self.done.as_ref()
    }

    /// The stream the completion event was recorded on ([`super::stream_id`]; 0 before it was).
    pub(crate) fn done_stream(&self) -> usize {
        self.done_stream
    }

    /// Whether the completion event has passed (`false` before [`StreamWork::end_complete`] or
    /// its siblings).
    pub fn is_complete(&self) -> Result<bool, Error> {
        let Some(done) = &self.done else { return Ok(false) };
        bind(&self.ctx)?;
        done.try_is_complete().map_err(|e| cuda("query completion", e))
    }

    /// Device time of the send half and of the complete half, with timing on (waits for the
    /// work's end on the device). `one_launch`: nothing runs in the complete half (it is all
    /// counted in the send half).
    pub fn elapsed(&self, one_launch: bool) -> Option<(Duration, Duration)> {
        self.timing(one_launch)?.halves()
    }

    /// The timing events, with timing on, to read later ([`OpTiming::halves`]): reading them
    /// waits for the work's end, which a stream-ordered completion must not do when it hands
    /// out its outputs. `one_launch` as in [`StreamWork::elapsed`].
    pub fn timing(&self, one_launch: bool) -> Option<OpTiming> {
        self.timing.as_ref().map(|events| OpTiming { events: events.clone(), one_launch })
    }

    /// Blocks until the work's device part is done: the completion event, else everything
    /// enqueued on the stream so far. For drop paths; errors are ignored.
    pub fn synchronize(&self) {
        if bind(&self.ctx).is_err() {
            return;
        }
        let _ = match &self.done {
            Some(done) => done.synchronize(),
            None => self.stream.synchronize(),
        };
    }
}
