//! One rank's NCCL EP group and the buffers its operations write, and the teardown the ranks of
//! a world share (destroying an NCCL EP group is collective).

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaContext, CudaStream};
use epflow_core::{Algorithm, DType, Error, GroupConfig, TensorDesc, TensorTag};
use epflow_kernels::DeviceTensor;
use epflow_kernels::transport::nccl::NcclComms;
use nccl_ep_sys as ep;

pub(crate) fn cuda(what: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Backend(format!("CUDA: {what}: {e:?}"))
}

/// The staging NCCL EP gets for a low-latency group, an upper bound of what its layout needs:
/// two slots, each holding the larger of dispatch (a send region of `M` messages and a receive
/// region of `R x M`) and combine (a send region of `E x M` messages and a receive region of
/// `M x K`), with messages of `2H` bytes plus a header or scale block, plus signals. NCCL EP
/// refuses a handle whose layout does not fit, naming the size it needs.
pub(crate) fn ll_rdma_bytes(config: &GroupConfig, max_tokens: usize) -> usize {
    let msg = 2 * config.hidden + 256;
    let per_slot = (config.num_experts + 1) * max_tokens * msg * 2;
    let total = 2 * per_slot;
    (total + total / 8).next_multiple_of(1 << 21)
}

/// NCCL EP's group configuration for `config` on `num_ranks` ranks, `max_tokens` per rank.
pub(crate) fn group_config(config: &GroupConfig, num_ranks: usize, max_tokens: usize) -> ep::NcclEpGroupConfig {
    let base = ep::NcclEpGroupConfig {
        num_experts: config.num_experts as u32,
        max_dispatch_tokens_per_rank: max_tokens as u32,
        max_token_bytes: (2 * config.hidden) as u32,
        max_num_sms: config.max_sms.map_or(ep::NCCL_EP_AUTO, |s| s as u32),
        timeout_ns: config.timeout.as_nanos() as u64 * 9 / 10,
        ..ep::NcclEpGroupConfig::default()
    };
    match config.algorithm {
        Algorithm::LowLatency => ep::NcclEpGroupConfig {
            algorithm: ep::NCCL_EP_ALGO_LOW_LATENCY,
            // Sized up front: with NCCL_EP_AUTO the first handle creation would allocate and
            // register the buffer collectively, which blocks any rank whose peers are driven
            // from the same thread (as an async executor may).
            rdma_buffer_size: ll_rdma_bytes(config, max_tokens) as _,
            ..base
        },
        Algorithm::HighThroughput => ep::NcclEpGroupConfig {
            algorithm: ep::NCCL_EP_ALGO_HIGH_THROUGHPUT,
            // Flat layout: a token reaches a rank at most once.
            max_recv_tokens_per_rank: (num_ranks * max_tokens) as u32,
            ..base
        },
    }
}

/// The outputs of one buffer set of a rank. Low-latency: tokens `[L x R*M x H]` and counts
/// `[L]`; high-throughput: tokens `[R*M x H]` (the most a rank receives) and the received
/// top-k weights and local indices `[R*M x K]`, allocated for the largest `K` seen. Both:
/// combined tokens `[M x H]`.
#[derive(Debug)]
pub(crate) struct SetBuffers {
    pub tokens: DeviceTensor,
    pub counts: DeviceTensor,
    pub combined: DeviceTensor,
    topk: Mutex<Option<TopkBuffers>>,
}

#[derive(Debug)]
struct TopkBuffers {
    k: usize,
    weights: DeviceTensor,
    idx: DeviceTensor,
}

impl SetBuffers {
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        device: usize,
        config: &GroupConfig,
        num_ranks: usize,
        max_tokens: usize,
    ) -> Result<Self, Error> {
        let (h, l, rows) = (config.hidden, config.local_experts(num_ranks), num_ranks * max_tokens);
        let tokens_shape = match config.algorithm {
            Algorithm::LowLatency => vec![l, rows, h],
            Algorithm::HighThroughput => vec![rows, h],
        };
        let t =
            |tag, dtype, shape: &[usize]| DeviceTensor::zeros(ctx, device, TensorDesc::contiguous(tag, dtype, shape));
        Ok(SetBuffers {
            tokens: t(TensorTag::Tokens, DType::Bf16, &tokens_shape)?,
            counts: t(TensorTag::RecvExpertCountsDevice, DType::I32, &[l])?,
            combined: t(TensorTag::Tokens, DType::Bf16, &[max_tokens, h])?,
            topk: Mutex::new(None),
        })
    }

    /// High-throughput: the addresses of the `[rows x k]` weights and indices of this set,
    /// grown when `k` is larger than any before. Called only by the operation that holds the
    /// set's slot, so no output of the set is alive.
    pub(crate) fn topk(
        &self,
        ctx: &Arc<CudaContext>,
        device: usize,
        rows: usize,
        k: usize,
    ) -> Result<(u64, u64), Error> {
        let mut g = self.topk.lock().unwrap_or_else(PoisonError::into_inner);
        if g.as_ref().is_none_or(|b| b.k < k) {
            let t = |tag, dtype| DeviceTensor::zeros(ctx, device, TensorDesc::contiguous(tag, dtype, &[rows, k]));
            *g = Some(TopkBuffers {
                k,
                weights: t(TensorTag::TopkWeights, DType::F32)?,
                idx: t(TensorTag::TopkIdx, DType::I64)?,
            });
        }
        let b = g.as_ref().ok_or_else(|| Error::Backend("no top-k buffers".into()))?;
        Ok((b.weights.ptr(), b.idx.ptr()))
    }
}

