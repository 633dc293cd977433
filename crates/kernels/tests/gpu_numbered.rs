//! Low-latency operations numbered on the device ([`epflow_kernels::DeviceNumbering`], what NCCL
//! EP's C API captures into a caller's CUDA graphs) on GPUs against the CPU reference: eager
//! host-numbered rounds first (so the switch starts past 0), then dispatch + combine captured
//! into a CUDA graph by the test itself (cudarc's stream capture, not `GpuRank::capture`) and
//! replayed with fresh inputs written in place, outputs poisoned before every run, eager
//! numbered rounds between replays, both layouts, staged and synchronous; then the rules'
//! errors. Without enough GPUs every test prints SKIPPED and passes. `EPFLOW_TEST_DEVICES=0,0`
//! runs two ranks on one GPU (a functional check). `EPFLOW_GPU_ITERS` sets the replays (default
//! 30).

use std::sync::Arc;

use cudarc::driver::{CudaStream, sys};
use epflow_core::backend::{Backend, blocking_dispatch, blocking_handle_on};
use epflow_core::handle::RoutingHandle;
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions, Layout};
use epflow_core::scenario::Scenario;
use epflow_core::verify::Report;
use epflow_core::workload::RoutingKind;
use epflow_core::{DType, DispatchDtype, Error, GroupConfig, TensorDesc, TensorTag, ValidationError};
use epflow_kernels::{DeviceNumbering, DeviceTensor, GpuHandle, GpuRank, GpuWorld, NumberedSend, OutputTargets};

mod common;
use common::{LlRound, check_ll_round, eager_ll_round, gpus, on_ranks, seed, shared_gpu_sms};

const M: usize = 64;

fn config(devices: &[usize], hidden: usize, experts: usize, dtype: DispatchDtype) -> GroupConfig {
    GroupConfig::low_latency(experts, M, hidden)
        .with_dispatch_dtype(dtype)
        .with_max_top_k(16)
        .with_max_sms(shared_gpu_sms(devices))
}

fn iters() -> u64 {
    std::env::var("EPFLOW_GPU_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(30)
}

/// One rank's buffers: inputs refilled before every run, the caller's outputs, and a handle
/// created in the stream's order on `topk` (its dispatches read `topk` at every run).
struct Buffers {
    topk: DeviceTensor,
    x: DeviceTensor,
    w: DeviceTensor,
    y: DeviceTensor,
    /// The dispatch's outputs: tokens, scales, weights, ids, counts (as `dispatch_output_descs`).
    out: [Option<DeviceTensor>; 5],
    targets: OutputTargets,
    combined: DeviceTensor,
    handle: GpuHandle,
}

impl Buffers {
    fn new(rank: &GpuRank, sc: &Scenario, layout: Layout, stream: &Arc<CudaStream>) -> Result<Self, Error> {
        let r = rank.rank();
        let topk = rank.upload(&sc.topk_idx(r))?;
        let x = rank.upload(&sc.tokens(r))?;
        let w = rank.upload(&sc.weights(r))?;
        let y = rank.upload(&sc.ll_reference_expert_outputs(r, layout).expect("a valid scenario"))?;
        let handle = blocking_handle_on(rank, &topk, &HandleOptions::with_layout(layout), stream)?.0;
        let (ctx, dev) = (rank.context(), rank.device());
        let descs = rank.dispatch_output_descs(&handle, &DispatchOptions::default());
        let alloc = |d: Option<TensorDesc>| d.map(|d| DeviceTensor::zeros(ctx, dev, d)).transpose();
        let tokens = DeviceTensor::zeros(ctx, dev, descs.tokens)?;
        let (scales, weights, idx, counts) =
            (alloc(descs.scales)?, alloc(descs.topk_weights)?, alloc(descs.topk_idx)?, alloc(descs.counts)?);
        let targets = OutputTargets {
            tokens: tokens.ptr(),
            scales: scales.as_ref().map(DeviceTensor::ptr),
            topk_weights: weights.as_ref().map(DeviceTensor::ptr),
            topk_idx: idx.as_ref().map(DeviceTensor::ptr),
            counts: counts.as_ref().map(DeviceTensor::ptr),
            ..OutputTargets::default()
        };
        let out = [Some(tokens), scales, weights, idx, counts];
        let desc = TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[handle.num_tokens(), sc.config.hidden]);
        let combined = DeviceTensor::zeros(ctx, dev, desc)?;
        Ok(Buffers { topk, x, w, y, out, targets, combined, handle })
    }

    /// Writes `sc`'s inputs for this rank in place and poisons the outputs.
    fn refill(&self, rank: &GpuRank, sc: &Scenario, layout: Layout) -> Result<(), Error> {
        let (r, ctx) = (rank.rank(), rank.context());
        self.topk.copy_from_host(ctx, &sc.topk_idx(r))?;
        self.x.copy_from_host(ctx, &sc.tokens(r))?;
        self.w.copy_from_host(ctx, &sc.weights(r))?;
        self.y.copy_from_host(ctx, &sc.ll_reference_expert_outputs(r, layout).expect("a valid scenario"))?;
        for t in self.out.iter().flatten().chain([&self.combined]) {
            t.fill_bytes(ctx, 0xA5)?;
        }
        Ok(())
    }

    /// Dispatch then combine, numbered on the device, on `stream` (staged halves with
    /// `staged`).
    fn enqueue(
        &self,
        rank: &GpuRank,
        dn: &DeviceNumbering,
        layout: Layout,
        stream: &CudaStream,
        staged: bool,
    ) -> Result<(), Error> {
        let din = match layout {
            Layout::RankMajor => DispatchInputs::new(&self.x).with_weights(&self.w),
            Layout::ExpertMajor => DispatchInputs::new(&self.x),
        };
        let opts = DispatchOptions::default();
        // SAFETY: the targets are this rank's tensors of the shapes dispatch_output_descs gave,
        // alive (with the graph) until the test ends.
        let sent = unsafe { rank.numbered_dispatch_into(dn, &self.handle, din, &opts, &self.targets, stream, staged) }?;
        complete(rank, dn, sent, stream)?;
        let cin = match layout {
            Layout::RankMajor => CombineInputs::new(&self.y),
            Layout::ExpertMajor => CombineInputs::new(&self.y).with_weights(&self.w),
        };
        let into = OutputTargets { tokens: self.combined.ptr(), ..OutputTargets::default() };
        // SAFETY: `combined` is [B x H] BF16 of this rank, alive until the test ends.
        let sent = unsafe {
            rank.numbered_combine_into(dn, &self.handle, cin, &CombineOptions::default(), &into, stream, staged)
        }?;
        complete(rank, dn, sent, stream)
    }

    /// Checks the outputs on this rank against `sc`'s reference.
    fn check(&self, rank: &GpuRank, sc: &Scenario, layout: Layout) -> Result<(Report, Report), Error> {
        let (r, ctx) = (rank.rank(), rank.context());
        let get = |i: usize| self.out[i].as_ref().map(|t| t.download(ctx)).transpose();
        let rank_major = match layout {
            Layout::RankMajor => Some((get(2)?.expect("weights"), get(3)?.expect("ids"))),
            Layout::ExpertMajor => None,
        };
        let got = LlRound {
            tokens: get(0)?.expect("tokens"),
            scales: get(1)?,
            counts: get(4)?.expect("counts"),
            rank_major,
            combined: self.combined.download(ctx)?,
        };
        Ok(check_ll_round(sc, r, layout, M, &got))
    }
}

