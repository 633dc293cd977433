//! The NCCL EP backend: NVIDIA's NCCL EP (`libnccl_ep`, NCCL EP 0.1 of the NCCL 2.30 series,
//! loaded at run time through `nccl-ep-sys`) behind epflow's [`Backend`] trait, so the same
//! futures ([`crate::Group`]) drive it: the send half of an operation is `ncclEpDispatch` /
//! `ncclEpCombine` with `send_only` set, and the awaited complete half is `ncclEpComplete`.
//!
//! Scope (what NCCL EP 0.1 offers): low-latency, BF16, expert-major layout (dispatch outputs
//! `[L x R*M x H]` and the per-expert counts, as epflow's GPU backend). High-throughput and FP8
//! dispatch are refused with [`Error::Unsupported`]: NCCL EP 0.1 does not report a
//! high-throughput receive count (`recv_total_counter` is planned) and reserves the FP8 scales.
//!
//! Differences from epflow's kernels that users see:
//! - Inside an expert's rows NCCL EP keeps arrival order (not epflow's source-rank, token order),
//!   and rows of different source ranks are not packed together: read an expert's rows through
//!   the counts only when you do not rely on the order, as with NCCL EP itself.
//! - Every operation is staged on the device (send, then complete), also when awaited whole.
//! - All operations of a rank run on one stream, in call order (NCCL EP's group is one ordered
//!   communicator), so dispatch and combine of one rank never overlap each other.
//!
//! Requires `libnccl_ep.so` (`NCCL_EP_LIB`, else the library path) and the NCCL it was built
//! against first on the library path.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, sys as cuda_sys};
use epflow_core::backend::{Backend, HandleCreation, OpOutput, PendingOp, Probe};
use epflow_core::ops::{
    CombineInputs, CombineOptions, CombineOutputs, CountsLocation, DispatchInputs, DispatchOptions, DispatchOutputs,
};
use epflow_core::protocol::{Channel, Poison, SlotGuard, SlotPool};
use epflow_core::routing::Routing;
use epflow_core::validate::{
    OpContext, check_topk_idx, routing_from_tensor, validate_combine_inputs, validate_dispatch_inputs,
};
use epflow_core::{Algorithm, DType, Error, GroupConfig, TensorDesc, TensorTag, ValidationError};
use epflow_kernels::DeviceTensor;
use epflow_kernels::nccl::NcclComms;
use nccl_ep_sys as ep;

fn cuda(what: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Backend(format!("CUDA: {what}: {e:?}"))
}

/// Creates NCCL EP groups.
#[derive(Debug)]
pub struct NcclEpWorld;

impl NcclEpWorld {
    /// One process driving every device in `devices` (rank `r` on `devices[r]`): loads NCCL EP,
    /// creates an NCCL communicator per device and an NCCL EP group per rank (collective: done
    /// here, one thread per rank). `config` must be low-latency with BF16 dispatch and a fixed
    /// `max_tokens_per_rank`.
    pub fn create(devices: &[usize], config: GroupConfig) -> Result<Vec<NcclEpRank>, Error> {
        let num_ranks = devices.len();
        config.validate(num_ranks)?;
        if config.algorithm != Algorithm::LowLatency {
            return Err(Error::Unsupported(
                "the NCCL EP backend runs low-latency only: NCCL EP 0.1 cannot report a high-throughput receive \
                 count (recv_total_counter is planned)"
                    .into(),
            ));
        }
        if config.dispatch_dtype.is_fp8() {
            return Err(Error::Unsupported("NCCL EP 0.1 reserves FP8 dispatch (scales): use BF16".into()));
        }
        let max_tokens = config
            .fixed_max_tokens()
            .ok_or_else(|| Error::Unsupported("NCCL EP needs a fixed max_tokens_per_rank".into()))?;
        let lib = Arc::new(ep::NcclEp::load().map_err(|e| Error::Unsupported(format!("NCCL EP: {e}")))?);
        let comms = NcclComms::init_all(devices)?;
        std::thread::scope(|s| {
            let joins: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(rank, comms)| {
                    let (lib, config) = (Arc::clone(&lib), config.clone());
                    let device = devices[rank];
                    s.spawn(move || NcclEpRank::new(lib, comms, rank, num_ranks, device, config, max_tokens))
                })
                .collect();
            joins
                .into_iter()
                .map(|j| j.join().unwrap_or_else(|_| Err(Error::Backend("NCCL EP group creation panicked".into()))))
                .collect()
        })
    }
}

