//! Creating GPU groups: one process driving several GPUs (peer access between them).

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use epflow_core::protocol::{Channel, Poison, SlotPool};
use epflow_core::{Algorithm, Error, GroupConfig};

use crate::driver::{bind, context, cuda};
use crate::kernels::Kernels;
use crate::layout::LlLayout;
use crate::memory::{DeviceBuffer, PinnedBuffer};
use crate::params::{SIGNAL_PAGE_BYTES, STATUS_WORDS};
use crate::rank::{GpuRank, RankMemory, RankShared};

static NEXT_GROUP_ID: AtomicU64 = AtomicU64::new(1 << 32);

/// Creates GPU groups.
#[derive(Debug)]
pub struct GpuWorld;

impl GpuWorld {
    /// One process driving every device in `devices`: rank `r` runs on `devices[r]`. Every pair of
    /// devices must have peer access (NVLink). Give each rank to its own thread (or task).
    pub fn create(devices: &[usize], config: GroupConfig) -> Result<Vec<GpuRank>, Error> {
        let num_ranks = devices.len();
        config.validate(num_ranks)?;
        if config.algorithm != Algorithm::LowLatency {
            return Err(Error::Unsupported(
                "the GPU backend runs the low-latency algorithm; high-throughput on GPUs is not built yet".into(),
            ));
        }
        let layout = LlLayout::new(&config, num_ranks)?;
        let ctxs = devices.iter().map(|&d| context(d)).collect::<Result<Vec<_>, _>>()?;
        enable_peer_access(devices, &ctxs)?;
        let group_id = NEXT_GROUP_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mems = ctxs.iter().map(|ctx| allocate(ctx, &layout).map(Arc::new)).collect::<Result<Vec<_>, _>>()?;
        let mut ranks = Vec::with_capacity(num_ranks);
        for (rank, (ctx, &device)) in ctxs.iter().zip(devices).enumerate() {
            bind(ctx)?;
            let kernels = Kernels::load(ctx)?;
            let streams = [
                ctx.new_stream().map_err(|e| cuda("create stream", e))?,
                ctx.new_stream().map_err(|e| cuda("create stream", e))?,
            ];
            let num_sms = ctx
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(|e| cuda("query SMs", e))? as u32;
            let shared = Arc::new(RankShared {
                rank,
                num_ranks,
                device,
                config: config.clone(),
                layout,
                group_id,
                ctx: Arc::clone(ctx),
                streams,
                kernels,
                mem: Arc::clone(&mems[rank]),
                peers: mems.clone(),
                num_sms,
                handle_pool: Arc::new(Mutex::new(Vec::new())),
                timing: Default::default(),
                turns: Default::default(),
            });
            ranks.push(GpuRank {
                shared,
                seqs: Default::default(),
                slots: Channel::ALL.map(|c| SlotPool::new(c, config.buffer_sets)),
                poison: Poison::default(),
            });
        }
        Ok(ranks)
    }
}

fn enable_peer_access(devices: &[usize], ctxs: &[Arc<cudarc::driver::CudaContext>]) -> Result<(), Error> {
    for (i, a) in ctxs.iter().enumerate() {
        for (j, b) in ctxs.iter().enumerate() {
            if i == j || devices[i] == devices[j] {
                continue;
            }
            bind(a)?;
            let mut can = 0i32;
            // SAFETY: valid out pointer and device handles of live contexts.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) }
                .result()
                .map_err(|e| cuda("query peer access", e))?;
            if can == 0 {
                return Err(Error::Unsupported(format!(
                    "device {} cannot access device {}'s memory (no NVLink/P2P path); the NVLink kernels need it",
                    devices[i], devices[j]
                )));
            }
            // SAFETY: `b` is a live context; the current context is `a`.
            match unsafe { sys::cuCtxEnablePeerAccess(b.cu_ctx(), 0) } {
                sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                e => return Err(cuda("enable peer access", cudarc::driver::DriverError(e))),
            }
        }
    }
    Ok(())
}

fn allocate(ctx: &Arc<cudarc::driver::CudaContext>, l: &LlLayout) -> Result<RankMemory, Error> {
    let sets = l.sets;
    let per_set = |bytes: usize| (0..sets).map(|_| DeviceBuffer::zeroed(ctx, bytes)).collect::<Result<Vec<_>, _>>();
    Ok(RankMemory {
        ctx: Arc::clone(ctx),
        disp_recv: DeviceBuffer::zeroed(ctx, l.dispatch_recv_set_bytes() * sets)?,
        comb_recv: DeviceBuffer::zeroed(ctx, l.combine_recv_set_bytes() * sets)?,
        signals: DeviceBuffer::zeroed(ctx, SIGNAL_PAGE_BYTES)?,
        status: PinnedBuffer::zeroed(ctx, STATUS_WORDS * 8)?,
        disp_out: per_set(l.dispatch_out_bytes())?,
        disp_scales: per_set(l.dispatch_scales_bytes())?,
        disp_counts: per_set(l.local_experts * 4)?,
        host_counts: (0..sets)
            .map(|_| PinnedBuffer::zeroed(ctx, l.local_experts * 4))
            .collect::<Result<Vec<_>, _>>()?,
        comb_out: per_set(l.combine_out_bytes())?,
    })
}
