//! The `epflow` binary: bad flags exit with code 2 and a clear message; small benchmarks run
//! on the host backend and validate.

use std::process::Command;

fn epflow(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_epflow")).args(args).output().expect("run epflow");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn bad_flags_exit_2_with_a_clear_error() {
    let cases: &[(&[&str], &str)] = &[
        (&["bench", "--tokens", "0"], "--tokens must be at least 1"),
        (&["bench", "--experts", "7", "--ranks", "4"], "not divisible by the number of ranks"),
        (&["bench", "--algorithm", "xx"], "invalid value 'xx'"),
        (&["bench", "--hidden", "100"], "not a multiple of 8"),
        (&["bench", "--dtype", "fp8", "--hidden", "136"], "multiple of 128"),
        (&["bench", "--top-k", "0"], "--top-k"),
        (&["bench", "--top-k", "17", "--experts", "32"], "at most 16"),
        (&["bench", "--backend", "host", "--hidden", "1000000"], "needs"),
        (&["bench", "--backend", "host", "--tokens", "100000"], "of host memory"),
        (&["bench", "--hidden", "2000000"], "hidden: 2000000 is more than the supported"),
        (&["bench", "--tokens", "1099511627776"], "max_tokens_per_rank"),
        (&["bench", "--timeout-ms", "18446744073709551615"], "timeout is"),
        (&["bench", "--ranks", "0"], "num_ranks is 0"),
        (&["bench", "--iters", "0"], "--iters"),
        (&["bench", "--algorithm", "ht", "--staged"], "--staged"),
        (&["bench", "--algorithm", "ll", "--fresh-routing"], "--fresh-routing with --algorithm ll needs --queued"),
        (&["bench", "--round-scales"], "--round-scales needs --dtype fp8"),
        (&["bench", "--tokens", "-3"], "unexpected argument"),
        (&["bench", "--no-such-flag"], "unexpected argument"),
        (&["bench", "--max-sms", "0"], "max_sms is 0"),
        (&["bench", "--backend", "host", "--hosts", "2"], "--hosts needs the GPU backend"),
        (&["bench", "--backend", "nccl-epp"], "invalid value 'nccl-epp'"),
        (&["bench", "--backend", "host", "--devices", "0,0"], "--devices places GPU ranks: it needs a GPU backend"),
        (&["bench", "--devices", "0,x"], "invalid value 'x'"),
        (&["bench", "--algorithm", "ht", "--rank-masking"], "rank_masking is a low-latency option"),
        (&["launch", "-n", "0", "--", "true"], "-n must be at least 1"),
        (&["diag", "launch", "--iters", "0"], "--tokens and --iters must be at least 1"),
        (&["diag", "launch", "--tokens", "0"], "--tokens and --iters must be at least 1"),
        (&["launch", "-n", "2", "--nnodes", "2", "--", "true"], "needs --master-addr"),
        (&["launch", "-n", "2", "--nnodes", "2", "--node-rank", "2", "--", "true"], "--node-rank (2) must be below"),
        (&["launch", "-n", "1", "--master-addr", "h", "--master-port", "0", "--", "true"], "not a port number"),
        (
            &["launch", "-n", "2", "--nnodes", "2", "--master-addr", "h", "--restarts", "1", "--", "true"],
            "--restarts takes one host",
        ),
        (
            &["launch", "-n", "1", "--master-addr", "h", "--master-port", "65535", "--restarts", "1", "--", "true"],
            "--restarts needs the port after --master-port (65535)",
        ),
    ];
    for (args, want) in cases {
        let (code, _, err) = epflow(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: stderr {err:?} should contain {want:?}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// `--rank-masking` makes the group able to mask a dead rank; none is masked, so the outputs
/// are the full group's, checked against the reference.
#[test]
fn rank_masking_bench_validates() {
    let args = ["bench", "--backend", "host", "--ranks", "3", "--tokens", "8", "--hidden", "128", "--experts", "12"];
    let (code, out, err) =
        epflow(&[&args[..], &["--warmup", "1", "--iters", "2", "--validate", "--rank-masking"]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("rank_masking=true"), "{out}");
    assert!(out.contains("Validation: PASSED"), "{out}");
}

#[test]
fn top_k_beyond_eight_sizes_the_group() {
    // Qwen3-Next routes to 10 experts: the group's top-k bound follows --top-k (up to 16).
    for k in ["10", "16"] {
        let (code, out, err) = epflow(&[
            "bench",
            "--backend",
            "host",
            "--top-k",
            k,
            "--experts",
            "20",
            "--ranks",
            "5",
            "--tokens",
            "8",
            "--hidden",
            "256",
            "--warmup",
            "1",
            "--iters",
            "2",
            "--validate",
        ]);
        assert_eq!(code, 0, "--top-k {k}: {err}");
        assert!(out.contains("Validation: PASSED"), "{out}");
    }
}

#[test]
fn small_ll_bench_validates() {
    let (code, out, err) = epflow(&[
        "bench",
        "--backend",
        "host",
        "--ranks",
        "4",
        "--tokens",
        "16",
        "--hidden",
        "256",
        "--experts",
        "32",
        "--warmup",
        "1",
        "--iters",
        "3",
        "--validate",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("Validation: PASSED"), "{out}");
    assert!(out.contains("Dispatch (BF16):") && out.contains("GB/s"), "{out}");
    // Low-latency handles are timed too: local, made with the bench's layout.
    let handle = out.lines().find(|l| l.starts_with("Handle:")).unwrap_or_else(|| panic!("{out}"));
    assert!(handle.contains("(host clock, local: the routing checked and planned on the host)"), "{handle}");
    let median: f64 = handle.split("median=").nth(1).and_then(|m| m.split(' ').next()?.parse().ok()).unwrap();
    assert!(median > 0.0, "{handle}");
}

#[test]
fn small_ht_fp8_bench_validates_as_json() {
    let (code, out, err) = epflow(&[
        "bench",
        "--algorithm",
        "ht",
        "--ranks",
        "2",
        "--tokens",
        "64",
        "--hidden",
        "256",
        "--experts",
        "16",
        "--dtype",
        "fp8",
        "--warmup",
        "0",
        "--iters",
        "2",
        "--validate",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    assert_eq!(v["validation"]["passed"], true, "{out}");
    assert_eq!(v["algorithm"], "ht");
    assert_eq!(v["dtype"], "fp8");
    assert!(v["dispatch"]["avg_us"].as_f64().unwrap() > 0.0);
}

/// `--fresh-routing`: a new routing and handle every iteration, the handle time beside
/// dispatch and combine, and the training step (handle, forward pair, backward pair).
#[test]
fn fresh_routing_bench_reports_the_training_step() {
    let args = ["bench", "--algorithm", "ht", "--ranks", "2", "--tokens", "48", "--hidden", "256", "--experts", "16"];
    let (code, out, err) =
        epflow(&[&args[..], &["--warmup", "1", "--iters", "4", "--validate", "--fresh-routing"]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("Validation: PASSED"), "{out}");
    assert!(out.contains("Training step (handle + forward D+C + backward D+C"), "{out}");
    assert!(out.contains("Handle:"), "{out}");
    let (code, out, err) =
        epflow(&[&args[..], &["--warmup", "0", "--iters", "3", "--fresh-routing", "--json"]].concat());
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    assert_eq!(v["fresh_routing"], true, "{out}");
    // Each step holds its handle and both pairs, so the shortest step is at least the shortest
    // handle plus the shortest forward dispatch and combine.
    let (step, handle) = (v["total"]["min_us"].as_f64().unwrap(), v["handle"]["min_us"].as_f64().unwrap());
    let (d, c) = (v["dispatch"]["min_us"].as_f64().unwrap(), v["combine"]["min_us"].as_f64().unwrap());
    assert!(handle > 0.0 && step >= handle + d + c - 1e-6, "{out}");
}

/// `--graph`: the captured dispatch + combine step's replays beside the eager operations, its
/// first replay validated with them; refused where nothing is captured.
#[test]
fn graph_bench_reports_replays_beside_eager_operations() {
    let args = ["bench", "--algorithm", "ll", "--ranks", "2", "--tokens", "16", "--hidden", "256", "--experts", "16"];
    for layout in ["expert-major", "rank-major"] {
        let (code, out, err) = epflow(
            &[&args[..], &["--warmup", "1", "--iters", "4", "--validate", "--graph", "--layout", layout]].concat(),
        );
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("Validation: PASSED"), "{out}");
        assert!(out.contains("Graph replay (D+C as one captured step"), "{out}");
    }
    let (code, out, err) = epflow(&[&args[..], &["--warmup", "0", "--iters", "3", "--graph", "--json"]].concat());
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    assert!(v["graph"]["median_us"].as_f64().unwrap() > 0.0, "{out}");
    let (code, _, err) = epflow(&["bench", "--algorithm", "ht", "--ranks", "2", "--graph"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--graph"), "{err}");
}

/// `--queued` on the host backend: the eager report stands, the note says that there is no
/// device clock and the JSON report has no queued times; refused for high-throughput.
#[test]
fn queued_bench_needs_a_device_clock() {
    let args = ["bench", "--backend", "host", "--ranks", "2", "--tokens", "8", "--hidden", "256", "--experts", "16"];
    let (code, out, err) = epflow(&[&args[..], &["--warmup", "0", "--iters", "2", "--validate", "--queued"]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("Validation: PASSED"), "{out}");
    assert!(err.contains("--queued: this backend has no device clock"), "{err}");
    let (code, out, err) = epflow(&[&args[..], &["--warmup", "0", "--iters", "2", "--queued", "--json"]].concat());
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    assert!(v["queued"].is_null() && v["host_clock"].is_null(), "{out}");
    let (code, _, err) = epflow(&["bench", "--algorithm", "ht", "--ranks", "2", "--queued"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--queued"), "{err}");
}

/// Across hosts, `epflow launch` gives each process torchrun's variables (no NCCL needed to
/// start them: the id is exchanged later, over TCP, by the processes themselves).
#[test]
fn launch_across_hosts_sets_the_torchrun_environment() {
    let (code, out, err) = epflow(&[
        "launch",
        "-n",
        "2",
        "--nnodes",
        "3",
        "--node-rank",
        "1",
        "--master-addr",
        "10.1.2.3",
        "--master-port",
        "29511",
        "--",
        "sh",
        "-c",
        "echo $RANK/$WORLD_SIZE/$LOCAL_RANK/$MASTER_ADDR:$MASTER_PORT/${EPFLOW_NCCL_ID:-none}",
    ]);
    assert_eq!(code, 0, "{err}");
    let mut lines: Vec<&str> = out.lines().collect();
    lines.sort();
    assert_eq!(lines, ["2/6/0/10.1.2.3:29511/none", "3/6/1/10.1.2.3:29511/none"]);
}

/// `epflow launch` bounds `-n` (per host), `--nnodes`, `--node-rank` and the whole job's ranks
/// (without overflow), and starts nothing when one is out of range (issue 64, item 2).
#[test]
fn launch_bounds_its_counts_and_starts_nothing_out_of_range() {
    let per_host =
        "-n is 1 to 8 processes per host (epflow_kernels::MAX_GPU_RANKS: the most ranks a GPU group may have)";
    let hosts = "--nnodes is 1 to 1024 hosts (epflow_core::config::MAX_RANKS: the most ranks a group may have)";
    let cases: &[(&[&str], String)] = &[
        (
            &["-n", "18446744073709551615"],
            format!("invalid value '18446744073709551615' for '--nprocs <NPROCS>': {per_host}"),
        ),
        (&["-n", "9223372036854775809", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h"], per_host.into()),
        (&["-n", "9"], format!("invalid value '9' for '--nprocs <NPROCS>': {per_host}")),
        (&["-n", "2", "--nnodes", "0"], format!("invalid value '0' for '--nnodes <NNODES>': {hosts}")),
        (&["-n", "2", "--nnodes", "1025", "--master-addr", "h"], hosts.into()),
        (&["-n", "2", "--nnodes", "18446744073709551615", "--master-addr", "h"], hosts.into()),
        (
            &["-n", "8", "--nnodes", "129", "--node-rank", "128", "--master-addr", "h"],
            "error: -n 8 x --nnodes 129 is more than the 1024 ranks a group may have (epflow_core::config::MAX_RANKS)"
                .into(),
        ),
        (
            &["-n", "2", "--nnodes", "2", "--node-rank", "18446744073709551615", "--master-addr", "h"],
            "error: --node-rank (18446744073709551615) must be below --nnodes (2)".into(),
        ),
    ];
    for (flags, want) in cases {
        let args = [&["launch"][..], flags, &["--", "sh", "-c", "echo started $RANK/$WORLD_SIZE"]].concat();
        let (code, out, err) = epflow(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(want.as_str()), "{args:?}: stderr {err:?} should contain {want:?}");
        assert_eq!(out, "", "{args:?}: nothing may start");
    }
    // The largest job is accepted: the last host of 128 x 8 ranks.
    let (code, out, err) = epflow(&[
        "launch",
        "-n",
        "8",
        "--nnodes",
        "128",
        "--node-rank",
        "127",
        "--master-addr",
        "h",
        "--",
        "sh",
        "-c",
        "echo $RANK/$WORLD_SIZE",
    ]);
    assert_eq!(code, 0, "{err}");
    let mut lines: Vec<&str> = out.lines().collect();
    lines.sort();
    assert_eq!(lines, (1016..1024).map(|r| format!("{r}/1024")).collect::<Vec<_>>());
}

/// An `ep_bench` low-latency run's output as `epflow ep-bench-report` reads it (abridged), with
/// kernel averages `dispatch` and `combine` (the ranks' own averages 0.5 µs either side).
fn ep_bench_log(dispatch: &str, combine: &str) -> String {
    format!(
        "=== NCCL EP Performance Benchmark ===\nConfiguration:\n  Algorithm:       LOW_LATENCY\n  \
         Layout:          rank-major\n  Ranks:           2\n  Tokens:          1\n  Dispatch dtype:  BF16\n\n\
         --- Host-observed performance ---\nDispatch (BF16):  avg=20.00 us, min=1.00 us, max=99.00 us\n\
         Combine (BF16):   avg=18.00 us, min=1.00 us, max=99.00 us\n\n--- Kernel-only performance ---\n\
         Dispatch:    avg={dispatch} us, min=8.00 us, max=8.50 us\n\
         Combine:     avg={combine} us, min=9.00 us, max=9.50 us\n"
    )
}

/// `epflow ep-bench-report` on runs with NaN or infinite values: each is an error naming the
/// file, line and field, left out, and the exit code is 1; a ratio over a zero mean prints as
/// `-`; the report never prints NaN or inf (issue 64, item 5).
#[test]
fn ep_bench_report_refuses_values_that_are_not_finite() {
    let dir = std::env::temp_dir().join(format!("epflow-cli-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let base = file("base.log", ep_bench_log("16.00", "12.00"));
    let good = file("good.log", ep_bench_log("8.00", "10.00"));
    let nan = file("nan.log", ep_bench_log("nan", "10.00"));
    let inf = file("inf.log", ep_bench_log("8.00", "inf"));
    let zero = file("zero.log", ep_bench_log("0.00", "0.00"));
    let (code, out, err) = epflow(&["ep-bench-report", "--baseline", &base, &inf, "--ours", &good, &nan]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!(
            "error: {nan}: line 14: Kernel-only Dispatch avg is \"nan\", not a finite number; run left out"
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "error: {inf}: line 15: Kernel-only Combine avg is \"inf\", not a finite number; run left out"
        )),
        "{err}"
    );
    assert!(err.contains("error: 2 run(s) left out for values that are not finite numbers"), "{err}");
    assert!(out.contains("baseline / epflow: kernel 2.00 / 1.20x, host 1.00 / 1.00x"), "{out}");
    assert!(!out.to_lowercase().contains("nan") && !out.contains("inf"), "{out}");
    let (code, out, err) = epflow(&["ep-bench-report", "--baseline", &base, "--ours", &zero]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("baseline / epflow: kernel - / -x, host 1.00 / 1.00x"), "{out}");
    assert!(!out.to_lowercase().contains("nan") && !out.contains("inf"), "{out}");
    for (args, want) in [
        (["--offset-us", "inf"], "--offset-us must be a positive finite number of µs"),
        (["--targets", "1:nan/10"], "--targets: `1:nan/10`: the targets must be finite numbers of µs"),
    ] {
        let (code, _, err) = epflow(&[&["ep-bench-report", "--baseline", &base, "--ours", &good][..], &args].concat());
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `epflow chart` draws `epflow bench --json` runs (two layouts of the host backend, three token
/// counts) as one SVG with a line per backend, layout and operation; unreadable or mixed input
/// is exit code 2.
#[test]
fn chart_draws_bench_json_runs() {
    let dir = std::env::temp_dir().join(format!("epflow-chart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut files = Vec::new();
    for layout in ["expert-major", "rank-major"] {
        let mut runs = String::new();
        for tokens in ["1", "4", "16"] {
            let (code, out, err) = epflow(&[
                "bench",
                "--backend",
                "host",
                "--tokens",
                tokens,
                "--iters",
                "3",
                "--warmup",
                "1",
                "--layout",
                layout,
                "--json",
            ]);
            assert_eq!(code, 0, "{err}");
            runs.push_str(&out);
        }
        let f = dir.join(format!("{layout}.json"));
        std::fs::write(&f, runs).unwrap();
        files.push(f.to_string_lossy().into_owned());
    }
    let svg = dir.join("chart.svg");
    let svg_s = svg.to_string_lossy().into_owned();
    let mut args = vec!["chart", "--svg", &svg_s];
    args.extend(files.iter().map(String::as_str));
    let (code, out, err) = epflow(&args);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("4 series"), "{out}");
    for series in ["host ll expert-major dispatch", "host ll rank-major combine"] {
        assert!(out.contains(series), "{out}");
    }
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.contains("tokens per rank"), "not the chart");
    assert!(text.contains("host ll rank-major combine"), "no legend");
    let bad = dir.join("bad.json");
    std::fs::write(&bad, "{\"tokens\": 3}").unwrap();
    let (code, _, err) = epflow(&["chart", "--svg", &svg_s, &bad.to_string_lossy()]);
    assert_eq!(code, 2);
    assert!(err.contains("not an `epflow bench --json` report"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `epflow diag env` (no GPU needed) lists every knob with the value the environment gives it,
/// and the tuning a new group takes from it.
#[test]
fn diag_env_lists_every_knob_and_the_tuning_it_gives() {
    let out = Command::new(env!("CARGO_BIN_EXE_epflow"))
        .args(["diag", "env"])
        .env("EPFLOW_HT_DEPTH", "128")
        .env("EPFLOW_ONE_LAUNCH", "0")
        .output()
        .expect("run epflow");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for k in epflow::core::tuning::KNOBS {
        assert!(text.contains(k.name), "{} missing:\n{text}", k.name);
    }
    let depth = text.lines().find(|l| l.starts_with("EPFLOW_HT_DEPTH ")).unwrap_or_default();
    assert!(depth.split_whitespace().nth(1) == Some("128"), "{depth}");
    let tuned = text.find("depth: Some(").map(|i| &text[i..(i + 60).min(text.len())]).unwrap_or_default();
    assert!(tuned.contains("128"), "the group's tuning: {tuned}");
    assert!(text.contains("one_launch: false"), "{text}");
}

/// `epflow launch --restarts K`: a rank's process that fails is started again with
/// `EPFLOW_REJOIN=1` and its restart count while the others run on, every process has the
/// meetings' port (`--master-port` + 1), and the job succeeds if every rank's last process did;
/// past the K-th restart a failure stops the others as without the flag.
#[test]
fn launch_restarts_a_failed_rank_with_epflow_rejoin() {
    let script = r#"if [ "$RANK" = 1 ] && [ -z "$EPFLOW_REJOIN" ]; then echo "1 died"; exit 3; fi; sleep 0.3; echo "$RANK ${EPFLOW_REJOIN:-0} ${EPFLOW_RESTART:-0} $EPFLOW_MEETING_PORT""#;
    let launch = |restarts: &str, script: &str| {
        epflow(&[
            "launch",
            "-n",
            "2",
            "--restarts",
            restarts,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            "29611",
            "--",
            "sh",
            "-c",
            script,
        ])
    };
    let (code, out, err) = launch("1", script);
    assert_eq!(code, 0, "{err}");
    let mut lines: Vec<&str> = out.lines().collect();
    lines.sort();
    assert_eq!(lines, ["0 0 0 29612", "1 1 1 29612", "1 died"], "{err}");
    assert!(
        err.contains(
            "[launch] rank 1 failed (exit status: 3); starting it again with EPFLOW_REJOIN=1 (0 restart(s) left)"
        ),
        "{err}"
    );
    // Rank 1 fails every time: one restart, then its second failure stops rank 0.
    let t = std::time::Instant::now();
    let (code, out, err) = launch("1", r#"if [ "$RANK" = 1 ]; then exit 4; fi; exec sleep 30"#);
    assert_eq!(code, 4, "{err}");
    assert!(t.elapsed() < std::time::Duration::from_secs(20), "rank 0 was not stopped: {:?}", t.elapsed());
    assert_eq!(out, "");
    assert!(err.contains("[launch] rank 1 failed (exit status: 4); stopping the others"), "{err}");
    // Without --restarts: no meeting port, and a failure stops the others.
    let (code, out, err) = launch("0", r#"echo "port=${EPFLOW_MEETING_PORT:-none}"; exit $RANK"#);
    assert_eq!(code, 1, "{err}");
    assert!(out.lines().all(|l| l == "port=none"), "{out}");
}