/// The staging NCCL EP gets for a low-latency group: DeepEP's low-latency layout (two buffers,
/// each a send region of `M` messages and a receive region of `E x M` messages for dispatch,
/// and as much for combine) plus an eighth for signals and alignment. NCCL EP refuses a handle
/// whose layout does not fit, naming the size it needs.
fn ll_rdma_bytes(config: &GroupConfig, max_tokens: usize) -> usize {
    let msg = 2 * config.hidden + 256;
    let per_buffer = (config.num_experts + 1) * max_tokens * msg * 2;
    let total = 2 * per_buffer;
    (total + total / 8).next_multiple_of(1 << 21)
}

/// One rank's output buffers for one buffer set.
#[derive(Debug)]
struct SetBuffers {
    tokens: DeviceTensor,
    counts: DeviceTensor,
    combined: DeviceTensor,
}

struct Shared {
    lib: Arc<ep::NcclEp>,
    rank: usize,
    num_ranks: usize,
    device: usize,
    config: GroupConfig,
    max_tokens: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    group: ep::NcclEpGroup,
    sets: Vec<SetBuffers>,
    /// The next operation (of any channel) allowed to issue: NCCL EP's group is one ordered
    /// communicator, so every rank issues in the same (call) order.
    turn: AtomicU64,
    timing: AtomicBool,
    /// Taken by the teardown thread (see `Drop`).
    comms: Option<NcclComms>,
}

// SAFETY: the NCCL EP group is used from one thread at a time (operations issue in turn order,
// handles are created and destroyed under the rank's calls); CUDA objects are thread-safe.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

/// The raw group, sent to the teardown thread.
struct GroupPtr(ep::NcclEpGroup);

// SAFETY: the group is destroyed by exactly one thread, after every use of it ended.
unsafe impl Send for GroupPtr {}

impl Drop for Shared {
    /// Destroying an NCCL EP group is collective (its buffer is an NCCL window): each rank's
    /// teardown runs on a thread of its own, so ranks dropped one after another by one thread
    /// still meet in it. The communicators are aborted after the group is gone.
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            let _ = self.stream.synchronize();
        }
        let (lib, ctx, group, comms) =
            (Arc::clone(&self.lib), Arc::clone(&self.ctx), GroupPtr(self.group), self.comms.take());
        std::thread::spawn(move || {
            let group = group;
            if ctx.bind_to_thread().is_ok() {
                // SAFETY: the group was created in `NcclEpRank::new`, is destroyed once, and no
                // operation uses it any more (every operation and handle held `Shared`).
                let _ = unsafe { (lib.group_destroy)(group.0) };
            }
            drop(comms);
        });
    }
}

impl Shared {
    fn check(&self, what: &str, r: ep::NcclResult) -> Result<(), Error> {
        if r == ep::NCCL_SUCCESS {
            Ok(())
        } else {
            Err(Error::Backend(format!("NCCL EP: {what}: {}", self.lib.error_string(r))))
        }
    }

    fn raw_stream(&self) -> ep::CudaStream {
        self.stream.cu_stream() as ep::CudaStream
    }
}

/// One rank of an NCCL EP group.
pub struct NcclEpRank {
    shared: Arc<Shared>,
    seqs: [AtomicU64; 3],
    order: AtomicU64,
    slots: [Arc<SlotPool>; 3],
    poison: Poison,
}

