//! [`HostWorld`] creates the ranks; [`HostRank`] is one rank's API, blocking and staged, and its
//! [`Backend`] implementation for the async runtime.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use half::bf16;

use super::HostWorldShared;
use super::handle::HostHandle;
use super::mailbox::Mailboxes;
use super::mailbox::Staging;
use super::messages::{Body, Message};
use super::op::{HostOp, HostOpKind, HostOpOutput};
use super::outputs::{Buffers, HostCombineOutput, HostDispatchOutput};
use crate::backend::{
    Backend, HandleCreation, OpOutput, OpState, PendingOp, RankCore, complete_blocking, detach, run_blocking,
    send_blocking,
};
use crate::config::{Algorithm, GroupConfig};
use crate::dtype::CombineQuant;
use crate::error::{ConfigError, Error, Result, ValidationError};
use crate::handle::{HandleCore, RoutingHandle};
use crate::mask::{MaskedRanks, RankSet};
use crate::ops::{
    CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions, Layout, Pass, RecvRows,
};
use crate::protocol::{Channel, Poison};
use crate::routing::{ExpertPlacement, SendPlan};
use crate::stamp::{Pairing, Stamp};
use crate::tensor::{HostData, HostTensor};
use crate::validate::{
    recv_bound, routing_from_tensor, validate_combine_inputs, validate_dispatch_inputs, validate_handle_options,
    validate_staged,
};

static NEXT_GROUP_ID: AtomicU64 = AtomicU64::new(1);

/// Creates host worlds.
#[derive(Debug)]
pub struct HostWorld;

impl HostWorld {
    /// Creates the `num_ranks` ranks of a new world; give one to each thread (or task).
    pub fn create(num_ranks: usize, config: GroupConfig) -> Result<Vec<HostRank>, ConfigError> {
        config.validate(num_ranks)?;
        let group_id = NEXT_GROUP_ID.fetch_add(1, Ordering::Relaxed);
        let world = Arc::new(HostWorldShared {
            mailboxes: Mailboxes::new(&config, num_ranks),
            masks: super::mask::HostMasks::new(num_ranks),
            epoch: AtomicU64::new(0),
            slots: std::sync::Mutex::new(vec![super::Slot::Live; num_ranks]),
            ops_alive: (0..num_ranks).map(|_| std::sync::atomic::AtomicUsize::new(0)).collect(),
            group_id,
            num_ranks,
            config,
        });
        Ok((0..num_ranks)
            .map(|rank| HostRank {
                world: Arc::clone(&world),
                core: RankCore::new(rank, num_ranks, group_id, world.config.clone()),
                buffers: Buffers::new(world.config.buffer_sets),
            })
            .collect())
    }

    /// Creates a world and runs `f` on every rank, one thread each; returns the results in rank
    /// order.
    pub fn run<R: Send>(
        num_ranks: usize,
        config: GroupConfig,
        f: impl Fn(&HostRank) -> R + Sync,
    ) -> Result<Vec<R>, ConfigError> {
        let ranks = Self::create(num_ranks, config)?;
        Ok(std::thread::scope(|s| {
            let handles: Vec<_> = ranks.iter().map(|r| s.spawn(|| f(r))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        }))
    }
}

/// One rank of a host world. Every operation is collective: all ranks must call it, in the same
/// order. Blocking calls return when this rank's part is done; staged calls
/// ([`HostRank::dispatch_send`], [`HostRank::combine_send`]) return after the send half.
#[derive(Debug)]
pub struct HostRank {
    pub(super) world: Arc<HostWorldShared>,
    pub(super) core: RankCore,
    pub(super) buffers: Arc<Buffers>,
}

/// A staged host operation: its send half is done; [`HostStaged::complete`] runs the complete
/// half. Dropping it without completing finishes the operation on a background thread (its
/// result is discarded), so peers never wait for it.
#[derive(Debug)]
pub struct HostStaged<T> {
    op: Option<HostOp>,
    poison: Arc<Poison>,
    timeout: Duration,
    extract: fn(HostOpOutput) -> Result<T>,
}

impl<T> HostStaged<T> {
    /// Whether the complete half can run without waiting (all data has arrived).
    pub fn is_ready(&mut self) -> Result<bool> {
        match self.op.as_mut() {
            Some(op) => op.poll_complete(),
            None => Ok(true),
        }
    }

