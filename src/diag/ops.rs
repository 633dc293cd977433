//! `epflow diag ops`: real low-latency operations on a one-rank group, in several sequences, with
//! the host time of each launch (the `EPFLOW_HOST_STEPS` steps, turned on here) per sequence, and
//! the cost of a no-op launch right after an operation. It separates what a launch costs by
//! itself from what the operations around it leave behind (benches/NOTES.md item 42).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use epflow_core::Error;
use epflow_core::backend::{Backend, blocking_combine, blocking_dispatch, blocking_handle};
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions};
use epflow_core::scenario::Scenario;
use epflow_core::workload::RoutingKind;
use epflow_kernels::device::host_steps;
use epflow_kernels::{GpuDispatchOutput, GpuRank};

use crate::cli::DiagLaunchArgs;

/// Operations run before each sequence's timed ones (their steps are dropped).
const WARMUP: usize = 20;

/// What one sequence does per iteration.
#[derive(Clone, Copy, Debug)]
enum Seq {
    /// Dispatch then combine, synchronous (as `epflow bench`).
    Pair,
    /// Dispatch only.
    Dispatch,
    /// Combine only, on one dispatch's output kept alive.
    Combine,
    /// Dispatch only, the host asleep for 1 ms before each.
    DispatchAfterSleep,
    /// Dispatch then combine, the host asleep for 1 ms before each dispatch.
    PairAfterSleep,
    /// Dispatch only, the host busy (spinning) for 1 ms before each: the GPU idles as long as
    /// after a sleep, the CPU does not.
    DispatchAfterSpin,
    /// Dispatch only, the host asleep for 50 µs before each (the shortest sleep Linux gives).
    DispatchAfterShortSleep,
    /// Dispatch, then a no-op launch of `ep_ll_dispatch_kernel` (timed alone).
    NoopAfterDispatch,
    /// Dispatch, then a no-op launch of `ep_ll_combine_kernel`.
    CombineNoopAfterDispatch,
    /// Dispatch, combine, then a no-op launch of `ep_ll_dispatch_kernel`.
    NoopAfterPair,
}

impl Seq {
    const ALL: [Seq; 10] = [
        Seq::Pair,
        Seq::Dispatch,
        Seq::Combine,
        Seq::DispatchAfterSleep,
        Seq::PairAfterSleep,
        Seq::DispatchAfterSpin,
        Seq::DispatchAfterShortSleep,
        Seq::NoopAfterDispatch,
        Seq::CombineNoopAfterDispatch,
        Seq::NoopAfterPair,
    ];

    fn describe(self) -> &'static str {
        match self {
            Seq::Pair => "dispatch + combine",
            Seq::Dispatch => "dispatch only",
            Seq::Combine => "combine only (one dispatch's output)",
            Seq::DispatchAfterSleep => "dispatch only, 1 ms host sleep before each",
            Seq::PairAfterSleep => "dispatch + combine, 1 ms host sleep before each dispatch",
            Seq::DispatchAfterSpin => "dispatch only, 1 ms host spin before each",
            Seq::DispatchAfterShortSleep => "dispatch only, 50 us host sleep before each",
            Seq::NoopAfterDispatch => "dispatch, then a no-op ep_ll_dispatch_kernel launch",
            Seq::CombineNoopAfterDispatch => "dispatch, then a no-op ep_ll_combine_kernel launch",
            Seq::NoopAfterPair => "dispatch + combine, then a no-op ep_ll_dispatch_kernel launch",
        }
    }
}

/// `epflow diag ops`: a one-rank low-latency group on `--device`; every [`Seq`] `--iters` times,
/// without and then with the operations' timing events (as `epflow bench` has them), printing
/// its launches' mean host time (and the no-op launch's, where there is one). Exit code 1 without
/// a GPU or on a failure, 2 on bad flags.
pub(crate) fn ops(args: &DiagLaunchArgs) -> ExitCode {
    if let Some(code) = super::refuse(args) {
        return code;
    }
    host_steps::enable();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(args: &DiagLaunchArgs) -> Result<(), Error> {
    let rank = super::one_rank(args)?;
    let config = rank.config().clone();
    let top_k = config.max_top_k.min(8);
    let sc = Scenario::generate(config, 1, &[args.tokens], top_k, RoutingKind::Uniform, 0, 1);
    let x = rank.upload(&sc.tokens(0))?;
    let idx = rank.upload(&sc.topk_idx(0))?;
    let w = rank.upload(&sc.weights(0))?;
    let handle = blocking_handle(&rank, &idx)?;
    let (dopts, copts) = (DispatchOptions::default(), CombineOptions::default());
    let dispatch = || blocking_dispatch(&rank, &handle, DispatchInputs::new(&x), &dopts, false);
    let combine = |d: &GpuDispatchOutput| -> Result<(), Error> {
        let cin = CombineInputs::new(d.tokens()).with_weights(&w);
        blocking_combine(&rank, &handle, cin, &copts, false).map(drop)
    };
    println!(
        "real low-latency operations on one rank, device {}, {} token(s), H={}, {} iterations per sequence; \
         host us per launch call (mean)",
        args.device, args.tokens, args.hidden, args.iters
    );
    for (timing, seq) in [false, true].into_iter().flat_map(|t| Seq::ALL.map(|s| (t, s))) {
        rank.set_timing(timing);
        let kept = matches!(seq, Seq::Combine).then(dispatch).transpose()?;
        let mut noop = Vec::new();
        for i in 0..WARMUP + args.iters {
            if i == WARMUP {
                host_steps::take();
                noop.clear();
            }
            match seq {
                Seq::DispatchAfterSleep | Seq::PairAfterSleep => std::thread::sleep(Duration::from_millis(1)),
                Seq::DispatchAfterShortSleep => std::thread::sleep(Duration::from_micros(50)),
                Seq::DispatchAfterSpin => {
                    let until = Instant::now() + Duration::from_millis(1);
                    while Instant::now() < until {
                        std::hint::spin_loop();
                    }
                }
                _ => {}
            }
            match (seq, &kept) {
                (Seq::Combine, Some(d)) => combine(d)?,
                _ => {
                    let d = dispatch()?;
                    if matches!(seq, Seq::Pair | Seq::PairAfterSleep | Seq::NoopAfterPair) {
                        combine(&d)?;
                    }
                    drop(d);
                }
            }
            noop_after(&rank, seq, args.tokens, &mut noop)?;
        }
        let steps = host_steps::take();
        let launches: Vec<String> = steps
            .iter()
            .filter(|(step, ..)| step.starts_with("launch: ") && step.ends_with("kernel"))
            .map(|(step, us, _)| format!("{} {us:.2}", step.trim_start_matches("launch: ")))
            .collect();
        let noop =
            (!noop.is_empty()).then(|| format!("; no-op launch {:.2}", noop.iter().sum::<f64>() / noop.len() as f64));
        let timed = if timing { "timed: " } else { "" };
        println!("{:<70} {}{}", format!("{timed}{}", seq.describe()), launches.join(", "), noop.unwrap_or_default());
    }
    Ok(())
}

/// The no-op launch of sequences that time one after their operations.
fn noop_after(rank: &GpuRank, seq: Seq, tokens: usize, out: &mut Vec<f64>) -> Result<(), Error> {
    let function = match seq {
        Seq::NoopAfterDispatch | Seq::NoopAfterPair => "ep_ll_dispatch_kernel",
        Seq::CombineNoopAfterDispatch => "ep_ll_combine_kernel",
        _ => return Ok(()),
    };
    out.push(rank.ll_noop_launch_us(function, tokens)?);
    Ok(())
}
