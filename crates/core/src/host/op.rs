//! [`HostOp`]: one host operation as a [`PendingOp`] state machine.

use crate::handle::RoutingHandle;
use std::sync::{Arc, RwLockReadGuard};

use half::bf16;

use super::handle::HostHandle;
use super::mailbox::Staging;
use super::messages::{Body, Message};
use super::outputs::{Buffers, HostCombineOutput, HostDispatchOutput, Recycle};
use super::{HostStream, HostWorldShared};
use crate::backend::{OpId, OpOutput, OpState, PendingOp, StreamOrder};
use crate::config::{Algorithm, DispatchDtype};
use crate::dtype::CombineQuant;
use crate::error::{Error, Result};
use crate::fp8;
use crate::handle::HandleCore;
use crate::mask::RankSet;
use crate::ops::{CombineOptions, CombineOutputs, DispatchOptions, DispatchOutputs, Layout, Pass};
use crate::protocol::{Channel, SlotGuard, op_label};
use crate::routing::{ExpertPlacement, HtRecvLayout, LlRecvLayout, RankRecvLayout, Routing, SendPlan};
use crate::stamp::Stamp;
use crate::tensor::{HostData, HostTensor, TensorTag};
use crate::validate::{OpContext, combine_output_descs, dispatch_output_descs};

/// What the operation produces once its messages are in.
#[derive(Debug)]
pub(crate) enum HostOpKind {
    /// `recv_bound`: the rows of received tensors of a `RecvRows::Bound` handle.
    Handle {
        routing: Routing,
        plan: SendPlan,
        recv_bound: Option<usize>,
    },
    Dispatch {
        handle: HostHandle,
        opts: DispatchOptions,
    },
    /// `weights`: low-latency combine's `[B x K]` weights, applied on arrival.
    Combine {
        handle: HostHandle,
        opts: CombineOptions,
        weights: Vec<f32>,
    },
}

/// One operation of one host rank.
#[derive(Debug)]
pub struct HostOp {
    pub(crate) world: Arc<HostWorldShared>,
    pub(crate) rank: usize,
    pub(crate) channel: Channel,
    pub(crate) seq: u64,
    /// What the peers must agree on; checked against every data message received.
    pub(crate) stamp: Stamp,
    /// `None` for a cancellation (a validation failure still takes part in the collective).
    pub(crate) work: Option<HostOpKind>,
    /// Per destination, the header to send (taken by `send`).
    pub(crate) outgoing: Vec<Option<Message>>,
    /// The payload, moved into this rank's staging buffer by `send`.
    pub(crate) staged: Option<Staging>,
    pub(crate) buffers: Arc<Buffers>,
    pub(crate) state: OpState,
    pub(crate) arrived: Vec<bool>,
}

/// The output of a host operation.
pub type HostOpOutput = OpOutput<HostHandle, HostDispatchOutput, HostCombineOutput>;