    /// Runs the complete half, waiting up to the group's timeout for the peers' data.
    pub fn complete(mut self) -> Result<T> {
        let op = self.op.take().ok_or_else(|| Error::Backend("staged operation already completed".into()))?;
        (self.extract)(complete_blocking(op, &self.poison, self.timeout)?)
    }
}

impl<T> Drop for HostStaged<T> {
    fn drop(&mut self) {
        if let Some(op) = self.op.take() {
            detach(op, self.timeout, Arc::clone(&self.poison));
        }
    }
}

fn cancelled_error(what: &str) -> Error {
    Error::Backend(format!("{what} was cancelled and has no result"))
}

fn into_dispatch(o: HostOpOutput) -> Result<HostDispatchOutput> {
    match o {
        OpOutput::Dispatch(d) => Ok(d),
        _ => Err(cancelled_error("dispatch")),
    }
}

fn into_combine(o: HostOpOutput) -> Result<HostCombineOutput> {
    match o {
        OpOutput::Combine(c) => Ok(c),
        _ => Err(cancelled_error("combine")),
    }
}

impl HostRank {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.core.rank()
    }

    /// Ranks in the world.
    pub fn num_ranks(&self) -> usize {
        self.core.num_ranks()
    }

    /// The group config.
    pub fn config(&self) -> &GroupConfig {
        self.core.config()
    }

    /// Whether an earlier failure poisoned this rank's group.
    pub fn is_poisoned(&self) -> bool {
        self.core.poison().is_poisoned()
    }

    fn new_op(
        &self,
        channel: Channel,
        work: Option<HostOpKind>,
        stamp: Stamp,
        outgoing: Vec<Option<Message>>,
        staged: Option<Staging>,
    ) -> HostOp {
        self.world.ops_alive[self.core.rank()].fetch_add(1, Ordering::AcqRel);
        HostOp {
            world: Arc::clone(&self.world),
            rank: self.core.rank(),
            channel,
            seq: self.core.next_seq(channel),
            stamp,
            work,
            outgoing,
            staged,
            buffers: Arc::clone(&self.buffers),
            state: OpState::default(),
            arrived: vec![false; self.world.num_ranks],
        }
    }

    /// Takes part in the next collective of `channel` as a cancellation, in the background: an
    /// operation whose arguments failed validation on this rank, so the peers fail at once with
    /// [`Error::PeerCancelled`] instead of waiting for their timeout.
    fn cancel_collective(&self, channel: Channel) {
        let mut op = self.new_op(
            channel,
            None,
            Stamp::new(0, Pass::Forward, Pairing::None),
            vec![None; self.world.num_ranks],
            None,
        );
        op.cancel();
        detach(op, self.world.config.timeout, Arc::clone(self.core.poison()));
    }

    /// [`Error::RankMasked`] if the group masked this rank: it neither sends nor waits (and
    /// takes no sequence number) until `unmask_all`.
    fn check_not_masked(&self, channel: Channel) -> Result<()> {
        let me = self.core.rank();
        if self.world.masks.holds(me, me) {
            let op = crate::protocol::op_label(channel, self.core.peek_seq(channel));
            return Err(Error::RankMasked { op, rank: me });
        }
        Ok(())
    }

    /// Runs `start` (which validates and creates an operation of `channel`); if it fails for a
    /// reason other than a poisoned group, the collective still goes ahead as a cancellation.
    fn collective<T>(&self, channel: Channel, start: impl FnOnce() -> Result<T>) -> Result<T> {
        self.core.poison().check()?;
        self.check_not_masked(channel)?;
        let r = start();
        if let Err(e) = &r {
            if !matches!(e, Error::Poisoned { .. }) {
                self.cancel_collective(channel);
            }
        }
        r
    }

