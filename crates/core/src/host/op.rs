//! [`HostOp`]: one host operation as a [`PendingOp`] state machine.

use std::sync::{Arc, OnceLock};

use half::bf16;

use super::HostWorldShared;
use super::handle::{HandleInner, HostHandle};
use super::messages::Message;
use super::outputs::{BufferCache, HostCombineOutput, HostDispatchOutput, Recycle, zeroed};
use crate::backend::{OpOutput, PendingOp};
use crate::error::{Error, Result};
use crate::ops::{CombineOptions, CombineOutputs, DispatchOptions, DispatchOutputs, Pass};
use crate::protocol::{Channel, SlotGuard, op_label};
use crate::reference::Rows;
use crate::routing::{HtRecvLayout, LlRecvLayout, Routing, SendPlan};
use crate::tensor::{HostData, HostTensor};
use crate::validate::{OpContext, combine_output_descs, dispatch_output_descs};
use crate::{Algorithm, TensorTag};

/// What the operation produces once its messages are in.
#[derive(Debug)]
pub(crate) enum Work {
    Handle {
        routing: Routing,
        plan: SendPlan,
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
    pub(crate) work: Option<Work>,
    /// Per destination, the message to send (taken by `send`).
    pub(crate) outgoing: Vec<Option<Message>>,
    pub(crate) cache: Arc<BufferCache>,
    pub(crate) sent: bool,
    pub(crate) cancelled: bool,
    pub(crate) arrived: Vec<bool>,
    pub(crate) slot: Option<SlotGuard>,
}

/// The output of a host operation.
pub type HostOpOutput = OpOutput<HostHandle, HostDispatchOutput, HostCombineOutput>;

impl HostOp {
    fn ranks_where(&self, pred: impl Fn(usize) -> bool) -> Vec<usize> {
        (0..self.world.num_ranks).filter(|&r| pred(r)).collect()
    }