impl Drop for HostOp {
    fn drop(&mut self) {
        self.world.ops_alive[self.rank].fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

impl HostOp {
    /// Whether this rank skips `peer` (masked, or this rank is: its result is then
    /// [`Error::RankMasked`]). Never without rank masking.
    fn masked(&self, peer: usize) -> bool {
        self.world.masks.skips(self.rank, peer)
    }

    /// Whether `dest` has returned the credit for this operation's buffer set, or is masked.
    fn credit_from(&self, dest: usize) -> bool {
        let mb = &self.world.mailboxes;
        self.masked(dest) || mb.cell(dest, self.channel, self.seq, self.rank).has_credit(self.seq, mb.sets())
    }

    /// Whether `src`'s message of this operation is in, or `src` is masked.
    fn arrival_from(&self, src: usize) -> bool {
        self.masked(src) || self.world.mailboxes.cell(self.rank, self.channel, self.seq, src).has_arrived(self.seq)
    }

    /// The message a masked source stands in with: data agreeing with this operation, carrying
    /// nothing (its rows are absent; combine counts its entries in `masked`).
    fn absent_message(&self) -> Message {
        let body = match &self.work {
            Some(HostOpKind::Combine { .. }) => Body::LlCombine { entries: Vec::new() },
            _ => Body::Dispatch { copies: Vec::new() },
        };
        Message::Data { stamp: self.stamp, body }
    }

    fn ranks_where(&self, pred: impl Fn(usize) -> bool) -> Vec<usize> {
        (0..self.world.num_ranks).filter(|&r| pred(r)).collect()
    }

    fn ctx(&self, handle: &HostHandle) -> OpContext<'_> {
        OpContext::new(&self.world.config, self.world.num_ranks, handle)
    }

    fn mismatch(&self, peer: usize, body: &Body) -> Error {
        Error::OrderMismatch { op: op_label(self.channel, self.seq), peer, got: body.kind().to_string() }
    }

    fn internal(&self, what: String) -> Error {
        Error::Backend(format!("{}: {what}", self.label()))
    }

    /// Every source's staged payload for this operation.
    fn staged_payloads(&self) -> Vec<RwLockReadGuard<'_, Staging>> {
        (0..self.world.num_ranks).map(|s| self.world.mailboxes.staging(s, self.channel, self.seq)).collect()
    }

    fn recycle(&self) -> Recycle {
        Recycle { buffers: Arc::clone(&self.buffers), channel: self.channel, set: self.state.slot_set().unwrap_or(0) }
    }

    fn output(&self, desc: &crate::TensorDesc) -> Result<HostData> {
        self.buffers.take_output(self.channel, self.state.slot_set().unwrap_or(0), desc)
    }

    fn finish_handle(
        &self,
        routing: Routing,
        plan: SendPlan,
        recv_bound: Option<usize>,
        msgs: &[&Body],
    ) -> Result<HostHandle> {
        let l = self.world.config.local_experts(self.world.num_ranks);
        let mut plans = Vec::with_capacity(msgs.len());
        for (src, m) in msgs.iter().enumerate() {
            match m {
                Body::HandlePlan { copies } => plans.push((src, copies.as_slice())),
                other => return Err(self.mismatch(src, other)),
            }
        }
        let layout = HtRecvLayout::from_received(l, plans);
        let mut core = HandleCore::new(self.world.group_id, routing, Algorithm::HighThroughput, Some(self.seq))
            .with_recv(layout.num_rows(), layout.expert_counts().to_vec());
        if let Some(bound) = recv_bound {
            core = core.with_recv_bound(bound);
        }
        Ok(HostHandle::new(core, plan, Some(layout)))
    }

