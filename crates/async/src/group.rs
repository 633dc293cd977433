//! [`Group`] and the futures of its operations.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use epflow_core::backend::{Backend, HandleCreation, OpOutput, StreamOrder};
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions};
use epflow_core::validate::validate_staged;
use epflow_core::{Error, GroupConfig, Result};

use futures::channel::oneshot;

use crate::completion::{Completion, CompletionMode};
use crate::driver::OpDriver;
use crate::lane::Lane;

type Output<B> = OpOutput<<B as Backend>::Handle, <B as Backend>::DispatchOutput, <B as Backend>::CombineOutput>;

/// One rank's EP group on backend `B`, with async operations.
///
/// Every operation is collective: all ranks of the group must start it, in the same order.
/// The order is fixed when the operation is *created* (when `dispatch`, `combine` or
/// `create_handle` is called), not when its future is first polled, so operations created
/// from several tasks keep this rank's call order.
#[derive(Debug)]
pub struct Group<B: Backend> {
    backend: Arc<B>,
    mode: CompletionMode,
    /// The host part of handle creations, off the caller's thread, in call order.
    lane: Arc<Lane>,
}

impl<B: Backend> Clone for Group<B> {
    fn clone(&self) -> Self {
        Group { backend: Arc::clone(&self.backend), mode: self.mode, lane: Arc::clone(&self.lane) }
    }
}

impl<B: Backend> Group<B> {
    /// Wraps one rank of a backend group (waits go through the reactor:
    /// [`CompletionMode::Reactor`]).
    pub fn new(backend: B) -> Self {
        Group { backend: Arc::new(backend), mode: CompletionMode::default(), lane: Arc::default() }
    }

    /// The same group, whose operations wait in `mode` ([`CompletionMode`] says when each mode is
    /// right). Operations created afterwards use it.
    pub fn with_completion_mode(mut self, mode: CompletionMode) -> Self {
        self.mode = mode;
        self
    }

