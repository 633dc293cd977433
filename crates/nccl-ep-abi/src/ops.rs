//! `ncclEpDispatch`, `ncclEpCombine` and `ncclEpComplete` on epflow's kernels: the caller's
//! tensors checked against the shapes `nccl_ep.h` gives, the operation started with its outputs
//! in the caller's tensors and its send half on the caller's stream, then (unless `send_only`)
//! its receive enqueued on the same stream. Nothing waits on the host in low-latency calls;
//! high-throughput calls return once the device finished (as NCCL EP 0.1's dispatch, which reads
//! the receive count back).

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaStream;
use epflow_core::backend::{Backend, PendingOp, StreamOrder, send_blocking};
use epflow_core::config::FP8_BLOCK;
use epflow_core::handle::RoutingHandle;
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, Layout, Pass};
use epflow_core::protocol::Channel;
use epflow_core::{Algorithm, CombineQuant, DType, DispatchDtype, Error, TensorDesc, TensorTag};
use epflow_kernels::device::host_steps::Steps;
use epflow_kernels::{DeviceTensor, GpuHandle, GpuOp, OutputTargets};
use nccl_ep_sys as ep;

use crate::capture::{self as graph, Mode};
use crate::check::{self, Tensor};
use crate::forwarded::Forwarded;
use crate::group::{Group, device};
use crate::handle::{Handle, Staged, StagedOp};
use crate::ids::Globalize;
use crate::profile::Timer;
use crate::status::{Fail, Res};
use crate::v2::{DispatchQuant, ExpertIds};

fn pass_of(p: ep::NcclEpPassDir) -> Res<Pass> {
    match p {
        ep::NCCL_EP_FWD_PASS => Ok(Pass::Forward),
        ep::NCCL_EP_BWD_PASS => Ok(Pass::Backward),
        p => Err(Fail::arg(format!("pass_direction is {p}, not FWD (0) or BWD (1)"))),
    }
}

/// Requires `t` to be `dtype` with `rows` (at least, with `at_least`) rows of `row` elements:
/// the last dimension is the row, the others multiply to the rows (`[R, M, H]` is `R*M` rows of
/// `H`).
fn rows_of(t: &Tensor, what: &str, dtype: ep::NcclDataType, rows: usize, row: usize, at_least: bool) -> Res<()> {
    t.expect_type(what, dtype)?;
    let (got_row, lead) = t.sizes.split_last().map_or((0, &[][..]), |(r, lead)| (*r, lead));
    let got_rows: usize = lead.iter().product();
    let fits = if at_least { got_rows >= rows } else { got_rows == rows };
    if got_row != row || !fits || t.sizes.len() < 2 {
        let want = if at_least { format!("at least {rows}") } else { rows.to_string() };
        return Err(Fail::arg(format!("{what}: sizes are {:?}, expected {want} rows of {row} elements", t.sizes)));
    }
    Ok(())
}

/// Issues `op` (its send half on `stream`), then completes it on `stream` (and enqueues `then`
/// after its receive) unless `staged`, in which case both are returned for `ncclEpComplete`.
/// `timer` closes the send and complete phases.
fn issue(
    g: &Group,
    mut op: GpuOp,
    channel: Channel,
    stream: &Arc<CudaStream>,
    staged: bool,
    then: Option<Globalize>,
    timer: &mut Timer<'_>,
) -> Res<Option<Staged>> {
    let mut steps = Steps::start();
    op.send_on(stream)?;
    if !staged {
        // Both halves on `stream`, back to back: one launch where the rank can.
        op.will_complete_at_once();
    }
    let rank = &g.rank;
    steps.step("abi: send_on");
    let op = send_blocking(op, rank.slot_pool(channel), rank.poison(), g.timeout())?;
    // Includes the operation's own send steps (timed apart as `send: ...` and `launch: ...`).
    steps.step("abi: send_blocking (slot, turn, the op's send)");
    timer.next();
    if staged {
        timer.next();
        g.eager_staged.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        return Ok(Some(Staged { op: StagedOp::Eager(Box::new(op)), then }));
    }
    complete(g, op, stream)?;
    if let Some(t) = then {
        t.enqueue(&g.rank, stream)?;
    }
    steps.step("abi: complete");
    timer.next();
    Ok(None)
}