    fn finish_dispatch(
        &mut self,
        handle: &HostHandle,
        opts: DispatchOptions,
        msgs: &[&Body],
    ) -> Result<HostDispatchOutput> {
        let cfg = &self.world.config;
        let (h, cols, k_n) = (cfg.hidden, cfg.scale_cols(), handle.top_k());
        let l = cfg.local_experts(self.world.num_ranks);
        let descs = dispatch_output_descs(&self.ctx(handle), &opts);
        let mut received = Vec::with_capacity(msgs.len());
        for (src, m) in msgs.iter().enumerate() {
            match m {
                Body::Dispatch { copies } => received.push((src, copies.as_slice())),
                other => return Err(self.mismatch(src, other)),
            }
        }
        let mut tokens = self.output(&descs.tokens)?;
        let mut scales = descs.scales.as_ref().map(|d| self.output(d)).transpose()?;
        let payloads = self.staged_payloads();
        // Copies row `t` of source `s` into output row `dst`, quantizing BF16 rows when the
        // output is FP8 (low-latency FP8 dispatch quantizes in flight).
        let round_scales = matches!(opts.dtype_in(cfg.dispatch_dtype), DispatchDtype::Fp8 { round_scales: true });
        let mut put = |dst: usize, s: usize, t: usize| {
            let p = &payloads[s];
            match (&mut tokens, scales.as_mut()) {
                (HostData::Bf16(out), _) => out[dst * h..(dst + 1) * h].copy_from_slice(&p.bf16[t * h..(t + 1) * h]),
                (HostData::Fp8(out), Some(HostData::F32(so))) => {
                    let (qo, sc) = (&mut out[dst * h..(dst + 1) * h], &mut so[dst * cols..(dst + 1) * cols]);
                    if p.fp8.is_empty() {
                        fp8::quantize_row(&p.bf16[t * h..(t + 1) * h], round_scales, qo, sc);
                    } else {
                        qo.copy_from_slice(&p.fp8[t * h..(t + 1) * h]);
                        sc.copy_from_slice(&p.scales[t * cols..(t + 1) * cols]);
                    }
                }
                _ => unreachable!("output buffers follow the descriptors"),
            }
        };
        let (mut topk_w, mut topk_i) = (None, None);
        let counts = match cfg.algorithm {
            Algorithm::LowLatency if handle.layout() == Layout::RankMajor => {
                let r = self.world.num_ranks;
                let m = cfg.fixed_max_tokens().unwrap_or(0);
                let (mut w, mut i) = (vec![0f32; r * m * k_n], vec![-1i32; r * m * k_n]);
                for &(s, copies) in &received {
                    if copies.len() > m {
                        return Err(self.internal(format!("rank {s} sent {} rows, more than {m}", copies.len())));
                    }
                    for (pos, copy) in copies.iter().enumerate() {
                        let (t, row) = (copy.token as usize, s * m + pos);
                        put(row, s, t);
                        let Some(sent) = payloads[s].weights.get(t * k_n..(t + 1) * k_n) else {
                            return Err(self.internal(format!("rank {s} staged no weights for token {t}")));
                        };
                        w[row * k_n..(row + 1) * k_n].copy_from_slice(sent);
                        for sel in &copy.selections {
                            match i.get_mut(row * k_n + sel.k as usize) {
                                Some(slot) => *slot = sel.local_expert as i32,
                                None => return Err(self.internal(format!("rank {s} sent a selection outside top-k"))),
                            }
                        }
                    }
                }
                let rows = r * m;
                topk_w = Some(HostTensor::topk_weights(rows, k_n, w));
                topk_i = Some(HostTensor::new(TensorTag::TopkIdx, &[rows, k_n], HostData::I32(i)));
                let layout = RankRecvLayout::from_received(r, received.iter().copied());
                let counts = layout.counts();
                handle.set_rank_major_layout(self.seq, layout);
                counts
            }
            Algorithm::LowLatency => {
                let rows_per_expert = descs.tokens.shape[1];
                let mut filled = vec![0usize; l];
                for &(s, copies) in &received {
                    for copy in copies {
                        for sel in &copy.selections {
                            let le = sel.local_expert as usize;
                            if le >= l || filled[le] >= rows_per_expert {
                                return Err(self.internal(format!("rank {s} sent more rows than fit expert {le}")));
                            }
                            put(le * rows_per_expert + filled[le], s, copy.token as usize);
                            filled[le] += 1;
                        }
                    }
                }
                let layout = LlRecvLayout::from_received(l, received.iter().copied());
                let counts = layout.counts();
                handle.set_ll_layout(self.seq, layout);
                counts
            }
            Algorithm::HighThroughput => {
                // `rows`: N, or the bound of a `RecvRows::Bound` handle (rows N.. stay zero, -1).
                let rows = descs.tokens.shape[0];
                let n = handle.num_recv_tokens().unwrap_or(rows);
                let forward = opts.pass == Pass::Forward;
                let (mut w, mut i) = (vec![0f32; rows * k_n], vec![-1i64; rows * k_n]);
                let mut row = 0;
                for &(s, copies) in &received {
                    for copy in copies {
                        if row >= n {
                            return Err(self.internal(format!("more rows arrived than the handle's {n}")));
                        }
                        let t = copy.token as usize;
                        put(row, s, t);
                        if forward {
                            for sel in &copy.selections {
                                let k = sel.k as usize;
                                let weight = payloads[s].weights.get(t * k_n + k).copied();
                                match (i.get_mut(row * k_n + k), weight) {
                                    (Some(slot), Some(weight)) => {
                                        *slot = i64::from(sel.local_expert);
                                        w[row * k_n + k] = weight;
                                    }
                                    _ => return Err(self.internal(format!("rank {s} sent a selection outside top-k"))),
                                }
                            }
                        }
                        row += 1;
                    }
                }
                if row != n {
                    return Err(self.internal(format!("{row} rows arrived, the handle expects {n}")));
                }
                if forward {
                    topk_w = Some(HostTensor::topk_weights(rows, k_n, w));
                    topk_i = Some(HostTensor::topk_idx(rows, k_n, i));
                }
                handle.recv_expert_counts().map(<[i32]>::to_vec).unwrap_or_default()
            }
        };
        drop(payloads);
        handle.0.core.record_dispatch(opts.pass, self.seq);
        let outputs = DispatchOutputs {
            tokens: HostTensor::new(TensorTag::Tokens, &descs.tokens.shape, tokens),
            scales: scales.zip(descs.scales.as_ref()).map(|(s, d)| HostTensor::new(TensorTag::Scales, &d.shape, s)),
            topk_weights: topk_w,
            topk_idx: topk_i,
            counts: descs.counts.as_ref().map(|d| HostTensor::new(d.tag, &d.shape, HostData::I32(counts))),
        };
        Ok(HostDispatchOutput { outputs, recycle: self.recycle(), _slot: self.state.take_slot() })
    }