    /// Creates a routing handle from `topk_idx` `[B x K]` int64 (collective for high-throughput:
    /// it exchanges what each rank will send; local for low-latency), expert-major.
    pub fn create_handle(&self, topk_idx: &HostTensor) -> Result<HostHandle> {
        self.create_handle_with(topk_idx, &HandleOptions::default())
    }

    /// Creates a routing handle with `opts` (see [`HostRank::create_handle`]).
    pub fn create_handle_with(&self, topk_idx: &HostTensor, opts: &HandleOptions) -> Result<HostHandle> {
        match self.start_handle(topk_idx, opts)? {
            HandleCreation::Ready(h) => Ok(h),
            HandleCreation::Collective(op) => {
                match run_blocking(op, self.core.slot_pool(Channel::Handle), self.core.poison(), self.config().timeout)?
                {
                    OpOutput::Handle(h) => Ok(h),
                    _ => Err(cancelled_error("handle creation")),
                }
            }
        }
    }

    /// Dispatch, blocking until this rank's outputs are ready (collective).
    pub fn dispatch(
        &self,
        handle: &HostHandle,
        inputs: DispatchInputs<'_>,
        opts: &DispatchOptions,
    ) -> Result<HostDispatchOutput> {
        let op = self.start_dispatch(handle, inputs, opts)?;
        into_dispatch(run_blocking(
            op,
            self.core.slot_pool(Channel::Dispatch),
            self.core.poison(),
            self.config().timeout,
        )?)
    }

    /// Low-latency staged dispatch: returns after the send half (collective).
    pub fn dispatch_send(
        &self,
        handle: &HostHandle,
        inputs: DispatchInputs<'_>,
        opts: &DispatchOptions,
    ) -> Result<HostStaged<HostDispatchOutput>> {
        validate_staged(&self.world.config)?;
        let op = self.start_dispatch(handle, inputs, opts)?;
        self.staged(Channel::Dispatch, op, into_dispatch)
    }

    /// Combine, blocking until this rank's outputs are ready (collective).
    pub fn combine(
        &self,
        handle: &HostHandle,
        inputs: CombineInputs<'_>,
        opts: &CombineOptions,
    ) -> Result<HostCombineOutput> {
        let op = self.start_combine(handle, inputs, opts)?;
        into_combine(run_blocking(
            op,
            self.core.slot_pool(Channel::Combine),
            self.core.poison(),
            self.config().timeout,
        )?)
    }

    /// Low-latency staged combine: returns after the send half (collective).
    pub fn combine_send(
        &self,
        handle: &HostHandle,
        inputs: CombineInputs<'_>,
        opts: &CombineOptions,
    ) -> Result<HostStaged<HostCombineOutput>> {
        validate_staged(&self.world.config)?;
        let op = self.start_combine(handle, inputs, opts)?;
        self.staged(Channel::Combine, op, into_combine)
    }

    fn staged<T>(&self, channel: Channel, op: HostOp, extract: fn(HostOpOutput) -> Result<T>) -> Result<HostStaged<T>> {
        let timeout = self.config().timeout;
        let poison = self.core.poison();
        let op = send_blocking(op, self.core.slot_pool(channel), poison, timeout)?;
        Ok(HostStaged { op: Some(op), poison: Arc::clone(poison), timeout, extract })
    }

