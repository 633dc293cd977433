//! `ncclEpGroup_t`: an epflow GPU rank joined over the caller's communicator, what the group
//! config fixed, and the operations still in flight (their verdicts are read once the device
//! is done with them, which also frees their buffer sets).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use epflow_core::backend::{Backend, PendingOp};
use epflow_core::protocol::Channel;
use epflow_core::{Algorithm, DispatchDtype, Error, GroupConfig, MaxTokens};
use epflow_kernels::setup::bootstrap::Bootstrap;
use epflow_kernels::{DeviceNumbering, GpuOp, GpuRank, GpuWorld, Transport};
use nccl_ep_sys as ep;

use crate::comm::CallerComm;
use crate::mask::{self, MaskFlag};
use crate::profile::Profile;
use crate::status::{Fail, Res, warn};
use crate::v2;

/// What `ncclEpCreateGroup` fixed, checked against every later call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    /// Low-latency or high-throughput.
    pub(crate) algorithm: Algorithm,
    /// `E`.
    pub(crate) num_experts: usize,
    /// `L = E / R`.
    pub(crate) local_experts: usize,
    /// `R`.
    pub(crate) num_ranks: usize,
    /// This rank.
    pub(crate) rank: usize,
    /// `M`: most tokens a rank dispatches.
    pub(crate) max_tokens: usize,
    /// High-throughput: the receive rows a flat dispatch output must have room for.
    pub(crate) max_recv: usize,
    /// High-throughput: `max_recv_tokens_per_rank` was API v2's `NCCL_EP_AUTO` (eager: NCCL EP's
    /// callers size their outputs by each routing's receive count).
    pub(crate) max_recv_auto: bool,
    /// `H`: `max_token_bytes / 2` (BF16 tokens).
    pub(crate) hidden: usize,
    /// API v2's `num_topk`: the most top-k any handle of the group may have (`None`: unset).
    pub(crate) num_topk: Option<usize>,
    /// API v2's `overflow_policy` DROP: a high-throughput flat handle keeps the first
    /// `max_recv` rows of a routing that sends it more (`overflow.rs`); low-latency buffers hold
    /// every row a routing can send, so nothing is ever dropped there.
    pub(crate) drop_overflow: bool,
}

impl Shape {
    /// Refuses a handle's top-k above the config's `num_topk` (API v2), as NCCL EP does.
    pub(crate) fn check_top_k(&self, k: usize) -> Res<()> {
        match self.num_topk {
            Some(bound) if k > bound => {
                Err(Fail::usage(format!("num_topk {k} is above the group config's num_topk ({bound})")))
            }
            _ => Ok(()),
        }
    }
}

/// The caller's tensor `t` as a device tensor of `desc` on `g`'s device (only `desc`'s bytes
/// are used: the leading rows of a larger tensor).
pub(crate) fn device(
    g: &Group,
    t: &crate::check::Tensor,
    desc: epflow_core::TensorDesc,
) -> epflow_kernels::DeviceTensor {
    // SAFETY: every caller checked that `t` holds at least `desc`'s elements of its type; the
    // memory is the caller's, valid until the operation completes (nccl_ep.h's contract).
    unsafe { epflow_kernels::DeviceTensor::from_raw(t.ptr, g.rank.device(), desc) }
}

/// One rank's group.
pub(crate) struct Group {
    pub(crate) rank: GpuRank,
    pub(crate) shape: Shape,
    comm: CallerComm,
    /// Operations issued and not yet settled, oldest first.
    in_flight: Mutex<VecDeque<GpuOp>>,
    /// `ncclEpErrorClear` was called after the group failed.
    error_cleared: AtomicBool,
    /// The error already logged.
    error_logged: AtomicBool,
    /// `ncclEpGroupDestroy` ran: the handles still holding the group refuse every call.
    destroyed: AtomicBool,
    /// With `enable_mask`: the asynchronous error flag of masking ([`MaskFlag`]).
    mask_flag: Mutex<MaskFlag>,
    /// Host time per phase of low-latency calls (`EPFLOW_ABI_PROFILE=1`).
    pub(crate) profile: Profile,
    /// Low-latency: the device numbering its calls switch to once one is captured into a CUDA
    /// graph (`capture.rs`), or why the group cannot (high-throughput, NCCL peers, masking).
    pub(crate) numbering: Result<Arc<DeviceNumbering>, String>,
    /// Eager send-only operations waiting for `ncclEpComplete` (a capture cannot start then).
    pub(crate) eager_staged: AtomicUsize,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group").field("shape", &self.shape).finish_non_exhaustive()
    }
}

