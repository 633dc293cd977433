//! Micro-batch pipelines: a sequence of steps, each dispatch → expert function → combine, with up
//! to `depth` steps in flight so that communication of one micro-batch overlaps the expert work of
//! another (two-batch overlap for `depth = 2`).
//!
//! Step `i` belongs to micro-batch `i % depth`; its dispatch input may depend on the combine
//! output of step `i - depth` (the same micro-batch one layer earlier), which is how a model with
//! several MoE layers chains them. The first `depth` steps have no predecessor.
//!
//! Schedule: the first `depth` dispatches are sent up front. Then, for each step `i`, three
//! things run concurrently: the expert function on step `i`'s received tokens; the completion of
//! step `i - 1`'s combine, which feeds step `i - 1 + depth`'s dispatch (sent, and completed too
//! when it is the next step); and the completion of step `i + 1`'s dispatch if it was sent
//! earlier. Then step `i`'s combine is sent. Operations are always *created* in step order, so
//! every rank numbers them the same way. The group needs at least `depth` buffer sets.
//!
//! A high-throughput group has no send-only form: its operations run whole when issued (in the
//! step's stream order, or awaited on the host), so in a stream-ordered pipeline one micro-batch's
//! dispatch and combine still overlap the others' expert work.
//!
//! Two ways to complete the operations:
//!
//! - [`run`]: every completion is awaited on the host (the outputs are host-observed). Right for
//!   the host backend, and for expert functions that need host data (counts on the host).
//! - [`run_on_streams`]: GPU pipelines. Micro-batch `m` owns stream `streams[m]`; every
//!   operation of its steps is ordered after that stream ([`crate::OpFuture::after`]) and
//!   completed on it ([`crate::Staged::complete_with`]), and the expert function only *enqueues*
//!   its work there. The host enqueues step `i + 1` before step `i` has run; it waits only to
//!   recycle buffer sets (a set is reused once the host has seen the operation that used it
//!   finish, and on the device once its outputs' readers are done) and for its turn. Each
//!   operation's verdict is collected in the background and checked before `run_on_streams`
//!   returns. On the host backend it behaves as [`run`].

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use epflow_core::backend::{Backend, StreamOrder};
use epflow_core::ops::{CombineInputs, DispatchInputs, DispatchOptions};
use epflow_core::{Algorithm, Error, Result};
use futures::join;

use crate::completion::Completion;
use crate::group::{Group, OpFuture, Staged};

/// The inputs of one step.
#[derive(Debug)]
pub struct StepInput<B: Backend> {
    /// The step's routing handle.
    pub handle: B::Handle,
    /// Tokens `[B x H]` to dispatch.
    pub tokens: B::Tensor,
    /// Top-k weights `[B x K]`: applied by low-latency combine, sent by high-throughput dispatch.
    pub weights: B::Tensor,
    /// Options of the step's dispatch (e.g. counters in host memory for the expert function).
    pub dispatch_options: DispatchOptions,
}

/// Timings of a pipeline run, as the host saw them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PipelineStats {
    /// Steps run.
    pub steps: usize,
    /// Wall-clock time of the whole run (for [`run_on_streams`]: until the device finished).
    pub wall: Duration,
    /// Time spent awaiting dispatch and combine (summed; overlapping waits count separately).
    /// With [`run_on_streams`]: waits for turns and buffer sets only.
    pub comm: Duration,
    /// Time spent in the expert function (summed). With [`run_on_streams`]: enqueueing it.
    pub compute: Duration,
}

/// What a step keeps until its combine: the handle and the weights (not the tokens: they may
/// hold the buffer set of the previous layer's combine, which this step's combine reuses).
struct Pending<B: Backend> {
    step: usize,
    handle: B::Handle,
    weights: B::Tensor,
}

fn dispatch_inputs<B: Backend>(s: &StepInput<B>, algorithm: Algorithm) -> DispatchInputs<'_, B::Tensor> {
    let d = DispatchInputs::new(&s.tokens);
    if algorithm == Algorithm::HighThroughput { d.with_weights(&s.weights) } else { d }
}