/// Completes `op` in `stream`'s order; the group reads its verdict later.
pub(crate) fn complete(g: &Group, mut op: GpuOp, stream: &Arc<CudaStream>) -> Res<()> {
    let deadline = Instant::now() + g.timeout();
    loop {
        // Low-latency: the receive kernel is enqueued on `stream` and this returns at once;
        // other operations return once the host saw them finish.
        match op.complete_on(stream, StreamOrder::OnStream) {
            Ok(Some(outputs)) => {
                // The outputs are views of the caller's tensors: nothing to hand out.
                drop(outputs);
                g.track(op);
                return Ok(());
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(std::time::Duration::from_micros(10)),
            Ok(None) => {
                let e = Error::Timeout {
                    op: op.label(),
                    rank: g.shape.rank,
                    waiting_for: op.waiting_for(),
                    after: g.timeout(),
                };
                g.rank.core().poison().poison(e.to_string());
                return Err(e.into());
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// The checks every dispatch and combine on `channel` starts with: the group not failed,
/// nothing staged on the handle; and how the call numbers its operation (on the device once a
/// low-latency call was captured into a CUDA graph: `capture.rs`). Low-latency calls read
/// earlier operations' verdicts after their launch (the stream is idle until it) and are timed
/// from here (`EPFLOW_ABI_PROFILE`); the timer is returned.
fn begin<'g>(g: &'g Group, h: &Handle, stream: ep::CudaStream, channel: Channel) -> Res<(Timer<'g>, Mode)> {
    let ll = g.shape.algorithm == Algorithm::LowLatency;
    let timer = if ll { g.profile.timer(channel.index()) } else { g.profile.untimed() };
    let what = if channel == Channel::Dispatch { "ncclEpDispatch" } else { "ncclEpCombine" };
    if ll {
        g.check_poisoned()?;
    } else {
        g.check()?;
    }
    no_staged(h)?;
    let mode = graph::mode(g, stream, what)?;
    Ok((timer, mode))
}

/// A low-latency operation numbered on the device has been launched: a send-only one waits on
/// the handle for `ncclEpComplete`; the receive of any other is enqueued, so `then` follows.
fn numbered_issued(
    g: &Group,
    h: &Handle,
    sent: Option<epflow_kernels::NumberedSend>,
    then: Option<Globalize>,
    stream: &Arc<CudaStream>,
) -> Res<()> {
    match sent {
        Some(send) => {
            *h.staged.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(Staged { op: StagedOp::Numbered(Box::new(send)), then })
        }
        None => {
            if let Some(t) = then {
                t.enqueue(&g.rank, stream)?;
            }
        }
    }
    Ok(())
}

fn no_staged(h: &Handle) -> Res<()> {
    if h.staged.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
        return Err(Fail::usage("a send-only operation on this handle is waiting for ncclEpComplete"));
    }
    Ok(())
}

/// The tokens input `[B x H]` BF16 of handle `gh`.
fn tokens_in(g: &Group, gh: &GpuHandle, t: &Tensor) -> Res<DeviceTensor> {
    let (b, hd) = (gh.num_tokens(), g.shape.hidden);
    rows_of(t, "inputs.tokens", ep::NCCL_BFLOAT16, b, hd, false)?;
    Ok(device(g, t, TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[b, hd])))
}

/// `ncclEpDispatch`.
///
/// # Safety
///
/// Every pointer is null or readable as `nccl_ep.h` declares; tensors address live device
/// memory of the group's device; `stream` is the caller's live stream.
pub(crate) unsafe fn dispatch(
    h: &Handle,
    inputs: *const ep::NcclEpDispatchInputs,
    outputs: *const ep::NcclEpDispatchOutputs,
    info: *const ep::NcclEpLayoutInfo,
    config: *const ep::NcclEpDispatchConfig,
    stream: ep::CudaStream,
) -> Res<()> {
    let g = &*h.group;
    // SAFETY: forwarded contract: every pointer is null or readable as nccl_ep.h declares.
    let (inputs, outputs, info, cfg) = unsafe {
        (
            check::required(inputs, "inputs")?,
            check::required(outputs, "outputs")?,
            check::api_struct(info, "layout_info")?,
            check::api_struct(config, "config")?.unwrap_or_default(),
        )
    };
    let ids = info.map(|i| i.check_v2_fields()).transpose()?.unwrap_or(ExpertIds::Local);
    let info = info.map(|i| i.v1);
    let quant = cfg.check_v2_fields()?;
    let cfg = cfg.v1;
    // SAFETY: as above, for the tensor descriptors the structs point to.
    let (x, w_in, out, out_w, out_i, out_s) = unsafe {
        (
            check::required_tensor(inputs.tokens, "inputs.tokens")?,
            check::tensor(inputs.topk_weights, "inputs.topk_weights")?,
            check::required_tensor(outputs.tokens, "outputs.tokens")?,
            check::tensor(outputs.topk_weights, "outputs.topk_weights")?,
            check::tensor(outputs.topk_idx, "outputs.topk_idx")?,
            check::tensor(outputs.scales, "outputs.scales")?,
        )
    };
    // SAFETY: as above.
    let x_s = unsafe { check::tensor(inputs.scales, "inputs.scales")? };
    let fp8 = quant == DispatchQuant::DsFp8;
    let fwd = quant == DispatchQuant::Fwd;
    match (quant, &x_s, &out_s) {
        (DispatchQuant::Fwd, None, _) => return Err(Fail::arg("NCCL_EP_DISP_QUANT_FWD needs inputs.scales")),
        (DispatchQuant::Fwd, _, None) => return Err(Fail::arg("NCCL_EP_DISP_QUANT_FWD needs outputs.scales")),
        (DispatchQuant::Fwd, _, _) => {}
        (_, Some(_), _) => {
            return Err(Fail::arg("inputs.scales: only config.quant_recipe NCCL_EP_DISP_QUANT_FWD takes scales"));
        }
        (DispatchQuant::None, _, Some(_)) => {
            return Err(Fail::arg(
                "outputs.scales: only config.quant_recipe NCCL_EP_DISP_QUANT_DS_FP8E3M4 or FWD writes scales",
            ));
        }
        (DispatchQuant::DsFp8, _, None) => {
            return Err(Fail::arg("NCCL_EP_DISP_QUANT_DS_FP8E3M4 needs outputs.scales"));
        }
        _ => {}
    }
    if fp8 && g.shape.algorithm != Algorithm::LowLatency {
        return Err(Fail::usage("NCCL_EP_DISP_QUANT_DS_FP8E3M4 is a low-latency recipe (as in NCCL EP)"));
    }
    if fwd && cfg.round_scales != 0 {
        return Err(Fail::arg("NCCL_EP_DISP_QUANT_FWD takes round_scales 0 (nothing is quantized)"));
    }
    let (mut timer, mode) = begin(g, h, stream, Channel::Dispatch)?;
    let gh = h.gpu()?;
    let pass = pass_of(cfg.pass_direction)?;
    let s = &g.shape;
    let (k, hd) = (gh.top_k(), s.hidden);
    // FWD: the caller's rows as bytes; the output rows take their type and width.
    let forwarded = match (&x_s, fwd) {
        (Some(xs), true) => Some(Forwarded::check(g, &gh, &x, xs)?),
        _ => None,
    };
    let tokens = match &forwarded {
        Some(f) => {
            device(g, &x, TensorDesc::contiguous(TensorTag::Tokens, DType::U8, &[gh.num_tokens(), f.token_bytes]))
        }
        None => tokens_in(g, &gh, &x)?,
    };
    // DS_FP8E3M4: epflow's FP8 dispatch, per call (`round_scales` rounds the scales up to powers
    // of two, as the v1 field says).
    let dtype = match &forwarded {
        Some(f) => Some(DispatchDtype::Forwarded { token_bytes: f.token_bytes, scale_bytes: f.scale_bytes }),
        None => fp8.then_some(DispatchDtype::Fp8 { round_scales: cfg.round_scales != 0 }),
    };
    let opts = DispatchOptions { pass, dtype, ..Default::default() };
    // The output rows: FP8 with one fp32 scale per 128 channels, BF16, or the forwarded rows'
    // type and width.
    let (out_type, out_row) = match &forwarded {
        Some(f) => (x.datatype, f.token_elems),
        None if fp8 => (ep::NCCL_FLOAT8_E4M3, hd),
        None => (ep::NCCL_BFLOAT16, hd),
    };
    let f32s = |t: &Tensor, rows| device(g, t, TensorDesc::contiguous(TensorTag::TopkWeights, DType::F32, &[rows, k]));
    // SAFETY: the caller's live stream (contract).
    let st = unsafe { g.stream(stream) };
    match (s.algorithm, h.layout) {
        (Algorithm::LowLatency, layout) => {
            if pass == Pass::Backward {
                return Err(Fail::usage("low-latency dispatch has no backward pass"));
            }
            let rows = s.num_ranks * s.max_tokens;
            let mut targets = OutputTargets { tokens: out.ptr, ..Default::default() };
            if let Some(sc) = &out_s {
                // `[R, M, S]` (rank-major) or `[L, R*M, S]` (expert-major), as NCCL EP: S fp32
                // scales per 128 channels, or the forwarded scale rows in their own type.
                let lead = if layout == Layout::RankMajor {
                    vec![s.num_ranks, s.max_tokens]
                } else {
                    vec![s.local_experts, rows]
                };
                let (scale_type, scale_row) = match (&forwarded, &x_s) {
                    (Some(f), Some(xs)) => (xs.datatype, f.scale_elems),
                    _ => (ep::NCCL_FLOAT32, hd / FP8_BLOCK),
                };
                sc.expect_type("outputs.scales", scale_type)?;
                sc.expect_sizes("outputs.scales", &[lead[0], lead[1], scale_row])?;
                // Forwarded scale rows move in 16-byte vectors (NCCL EP's FWD rule); DS_FP8E3M4's
                // fp32 scales are stored one by one, so their own alignment is enough (NVIDIA's
                // test_quantization_recipe places them 4 bytes into an allocation).
                match &forwarded {
                    Some(_) => check::aligned16("outputs.scales", sc.ptr)?,
                    None => check::aligned("outputs.scales", sc.ptr, 4)?,
                }
                targets.scales = Some(sc.ptr);
            }
            // Expert-major outputs carry no top-k ids: the numbering does not apply (NCCL EP).
            let mut then = None;
            let weights = if layout == Layout::RankMajor {
                let w = w_in.ok_or_else(|| Fail::arg("rank-major dispatch needs inputs.topk_weights"))?;
                rows_of(&w, "inputs.topk_weights", ep::NCCL_FLOAT32, gh.num_tokens(), k, false)?;
                rows_of(&out, "outputs.tokens", out_type, rows, out_row, false)?;
                let ow = out_w.ok_or_else(|| Fail::arg("rank-major dispatch needs outputs.topk_weights"))?;
                let oi = out_i.ok_or_else(|| Fail::arg("rank-major dispatch needs outputs.topk_idx"))?;
                rows_of(&ow, "outputs.topk_weights", ep::NCCL_FLOAT32, rows, k, false)?;
                rows_of(&oi, "outputs.topk_idx", ep::NCCL_INT32, rows, k, false)?;
                // Optional (as in NCCL EP): without it the counts go to the group's own buffer;
                // the ids of each source's rows after its last are -1 either way.
                let c = counter(info.and_then(|i| (!i.src_rank_counters.is_null()).then_some(i.src_rank_counters)))
                    .transpose()?;
                if let Some(c) = &c {
                    c.expect_type("layout_info.src_rank_counters", ep::NCCL_INT32)?;
                    c.expect_sizes("layout_info.src_rank_counters", &[s.num_ranks])?;
                }
                targets.topk_weights = Some(ow.ptr);
                targets.topk_idx = Some(oi.ptr);
                targets.counts = c.as_ref().map(|c| c.ptr);
                if ids == ExpertIds::Global {
                    then = Some(Globalize {
                        ids: device(g, &oi, TensorDesc::contiguous(TensorTag::TopkIdx, DType::I32, &[rows, k])),
                        counts: c.as_ref().map(|c| {
                            let desc =
                                TensorDesc::contiguous(TensorTag::RecvExpertCountsDevice, DType::I32, &[s.num_ranks]);
                            (device(g, c, desc), s.max_tokens)
                        }),
                        offset: global_offset(s),
                    });
                }
                Some(f32s(&w, gh.num_tokens()))
            } else {
                out.expect_type("outputs.tokens", out_type)?;
                out.expect_sizes("outputs.tokens", &[s.local_experts, rows, out_row])?;
                let c = counter(info.and_then(|i| (!i.expert_counters.is_null()).then_some(i.expert_counters)))
                    .ok_or_else(|| Fail::arg("expert-major dispatch needs layout_info.expert_counters"))??;
                c.expect_type("layout_info.expert_counters", ep::NCCL_INT32)?;
                c.expect_sizes("layout_info.expert_counters", &[s.local_experts])?;
                targets.counts = Some(c.ptr);
                None
            };
            let mut din = DispatchInputs::new(&tokens);
            if let Some(w) = &weights {
                din = din.with_weights(w);
            }
            if let Some(f) = &forwarded {
                check::aligned16("outputs.tokens", out.ptr)?;
                din = din.with_scales(&f.scales);
            }
            if let Mode::Numbered(dn) = &mode {
                h.rewiden(&st)?;
                // SAFETY: the targets were checked against the shapes of this layout above.
                let sent =
                    unsafe { g.rank.numbered_dispatch_into(dn, &gh, din, &opts, &targets, &st, cfg.send_only != 0) }?;
                return numbered_issued(g, h, sent, then, &st);
            }
            g.make_room(Channel::Dispatch)?;
            timer.next();
            // SAFETY: the targets were checked against the shapes of this layout above.
            let op = unsafe { g.rank.start_dispatch_into(&gh, din, &opts, &targets) }?;
            timer.next();
            let staged = issue(g, op, Channel::Dispatch, &st, cfg.send_only != 0, then, &mut timer)?;
            *h.staged.lock().unwrap_or_else(|e| e.into_inner()) = staged;
            g.settle(false)?;
        }
        (Algorithm::HighThroughput, _) if h.expert_major_alignment.is_some() => {
            // Expert-major: the flat dispatch into the handle's memory, then the caller's zones.
            let em = h.expert_major()?.ok_or_else(|| Fail::usage("no expert-major zones"))?;
            if pass == Pass::Backward {
                // Gradients into the slots the forward dispatch numbered (NCCL EP's backward
                // dispatch: no weights, no ids).
                if w_in.is_some() || out_w.is_some() || out_i.is_some() {
                    return Err(Fail::arg("backward dispatch takes no top-k weights or indices"));
                }
                rows_of(&out, "outputs.tokens", ep::NCCL_BFLOAT16, em.plan.total, hd, true)?;
                // The scatter stores 16-byte vectors.
                check::aligned16("outputs.tokens", out.ptr)?;
                let slots = out.numel() / hd.max(1);
                em.require_numbered()?;
                let targets = OutputTargets { tokens: em.tokens.ptr(), ..Default::default() };
                em.wait_on(&st)?;
                // SAFETY: the target is the handle's flat buffer of exactly the rows it receives.
                let op = unsafe { g.rank.start_dispatch_into(&gh, DispatchInputs::new(&tokens), &opts, &targets) }?;
                issue(g, op, Channel::Dispatch, &st, false, None, &mut timer)?;
                let out = device(g, &out, TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[slots, hd]));
                em.scatter_gradients(&g.rank, &st, &out)?;
                g.settle(true)?;
                return Ok(());
            }
            if out_i.is_some() {
                return Err(Fail::arg("expert-major dispatch writes no outputs.topk_idx (one weight per slot)"));
            }
            let total = em.plan.total;
            let slots = match (&forwarded, &out_s) {
                (Some(f), Some(os)) => f.check_ht_outputs(&out, os, total)?,
                _ => {
                    rows_of(&out, "outputs.tokens", ep::NCCL_BFLOAT16, total, hd, true)?;
                    // The scatter stores 16-byte vectors.
                    check::aligned16("outputs.tokens", out.ptr)?;
                    out.numel() / hd.max(1)
                }
            };
            let w = w_in.ok_or_else(|| Fail::arg("forward dispatch needs inputs.topk_weights"))?;
            rows_of(&w, "inputs.topk_weights", ep::NCCL_FLOAT32, gh.num_tokens(), k, false)?;
            let ow = out_w
                .ok_or_else(|| Fail::arg("expert-major dispatch needs outputs.topk_weights (1D, a weight per slot)"))?;
            ow.expect_type("outputs.topk_weights", ep::NCCL_FLOAT32)?;
            // Empty outputs (a rank receiving nothing) go together: NCCL EP refuses an empty
            // tokens tensor beside non-empty weights, and the other way round.
            if ow.sizes.len() != 1 || ow.sizes[0] < slots || (ow.sizes[0] == 0) != (slots == 0) {
                return Err(Fail::arg(format!(
                    "outputs.topk_weights: sizes are {:?}, expected [{slots}] (1D, a weight per slot of outputs.tokens; both empty or neither)",
                    ow.sizes
                )));
            }
            // A forwarded dispatch's flat token and scale rows share the handle's BF16 buffer.
            let split = forwarded.as_ref().map(|f| f.split(&em.tokens));
            let targets = OutputTargets {
                tokens: split.as_ref().map_or(em.tokens.ptr(), |(t, _)| t.ptr()),
                scales: split.as_ref().map(|(_, sc)| sc.ptr()),
                topk_weights: Some(em.weights.ptr()),
                topk_idx: Some(em.idx.ptr()),
                ..Default::default()
            };
            let weights = f32s(&w, gh.num_tokens());
            let mut din = DispatchInputs::new(&tokens).with_weights(&weights);
            if let Some(f) = &forwarded {
                din = din.with_scales(&f.scales);
            }
            em.wait_on(&st)?;
            // SAFETY: the targets are the handle's flat buffers of exactly the rows it receives.
            let op = unsafe { g.rank.start_dispatch_into(&gh, din, &opts, &targets) }?;
            issue(g, op, Channel::Dispatch, &st, false, None, &mut timer)?;
            let ow = device(g, &ow, TensorDesc::contiguous(TensorTag::TopkWeights, DType::F32, &[slots]));
            match (&forwarded, &split, &out_s) {
                (Some(f), Some((ft, fs)), Some(os)) => {
                    let [ct, cs] = f.caller_views(g, &out, os, slots);
                    em.scatter(&g.rank, &st, &[(ft, &ct), (fs, &cs)], &ow)?;
                }
                _ => {
                    let out = device(g, &out, TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[slots, hd]));
                    em.scatter(&g.rank, &st, &[(&em.tokens, &out)], &ow)?;
                }
            }
            g.settle(true)?;
        }
        (Algorithm::HighThroughput, _) => {
            // After a DROP (`overflow.rs`): the dispatch runs into the handle's buffers of every
            // row, and the caller's outputs get the rows kept.
            let overflow = h.overflow();
            let rows = h.output_rows()?;
            let slots = match (&forwarded, &out_s) {
                // NCCL EP's FWD outputs hold the group's receive budget unless it is AUTO (BF16
                // outputs need only the rows received).
                (Some(f), Some(os)) => {
                    let need = if s.max_recv_auto { rows } else { rows.max(s.max_recv) };
                    f.check_ht_outputs(&out, os, need)?
                }
                _ => {
                    rows_of(&out, "outputs.tokens", ep::NCCL_BFLOAT16, rows, hd, true)?;
                    out.numel() / hd.max(1)
                }
            };
            let out_scales = out_s.as_ref().filter(|_| fwd).map(|os| os.ptr);
            let mut targets = OutputTargets { tokens: out.ptr, scales: out_scales, ..Default::default() };
            let mut then = None;
            let mut weights_idx = None;
            let weights = match pass {
                Pass::Forward => {
                    let w = w_in.ok_or_else(|| Fail::arg("forward dispatch needs inputs.topk_weights"))?;
                    rows_of(&w, "inputs.topk_weights", ep::NCCL_FLOAT32, gh.num_tokens(), k, false)?;
                    let ow = out_w.ok_or_else(|| Fail::arg("flat dispatch needs outputs.topk_weights"))?;
                    let oi = out_i.ok_or_else(|| Fail::arg("flat dispatch needs outputs.topk_idx"))?;
                    rows_of(&ow, "outputs.topk_weights", ep::NCCL_FLOAT32, slots, k, false)?;
                    rows_of(&oi, "outputs.topk_idx", ep::NCCL_INT64, slots, k, false)?;
                    fill_unused(&st, &ow, &oi, rows, slots, k)?;
                    targets.topk_weights = Some(ow.ptr);
                    targets.topk_idx = Some(oi.ptr);
                    weights_idx = Some((ow.ptr, oi.ptr));
                    if ids == ExpertIds::Global {
                        then = Some(Globalize {
                            ids: device(g, &oi, TensorDesc::contiguous(TensorTag::TopkIdx, DType::I64, &[rows, k])),
                            counts: None,
                            offset: global_offset(s),
                        });
                    }
                    Some(f32s(&w, gh.num_tokens()))
                }
                Pass::Backward => {
                    if w_in.is_some() || out_w.is_some() || out_i.is_some() {
                        return Err(Fail::arg("backward dispatch takes no top-k weights or indices"));
                    }
                    None
                }
            };
            // After a DROP, a forwarded dispatch's token and scale rows share the handle's buffer.
            let split = forwarded.as_ref().zip(overflow.as_ref()).map(|(f, o)| f.split(&o.tokens));
            if let Some(o) = &overflow {
                o.wait_on(&st)?;
                targets = OutputTargets {
                    tokens: split.as_ref().map_or(o.tokens.ptr(), |(t, _)| t.ptr()),
                    scales: split.as_ref().map(|(_, sc)| sc.ptr()),
                    topk_weights: weights_idx.map(|_| o.weights.ptr()),
                    topk_idx: weights_idx.map(|_| o.idx.ptr()),
                    ..Default::default()
                };
            }
            let mut din = DispatchInputs::new(&tokens);
            if let Some(w) = &weights {
                din = din.with_weights(w);
            }
            if let Some(f) = &forwarded {
                din = din.with_scales(&f.scales);
            }
            // SAFETY: the targets hold at least the rows epflow writes (checked above, or the
            // overflow buffers of every received row).
            let op = unsafe { g.rank.start_dispatch_into(&gh, din, &opts, &targets) }?;
            match &overflow {
                None => {
                    issue(g, op, Channel::Dispatch, &st, false, then, &mut timer)?;
                }
                Some(o) => {
                    issue(g, op, Channel::Dispatch, &st, false, None, &mut timer)?;
                    let mut keep = match (&split, out_scales) {
                        (Some((t, sc)), Some(os)) => vec![(t, out.ptr), (sc, os)],
                        _ => vec![(&o.tokens, out.ptr)],
                    };
                    if let Some((w, i)) = weights_idx {
                        keep.extend([(&o.weights, w), (&o.idx, i)]);
                    }
                    o.keep_dispatched(&g.rank, &st, &keep)?;
                    if let Some(t) = then {
                        t.enqueue(&g.rank, &st)?;
                    }
                }
            }
            g.settle(true)?;
        }
    }
    Ok(())
}

