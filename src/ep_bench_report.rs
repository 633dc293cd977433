//! `epflow ep-bench-report`: reads the output of NCCL EP's `ep_bench` (its configuration block,
//! "Host-observed performance" and "Kernel-only performance", or for high-throughput runs "BW
//! based on total time" and "BW based on kernel time"), one file per run, for a baseline
//! (NVIDIA's `libnccl_ep.so`) and for epflow's `libnccl_ep.so` under the same program, and prints
//! one line per (algorithm, layout, dtype, tokens): runs, runs with a whole-run rank offset,
//! means of both columns, the baseline / epflow ratios, and how many of epflow's runs met
//! `--targets`.
//!
//! `ep_bench`'s kernel column is CUPTI's kernel time averaged over both ranks; its `min` / `max`
//! are the two ranks' own averages. A run whose ranks' averages are `--offset-us` or more apart
//! (dispatch or combine) is counted as an **offset** run: one rank started each operation later
//! for the whole run and the other's kernels waited for it (benches/NOTES.md items 130, 138 and
//! 187). The report gives epflow's means over the runs without an offset as well, and the mean
//! of the faster rank's average over every run.
//!
//! Every number read must be finite: a run with a NaN or infinite value is an error naming the
//! file, the line and the field, and it is left out of the report (exit code 1, as for a run whose
//! own validation failed). A ratio whose epflow side is zero, or any other result that is not a
//! finite number, prints as `-`: the report never prints NaN or inf.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::cli::EpBenchReportArgs;

/// Dispatch and combine, in that order.
type Pair<T> = [T; 2];

/// One line of the kernel column: the average over both ranks, and the ranks' own averages.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct KernelStat {
    /// Microseconds, the mean of both ranks.
    pub avg: f64,
    /// The lower rank average, µs.
    pub min: f64,
    /// The higher rank average, µs.
    pub max: f64,
}

impl KernelStat {
    /// How far apart the two ranks' averages are, µs.
    fn gap(&self) -> f64 {
        self.max - self.min
    }
}

/// What one `ep_bench` run printed.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Run {
    /// The file it was read from.
    pub path: PathBuf,
    /// The case: `Algorithm`, `Layout` (`-` when the run printed none), `Dispatch dtype`, `Tokens`.
    pub case: Case,
    /// The kernel column (dispatch, combine), if the run printed it.
    pub kernel: Option<Pair<KernelStat>>,
    /// The host-observed averages (dispatch, combine) in µs, if the run printed them.
    pub host: Option<Pair<f64>>,
    /// Whether the run's own checks passed (`Dispatch validation:` / `Combine validation:`
    /// lines, with `--validate`); `None` when it printed none.
    pub validated: Option<bool>,
}

/// The configuration a run is grouped by.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Case {
    /// `LOW_LATENCY` or `HIGH_THROUGHPUT`.
    pub algorithm: String,
    /// `rank-major`, `expert-major`, or `-`.
    pub layout: String,
    /// `BF16` or `FP8`.
    pub dtype: String,
    /// Tokens per rank.
    pub tokens: usize,
}

/// Why a run's output cannot be used.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub(crate) enum ParseError {
    /// The output lacks what every run prints (not `ep_bench` output, or a run that failed
    /// early): the file is left out with a warning.
    #[error("{0}")]
    Missing(&'static str),
    /// A value that is not a finite number (`nan`, `inf`): the run is left out, and the report
    /// exits with code 1.
    #[error("line {line}: {field} is {value:?}, not a finite number")]
    NonFinite {
        /// The line, counted from 1.
        line: usize,
        /// The field, e.g. `Kernel-only Dispatch avg`.
        field: String,
        /// The text of the value.
        value: String,
    },
}

