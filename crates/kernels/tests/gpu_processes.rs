//! Processes joined over the TCP bootstrap (`setup::tcp_bootstrap`, no NCCL), so that two
//! processes may share one GPU (NCCL refuses two ranks of a communicator on one device): their
//! buffers are mapped with CUDA IPC between the processes. Each process runs eager low-latency
//! rounds (dispatch + combine, both layouts) against the CPU reference and prints the median
//! round time. Started by hand, one process per rank, e.g. two on GPU 0:
//!
//! ```text
//! for r in 0 1; do MASTER_ADDR=127.0.0.1 MASTER_PORT=29611 RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 \
//!     EPFLOW_TEST_SEED=7 gpu_processes --nocapture & done; wait
//! ```
//!
//! `LOCAL_RANK` is the device. Without `MASTER_ADDR` it prints SKIPPED and passes.
//! `EPFLOW_GPU_ITERS` sets the rounds per layout (default 20).

use std::time::{Duration, Instant};

use epflow_core::backend::{Backend, blocking_combine, blocking_dispatch, blocking_handle_with};
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions, Layout};
use epflow_core::scenario::Scenario;
use epflow_core::verify::{Tolerance, check_bf16};
use epflow_core::workload::RoutingKind;
use epflow_core::{Error, GroupConfig};
use epflow_kernels::setup::bootstrap::LaunchEnv;
use epflow_kernels::setup::tcp_bootstrap::TcpLinks;
use epflow_kernels::{GpuRank, GpuWorld};

/// One checked round of `layout` on `rank`; returns its wall time.
fn round(rank: &GpuRank, sc: &Scenario, layout: Layout) -> Result<Duration, Error> {
    let r = rank.rank();
    let idx = rank.upload(&sc.topk_idx(r))?;
    let x = rank.upload(&sc.tokens(r))?;
    let w = rank.upload(&sc.weights(r))?;
    let y = rank.upload(&sc.ll_reference_expert_outputs(r, layout).expect("a valid scenario"))?;
    let t = Instant::now();
    let handle = blocking_handle_with(rank, &idx, &HandleOptions::with_layout(layout))?;
    let din = match layout {
        Layout::RankMajor => DispatchInputs::new(&x).with_weights(&w),
        Layout::ExpertMajor => DispatchInputs::new(&x),
    };
    drop(blocking_dispatch(rank, &handle, din, &DispatchOptions::default(), false)?);
    let cin = match layout {
        Layout::RankMajor => CombineInputs::new(&y),
        Layout::ExpertMajor => CombineInputs::new(&y).with_weights(&w),
    };
    let out = blocking_combine(rank, &handle, cin, &CombineOptions::default(), true)?;
    let elapsed = t.elapsed();
    let want = match layout {
        Layout::ExpertMajor => sc.ll_combine_identity_reference(&sc.ll_dispatch_reference().unwrap()).unwrap(),
        Layout::RankMajor => {
            sc.ll_rank_major_combine_identity_reference(&sc.ll_rank_major_reference().unwrap()).unwrap()
        }
    };
    let got = out.to_host()?.tokens;
    let rep = check_bf16("combine", &want[r], got.as_bf16().unwrap_or_default(), Tolerance::Exact);
    assert!(rep.ok(), "rank {r} {}: {rep:?}", layout.name());
    Ok(elapsed)
}

#[test]
fn processes_over_the_tcp_bootstrap() {
    let env = match LaunchEnv::from_env() {
        Ok(Some(env)) => env,
        Ok(None) => {
            eprintln!("SKIPPED processes_over_the_tcp_bootstrap: no MASTER_ADDR (start one process per rank)");
            return;
        }
        Err(e) => panic!("bad launch environment: {e}"),
    };
    let base: u64 = std::env::var("EPFLOW_TEST_SEED").ok().and_then(|s| s.parse().ok()).expect("EPFLOW_TEST_SEED");
    let iters: u64 = std::env::var("EPFLOW_GPU_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    let (addr, port) = (
        std::env::var("MASTER_ADDR").expect("MASTER_ADDR"),
        std::env::var("MASTER_PORT").ok().and_then(|p| p.parse().ok()).expect("MASTER_PORT"),
    );
    let links = TcpLinks::connect(env.rank, env.world_size, &addr, port, Duration::from_secs(60)).expect("connect");
    let boot = epflow_kernels::setup::tcp_bootstrap::TcpBootstrap::new(links, env.local_rank).expect("bootstrap");
    let n = env.world_size;
    let cfg = GroupConfig::low_latency(16, 32, 2048).with_max_top_k(16);
    let rank = GpuWorld::join_over(&boot, cfg.clone(), epflow_kernels::Transport::Auto).expect("join the GPU group");
    eprintln!("rank {} of {n} joined on device {} (CUDA IPC between the processes)", env.rank, env.local_rank);
    for layout in [Layout::ExpertMajor, Layout::RankMajor] {
        let mut times = Vec::new();
        for i in 0..iters {
            let sc = Scenario::generate(
                cfg.clone(),
                n,
                &vec![32; n],
                8,
                RoutingKind::Uniform,
                3,
                base.wrapping_add(i * 7919),
            );
            times.push(round(&rank, &sc, layout).expect("round"));
        }
        times.sort();
        eprintln!(
            "ok: rank {} of {n}, {}: {iters} rounds checked; handle + dispatch + combine median {:.1} us, max {:.1} us",
            env.rank,
            layout.name(),
            times[times.len() / 2].as_secs_f64() * 1e6,
            times[times.len() - 1].as_secs_f64() * 1e6
        );
    }
}