    /// How this group's operations wait.
    pub fn completion_mode(&self) -> CompletionMode {
        self.mode
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub(crate) fn backend_arc(&self) -> &Arc<B> {
        &self.backend
    }

    /// Waits (blocking) until the handle creations called so far ran their host part, so that
    /// an operation started next comes after them ([`Group::create_handle_with`]).
    pub(crate) fn after_creations(&self) {
        self.lane.wait_idle();
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.backend.rank()
    }

    /// Ranks in the group.
    pub fn num_ranks(&self) -> usize {
        self.backend.num_ranks()
    }

    /// The group config.
    pub fn config(&self) -> &GroupConfig {
        self.backend.config()
    }

    /// Whether an earlier failure poisoned the group.
    pub fn is_poisoned(&self) -> bool {
        self.backend.poison().is_poisoned()
    }

    /// Creates a routing handle from `topk_idx` `[B x K]` (collective for high-throughput, which
    /// exchanges counts; immediate for low-latency), expert-major.
    pub fn create_handle(&self, topk_idx: &B::Tensor) -> HandleFuture<B> {
        self.create_handle_with(topk_idx, &HandleOptions::default())
    }

    /// Creates a routing handle with `opts`: [`HandleOptions::layout`] chooses low-latency
    /// expert-major or rank-major outputs for every dispatch and combine on the handle (every
    /// rank must choose the same).
    ///
    /// The creation's host part ([`Backend::start_handle`]: validation, and whatever the backend
    /// waits for, such as the GPU backend's low-latency handle kernel or NCCL EP's
    /// `ncclEpCreateHandle`) runs on this group's handle thread, not on the caller's: awaiting
    /// the future never blocks the executor's thread for it, under any executor. Creations
    /// run in this rank's call order, and an operation created on this group while one is on
    /// that thread waits for it (blocking) before it starts, so the order of operations is the
    /// call order, as if the creation had run inline. It keeps a clone of `topk_idx` until then.
    pub fn create_handle_with(&self, topk_idx: &B::Tensor, opts: &HandleOptions) -> HandleFuture<B> {
        let (tx, rx) = oneshot::channel::<Created<B>>();
        let (backend, mode) = (Arc::clone(&self.backend), self.mode);
        let (topk_idx, opts) = (topk_idx.clone(), *opts);
        self.lane.submit(Box::new(move || {
            let created =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backend.start_handle(&topk_idx, &opts)));
            if let Err(Ok(Ok(HandleCreation::Collective(op)))) = tx.send(created) {
                // The future was dropped: its peers see a cancellation, as when a future holding
                // the operation is dropped.
                drop(OpDriver::new(backend, op, mode));
            }
        }));
        let pending = Pending {
            rx,
            backend: Arc::clone(&self.backend),
            mode: self.mode,
            lane: Arc::clone(&self.lane),
            span: tracing::Span::current(),
        };
        HandleFuture { state: HandleState::Pending(pending) }
    }

    /// Creates a routing handle with `opts` in `stream`'s order: resolves once the creation is
    /// enqueued, with the handle and a [`Completion`], and nothing waits on the host.
    /// Low-latency handles on GPUs over NVLink launch nothing: the handle is returned at once and
    /// keeps `topk_idx`, which its dispatches read and check in `stream`'s order (after
    /// `topk_idx`'s ready event), as NCCL EP's low-latency handles do (a handle dispatched again
    /// builds its own copy beside its second dispatch); an invalid entry becomes the error of
    /// this rank's dispatches on the handle, found at their verdicts (the peers receive the
    /// sanitized rows), instead of this creation's. Keep `topk_idx` unchanged until the
    /// dispatches on the handle ran. High-throughput handles: as
    /// `create_handle_with(..).after(stream).complete_on(stream)` ([`HandleFuture::after`],
    /// [`HandleFuture::complete_on`]). Elsewhere (the host backend, NCCL peers) the handle is
    /// built at once, as by [`Group::create_handle_with`], and the completion is done.
    pub fn create_handle_on<'s>(
        &self,
        topk_idx: &B::Tensor,
        opts: &HandleOptions,
        stream: &'s B::Stream,
    ) -> HandleOn<'s, B> {
        self.after_creations();
        let state = match self.backend.start_handle_on(topk_idx, opts, stream) {
            Ok(HandleCreation::Ready(h)) => HandleState::Ready(Some(h)),
            Ok(HandleCreation::Collective(op)) => {
                let mut d = OpDriver::new(Arc::clone(&self.backend), op, self.mode);
                // After the work enqueued on `stream` so far (the producer of `topk_idx`).
                match d.order_after(stream) {
                    Ok(()) => HandleState::Op(d),
                    Err(e) => HandleState::Failed(Some(e)),
                }
            }
            Err(e) => HandleState::Failed(Some(e)),
        };
        HandleOn { state: Some(state), stream }
    }

    /// Dispatch with default options (forward, counters on the device).
    pub fn dispatch(
        &self,
        handle: &B::Handle,
        inputs: DispatchInputs<'_, B::Tensor>,
    ) -> OpFuture<B, B::DispatchOutput> {
        self.dispatch_with(handle, inputs, &DispatchOptions::default())
    }

    /// Dispatch. The future resolves to the outputs; [`OpFuture::send_only`] stops after the
    /// send half and returns a [`Staged`] whose `.await` is the complete half.
    pub fn dispatch_with(
        &self,
        handle: &B::Handle,
        inputs: DispatchInputs<'_, B::Tensor>,
        opts: &DispatchOptions,
    ) -> OpFuture<B, B::DispatchOutput> {
        self.after_creations();
        let op = self.backend.start_dispatch(handle, inputs, opts);
        OpFuture::new(&self.backend, op, self.mode, extract_dispatch::<B>)
    }

    /// Combine with default options (forward).
    pub fn combine(&self, handle: &B::Handle, inputs: CombineInputs<'_, B::Tensor>) -> OpFuture<B, B::CombineOutput> {
        self.combine_with(handle, inputs, &CombineOptions::default())
    }

    /// Combine; see [`Group::dispatch_with`].
    pub fn combine_with(
        &self,
        handle: &B::Handle,
        inputs: CombineInputs<'_, B::Tensor>,
        opts: &CombineOptions,
    ) -> OpFuture<B, B::CombineOutput> {
        self.after_creations();
        let op = self.backend.start_combine(handle, inputs, opts);
        OpFuture::new(&self.backend, op, self.mode, extract_combine::<B>)
    }
}