/// The value after `key=` in `line` up to the next space or comma, as a number (`Ok(None)`
/// when absent or not a number); a value that reads as NaN or infinite is an error naming line
/// `lineno` (from 1) and the field (`what` and `key`).
fn field(line: &str, key: &str, lineno: usize, what: &str) -> Result<Option<f64>, ParseError> {
    let Some(at) = line.find(&format!("{key}=")).map(|at| at + key.len() + 1) else { return Ok(None) };
    let rest = &line[at..];
    let raw = &rest[..rest.find([' ', ',']).unwrap_or(rest.len())];
    match raw.parse::<f64>() {
        Ok(v) if !v.is_finite() => {
            Err(ParseError::NonFinite { line: lineno, field: format!("{what} {key}"), value: raw.to_string() })
        }
        Ok(v) => Ok(Some(v)),
        Err(_) => Ok(None),
    }
}

/// The value of configuration line `  Key:   value` of `text`.
fn config<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|l| l.trim_start().strip_prefix(key)?.trim_start().strip_prefix(':').map(str::trim))
}

/// Parses one run's output; errors name what is missing, or the line and field of a value that
/// is not a finite number.
pub(crate) fn parse(path: &Path, text: &str) -> Result<Run, ParseError> {
    let algorithm = config(text, "Algorithm")
        .ok_or(ParseError::Missing("no `Algorithm:` line (not ep_bench output?)"))?
        .to_string();
    let tokens = config(text, "Tokens").and_then(|t| t.parse().ok()).ok_or(ParseError::Missing("no `Tokens:` line"))?;
    let case = Case {
        algorithm,
        layout: config(text, "Layout").unwrap_or("-").to_string(),
        dtype: config(text, "Dispatch dtype").unwrap_or("BF16").to_string(),
        tokens,
    };
    let (mut host, mut kernel) = ([None, None], [None, None]);
    let mut section = "";
    let mut checks = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.starts_with("---") || line.starts_with("===") {
            section = line;
            continue;
        }
        let (which, op) = if line.starts_with("Dispatch") {
            (0, "Dispatch")
        } else if line.starts_with("Combine") {
            (1, "Combine")
        } else {
            continue;
        };
        let lineno = i + 1;
        if line.contains(" validation:") {
            checks.push(line.contains("PASSED"));
        } else if section.contains("BW based on total time") {
            // High-throughput: `Dispatch:    total=96.60 us (min=..., max=...)`, the host's
            // time per call (the min / max are over the iterations, not the ranks).
            host[which] = field(line, "total", lineno, &format!("total-time {op}"))?;
        } else if section.contains("BW based on kernel time") {
            // High-throughput: `Dispatch:    kernel=59.25 us`, no per-rank spread printed: the
            // run counts as without an offset.
            kernel[which] = field(line, "kernel", lineno, &format!("kernel-time {op}"))?.map(|avg| KernelStat {
                avg,
                min: avg,
                max: avg,
            });
        } else if section.contains("Host-observed") {
            host[which] = field(line, "avg", lineno, &format!("Host-observed {op}"))?;
        } else if section.contains("Kernel-only") {
            let what = format!("Kernel-only {op}");
            let f = |key| field(line, key, lineno, &what);
            kernel[which] = match (f("avg")?, f("min")?, f("max")?) {
                (Some(avg), Some(min), Some(max)) => Some(KernelStat { avg, min, max }),
                _ => None,
            };
        }
    }
    Ok(Run {
        path: path.to_path_buf(),
        case,
        kernel: kernel[0].zip(kernel[1]).map(|(d, c)| [d, c]),
        host: host[0].zip(host[1]).map(|(d, c)| [d, c]),
        validated: (!checks.is_empty()).then(|| checks.iter().all(|&ok| ok)),
    })
}

/// `--targets`: dispatch / combine kernel targets in µs per (layout, tokens); a target given
/// without a layout (`TOKENS:D/C`) holds for every layout (key `None`), one with a layout
/// (`LAYOUT:TOKENS:D/C`) for that one only.
pub(crate) type Targets = BTreeMap<(Option<String>, usize), Pair<f64>>;

