//! [`GpuRank::ll_launch_costs`]: the host time of launching each low-latency kernel alone, with
//! nothing else of an operation around it (a diagnostic: `epflow diag launch`).
//!
//! Every launch is a no-op on the device: its parameters name a captured step whose failure word is
//! set, so the kernel sees itself `dead` (`op_num` in `ll_base.cuh`) and returns before it reads or
//! writes anything else. What remains is the driver's work for that function: 3-6 µs for every
//! low-latency kernel on an H200 (benches/NOTES.md item 42, which also shows that item 39's "slow
//! dispatch launch" was the warm-up's first launches counted in a mean).

use std::time::{Duration, Instant};

use epflow_core::Error;

use super::GpuRank;
use crate::compile::ll_kernels::LlKernel;
use crate::device::{DeviceBuffer, bind, cuda};
use crate::op::{launch_ll_kernel, launch_ll_kernel_as};
use crate::params::LlParams;
use crate::state::shared::RankShared;

/// The host time of launching one low-latency kernel, as [`GpuRank::ll_launch_costs`] measured it.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchCost {
    /// The kernel (`ep_ll_...`).
    pub kernel: &'static str,
    /// Mean host microseconds per launch call with the GPU idle (the stream synchronized before
    /// each launch), as at the start of a synchronous operation.
    pub idle_us: f64,
    /// As `idle_us`, launched as a plain kernel (a no-op needs no resident grid): for the
    /// one-launch kernels, which operations launch cooperatively, `idle_us - plain_us` is the
    /// cooperative launch's share; the other kernels are plain launches in both columns.
    pub plain_us: f64,
    /// Mean host microseconds per launch call issued back to back (the GPU still busy with the
    /// previous ones).
    pub queued_us: f64,
    /// Mean host microseconds per launch call with the GPU idle, made right after the stream
    /// was told to wait for an event of the other channel's stream (already passed), as an
    /// operation that waits for its inputs or fences does. The wait call itself is not counted.
    pub after_wait_us: f64,
    /// As `after_wait_us`, but the host never observed the event's completion: it was recorded
    /// on the other stream, the host slept 50 µs (the idle GPU passed it meanwhile) and the
    /// stream was told to wait for it without a query, as a buffer-set fence used to be.
    pub after_unobserved_wait_us: f64,
    /// The other stream busy for 200 µs (a spin kernel), then an event recorded there, this
    /// stream told to wait for it, and the launch: a real cross-stream dependency. The wait
    /// call itself is not counted.
    pub after_pending_wait_us: f64,
}

impl LaunchCost {
    /// The bytes of the one parameter block (`LlParams`) every low-latency kernel takes, which
    /// every launch copies.
    pub const PARAMS_BYTES: usize = std::mem::size_of::<LlParams>();
}

impl GpuRank {
    /// Launches each low-latency kernel `iters` times as a device no-op on its channel's stream
    /// (the dispatch's or the combine's, as an operation would), `tokens` tokens per rank for the
    /// grid (as an operation of that size would get it), and returns the mean host time of the
    /// launch calls: GPU idle, back to back, and after waits for the other stream (an event the
    /// host saw pass, one it did not, and a pending one).
    /// Local to this rank: no peer takes part. Errors: CUDA failures, `iters == 0`.
    pub fn ll_launch_costs(&self, tokens: usize, iters: usize) -> Result<Vec<LaunchCost>, Error> {
        if iters == 0 {
            return Err(Error::Unsupported("ll_launch_costs: iters must be at least 1".into()));
        }
        let s = &self.shared;
        bind(&s.ctx)?;
        let bases = dead_step_bases(s)?;
        let mut out = Vec::with_capacity(LlKernel::ALL.len());
        for which in LlKernel::ALL {
            let chan = usize::from(which.is_combine());
            let (stream, other) = (&s.streams[chan], &s.streams[1 - chan]);
            let sync = || stream.synchronize().map_err(|e| cuda("synchronize", e));
            let p = noop_params(s, &bases, which, tokens);
            // One launch first: any one-time cost (module state, local memory) stays out.
            launch_ll_kernel(s, which, p, stream)?;
            sync()?;
            let (mut idle, mut plain) = (0.0, 0.0);
            for _ in 0..iters {
                sync()?;
                let t = Instant::now();
                launch_ll_kernel(s, which, p, stream)?;
                idle += t.elapsed().as_secs_f64();
                sync()?;
                let t = Instant::now();
                launch_ll_kernel_as(s, which, p, stream, false)?;
                plain += t.elapsed().as_secs_f64();
            }
            sync()?;
            let t = Instant::now();
            for _ in 0..iters {
                launch_ll_kernel(s, which, p, stream)?;
            }
            let queued = t.elapsed().as_secs_f64();
            sync()?;
            // One launch after `stream` was told to wait for an event of `other`: its host seconds.
            let after = |wait: OtherEvent| -> Result<f64, Error> {
                if wait == OtherEvent::Pending {
                    self.delay_on(other, Duration::from_micros(200))?;
                }
                let e = other.record_event(None).map_err(|e| cuda("record event", e))?;
                match wait {
                    OtherEvent::Seen => other.synchronize().map_err(|e| cuda("synchronize", e))?,
                    OtherEvent::Unseen => std::thread::sleep(Duration::from_micros(50)),
                    OtherEvent::Pending => {}
                }
                stream.wait(&e).map_err(|e| cuda("wait for an event", e))?;
                let t = Instant::now();
                launch_ll_kernel(s, which, p, stream)?;
                let secs = t.elapsed().as_secs_f64();
                sync()?;
                Ok(secs)
            };
            let mut after_wait = 0.0;
            for _ in 0..iters {
                after_wait += after(OtherEvent::Seen)?;
            }
            let (mut unobserved, mut pending) = (0.0, 0.0);
            for _ in 0..iters {
                unobserved += after(OtherEvent::Unseen)?;
                pending += after(OtherEvent::Pending)?;
            }
            let us = |total: f64| total * 1e6 / iters as f64;
            out.push(LaunchCost {
                kernel: which.function_name(),
                idle_us: us(idle),
                plain_us: us(plain),
                queued_us: us(queued),
                after_wait_us: us(after_wait),
                after_unobserved_wait_us: us(unobserved),
                after_pending_wait_us: us(pending),
            });
        }
        Ok(out)
    }

