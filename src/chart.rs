//! `epflow chart`: `epflow bench --json` runs (epflow's backends and `--backend nccl-ep`, one
//! JSON object per run, several per file allowed) drawn as one SVG: latency in µs against
//! tokens per rank (log scale), a line per (backend, layout, operation). Runs of the same
//! series and token count are reduced to their median. Every run must come from one setup (the
//! same device and rank count): a chart compares backends, not machines.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use plotters::prelude::*;
use serde::Deserialize;

use crate::cli::{ChartArgs, ChartMetric};

/// The part of an `epflow bench --json` report the chart reads.
#[derive(Debug, Deserialize)]
struct Run {
    algorithm: String,
    backend: String,
    device: String,
    ranks: usize,
    tokens: usize,
    layout: String,
    dispatch: Op,
    combine: Op,
}

/// One operation's summary (µs).
#[derive(Debug, Deserialize)]
struct Op {
    avg_us: f64,
    median_us: f64,
}

/// Series name → tokens per rank → the runs' values (µs).
type Series = BTreeMap<String, BTreeMap<usize, Vec<f64>>>;

/// Reads every run of `files`; an error names the file and what is wrong.
fn read_runs(files: &[PathBuf]) -> Result<Vec<Run>, String> {
    let mut runs = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
        let before = runs.len();
        for (i, run) in serde_json::Deserializer::from_str(&text).into_iter::<Run>().enumerate() {
            runs.push(
                run.map_err(|e| format!("{}: run {}: not an `epflow bench --json` report: {e}", f.display(), i + 1))?,
            );
        }
        if runs.len() == before {
            return Err(format!("{}: no run in it", f.display()));
        }
    }
    Ok(runs)
}

/// The runs grouped into series by (backend, algorithm and layout, operation), with the
/// chosen metric; refused when the runs come from different setups or hold values that are
/// not finite and positive.
fn series(runs: &[Run], metric: ChartMetric) -> Result<(Series, String), String> {
    let first = runs.first().ok_or("no runs")?;
    let setup = format!("{}, {} ranks", first.device, first.ranks);
    let mut out = Series::new();
    for r in runs {
        if (r.device.as_str(), r.ranks) != (first.device.as_str(), first.ranks) {
            return Err(format!(
                "runs from different setups ({setup}; {}, {} ranks): a chart compares backends on one setup",
                r.device, r.ranks
            ));
        }
        if r.tokens == 0 {
            return Err(format!("{} {}: 0 tokens per rank cannot be drawn on a log scale", r.backend, r.layout));
        }
        for (name, op) in [("dispatch", &r.dispatch), ("combine", &r.combine)] {
            let v = match metric {
                ChartMetric::Median => op.median_us,
                ChartMetric::Avg => op.avg_us,
            };
            if !v.is_finite() || v <= 0.0 {
                return Err(format!(
                    "{} {} {name} at {} tokens: {v} µs is not a positive number",
                    r.backend, r.layout, r.tokens
                ));
            }
            let key = format!("{} {} {} {name}", r.backend, r.algorithm, r.layout);
            out.entry(key).or_default().entry(r.tokens).or_default().push(v);
        }
    }
    Ok((out, setup))
}

/// The median of `v` (not empty).
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 }
}

/// Draws `series` into the SVG file `path`.
fn draw(path: &Path, title: &str, series: &Series) -> Result<(), Box<dyn std::error::Error>> {
    let points: Vec<(usize, f64)> = series.values().flat_map(|s| s.iter().map(|(&t, v)| (t, median(v)))).collect();
    let max_t = points.iter().map(|p| p.0).max().unwrap_or(1).max(2) as f64;
    let min_t = points.iter().map(|p| p.0).min().unwrap_or(1) as f64;
    let max_y = points.iter().map(|p| p.1).fold(0.0, f64::max) * 1.1;
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((min_t..max_t).log_scale(), 0f64..max_y)?;
    chart.configure_mesh().x_desc("tokens per rank").y_desc("latency (µs)").draw()?;
    for (i, (name, s)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let line: Vec<(f64, f64)> = s.iter().map(|(&t, v)| (t as f64, median(v))).collect();
        chart
            .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        if name.ends_with("combine") {
            chart.draw_series(line.iter().map(|&p| TriangleMarker::new(p, 5, color.filled())))?;
        } else {
            chart.draw_series(line.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE)
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Runs `epflow chart`: exit code 0 with the SVG written and the points printed, 2 when the
/// runs cannot be read or drawn.
pub(crate) fn main(args: &ChartArgs) -> ExitCode {
    let result = read_runs(&args.files).and_then(|runs| series(&runs, args.metric));
    let (series, setup) = match result {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let metric = match args.metric {
        ChartMetric::Median => "median",
        ChartMetric::Avg => "mean",
    };
    let title = args.title.clone().unwrap_or_else(|| format!("dispatch and combine, {metric} latency ({setup})"));
    if let Err(e) = draw(&args.svg, &title, &series) {
        eprintln!("error: {}: {e}", args.svg.display());
        return ExitCode::from(2);
    }
    println!("{title}: {} series, written to {}", series.len(), args.svg.display());
    for (name, s) in &series {
        let pts: Vec<String> = s.iter().map(|(t, v)| format!("{t}: {:.2}", median(v))).collect();
        println!("  {name} (µs by tokens per rank): {}", pts.join(", "));
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(backend: &str, tokens: usize, d: f64, c: f64) -> Run {
        Run {
            algorithm: "ll".into(),
            backend: backend.into(),
            device: "H200".into(),
            ranks: 2,
            tokens,
            layout: "rank-major".into(),
            dispatch: Op { avg_us: d, median_us: d },
            combine: Op { avg_us: c, median_us: c },
        }
    }

    #[test]
    fn runs_group_into_series_with_medians() {
        let runs = [
            run("gpu", 1, 9.0, 9.5),
            run("gpu", 1, 11.0, 9.5),
            run("gpu", 1, 10.0, 9.5),
            run("nccl-ep", 1, 18.0, 13.0),
        ];
        let (s, setup) = series(&runs, ChartMetric::Median).unwrap();
        assert_eq!(setup, "H200, 2 ranks");
        assert_eq!(s.len(), 4);
        assert_eq!(median(&s["gpu ll rank-major dispatch"][&1]), 10.0);
        assert_eq!(median(&[1.0, 2.0, 3.0, 4.0]), 2.5);
    }

    #[test]
    fn mixed_setups_and_bad_values_are_refused() {
        let mut other = run("gpu", 1, 9.0, 9.0);
        other.ranks = 4;
        assert!(
            series(&[run("gpu", 1, 9.0, 9.0), other], ChartMetric::Median).unwrap_err().contains("different setups")
        );
        assert!(series(&[run("gpu", 1, f64::NAN, 9.0)], ChartMetric::Median).unwrap_err().contains("not a positive"));
        assert!(series(&[run("gpu", 0, 9.0, 9.0)], ChartMetric::Median).unwrap_err().contains("log scale"));
    }
}
