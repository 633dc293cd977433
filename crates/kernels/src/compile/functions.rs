//! [`Functions`]: the kernels of every module, compiled (or taken from the cache) and loaded
//! into one device's context.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;
use epflow_core::Error;

use super::ll_kernels::{Form, LlKernel};
use super::nvrtc::compile;
use super::sources::{HT, LL, NCCL, UTIL};
use crate::device::cuda;

/// Every kernel epflow launches, loaded into one context.
#[derive(Debug, Clone)]
pub(crate) struct Functions {
    pub dispatch_send: CudaFunction,
    pub dispatch_recv: CudaFunction,
    pub combine_send: CudaFunction,
    pub combine_recv: CudaFunction,
    /// The combine complete half for tagged rows (`LlParams::tagged_rows`).
    pub combine_recv_tagged: CudaFunction,
    /// Low-latency dispatch in one launch (send, then receive; launched cooperatively).
    pub dispatch_one: CudaFunction,
    /// Low-latency dispatch in one launch, sent as tagged messages (`LlParams::sends_tagged`).
    pub dispatch_one_tagged: CudaFunction,
    /// A forwarded dispatch's kernels (`LlParams::fwd_token_bytes`): send half, complete half,
    /// one launch, one launch sent as tagged messages.
    pub dispatch_fwd: ForwardedDispatch,
    /// An NVFP4 combine's kernels (`LlParams::nvfp4`).
    pub combine_nvfp4: Nvfp4Combine,
    /// Low-latency combine in one launch.
    pub combine_one: CudaFunction,
    /// Low-latency combine in one launch, for tagged rows.
    pub combine_one_tagged: CudaFunction,
    /// A captured step's bases, set before a replay whose channels moved on (`graph/`).
    pub graph_rebase: CudaFunction,
    /// Rank masking: ORs ranks into every rank's mask word (`mask.rs`).
    pub mask_spread: CudaFunction,
    /// Rank masking: `unmask_all`'s meeting and reset (`mask.rs`).
    pub mask_rejoin: CudaFunction,
    /// The ranks' meeting on the device in stream order (`meet.rs`).
    pub meet: CudaFunction,
    /// A low-latency handle built on the device (`ll/handle.rs`).
    pub ll_handle: CudaFunction,
    pub ht_dispatch: CudaFunction,
    /// High-throughput combine for up to 8, 4 and 2 ranks (`ht_receive.cuh`: the smaller the bound,
    /// the more loads each receiving lane keeps in flight): see [`Functions::ht_combine_for`].
    pub ht_combine: [CudaFunction; 3],
    pub ht_exchange: CudaFunction,
    /// A high-throughput handle built on the device, one kernel: the mark blocks (a thread per
    /// token), then a block per destination and the receive block.
    pub ht_plan: CudaFunction,
    pub dequant_fp8: CudaFunction,
    /// int32 to int64, sign-extended (`GpuRank::widen_i32_on`).
    pub widen_i32: CudaFunction,
    /// Local expert ids to global ones in place (`GpuRank::globalize_expert_ids_on`).
    pub globalize_ids: CudaFunction,
    /// High-throughput expert-major layout (`rank/expert_major.rs`): slot numbering, scatter,
    /// zone padding, the flat combine input's reduce, and a backward combine's weight gradients.
    pub em_slots: CudaFunction,
    pub em_scatter: CudaFunction,
    pub em_pad: CudaFunction,
    pub em_reduce: CudaFunction,
    pub em_gather_weights: CudaFunction,
    pub spin: CudaFunction,
    /// The SM-store copy probe (`GpuRank::sm_copy`).
    pub sm_copy: CudaFunction,
    /// The SM-store copy probe with the work balanced between blocks (`GpuRank::sm_copy_balanced`).
    pub sm_copy_balanced: CudaFunction,
    /// The bulk-copy (TMA) probe (`GpuRank::tma_copy`).
    pub tma_copy: CudaFunction,
    pub nccl_ht_pack: CudaFunction,
    pub nccl_arrivals: CudaFunction,
    pub nccl_ht_reduce: CudaFunction,
}