/// The `ncclEpGroupConfig_t.version`s this library implements: NCCL EP's API versions whose
/// features it knows.
pub(crate) const API_VERSIONS: &[std::ffi::c_uint] = &[ep::NCCL_EP_API_VERSION, v2::API_VERSION];

/// Refuses a `config.version` this library does not implement with `ncclInvalidArgument`.
/// NVIDIA's library only warns on a mismatch; epflow refuses it, since a version it does not
/// know may ask for features it would otherwise silently ignore (and 0 or a stray value means
/// the config was not made with `NCCL_EP_GROUP_CONFIG_INIT`).
fn check_version(version: std::ffi::c_uint) -> Res<()> {
    if API_VERSIONS.contains(&version) {
        return Ok(());
    }
    Err(Fail::arg(format!(
        "config.version is {version}, this library implements NCCL EP API version(s) {API_VERSIONS:?}: \
         initialise the config with NCCL_EP_GROUP_CONFIG_INIT of a matching nccl_ep.h"
    )))
}

/// The epflow config of an NCCL EP group config (checked).
fn group_config(read: &v2::GroupConfig, num_ranks: usize) -> Res<(GroupConfig, Shape)> {
    let c = &read.v1;
    check_version(c.version)?;
    let fields = read.check_v2_fields(epflow_core::config::MAX_TOP_K)?;
    let v2_size = c.size as usize >= std::mem::size_of::<v2::GroupConfig>();
    let algorithm = match c.algorithm {
        ep::NCCL_EP_ALGO_LOW_LATENCY => Algorithm::LowLatency,
        ep::NCCL_EP_ALGO_HIGH_THROUGHPUT => Algorithm::HighThroughput,
        a => return Err(Fail::arg(format!("config.algorithm is {a}, not LOW_LATENCY (0) or HIGH_THROUGHPUT (1)"))),
    };
    if c.num_experts == 0 {
        return Err(Fail::arg("config.num_experts is 0"));
    }
    if c.max_dispatch_tokens_per_rank == ep::NCCL_EP_AUTO {
        return Err(Fail::usage(
            "config.max_dispatch_tokens_per_rank is NCCL_EP_AUTO: give a bound (NCCL EP 0.1 requires one too)",
        ));
    }
    if c.max_token_bytes == 0 || c.max_token_bytes % 2 != 0 {
        return Err(Fail::arg(format!(
            "config.max_token_bytes is {}: it must be hidden * 2 (BF16 tokens)",
            c.max_token_bytes
        )));
    }
    // Both or neither (the allocator itself is built by `Group::create`).
    crate::alloc::caller_allocator(&c.alloc)?;
    if c.enable_mask != 0 && algorithm != Algorithm::LowLatency {
        return Err(Fail::usage("config.enable_mask: rank masking is for low-latency groups (as in NCCL EP)"));
    }
    let hidden = c.max_token_bytes as usize / 2;
    let max_tokens = c.max_dispatch_tokens_per_rank as usize;
    let timeout = match epflow_core::tuning::Environment::get().abi_timeout_ms {
        Some(ms) => Duration::from_millis(ms),
        _ if c.timeout_ns > 0 => Duration::from_nanos(c.timeout_ns),
        _ => epflow_core::config::DEFAULT_TIMEOUT,
    };
    let max_sms = (c.max_num_sms != ep::NCCL_EP_AUTO).then_some(c.max_num_sms as usize);
    let config = match algorithm {
        Algorithm::LowLatency => GroupConfig::low_latency(c.num_experts as usize, max_tokens, hidden),
        Algorithm::HighThroughput => {
            GroupConfig::high_throughput(c.num_experts as usize, hidden).with_max_tokens(MaxTokens::Fixed(max_tokens))
        }
    }
    .with_dispatch_dtype(DispatchDtype::Bf16)
    .with_max_top_k(epflow_core::config::MAX_TOP_K)
    .with_max_sms(max_sms)
    .with_timeout(timeout)
    .with_rank_masking(c.enable_mask != 0)
    // NCCL EP's callers pass every output tensor: the group keeps no dispatch output sets.
    .with_caller_outputs(true);
    let max_recv = match (algorithm, c.max_recv_tokens_per_rank) {
        // v2's NCCL_EP_AUTO: the bound no routing can pass, R x max_dispatch_tokens_per_rank
        // (a token reaches a rank at most once). epflow's high-throughput outputs are sized by
        // the rows each handle receives, so the bound reserves nothing.
        (Algorithm::HighThroughput, 0) if v2_size => num_ranks * max_tokens,
        (Algorithm::HighThroughput, 0) => {
            return Err(Fail::arg("config.max_recv_tokens_per_rank is 0: high-throughput groups need it"));
        }
        (Algorithm::HighThroughput, m) if (m as usize) < max_tokens => {
            return Err(Fail::arg(format!(
                "config.max_recv_tokens_per_rank ({m}) is below max_dispatch_tokens_per_rank ({max_tokens})"
            )));
        }
        (_, 0) => num_ranks * max_tokens,
        (_, m) => m as usize,
    };
    config.validate(num_ranks).map_err(|e| Fail::usage(e.to_string()))?;
    let local_experts = config.local_experts(num_ranks);
    let shape = Shape {
        algorithm,
        num_experts: c.num_experts as usize,
        local_experts,
        num_ranks,
        rank: 0,
        max_tokens,
        max_recv,
        max_recv_auto: algorithm == Algorithm::HighThroughput && c.max_recv_tokens_per_rank == 0,
        hidden,
        num_topk: fields.num_topk,
        drop_overflow: fields.drop_overflow,
    };
    Ok((config, shape))
}