impl std::fmt::Debug for NcclEpRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclEpRank").field("rank", &self.shared.rank).field("device", &self.shared.device).finish()
    }
}

/// A tensor descriptor and the sizes it points to, kept together (NCCL EP reads both during
/// the calls that see the descriptor).
struct Desc {
    sizes: Box<[usize]>,
    t: ep::NcclEpTensor,
}

// SAFETY: a descriptor is plain data: device addresses and a pointer to its own boxed sizes; it
// is read only by the NCCL EP calls of the operation that owns it.
unsafe impl Send for Desc {}

impl Desc {
    fn new(dtype: ep::NcclDataType, ptr: u64, sizes: &[usize]) -> Box<Self> {
        let mut d =
            Box::new(Desc { sizes: sizes.into(), t: ep::NcclEpTensor::new(dtype, std::ptr::null_mut(), &mut []) });
        d.t = ep::NcclEpTensor::new(dtype, ptr as *mut _, &mut d.sizes);
        d
    }

    fn ptr(&mut self) -> *mut ep::NcclEpTensor {
        &mut self.t
    }
}

impl NcclEpRank {
    fn new(
        lib: Arc<ep::NcclEp>,
        comms: NcclComms,
        rank: usize,
        num_ranks: usize,
        device: usize,
        config: GroupConfig,
        max_tokens: usize,
    ) -> Result<Self, Error> {
        let ctx = CudaContext::new(device).map_err(|e| cuda("open device", e))?;
        ctx.bind_to_thread().map_err(|e| cuda("bind context", e))?;
        let stream = ctx.new_stream().map_err(|e| cuda("create stream", e))?;
        let (h, l) = (config.hidden, config.local_experts(num_ranks));
        let gc = ep::NcclEpGroupConfig {
            algorithm: ep::NCCL_EP_ALGO_LOW_LATENCY,
            num_experts: config.num_experts as u32,
            max_dispatch_tokens_per_rank: max_tokens as u32,
            max_token_bytes: (2 * h) as u32,
            // Sized up front: with NCCL_EP_AUTO the first handle creation would allocate and
            // register the buffer collectively, which blocks any rank whose peers are driven
            // from the same thread (as an async executor may).
            rdma_buffer_size: ll_rdma_bytes(&config, max_tokens) as _,
            max_num_sms: config.max_sms.map_or(ep::NCCL_EP_AUTO, |s| s as u32),
            timeout_ns: config.timeout.as_nanos() as u64 * 9 / 10,
            ..ep::NcclEpGroupConfig::default()
        };
        let mut group: ep::NcclEpGroup = std::ptr::null_mut();
        let comm = comms.comm(0)? as ep::NcclComm;
        // SAFETY: valid out pointer, a live communicator of this rank, a config initialised with
        // its size and magic; collective: every rank's thread calls it now.
        let r = unsafe { (lib.create_group)(&mut group, comm, &gc) };
        if r != ep::NCCL_SUCCESS {
            return Err(Error::Backend(format!("NCCL EP: ncclEpCreateGroup: {}", lib.error_string(r))));
        }
        let set = || -> Result<SetBuffers, Error> {
            Ok(SetBuffers {
                tokens: DeviceTensor::zeros(
                    &ctx,
                    device,
                    TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[l, num_ranks * max_tokens, h]),
                )?,
                counts: DeviceTensor::zeros(
                    &ctx,
                    device,
                    TensorDesc::contiguous(TensorTag::RecvExpertCountsDevice, DType::I32, &[l]),
                )?,
                combined: DeviceTensor::zeros(
                    &ctx,
                    device,
                    TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[max_tokens, h]),
                )?,
            })
        };
        let sets = (0..config.buffer_sets).map(|_| set()).collect::<Result<Vec<_>, _>>()?;
        let slots = Channel::ALL.map(|c| SlotPool::new(c, config.buffer_sets));
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
            }),
            seqs: Default::default(),
            order: AtomicU64::new(0),
            slots,
            poison: Poison::default(),
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

    fn ctx_for(&self, h: &NcclEpHandle) -> OpContext<'_> {
        OpContext {
            config: &self.shared.config,
            num_ranks: self.shared.num_ranks,
            num_tokens: h.0.routing.num_tokens(),
            top_k: h.0.routing.top_k(),
            num_recv: 0,
        }
    }

    fn check_handle(&self, h: &NcclEpHandle) -> Result<(), Error> {
        self.poison.check()?;
        if !Arc::ptr_eq(&h.0.shared, &self.shared) {
            return Err(Error::Unsupported("the handle belongs to another NCCL EP rank".into()));
        }
        Ok(())
    }

    fn new_op(&self, channel: Channel, h: &NcclEpHandle, work: Work, inputs: &[&DeviceTensor]) -> NcclEpOp {
        let seq = self.seqs[channel.index()].fetch_add(1, Ordering::Relaxed);
        NcclEpOp {
            shared: Arc::clone(&self.shared),
            handle: h.clone(),
            channel,
            seq,
            order: self.order.fetch_add(1, Ordering::Relaxed),
            set: (seq % self.shared.config.buffer_sets as u64) as usize,
            work,
            waits: inputs.iter().filter_map(|t| t.ready_event().cloned()).collect(),
            inputs: inputs.iter().map(|t| (*t).clone()).collect(),
            descs: Vec::new(),
            sent: false,
            cancelled: false,
            completing: false,
            slot: None,
            done: None,
            timing: None,
        }
    }
}

