//! The benchmark with one process per GPU (started by `epflow launch`): each process runs its
//! rank; an NCCL barrier separates iterations; rank 0 gathers every rank's timings and prints.

use epflow_core::scenario::Scenario;
use epflow_core::verify::Report;
use epflow_core::workload::RoutingKind;
use epflow_kernels::GpuWorld;
use epflow_kernels::setup::bootstrap::{LaunchEnv, all_gather, barrier};

use super::rank::LoopPlan;
use super::runner::{HANDLE_SAMPLES, RankResult, run_rank};
use super::stats::{BenchReport, RankTimes};
use super::{BenchError, check_host_memory, config_from_args, references, summarise};
use crate::cli::{BackendArg, BenchArgs};

fn encode(r: &RankResult, iters: usize) -> Vec<f64> {
    let mut v = Vec::new();
    for t in [&r.handle, &r.handle_device] {
        v.extend(t.samples_us.iter().copied().chain(std::iter::repeat(f64::NAN)).take(HANDLE_SAMPLES.max(iters)));
    }
    for t in [&r.dispatch, &r.combine, &r.total] {
        v.extend(t.samples_us.iter().copied().chain(std::iter::repeat(0.0)).take(iters));
        v.push(t.bytes as f64);
    }
    for h in &r.halves {
        v.push(if h.is_empty() { 0.0 } else { h.iter().sum::<f64>() / h.len() as f64 });
    }
    for t in [
        &r.graph,
        &r.stream_step,
        &r.stream_step_device,
        &r.stream_handle_device,
        &r.queued[0],
        &r.queued[1],
        &r.host_clock[0],
        &r.host_clock[1],
    ] {
        v.extend(t.samples_us.iter().copied().chain(std::iter::repeat(f64::NAN)).take(iters));
    }
    for c in [&r.dispatch_check, &r.combine_check] {
        match c {
            Some(rep) => v.extend([1.0, rep.checked as f64, rep.mismatched as f64, rep.max_abs_diff]),
            None => v.extend([0.0; 4]),
        }
    }
    v
}

fn decode(v: &[f64], iters: usize) -> RankResult {
    let n = HANDLE_SAMPLES.max(iters);
    let samples =
        |at: usize| RankTimes { samples_us: v[at..at + n].iter().copied().filter(|x| !x.is_nan()).collect(), bytes: 0 };
    let (handle, handle_device) = (samples(0), samples(n));
    let mut i = 2 * n;
    let mut times = |v: &[f64]| {
        let t = RankTimes { samples_us: v[i..i + iters].to_vec(), bytes: v[i + iters] as u64 };
        i += iters + 1;
        t
    };
    let (d, c, t) = (times(v), times(v), times(v));
    let mut halves: [Vec<f64>; 4] = Default::default();
    for (k, h) in halves.iter_mut().enumerate() {
        if v[i + k] > 0.0 {
            h.push(v[i + k]);
        }
    }
    i += 4;
    let mut optional = || {
        let t = RankTimes { samples_us: v[i..i + iters].iter().copied().filter(|x| !x.is_nan()).collect(), bytes: 0 };
        i += iters;
        t
    };
    let (graph, stream_step, stream_step_device, stream_handle_device) =
        (optional(), optional(), optional(), optional());
    let queued = [optional(), optional()];
    let host_clock = [optional(), optional()];
    let check = |j: usize| {
        (v[j] > 0.0).then(|| Report {
            checked: v[j + 1] as u64,
            mismatched: v[j + 2] as u64,
            first: None,
            max_abs_diff: v[j + 3],
        })
    };
    RankResult {
        handle,
        handle_device,
        dispatch: d,
        combine: c,
        total: t,
        halves,
        dispatch_check: check(i),
        combine_check: check(i + 4),
        graph,
        stream_step,
        stream_step_device,
        stream_handle_device,
        queued,
        host_clock,
    }
}

