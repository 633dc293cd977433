//! # epflow-nccl-ep
//!
//! The NCCL EP backend: NVIDIA's NCCL EP (`libnccl_ep`, NCCL EP 0.1 of the NCCL 2.30 series,
//! loaded at run time through `nccl-ep-sys`) behind epflow's [`Backend`] trait, so the same
//! futures (`epflow::Group`) drive it. A peer of the GPU backend (`epflow-kernels`) and the host
//! backend (`epflow-core`); reached as `epflow::nccl_ep`.
//!
//! ## Table of contents
//!
//! - [`NcclEpWorld`], [`NcclEpRank`]: the group and one rank (here).
//! - [`NcclEpHandle`] (`handle.rs`): `ncclEpCreateHandle`'s handles.
//! - [`NcclEpOp`], [`NcclEpDispatchOutput`], [`NcclEpCombineOutput`] (`op.rs`): one operation and
//!   what it returns.
//! - `group.rs`: what the ranks share: the library, the NCCL EP group, buffer sets, and the
//!   teardown the whole world shares.
//! - [`NcclEpStreamHandle`] (`stream.rs`): low-latency dispatch and combine in the caller's
//!   stream order into the caller's tensors, a handle's routing replaced in place (how a C++
//!   layer drives NCCL EP; `moe_serving --backend nccl-ep`).
//!
//! Scope (what NCCL EP 0.1 offers, one process driving every GPU, BF16 dispatch, forward pass):
//! - Low-latency, expert-major layout: dispatch outputs `[L x R*M x H]` and the per-expert
//!   counts, as epflow's GPU backend. The send half is `ncclEpDispatch` / `ncclEpCombine` with
//!   `send_only` set; the awaited complete half is `ncclEpComplete`.
//! - High-throughput, flat layout: handle creation reports `N` (NCCL EP's
//!   `recv_total_counter`) and the per-expert counts; dispatch outputs `[N x H]` tokens with
//!   `[N x K]` weights and local expert indices; combine sums each token's copies. NCCL EP 0.1
//!   has no `send_only` here, and its dispatch reads the receive count back on the host, so the
//!   send half returns once the rows have arrived.
//!
//! FP8 dispatch and the backward pass are refused with [`Error::Unsupported`].
//!
//! Differences from epflow's kernels that users see:
//! - Low-latency: inside an expert's rows NCCL EP keeps arrival order (not epflow's
//!   source-rank, token order), and rows of different source ranks are not packed together:
//!   read an expert's rows through the counts only when you do not rely on the order.
//! - High-throughput: a received row's top-k entries are compact: the local experts it goes to
//!   in ascending order with their weights, then `-1` and weight 0 (epflow keeps slot `k` of the
//!   source token: its local index or `-1`). Rows may arrive in another order than epflow's.
//! - All operations of a rank run on one stream, in call order (NCCL EP's group is one ordered
//!   communicator), so dispatch and combine of one rank never overlap each other.
//! - Handle creation and high-throughput dispatch wait on the host for their peers: drive each
//!   rank from its own thread (a `current_thread` runtime per rank, say), never several ranks
//!   from one thread.
//!
//! Requires `libnccl_ep.so` (`NCCL_EP_LIB`, else the library path) and the NCCL it was built
//! against first on the library path.
//!
//! A rank whose arguments fail validation cannot send a cancellation (NCCL EP has none): its
//! peers wait until their timeout, as with NCCL EP itself.

// Unsafe code lives at this FFI edge only, each block with its SAFETY line.
mod group;
mod handle;
mod op;
mod stream;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cudarc::driver::{CudaContext, CudaStream};
use epflow_core::backend::{Backend, HandleCreation, RankCore};
use epflow_core::handle::HandleCore;
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions, Layout, Pass};
use epflow_core::protocol::Channel;
use epflow_core::validate::{
    check_topk_idx, routing_from_tensor, validate_combine_inputs, validate_dispatch_inputs, validate_handle_options,
};
use epflow_core::{Algorithm, DType, Error, GroupConfig, TensorDesc, TensorTag};
use epflow_kernels::transport::nccl::NcclComms;
use epflow_kernels::{DeviceTensor, StreamWork};
use nccl_ep_sys as ep;