struct HandleInner {
    shared: Arc<Shared>,
    raw: ep::NcclEpHandle,
    routing: Routing,
    _topk: DeviceTensor,
    dispatched: AtomicBool,
}

// SAFETY: the raw handle is used only inside operations issued in turn order.
unsafe impl Send for HandleInner {}
// SAFETY: as above.
unsafe impl Sync for HandleInner {}

impl Drop for HandleInner {
    fn drop(&mut self) {
        if self.shared.ctx.bind_to_thread().is_ok() {
            let _ = self.shared.stream.synchronize();
        }
        // SAFETY: created by ncclEpCreateHandle, destroyed once; every operation using it holds
        // this value, so none is in flight.
        let _ = unsafe { (self.shared.lib.handle_destroy)(self.raw) };
    }
}

/// A routing handle of the NCCL EP backend (`ncclEpCreateHandle`, expert-major layout).
#[derive(Clone)]
pub struct NcclEpHandle(Arc<HandleInner>);

impl std::fmt::Debug for NcclEpHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclEpHandle").field("tokens", &self.0.routing.num_tokens()).finish()
    }
}

/// Dispatch outputs: `[L x R*M x H]` BF16 tokens (arrival order inside an expert, see the module
/// docs) and `[L]` counts, views into the buffer set they hold until dropped.
#[derive(Debug)]
pub struct NcclEpDispatchOutput {
    outputs: DispatchOutputs<DeviceTensor>,
    host_counts: Option<Vec<i32>>,
    elapsed: Option<(Duration, Duration)>,
    _slot: Option<SlotGuard>,
}

impl NcclEpDispatchOutput {
    /// The received tokens `[L x R*M x H]`.
    pub fn tokens(&self) -> &DeviceTensor {
        &self.outputs.tokens
    }
    /// Rows per local expert `[L]`, on the device.
    pub fn counts(&self) -> Option<&DeviceTensor> {
        self.outputs.counts.as_ref()
    }
    /// The counts on the host, when asked for with [`CountsLocation::Host`].
    pub fn host_counts(&self) -> Option<&[i32]> {
        self.host_counts.as_deref()
    }
    /// All outputs.
    pub fn outputs(&self) -> &DispatchOutputs<DeviceTensor> {
        &self.outputs
    }
    /// (send half, complete half) device time, with timing on.
    pub fn elapsed_halves(&self) -> Option<(Duration, Duration)> {
        self.elapsed
    }
}