fn cancelled() -> Error {
    Error::Backend("the operation was cancelled and has no result".into())
}

fn extract_dispatch<B: Backend>(o: Output<B>) -> Result<B::DispatchOutput> {
    match o {
        OpOutput::Dispatch(d) => Ok(d),
        _ => Err(cancelled()),
    }
}

fn extract_combine<B: Backend>(o: Output<B>) -> Result<B::CombineOutput> {
    match o {
        OpOutput::Combine(c) => Ok(c),
        _ => Err(cancelled()),
    }
}

/// What the handle lane hands back: [`Backend::start_handle`]'s result, or its panic.
type Created<B> = std::thread::Result<Result<HandleCreation<<B as Backend>::Handle, <B as Backend>::Op>>>;

/// A creation whose host part is on the group's handle lane.
struct Pending<B: Backend> {
    rx: oneshot::Receiver<Created<B>>,
    backend: Arc<B>,
    mode: CompletionMode,
    lane: Arc<Lane>,
    /// The caller's span when the creation was called: the operation's spans open under it.
    span: tracing::Span,
}

impl<B: Backend> Pending<B> {
    /// The state `created` leads to; a panic of the backend goes on in the caller's task.
    fn settle(self, created: std::result::Result<Created<B>, oneshot::Canceled>) -> HandleState<B> {
        match created {
            Ok(Ok(Ok(HandleCreation::Ready(h)))) => HandleState::Ready(Some(h)),
            Ok(Ok(Ok(HandleCreation::Collective(op)))) => {
                let _in = self.span.enter();
                HandleState::Op(OpDriver::new(self.backend, op, self.mode))
            }
            Ok(Ok(Err(e))) => HandleState::Failed(Some(e)),
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Err(oneshot::Canceled) => HandleState::Failed(Some(Error::Internal {
                op: "create_handle".into(),
                message: "the handle thread ended without a result".into(),
            })),
        }
    }
}

enum HandleState<B: Backend> {
    /// The host part runs on the lane.
    Pending(Pending<B>),
    Ready(Option<B::Handle>),
    Op(OpDriver<B>),
    Failed(Option<Error>),
}

impl<B: Backend> HandleState<B> {
    /// Moves a pending creation on once the lane has its result; `Pending` until then.
    fn poll_created(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let HandleState::Pending(p) = self else { return Poll::Ready(()) };
        let created = ready!(Pin::new(&mut p.rx).poll(cx));
        self.settle_with(created);
        Poll::Ready(())
    }

    /// Waits (blocking) for a pending creation's host part and moves on with its result.
    fn wait_created(&mut self) {
        let HandleState::Pending(p) = self else { return };
        p.lane.wait_idle();
        // The lane sends the result before it counts the job as run.
        let created = match p.rx.try_recv() {
            Ok(Some(c)) => Ok(c),
            Ok(None) | Err(oneshot::Canceled) => Err(oneshot::Canceled),
        };
        self.settle_with(created);
    }

    fn settle_with(&mut self, created: std::result::Result<Created<B>, oneshot::Canceled>) {
        let HandleState::Pending(p) = std::mem::replace(self, HandleState::Failed(None)) else { return };
        *self = p.settle(created);
    }
}

/// The future of [`Group::create_handle`].
pub struct HandleFuture<B: Backend> {
    state: HandleState<B>,
}

impl<B: Backend> HandleFuture<B> {
    /// Orders the creation's kernels after the work enqueued on `stream` so far, on the device
    /// (the producer of `topk_idx`, say: the router's top-k). No host wait. Low-latency handles
    /// are built when created (on a GPU over NVLink by one kernel after `topk_idx`'s ready event,
    /// the host waiting for that kernel alone) and ignore it.
    ///
    /// It waits (blocking) for the creation's host part on the group's handle thread
    /// ([`Group::create_handle_with`]), which must have made the operation it orders.
    pub fn after(mut self, stream: &B::Stream) -> Self {
        self.state.wait_created();
        if let HandleState::Op(d) = &mut self.state {
            if let Err(e) = d.order_after(stream) {
                self.state = HandleState::Failed(Some(e));
            }
        }
        self
    }