    /// Stages the dispatch payload (this rank's whole input; receivers gather their rows) and
    /// builds the headers.
    fn dispatch_messages(
        &self,
        handle: &HostHandle,
        inputs: &DispatchInputs<'_>,
        pass: Pass,
        stamp: Stamp,
    ) -> (Vec<Option<Message>>, Staging) {
        let mut staged = self.buffers.take_staging();
        match inputs.tokens.data() {
            HostData::Bf16(x) => staged.bf16.extend_from_slice(x),
            HostData::Fp8(q) => {
                staged.fp8.extend_from_slice(q);
                staged.scales.extend_from_slice(inputs.scales.and_then(HostTensor::as_f32).unwrap_or_default());
            }
            _ => unreachable!("dtype validated"),
        }
        let weights_travel = match self.world.config.algorithm {
            Algorithm::HighThroughput => pass == Pass::Forward,
            Algorithm::LowLatency => handle.layout() == Layout::RankMajor,
        };
        if weights_travel {
            staged.weights.extend_from_slice(inputs.topk_weights.and_then(HostTensor::as_f32).unwrap_or_default());
        }
        let plan = &handle.0.plan;
        let msgs = (0..self.world.num_ranks)
            .map(|d| Some(Message::Data { stamp, body: Body::Dispatch { copies: plan.copies_to(d).to_vec() } }))
            .collect();
        (msgs, staged)
    }

    /// Stages the expert outputs the peers need and builds the headers; returns them with the
    /// combine's stamp (low-latency: paired with the dispatch whose layout the rows follow).
    fn combine_messages(
        &self,
        handle: &HostHandle,
        inputs: &CombineInputs<'_>,
        opts: &CombineOptions,
    ) -> Result<(Vec<Option<Message>>, Staging, Stamp)> {
        let pass = opts.pass;
        let cfg = &self.world.config;
        let (h, r) = (cfg.hidden, self.world.num_ranks);
        let x: &[bf16] = inputs.tokens.as_bf16().unwrap_or_default();
        // NVFP4: each staged row travels as its codes and block scales (`staged.fp8`, rows of
        // `nvfp4::payload_bytes`) with its global scale (`staged.scales`), as on the GPU's wire.
        let nvfp4 = (opts.quant == CombineQuant::Nvfp4).then(|| inputs.global_scales.and_then(HostTensor::as_f32));
        let stage_row = |staged: &mut Staging, off: usize| -> u32 {
            let row = &x[off..off + h];
            match nvfp4 {
                Some(g) => {
                    let g = g.and_then(|g| g.get(off / h.max(1))).copied().unwrap_or(0.0);
                    let at = staged.fp8.len();
                    staged.fp8.resize(at + crate::nvfp4::payload_bytes(h), 0);
                    let (codes, scales) = staged.fp8[at..].split_at_mut(h / 2);
                    crate::nvfp4::quantize_row(row, g, codes, scales);
                    staged.scales.push(g);
                    (staged.scales.len() - 1) as u32
                }
                None => {
                    staged.bf16.extend_from_slice(row);
                    (staged.bf16.len() / h.max(1) - 1) as u32
                }
            }
        };
        let core = &handle.0.core;
        match cfg.algorithm {
            Algorithm::LowLatency if handle.layout() == Layout::RankMajor => {
                let (seq, layout) = handle.rank_major_layout().ok_or(ValidationError::CombineBeforeDispatch)?;
                let stamp = core.combine_stamp(pass, seq);
                let mut staged = self.buffers.take_staging();
                let m = cfg.fixed_max_tokens().unwrap_or(0);
                let mut entries: Vec<Vec<(u32, u16, u32)>> = vec![Vec::new(); r];
                for (s, entries) in entries.iter_mut().enumerate() {
                    for (i, src) in layout.rows(s).iter().enumerate() {
                        let row = stage_row(&mut staged, (s * m + i) * h);
                        entries.push((src.token, src.k, row));
                    }
                }
                let msgs =
                    entries.into_iter().map(|entries| Some(Message::Data { stamp, body: Body::LlCombine { entries } }));
                Ok((msgs.collect(), staged, stamp))
            }
            Algorithm::LowLatency => {
                let (seq, layout) = handle.ll_layout_with_seq().ok_or(ValidationError::CombineBeforeDispatch)?;
                let stamp = core.combine_stamp(pass, seq);
                let mut staged = self.buffers.take_staging();
                let rows_per_expert = r * cfg.fixed_max_tokens().unwrap_or(0);
                let mut entries: Vec<Vec<(u32, u16, u32)>> = vec![Vec::new(); r];
                for le in 0..layout.local_experts() {
                    for (i, src) in layout.rows(le).iter().enumerate() {
                        let row = stage_row(&mut staged, (le * rows_per_expert + i) * h);
                        entries[src.src_rank as usize].push((src.token, src.k, row));
                    }
                }
                let msgs =
                    entries.into_iter().map(|entries| Some(Message::Data { stamp, body: Body::LlCombine { entries } }));
                Ok((msgs.collect(), staged, stamp))
            }
            Algorithm::HighThroughput => {
                let layout = handle.ht_layout().ok_or(ValidationError::CombineBeforeDispatch)?;
                let stamp = core.combine_stamp(pass, core.combine_dispatch(pass)?);
                let mut staged = self.buffers.take_staging();
                staged.bf16.extend_from_slice(x);
                if pass == Pass::Backward {
                    staged
                        .weights
                        .extend_from_slice(inputs.topk_weights.and_then(HostTensor::as_f32).unwrap_or_default());
                }
                // Rows are sorted by source rank: each source's rows start where the previous end.
                let mut first = vec![0usize; r + 1];
                for src in layout.rows() {
                    first[src.src_rank as usize + 1] += 1;
                }
                for s in 0..r {
                    first[s + 1] += first[s];
                }
                let msgs = (0..r).map(|s| Some(Message::Data { stamp, body: Body::HtCombine { first_row: first[s] } }));
                Ok((msgs.collect(), staged, stamp))
            }
        }
    }

