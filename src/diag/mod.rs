//! `epflow diag`: diagnostics on one GPU.

use std::process::ExitCode;

use epflow_core::Error;
use epflow_core::GroupConfig;
use epflow_kernels::{GpuRank, GpuWorld, device_count};

use crate::cli::DiagLaunchArgs;

mod ops;
pub(crate) use ops::ops;

/// `epflow diag env`: every knob of [`epflow_core::tuning::KNOBS`] with the value this process's
/// environment gives it, its default and meaning, then the tuning a group created now takes.
pub(crate) fn env() -> ExitCode {
    let e = epflow_core::tuning::Environment::get();
    println!("{:<36} {:<16} {:<28} meaning", "knob", "set to", "default");
    for k in epflow_core::tuning::KNOBS {
        let value = e.set.iter().find(|(n, _)| *n == k.name).map_or("-", |(_, v)| v.as_str());
        println!("{:<36} {:<16} {:<28} {}", k.name, value, k.default, k.meaning);
    }
    println!("a group created now takes (unless its config has its own, GroupConfig::with_tuning):");
    println!("{:#?}", e.tuning);
    ExitCode::SUCCESS
}

/// `epflow diag launch`: a one-rank low-latency group on `--device`, then the mean host time of
/// launching each of its kernels as a device no-op ([`epflow_kernels::GpuRank::ll_launch_costs`]:
/// as operations launch it, and as a plain launch), and of a kernel with one 8-byte parameter
/// ([`epflow_kernels::GpuRank::small_launch_us`], the driver's floor).
/// Exit code 1 without a GPU or on a CUDA failure, 2 on bad flags.
pub(crate) fn launch(args: &DiagLaunchArgs) -> ExitCode {
    if let Some(code) = refuse(args) {
        return code;
    }
    let result = one_rank(args)
        .and_then(|rank| Ok((rank.ll_launch_costs(args.tokens, args.iters)?, rank.small_launch_us(args.iters)?)));
    match result {
        Ok((costs, small)) => {
            println!(
                "launch host time per call, device {}, {} token(s), H={}, {} launches each (kernels are no-ops):",
                args.device, args.tokens, args.hidden, args.iters
            );
            println!(
                "host us per launch; idle: as operations launch (one-launch kernels cooperative), plain: not cooperative;"
            );
            println!("after a wait for the other stream's event: seen passed / not seen / pending");
            println!(
                "{:<24} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
                "kernel", "idle", "plain", "queued", "seen", "unseen", "pending"
            );
            for c in costs {
                println!(
                    "{:<24} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
                    c.kernel,
                    c.idle_us,
                    c.plain_us,
                    c.queued_us,
                    c.after_wait_us,
                    c.after_unobserved_wait_us,
                    c.after_pending_wait_us
                );
            }
            println!(
                "{:<24} {:>8.2}   (ep_spin: one 8-byte parameter, plain, idle; each kernel above takes a {}-byte LlParams)",
                "small kernel",
                small,
                epflow_kernels::LaunchCost::PARAMS_BYTES
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

/// The flag checks of every `epflow diag` command: `None` when `--tokens`, `--iters` and
/// `--device` are usable, else the exit code (2 on bad flags, 1 without a GPU), after a message.
fn refuse(args: &DiagLaunchArgs) -> Option<ExitCode> {
    if args.tokens == 0 || args.iters == 0 {
        eprintln!("error: --tokens and --iters must be at least 1");
        return Some(ExitCode::from(2));
    }
    let gpus = device_count();
    if args.device >= gpus {
        eprintln!("error: --device {}: this machine has {gpus} CUDA device(s)", args.device);
        return Some(ExitCode::from(if gpus == 0 { 1 } else { 2 }));
    }
    None
}

/// A one-rank low-latency group on `--device`, sized by `--experts`, `--tokens` and `--hidden`.
fn one_rank(args: &DiagLaunchArgs) -> Result<GpuRank, Error> {
    let config = GroupConfig::low_latency(args.experts, args.tokens, args.hidden);
    GpuWorld::create(&[args.device], config)?.pop().ok_or_else(|| Error::Unsupported("no rank created".into()))
}