/// Combine outputs: `[B x H]` BF16, a view into the buffer set it holds until dropped.
#[derive(Debug)]
pub struct NcclEpCombineOutput {
    outputs: CombineOutputs<DeviceTensor>,
    elapsed: Option<(Duration, Duration)>,
    _slot: Option<SlotGuard>,
}

impl NcclEpCombineOutput {
    /// The combined tokens `[B x H]`.
    pub fn tokens(&self) -> &DeviceTensor {
        &self.outputs.tokens
    }
    /// (send half, complete half) device time, with timing on.
    pub fn elapsed_halves(&self) -> Option<(Duration, Duration)> {
        self.elapsed
    }
}

enum Work {
    Dispatch { opts: DispatchOptions },
    Combine,
}

/// One NCCL EP operation: `send` issues the `send_only` call, `start_complete` `ncclEpComplete`,
/// and a CUDA event after it is the completion.
pub struct NcclEpOp {
    shared: Arc<Shared>,
    handle: NcclEpHandle,
    channel: Channel,
    seq: u64,
    order: u64,
    set: usize,
    work: Work,
    waits: Vec<Arc<CudaEvent>>,
    inputs: Vec<DeviceTensor>,
    /// Boxed so the descriptors NCCL EP saw keep their addresses until `ncclEpComplete`.
    #[allow(clippy::vec_box)]
    descs: Vec<Box<Desc>>,
    sent: bool,
    cancelled: bool,
    completing: bool,
    slot: Option<SlotGuard>,
    done: Option<Arc<CudaEvent>>,
    timing: Option<(CudaEvent, CudaEvent, CudaEvent)>,
}

/// The output of an NCCL EP operation.
pub type NcclEpOpOutput = OpOutput<NcclEpHandle, NcclEpDispatchOutput, NcclEpCombineOutput>;