/// What one rank's group state holds; every operation and handle of the rank holds it too.
pub(crate) struct Shared {
    pub lib: Arc<ep::NcclEp>,
    pub rank: usize,
    pub num_ranks: usize,
    pub device: usize,
    pub config: GroupConfig,
    pub max_tokens: usize,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub group: ep::NcclEpGroup,
    pub sets: Vec<SetBuffers>,
    /// The next operation (of any channel) allowed to issue: NCCL EP's group is one ordered
    /// communicator, so every rank issues in the same (call) order.
    pub turn: AtomicU64,
    pub timing: AtomicBool,
    pub comms: Option<NcclComms>,
    pub teardown: Arc<Teardown>,
}

// SAFETY: the NCCL EP group is used from one thread at a time (operations issue in turn order,
// handles are created and destroyed under the rank's calls); CUDA objects are thread-safe.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Drop for Shared {
    /// Hands the group and the communicators to the world's [`Teardown`], which destroys every
    /// rank's group together once the last rank is gone.
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            let _ = self.stream.synchronize();
        }
        self.teardown.leave(Remains {
            lib: Arc::clone(&self.lib),
            ctx: Arc::clone(&self.ctx),
            group: GroupPtr(self.group),
            _comms: self.comms.take(),
        });
    }
}

impl Shared {
    pub(crate) fn check(&self, what: &str, r: ep::NcclResult) -> Result<(), Error> {
        if r == ep::NCCL_SUCCESS {
            Ok(())
        } else {
            Err(Error::Backend(format!("NCCL EP: {what}: {}", self.lib.error_string(r))))
        }
    }

    pub(crate) fn raw_stream(&self) -> ep::CudaStream {
        self.stream.cu_stream() as ep::CudaStream
    }
}

/// A raw group, moved to the thread that destroys it.
struct GroupPtr(ep::NcclEpGroup);

/// What a rank leaves to the world's teardown.
struct Remains {
    lib: Arc<ep::NcclEp>,
    ctx: Arc<CudaContext>,
    group: GroupPtr,
    /// Aborted when dropped, after every group is gone.
    _comms: Option<NcclComms>,
}

// SAFETY: the group is destroyed by exactly one thread, after every use of it ended (the rank's
// `Shared`, which every operation and handle holds, is gone); the rest is thread-safe.
unsafe impl Send for Remains {}

/// The teardown the ranks of one world share. Destroying an NCCL EP group is collective (a
/// barrier on its communicator, then its NCCL windows are deregistered), so ranks dropped one
/// after another by one thread, or by threads that end at different times, cannot each destroy
/// their own: each rank leaves its group here, and when the last rank's state goes every group
/// is destroyed at once (one thread per rank, joined), then the communicators are aborted.
/// If a rank never leaves (its state was leaked) nothing is destroyed; if fewer ranks than the
/// world were created, their groups are leaked rather than entering a barrier nobody meets.
pub(crate) struct Teardown {
    ranks: usize,
    left: Mutex<Vec<Remains>>,
}

impl Teardown {
    pub(crate) fn new(ranks: usize) -> Arc<Self> {
        Arc::new(Teardown { ranks, left: Mutex::new(Vec::new()) })
    }

    /// A group created but not handed to a rank (creation failed later): leaked at teardown
    /// (its peers cannot be assumed to meet it), its communicators aborted.
    pub(crate) fn leave_failed(&self, lib: &Arc<ep::NcclEp>, ctx: &Arc<CudaContext>, comms: NcclComms) {
        self.leave(Remains {
            lib: Arc::clone(lib),
            ctx: Arc::clone(ctx),
            group: GroupPtr(std::ptr::null_mut()),
            _comms: Some(comms),
        });
    }

    fn leave(&self, r: Remains) {
        self.left.lock().unwrap_or_else(PoisonError::into_inner).push(r);
    }
}

impl Drop for Teardown {
    fn drop(&mut self) {
        let left = std::mem::take(self.left.get_mut().unwrap_or_else(PoisonError::into_inner));
        let complete = left.len() == self.ranks && left.iter().all(|r| !r.group.0.is_null());
        let left: Vec<Remains> = if complete {
            std::thread::scope(|s| {
                let joins: Vec<_> = left
                    .into_iter()
                    .map(|r| {
                        s.spawn(move || {
                            if r.ctx.bind_to_thread().is_ok() {
                                // SAFETY: every rank's group, each destroyed once by its own thread,
                                // all at the same time (the call is collective); no operation or
                                // handle uses them any more (they held the ranks' state).
                                let rc = unsafe { (r.lib.group_destroy)(r.group.0) };
                                if rc != ep::NCCL_SUCCESS {
                                    tracing::warn!("NCCL EP: ncclEpGroupDestroy: {}", r.lib.error_string(rc));
                                }
                            }
                            r
                        })
                    })
                    .collect();
                joins.into_iter().filter_map(|j| j.join().ok()).collect()
            })
        } else {
            if left.iter().any(|r| !r.group.0.is_null()) {
                tracing::warn!(
                    "NCCL EP: {} of {} ranks reached teardown: their groups are not destroyed (the call is collective)",
                    left.len(),
                    self.ranks
                );
            }
            left
        };
        // The communicators go after every group (aborting is local and never waits).
        drop(left);
    }
}