/// A counter tensor of the layout info, checked.
fn counter(p: Option<*mut ep::NcclEpTensor>) -> Option<Res<Tensor>> {
    // SAFETY: a descriptor pointer of the caller's layout info (readable, the API's contract).
    p.map(|p| unsafe { check::required_tensor(p, "layout_info counter") })
}

/// Flat layout: rows `n..slots` of the caller's top-k outputs say "no expert" (indices -1,
/// weights 0), as NCCL EP writes every row; enqueued on `stream`.
fn fill_unused(stream: &CudaStream, w: &Tensor, idx: &Tensor, n: usize, slots: usize, k: usize) -> Res<()> {
    if slots <= n {
        return Ok(());
    }
    let rows = slots - n;
    let cu = stream.cu_stream();
    // SAFETY: both tensors have `slots` rows of `k` elements (checked by the caller); the ranges
    // start at row `n`; ordered on the caller's stream.
    let rc = unsafe {
        cudarc::driver::sys::cuMemsetD8Async(idx.ptr + (n * k * 8) as u64, 0xff, rows * k * 8, cu)
            .result()
            .and_then(|()| cudarc::driver::sys::cuMemsetD32Async(w.ptr + (n * k * 4) as u64, 0, rows * k, cu).result())
    };
    rc.map_err(|e| Fail::from(Error::Backend(format!("CUDA: fill the unused flat rows: {e:?}"))))
}