impl NcclEpOp {
    fn event(&self) -> Result<CudaEvent, Error> {
        self.shared.ctx.new_event(Some(cuda_sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| cuda("create event", e))
    }

    fn elapsed(&self) -> Option<(Duration, Duration)> {
        let (a, m, b) = self.timing.as_ref()?;
        let d =
            |x: &CudaEvent, y: &CudaEvent| x.elapsed_ms(y).ok().map(|ms| Duration::from_secs_f64(f64::from(ms) / 1e3));
        Some((d(a, m)?, d(m, b)?))
    }

    /// Issues the `send_only` dispatch or combine.
    fn issue(&mut self) -> Result<(), Error> {
        let s = Arc::clone(&self.shared);
        let (h, l, m, r) = (s.config.hidden, s.config.local_experts(s.num_ranks), s.max_tokens, s.num_ranks);
        let b = self.handle.0.routing.num_tokens();
        let k = self.handle.0.routing.top_k();
        let set = &s.sets[self.set];
        let raw = self.handle.0.raw;
        match self.work {
            Work::Dispatch { .. } => {
                let mut x = Desc::new(ep::NCCL_BFLOAT16, self.inputs[0].ptr(), &[b, h]);
                let mut out = Desc::new(ep::NCCL_BFLOAT16, set.tokens.ptr(), &[l, r * m, h]);
                let mut counts = Desc::new(ep::NCCL_INT32, set.counts.ptr(), &[l]);
                let inputs = ep::NcclEpDispatchInputs { tokens: x.ptr(), ..Default::default() };
                let outputs = ep::NcclEpDispatchOutputs { tokens: out.ptr(), ..Default::default() };
                let info = ep::NcclEpLayoutInfo { expert_counters: counts.ptr(), ..Default::default() };
                let cfg = ep::NcclEpDispatchConfig { send_only: 1, ..Default::default() };
                // SAFETY: every descriptor addresses live device memory of this rank with the sizes
                // given (inputs kept by this operation, outputs in its buffer set, held by its
                // slot); the structs carry their size and magic; ordered on the rank's stream.
                let rc = unsafe { (s.lib.dispatch)(raw, &inputs, &outputs, &info, &cfg, s.raw_stream()) };
                self.descs.extend([x, out, counts]);
                s.check("ncclEpDispatch", rc)
            }
            Work::Combine => {
                let mut x = Desc::new(ep::NCCL_BFLOAT16, self.inputs[0].ptr(), &[l, r * m, h]);
                let mut w = Desc::new(ep::NCCL_FLOAT32, self.inputs[1].ptr(), &[b, k]);
                let mut out = Desc::new(ep::NCCL_BFLOAT16, set.combined.ptr(), &[b, h]);
                let inputs = ep::NcclEpCombineInputs { tokens: x.ptr(), ..Default::default() };
                let outputs =
                    ep::NcclEpCombineOutputs { tokens: out.ptr(), topk_weights: w.ptr(), ..Default::default() };
                let cfg = ep::NcclEpCombineConfig { send_only: 1, ..Default::default() };
                // SAFETY: as for dispatch.
                let rc = unsafe { (s.lib.combine)(raw, &inputs, &outputs, &cfg, s.raw_stream()) };
                self.descs.extend([x, w, out]);
                s.check("ncclEpCombine", rc)
            }
        }
    }

    fn finish_dispatch(&mut self, opts: DispatchOptions) -> Result<NcclEpDispatchOutput, Error> {
        let s = &self.shared;
        let set = &s.sets[self.set];
        let host_counts = if opts.counts_location == CountsLocation::Host {
            let h = set.counts.download(&s.ctx)?;
            Some(h.as_i32().unwrap_or_default().to_vec())
        } else {
            None
        };
        self.handle.0.dispatched.store(true, Ordering::Release);
        Ok(NcclEpDispatchOutput {
            outputs: DispatchOutputs {
                tokens: set.tokens.clone(),
                scales: None,
                topk_weights: None,
                topk_idx: None,
                counts: Some(set.counts.clone()),
            },
            host_counts,
            elapsed: self.elapsed(),
            _slot: self.slot.take(),
        })
    }

    fn finish_combine(&mut self) -> Result<NcclEpCombineOutput, Error> {
        let s = &self.shared;
        let b = self.handle.0.routing.num_tokens();
        let desc = TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[b, s.config.hidden]);
        // SAFETY: the first `b` rows of the set's `[M x H]` buffer, alive as long as the rank; the
        // output holds the buffer set's slot, as the GPU backend's outputs do.
        let tokens = unsafe { DeviceTensor::from_raw(s.sets[self.set].combined.ptr(), s.device, desc) };
        Ok(NcclEpCombineOutput {
            outputs: CombineOutputs { tokens, topk_weights: None },
            elapsed: self.elapsed(),
            _slot: self.slot.take(),
        })
    }
}

impl Drop for NcclEpOp {
    /// An operation dropped unfinished (an error path) waits for its device work, bounded by
    /// NCCL EP's own device timeout, so nothing it uses is freed under a kernel.
    fn drop(&mut self) {
        if self.sent && self.shared.ctx.bind_to_thread().is_ok() {
            let _ = self.shared.stream.synchronize();
        }
    }
}

impl PendingOp for NcclEpOp {
    type Output = NcclEpOpOutput;

    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn channel(&self) -> Channel {
        self.channel
    }

    fn seq(&self) -> u64 {
        self.seq
    }

    fn needs_slot(&self) -> bool {
        true
    }

    fn poll_send_ready(&mut self) -> Result<bool, Error> {
        Ok(self.sent || self.shared.turn.load(Ordering::Acquire) == self.order)
    }