fn complete(
    rank: &GpuRank,
    dn: &DeviceNumbering,
    sent: Option<NumberedSend>,
    stream: &CudaStream,
) -> Result<(), Error> {
    match sent {
        Some(s) => rank.numbered_complete(dn, &s, stream),
        None => Ok(()),
    }
}

fn sync(stream: &CudaStream) -> Result<(), Error> {
    stream.synchronize().map_err(|e| Error::Backend(format!("synchronize: {e}")))
}

fn run_world(devices: &[usize], cfg: &GroupConfig, base: u64, tokens: usize, top_k: usize) {
    let replays = iters();
    for (layout, staged) in [(Layout::ExpertMajor, true), (Layout::RankMajor, false), (Layout::ExpertMajor, false)] {
        let scenario = |i: u64| {
            let s = base.wrapping_add(i * 7919 + tokens as u64 * 31 + top_k as u64);
            let kind = if i % 5 == 4 { RoutingKind::Skewed } else { RoutingKind::Uniform };
            Scenario::generate(cfg.clone(), devices.len(), &vec![tokens; devices.len()], top_k, kind, 3, s)
        };
        let what = format!(
            "R={} H={} {:?} tokens={tokens} top_k={top_k} {} {}",
            devices.len(),
            cfg.hidden,
            cfg.dispatch_dtype,
            layout.name(),
            if staged { "staged" } else { "synchronous" }
        );
        // A group of its own: a rank never goes back to numbering on the host.
        let world = GpuWorld::create(devices, cfg.clone()).expect("create GPU group");
        on_ranks(&world, |rank| {
            let stream = rank.context().new_stream().expect("stream");
            // Host-numbered rounds first: the device numbers continue from theirs.
            for i in 0..3 {
                let e = eager_ll_round(rank, &scenario(1000 + i)).expect("eager round");
                assert!(e.ok(), "{what}: eager round {i}: {e:?}");
            }
            let first = scenario(0);
            let b = Buffers::new(rank, &first, layout, &stream).expect("buffers");
            let dn = rank.device_numbering().expect("device numbering");
            rank.start_device_numbering(&dn).expect("switch");
            assert!(dn.started());
            // Eager host-numbered operations are refused now.
            let e = blocking_dispatch(rank, &b.handle, DispatchInputs::new(&b.x), &DispatchOptions::default(), false);
            assert!(
                matches!(e, Err(Error::Unsupported(_))),
                "{what}: a host-numbered dispatch after the switch: {e:?}"
            );
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).expect("begin capture");
            let recorded = b.enqueue(rank, &dn, layout, &stream, staged);
            let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).expect("end capture");
            recorded.expect("captured operations");
            let graph = graph.expect("a graph");
            for i in 0..replays {
                let sc = scenario(i);
                b.refill(rank, &sc, layout).expect("refill");
                if i % 4 == 3 {
                    // An eager round numbered on the device between replays.
                    b.enqueue(rank, &dn, layout, &stream, !staged).expect("eager numbered round");
                } else {
                    graph.launch().expect("launch the graph");
                }
                sync(&stream).expect("run");
                dn.check(Some(&b.handle)).expect("no failure on the device");
                let (d, y) = b.check(rank, &sc, layout).expect("check");
                assert!(d.ok() && y.ok(), "{what} run {i} seed {base}: {d:?} {y:?}");
            }
            assert_eq!(dn.open_sends(epflow_core::protocol::Channel::Dispatch), 0);
        });
        eprintln!("ok: {what}: {replays} runs (a quarter eager) checked");
    }
}