impl Group {
    /// `ncclEpCreateGroup` (collective over `comm`).
    pub(crate) fn create(comm: ep::NcclComm, c: &v2::GroupConfig) -> Res<Arc<Self>> {
        // Refuse a bad config before anything is loaded, and a machine without a GPU before the
        // communicator is touched.
        group_config(c, 1)?;
        if !epflow_kernels::device::driver_present() || epflow_kernels::device_count() == 0 {
            return Err(Fail::usage(
                "no CUDA GPU on this machine (the CUDA driver is not installed or sees no device)",
            ));
        }
        let comm = CallerComm::new(comm)?;
        let (config, mut shape) = group_config(c, comm.world_size())?;
        shape.rank = comm.rank();
        // The config's alloc_fn / free_fn serve the rank's local scratch (`alloc.rs`).
        let allocator = crate::alloc::caller_allocator(&c.v1.alloc)?;
        let rank = GpuWorld::join_over_with_allocator(&comm, config, Transport::Auto, allocator)?;
        let numbering = rank.device_numbering().map_err(|e| e.to_string());
        Ok(Arc::new(Group {
            rank,
            shape,
            comm,
            in_flight: Mutex::new(VecDeque::new()),
            error_cleared: AtomicBool::new(false),
            error_logged: AtomicBool::new(false),
            destroyed: AtomicBool::new(false),
            mask_flag: Mutex::new(MaskFlag::default()),
            profile: Profile::from_env(),
            numbering,
            eager_staged: AtomicUsize::new(0),
        }))
    }

    /// Marks the group destroyed (`ncclEpGroupDestroy`).
    pub(crate) fn mark_destroyed(&self) {
        self.destroyed.store(true, Ordering::Release);
    }

    /// `ncclInvalidArgument` once `ncclEpGroupDestroy` ran: a handle of the group is unusable.
    pub(crate) fn check_not_destroyed(&self) -> Res<()> {
        if self.destroyed.load(Ordering::Acquire) {
            return Err(Fail::arg(
                "the handle's ep_group was destroyed (ncclEpGroupDestroy); destroy its handles first",
            ));
        }
        Ok(())
    }

