//! Low-latency `--queued`: dispatch and combine enqueued in stream order ahead of the device,
//! timed on the device.

use std::borrow::Cow;
use std::time::Duration;

use epflow_core::Error;
use epflow_core::backend::{Backend, blocking_combine_on, blocking_dispatch_on, blocking_handle_on};
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions};

use super::rank::{BenchRank, LoopPlan};
use super::stats::{OpSummary, RankTimes};

/// The spin ahead of a `--queued` pair: far longer than the host takes to enqueue a dispatch
/// and a combine (tens of microseconds each; the warning below says when it was not).
const QUEUED_LEAD: Duration = Duration::from_millis(1);

/// Low-latency `--queued`: per iteration (after a barrier), the dispatch and the combine
/// enqueued on `stream` in stream order (each a whole operation: one launch on GPUs), behind a
/// spin kernel, so that the device reaches them with both already queued and never waits for
/// the host's launches; then both verdicts. Returns the device time of the dispatch (from the
/// end of the spin to after it) and of the combine (from there to after the combine): the
/// operations' own device time and the gap between the kernels, what NCCL EP's CUPTI kernel
/// column counts without the gaps. The combine's input is `fixed` (rank-major sums, or a kept
/// buffer standing for an FP8 dispatch's experts), else the identity experts' view of the
/// dispatched rows; `weights` are the combine's top-k weights (expert-major). With `fresh`
/// (`--fresh-routing`: routings and the handle options), each pair runs on a new handle of the
/// next routing, created in `stream`'s order right after the spin (`blocking_handle_on`: on
/// GPUs nothing waits, and the dispatch reads the routing), so the dispatch's device time
/// includes what a new routing costs it. The operations' own timing events are off meanwhile.
/// Empty times where the backend has no device clock.
#[allow(clippy::too_many_arguments)]
pub(super) fn queued_pairs<R: BenchRank>(
    r: &R,
    plan: &LoopPlan,
    stream: &<R::B as Backend>::Stream,
    handle: &<R::B as Backend>::Handle,
    inputs: DispatchInputs<'_, <R::B as Backend>::Tensor>,
    fixed: Option<&<R::B as Backend>::Tensor>,
    weights: Option<&<R::B as Backend>::Tensor>,
    fresh: Option<(&[<R::B as Backend>::Tensor], &HandleOptions)>,
) -> Result<[RankTimes; 2], Error>
where
    <R::B as Backend>::Tensor: Clone,
{
    let b = r.backend();
    let (dopts, copts) = (DispatchOptions::default(), CombineOptions::default());
    let mut times = [RankTimes::default(), RankTimes::default()];
    let mut late = 0;
    // Only the clock's events on the stream between the spin and the pair's end; the
    // operations' own timing comes back on however this returns.
    r.set_op_timing(false);
    let _restore = OpTimingBack(r);
    // Host time (us) to enqueue the clock, the dispatch and the combine, per timed iteration.
    let mut enqueue: [RankTimes; 3] = Default::default();
    for i in 0..plan.warmup + plan.iters {
        r.barrier();
        let t0 = std::time::Instant::now();
        let Some(mut clock) = r.start_device_clock(stream, QUEUED_LEAD)? else {
            if b.rank() == 0 {
                eprintln!("note: --queued: this backend has no device clock (GPU backend only)");
            }
            return Ok(Default::default());
        };
        let t1 = std::time::Instant::now();
        let fresh_handle = match fresh {
            Some((routings, opts)) => Some(blocking_handle_on(b, &routings[i % routings.len()], opts, stream)?),
            None => None,
        };
        let handle = fresh_handle.as_ref().map_or(handle, |(h, _)| h);
        let (d, ds) = blocking_dispatch_on(b, handle, inputs, &dopts, stream)?;
        clock.lap()?;
        let t2 = std::time::Instant::now();
        let y = match fixed {
            Some(t) => Cow::Borrowed(t),
            None => r.identity_experts(&d)?,
        };
        let mut cin = CombineInputs::new(&*y);
        if let Some(w) = weights {
            cin = cin.with_weights(w);
        }
        let (c, cs) = blocking_combine_on(b, handle, cin, &copts, stream)?;
        clock.stop()?;
        let was_late = clock.started()?;
        let t3 = std::time::Instant::now();
        ds.settle()?;
        cs.settle()?;
        if let Some((_, Some(created))) = fresh_handle {
            created.settle()?;
        }
        let (total, disp) = clock.elapsed_us()?;
        drop((c, y));
        drop(d);
        if i >= plan.warmup {
            times[0].samples_us.push(disp);
            times[1].samples_us.push(total - disp);
            late += usize::from(was_late);
            for (v, (a, z)) in enqueue.iter_mut().zip([(t0, t1), (t1, t2), (t2, t3)]) {
                v.samples_us.push((z - a).as_secs_f64() * 1e6);
            }
        }
    }
    if late > 0 {
        let med = |t: &RankTimes| OpSummary::from_ranks(std::slice::from_ref(t)).median_us;
        let [c, d, k] = &enqueue;
        eprintln!(
            "warning: --queued, rank {}: in {late} of {} iterations the device reached the pair before the host had \
             enqueued it (those times include the host's lag); host enqueue medians: clock {:.1} us, dispatch {:.1} \
             us, combine {:.1} us, lead {} us",
            b.rank(),
            plan.iters,
            med(c),
            med(d),
            med(k),
            QUEUED_LEAD.as_micros()
        );
    }
    Ok(times)
}

/// Turns the operations' own timing back on when dropped ([`BenchRank::set_op_timing`]).
struct OpTimingBack<'a, R: BenchRank>(&'a R);

impl<R: BenchRank> Drop for OpTimingBack<'_, R> {
    fn drop(&mut self) {
        self.0.set_op_timing(true);
    }
}