    fn prepare_dispatch(
        &self,
        handle: &HostHandle,
        inputs: DispatchInputs<'_>,
        opts: &DispatchOptions,
    ) -> Result<HostOp> {
        self.core.check_handle(handle)?;
        validate_dispatch_inputs(&self.core.op_context(handle), opts, &inputs)?;
        if opts.dtype.and_then(crate::DispatchDtype::forwarded).is_some() {
            return Err(Error::Unsupported(
                "forwarded rows (DispatchDtype::Forwarded) are a GPU backend's: the host backend moves BF16 or FP8 rows"
                    .into(),
            ));
        }
        let stamp = handle.0.core.dispatch_stamp(opts.pass);
        self.core.note_dispatch_epoch(&handle.0.core);
        let (outgoing, staged) = self.dispatch_messages(handle, &inputs, opts.pass, stamp);
        let work = HostOpKind::Dispatch { handle: handle.clone(), opts: *opts };
        Ok(self.new_op(Channel::Dispatch, Some(work), stamp, outgoing, Some(staged)))
    }

    fn prepare_combine(&self, handle: &HostHandle, inputs: CombineInputs<'_>, opts: &CombineOptions) -> Result<HostOp> {
        self.core.check_handle(handle)?;
        validate_combine_inputs(&self.core.op_context(handle), opts, &inputs)?;
        self.core.check_mask_epoch(&handle.0.core, || {
            crate::protocol::op_label(Channel::Combine, self.core.peek_seq(Channel::Combine))
        })?;
        let (outgoing, staged, stamp) = self.combine_messages(handle, &inputs, opts)?;
        // Expert-major low-latency combine applies the weights on arrival; rank-major and
        // high-throughput combines sum pre-weighted rows (no weights).
        let weights = match self.world.config.algorithm {
            Algorithm::LowLatency => inputs.topk_weights.and_then(HostTensor::as_f32).unwrap_or_default().to_vec(),
            Algorithm::HighThroughput => Vec::new(),
        };
        let work = HostOpKind::Combine { handle: handle.clone(), opts: *opts, weights };
        Ok(self.new_op(Channel::Combine, Some(work), stamp, outgoing, Some(staged)))
    }
}