fn combine_inputs<'a, B: Backend>(
    weights: &'a B::Tensor,
    experts: &'a B::Tensor,
    algorithm: Algorithm,
) -> CombineInputs<'a, B::Tensor> {
    let c = CombineInputs::new(experts);
    if algorithm == Algorithm::LowLatency { c.with_weights(weights) } else { c }
}

/// How a pipeline completes its operations: on the host, or in the order of one stream per
/// micro-batch.
struct Lanes<'s, B: Backend> {
    depth: usize,
    streams: Option<(&'s [B::Stream], StreamOrder)>,
}

impl<B: Backend> Lanes<'_, B> {
    fn stream(&self, step: usize) -> Option<&B::Stream> {
        self.streams.map(|(s, _)| &s[step % self.depth])
    }
}

/// The completions of stream-ordered operations not yet known to be done.
struct Verdicts(VecDeque<Completion>);

impl Verdicts {
    /// Drops the settled ones at the front, failing on the first error.
    fn reap(&mut self) -> Result<()> {
        while let Some(c) = self.0.front() {
            if !c.is_done() {
                break;
            }
            if let Some(c) = self.0.pop_front() {
                futures::executor::block_on(c)?;
            }
        }
        Ok(())
    }
}

/// An operation the pipeline issued: a low-latency send half waiting for its complete half, or
/// a high-throughput operation, which has no send-only form, run whole when issued (in the
/// step's stream order with its verdict collected with the others, or awaited on the host).
// The low-latency variant is the common one: boxing it would allocate once per operation.
#[allow(clippy::large_enum_variant)]
enum Sent<B: Backend, T> {
    Staged(Staged<B, T>),
    Whole(T),
}

/// Issues `op` of step `step`: its send half (low-latency), or the whole operation
/// (high-throughput).
async fn issue<B: Backend, T>(
    op: OpFuture<B, T>,
    lanes: &Lanes<'_, B>,
    step: usize,
    verdicts: &std::sync::Mutex<Verdicts>,
    algorithm: Algorithm,
) -> Result<Sent<B, T>> {
    if algorithm == Algorithm::LowLatency {
        return Ok(Sent::Staged(op.send_only().await?));
    }
    match lanes.stream(step) {
        Some(stream) => {
            let (out, completion) = op.complete_on(stream).await?;
            verdicts.lock().unwrap_or_else(|e| e.into_inner()).0.push_back(completion);
            Ok(Sent::Whole(out))
        }
        None => Ok(Sent::Whole(op.await?)),
    }
}

/// Completes an issued operation of step `step`: awaited on the host, or on the step's stream.
async fn complete<B: Backend, T>(
    lanes: &Lanes<'_, B>,
    step: usize,
    sent: Sent<B, T>,
    verdicts: &std::sync::Mutex<Verdicts>,
) -> Result<T> {
    let staged = match sent {
        Sent::Whole(out) => return Ok(out),
        Sent::Staged(staged) => staged,
    };
    match (lanes.streams, lanes.stream(step)) {
        (Some((_, order)), Some(stream)) => {
            let (out, completion) = staged.complete_with(stream, order).await?;
            verdicts.lock().unwrap_or_else(|e| e.into_inner()).0.push_back(completion);
            Ok(out)
        }
        _ => staged.await,
    }
}

async fn send_dispatch<B: Backend>(
    group: &Group<B>,
    lanes: &Lanes<'_, B>,
    i: usize,
    s: &StepInput<B>,
    verdicts: &std::sync::Mutex<Verdicts>,
) -> Result<Sent<B, B::DispatchOutput>> {
    let algorithm = group.config().algorithm;
    let mut op = group.dispatch_with(&s.handle, dispatch_inputs(s, algorithm), &s.dispatch_options);
    if let Some(stream) = lanes.stream(i) {
        op = op.after(stream);
    }
    issue(op.micro_batch(i as u64), lanes, i, verdicts, algorithm).await
}