/// Parses `--targets` (comma-separated `[LAYOUT:]TOKENS:DISPATCH/COMBINE`).
pub(crate) fn parse_targets(spec: &str) -> Result<Targets, String> {
    let mut out = BTreeMap::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let bad = || format!("--targets: `{item}` is not [LAYOUT:]TOKENS:DISPATCH/COMBINE (e.g. rank-major:1:10/10)");
        let parts: Vec<&str> = item.split(':').map(str::trim).collect();
        let (layout, tokens, us) = match parts[..] {
            [tokens, us] => (None, tokens, us),
            [layout, tokens, us] if !layout.is_empty() => (Some(layout.to_string()), tokens, us),
            _ => return Err(bad()),
        };
        let (d, c) = us.split_once('/').ok_or_else(bad)?;
        let (Ok(t), Ok(d), Ok(c)) = (tokens.parse(), d.trim().parse::<f64>(), c.trim().parse::<f64>()) else {
            return Err(bad());
        };
        if !d.is_finite() || !c.is_finite() {
            return Err(format!("--targets: `{item}`: the targets must be finite numbers of µs"));
        }
        out.insert((layout, t), [d, c]);
    }
    Ok(out)
}

/// The target of `case`: its layout's, else one for every layout.
fn target_of(targets: &Targets, case: &Case) -> Option<Pair<f64>> {
    let own = targets.get(&(Some(case.layout.clone()), case.tokens));
    own.or_else(|| targets.get(&(None, case.tokens))).copied()
}

/// Means over one side's runs of a case.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Side {
    /// Runs with a kernel column.
    pub runs: usize,
    /// Of them, runs whose ranks' averages were `offset_us` or more apart.
    pub offsets: usize,
    /// Mean kernel averages (dispatch, combine), µs (`None` without runs).
    pub kernel: Option<Pair<f64>>,
    /// Mean of the faster rank's averages, µs (`None` without runs).
    pub faster_rank: Option<Pair<f64>>,
    /// Mean kernel averages over the runs without an offset (`None` if every run had one).
    pub aligned: Option<Pair<f64>>,
    /// Mean host-observed averages, µs (`None` if no run printed them).
    pub host: Option<Pair<f64>>,
    /// Runs whose kernel averages met the case's targets (`None` without a target).
    pub met: Option<usize>,
}

/// The mean, summing `v / n` so that finite values near `f64::MAX` do not overflow.
fn mean(values: impl Iterator<Item = f64> + Clone) -> Option<f64> {
    let n = values.clone().count();
    (n > 0).then(|| values.map(|v| v / n as f64).sum())
}

/// Summarizes `runs` (of one case): offsets at `offset_us`, targets `target`.
pub(crate) fn summarize(runs: &[&Run], offset_us: f64, target: Option<Pair<f64>>) -> Side {
    let timed: Vec<&Pair<KernelStat>> = runs.iter().filter_map(|r| r.kernel.as_ref()).collect();
    let offset = |k: &Pair<KernelStat>| k.iter().any(|s| s.gap() >= offset_us);
    let pair = |f: &dyn Fn(&Pair<KernelStat>, usize) -> f64, sel: &dyn Fn(&Pair<KernelStat>) -> bool| {
        let m = |i| mean(timed.iter().filter(|k| sel(k)).map(|k| f(k, i)));
        m(0).zip(m(1)).map(|(d, c)| [d, c])
    };
    Side {
        runs: timed.len(),
        offsets: timed.iter().filter(|k| offset(k)).count(),
        kernel: pair(&|k, i| k[i].avg, &|_| true),
        faster_rank: pair(&|k, i| k[i].min, &|_| true),
        aligned: pair(&|k, i| k[i].avg, &|k| !offset(k)),
        host: {
            let h = |i| mean(runs.iter().filter_map(|r| r.host.map(|h| h[i])));
            h(0).zip(h(1)).map(|(d, c)| [d, c])
        },
        met: target.map(|t| timed.iter().filter(|k| k[0].avg <= t[0] && k[1].avg <= t[1]).count()),
    }
}

/// The runs of `runs` whose case is `case`.
fn of_case<'a>(runs: &'a [Run], case: &Case) -> Vec<&'a Run> {
    runs.iter().filter(|r| &r.case == case).collect()
}