    fn finish_combine(
        &mut self,
        handle: &HostHandle,
        opts: CombineOptions,
        weights: &[f32],
        msgs: &[&Body],
        absent: &RankSet,
    ) -> Result<HostCombineOutput> {
        let h = self.world.config.hidden;
        let (b, k_n) = (handle.num_tokens(), handle.top_k());
        let descs = combine_output_descs(&self.ctx(handle), &opts);
        let HostData::Bf16(mut out) = self.output(&descs.tokens)? else {
            return Err(self.internal("combine outputs are BF16".into()));
        };
        let mut out_w = descs.topk_weights.as_ref().map(|_| vec![0f32; b * k_n]);
        let mut masked = descs.masked.as_ref().map(|d| self.output(d)).transpose()?;
        let payloads = self.staged_payloads();
        match self.world.config.algorithm {
            Algorithm::LowLatency => {
                // Rank-major: one pre-weighted row per rank reached, in the slot of the rank's
                // first top-k entry, added with weight 1 (fma(1, x, acc) = acc + x).
                let rank_major = handle.layout() == Layout::RankMajor;
                let Some(routing) = handle.routing() else {
                    return Err(self.internal("a host handle without its routing".into()));
                };
                let placement = ExpertPlacement::new(self.world.config.num_experts, self.world.num_ranks);
                // where_[t * K + k] = (source, staged row) of that selection's expert output.
                let mut where_: Vec<Option<(usize, usize)>> = vec![None; b * k_n];
                for (src, m) in msgs.iter().enumerate() {
                    let Body::LlCombine { entries } = m else { return Err(self.mismatch(src, m)) };
                    for &(t, k, row) in entries {
                        let at = (k as usize) < k_n && (t as usize) < b;
                        let Some(slot) = where_.get_mut(t as usize * k_n + k as usize).filter(|_| at) else {
                            return Err(self.internal(format!("rank {src} sent token {t}, slot {k} of {b} x {k_n}")));
                        };
                        *slot = Some((src, row as usize));
                    }
                }
                let (mut acc, mut x) = (vec![0f32; h], vec![0f32; h]);
                let local = self.world.config.local_experts(self.world.num_ranks);
                for t in 0..b {
                    acc.iter_mut().for_each(|a| *a = 0.0);
                    // Entries on masked ranks contribute zero; the token's count says how many.
                    let mut lost = 0;
                    for k in 0..k_n {
                        if routing.expert(t, k).is_some_and(|e| absent.contains(e / local.max(1))) {
                            lost += 1;
                            continue;
                        }
                        let sends = if rank_major {
                            routing.first_of_its_rank(placement, t, k).is_some()
                        } else {
                            routing.expert(t, k).is_some()
                        };
                        if !sends {
                            continue;
                        }
                        let Some((s, row)) = where_[t * k_n + k] else {
                            return Err(self.internal(format!("no expert output for token {t}, slot {k}")));
                        };
                        let w = if rank_major { 1.0 } else { weights[t * k_n + k] };
                        if opts.quant == CombineQuant::Nvfp4 {
                            let n = crate::nvfp4::payload_bytes(h);
                            let (Some(bytes), Some(&g)) =
                                (payloads[s].fp8.get(row * n..(row + 1) * n), payloads[s].scales.get(row))
                            else {
                                return Err(self.internal(format!("rank {s} staged no NVFP4 row {row}")));
                            };
                            let (codes, scales) = bytes.split_at(h / 2);
                            crate::nvfp4::dequantize_row(codes, scales, g, &mut x);
                        } else {
                            let Some(row) = payloads[s].bf16.get(row * h..(row + 1) * h) else {
                                return Err(self.internal(format!("rank {s} staged no row {row}")));
                            };
                            x.iter_mut().zip(row).for_each(|(x, v)| *x = v.to_f32());
                        }
                        for (a, x) in acc.iter_mut().zip(&x) {
                            *a = w.mul_add(*x, *a);
                        }
                    }
                    for (o, a) in out[t * h..(t + 1) * h].iter_mut().zip(&acc) {
                        *o = bf16::from_f32(*a);
                    }
                    if let Some(HostData::I32(m)) = masked.as_mut() {
                        m[t] = lost;
                    }
                }
            }
            Algorithm::HighThroughput => {
                let mut acc = self.buffers.take_scratch(b * h);
                for (d, m) in msgs.iter().enumerate() {
                    let first_row = match m {
                        Body::HtCombine { first_row } => *first_row,
                        other => return Err(self.mismatch(d, other)),
                    };
                    let copies = handle.0.plan.copies_to(d);
                    let p = &payloads[d];
                    if p.bf16.len() < (first_row + copies.len()) * h {
                        return Err(self.internal(format!("rank {d} staged too few rows")));
                    }
                    for (ci, copy) in copies.iter().enumerate() {
                        let (t, row) = (copy.token as usize, first_row + ci);
                        for (a, x) in acc[t * h..(t + 1) * h].iter_mut().zip(&p.bf16[row * h..(row + 1) * h]) {
                            *a += x.to_f32();
                        }
                        if let Some(ow) = out_w.as_mut() {
                            for sel in &copy.selections {
                                let k = sel.k as usize;
                                match (ow.get_mut(t * k_n + k), p.weights.get(row * k_n + k)) {
                                    (Some(o), Some(&w)) => *o = w,
                                    _ => return Err(self.internal(format!("rank {d} staged no weights for row {row}"))),
                                }
                            }
                        }
                    }
                }
                for (o, a) in out.iter_mut().zip(&acc) {
                    *o = bf16::from_f32(*a);
                }
                self.buffers.give_scratch(acc);
            }
        }
        drop(payloads);
        Ok(HostCombineOutput {
            outputs: CombineOutputs {
                tokens: HostTensor::tokens(b, h, out),
                topk_weights: out_w.map(|w| HostTensor::topk_weights(b, k_n, w)),
                masked: masked.zip(descs.masked.as_ref()).map(|(m, d)| HostTensor::new(d.tag, &d.shape, m)),
            },
            recycle: self.recycle(),
            _slot: self.state.take_slot(),
        })
    }