    fn send(&mut self, slot: Option<SlotGuard>) -> Result<(), Error> {
        if self.sent {
            return Ok(());
        }
        let s = Arc::clone(&self.shared);
        s.ctx.bind_to_thread().map_err(|e| cuda("bind context", e))?;
        let result: Result<(), Error> = (|| {
            for e in &self.waits {
                s.stream.wait(e).map_err(|e| cuda("wait for an input", e))?;
            }
            if s.timing.load(Ordering::Relaxed) {
                let (a, m, b) = (self.event()?, self.event()?, self.event()?);
                a.record(&s.stream).map_err(|e| cuda("record event", e))?;
                self.timing = Some((a, m, b));
            }
            // A cancelled operation still runs: NCCL EP has no cancellation marker, and the peers
            // wait for this rank's messages. Its inputs are still alive (held by the operation).
            self.issue()?;
            if let Some((_, m, _)) = &self.timing {
                m.record(&s.stream).map_err(|e| cuda("record event", e))?;
            }
            Ok(())
        })();
        s.turn.store(self.order + 1, Ordering::Release);
        result?;
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
        }
    }

    fn start_complete(&mut self) -> Result<(), Error> {
        if self.completing {
            return Ok(());
        }
        let s = Arc::clone(&self.shared);
        s.ctx.bind_to_thread().map_err(|e| cuda("bind context", e))?;
        let cfg = ep::NcclEpCompleteConfig::default();
        // SAFETY: completes the staged operation this handle just issued, on the same stream; the
        // descriptors it saw are still held by this operation.
        let rc = unsafe { (s.lib.complete)(self.handle.0.raw, &cfg, s.raw_stream()) };
        s.check("ncclEpComplete", rc)?;
        if let Some((_, _, b)) = &self.timing {
            b.record(&s.stream).map_err(|e| cuda("record event", e))?;
        }
        let done = s.ctx.new_event(None).map_err(|e| cuda("create event", e))?;
        done.record(&s.stream).map_err(|e| cuda("record event", e))?;
        self.done = Some(Arc::new(done));
        self.completing = true;
        Ok(())
    }

    fn poll_complete(&mut self) -> Result<bool, Error> {
        let Some(done) = &self.done else { return Ok(false) };
        self.shared.ctx.bind_to_thread().map_err(|e| cuda("bind context", e))?;
        done.try_is_complete().map_err(|e| cuda("query completion", e))
    }

    fn finish(mut self) -> Result<NcclEpOpOutput, Error> {
        if self.cancelled {
            return Ok(OpOutput::Cancelled);
        }
        match self.work {
            Work::Dispatch { opts } => Ok(OpOutput::Dispatch(self.finish_dispatch(opts)?)),
            Work::Combine => Ok(OpOutput::Combine(self.finish_combine()?)),
        }
    }

    fn send_probe(&self) -> Box<dyn Probe> {
        let (shared, order) = (Arc::clone(&self.shared), self.order);
        Box::new(move || shared.turn.load(Ordering::Acquire) == order)
    }

    fn complete_probe(&self) -> Box<dyn Probe> {
        let (ctx, done) = (Arc::clone(&self.shared.ctx), self.done.clone());
        Box::new(move || match &done {
            Some(e) => ctx.bind_to_thread().is_err() || e.try_is_complete().unwrap_or(true),
            None => true,
        })
    }

    fn traffic(&self) -> (u64, u64) {
        let b = self.handle.0.routing.num_tokens() as u64;
        (b * self.shared.config.hidden as u64 * 2, b)
    }

    fn waiting_for(&self) -> String {
        if self.sent {
            "NCCL EP to complete (the peers' data)".into()
        } else {
            "its turn to send (an earlier operation of this rank has not been sent yet)".into()
        }
    }
}

impl Backend for NcclEpRank {
    type Tensor = DeviceTensor;
    type Handle = NcclEpHandle;
    type DispatchOutput = NcclEpDispatchOutput;
    type CombineOutput = NcclEpCombineOutput;
    type Op = NcclEpOp;

    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn num_ranks(&self) -> usize {
        self.shared.num_ranks
    }

    fn config(&self) -> &GroupConfig {
        &self.shared.config
    }