/// `d / c` with two decimals; `-` for a missing pair, and for each value that is not a finite
/// number (a ratio over a zero mean), so that the report never prints NaN or inf.
fn pair_text(p: Option<Pair<f64>>) -> String {
    let one = |v: f64| if v.is_finite() { format!("{v:.2}") } else { "-".to_string() };
    p.map_or_else(|| "-".to_string(), |[d, c]| format!("{} / {}", one(d), one(c)))
}

/// `a / b` per operation; a zero denominator gives NaN or inf, which [`pair_text`] prints as `-`.
fn ratio(a: Option<Pair<f64>>, b: Option<Pair<f64>>) -> Option<Pair<f64>> {
    a.zip(b).map(|(a, b)| [a[0] / b[0], a[1] / b[1]])
}

/// The report of `baseline` and `ours` (parsed runs), one block per case either side has.
pub(crate) fn report(baseline: &[Run], ours: &[Run], offset_us: f64, targets: &Targets) -> String {
    let mut cases: Vec<&Case> = baseline.iter().chain(ours).map(|r| &r.case).collect();
    cases.sort();
    cases.dedup();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "ep_bench runs, kernel column (CUPTI, mean of both ranks) and host-observed column, means over runs, µs \
         dispatch / combine; offset: the ranks' averages >= {offset_us} µs apart"
    );
    for case in cases {
        let (b, o) = (of_case(baseline, case), of_case(ours, case));
        let target = target_of(targets, case);
        let (sb, so) = (summarize(&b, offset_us, None), summarize(&o, offset_us, target));
        let _ = writeln!(out, "{} {} {} {} tokens:", case.algorithm, case.layout, case.dtype, case.tokens);
        for (name, s) in [("baseline", &sb), ("epflow", &so)] {
            let _ = writeln!(
                out,
                "  {name:<8} runs {:>3}, offset {:>3} | kernel {} | faster rank {} | without offset {} | host {}",
                s.runs,
                s.offsets,
                pair_text(s.kernel),
                pair_text(s.faster_rank),
                pair_text(s.aligned),
                pair_text(s.host)
            );
        }
        let met = match (target, so.met) {
            (Some(t), Some(n)) => format!(" | epflow met <= {} / {} in {n} of {} runs", t[0], t[1], so.runs),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "  baseline / epflow: kernel {}x, host {}x{met}",
            pair_text(ratio(sb.kernel, so.kernel)),
            pair_text(ratio(sb.host, so.host))
        );
        let failed: Vec<String> =
            b.iter().chain(&o).filter(|r| r.validated == Some(false)).map(|r| r.path.display().to_string()).collect();
        if !failed.is_empty() {
            let _ = writeln!(out, "  validation FAILED: {}", failed.join(", "));
        }
    }
    out
}

/// Reads and parses every file; a file that cannot be read or parsed is named on stderr and
/// left out (a warning); so is a run with a value that is not a finite number (an error: the
/// second value returned is how many).
fn read_all(paths: &[PathBuf]) -> (Vec<Run>, usize) {
    let mut bad = 0;
    let runs = paths
        .iter()
        .filter_map(|p| match std::fs::read_to_string(p) {
            Err(e) => {
                eprintln!("warning: {}: {e}; left out", p.display());
                None
            }
            Ok(t) => match parse(p, &t) {
                Ok(run) if run.kernel.is_some() => Some(run),
                Ok(_) => {
                    eprintln!("warning: {}: no kernel column (the run failed?); left out", p.display());
                    None
                }
                Err(e @ ParseError::NonFinite { .. }) => {
                    eprintln!("error: {}: {e}; run left out", p.display());
                    bad += 1;
                    None
                }
                Err(e) => {
                    eprintln!("warning: {}: {e}; left out", p.display());
                    None
                }
            },
        })
        .collect();
    (runs, bad)
}