/// Runs this process's rank; returns the report on rank 0 (`None` elsewhere).
pub(super) fn run(args: &BenchArgs, env: &LaunchEnv) -> Result<Option<BenchReport>, BenchError> {
    if args.backend == BackendArg::NcclEp {
        return Err(BenchError::Usage(
            "--backend nccl-ep runs one process driving every GPU; start it without `epflow launch`".into(),
        ));
    }
    if args.backend == BackendArg::Host {
        return Err(BenchError::Usage(
            "processes started by `epflow launch` run the GPU backend; drop --backend host".into(),
        ));
    }
    let ranks = env.world_size;
    if args.ranks.is_some_and(|r| r != ranks) {
        return Err(BenchError::Usage(format!("--ranks must equal the launch's WORLD_SIZE ({ranks})")));
    }
    let run_err = |e: epflow_core::Error| BenchError::Run(format!("rank {}: {e}", env.rank));
    let (config, tokens) = config_from_args(args, ranks)?;
    check_host_memory(args, &config, ranks, tokens, false)?;
    let sc =
        Scenario::generate(config.clone(), ranks, &[tokens], args.top_k, RoutingKind::Uniform, args.masked, args.seed);
    let refs = if args.validate { Some(references(&sc, args.layout.layout())?) } else { None };
    let plan = LoopPlan::from_args(args);
    let comm = env.communicator().map_err(run_err)?;
    let transport = super::transport_from_args(args, ranks)?;
    if args.devices.is_some() {
        return Err(BenchError::Usage(
            "--devices places the ranks of one process; under `epflow launch` each process takes LOCAL_RANK's GPU"
                .into(),
        ));
    }
    let (rank, setup) = super::setup_cost::measure(
        &[comm.context().ordinal()],
        || GpuWorld::join_with(&comm, config.clone(), transport).map_err(run_err),
        |rank| rank.device_memory_bytes() as u64,
    )?;
    rank.set_timing(true);
    let label = match rank.nccl_peers() {
        0 => "gpu",
        m if m.count_ones() as usize + 1 == ranks => "nccl",
        _ => "gpu+nccl",
    };
    let memory = rank.device_memory_bytes() as u64;
    let name = rank.context().name().unwrap_or_default();
    let bench = super::gpu::GpuBench::new(rank, || barrier(&comm).expect("NCCL barrier"));
    let result = run_rank(&bench, &sc, refs.as_ref(), &plan).map_err(run_err)?;
    for c in [&result.dispatch_check, &result.combine_check].into_iter().flatten() {
        if let Some(f) = &c.first {
            eprintln!("rank {}: first mismatch: {f}", env.rank);
        }
    }
    let mine = encode(&result, plan.iters);
    let all = all_gather(&comm, &mine).map_err(run_err)?;
    barrier(&comm).map_err(run_err)?;
    drop(bench);
    let results: Vec<RankResult> = all.chunks_exact(mine.len()).map(|c| decode(c, plan.iters)).collect();
    let mut report =
        summarise(args, &config, label, &format!("{ranks} x {name}, one process per GPU"), ranks, tokens, results);
    report.device_memory_bytes_per_rank = Some(memory);
    // Rank 0's own: the other processes' set-ups took about as long (they meet in it), and as
    // much memory each on their GPUs.
    report.setup = Some(setup);
    if env.rank != 0 {
        return match &report.validation {
            Some(v) if !v.passed => Err(BenchError::Run(format!("rank {}: validation failed", env.rank))),
            _ => Ok(None),
        };
    }
    Ok(Some(report))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn times(v: &[f64]) -> RankTimes {
        RankTimes { samples_us: v.to_vec(), bytes: 0 }
    }

    /// What rank 0 gathers is what each rank measured: every optional series comes back in its
    /// own field (they travel as one flat vector, in a fixed order).
    #[test]
    fn a_rank_result_survives_the_gather() {
        let iters = 3;
        let r = RankResult {
            handle: times(&[9.0]),
            handle_device: times(&[7.5]),
            dispatch: RankTimes { samples_us: vec![1.0, 2.0, 3.0], bytes: 64 },
            combine: RankTimes { samples_us: vec![4.0, 5.0, 6.0], bytes: 64 },
            total: RankTimes { samples_us: vec![5.0, 7.0, 9.0], bytes: 128 },
            halves: [vec![1.5], vec![], vec![2.5], vec![]],
            dispatch_check: Some(Report { checked: 10, mismatched: 0, first: None, max_abs_diff: 0.0 }),
            combine_check: None,
            graph: times(&[]),
            stream_step: times(&[11.0, 12.0, 13.0]),
            stream_step_device: times(&[]),
            stream_handle_device: times(&[]),
            queued: [times(&[21.0, 22.0, 23.0]), times(&[31.0, 32.0, 33.0])],
            host_clock: [times(&[41.0, 42.0, 43.0]), times(&[51.0, 52.0, 53.0])],
        };
        let back = decode(&encode(&r, iters), iters);
        assert_eq!(back.handle.samples_us, [9.0]);
        assert_eq!(back.handle_device.samples_us, [7.5]);
        assert_eq!((back.dispatch.samples_us.as_slice(), back.dispatch.bytes), (&[1.0, 2.0, 3.0][..], 64));
        assert_eq!(back.combine.samples_us, [4.0, 5.0, 6.0]);
        assert_eq!((back.total.samples_us.as_slice(), back.total.bytes), (&[5.0, 7.0, 9.0][..], 128));
        assert_eq!(back.halves, [vec![1.5], vec![], vec![2.5], vec![]]);
        assert!(back.graph.samples_us.is_empty());
        assert_eq!(back.stream_step.samples_us, [11.0, 12.0, 13.0]);
        assert_eq!(back.queued[0].samples_us, [21.0, 22.0, 23.0]);
        assert_eq!(back.queued[1].samples_us, [31.0, 32.0, 33.0]);
        assert_eq!(back.host_clock[0].samples_us, [41.0, 42.0, 43.0]);
        assert_eq!(back.host_clock[1].samples_us, [51.0, 52.0, 53.0]);
        assert_eq!(back.dispatch_check.map(|c| (c.checked, c.mismatched)), Some((10, 0)));
        assert!(back.combine_check.is_none());
    }
}