    /// Takes every peer's message, produces the result, and returns the credits (also after an
    /// error). Runs once.
    ///
    /// Rank masking: the sources masked now are absent, whether or not their message came (so
    /// no output mixes a masked rank's data with its absence).
    fn take_result(&mut self) -> Result<HostOpOutput> {
        let (mb, r) = (&self.world.mailboxes, self.world.num_ranks);
        let absent = self.world.masks.view(self.rank);
        let msgs: Vec<Message> = (0..r)
            .map(|s| {
                let m = mb.cell(self.rank, self.channel, self.seq, s).take();
                if absent.contains(s) { self.absent_message() } else { m.unwrap_or(Message::Cancelled) }
            })
            .collect();
        let result = if absent.contains(self.rank) {
            Err(Error::RankMasked { op: self.label(), rank: self.rank })
        } else if self.state.is_cancelled() {
            Ok(OpOutput::Cancelled)
        } else {
            self.produce(&msgs, &absent)
        };
        // Done reading the senders' staging buffers: return every credit, also after an error.
        for s in 0..r {
            self.world.mailboxes.cell(self.rank, self.channel, self.seq, s).release(self.seq);
        }
        result
    }

    fn produce(&mut self, msgs: &[Message], absent: &RankSet) -> Result<HostOpOutput> {
        let mut bodies = Vec::with_capacity(msgs.len());
        for (peer, m) in msgs.iter().enumerate() {
            match m {
                Message::Cancelled => {
                    return Err(Error::PeerCancelled { op: op_label(self.channel, self.seq), peer });
                }
                Message::Data { stamp, body } => {
                    if *stamp != self.stamp {
                        return Err(Error::PeerMismatch {
                            op: op_label(self.channel, self.seq),
                            peer,
                            ours: self.stamp,
                            theirs: *stamp,
                        });
                    }
                    bodies.push(body);
                }
            }
        }
        match self.work.take().ok_or_else(|| self.internal("finished twice".into()))? {
            HostOpKind::Handle { routing, plan, recv_bound } => {
                Ok(OpOutput::Handle(self.finish_handle(routing, plan, recv_bound, &bodies)?))
            }
            HostOpKind::Dispatch { handle, opts } => {
                Ok(OpOutput::Dispatch(self.finish_dispatch(&handle, opts, &bodies)?))
            }
            HostOpKind::Combine { handle, opts, weights } => {
                Ok(OpOutput::Combine(self.finish_combine(&handle, opts, &weights, &bodies, absent)?))
            }
        }
    }
}