/// `epflow ep-bench-report`. Exit code 2 on bad flags or when a side has no usable run, 1 when a
/// run's own validation failed or a run was left out for a value that is not a finite number,
/// else 0.
pub(crate) fn main(args: &EpBenchReportArgs) -> ExitCode {
    let targets = match args.targets.as_deref().map(parse_targets).transpose() {
        Ok(t) => t.unwrap_or_default(),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if !args.offset_us.is_finite() || args.offset_us <= 0.0 {
        eprintln!("error: --offset-us must be a positive finite number of µs");
        return ExitCode::from(2);
    }
    let ((baseline, bad_b), (ours, bad_o)) = (read_all(&args.baseline), read_all(&args.ours));
    if baseline.is_empty() || ours.is_empty() {
        eprintln!(
            "error: no usable ep_bench run for the {}",
            if baseline.is_empty() { "baseline" } else { "epflow side" }
        );
        return ExitCode::from(2);
    }
    print!("{}", report(&baseline, &ours, args.offset_us, &targets));
    if bad_b + bad_o > 0 {
        eprintln!("error: {} run(s) left out for values that are not finite numbers", bad_b + bad_o);
    }
    let failed = baseline.iter().chain(&ours).any(|r| r.validated == Some(false));
    if failed || bad_b + bad_o > 0 { ExitCode::from(1) } else { ExitCode::SUCCESS }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines of an `ep_bench` low-latency run that the report reads (its format, abridged).
    fn log(tokens: usize, layout: &str, kernel: Pair<(f64, f64, f64)>, host: Pair<f64>) -> String {
        let [(da, dn, dx), (ca, cn, cx)] = kernel;
        format!(
            "=== NCCL EP Performance Benchmark ===\nConfiguration:\n  Algorithm:       LOW_LATENCY\n  \
             Layout:          {layout}\n  Ranks:           2\n  Tokens:          {tokens}\n  Dispatch dtype:  BF16\n\n\
             === Summary (Low Latency, across 2 ranks) ===\n\n--- Host-observed performance ---\n\
             Dispatch (BF16):  avg={:.2} us, min=1.00 us, max=99.00 us\n                  throughput: avg=1.48 GB/s\n\
             Combine (BF16):   avg={:.2} us, min=1.00 us, max=99.00 us\n\n--- Kernel-only performance ---\n\
             Dispatch:    avg={da:.2} us, min={dn:.2} us, max={dx:.2} us\n                  throughput: avg=3.47 GB/s\n\
             Combine:     avg={ca:.2} us, min={cn:.2} us, max={cx:.2} us\n",
            host[0], host[1]
        )
    }

    fn run(text: &str) -> Run {
        parse(Path::new("r.log"), text).unwrap()
    }

    #[test]
    fn a_run_gives_its_case_and_both_columns() {
        let r = run(&log(32, "rank-major", [(12.5, 12.0, 13.0), (11.0, 10.0, 12.0)], [21.5, 19.25]));
        assert_eq!(
            r.case,
            Case { algorithm: "LOW_LATENCY".into(), layout: "rank-major".into(), dtype: "BF16".into(), tokens: 32 }
        );
        assert_eq!(r.kernel.unwrap()[1], KernelStat { avg: 11.0, min: 10.0, max: 12.0 });
        assert_eq!(r.host, Some([21.5, 19.25]));
        assert_eq!(r.validated, None);
    }

    #[test]
    fn validation_lines_are_read_and_the_global_line_is_not() {
        // ep_bench's global line can say FAILED while both checks passed (benches/NOTES.md item 41).
        let text = log(1, "rank-major", [(9.0, 8.0, 10.0); 2], [18.0, 16.0])
            + "Dispatch validation: PASSED\nCombine validation:  PASSED (calc_diff=1e-6)\n\
               Global validation: Dispatch=PASSED, Combine=FAILED\n";
        assert_eq!(run(&text).validated, Some(true));
        let failed = text.replace("Combine validation:  PASSED", "Combine validation:  FAILED");
        assert_eq!(run(&failed).validated, Some(false));
    }

    /// A high-throughput run prints its times in other sections: the total time per call is the
    /// host column, the kernel time (no per-rank spread) the kernel column.
    #[test]
    fn a_high_throughput_run_gives_both_columns() {
        let text = "=== NCCL EP Performance Benchmark ===\nConfiguration:\n  Algorithm:       HIGH_THROUGHPUT\n  \
                    Layout:          flat\n  Tokens:          4096\n  Dispatch dtype:  BF16\n\n\
                    === Summary (High Throughput BF16, across 1 ranks) ===\n--- BW based on total time ---\n\
                    Dispatch:    total=96.60 us (min=94.18, max=149.06)\n             recv: total_bw=607.84 GB/s\n\
                    Combine:     total=88.63 us (min=87.04, max=133.57)\n\
                    Total (D+C): avg=191.30 us, min=187.42 us, max=242.56 us\n\n--- BW based on kernel time ---\n\
                    Dispatch:    kernel=59.25 us\nCombine:     kernel=68.91 us\n\
                    Dispatch validation: PASSED\nCombine validation:  PASSED (calc_diff=0.000000e+00)\n";
        let r = run(text);
        assert_eq!(r.case.algorithm, "HIGH_THROUGHPUT");
        assert_eq!(r.host, Some([96.60, 88.63]));
        assert_eq!(r.kernel.unwrap()[1], KernelStat { avg: 68.91, min: 68.91, max: 68.91 });
        assert_eq!(r.validated, Some(true));
        let bad = text.replace("kernel=68.91", "kernel=nan");
        assert!(matches!(parse(Path::new("x"), &bad), Err(ParseError::NonFinite { .. })));
    }

    #[test]
    fn other_output_is_refused() {
        assert!(parse(Path::new("x"), "epflow bench: algorithm=ll\n").is_err());
    }

    #[test]
    fn offsets_ratios_and_targets_are_counted() {
        let ours = [
            run(&log(1, "rank-major", [(8.0, 7.5, 8.5), (8.0, 7.0, 9.0)], [18.0, 16.0])),
            // An offset run: the ranks' combine averages 6 µs apart.
            run(&log(1, "rank-major", [(9.0, 8.0, 10.0), (11.0, 8.0, 14.0)], [20.0, 18.0])),
        ];
        let base = [run(&log(1, "rank-major", [(18.0, 17.5, 18.5), (12.0, 11.0, 13.0)], [27.0, 21.0]))];
        let refs: Vec<&Run> = ours.iter().collect();
        let s = summarize(&refs, 3.0, Some([10.0, 10.0]));
        assert_eq!((s.runs, s.offsets, s.met), (2, 1, Some(1)));
        assert_eq!(s.kernel, Some([8.5, 9.5]));
        assert_eq!(s.faster_rank, Some([7.75, 7.5]));
        assert_eq!(s.aligned, Some([8.0, 8.0]));
        assert_eq!(s.host, Some([19.0, 17.0]));
        let targets = parse_targets("1:10/10, expert-major:1:5/5, rank-major:128:20/22").unwrap();
        let text = report(&base, &ours, 3.0, &targets);
        assert!(text.contains("LOW_LATENCY rank-major BF16 1 tokens:"), "{text}");
        // 18 / 8.5 and 12 / 9.5.
        assert!(text.contains("kernel 2.12 / 1.26x"), "{text}");
        assert!(text.contains("met <= 10 / 10 in 1 of 2 runs"), "{text}");
        assert!(!text.contains("FAILED"), "{text}");
    }

    /// Issue 64 item 5: a value that reads as NaN or infinite is an error naming its line and
    /// field, in either column.
    #[test]
    fn values_that_are_not_finite_are_refused_with_their_line_and_field() {
        let good = log(1, "rank-major", [(9.0, 8.0, 10.0), (11.0, 10.0, 12.0)], [18.0, 16.0]);
        let cases = [
            ("Dispatch:    avg=9.00", "Dispatch:    avg=nan", 17, "Kernel-only Dispatch avg", "nan"),
            ("min=10.00 us, max=12.00", "min=-inf us, max=12.00", 19, "Kernel-only Combine min", "-inf"),
            ("min=10.00 us, max=12.00", "min=10.00 us, max=inf", 19, "Kernel-only Combine max", "inf"),
            ("Combine (BF16):   avg=16.00", "Combine (BF16):   avg=NaN", 14, "Host-observed Combine avg", "NaN"),
            (
                "Dispatch (BF16):  avg=18.00",
                "Dispatch (BF16):  avg=infinity",
                12,
                "Host-observed Dispatch avg",
                "infinity",
            ),
        ];
        for (from, to, line, field, value) in cases {
            let text = good.replacen(from, to, 1);
            assert_ne!(text, good, "{from}");
            let err = parse(Path::new("r.log"), &text).unwrap_err();
            assert_eq!(err, ParseError::NonFinite { line, field: field.into(), value: value.into() });
            assert_eq!(err.to_string(), format!("line {line}: {field} is {value:?}, not a finite number"));
        }
        assert!(parse(Path::new("r.log"), &good).is_ok());
    }

    /// A ratio over a zero mean, or a mean past `f64::MAX`, prints as `-`, never NaN or inf.
    #[test]
    fn the_report_never_prints_nan_or_inf() {
        let ours = [run(&log(1, "rank-major", [(0.0, 0.0, 0.0), (2.0, 2.0, 2.0)], [0.0, 0.0]))];
        let base = [
            run(&log(1, "rank-major", [(0.0, 0.0, 0.0), (4.0, 4.0, 4.0)], [3.0, 0.0])),
            run(&log(1, "rank-major", [(0.0, 0.0, 0.0), (4.0, 4.0, 4.0)], [3.0, 0.0])),
        ];
        let text = report(&base, &ours, 3.0, &Targets::new());
        assert!(text.contains("baseline / epflow: kernel - / 2.00x, host - / -x"), "{text}");
        let huge = [
            run(&log(1, "rank-major", [(f64::MAX, 1.0, 1.0), (1.0, 1.0, 1.0)], [1.0, 1.0])),
            run(&log(1, "rank-major", [(f64::MAX, 1.0, 1.0), (1.0, 1.0, 1.0)], [1.0, 1.0])),
        ];
        let refs: Vec<&Run> = huge.iter().collect();
        assert_eq!(summarize(&refs, 3.0, None).kernel, Some([f64::MAX, 1.0]));
        let text = report(&huge, &ours, 3.0, &Targets::new());
        for bad in ["NaN", "nan", "inf"] {
            assert!(!text.contains(bad), "{bad}: {text}");
        }
    }

    #[test]
    fn targets_hold_for_their_layout_or_every_layout() {
        let t = parse_targets("rank-major:1:10/10, 1:12/12, 32:14/14").unwrap();
        let case = |layout: &str, tokens| Case {
            algorithm: "LOW_LATENCY".into(),
            layout: layout.into(),
            dtype: "BF16".into(),
            tokens,
        };
        assert_eq!(target_of(&t, &case("rank-major", 1)), Some([10.0, 10.0]));
        assert_eq!(target_of(&t, &case("expert-major", 1)), Some([12.0, 12.0]));
        assert_eq!(target_of(&t, &case("expert-major", 32)), Some([14.0, 14.0]));
        assert_eq!(target_of(&t, &case("rank-major", 128)), None);
    }

    #[test]
    fn bad_targets_are_refused() {
        assert!(parse_targets("1=10/10").is_err());
        assert!(parse_targets(":1:10/10").is_err());
        assert!(parse_targets("a:b:1:10/10").is_err());
        assert!(parse_targets("1:10").is_err());
        assert!(parse_targets("x:1/2").is_err());
        assert_eq!(
            parse_targets("1:nan/10"),
            Err("--targets: `1:nan/10`: the targets must be finite numbers of µs".to_string())
        );
        assert!(parse_targets("rank-major:1:10/inf").is_err());
        assert_eq!(parse_targets("").unwrap().len(), 0);
    }
}
