//! The `epflow` command-line tool.

mod bench;
mod chart;
mod cli;
mod compile;
mod diag;
mod ep_bench_report;
mod launch;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    match cli.command {
        cli::Command::Bench(args) => bench::main(&args),
        cli::Command::Compile(args) => compile::main(&args),
        cli::Command::Launch(args) => launch::main(&args),
        cli::Command::Diag(cli::DiagCommand::Launch(args)) => diag::launch(&args),
        cli::Command::Diag(cli::DiagCommand::Ops(args)) => diag::ops(&args),
        cli::Command::Diag(cli::DiagCommand::Env) => diag::env(),
        cli::Command::EpBenchReport(args) => ep_bench_report::main(&args),
        cli::Command::Chart(args) => chart::main(&args),
    }
}
