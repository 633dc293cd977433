//! Timing statistics and the report, printed like NCCL EP's ep_bench or as JSON.

use serde::Serialize;

/// Timings of one operation on one rank, in microseconds, and the bytes it moved.
#[derive(Clone, Debug, Default)]
pub(crate) struct RankTimes {
    pub samples_us: Vec<f64>,
    pub bytes: u64,
}

/// One operation summarised over ranks and iterations.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct OpSummary {
    pub avg_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    pub median_us: f64,
    /// Mean over ranks of (rank bytes / rank average time).
    pub gbps_avg: f64,
    pub gbps_min: f64,
    pub gbps_min_rank: usize,
    pub gbps_max: f64,
    pub gbps_max_rank: usize,
}

impl OpSummary {
    pub(crate) fn from_ranks(ranks: &[RankTimes]) -> Self {
        let all: Vec<f64> = ranks.iter().flat_map(|r| r.samples_us.iter().copied()).collect();
        let n = all.len().max(1) as f64;
        let avg = all.iter().sum::<f64>() / n;
        let mut sorted = all.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
        let per_rank: Vec<f64> = ranks
            .iter()
            .map(|r| {
                let a = r.samples_us.iter().sum::<f64>() / r.samples_us.len().max(1) as f64;
                if a > 0.0 { r.bytes as f64 / 1e3 / a } else { 0.0 }
            })
            .collect();
        let (min_rank, gbps_min) =
            per_rank.iter().copied().enumerate().min_by(|a, b| a.1.total_cmp(&b.1)).unwrap_or((0, 0.0));
        let (max_rank, gbps_max) =
            per_rank.iter().copied().enumerate().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap_or((0, 0.0));
        OpSummary {
            avg_us: avg,
            min_us: sorted.first().copied().unwrap_or(0.0),
            max_us: sorted.last().copied().unwrap_or(0.0),
            median_us: median,
            gbps_avg: per_rank.iter().sum::<f64>() / per_rank.len().max(1) as f64,
            gbps_min,
            gbps_min_rank: min_rank,
            gbps_max,
            gbps_max_rank: max_rank,
        }
    }
}

/// The validation verdict.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Validation {
    pub passed: bool,
    pub dispatch_checked: u64,
    pub dispatch_mismatched: u64,
    pub combine_checked: u64,
    pub combine_mismatched: u64,
    pub combine_max_abs_diff: f64,
    pub first_mismatch: Option<String>,
}

/// Everything `epflow bench` reports.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct BenchReport {
    pub algorithm: &'static str,
    pub backend: String,
    pub device: String,
    pub ranks: usize,
    pub tokens: usize,
    pub hidden: usize,
    pub top_k: usize,
    pub experts: usize,
    pub dtype: &'static str,
    pub staged: bool,
    /// Low-latency receive layout (`expert-major` or `rank-major`).
    pub layout: &'static str,
    pub warmup: usize,
    pub iters: usize,
    pub seed: u64,
    pub dispatch: OpSummary,
    pub combine: OpSummary,
    pub total: OpSummary,
    pub validation: Option<Validation>,
    pub device_memory_bytes_per_rank: Option<u64>,
    /// What making the GPU group cost (time, and the device memory it took, NCCL's included).
    pub setup: Option<super::setup_cost::SetupCost>,
    /// `--rank-masking`: the group was made able to mask a dead rank (none was).
    pub rank_masking: bool,
    /// Average device time (us) of dispatch send, dispatch complete, combine send, combine
    /// complete halves, when measured.
    pub halves_us: Option<[f64; 4]>,
    /// Handle creation, host clock: high-throughput, the collective count exchange; low-latency,
    /// the local routing plan and its upload.
    pub handle: Option<OpSummary>,
    /// The same creations' device time (GPU high-throughput handles: CUDA events before the
    /// creation's kernel and after it), when measured.
    pub handle_device: Option<OpSummary>,
    /// `--fresh-routing`: every iteration created a handle for a new routing; `total` is the
    /// training step (handle, forward pair, backward pair), dispatch and combine the forward ones.
    pub fresh_routing: bool,
    /// Low-latency `--fresh-routing --queued`: every queued pair ran on a new routing, its
    /// handle built in the stream's order ahead of the dispatch (counted in the dispatch).
    pub queued_fresh_routing: bool,
    /// `--graph`: one replay of the captured dispatch + combine step (GPU: device time; host
    /// backend: host clock).
    pub graph: Option<OpSummary>,
    /// `--fresh-routing`: the training step in stream order (handle, forward pair, backward
    /// pair enqueued with no host wait between them; host clock to the last verdict).
    pub stream_step: Option<OpSummary>,
    /// `--fresh-routing`: the stream-ordered step's device time (CUDA events around the five
    /// operations, enqueued behind a spin kernel).
    pub stream_step_device: Option<OpSummary>,
    /// `--fresh-routing`: the device time of that step's handle creation.
    pub stream_handle_device: Option<OpSummary>,
    /// Low-latency `--queued`: device time of dispatch and of combine, each enqueued in stream
    /// order ahead of the device (behind a spin kernel).
    pub queued: Option<[OpSummary; 2]>,
    /// Where `dispatch` and `combine` are device times (low-latency on GPUs): the host clock
    /// around each blocking dispatch and combine, ep_bench's host-observed measure.
    pub host_clock: Option<[OpSummary; 2]>,
}