    /// Stream-ordered creation (high-throughput): resolves once the creation's kernels are
    /// enqueued, with the handle and a [`Completion`] that resolves when the device has built it
    /// (its verdict: an invalid routing anywhere, a peer's cancellation or a timeout fail it and
    /// poison the group, as any stream-ordered completion). Operations started on the handle
    /// are ordered after its kernels on the device, and `stream` waits for them too; nothing
    /// waits on the host. Its received tensors must not depend on `N`: create it with
    /// [`epflow_core::ops::RecvRows::Bound`], and read [`RoutingHandle::num_recv_tokens`] after
    /// the completion resolved (`None` before).
    ///
    /// With `RecvRows::Exact`, or where the handle is built on the host (the host backend, the
    /// NCCL transport, `EPFLOW_HT_HANDLE=host`), it resolves once the handle exists, with
    /// `stream` ordered after it: the same semantics, without the overlap. Low-latency handles
    /// are built when created: [`Group::create_handle_on`] builds them in a stream's order.
    ///
    /// [`RoutingHandle::num_recv_tokens`]: epflow_core::handle::RoutingHandle::num_recv_tokens
    pub fn complete_on(self, stream: &B::Stream) -> HandleOn<'_, B> {
        HandleOn { state: Some(self.state), stream }
    }
}

/// The future of [`HandleFuture::complete_on`]: the handle and its creation's [`Completion`].
pub struct HandleOn<'s, B: Backend> {
    state: Option<HandleState<B>>,
    stream: &'s B::Stream,
}

impl<B: Backend> Unpin for HandleOn<'_, B> {}

impl<B: Backend> Future for HandleOn<'_, B> {
    type Output = Result<(B::Handle, Completion)>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let state = this.state.as_mut().ok_or_else(|| Error::Backend("polled again".into()))?;
        ready!(state.poll_created(cx));
        let out = match state {
            HandleState::Pending(_) => Err(Error::Backend("handle creation still pending".into())),
            HandleState::Ready(h) => {
                h.take().ok_or_else(|| Error::Backend("handle already taken".into())).map(|h| (h, Completion::done()))
            }
            HandleState::Failed(e) => Err(e.take().unwrap_or_else(|| Error::Backend("polled again".into()))),
            HandleState::Op(d) => match ready!(d.poll_complete_on(cx, this.stream, StreamOrder::Ordered)) {
                Ok((OpOutput::Handle(h), completion)) => Ok((h, completion)),
                Ok(_) => Err(cancelled()),
                Err(e) => Err(e),
            },
        };
        this.state = None;
        Poll::Ready(out)
    }
}

impl<B: Backend> std::fmt::Debug for HandleOn<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandleOn").finish_non_exhaustive()
    }
}

impl<B: Backend> Unpin for HandleFuture<B> {}

impl<B: Backend> Future for HandleFuture<B> {
    type Output = Result<B::Handle>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<B::Handle>> {
        let this = self.get_mut();
        ready!(this.state.poll_created(cx));
        match &mut this.state {
            HandleState::Pending(_) => Poll::Ready(Err(Error::Backend("handle creation still pending".into()))),
            HandleState::Ready(h) => Poll::Ready(h.take().ok_or_else(|| Error::Backend("handle already taken".into()))),
            HandleState::Failed(e) => {
                Poll::Ready(Err(e.take().unwrap_or_else(|| Error::Backend("polled again".into()))))
            }
            HandleState::Op(d) => Poll::Ready(match ready!(d.poll_done(cx))? {
                OpOutput::Handle(h) => Ok(h),
                _ => Err(cancelled()),
            }),
        }
    }
}

/// A dispatch or combine that has not been awaited yet. Awaiting it runs the whole operation
/// (the synchronous form); [`OpFuture::send_only`] runs only the send half.
///
/// Dropping it at any point is safe: an operation not sent yet becomes a cancellation (the peers'
/// operation fails with [`Error::PeerCancelled`]) and the reactor still finishes this rank's
/// side, so every rank's next operation sees clean buffers.
pub struct OpFuture<B: Backend, T> {
    driver: std::result::Result<OpDriver<B>, Option<Error>>,
    extract: fn(Output<B>) -> Result<T>,
    _t: PhantomData<fn() -> T>,
}