    fn ctx<'a>(&'a self, handle: &HostHandle) -> OpContext<'a> {
        OpContext {
            config: &self.world.config,
            num_ranks: self.world.num_ranks,
            num_tokens: handle.num_tokens(),
            top_k: handle.top_k(),
            num_recv: handle.num_recv_tokens().unwrap_or(0),
        }
    }

    fn mismatch(&self, peer: usize, msg: &Message) -> Error {
        Error::OrderMismatch { op: op_label(self.channel, self.seq), peer, got: msg.kind() }
    }

    /// Takes every source's message (returning the credits), then checks for cancellations.
    fn take_messages(&mut self) -> Result<Vec<Message>> {
        let msgs: Vec<Message> = (0..self.world.num_ranks)
            .map(|src| {
                self.world
                    .mailboxes
                    .cell(self.rank, self.channel, self.seq, src)
                    .consume(self.seq)
                    .unwrap_or(Message::Cancelled)
            })
            .collect();
        if let Some(peer) = msgs.iter().position(|m| matches!(m, Message::Cancelled)) {
            return Err(Error::PeerCancelled { op: op_label(self.channel, self.seq), peer });
        }
        Ok(msgs)
    }

    fn finish_handle(&self, routing: Routing, plan: SendPlan, msgs: Vec<Message>) -> Result<HostHandle> {
        let l = self.world.config.local_experts(self.world.num_ranks);
        let mut plans = Vec::with_capacity(msgs.len());
        for (src, m) in msgs.iter().enumerate() {
            match m {
                Message::HandlePlan { copies } => plans.push((src, copies.as_slice())),
                other => return Err(self.mismatch(src, other)),
            }
        }
        let layout = HtRecvLayout::from_received(l, plans);
        Ok(HostHandle(Arc::new(HandleInner {
            group_id: self.world.group_id,
            routing,
            plan,
            ht: Some(layout),
            ll: OnceLock::new(),
        })))
    }

    fn finish_dispatch(
        &mut self,
        handle: &HostHandle,
        opts: DispatchOptions,
        msgs: Vec<Message>,
    ) -> Result<HostDispatchOutput> {
        let cfg = &self.world.config;
        let h = cfg.hidden;
        let cols = cfg.scale_cols();
        let k_n = handle.top_k();
        let descs = dispatch_output_descs(&self.ctx(handle), &opts);
        let mut received = Vec::with_capacity(msgs.len());
        for (src, m) in msgs.iter().enumerate() {
            match m {
                Message::Dispatch { pass, copies, rows, weights } if *pass == opts.pass => {
                    received.push((src, copies.as_slice(), rows, weights.as_slice()))
                }
                other => return Err(self.mismatch(src, other)),
            }
        }
        let set = self.slot.as_ref().map_or(0, SlotGuard::set);
        let mut tokens = match cfg.algorithm {
            Algorithm::LowLatency => self.cache.take(set, &descs.tokens, false),
            Algorithm::HighThroughput => zeroed(&descs.tokens),
        };
        let mut scales = descs.scales.as_ref().map(|d| match cfg.algorithm {
            Algorithm::LowLatency => self.cache.take(set, d, true),
            Algorithm::HighThroughput => zeroed(d),
        });
        let mut put_row =
            |dst_row: usize, rows: &Rows, src_row: usize, scales: &mut Option<HostData>| match (rows, &mut tokens) {
                (Rows::Bf16(r), HostData::Bf16(t)) => {
                    t[dst_row * h..(dst_row + 1) * h].copy_from_slice(&r[src_row * h..(src_row + 1) * h])
                }
                (Rows::Fp8 { q, scales: s }, HostData::Fp8(t)) => {
                    t[dst_row * h..(dst_row + 1) * h].copy_from_slice(&q[src_row * h..(src_row + 1) * h]);
                    if let Some(HostData::F32(out)) = scales {
                        out[dst_row * cols..(dst_row + 1) * cols]
                            .copy_from_slice(&s[src_row * cols..(src_row + 1) * cols]);
                    }
                }
                _ => unreachable!("rows are built in the group's dispatch dtype"),
            };
        let l = cfg.local_experts(self.world.num_ranks);
        let (mut topk_w, mut topk_i, counts) = (None, None, descs.counts.as_ref().map(|_| vec![0i32; l]));
        match cfg.algorithm {
            Algorithm::LowLatency => {
                let rows_per_expert = descs.tokens.shape[1];
                let mut counts = vec![0usize; l];
                for (_, copies, rows, _) in &received {
                    for (ci, copy) in copies.iter().enumerate() {
                        for sel in &copy.selections {
                            let le = sel.local_expert as usize;
                            put_row(le * rows_per_expert + counts[le], rows, ci, &mut scales);
                            counts[le] += 1;
                        }
                    }
                }
                let layout = LlRecvLayout::from_received(l, received.iter().map(|(s, c, _, _)| (*s, *c)));
                let _ = handle.0.ll.set(layout);
            }
            Algorithm::HighThroughput => {
                let n = descs.tokens.shape[0];
                let forward = opts.pass == Pass::Forward;
                let (mut w, mut i) = (vec![0f32; n * k_n], vec![-1i64; n * k_n]);
                let mut row = 0;
                for (_, copies, rows, weights) in &received {
                    for (ci, copy) in copies.iter().enumerate() {
                        if row >= n {
                            return Err(Error::Backend(format!(
                                "{}: more rows arrived than the handle's {n}",
                                self.label()
                            )));
                        }
                        put_row(row, rows, ci, &mut scales);
                        if forward {
                            for sel in &copy.selections {
                                let k = sel.k as usize;
                                i[row * k_n + k] = i64::from(sel.local_expert);
                                w[row * k_n + k] = weights[ci * k_n + k];
                            }
                        }
                        row += 1;
                    }
                }
                if row != n {
                    return Err(Error::Backend(format!(
                        "{}: {row} rows arrived, the handle expects {n}",
                        self.label()
                    )));
                }
                if forward {
                    topk_w = Some(HostTensor::topk_weights(n, k_n, w));
                    topk_i = Some(HostTensor::topk_idx(n, k_n, i));
                }
            }
        }
        let counts = counts.map(|_| {
            let c = match cfg.algorithm {
                Algorithm::LowLatency => handle.ll_layout().map(LlRecvLayout::counts).unwrap_or_default(),
                Algorithm::HighThroughput => handle.recv_expert_counts().map(<[i32]>::to_vec).unwrap_or_default(),
            };
            let tag = descs.counts.as_ref().map_or(TensorTag::RecvExpertCountsDevice, |d| d.tag);
            HostTensor::new(tag, &[l], HostData::I32(c))
        });
        let outputs = DispatchOutputs {
            tokens: HostTensor::new(TensorTag::Tokens, &descs.tokens.shape, tokens),
            scales: scales.zip(descs.scales.as_ref()).map(|(s, d)| HostTensor::new(TensorTag::Scales, &d.shape, s)),
            topk_weights: topk_w,
            topk_idx: topk_i,
            counts,
        };
        let recycle = (cfg.algorithm == Algorithm::LowLatency).then(|| Recycle { cache: Arc::clone(&self.cache), set });
        Ok(HostDispatchOutput { outputs, recycle, _slot: self.slot.take() })
    }

    fn finish_combine(
        &mut self,
        handle: &HostHandle,
        opts: CombineOptions,
        weights: &[f32],
        msgs: Vec<Message>,
    ) -> Result<HostCombineOutput> {
        let h = self.world.config.hidden;
        let (b, k_n) = (handle.num_tokens(), handle.top_k());
        let descs = combine_output_descs(&self.ctx(handle), &opts);
        let mut out = vec![bf16::ZERO; b * h];
        let mut out_w = descs.topk_weights.as_ref().map(|_| vec![0f32; b * k_n]);
        match self.world.config.algorithm {
            Algorithm::LowLatency => {
                // where_[t * K + k] = (message, entry) holding that selection's expert output.
                let mut where_: Vec<Option<(usize, usize)>> = vec![None; b * k_n];
                for (src, m) in msgs.iter().enumerate() {
                    let Message::LlCombine { entries, .. } = m else { return Err(self.mismatch(src, m)) };
                    for (ei, &(t, k)) in entries.iter().enumerate() {
                        where_[t as usize * k_n + k as usize] = Some((src, ei));
                    }
                }
                let mut acc = vec![0f32; h];
                for t in 0..b {
                    acc.iter_mut().for_each(|a| *a = 0.0);
                    for k in 0..k_n {
                        if handle.routing().expert(t, k).is_none() {
                            continue;
                        }
                        let Some((mi, ei)) = where_[t * k_n + k] else {
                            return Err(Error::Backend(format!(
                                "{}: no expert output for token {t}, slot {k}",
                                self.label()
                            )));
                        };
                        let Message::LlCombine { rows, .. } = &msgs[mi] else { unreachable!() };
                        let w = weights[t * k_n + k];
                        for (a, x) in acc.iter_mut().zip(&rows[ei * h..(ei + 1) * h]) {
                            *a = w.mul_add(x.to_f32(), *a);
                        }
                    }
                    for (o, a) in out[t * h..(t + 1) * h].iter_mut().zip(&acc) {
                        *o = bf16::from_f32(*a);
                    }
                }
            }
            Algorithm::HighThroughput => {
                let mut acc = vec![0f32; b * h];
                for (d, m) in msgs.iter().enumerate() {
                    let copies = handle.0.plan.copies_to(d);
                    let (rows, wg) = match m {
                        Message::HtCombine { pass, rows, weights } if *pass == opts.pass => (rows, weights),
                        other => return Err(self.mismatch(d, other)),
                    };
                    if rows.len() != copies.len() * h {
                        return Err(Error::Backend(format!(
                            "{}: rank {d} sent {} rows, expected {}",
                            self.label(),
                            rows.len() / h,
                            copies.len()
                        )));
                    }
                    for (ci, copy) in copies.iter().enumerate() {
                        let t = copy.token as usize;
                        for (a, x) in acc[t * h..(t + 1) * h].iter_mut().zip(&rows[ci * h..(ci + 1) * h]) {
                            *a += x.to_f32();
                        }
                        if let Some(ow) = out_w.as_mut() {
                            for sel in &copy.selections {
                                let k = sel.k as usize;
                                ow[t * k_n + k] = wg[ci * k_n + k];
                            }
                        }
                    }
                }
                for (o, a) in out.iter_mut().zip(&acc) {
                    *o = bf16::from_f32(*a);
                }
            }
        }
        Ok(HostCombineOutput {
            outputs: CombineOutputs {
                tokens: HostTensor::tokens(b, h, out),
                topk_weights: out_w.map(|w| HostTensor::topk_weights(b, k_n, w)),
            },
            _slot: self.slot.take(),
        })
    }
}