impl BenchReport {
    pub(crate) fn print_text(&self) {
        let algo = if self.algorithm == "ll" { "Low Latency" } else { "High Throughput" };
        let dt = self.dtype.to_uppercase();
        println!(
            "epflow bench: algorithm={} backend={} device={} ranks={} tokens={} hidden={} top_k={} experts={} dtype={} staged={} layout={} rank_masking={} warmup={} iters={} seed={}",
            self.algorithm,
            self.backend,
            self.device,
            self.ranks,
            self.tokens,
            self.hidden,
            self.top_k,
            self.experts,
            self.dtype,
            self.staged,
            self.layout,
            self.rank_masking,
            self.warmup,
            self.iters,
            self.seed
        );
        println!("\n=== Summary ({algo}, across {} ranks) ===\n", self.ranks);
        match self.host_clock {
            Some(_) => println!(
                "--- Per operation, device time (CUDA events from before the send to after the completion; the host's\n    launch included, its wait for the completion not) ---"
            ),
            None => println!("--- Host-observed performance ---"),
        }
        print_op(&format!("Dispatch ({dt}):"), &self.dispatch);
        print_op("Combine (BF16):", &self.combine);
        if self.fresh_routing {
            println!(
                "Training step (handle + forward D+C + backward D+C, a new routing every step; the sum of the five\n  operations, each awaited behind a barrier):"
            );
            print_op("", &self.total);
            // On a device, its clock (the host clock would count the spin ahead of the step).
            match (&self.stream_step_device, &self.stream_step) {
                (Some(s), _) => {
                    println!(
                        "Training step in stream order, device time (the same five enqueued on one stream with no host\n  wait between them, RecvRows::Bound handle, behind a 300 us spin kernel as behind a previous\n  layer; CUDA events before the handle and after the backward combine):"
                    );
                    print_op("", s);
                    if let Some(h) = &self.stream_handle_device {
                        print_op("  of it, handle:", h);
                    }
                }
                (None, Some(s)) => {
                    println!(
                        "Training step in stream order (the same five enqueued with no host wait between them,\n  RecvRows::Bound handle; host clock from the barrier to the last verdict):"
                    );
                    print_op("", s);
                }
                (None, None) => {}
            }
        } else {
            print_op("Total (D+C):", &self.total);
        }
        if let Some(g) = &self.graph {
            println!("Graph replay (D+C as one captured step; device time, CUDA events around each replay):");
            print_op("", g);
            if self.total.median_us > 0.0 {
                println!("{:<18}replay median / eager D+C median = {:.2}", "", g.median_us / self.total.median_us);
            }
        }
        if let Some([d, c]) = &self.host_clock {
            println!(
                "\n--- Host-observed performance (host clock around each blocking operation, until the host saw it\n    finish: ep_bench's measure) ---"
            );
            print_op(&format!("Dispatch ({dt}):"), d);
            print_op("Combine (BF16):", c);
        }
        if let Some([d, c]) = &self.queued {
            println!(
                "\n--- Queued ahead of the device (--queued: dispatch and combine enqueued in stream order, one launch\n    each, behind a 1 ms spin kernel; CUDA events between them: kernels and the gaps between them) ---"
            );
            if self.queued_fresh_routing {
                println!(
                    "    (--fresh-routing: each pair on a new routing, its handle created in the stream's order ahead of\n    the dispatch: the dispatch's time includes reading the routing, or the handle's kernel)"
                );
            }
            print_op(&format!("Dispatch ({dt}):"), d);
            print_op("Combine (BF16):", c);
        }
        if let Some(h) = &self.handle {
            let what = match (self.algorithm, self.backend.as_str()) {
                ("ll", "nccl-ep") => "ncclEpCreateHandle",
                ("ll", "gpu") => "local: checked and numbered by one kernel, awaited (on the host with NCCL peers)",
                ("ll", _) => "local: the routing checked and planned on the host",
                _ => "collective",
            };
            println!(
                "{:<18}avg={:.2} us, min={:.2} us, median={:.2} us (host clock, {what})",
                "Handle:", h.avg_us, h.min_us, h.median_us
            );
            if let Some(h) = &self.handle_device {
                println!(
                    "{:<18}avg={:.2} us, min={:.2} us, median={:.2} us (device time of the same creations: events\n{:<18}before the kernel and after it, so with the launch's latency and waits for the peers)",
                    "", h.avg_us, h.min_us, h.median_us, ""
                );
            }
        }
        if let Some(h) = self.halves_us {
            println!(
                "\n--- Device time per half (CUDA events before send, between halves, after complete; a synchronous\n    low-latency operation run as one launch counts all of it in its send half) ---"
            );
            println!("Dispatch:          send half avg={:.2} us, complete half avg={:.2} us", h[0], h[1]);
            println!("Combine:           send half avg={:.2} us, complete half avg={:.2} us", h[2], h[3]);
        }
        if let Some(m) = self.device_memory_bytes_per_rank {
            println!("\nDevice memory of the group: {:.3} GB per rank", m as f64 / 1e9);
        }
        if let Some(c) = &self.setup {
            println!("{}", c.describe());
        }
        match &self.validation {
            None => println!("\nValidation: skipped (pass --validate)"),
            Some(v) => {
                println!(
                    "\nValidation: {} (dispatch: {} values, {} mismatched; combine: {} values, {} mismatched, max |diff| {:.3e})",
                    if v.passed { "PASSED" } else { "FAILED" },
                    v.dispatch_checked,
                    v.dispatch_mismatched,
                    v.combine_checked,
                    v.combine_mismatched,
                    v.combine_max_abs_diff
                );
                if let Some(f) = &v.first_mismatch {
                    println!("  first mismatch: {f}");
                }
            }
        }
    }
}