/// `ncclEpCombine`.
///
/// # Safety
///
/// As [`dispatch`].
pub(crate) unsafe fn combine(
    h: &Handle,
    inputs: *const ep::NcclEpCombineInputs,
    outputs: *const ep::NcclEpCombineOutputs,
    config: *const ep::NcclEpCombineConfig,
    stream: ep::CudaStream,
) -> Res<()> {
    let g = &*h.group;
    // SAFETY: forwarded contract: every pointer is null or readable as nccl_ep.h declares.
    let (inputs, outputs, cfg) = unsafe {
        (
            check::required(inputs, "inputs")?,
            check::required(outputs, "outputs")?,
            check::api_struct(config, "config")?.unwrap_or_default(),
        )
    };
    let quant = cfg.check_v2_fields()?;
    let (scales, inputs, cfg) = (inputs.scales, inputs.v1, cfg.v1);
    // SAFETY: as above, for the tensor descriptors the structs point to.
    let (x, w_in, out, out_w, scales) = unsafe {
        (
            check::required_tensor(inputs.tokens, "inputs.tokens")?,
            check::tensor(inputs.topk_weights, "inputs.topk_weights")?,
            check::required_tensor(outputs.tokens, "outputs.tokens")?,
            check::tensor(outputs.topk_weights, "outputs.topk_weights")?,
            check::tensor(scales, "inputs.scales")?,
        )
    };
    match (quant, &scales) {
        (CombineQuant::Nvfp4, None) => {
            return Err(Fail::arg(
                "NCCL_EP_COMB_QUANT_NVFP4 needs inputs.scales: each expert output row's FP32 global scale (2688 / amax, 0 for a zero row)",
            ));
        }
        (CombineQuant::None, Some(_)) => {
            return Err(Fail::arg("inputs.scales: only config.quant_recipe NCCL_EP_COMB_QUANT_NVFP4 takes scales"));
        }
        (CombineQuant::Nvfp4, Some(_)) if g.shape.algorithm != Algorithm::LowLatency => {
            return Err(Fail::usage(
                "config.quant_recipe NCCL_EP_COMB_QUANT_NVFP4 is a low-latency combine's (high-throughput combines travel in BF16)",
            ));
        }
        _ => {}
    }
    let (mut timer, mode) = begin(g, h, stream, Channel::Combine)?;
    let gh = h.gpu()?;
    let pass = pass_of(cfg.pass_direction)?;
    let s = &g.shape;
    let (b, k, hd) = (gh.num_tokens(), gh.top_k(), s.hidden);
    rows_of(&out, "outputs.tokens", ep::NCCL_BFLOAT16, b, hd, false)?;
    let mut targets = OutputTargets { tokens: out.ptr, ..Default::default() };
    let opts = CombineOptions { pass, quant };
    let f32s = |t: &Tensor, rows| device(g, t, TensorDesc::contiguous(TensorTag::TopkWeights, DType::F32, &[rows, k]));
    // SAFETY: the caller's live stream (contract).
    let st = unsafe { g.stream(stream) };
    match s.algorithm {
        Algorithm::LowLatency => {
            if pass == Pass::Backward {
                return Err(Fail::usage("low-latency combine has no backward pass"));
            }
            let rows = s.num_ranks * s.max_tokens;
            let (tokens, weights) = if h.layout == Layout::RankMajor {
                rows_of(&x, "inputs.tokens", ep::NCCL_BFLOAT16, rows, hd, false)?;
                if out_w.is_some() {
                    return Err(Fail::arg(
                        "rank-major combine takes no outputs.topk_weights (the weights were applied)",
                    ));
                }
                (device(g, &x, TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[rows, hd])), None)
            } else {
                x.expect_type("inputs.tokens", ep::NCCL_BFLOAT16)?;
                x.expect_sizes("inputs.tokens", &[s.local_experts, rows, hd])?;
                let desc = TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[s.local_experts, rows, hd]);
                let w = match &out_w {
                    Some(w) => {
                        rows_of(w, "outputs.topk_weights", ep::NCCL_FLOAT32, b, k, false)?;
                        Some(f32s(w, b))
                    }
                    None => None,
                };
                (device(g, &x, desc), w)
            };
            // NVFP4: one FP32 global scale per expert output row, the tokens' shape with a last
            // dimension of 1 (NCCL EP's contract).
            let global = match &scales {
                Some(sc) => {
                    sc.expect_type("inputs.scales", ep::NCCL_FLOAT32)?;
                    let mut sizes =
                        if h.layout == Layout::RankMajor { vec![rows] } else { vec![s.local_experts, rows] };
                    sizes.push(1);
                    sc.expect_sizes("inputs.scales", &sizes)?;
                    Some(device(g, sc, TensorDesc::contiguous(TensorTag::Scales, DType::F32, &sizes)))
                }
                None => None,
            };
            let mut cin = CombineInputs::new(&tokens);
            if let Some(w) = &weights {
                cin = cin.with_weights(w);
            }
            if let Some(gs) = &global {
                cin = cin.with_global_scales(gs);
            }
            if let Mode::Numbered(dn) = &mode {
                // SAFETY: the output was checked as [B x H] BF16 above.
                let sent =
                    unsafe { g.rank.numbered_combine_into(dn, &gh, cin, &opts, &targets, &st, cfg.send_only != 0) }?;
                return numbered_issued(g, h, sent, None, &st);
            }
            g.make_room(Channel::Combine)?;
            timer.next();
            // SAFETY: the output was checked as [B x H] BF16 above.
            let op = unsafe { g.rank.start_combine_into(&gh, cin, &opts, &targets) }?;
            timer.next();
            let staged = issue(g, op, Channel::Combine, &st, cfg.send_only != 0, None, &mut timer)?;
            *h.staged.lock().unwrap_or_else(|e| e.into_inner()) = staged;
            g.settle(false)?;
        }
        Algorithm::HighThroughput => {
            let n = gh.num_recv_tokens().unwrap_or(0);
            // After a DROP (`overflow.rs`): the caller's rows kept, zeros for the dropped ones.
            let overflow = h.overflow();
            let rows = h.output_rows()?;
            let zones = h.expert_major()?;
            // Every check first, then the work in the caller's stream order.
            rows_of(&x, "inputs.tokens", ep::NCCL_BFLOAT16, rows, hd, true)?;
            let in_slots = x.numel() / hd.max(1);
            // Backward: the caller's weight gradients, `[rows, K]` flat, `[S]` (a gradient per
            // slot) expert-major, as NCCL EP takes them.
            let w_grads = match pass {
                Pass::Forward => {
                    if w_in.is_some() {
                        return Err(Fail::arg("forward combine takes no inputs.topk_weights"));
                    }
                    None
                }
                Pass::Backward => {
                    let w = w_in.ok_or_else(|| Fail::arg("backward combine needs inputs.topk_weights"))?;
                    match &zones {
                        Some(_) => {
                            w.expect_type("inputs.topk_weights", ep::NCCL_FLOAT32)?;
                            // Empty inputs (a rank receiving nothing) go together, as in NCCL EP.
                            if w.sizes.len() != 1 || w.sizes[0] < rows || (w.sizes[0] == 0) != (in_slots == 0) {
                                return Err(Fail::arg(format!(
                                    "inputs.topk_weights: sizes are {:?}, expected [at least {rows}] (expert-major: 1D, a weight gradient per slot of inputs.tokens; both empty or neither)",
                                    w.sizes
                                )));
                            }
                        }
                        None => rows_of(&w, "inputs.topk_weights", ep::NCCL_FLOAT32, rows, k, true)?,
                    }
                    let ow = out_w.ok_or_else(|| Fail::arg("backward combine needs outputs.topk_weights"))?;
                    rows_of(&ow, "outputs.topk_weights", ep::NCCL_FLOAT32, b, k, false)?;
                    targets.topk_weights = Some(ow.ptr);
                    Some(w)
                }
            };
            if let Some(em) = &zones {
                em.require_numbered()?;
            }
            let (tokens, weights) = match &zones {
                // Expert-major: each received row's slots summed into the handle's flat input
                // (backward, the slots' weight gradients gathered per entry beside it).
                Some(em) => {
                    let y = device(g, &x, TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[in_slots, hd]));
                    let slot_w = w_grads.as_ref().map(|w| {
                        device(g, w, TensorDesc::contiguous(TensorTag::TopkWeights, DType::F32, &[w.sizes[0]]))
                    });
                    em.wait_on(&st)?;
                    em.reduce(&g.rank, &st, &y, slot_w.as_ref())?;
                    (em.combine_in.clone(), slot_w.map(|_| em.combine_weights.clone()))
                }
                None => match &overflow {
                    Some(o) => {
                        o.wait_on(&st)?;
                        o.take_combine_inputs(&g.rank, &st, x.ptr, w_grads.as_ref().map(|w| w.ptr))?;
                        (o.combine_in.clone(), w_grads.as_ref().map(|_| o.combine_weights.clone()))
                    }
                    None => (
                        device(g, &x, TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[n, hd])),
                        w_grads.as_ref().map(|w| f32s(w, n)),
                    ),
                },
            };
            let mut cin = CombineInputs::new(&tokens);
            if let Some(w) = &weights {
                cin = cin.with_weights(w);
            }
            // SAFETY: the outputs were checked above ([B x H] tokens, [B x K] weights).
            let op = unsafe { g.rank.start_combine_into(&gh, cin, &opts, &targets) }?;
            issue(g, op, Channel::Combine, &st, false, None, &mut timer)?;
            // The combine's send read the handle's input buffer: the next use on another stream
            // waits for it.
            if let Some(o) = &overflow {
                o.used_on(&st)?;
            }
            if let Some(em) = &zones {
                em.used_on(&st)?;
            }
            g.settle(true)?;
        }
    }
    Ok(())
}