    /// The mean host microseconds of launching a kernel with one 8-byte parameter (`ep_spin`,
    /// told to spin 0 ns) on the dispatch stream with the GPU idle, `iters` times: the driver's
    /// cost of a launch, beside which [`GpuRank::ll_launch_costs`] shows what a low-latency
    /// kernel's launch adds (its `LlParams` block, the cooperative launch). Local to this rank.
    /// Errors: CUDA failures, `iters == 0`.
    pub fn small_launch_us(&self, iters: usize) -> Result<f64, Error> {
        if iters == 0 {
            return Err(Error::Unsupported("small_launch_us: iters must be at least 1".into()));
        }
        let stream = &self.shared.streams[0];
        let sync = || stream.synchronize().map_err(|e| cuda("synchronize", e));
        self.delay_on(stream, Duration::ZERO)?;
        let mut total = 0.0;
        for _ in 0..iters {
            sync()?;
            let t = Instant::now();
            self.delay_on(stream, Duration::ZERO)?;
            total += t.elapsed().as_secs_f64();
        }
        sync()?;
        Ok(total * 1e6 / iters as f64)
    }

    /// Launches the low-latency kernel named `function` (`ep_ll_...`) once as a device no-op on
    /// its channel's stream, as [`GpuRank::ll_launch_costs`] does, and returns the launch call's
    /// host microseconds (the stream is synchronized before returning, not counted). For
    /// `epflow diag ops`: the cost of a launch right after real operations.
    pub fn ll_noop_launch_us(&self, function: &str, tokens: usize) -> Result<f64, Error> {
        let which = LlKernel::ALL
            .into_iter()
            .find(|k| k.function_name() == function)
            .ok_or_else(|| Error::Unsupported(format!("no low-latency kernel named {function}")))?;
        let s = &self.shared;
        bind(&s.ctx)?;
        let bases = dead_step_bases(s)?;
        let stream = &s.streams[usize::from(which.is_combine())];
        let p = noop_params(s, &bases, which, tokens);
        let t = Instant::now();
        launch_ll_kernel(s, which, p, stream)?;
        let us = t.elapsed().as_secs_f64() * 1e6;
        stream.synchronize().map_err(|e| cuda("synchronize", e))?;
        Ok(us)
    }
}

/// The event of the other channel's stream a timed launch waits for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum OtherEvent {
    /// Recorded on an idle stream, which the host then synchronized.
    Seen,
    /// Recorded on an idle stream; the host slept 50 µs (the GPU passed it) without asking.
    Unseen,
    /// Recorded behind a 200 µs spin kernel: still pending at the launch.
    Pending,
}

/// A step's bases `[dispatch, combine, replay, failed, ...]` with `failed` set: every launch that
/// points at them is dead on arrival (channel c's base is word c).
fn dead_step_bases(s: &RankShared) -> Result<DeviceBuffer, Error> {
    let bases = DeviceBuffer::zeroed(&s.ctx, 8 * 8)?;
    bases.write(3 * 8, &[1u64])?;
    Ok(bases)
}

/// Parameters of `which` for `tokens` tokens that make it a device no-op (`bases` from
/// [`dead_step_bases`]).
fn noop_params(s: &RankShared, bases: &DeviceBuffer, which: LlKernel, tokens: usize) -> LlParams {
    let cfg = &s.config;
    LlParams {
        seq_base: bases.ptr() + 8 * u64::from(which.is_combine()),
        num_ranks: s.num_ranks as i32,
        max_tokens: cfg.fixed_max_tokens().unwrap_or(tokens).max(tokens) as i32,
        num_tokens: tokens as i32,
        hidden: cfg.hidden as i32,
        top_k: cfg.max_top_k as i32,
        num_local: cfg.local_experts(s.num_ranks) as i32,
        num_sets: cfg.buffer_sets as i32,
        ..LlParams::default()
    }
}