impl PendingOp for HostOp {
    type Output = HostOpOutput;
    type Stream = HostStream;

    fn id(&self) -> OpId {
        OpId { rank: self.rank, channel: self.channel, seq: self.seq }
    }

    fn needs_slot(&self) -> bool {
        self.channel != Channel::Handle
    }

    fn poll_send_ready(&mut self) -> Result<bool> {
        Ok(self.state.is_sent() || (0..self.world.num_ranks).all(|d| self.credit_from(d)))
    }

    fn send(&mut self, slot: Option<SlotGuard>) -> Result<()> {
        if self.state.is_sent() {
            return Ok(());
        }
        let mb = &self.world.mailboxes;
        if !self.state.is_cancelled() {
            if let Some(payload) = self.staged.take() {
                // Every receiver has released operation `seq - sets`, the last user of this buffer.
                let old = std::mem::replace(&mut *mb.staging_mut(self.rank, self.channel, self.seq), payload);
                self.buffers.give_staging(old);
            }
        }
        for d in 0..self.world.num_ranks {
            if self.masked(d) {
                continue; // A masked rank gets nothing.
            }
            let msg = if self.state.is_cancelled() {
                Message::Cancelled
            } else {
                self.outgoing[d].take().unwrap_or(Message::Cancelled)
            };
            mb.cell(d, self.channel, self.seq, self.rank).deliver(self.seq, msg);
        }
        self.state.mark_sent(slot);
        Ok(())
    }

    fn is_sent(&self) -> bool {
        self.state.is_sent()
    }

    fn cancel(&mut self) {
        if self.state.cancel() {
            self.outgoing.iter_mut().for_each(|m| *m = None);
            if let Some(s) = self.staged.take() {
                self.buffers.give_staging(s);
            }
        }
    }