/// `ncclEpComplete`: enqueues the receive of the handle's staged operation on `stream`; a
/// no-op when nothing is staged (NCCL EP's programs call it after every operation).
///
/// # Safety
///
/// `config` is null or readable; `stream` is the caller's live stream.
pub(crate) unsafe fn complete_staged(
    h: &Handle,
    config: *const ep::NcclEpCompleteConfig,
    stream: ep::CudaStream,
) -> Res<()> {
    // SAFETY: forwarded contract.
    unsafe { check::api_struct(config, "config") }?;
    let mut slot = h.staged.lock().unwrap_or_else(|e| e.into_inner());
    let g = &*h.group;
    let Some(staged) = slot.as_ref() else { return Ok(()) };
    let captured = graph::capturing(stream, "ncclEpComplete")?;
    // SAFETY: the caller's live stream (contract).
    let st = unsafe { g.stream(stream) };
    if let StagedOp::Numbered(send) = &staged.op {
        let dn = g.numbering.as_ref().map_err(|why| Fail::usage(why.clone()))?;
        // Refused (kept staged) unless it is its channel's oldest open send.
        g.rank.numbered_complete(dn, send, &st)?;
    } else if captured {
        return Err(Fail::usage(
            "ncclEpComplete on a stream under CUDA graph capture for a send-only operation issued before the capture: complete it before capturing",
        ));
    }
    let Some(Staged { op, then }) = slot.take() else { return Ok(()) };
    drop(slot);
    if let StagedOp::Eager(op) = op {
        g.eager_staged.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        complete(g, *op, &st)?;
    }
    match then {
        Some(t) => t.enqueue(&g.rank, &st),
        None => Ok(()),
    }
}