#[test]
fn numbered_replays_match_reference_on_1_and_2_gpus() {
    let base = seed();
    eprintln!("seed {base}");
    for n in [1usize, 2] {
        let Some(devices) = gpus(n, &format!("numbered_replays_match_reference ({n} GPUs)")) else { continue };
        for (h, e, dt) in
            [(7168usize, 32usize, DispatchDtype::Bf16), (2048, 64, DispatchDtype::Fp8 { round_scales: true })]
        {
            run_world(&devices, &config(&devices, h, e, dt), base, M, 8);
        }
        run_world(&devices, &config(&devices, 2048, 16, DispatchDtype::Bf16), base ^ 0x55, 5, 4);
    }
}

#[test]
fn numbered_rules_are_errors() {
    let Some(devices) = gpus(1, "numbered_rules_are_errors") else { return };
    let cfg = config(&devices, 2048, 16, DispatchDtype::Bf16);
    let ranks = GpuWorld::create(&devices, cfg.clone()).expect("create GPU group");
    let rank = &ranks[0];
    let sc = Scenario::generate(cfg.clone(), 1, &[16], 4, RoutingKind::Uniform, 3, seed());
    let stream = rank.context().new_stream().expect("stream");
    let b = Buffers::new(rank, &sc, Layout::ExpertMajor, &stream).expect("buffers");
    let dn = rank.device_numbering().expect("device numbering");
    let opts = DispatchOptions::default();
    // Not started: refused by name.
    // SAFETY: the targets are this rank's tensors of the shapes dispatch_output_descs gave.
    let e = unsafe {
        rank.numbered_dispatch_into(&dn, &b.handle, DispatchInputs::new(&b.x), &opts, &b.targets, &stream, false)
    };
    assert!(matches!(e, Err(Error::Unsupported(ref m)) if m.contains("start_device_numbering")), "{e:?}");
    rank.start_device_numbering(&dn).expect("switch");
    // A combine before any dispatch on the handle.
    let into = OutputTargets { tokens: b.combined.ptr(), ..OutputTargets::default() };
    let cin = CombineInputs::new(&b.y).with_weights(&b.w);
    // SAFETY: `combined` is [B x H] BF16 of this rank.
    let e =
        unsafe { rank.numbered_combine_into(&dn, &b.handle, cin, &CombineOptions::default(), &into, &stream, false) };
    assert!(matches!(e, Err(Error::Validation(ValidationError::CombineBeforeDispatch))), "{e:?}");
    // Two staged dispatches (the buffer sets), then a third and a synchronous one are refused,
    // and the second cannot complete before the first.
    // SAFETY: as above.
    let send = |staged| unsafe {
        rank.numbered_dispatch_into(&dn, &b.handle, DispatchInputs::new(&b.x), &opts, &b.targets, &stream, staged)
    };
    let first = send(true).expect("first").expect("a send half");
    let second = send(true).expect("second").expect("a send half");
    assert!(matches!(send(true), Err(Error::Unsupported(ref m)) if m.contains("buffer sets")));
    assert!(matches!(send(false), Err(Error::Unsupported(ref m)) if m.contains("synchronous")));
    let e = rank.numbered_complete(&dn, &second, &stream);
    assert!(matches!(e, Err(Error::Unsupported(ref m)) if m.contains("order")), "{e:?}");
    rank.numbered_complete(&dn, &first, &stream).expect("first completes");
    rank.numbered_complete(&dn, &second, &stream).expect("then the second");
    sync(&stream).expect("run");
    dn.check(Some(&b.handle)).expect("no failure");
    let (d, _) = b.check(rank, &sc, Layout::ExpertMajor).expect("check");
    assert!(d.ok(), "the second staged dispatch's outputs: {d:?}");
    // A high-throughput group has no device numbering.
    let ht = GroupConfig::high_throughput(16, 2048).with_max_sms(shared_gpu_sms(&devices));
    let ht_ranks = GpuWorld::create(&devices, ht).expect("create HT group");
    assert!(matches!(ht_ranks[0].device_numbering(), Err(Error::Unsupported(_))));
}