/// Runs `steps` steps with up to `depth` in flight, every completion awaited on the host (see
/// the module docs).
///
/// - `input(i, prev)` returns step `i`'s inputs; `prev` is step `i - depth`'s combine output
///   (`None` for the first `depth` steps).
/// - `expert(i, received)` computes step `i`'s expert outputs from its dispatch outputs.
/// - `sink(i, output)` receives the combine outputs no later step consumes (the last `depth`).
///
/// Requires a group with at least `depth` buffer sets. A high-throughput group has no send-only
/// form: each of its operations runs whole when issued, awaited here on the host.
pub async fn run<B, I, E, S>(
    group: &Group<B>,
    steps: usize,
    depth: usize,
    input: I,
    mut expert: E,
    sink: S,
) -> Result<PipelineStats>
where
    B: Backend,
    I: FnMut(usize, Option<B::CombineOutput>) -> Result<StepInput<B>>,
    E: AsyncFnMut(usize, &B::DispatchOutput) -> Result<B::Tensor>,
    S: FnMut(usize, B::CombineOutput),
{
    let lanes = Lanes { depth, streams: None };
    run_lanes(group, steps, lanes, input, Expert::<E, _>::Plain(&mut expert, no_stream::<B>), sink).await
}

/// The expert function of a pipeline: awaited ([`run`]) or enqueueing on the step's stream
/// ([`run_on_streams`]); the other variant's type is filled with a function never called.
enum Expert<'e, P, S> {
    Plain(&'e mut P, S),
    Streamed(&'e mut S, P),
}

async fn no_stream<B: Backend>(_: usize, _: &B::Stream, _: &B::DispatchOutput) -> Result<B::Tensor> {
    Err(Error::Backend("host-awaited pipeline step given a stream".into()))
}

async fn no_plain<B: Backend>(_: usize, _: &B::DispatchOutput) -> Result<B::Tensor> {
    Err(Error::Backend("stream-ordered pipeline step without a stream".into()))
}

/// Runs `steps` steps with `streams.len()` micro-batches in flight, in stream order (see the
/// module docs): micro-batch `m` (steps `i` with `i % streams.len() == m`) runs on `streams[m]`.
///
/// - `input(i, prev)` returns step `i`'s inputs; `prev` is step `i - depth`'s combine output,
///   ready in the order of the step's stream (pass its tensors straight on: the dispatch is
///   ordered after the stream, and the output's buffer set is held until the dispatch has read
///   it).
/// - `expert(i, stream, received)` *enqueues* step `i`'s expert work on `stream` and returns its
///   output tensor, ready in `stream`'s order; it should not wait for the device (the counters
///   are in device memory: [`epflow_core::ops::CountsLocation::Device`]).
/// - `sink(i, output)` receives the combine outputs no later step consumes, ready in the order
///   of their stream.
/// - `order`: where the complete halves run ([`StreamOrder::OnStream`]: on the micro-batch's
///   stream, after its earlier work, as DeepEP's receive hook; [`StreamOrder::Ordered`]: on the
///   group's communication streams, the micro-batch's stream waiting for them).
///
/// Requires a group with at least `streams.len()` buffer sets; a high-throughput group's
/// operations run whole in the step's stream order when issued ([`crate::OpFuture::complete_on`]).
/// Returns once the device has finished every operation, with the first error any of them
/// reported.
pub async fn run_on_streams<B, I, E, S>(
    group: &Group<B>,
    steps: usize,
    streams: &[B::Stream],
    order: StreamOrder,
    input: I,
    expert: E,
    sink: S,
) -> Result<PipelineStats>
where
    B: Backend,
    I: FnMut(usize, Option<B::CombineOutput>) -> Result<StepInput<B>>,
    E: AsyncFnMut(usize, &B::Stream, &B::DispatchOutput) -> Result<B::Tensor>,
    S: FnMut(usize, B::CombineOutput),
{
    let mut expert = expert;
    let lanes = Lanes { depth: streams.len(), streams: Some((streams, order)) };
    run_lanes(group, steps, lanes, input, Expert::Streamed(&mut expert, no_plain::<B>), sink).await
}

async fn run_lanes<B, I, P, E, S>(
    group: &Group<B>,
    steps: usize,
    lanes: Lanes<'_, B>,
    mut input: I,
    mut expert: Expert<'_, P, E>,
    mut sink: S,
) -> Result<PipelineStats>
where
    B: Backend,
    I: FnMut(usize, Option<B::CombineOutput>) -> Result<StepInput<B>>,
    P: AsyncFnMut(usize, &B::DispatchOutput) -> Result<B::Tensor>,
    E: AsyncFnMut(usize, &B::Stream, &B::DispatchOutput) -> Result<B::Tensor>,
    S: FnMut(usize, B::CombineOutput),
{
    let algorithm = group.config().algorithm;
    let depth = lanes.depth;
    if depth == 0 || depth > group.config().buffer_sets {
        return Err(Error::Unsupported(format!(
            "pipeline depth {depth} needs 1..={} (the group's buffer sets)",
            group.config().buffer_sets
        )));
    }
    let start = Instant::now();
    let verdicts = std::sync::Mutex::new(Verdicts(VecDeque::new()));
    let mut stats = PipelineStats { steps, ..Default::default() };
    let mut pending: VecDeque<Pending<B>> = VecDeque::new();
    let mut staged: VecDeque<(usize, Sent<B, B::DispatchOutput>)> = VecDeque::new();
    for i in 0..depth.min(steps) {
        let s = input(i, None)?;
        staged.push_back((i, send_dispatch(group, &lanes, i, &s, &verdicts).await?));
        pending.push_back(Pending { step: i, handle: s.handle, weights: s.weights });
    }
    let mut current: Option<B::DispatchOutput> = None;
    let mut pending_combine: Option<(usize, Sent<B, B::CombineOutput>)> = None;
    for i in 0..steps {
        verdicts.lock().unwrap_or_else(|e| e.into_inner()).reap()?;
        let out_i = match current.take() {
            Some(o) => o,
            None => {
                if staged.front().is_none_or(|(j, _)| *j != i) {
                    // Depth 1: step i's dispatch reads step i - 1's combine output.
                    if let Some((j, c)) = pending_combine.take().filter(|(j, _)| j + depth == i) {
                        let t = Instant::now();
                        let co = complete(&lanes, j, c, &verdicts).await?;
                        let s = input(i, Some(co))?;
                        staged.push_front((i, send_dispatch(group, &lanes, i, &s, &verdicts).await?));
                        pending.push_back(Pending { step: i, handle: s.handle, weights: s.weights });
                        stats.comm += t.elapsed();
                    }
                }
                let (_, s) = staged.pop_front().ok_or_else(|| Error::Backend("pipeline lost a dispatch".into()))?;
                let t = Instant::now();
                let o = complete(&lanes, i, s, &verdicts).await?;
                stats.comm += t.elapsed();
                o
            }
        };
        let next_staged = if staged.front().is_some_and(|(j, _)| *j == i + 1) { staged.pop_front() } else { None };
        let prev_combine = pending_combine.take();
        let compute = async {
            let t = Instant::now();
            let y = match (&mut expert, lanes.stream(i)) {
                (Expert::Plain(e, _), _) => e(i, &out_i).await,
                (Expert::Streamed(e, _), Some(stream)) => e(i, stream, &out_i).await,
                (Expert::Streamed(_, _), None) => Err(Error::Backend("stream-ordered step without a stream".into())),
            };
            (y, t.elapsed())
        };
        // Combine of step i - 1 → dispatch of step i - 1 + depth (completed here too if it is the next step).
        let chain = async {
            let t = Instant::now();
            let mut issued = None;
            let mut ready_next = None;
            let mut kept = None;
            if let Some((j, c)) = prev_combine {
                let co = complete(&lanes, j, c, &verdicts).await?;
                let k = j + depth;
                if k < steps {
                    let s = input(k, Some(co))?;
                    let st = send_dispatch(group, &lanes, k, &s, &verdicts).await?;
                    let StepInput { handle, tokens, weights, .. } = s;
                    drop(tokens);
                    kept = Some(Pending { step: k, handle, weights });
                    if k == i + 1 {
                        ready_next = Some(complete(&lanes, k, st, &verdicts).await?);
                    } else {
                        issued = Some((k, st));
                    }
                } else {
                    sink(j, co);
                }
            }
            Ok::<_, Error>((issued, ready_next, kept, t.elapsed()))
        };
        let next = async {
            let t = Instant::now();
            match next_staged {
                Some((k, s)) => complete(&lanes, k, s, &verdicts).await.map(|o| (Some(o), t.elapsed())),
                None => Ok((None, Duration::ZERO)),
            }
        };
        let ((y, tc), chained, nexted) = join!(compute, chain, next);
        let (issued, ready_next, kept, t_chain) = chained?;
        let (out_next, t_next) = nexted?;
        stats.compute += tc;
        stats.comm += t_chain + t_next;
        let y = y?;
        drop(out_i);
        if let Some(st) = issued {
            staged.push_back(st);
        }
        pending.extend(kept);
        current = out_next.or(ready_next);
        let pos =
            pending.iter().position(|p| p.step == i).ok_or_else(|| Error::Backend("pipeline lost a step".into()))?;
        let p = pending.remove(pos).ok_or_else(|| Error::Backend("pipeline lost a step".into()))?;
        let mut op = group.combine(&p.handle, combine_inputs::<B>(&p.weights, &y, algorithm)).micro_batch(i as u64);
        if let Some(stream) = lanes.stream(i) {
            op = op.after(stream);
        }
        let t = Instant::now();
        let c = issue(op, &lanes, i, &verdicts, algorithm).await?;
        stats.comm += t.elapsed();
        pending_combine = Some((i, c));
    }
    if let Some((j, c)) = pending_combine {
        let t = Instant::now();
        let co = complete(&lanes, j, c, &verdicts).await?;
        stats.comm += t.elapsed();
        sink(j, co);
    }
    // Every operation's verdict: the device has finished them all.
    let rest = std::mem::take(&mut verdicts.lock().unwrap_or_else(|e| e.into_inner()).0);
    for c in rest {
        c.await?;
    }
    stats.wall = start.elapsed();
    Ok(stats)
}

/// Runs the same steps one after the other, nothing overlapped: the baseline of [`run`].
pub async fn run_serial<B, I, E, S>(
    group: &Group<B>,
    steps: usize,
    depth: usize,
    mut input: I,
    mut expert: E,
    mut sink: S,
) -> Result<PipelineStats>
where
    B: Backend,
    I: FnMut(usize, Option<B::CombineOutput>) -> Result<StepInput<B>>,
    E: AsyncFnMut(usize, &B::DispatchOutput) -> Result<B::Tensor>,
    S: FnMut(usize, B::CombineOutput),
{
    let algorithm = group.config().algorithm;
    let start = Instant::now();
    let mut stats = PipelineStats { steps, ..Default::default() };
    let mut outputs: VecDeque<(usize, B::CombineOutput)> = VecDeque::new();
    for i in 0..steps {
        let prev = if i >= depth { outputs.pop_front().map(|(_, o)| o) } else { None };
        let s = input(i, prev)?;
        let t = Instant::now();
        let d = group
            .dispatch_with(&s.handle, dispatch_inputs(&s, algorithm), &s.dispatch_options)
            .micro_batch(i as u64)
            .await?;
        stats.comm += t.elapsed();
        // The tokens may hold the buffer set this step's combine reuses: drop them now (a
        // partial move would keep them to the end of the iteration).
        let StepInput { handle, tokens, weights, .. } = s;
        drop(tokens);
        let s = Pending::<B> { step: i, handle, weights };
        let t = Instant::now();
        let y = expert(i, &d).await?;
        stats.compute += t.elapsed();
        drop(d);
        let t = Instant::now();
        let c = group.combine(&s.handle, combine_inputs::<B>(&s.weights, &y, algorithm)).micro_batch(i as u64).await?;
        stats.comm += t.elapsed();
        outputs.push_back((i, c));
    }
    for (i, o) in outputs {
        sink(i, o);
    }
    stats.wall = start.elapsed();
    Ok(stats)
}