    fn start_complete(&mut self) -> Result<()> {
        Ok(())
    }

    fn poll_complete(&mut self) -> Result<bool> {
        let mut all = true;
        for src in 0..self.world.num_ranks {
            if !self.arrived[src] {
                self.arrived[src] = self.arrival_from(src);
                all &= self.arrived[src];
            }
        }
        Ok(all)
    }

    fn finish(mut self) -> Result<Self::Output> {
        self.take_result()
    }

    /// The host backend completes on the host: the outputs come once every peer's message is
    /// in (the driver waits through the complete probe until then), already in order for any
    /// later work.
    fn complete_on(&mut self, _stream: &HostStream, _order: StreamOrder) -> Result<Option<Self::Output>> {
        if !self.poll_complete()? {
            return Ok(None);
        }
        self.take_result().map(Some)
    }

    fn send_probe(&self) -> Box<dyn crate::backend::Probe> {
        let (world, channel, seq, rank) = (Arc::clone(&self.world), self.channel, self.seq, self.rank);
        Box::new(move || {
            let sets = world.mailboxes.sets();
            (0..world.num_ranks).all(|d| {
                world.masks.skips(rank, d) || world.mailboxes.cell(d, channel, seq, rank).has_credit(seq, sets)
            })
        })
    }

    fn complete_probe(&self) -> Box<dyn crate::backend::Probe> {
        if self.arrived.iter().all(|&a| a) {
            // Everything is in (and may have been taken already by a stream-ordered completion).
            return Box::new(|| true);
        }
        let (world, channel, seq, rank) = (Arc::clone(&self.world), self.channel, self.seq, self.rank);
        Box::new(move || {
            (0..world.num_ranks)
                .all(|s| world.masks.skips(rank, s) || world.mailboxes.cell(rank, channel, seq, s).has_arrived(seq))
        })
    }

    fn traffic(&self) -> (u64, u64) {
        let h = self.world.config.hidden as u64;
        let copies: usize = self
            .outgoing
            .iter()
            .map(|m| match m {
                Some(Message::Data { body: Body::Dispatch { copies }, .. }) => copies.len(),
                Some(Message::Data { body: Body::LlCombine { entries }, .. }) => entries.len(),
                _ => 0,
            })
            .sum();
        let tokens = match &self.work {
            Some(HostOpKind::Dispatch { handle, .. } | HostOpKind::Combine { handle, .. }) => {
                handle.num_tokens() as u64
            }
            _ => 0,
        };
        (copies as u64 * h * 2, tokens)
    }

    fn waiting_for(&self) -> String {
        if !self.state.is_sent() {
            let missing = self.ranks_where(|d| !self.credit_from(d));
            format!(
                "buffer credits from ranks {missing:?} (they have not consumed {} #{})",
                self.channel,
                self.seq.saturating_sub(self.world.mailboxes.sets() as u64)
            )
        } else {
            let missing = self.ranks_where(|s| !self.arrived[s] && !self.arrival_from(s));
            format!("data from ranks {missing:?}")
        }
    }

    /// Masks the ranks this operation still waits for (credits before its send, data after),
    /// in every rank's word; `true` if there were any, or if nothing is missing any more: what
    /// it waited for came, or the group masked it (or this rank, whose operation then ends in
    /// [`Error::RankMasked`]) between the wait's last look and its deadline, so the next
    /// check finds it ready.
    fn mask_missing(&mut self) -> Result<bool> {
        if !self.world.config.rank_masking {
            return Ok(false);
        }
        let missing = if !self.state.is_sent() {
            self.ranks_where(|d| !self.credit_from(d))
        } else {
            self.ranks_where(|s| !self.arrived[s] && !self.arrival_from(s))
        };
        let missing = RankSet::from_ranks(missing, self.world.num_ranks)?;
        Ok(missing.is_empty() || self.world.masks.detect(self.rank, &missing))
    }
}