impl PendingOp for HostOp {
    type Output = HostOpOutput;

    fn rank(&self) -> usize {
        self.rank
    }

    fn channel(&self) -> Channel {
        self.channel
    }

    fn seq(&self) -> u64 {
        self.seq
    }

    fn needs_slot(&self) -> bool {
        self.channel != Channel::Handle
    }

    fn poll_send_ready(&mut self) -> Result<bool> {
        let sets = self.world.mailboxes.sets();
        Ok(self.sent
            || (0..self.world.num_ranks)
                .all(|d| self.world.mailboxes.cell(d, self.channel, self.seq, self.rank).has_credit(self.seq, sets)))
    }

    fn send(&mut self, slot: Option<SlotGuard>) -> Result<()> {
        if self.sent {
            return Ok(());
        }
        for d in 0..self.world.num_ranks {
            let msg =
                if self.cancelled { Message::Cancelled } else { self.outgoing[d].take().unwrap_or(Message::Cancelled) };
            self.world.mailboxes.cell(d, self.channel, self.seq, self.rank).deliver(self.seq, msg);
        }
        self.slot = slot;
        self.sent = true;
        Ok(())
    }

    fn is_sent(&self) -> bool {
        self.sent
    }

    fn cancel(&mut self) {
        if !self.sent {
            self.cancelled = true;
            self.outgoing.iter_mut().for_each(|m| *m = None);
        }
    }

