//! [`GpuRank::ll_launch_costs`]: the host time of launching each low-latency kernel alone, with
//! nothing else of an operation around it (a diagnostic: `epflow diag launch`).
//!
//! Every launch is a no-op on the device: its parameters name a captured step whose failure word
//! is set, so the kernel sees itself `dead` (`op_num` in `ll.cu`) and returns before it reads or
//! writes anything else. What remains is the driver's work for that function: benches/NOTES.md
//! item 39 found the dispatch receive's launch at 13-24 µs of host time against 3.4-5.6 µs for
//! every other low-latency kernel, inside real operations.

use std::time::Instant;

use epflow_core::Error;

use super::GpuRank;
use crate::device::{DeviceBuffer, bind, cuda};
use crate::ll::geometry::LlKernel;
use crate::op::launch_ll_kernel;
use crate::params::LlParams;

/// The host time of launching one low-latency kernel, as [`GpuRank::ll_launch_costs`] measured it.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchCost {
    /// The kernel (`ep_ll_...`).
    pub kernel: &'static str,
    /// Mean host microseconds per launch call with the GPU idle (the stream synchronized before
    /// each launch), as at the start of a synchronous operation.
    pub idle_us: f64,
    /// Mean host microseconds per launch call issued back to back (the GPU still busy with the
    /// previous ones).
    pub queued_us: f64,
}

impl GpuRank {
    /// Launches each low-latency kernel `iters` times as a device no-op on this rank's dispatch
    /// stream, `tokens` tokens per rank for the grid (as an operation of that size would get
    /// it), and returns the mean host time of the launch calls, GPU idle and back to back.
    /// Local to this rank: no peer takes part. Errors: CUDA failures, `iters == 0`.
    pub fn ll_launch_costs(&self, tokens: usize, iters: usize) -> Result<Vec<LaunchCost>, Error> {
        if iters == 0 {
            return Err(Error::Unsupported("ll_launch_costs: iters must be at least 1".into()));
        }
        let s = &self.shared;
        bind(&s.ctx)?;
        let cfg = &s.config;
        // A step's bases `[dispatch, combine, replay, failed, ...]` with `failed` set: every
        // launch that points at them is dead on arrival (channel c's base is word c).
        let bases = DeviceBuffer::zeroed(&s.ctx, 8 * 8)?;
        bases.write(3 * 8, &[1u64])?;
        let stream = &s.streams[0];
        let sync = || stream.synchronize().map_err(|e| cuda("synchronize", e));
        let mut out = Vec::with_capacity(LlKernel::ALL.len());
        for which in LlKernel::ALL {
            let chan = u64::from(which.is_combine());
            let p = LlParams {
                seq_base: bases.ptr() + 8 * chan,
                num_ranks: s.num_ranks as i32,
                max_tokens: cfg.fixed_max_tokens().unwrap_or(tokens).max(tokens) as i32,
                num_tokens: tokens as i32,
                hidden: cfg.hidden as i32,
                top_k: cfg.max_top_k as i32,
                num_local: cfg.local_experts(s.num_ranks) as i32,
                num_sets: cfg.buffer_sets as i32,
                ..LlParams::default()
            };
            // One launch first: any one-time cost (module state, local memory) stays out.
            launch_ll_kernel(s, which, p, stream)?;
            sync()?;
            let mut idle = 0.0;
            for _ in 0..iters {
                sync()?;
                let t = Instant::now();
                launch_ll_kernel(s, which, p, stream)?;
                idle += t.elapsed().as_secs_f64();
            }
            sync()?;
            let t = Instant::now();
            for _ in 0..iters {
                launch_ll_kernel(s, which, p, stream)?;
            }
            let queued = t.elapsed().as_secs_f64();
            sync()?;
            let us = |total: f64| total * 1e6 / iters as f64;
            out.push(LaunchCost { kernel: which.function_name(), idle_us: us(idle), queued_us: us(queued) });
        }
        Ok(out)
    }
}