    /// The group's timeout.
    pub(crate) fn timeout(&self) -> Duration {
        self.rank.core().config().timeout
    }

    /// The caller's stream as a stream of this rank's context.
    ///
    /// # Safety
    ///
    /// `stream` is null (the legacy default stream) or a live stream of this rank's device.
    pub(crate) unsafe fn stream(&self, stream: ep::CudaStream) -> Arc<CudaStream> {
        // SAFETY: the caller's contract; the caller keeps the stream alive while it uses the API.
        unsafe { self.rank.context().wrap_borrowed_stream(stream as cudarc::driver::sys::CUstream) }
    }

    /// Fails fast once the group failed (a timeout, a failed peer), with the first reason.
    pub(crate) fn check(&self) -> Res<()> {
        self.settle(false)?;
        self.check_poisoned()
    }

    /// [`Group::check`] without reading earlier operations' verdicts (cheap: for the path to a
    /// launch; call [`Group::settle`] after it).
    pub(crate) fn check_poisoned(&self) -> Res<()> {
        self.rank.core().poison().check().map_err(Fail::from)
    }

    /// Keeps an issued operation until its verdict is read.
    pub(crate) fn track(&self, op: GpuOp) {
        self.in_flight.lock().unwrap_or_else(|e| e.into_inner()).push_back(op);
    }