    fn start_complete(&mut self) -> Result<()> {
        Ok(())
    }

    fn poll_complete(&mut self) -> Result<bool> {
        let mut all = true;
        for src in 0..self.world.num_ranks {
            if !self.arrived[src] {
                self.arrived[src] =
                    self.world.mailboxes.cell(self.rank, self.channel, self.seq, src).has_arrived(self.seq);
                all &= self.arrived[src];
            }
        }
        Ok(all)
    }

    fn finish(mut self) -> Result<Self::Output> {
        let msgs = self.take_messages();
        if self.cancelled {
            return Ok(OpOutput::Cancelled);
        }
        let msgs = msgs?;
        let work = self.work.take().ok_or_else(|| Error::Backend(format!("{} finished twice", self.label())))?;
        match work {
            Work::Handle { routing, plan } => Ok(OpOutput::Handle(self.finish_handle(routing, plan, msgs)?)),
            Work::Dispatch { handle, opts } => Ok(OpOutput::Dispatch(self.finish_dispatch(&handle, opts, msgs)?)),
            Work::Combine { handle, opts, weights } => {
                Ok(OpOutput::Combine(self.finish_combine(&handle, opts, &weights, msgs)?))
            }
        }
    }

    fn waiting_for(&self) -> String {
        if !self.sent {
            let sets = self.world.mailboxes.sets();
            let missing = self.ranks_where(|d| {
                !self.world.mailboxes.cell(d, self.channel, self.seq, self.rank).has_credit(self.seq, sets)
            });
            format!(
                "buffer credits from ranks {missing:?} (they have not consumed {} #{})",
                self.channel,
                self.seq.saturating_sub(sets as u64)
            )
        } else {
            let missing = self.ranks_where(|s| !self.arrived[s]);
            format!("data from ranks {missing:?}")
        }
    }
}