/// The kernels of a forwarded low-latency dispatch (`ll.cu`'s `_fwd` kernels).
#[derive(Debug, Clone)]
pub(crate) struct ForwardedDispatch {
    pub send: CudaFunction,
    pub recv: CudaFunction,
    pub one: CudaFunction,
    pub one_tagged: CudaFunction,
}

/// The kernels of an NVFP4 low-latency combine (`ll.cu`'s `_nvfp4` kernels).
#[derive(Debug, Clone)]
pub(crate) struct Nvfp4Combine {
    pub send: CudaFunction,
    pub recv: CudaFunction,
    pub one: CudaFunction,
}

/// `"sm_90"` for a 9.0 device.
pub fn device_arch(ctx: &CudaContext) -> Result<String, Error> {
    let (major, minor) = ctx.compute_capability().map_err(|e| cuda("query compute capability", e))?;
    if major < 7 {
        return Err(Error::Unsupported(format!("compute capability {major}.{minor}: the kernels need 7.0 or newer")));
    }
    Ok(format!("sm_{major}{minor}"))
}

impl Functions {
    /// Compiles (or takes from the cache) and loads every module for this device.
    pub(crate) fn load(ctx: &Arc<CudaContext>) -> Result<Self, Error> {
        let arch = device_arch(ctx)?;
        let ll = ctx.load_module(Ptx::from_binary(compile(&LL, &arch)?)).map_err(|e| cuda("load ll module", e))?;
        let ht = ctx.load_module(Ptx::from_binary(compile(&HT, &arch)?)).map_err(|e| cuda("load ht module", e))?;
        let nccl =
            ctx.load_module(Ptx::from_binary(compile(&NCCL, &arch)?)).map_err(|e| cuda("load nccl module", e))?;
        let util =
            ctx.load_module(Ptx::from_binary(compile(&UTIL, &arch)?)).map_err(|e| cuda("load util module", e))?;
        // Loaded now, not at their first launch: with CUDA's lazy loading (the default), loading a
        // kernel may wait for the kernels already running in the context, and with several ranks
        // in one process those may be another rank's receive, spinning for this rank's send —
        // which then starts only at that receive's deadline.
        let f = |m: &Arc<cudarc::driver::CudaModule>, name: &str| {
            let func = m.load_function(name).map_err(|e| cuda(&format!("find kernel {name}"), e))?;
            // SAFETY: `func` is a live function handle of a module of this context (the caller
            // bound it: `build_rank`).
            unsafe { cudarc::driver::sys::cuFuncLoad(func.cu_function()) }
                .result()
                .map_err(|e| cuda(&format!("load kernel {name}"), e))?;
            Ok::<_, Error>(func)
        };
        Ok(Functions {
            dispatch_send: f(&ll, LlKernel::DispatchSend.function_name())?,
            dispatch_recv: f(&ll, LlKernel::DispatchRecv.function_name())?,
            combine_send: f(&ll, LlKernel::CombineSend.function_name())?,
            combine_recv: f(&ll, LlKernel::CombineRecv.function_name())?,
            combine_recv_tagged: f(&ll, LlKernel::CombineRecv.tagged_function_name().unwrap_or_default())?,
            dispatch_one: f(&ll, LlKernel::DispatchOne.function_name())?,
            dispatch_one_tagged: f(&ll, LlKernel::DispatchOne.tagged_function_name().unwrap_or_default())?,
            dispatch_fwd: {
                let fwd = |k: LlKernel, form| f(&ll, k.forwarded_function_name(form).unwrap_or_default());
                ForwardedDispatch {
                    send: fwd(LlKernel::DispatchSend, Form::Plain)?,
                    recv: fwd(LlKernel::DispatchRecv, Form::Plain)?,
                    one: fwd(LlKernel::DispatchOne, Form::Plain)?,
                    one_tagged: fwd(LlKernel::DispatchOne, Form::Tagged)?,
                }
            },
            combine_nvfp4: {
                let nv = |k: LlKernel| f(&ll, k.nvfp4_function_name().unwrap_or_default());
                Nvfp4Combine {
                    send: nv(LlKernel::CombineSend)?,
                    recv: nv(LlKernel::CombineRecv)?,
                    one: nv(LlKernel::CombineOne)?,
                }
            },
            combine_one: f(&ll, LlKernel::CombineOne.function_name())?,
            combine_one_tagged: f(&ll, LlKernel::CombineOne.tagged_function_name().unwrap_or_default())?,
            graph_rebase: f(&ll, "ep_graph_rebase")?,
            mask_spread: f(&ll, "ep_mask_spread")?,
            mask_rejoin: f(&ll, "ep_mask_rejoin")?,
            meet: f(&ll, "ep_meet")?,
            ll_handle: f(&ll, "ep_ll_handle")?,
            ht_dispatch: f(&ht, "ep_ht_dispatch_kernel")?,
            ht_combine: [
                f(&ht, "ep_ht_combine_kernel")?,
                f(&ht, "ep_ht_combine_kernel_4ranks")?,
                f(&ht, "ep_ht_combine_kernel_2ranks")?,
            ],
            ht_exchange: f(&ht, "ep_ht_exchange")?,
            ht_plan: f(&ht, "ep_ht_plan")?,
            dequant_fp8: f(&util, "ep_dequant_fp8_rows")?,
            widen_i32: f(&util, "ep_widen_i32")?,
            globalize_ids: f(&util, "ep_globalize_expert_ids")?,
            em_slots: f(&util, "ep_em_slots")?,
            em_scatter: f(&util, "ep_em_scatter")?,
            em_pad: f(&util, "ep_em_pad")?,
            em_reduce: f(&util, "ep_em_reduce")?,
            em_gather_weights: f(&util, "ep_em_gather_weights")?,
            spin: f(&util, "ep_spin")?,
            sm_copy: f(&util, "ep_sm_copy")?,
            sm_copy_balanced: f(&util, "ep_sm_copy_balanced")?,
            tma_copy: f(&util, "ep_tma_copy")?,
            nccl_ht_pack: f(&nccl, "ep_nccl_ht_pack")?,
            nccl_arrivals: f(&nccl, "ep_nccl_arrivals")?,
            nccl_ht_reduce: f(&nccl, "ep_nccl_ht_reduce")?,
        })
    }
}