use group::{SetBuffers, Shared, Teardown, cuda, group_config};
pub use handle::NcclEpHandle;
use handle::{Desc, HtRecv, NcclEpHandleState};
use op::NcclEpOpKind;
pub use op::{NcclEpCombineOutput, NcclEpDispatchOutput, NcclEpOp, NcclEpOpOutput};
pub use stream::NcclEpStreamHandle;

/// Creates NCCL EP groups.
#[derive(Debug)]
pub struct NcclEpWorld;

impl NcclEpWorld {
    /// One process driving every device in `devices` (rank `r` on `devices[r]`): loads NCCL EP,
    /// creates an NCCL communicator per device and an NCCL EP group per rank (collective: done
    /// here, one thread per rank). `config` needs BF16 dispatch and a fixed
    /// `max_tokens_per_rank` (high-throughput too: NCCL EP sizes its buffers from it).
    ///
    /// The ranks' groups are destroyed together when the last rank (with every handle and
    /// operation of the world) is dropped, since destroying one is collective.
    pub fn create(devices: &[usize], config: GroupConfig) -> Result<Vec<NcclEpRank>, Error> {
        let num_ranks = devices.len();
        config.validate(num_ranks)?;
        if config.rank_masking {
            return Err(Error::Unsupported(
                "the NCCL EP backend does not mask ranks (use the GPU backend, or NCCL EP's own enable_mask)".into(),
            ));
        }
        if config.dispatch_dtype.is_fp8() {
            return Err(Error::Unsupported(
                "the NCCL EP backend dispatches BF16 (NCCL EP 0.1 reserves the low-latency FP8 scales)".into(),
            ));
        }
        let max_tokens = config.fixed_max_tokens().ok_or_else(|| {
            Error::Unsupported(
                "NCCL EP needs a fixed max_tokens_per_rank (MaxTokens::Fixed), high-throughput too".into(),
            )
        })?;
        let lib = Arc::new(ep::NcclEp::load().map_err(|e| Error::Unsupported(format!("NCCL EP: {e}")))?);
        let comms = NcclComms::init_all(devices)?;
        let teardown = Teardown::new(num_ranks);
        let group_id = NEXT_GROUP_ID.fetch_add(1, Ordering::Relaxed);
        std::thread::scope(|s| {
            let joins: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(rank, comms)| {
                    let (lib, config, teardown) = (Arc::clone(&lib), config.clone(), Arc::clone(&teardown));
                    let at = Place { rank, num_ranks, device: devices[rank], max_tokens, group_id };
                    s.spawn(move || NcclEpRank::new(lib, comms, at, config, teardown))
                })
                .collect();
            joins
                .into_iter()
                .map(|j| j.join().unwrap_or_else(|_| Err(Error::Backend("NCCL EP group creation panicked".into()))))
                .collect()
        })
    }
}

/// Group ids of NCCL EP worlds (apart from the other backends' ids).
static NEXT_GROUP_ID: AtomicU64 = AtomicU64::new(1 << 48);

/// Where a rank sits.
struct Place {
    rank: usize,
    num_ranks: usize,
    device: usize,
    max_tokens: usize,
    group_id: u64,
}

/// One rank of an NCCL EP group.
pub struct NcclEpRank {
    shared: Arc<Shared>,
    core: RankCore,
    order: AtomicU64,
}

impl std::fmt::Debug for NcclEpRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclEpRank").field("rank", &self.shared.rank).field("device", &self.shared.device).finish()
    }
}