fn print_op(label: &str, s: &OpSummary) {
    println!(
        "{label:<18}avg={:.2} us, min={:.2} us, max={:.2} us, median={:.2} us",
        s.avg_us, s.min_us, s.max_us, s.median_us
    );
    if s.gbps_max == 0.0 {
        return; // no bytes counted (the training step of --fresh-routing)
    }
    println!(
        "{:<18}throughput: avg={:.2} GB/s, min={:.2} GB/s (rank {}), max={:.2} GB/s (rank {})",
        "", s.gbps_avg, s.gbps_min, s.gbps_min_rank, s.gbps_max, s.gbps_max_rank
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_of_two_ranks() {
        let r0 = RankTimes { samples_us: vec![10.0, 30.0], bytes: 20_000 };
        let r1 = RankTimes { samples_us: vec![20.0], bytes: 40_000 };
        let s = OpSummary::from_ranks(&[r0, r1]);
        assert_eq!(s.avg_us, 20.0);
        assert_eq!((s.min_us, s.max_us, s.median_us), (10.0, 30.0, 20.0));
        // rank 0: 20 kB / 20 us = 1 GB/s; rank 1: 40 kB / 20 us = 2 GB/s.
        assert_eq!((s.gbps_min, s.gbps_min_rank, s.gbps_max, s.gbps_max_rank), (1.0, 0, 2.0, 1));
        assert_eq!(s.gbps_avg, 1.5);
    }
}