impl Functions {
    /// Every one-launch low-latency kernel with its form (which sets its block size:
    /// `ll::geometry::one_launch_threads`).
    pub(crate) fn one_launch(&self) -> [(&CudaFunction, Form); 7] {
        [
            (&self.dispatch_one, Form::Plain),
            (&self.dispatch_one_tagged, Form::Tagged),
            (&self.dispatch_fwd.one, Form::Plain),
            (&self.dispatch_fwd.one_tagged, Form::Tagged),
            (&self.combine_one, Form::Plain),
            (&self.combine_one_tagged, Form::Tagged),
            (&self.combine_nvfp4.one, Form::Plain),
        ]
    }

    /// The high-throughput combine kernel for a group of `num_ranks` ranks: the one of the
    /// smallest rank bound (2, 4, 8) that covers it and `min_bound` (a tuning aid, the group's
    /// `EPFLOW_HT_COMBINE_RANKS`: e.g. `8` runs the general kernel on 2 ranks).
    pub(crate) fn ht_combine_for(&self, num_ranks: usize, min_bound: usize) -> &CudaFunction {
        match num_ranks.max(min_bound) {
            0..=2 => &self.ht_combine[2],
            3..=4 => &self.ht_combine[1],
            _ => &self.ht_combine[0],
        }
    }
}