impl NcclEpRank {
    fn new(
        lib: Arc<ep::NcclEp>,
        comms: NcclComms,
        at: Place,
        config: GroupConfig,
        teardown: Arc<Teardown>,
    ) -> Result<Self, Error> {
        let Place { rank, num_ranks, device, max_tokens, group_id } = at;
        let ctx = CudaContext::new(device).map_err(|e| cuda("open device", e))?;
        ctx.bind_to_thread().map_err(|e| cuda("bind context", e))?;
        let stream = ctx.new_stream().map_err(|e| cuda("create stream", e))?;
        let gc = group_config(&config, num_ranks, max_tokens);
        let mut group: ep::NcclEpGroup = std::ptr::null_mut();
        let comm = comms.comm(0)? as ep::NcclComm;
        // SAFETY: valid out pointer, a live communicator of this rank, a config initialised with
        // its size and magic; collective: every rank's thread calls it now.
        let r = unsafe { (lib.create_group)(&mut group, comm, &gc) };
        if r != ep::NCCL_SUCCESS {
            return Err(Error::Backend(format!("NCCL EP: ncclEpCreateGroup: {}", lib.error_string(r))));
        }
        let sets = (0..config.buffer_sets)
            .map(|_| SetBuffers::new(&ctx, device, &config, num_ranks, max_tokens))
            .collect::<Result<Vec<_>, _>>();
        let sets = match sets {
            Ok(s) => s,
            Err(e) => {
                teardown.leave_failed(&lib, &ctx, comms);
                return Err(e);
            }
        };
        let core = RankCore::new(rank, num_ranks, group_id, config.clone());
        Ok(NcclEpRank {
            shared: Arc::new(Shared {
                lib,
                rank,
                num_ranks,
                device,
                config,
                max_tokens,
                ctx,
                stream,
                group,
                sets,
                turn: AtomicU64::new(0),
                timing: AtomicBool::new(false),
                comms: Some(comms),
                teardown,
            }),
            core,
            order: AtomicU64::new(0),
        })
    }

    /// The CUDA context of the device.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.shared.ctx
    }

    /// The stream every operation of this rank runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.shared.stream
    }

    /// Copies a host tensor to this rank's device.
    pub fn upload(&self, t: &epflow_core::HostTensor) -> Result<DeviceTensor, Error> {
        DeviceTensor::upload(&self.shared.ctx, self.shared.device, t)
    }

    /// Records CUDA events around every operation ([`NcclEpDispatchOutput::elapsed_halves`]).
    pub fn set_timing(&self, on: bool) {
        self.shared.timing.store(on, Ordering::Relaxed);
    }

    /// Where NCCL EP was loaded from, and its version.
    pub fn library(&self) -> (&str, &str) {
        (self.shared.lib.path(), self.shared.lib.version())
    }

    fn check_handle(&self, h: &NcclEpHandle, pass: Pass) -> Result<(), Error> {
        self.core.check_handle(h)?;
        if !Arc::ptr_eq(&h.0.shared, &self.shared) {
            return Err(Error::Unsupported("the handle belongs to another NCCL EP rank".into()));
        }
        if pass == Pass::Backward {
            return Err(Error::Unsupported("the NCCL EP backend runs the forward pass only".into()));
        }
        Ok(())
    }

    fn new_op(&self, channel: Channel, h: &NcclEpHandle, kind: NcclEpOpKind, inputs: &[&DeviceTensor]) -> NcclEpOp {
        let seq = self.core.next_seq(channel);
        let s = &self.shared;
        NcclEpOp {
            shared: Arc::clone(s),
            handle: h.clone(),
            channel,
            seq,
            order: self.order.fetch_add(1, Ordering::Relaxed),
            set: (seq % s.config.buffer_sets as u64) as usize,
            kind,
            work: StreamWork::new(&s.ctx, &s.stream, inputs),
            inputs: inputs.iter().map(|t| t.ptr()).collect(),
            descs: Vec::new(),
            state: epflow_core::backend::OpState::default(),
            completing: false,
            topk_out: None,
        }
    }

    /// High-throughput: the receive count and per-expert counts NCCL EP writes while it creates
    /// the handle, and their device tensors.
    fn ht_recv_tensors(&self) -> Result<(DeviceTensor, DeviceTensor), Error> {
        let s = &self.shared;
        let l = s.config.local_experts(s.num_ranks);
        let t = |shape: &[usize]| {
            DeviceTensor::zeros(
                &s.ctx,
                s.device,
                TensorDesc::contiguous(TensorTag::RecvExpertCountsDevice, DType::I32, shape),
            )
        };
        Ok((t(&[l])?, t(&[1])?))
    }
}

impl Backend for NcclEpRank {
    type Stream = Arc<CudaStream>;
    type Tensor = DeviceTensor;
    type Handle = NcclEpHandle;
    type DispatchOutput = NcclEpDispatchOutput;
    type CombineOutput = NcclEpCombineOutput;
    type Op = NcclEpOp;