impl<B: Backend, T> OpFuture<B, T> {
    fn new(backend: &Arc<B>, op: Result<B::Op>, mode: CompletionMode, extract: fn(Output<B>) -> Result<T>) -> Self {
        OpFuture {
            driver: op.map(|op| OpDriver::new(Arc::clone(backend), op, mode)).map_err(Some),
            extract,
            _t: PhantomData,
        }
    }

    /// Orders the send half after the work enqueued on `stream` so far, on the device (the
    /// inputs' producers, say: torch's `wait_stream`). No host wait.
    pub fn after(mut self, stream: &B::Stream) -> Self {
        if let Ok(d) = &mut self.driver {
            if let Err(e) = d.order_after(stream) {
                // Dropping the driver sends the operation as a cancellation.
                self.driver = Err(Some(e));
            }
        }
        self
    }

    /// Runs the whole operation in `stream`'s order (the synchronous form without the host
    /// wait): resolves once it is enqueued, with the outputs (usable by work enqueued on
    /// `stream` from now on) and a [`Completion`] with its verdict (a failure poisons the
    /// group, but for [`epflow_core::Error::RankMasked`]). The operation runs on its own
    /// stream, `stream` waits for it ([`StreamOrder::Ordered`]); ordered with
    /// [`OpFuture::after`] on the same stream, a high-throughput kernel runs on `stream` itself.
    /// On the GPU backend both algorithms complete this way without the host, a low-latency
    /// operation sending and receiving in one launch where the rank allows it; operations a
    /// backend cannot order on the device resolve once the host saw them finish, with `stream`
    /// ordered after them. For low-latency receive placement choices, use
    /// [`OpFuture::send_only`] and [`Staged::complete_with`].
    pub fn complete_on(self, stream: &B::Stream) -> CompleteOn<'_, B, T> {
        CompleteOn { driver: self.driver, extract: self.extract, stream, order: StreamOrder::Ordered }
    }

    /// Tags the operation's trace spans with a micro-batch index.
    pub fn micro_batch(mut self, micro_batch: u64) -> Self {
        if let Ok(d) = &mut self.driver {
            d.set_micro_batch(micro_batch);
        }
        self
    }

    /// Issues only the send half: resolves to a [`Staged`] once the transfers are issued
    /// (after waiting for a free buffer set if all are held); awaiting the `Staged` runs the
    /// complete half. Low-latency only.
    pub fn send_only(self) -> SendOnly<B, T> {
        let OpFuture { driver, extract, .. } = self;
        let driver = driver.and_then(|d| match validate_staged(d.backend_config()) {
            Ok(()) => Ok(d),
            Err(e) => Err(Some(e.into())),
        });
        SendOnly { driver: driver.map(Some), extract }
    }
}

impl<B: Backend> OpDriver<B> {
    pub(crate) fn backend_config(&self) -> &GroupConfig {
        self.backend_ref().config()
    }
}

impl<B: Backend, T> Unpin for OpFuture<B, T> {}

impl<B: Backend, T> Future for OpFuture<B, T> {
    type Output = Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let this = self.get_mut();
        match &mut this.driver {
            Ok(d) => Poll::Ready(ready!(d.poll_done(cx)).and_then(this.extract)),
            Err(e) => Poll::Ready(Err(e.take().unwrap_or_else(|| Error::Backend("polled again".into())))),
        }
    }
}

/// The future of [`OpFuture::send_only`].
pub struct SendOnly<B: Backend, T> {
    driver: std::result::Result<Option<OpDriver<B>>, Option<Error>>,
    extract: fn(Output<B>) -> Result<T>,
}

impl<B: Backend, T> Unpin for SendOnly<B, T> {}

impl<B: Backend, T> Future for SendOnly<B, T> {
    type Output = Result<Staged<B, T>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Staged<B, T>>> {
        let this = self.get_mut();
        match &mut this.driver {
            Ok(slot) => {
                let Some(d) = slot.as_mut() else { return Poll::Ready(Err(Error::Backend("polled again".into()))) };
                ready!(d.poll_sent(cx))?;
                let driver = slot.take().ok_or_else(|| Error::Backend("polled again".into()))?;
                Poll::Ready(Ok(Staged { driver, extract: this.extract }))
            }
            Err(e) => Poll::Ready(Err(e.take().unwrap_or_else(|| Error::Backend("polled again".into())))),
        }
    }
}