impl HostRank {
    fn check_masking(&self, what: &str) -> Result<()> {
        if self.world.config.rank_masking {
            Ok(())
        } else {
            Err(Error::Unsupported(format!("{what} needs a group with rank_masking (GroupConfig::with_rank_masking)")))
        }
    }
}

impl Backend for HostRank {
    type Stream = super::HostStream;
    type Tensor = HostTensor;
    type Handle = HostHandle;
    type DispatchOutput = HostDispatchOutput;
    type CombineOutput = HostCombineOutput;
    type Op = HostOp;

    fn core(&self) -> &RankCore {
        &self.core
    }

    fn masked_ranks(&self) -> MaskedRanks {
        MaskedRanks { ranks: self.world.masks.view(self.core.rank()), epoch: self.core.mask_epoch() }
    }

    fn mask_ranks(&self, ranks: &RankSet) -> Result<()> {
        ranks.check_range("mask_ranks", self.world.num_ranks)?;
        self.check_masking("mask_ranks")?;
        self.world.masks.mask(ranks);
        Ok(())
    }

    fn unmask_all(&self) -> Result<()> {
        self.check_masking("unmask_all")?;
        super::mask::unmask_all(&self.world, &self.core)
    }

    fn admit(&self, ranks: &RankSet, timeout: Duration) -> Result<()> {
        super::mask::admit(&self.world, &self.core, ranks, timeout)
    }

    fn rejoin(&self, timeout: Duration) -> Result<()> {
        super::mask::rejoin(&self.world, &self.core, timeout)
    }

    fn start_handle(&self, topk_idx: &HostTensor, opts: &HandleOptions) -> Result<HandleCreation<HostHandle, HostOp>> {
        let cfg = &self.world.config;
        let placement = ExpertPlacement::new(cfg.num_experts, self.world.num_ranks);
        match cfg.algorithm {
            Algorithm::LowLatency => {
                self.core.poison().check()?;
                validate_handle_options(cfg, opts)?;
                let routing = routing_from_tensor(cfg, topk_idx, topk_idx.as_i64().unwrap_or_default())?;
                let plan = SendPlan::new(&routing, placement);
                let core =
                    HandleCore::new(self.world.group_id, routing, Algorithm::LowLatency, None).with_layout(opts.layout);
                Ok(HandleCreation::Ready(HostHandle::new(core, plan, None)))
            }
            Algorithm::HighThroughput => self.collective(Channel::Handle, || {
                validate_handle_options(cfg, opts)?;
                let routing = routing_from_tensor(cfg, topk_idx, topk_idx.as_i64().unwrap_or_default())?;
                let plan = SendPlan::new(&routing, placement);
                let stamp = Stamp::new(routing.top_k(), Pass::Forward, Pairing::None);
                let outgoing = (0..self.world.num_ranks)
                    .map(|d| {
                        Some(Message::Data { stamp, body: Body::HandlePlan { copies: plan.copies_to(d).to_vec() } })
                    })
                    .collect();
                let recv_bound = (opts.recv_rows == RecvRows::Bound).then(|| recv_bound(cfg, self.world.num_ranks));
                let work = HostOpKind::Handle { routing, plan, recv_bound };
                Ok(HandleCreation::Collective(self.new_op(Channel::Handle, Some(work), stamp, outgoing, None)))
            }),
        }
    }

    fn start_dispatch(
        &self,
        handle: &HostHandle,
        inputs: DispatchInputs<'_>,
        opts: &DispatchOptions,
    ) -> Result<HostOp> {
        self.collective(Channel::Dispatch, || self.prepare_dispatch(handle, inputs, opts))
    }

    fn start_combine(&self, handle: &HostHandle, inputs: CombineInputs<'_>, opts: &CombineOptions) -> Result<HostOp> {
        self.collective(Channel::Combine, || self.prepare_combine(handle, inputs, opts))
    }
}