    fn core(&self) -> &RankCore {
        &self.core
    }

    /// `ncclEpCreateHandle` on the rank's stream, waited for before returning. Collective
    /// (high-throughput: an all-gather of the routing), so every rank creates its handles in
    /// the same order, each from its own thread.
    ///
    /// Handles are expert-major: this backend is the yardstick for epflow's own kernels, and
    /// [`Layout::RankMajor`] is refused with [`Error::Unsupported`].
    fn start_handle(
        &self,
        topk_idx: &DeviceTensor,
        opts: &HandleOptions,
    ) -> Result<HandleCreation<NcclEpHandle, NcclEpOp>, Error> {
        self.core.poison().check()?;
        let s = &self.shared;
        validate_handle_options(&s.config, opts)?;
        if opts.layout == Layout::RankMajor {
            return Err(Error::Unsupported(
                "the NCCL EP backend runs expert-major handles only; rank-major runs on epflow's own backends".into(),
            ));
        }
        let d = topk_idx.desc();
        check_topk_idx(&s.config, d)?;
        s.ctx.bind_to_thread().map_err(|e| cuda("bind context", e))?;
        if let Some(e) = topk_idx.ready_event() {
            e.synchronize().map_err(|e| cuda("wait for topk_idx", e))?;
        }
        let host = topk_idx.download(&s.ctx)?;
        let routing = routing_from_tensor(&s.config, d, host.as_i64().unwrap_or_default())?;
        let (b, k) = (routing.num_tokens(), routing.top_k());
        let ht = s.config.algorithm == Algorithm::HighThroughput;
        let mut t = Desc::new(ep::NCCL_INT64, topk_idx.ptr(), &[b, k]);
        let recv = if ht { Some(self.ht_recv_tensors()?) } else { None };
        let (mut counts_desc, mut total_desc) = match &recv {
            Some((c, n)) => (
                Some(Desc::new(ep::NCCL_INT32, c.ptr(), &[c.desc().shape[0]])),
                Some(Desc::new(ep::NCCL_INT32, n.ptr(), &[1])),
            ),
            None => (None, None),
        };
        let info = ep::NcclEpLayoutInfo {
            expert_counters: counts_desc.as_mut().map_or(std::ptr::null_mut(), |d| d.ptr()),
            recv_total_counter: total_desc.as_mut().map_or(std::ptr::null_mut(), |d| d.ptr()),
            ..Default::default()
        };
        let (layout, info_ptr): (_, *const ep::NcclEpLayoutInfo) =
            if ht { (ep::NCCL_EP_LAYOUT_FLAT, &info) } else { (ep::NCCL_EP_LAYOUT_EXPERT_MAJOR, std::ptr::null()) };
        let mut raw: ep::NcclEpHandle = std::ptr::null_mut();
        // SAFETY: valid out pointer; the descriptors address the `[B x K]` int64 routing and, for
        // high-throughput, the `[L]` and `[1]` int32 counters, all on this device and alive
        // until the stream is synchronized below; ordered on the rank's stream.
        let rc = unsafe {
            (s.lib.create_handle)(&mut raw, s.group, layout, t.ptr(), info_ptr, std::ptr::null(), s.raw_stream())
        };
        s.check("ncclEpCreateHandle", rc)?;
        let synced = s.stream.synchronize().map_err(|e| cuda("create handle", e));
        // NCCL EP's handle creation is collective for both algorithms; its number identifies it.
        let creation = ht.then(|| self.core.next_seq(Channel::Handle));
        let mut handle = NcclEpHandleState {
            shared: Arc::clone(&self.shared),
            raw,
            core: HandleCore::new(self.core.group_id(), routing, s.config.algorithm, creation),
            ht: None,
            _topk: topk_idx.clone(),
        };
        synced?;
        handle.ht = match recv {
            Some((counts, total)) => {
                let n = total.download(&s.ctx)?.as_i32().and_then(|v| v.first().copied()).unwrap_or(-1);
                let max = s.num_ranks * s.max_tokens;
                let num_recv = usize::try_from(n)
                    .ok()
                    .filter(|&n| n <= max)
                    .ok_or_else(|| Error::Backend(format!("NCCL EP reported {n} received rows (at most {max})")))?;
                let expert_counts = counts.download(&s.ctx)?.as_i32().unwrap_or_default().to_vec();
                handle.core.set_recv(num_recv, expert_counts);
                Some(HtRecv { counts })
            }
            None => None,
        };
        Ok(HandleCreation::Ready(NcclEpHandle(Arc::new(handle))))
    }