/// GLOBAL ids' offset on this rank: its first expert's global id, `rank * L`.
fn global_offset(s: &crate::group::Shape) -> i64 {
    (s.rank * s.local_experts) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_all_but_the_last_dimension() {
        let t =
            |sizes: &[usize]| Tensor { ptr: 1, datatype: ep::NCCL_BFLOAT16, sizes: sizes.to_vec(), windowed: false };
        assert!(rows_of(&t(&[2, 128, 64]), "x", ep::NCCL_BFLOAT16, 256, 64, false).is_ok());
        assert!(rows_of(&t(&[256, 64]), "x", ep::NCCL_BFLOAT16, 256, 64, false).is_ok());
        assert!(rows_of(&t(&[300, 64]), "x", ep::NCCL_BFLOAT16, 256, 64, true).is_ok());
        let code = |sizes: &[usize], rows, at_least| {
            rows_of(&t(sizes), "x", ep::NCCL_BFLOAT16, rows, 64, at_least).unwrap_err().code
        };
        assert_eq!(code(&[300, 64], 256, false), ep::NCCL_INVALID_ARGUMENT);
        assert_eq!(code(&[200, 64], 256, true), ep::NCCL_INVALID_ARGUMENT);
        assert_eq!(code(&[256, 32], 256, false), ep::NCCL_INVALID_ARGUMENT);
        assert_eq!(code(&[16384], 256, false), ep::NCCL_INVALID_ARGUMENT);
        let f32s = Tensor { datatype: ep::NCCL_FLOAT32, ..t(&[256, 64]) };
        assert_eq!(rows_of(&f32s, "x", ep::NCCL_BFLOAT16, 256, 64, false).unwrap_err().code, ep::NCCL_INVALID_USAGE);
    }
}