    fn poison(&self) -> &Poison {
        &self.poison
    }

    fn slot_pool(&self, channel: Channel) -> &Arc<SlotPool> {
        &self.slots[channel.index()]
    }

    /// `ncclEpCreateHandle` (expert-major layout) on the rank's stream; it may be collective,
    /// so every rank creates its handles in the same order.
    fn start_handle(&self, topk_idx: &DeviceTensor) -> Result<HandleCreation<NcclEpHandle, NcclEpOp>, Error> {
        self.poison.check()?;
        let s = &self.shared;
        let d = topk_idx.desc();
        check_topk_idx(&s.config, d)?;
        s.ctx.bind_to_thread().map_err(|e| cuda("bind context", e))?;
        if let Some(e) = topk_idx.ready_event() {
            e.synchronize().map_err(|e| cuda("wait for topk_idx", e))?;
        }
        let host = topk_idx.download(&s.ctx)?;
        let routing = routing_from_tensor(&s.config, d, host.as_i64().unwrap_or_default())?;
        let (b, k) = (routing.num_tokens(), routing.top_k());
        let mut t = Desc::new(ep::NCCL_INT64, topk_idx.ptr(), &[b, k]);
        let mut raw: ep::NcclEpHandle = std::ptr::null_mut();
        // SAFETY: valid out pointer; the descriptor addresses the `[B x K]` int64 routing on this
        // device; ordered on the rank's stream, which is synchronized before returning.
        let rc = unsafe {
            (s.lib.create_handle)(
                &mut raw,
                s.group,
                ep::NCCL_EP_LAYOUT_EXPERT_MAJOR,
                t.ptr(),
                std::ptr::null(),
                std::ptr::null(),
                s.raw_stream(),
            )
        };
        s.check("ncclEpCreateHandle", rc)?;
        s.stream.synchronize().map_err(|e| cuda("create handle", e))?;
        Ok(HandleCreation::Ready(NcclEpHandle(Arc::new(HandleInner {
            shared: Arc::clone(&self.shared),
            raw,
            routing,
            _topk: topk_idx.clone(),
            dispatched: AtomicBool::new(false),
        }))))
    }

    fn start_dispatch(
        &self,
        h: &NcclEpHandle,
        inputs: DispatchInputs<'_, DeviceTensor>,
        opts: &DispatchOptions,
    ) -> Result<NcclEpOp, Error> {
        self.check_handle(h)?;
        validate_dispatch_inputs(&self.ctx_for(h), opts, &inputs)?;
        Ok(self.new_op(Channel::Dispatch, h, Work::Dispatch { opts: *opts }, &[inputs.tokens]))
    }

    fn start_combine(
        &self,
        h: &NcclEpHandle,
        inputs: CombineInputs<'_, DeviceTensor>,
        opts: &CombineOptions,
    ) -> Result<NcclEpOp, Error> {
        self.check_handle(h)?;
        validate_combine_inputs(&self.ctx_for(h), opts, &inputs)?;
        if !h.0.dispatched.load(Ordering::Acquire) {
            return Err(ValidationError::CombineBeforeDispatch.into());
        }
        let weights = inputs.topk_weights.ok_or(ValidationError::CombineBeforeDispatch)?;
        Ok(self.new_op(Channel::Combine, h, Work::Combine, &[inputs.tokens, weights]))
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
    fn high_throughput_and_fp8_are_refused_before_any_library_is_loaded() {
        let ht = GroupConfig::high_throughput(8, 1024);
        assert!(matches!(NcclEpWorld::create(&[0, 1], ht), Err(Error::Unsupported(m)) if m.contains("low-latency")));
        let fp8 = GroupConfig::low_latency(8, 16, 1024)
            .with_dispatch_dtype(epflow_core::DispatchDtype::Fp8 { round_scales: false });
        assert!(matches!(NcclEpWorld::create(&[0, 1], fp8), Err(Error::Unsupported(m)) if m.contains("FP8")));
    }
}