    fn start_dispatch(
        &self,
        h: &NcclEpHandle,
        inputs: DispatchInputs<'_, DeviceTensor>,
        opts: &DispatchOptions,
    ) -> Result<NcclEpOp, Error> {
        self.check_handle(h, opts.pass)?;
        let valid = validate_dispatch_inputs(&self.core.op_context(h), opts, &inputs)?;
        // Tokens, then (high-throughput forward) the weights: what `issue` reads.
        Ok(self.new_op(Channel::Dispatch, h, NcclEpOpKind::Dispatch { opts: *opts }, &valid.tensors()))
    }

    fn start_combine(
        &self,
        h: &NcclEpHandle,
        inputs: CombineInputs<'_, DeviceTensor>,
        opts: &CombineOptions,
    ) -> Result<NcclEpOp, Error> {
        self.check_handle(h, opts.pass)?;
        let valid = validate_combine_inputs(&self.core.op_context(h), opts, &inputs)?;
        h.0.core.combine_dispatch(opts.pass)?;
        // Expert outputs, then (low-latency) the weights: what `issue` reads.
        Ok(self.new_op(Channel::Combine, h, NcclEpOpKind::Combine, &valid.tensors()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_point_at_their_own_sizes() {
        let mut d = Desc::new(ep::NCCL_BFLOAT16, 0x1000, &[4, 7168]);
        let t = d.ptr();
        // SAFETY: `t` points into `d`, alive here.
        let t = unsafe { &*t };
        assert_eq!((t.ndim, t.data as u64, t.magic), (2, 0x1000, ep::NCCL_EP_TENSOR_MAGIC));
        // SAFETY: `sizes` points at the two sizes `d` owns.
        assert_eq!(unsafe { std::slice::from_raw_parts(t.sizes, 2) }, &[4, 7168]);
    }

    #[test]
    fn fp8_and_unbounded_high_throughput_are_refused_before_any_library_is_loaded() {
        let ht = GroupConfig::high_throughput(8, 1024);
        assert!(
            matches!(NcclEpWorld::create(&[0, 1], ht), Err(Error::Unsupported(m)) if m.contains("fixed max_tokens"))
        );
        let fp8 = GroupConfig::low_latency(8, 16, 1024)
            .with_dispatch_dtype(epflow_core::DispatchDtype::Fp8 { round_scales: false });
        assert!(matches!(NcclEpWorld::create(&[0, 1], fp8), Err(Error::Unsupported(m)) if m.contains("BF16")));
    }

    #[test]
    fn group_configs_follow_the_algorithm() {
        let ll = group_config(&GroupConfig::low_latency(256, 128, 7168), 4, 128);
        assert_eq!(
            (ll.algorithm, ll.max_dispatch_tokens_per_rank, ll.max_token_bytes),
            (ep::NCCL_EP_ALGO_LOW_LATENCY, 128, 14336)
        );
        // At least NCCL EP's own layout for E=256, M=128, H=7168: two slots of E x M combine
        // messages (2H + H/32 bytes) plus M x K received.
        assert!(ll.rdma_buffer_size as usize >= 2 * (256 + 8) * 128 * (14336 + 224));
        let ht = group_config(
            &GroupConfig::high_throughput(256, 7168).with_max_tokens(epflow_core::MaxTokens::Fixed(4096)),
            4,
            4096,
        );
        assert_eq!(
            (ht.algorithm, ht.max_dispatch_tokens_per_rank, ht.max_recv_tokens_per_rank, ht.rdma_buffer_size),
            (ep::NCCL_EP_ALGO_HIGH_THROUGHPUT, 4096, 4 * 4096, 0)
        );
    }
}
