//! Micro-batch pipelines: a sequence of steps, each dispatch → expert function → combine, with up
//! to `depth` steps in flight so that communication of one micro-batch overlaps the expert work of
//! another (two-batch overlap for `depth = 2`).
//!
//! Step `i` belongs to micro-batch `i % depth`; its dispatch input may depend on the combine
//! output of step `i - depth` (the same micro-batch one layer earlier), which is how a model with
//! several MoE layers chains them. The first `depth` steps have no predecessor.
//!
//! Schedule of [`run`]: the first `depth` dispatches are sent up front. Then, for each step `i`,
//! three things run concurrently: the expert function on step `i`'s received tokens; the
//! completion of step `i - 1`'s combine, which feeds step `i - 1 + depth`'s dispatch (sent, and
//! completed too when it is the next step); and the completion of step `i + 1`'s dispatch if it
//! was sent earlier. Then step `i`'s combine is sent. Operations are always *created* in step
//! order, so every rank numbers them the same way. The group needs at least `depth` buffer sets.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use epflow_core::backend::Backend;
use epflow_core::ops::{CombineInputs, DispatchInputs, DispatchOptions};
use epflow_core::{Algorithm, Error, Result};
use futures::join;

use crate::group::{Group, Staged};

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

/// Timings of a pipeline run.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PipelineStats {
    /// Steps run.
    pub steps: usize,
    /// Wall-clock time of the whole run.
    pub wall: Duration,
    /// Time spent awaiting dispatch and combine (summed; overlapping waits count separately).
    pub comm: Duration,
    /// Time spent in the expert function (summed).
    pub compute: Duration,
}

fn dispatch_inputs<B: Backend>(s: &StepInput<B>, algorithm: Algorithm) -> DispatchInputs<'_, B::Tensor> {
    let d = DispatchInputs::new(&s.tokens);
    if algorithm == Algorithm::HighThroughput { d.with_weights(&s.weights) } else { d }
}

fn combine_inputs<'a, B: Backend>(
    s: &'a StepInput<B>,
    experts: &'a B::Tensor,
    algorithm: Algorithm,
) -> CombineInputs<'a, B::Tensor> {
    let c = CombineInputs::new(experts);
    if algorithm == Algorithm::LowLatency { c.with_weights(&s.weights) } else { c }
}

async fn send_dispatch<B: Backend>(
    group: &Group<B>,
    i: usize,
    s: &StepInput<B>,
) -> Result<Staged<B, B::DispatchOutput>> {
    let algorithm = group.config().algorithm;
    if algorithm == Algorithm::HighThroughput {
        return Err(Error::Unsupported("pipelines stage their operations; use a low-latency group".into()));
    }
    group
        .dispatch_with(&s.handle, dispatch_inputs(s, algorithm), &s.dispatch_options)
        .micro_batch(i as u64)
        .send_only()
        .await
}

/// Runs `steps` steps with up to `depth` in flight (see the module docs).
///
/// - `input(i, prev)` returns step `i`'s inputs; `prev` is step `i - depth`'s combine output
///   (`None` for the first `depth` steps).
/// - `expert(i, received)` computes step `i`'s expert outputs from its dispatch outputs.
/// - `sink(i, output)` receives the combine outputs no later step consumes (the last `depth`).
///
/// Requires a low-latency group with at least `depth` buffer sets.
pub async fn run<B, I, E, S>(
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
    if depth == 0 || depth > group.config().buffer_sets {
        return Err(Error::Unsupported(format!(
            "pipeline depth {depth} needs 1..={} (the group's buffer sets)",
            group.config().buffer_sets
        )));
    }
    let start = Instant::now();
    let mut stats = PipelineStats { steps, ..Default::default() };
    let mut step_inputs: VecDeque<(usize, StepInput<B>)> = VecDeque::new();
    let mut staged: VecDeque<(usize, Staged<B, B::DispatchOutput>)> = VecDeque::new();
    for i in 0..depth.min(steps) {
        let s = input(i, None)?;
        staged.push_back((i, send_dispatch(group, i, &s).await?));
        step_inputs.push_back((i, s));
    }
    let mut current: Option<B::DispatchOutput> = None;
    let mut pending_combine: Option<(usize, Staged<B, B::CombineOutput>)> = None;
    for i in 0..steps {
        let out_i = match current.take() {
            Some(o) => o,
            None => {
                let (_, s) = staged.pop_front().ok_or_else(|| Error::Backend("pipeline lost a dispatch".into()))?;
                let t = Instant::now();
                let o = s.await?;
                stats.comm += t.elapsed();
                o
            }
        };
        let next_staged = if staged.front().is_some_and(|(j, _)| *j == i + 1) { staged.pop_front() } else { None };
        let prev_combine = pending_combine.take();
        let compute = async {
            let t = Instant::now();
            let y = expert(i, &out_i).await;
            (y, t.elapsed())
        };
        // Combine of step i - 1 → dispatch of step i - 1 + depth (completed here too if it is the next step).
        let chain = async {
            let t = Instant::now();
            let mut issued = None;
            let mut ready_next = None;
            if let Some((j, c)) = prev_combine {
                let co = c.await?;
                let k = j + depth;
                if k < steps {
                    let s = input(k, Some(co))?;
                    let st = send_dispatch(group, k, &s).await?;
                    if k == i + 1 {
                        ready_next = Some(st.await?);
                    } else {
                        issued = Some((k, st));
                    }
                    step_inputs.push_back((k, s));
                } else {
                    sink(j, co);
                }
            }
            Ok::<_, Error>((issued, ready_next, t.elapsed()))
        };
        let next = async {
            let t = Instant::now();
            match next_staged {
                Some((_, s)) => s.await.map(|o| (Some(o), t.elapsed())),
                None => Ok((None, Duration::ZERO)),
            }
        };
        let ((y, tc), chained, nexted) = join!(compute, chain, next);
        let (issued, ready_next, t_chain) = chained?;
        let (out_next, t_next) = nexted?;
        stats.compute += tc;
        stats.comm += t_chain + t_next;
        let y = y?;
        drop(out_i);
        if let Some(st) = issued {
            staged.push_back(st);
        }
        current = out_next.or(ready_next);
        let pos = step_inputs
            .iter()
            .position(|(j, _)| *j == i)
            .ok_or_else(|| Error::Backend("pipeline lost a step".into()))?;
        let (_, s) = step_inputs.remove(pos).ok_or_else(|| Error::Backend("pipeline lost a step".into()))?;
        let c = group.combine(&s.handle, combine_inputs(&s, &y, algorithm)).micro_batch(i as u64).send_only().await?;
        pending_combine = Some((i, c));
    }
    if let Some((j, c)) = pending_combine {
        let t = Instant::now();
        let co = c.await?;
        stats.comm += t.elapsed();
        sink(j, co);
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
        let t = Instant::now();
        let y = expert(i, &d).await?;
        stats.compute += t.elapsed();
        drop(d);
        let t = Instant::now();
        let c = group.combine(&s.handle, combine_inputs(&s, &y, algorithm)).micro_batch(i as u64).await?;
        stats.comm += t.elapsed();
        outputs.push_back((i, c));
    }
    for (i, o) in outputs {
        sink(i, o);
    }
    stats.wall = start.elapsed();
    Ok(stats)
}