/// An operation whose send half is issued. Awaiting it runs the complete half (NCCL EP's
/// `ncclEpComplete`) and yields the outputs, host-observed. [`Staged::complete_on`] completes it
/// in a caller's stream order instead, with no host wait. Dropping it lets the reactor complete
/// it in the background and discard the outputs.
pub struct Staged<B: Backend, T> {
    driver: OpDriver<B>,
    extract: fn(Output<B>) -> Result<T>,
}

impl<B: Backend, T> Staged<B, T> {
    /// Completes the operation in `stream`'s order, DeepEP's receive-hook way: the complete half
    /// runs on `stream` after the work already enqueued there ([`StreamOrder::OnStream`]), and
    /// the outputs come back at once, usable by work enqueued on `stream` (or on streams that
    /// wait for it) with no host wait. The [`Completion`] resolves when the device has finished,
    /// with the verdict (if the operation failed, its group is poisoned, unless the group had
    /// masked this rank: [`epflow_core::Error::RankMasked`]). On the host backend the
    /// future resolves once the peers' data is in.
    ///
    /// The outputs' buffer set is released in stream order: when they are dropped, the next
    /// operation on the set waits on the device for the work enqueued on `stream` until then.
    ///
    /// The group's timeout runs from this call: work already queued on `stream` ahead of the
    /// receive counts against it (a stream with seconds of queued work needs a longer timeout).
    pub fn complete_on(self, stream: &B::Stream) -> CompleteOn<'_, B, T> {
        self.complete_with(stream, StreamOrder::OnStream)
    }

    /// Completes the operation on its own stream at once and makes `stream` wait for it
    /// ([`StreamOrder::Ordered`]); otherwise as [`Staged::complete_on`].
    pub fn complete_ordered(self, stream: &B::Stream) -> CompleteOn<'_, B, T> {
        self.complete_with(stream, StreamOrder::Ordered)
    }

    /// Stream-ordered completion with the placement `order`.
    pub fn complete_with(self, stream: &B::Stream, order: StreamOrder) -> CompleteOn<'_, B, T> {
        CompleteOn { driver: Ok(self.driver), extract: self.extract, stream, order }
    }
}

/// The future of [`Staged::complete_on`]: the outputs and their [`Completion`].
pub struct CompleteOn<'s, B: Backend, T> {
    /// `Err`: the operation failed to start (its error, taken once).
    driver: std::result::Result<OpDriver<B>, Option<Error>>,
    extract: fn(Output<B>) -> Result<T>,
    stream: &'s B::Stream,
    order: StreamOrder,
}

impl<B: Backend, T> Unpin for CompleteOn<'_, B, T> {}

impl<B: Backend, T> Future for CompleteOn<'_, B, T> {
    type Output = Result<(T, Completion)>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let d = match &mut this.driver {
            Ok(d) => d,
            Err(e) => return Poll::Ready(Err(e.take().unwrap_or_else(|| Error::Backend("polled again".into())))),
        };
        let out = ready!(d.poll_complete_on(cx, this.stream, this.order));
        this.driver = Err(None);
        Poll::Ready(out.and_then(|(output, completion)| (this.extract)(output).map(|t| (t, completion))))
    }
}

impl<B: Backend, T> std::fmt::Debug for CompleteOn<'_, B, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompleteOn").field("order", &self.order).finish_non_exhaustive()
    }
}

impl<B: Backend, T> Unpin for Staged<B, T> {}

impl<B: Backend, T> Future for Staged<B, T> {
    type Output = Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let this = self.get_mut();
        Poll::Ready(ready!(this.driver.poll_done(cx)).and_then(this.extract))
    }
}

impl<B: Backend> std::fmt::Debug for HandleFuture<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandleFuture").finish_non_exhaustive()
    }
}

impl<B: Backend, T> std::fmt::Debug for OpFuture<B, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpFuture").finish_non_exhaustive()
    }
}

impl<B: Backend, T> std::fmt::Debug for SendOnly<B, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendOnly").finish_non_exhaustive()
    }
}

impl<B: Backend, T> std::fmt::Debug for Staged<B, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staged").finish_non_exhaustive()
    }
}