    /// Reads the verdicts of the operations the device has finished; with `all`, waits (each
    /// bounded by the group's timeout) until every one has. An operation's verdict failing
    /// fails the group (later calls return the error).
    pub(crate) fn settle(&self, all: bool) -> Res<()> {
        let mut q = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(op) = q.front_mut() {
            if !op_done(op, all.then(|| self.timeout()))? {
                break;
            }
            if let Some(mut op) = q.pop_front() {
                if let Err(e) = op.verdict() {
                    self.rank.core().poison().poison(e.to_string());
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }

    /// Waits until fewer than `sets` operations of `channel` are in flight, so the buffer set
    /// the next one takes is free.
    pub(crate) fn make_room(&self, channel: Channel) -> Res<()> {
        let sets = self.rank.core().config().buffer_sets;
        loop {
            let busy = {
                let q = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
                q.iter().filter(|op| op.id().channel == channel).count()
            };
            if busy < sets {
                return Ok(());
            }
            let mut q = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(op) = q.front_mut() {
                op_done(op, Some(self.timeout()))?;
            }
            drop(q);
            self.settle(false)?;
        }
    }

    /// `ncclEpGetAsyncError`: 1 once the group failed (and `ncclEpErrorClear` was not called
    /// since), or, with `enable_mask`, once a timeout masked a rank (until `ncclEpErrorClear`);
    /// else 0.
    pub(crate) fn async_error(&self) -> i32 {
        let _ = self.settle(false);
        let failed = self.rank.core().poison().is_poisoned();
        if failed && !self.error_logged.swap(true, Ordering::Relaxed) {
            if let Err(e) = self.rank.core().poison().check() {
                warn(&format!("the group failed: {e}"));
            }
        }
        let masked = self.masking() && self.flag().poll(&self.rank.masked_ranks().ranks);
        i32::from((failed && !self.error_cleared.load(Ordering::Relaxed)) || masked)
    }

    /// `ncclEpErrorClear`: re-arms the flag (a failed group stays failed; masked ranks stay
    /// masked).
    pub(crate) fn clear_error(&self) {
        self.error_cleared.store(true, Ordering::Relaxed);
        if self.masking() {
            self.flag().clear(&self.rank.masked_ranks().ranks);
        }
    }

    fn flag(&self) -> std::sync::MutexGuard<'_, MaskFlag> {
        self.mask_flag.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the group was created with `enable_mask`.
    pub(crate) fn masking(&self) -> bool {
        self.rank.core().config().rank_masking
    }

    /// Refuses a mask call on a group without `enable_mask`.
    pub(crate) fn require_masking(&self, what: &str) -> Res<()> {
        if self.masking() {
            Ok(())
        } else {
            Err(Fail::usage(format!("{what}: the group was created with enable_mask = 0")))
        }
    }

    /// `ncclEpMaskQuery`'s values: per rank, 1 active, 0 masked (this rank's view).
    pub(crate) fn mask_status(&self) -> Vec<i32> {
        mask::status_of(&self.rank.masked_ranks().ranks, self.shape.num_ranks)
    }

    /// `ncclEpMaskUpdate`: masks the ranks at 0 on every rank ([`mask::ranks_to_mask`]).
    pub(crate) fn mask_update(&self, update: &[i32]) -> Res<()> {
        let ranks = mask::ranks_to_mask(update, &self.rank.masked_ranks().ranks)?;
        if !ranks.is_empty() {
            self.flag().masked_by_update(&ranks);
            self.rank.mask_ranks(&ranks)?;
        }
        Ok(())
    }

    /// `ncclEpMaskClean`: waits for this rank's operations, then epflow's `unmask_all` (a
    /// collective of every rank, the masked ones included; bounded by the group's timeout).
    pub(crate) fn mask_clean(&self) -> Res<()> {
        self.settle(true)?;
        self.rank.unmask_all()?;
        self.flag().cleaned();
        Ok(())
    }

    /// `ncclEpGroupDestroy`: waits for every operation, then for every rank (collective), so no
    /// peer still reads this rank's memory when it is freed.
    pub(crate) fn shut_down(&self) -> Res<()> {
        let stamps = self.profile.write_stamps(self.shape.rank);
        for line in self.profile.report().into_iter().chain(epflow_kernels::device::host_steps::report()).chain(stamps)
        {
            eprintln!("NCCL EP (epflow) PROFILE rank {}: {line}", self.shape.rank);
        }
        let settled = self.settle(true);
        let barrier = self.comm.all_gather_bytes(&[1]);
        settled?;
        barrier.map(|_| ()).map_err(Fail::from)
    }
}

/// Whether `op`'s device work is done; with `wait`, polls until it is (at most `wait`).
fn op_done(op: &mut GpuOp, wait: Option<Duration>) -> Res<bool> {
    let deadline = wait.map(|w| Instant::now() + w);
    loop {
        match op.poll_complete() {
            Ok(true) => return Ok(true),
            Ok(false) => {}
            Err(e) => return Err(e.into()),
        }
        match deadline {
            None => return Ok(false),
            Some(d) if Instant::now() >= d => {
                let e = Error::Timeout {
                    op: op.label(),
                    rank: op.id().rank,
                    waiting_for: op.waiting_for(),
                    after: wait.unwrap_or_default(),
                };
                return Err(e.into());
            }
            Some(_) => std::thread::sleep(Duration::from_micros(20)),
        }
    }
}

impl crate::window::WindowBase for Group {
    fn window_base(&self, win: ep::NcclWindow) -> Res<u64> {
        self.comm.window_base(win)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ll() -> ep::NcclEpGroupConfig {
        ep::NcclEpGroupConfig {
            num_experts: 16,
            max_dispatch_tokens_per_rank: 128,
            max_token_bytes: 7168 * 2,
            ..Default::default()
        }
    }

    #[test]
    fn configs_map_to_epflow_groups() {
        let (config, shape) = group_config(&v2::GroupConfig::from_v1(ll()), 2).unwrap();
        assert_eq!((config.hidden, config.num_experts, shape.local_experts, shape.max_recv), (7168, 16, 8, 256));
        assert!(config.caller_outputs, "NCCL EP's outputs are the caller's: the group keeps none");
        let ht = ep::NcclEpGroupConfig {
            algorithm: ep::NCCL_EP_ALGO_HIGH_THROUGHPUT,
            max_recv_tokens_per_rank: 4096,
            ..ll()
        };
        let (config, shape) = group_config(&v2::GroupConfig::from_v1(ht), 2).unwrap();
        assert_eq!((config.algorithm, shape.max_recv), (Algorithm::HighThroughput, 4096));
        assert!(!config.rank_masking);
        let (config, _) =
            group_config(&v2::GroupConfig::from_v1(ep::NcclEpGroupConfig { enable_mask: 1, ..ll() }), 2).unwrap();
        assert!(config.rank_masking, "enable_mask makes a group with rank masking");
    }

    #[test]
    fn bad_configs_are_refused_with_the_nccl_code() {
        let code = |c: ep::NcclEpGroupConfig| group_config(&v2::GroupConfig::from_v1(c), 2).unwrap_err().code;
        assert_eq!(code(ep::NcclEpGroupConfig { algorithm: 7, ..ll() }), ep::NCCL_INVALID_ARGUMENT);
        for version in [0, 3, 99, u32::MAX] {
            let e = group_config(&v2::GroupConfig::from_v1(ep::NcclEpGroupConfig { version, ..ll() }), 2).unwrap_err();
            assert_eq!(e.code, ep::NCCL_INVALID_ARGUMENT, "version {version}");
            assert!(e.message.contains(&format!("config.version is {version}")), "{}", e.message);
        }
        assert_eq!(ll().version, ep::NCCL_EP_API_VERSION);
        assert_eq!(code(ep::NcclEpGroupConfig { num_experts: 0, ..ll() }), ep::NCCL_INVALID_ARGUMENT);
        assert_eq!(code(ep::NcclEpGroupConfig { max_token_bytes: 7, ..ll() }), ep::NCCL_INVALID_ARGUMENT);
        assert_eq!(code(ep::NcclEpGroupConfig { max_dispatch_tokens_per_rank: 0, ..ll() }), ep::NCCL_INVALID_USAGE);
        let masked_ht = ep::NcclEpGroupConfig {
            algorithm: ep::NCCL_EP_ALGO_HIGH_THROUGHPUT,
            max_recv_tokens_per_rank: 1024,
            enable_mask: 1,
            ..ll()
        };
        assert_eq!(code(masked_ht), ep::NCCL_INVALID_USAGE);
        assert_eq!(code(ep::NcclEpGroupConfig { num_experts: 15, ..ll() }), ep::NCCL_INVALID_USAGE);
        let ht = ep::NcclEpGroupConfig { algorithm: ep::NCCL_EP_ALGO_HIGH_THROUGHPUT, ..ll() };
        assert_eq!(code(ht), ep::NCCL_INVALID_ARGUMENT);
    }

    #[test]
    fn v2_group_configs_map_or_are_refused_by_field() {
        let v2c = |v1: ep::NcclEpGroupConfig| v2::GroupConfig {
            v1: ep::NcclEpGroupConfig { size: 112, version: 2, ..v1 },
            ..v2::GroupConfig::from_v1(v1)
        };
        let (_, shape) = group_config(&v2::GroupConfig { num_topk: 8, ..v2c(ll()) }, 2).unwrap();
        assert_eq!(shape.num_topk, Some(8));
        assert_eq!(shape.check_top_k(8), Ok(()));
        assert_eq!(shape.check_top_k(9).unwrap_err().code, ep::NCCL_INVALID_USAGE);
        let (_, shape) = group_config(&v2c(ll()), 2).unwrap();
        assert_eq!((shape.num_topk, shape.check_top_k(16)), (None, Ok(())));
        assert!(!shape.drop_overflow);
        let drop = v2::GroupConfig { overflow_policy: v2::OVERFLOW_DROP, ..v2c(ll()) };
        assert!(group_config(&drop, 2).unwrap().1.drop_overflow);
        // High-throughput NCCL_EP_AUTO receive bound (v2): R x max_dispatch_tokens_per_rank.
        let ht_auto = v2c(ep::NcclEpGroupConfig { algorithm: ep::NCCL_EP_ALGO_HIGH_THROUGHPUT, ..ll() });
        let (config, shape) = group_config(&ht_auto, 4).unwrap();
        assert_eq!(config.algorithm, Algorithm::HighThroughput);
        assert_eq!(shape.max_recv, 4 * shape.max_tokens);
        // A v1 caller's 0 is still an error: NCCL EP 0.1 has no AUTO there.
        let ht_v1 = ep::NcclEpGroupConfig { algorithm: ep::NCCL_EP_ALGO_HIGH_THROUGHPUT, ..ll() };
        assert_eq!(group_config(&v2::GroupConfig::from_v1(ht_v1), 2).unwrap_err().code, ep::NCCL_INVALID_ARGUMENT);
    }
}
