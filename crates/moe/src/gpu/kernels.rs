//! The layer's own CUDA kernels (`cuda/moe.cu`), compiled with epflow's NVRTC cache, and their
//! launches: seeded weights, the router's top-k, the SwiGLU activation reading the per-expert
//! counts on the device, a BF16 add, and the slots, gather and weighted reduce of grouped
//! experts over a high-throughput dispatch's rows. Every launch is enqueued on the stream given and
//! returns at once.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use epflow_core::{Error, Result};
use epflow_kernels::compile::nvrtc::compile;
use epflow_kernels::compile::sources::KernelModule;
use epflow_kernels::device_arch;

use super::cuda;
use crate::preset::Scoring;

/// The compilation unit (compiled after epflow's `common.cuh`, like epflow's own modules).
pub const MOE: KernelModule = KernelModule {
    name: "moe",
    files: &[("moe.cu", include_str!("../cuda/moe.cu"))],
    kernels: &[
        "moe_fill_uniform",
        "moe_router_topk",
        "moe_swiglu",
        "moe_add",
        "moe_ht_slots",
        "moe_ht_gather",
        "moe_ht_reduce",
    ],
};

/// The most experts the top-k kernel takes (64 per lane of a warp).
pub const MAX_ROUTER_EXPERTS: usize = 2048;

/// The layer's kernels, loaded into one device's context.
#[derive(Debug, Clone)]
pub(crate) struct MoeKernels {
    fill: CudaFunction,
    topk: CudaFunction,
    swiglu: CudaFunction,
    add: CudaFunction,
    slots: CudaFunction,
    gather: CudaFunction,
    reduce: CudaFunction,
}

fn grid(n: u64, block: u32) -> LaunchConfig {
    let blocks = n.div_ceil(u64::from(block)).clamp(1, 65_535 * 8) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

fn launched(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> Error + '_ {
    move |e| cuda(&format!("launch {what}"), e)
}

impl MoeKernels {
    /// Compiles (or takes from epflow's kernel cache) and loads the module into `ctx`.
    pub(crate) fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        let arch = device_arch(ctx)?;
        let module =
            ctx.load_module(Ptx::from_binary(compile(&MOE, &arch)?)).map_err(|e| cuda("load moe module", e))?;
        let f = |name: &str| module.load_function(name).map_err(|e| cuda(&format!("load {name}"), e));
        Ok(MoeKernels {
            fill: f("moe_fill_uniform")?,
            topk: f("moe_router_topk")?,
            swiglu: f("moe_swiglu")?,
            add: f("moe_add")?,
            slots: f("moe_ht_slots")?,
            gather: f("moe_ht_gather")?,
            reduce: f("moe_ht_reduce")?,
        })
    }

    /// Fills `n` BF16 values at `out` with [`crate::weights::value`]`(key, i, scale)`.
    ///
    /// `out` must address `n` BF16 values of this context's device, alive until the fill ran.
    pub(crate) fn fill(&self, stream: &CudaStream, out: u64, n: u64, key: u64, scale: f32) -> Result<()> {
        let mut b = stream.launch_builder(&self.fill);
        b.arg(&out).arg(&n).arg(&key).arg(&scale);
        // SAFETY: the arguments match `moe_fill_uniform(bf16*, u64, u64, float)`; the caller
        // gives `n` values of device memory at `out` (the methods of `DeviceWeights` allocate
        // exactly that).
        unsafe { b.launch(grid(n, 256)) }.map(drop).map_err(launched("moe_fill_uniform"))
    }

    /// The router's top-k of `logits` (`[tokens x experts]` FP32) into `topk_idx` (`[tokens x
    /// k]` int64) and `topk_weights` (`[tokens x k]` FP32), scored as `scoring` says. `experts` at most
    /// [`MAX_ROUTER_EXPERTS`], `k` at most 16 and at most `experts`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn router_topk(
        &self,
        stream: &CudaStream,
        logits: u64,
        tokens: usize,
        experts: usize,
        k: usize,
        scoring: Scoring,
        topk_idx: u64,
        topk_weights: u64,
    ) -> Result<()> {
        if experts == 0 || experts > MAX_ROUTER_EXPERTS || k == 0 || k > 16 || k > experts || tokens > i32::MAX as usize
        {
            return Err(Error::Unsupported(format!(
                "router top-k: {experts} experts (1..={MAX_ROUTER_EXPERTS}), top-{k} (1..=16, at most the experts)"
            )));
        }
        if tokens == 0 {
            return Ok(());
        }
        let (b, e, kk) = (tokens as i32, experts as i32, k as i32);
        let (scoring, scale) = match scoring {
            Scoring::Softmax => (0i32, 1.0f32),
            Scoring::SigmoidRenorm { scale } => (1, scale),
        };
        let mut l = stream.launch_builder(&self.topk);
        l.arg(&logits).arg(&b).arg(&e).arg(&kk).arg(&scoring).arg(&scale).arg(&topk_idx).arg(&topk_weights);
        // SAFETY: the arguments match `moe_router_topk(const float*, int, int, int, int, float,
        // long long*, float*)`; the caller gives `logits` of tokens x experts floats and outputs
        // of tokens x k entries (checked by `Router`'s shapes); one warp per token.
        unsafe { l.launch(grid(tokens as u64 * 32, 256)) }.map(drop).map_err(launched("moe_router_topk"))
    }

    /// SwiGLU's activation over `rows_per_expert`-row blocks: `gu` `[blocks x rows x 2F]` into
    /// `act` `[blocks x rows x F]` (BF16), skipping the rows at or past `counts[block]` when
    /// `counts` (device int32 `[blocks]`) is given.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn swiglu(
        &self,
        stream: &CudaStream,
        gu: u64,
        act: u64,
        counts: Option<u64>,
        blocks: usize,
        rows_per_expert: usize,
        ffn: usize,
    ) -> Result<()> {
        let rows = blocks * rows_per_expert;
        if rows == 0 {
            return Ok(());
        }
        if rows > i32::MAX as usize || ffn > i32::MAX as usize / 2 {
            return Err(Error::Unsupported(format!("SwiGLU over {rows} rows of {ffn}: too large")));
        }
        let (c, f, counts) = (rows_per_expert as i32, ffn as i32, counts.unwrap_or(0));
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut l = stream.launch_builder(&self.swiglu);
        l.arg(&gu).arg(&act).arg(&counts).arg(&c).arg(&f);
        // SAFETY: the arguments match `moe_swiglu(const bf16*, bf16*, const int*, int, int)`;
        // the caller gives rows x 2F and rows x F BF16 values at `gu` and `act`, and `counts`
        // (0 = none) of `blocks` int32; one block per row.
        unsafe { l.launch(cfg) }.map(drop).map_err(launched("moe_swiglu"))
    }

    /// `out[i] = bf16(a[i] + b[i])` for `n` BF16 values (`out` may be `a` or `b`).
    pub(crate) fn add(&self, stream: &CudaStream, a: u64, b: u64, out: u64, n: u64) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let mut l = stream.launch_builder(&self.add);
        l.arg(&a).arg(&b).arg(&out).arg(&n);
        // SAFETY: the arguments match `moe_add(const bf16*, const bf16*, bf16*, u64)`; the
        // caller gives `n` BF16 values at each address.
        unsafe { l.launch(grid(n, 256)) }.map(drop).map_err(launched("moe_add"))
    }

    /// The positions of grouped experts' rows: for a high-throughput dispatch's `n` rows with
    /// local expert indices `idx` (`[n x k]` int64, -1: not local) and the per-expert counts
    /// `counts` (`[experts]` int32, device), writes `rows[p]` (`[cap]` int32: the received row
    /// at position `p`) and `pos_of[i]` (`[n x k]` int32: the position of local entry `i`).
    /// Expert `e`'s rows sit from `counts[0] + ... + counts[e-1]` on, in (row, k) order.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ht_slots(
        &self,
        stream: &CudaStream,
        idx: u64,
        n: usize,
        k: usize,
        counts: u64,
        experts: usize,
        cap: usize,
        rows: u64,
        pos_of: u64,
    ) -> Result<()> {
        if experts == 0 || n == 0 {
            return Ok(());
        }
        if n.saturating_mul(k) > i32::MAX as usize || cap > i32::MAX as usize || experts > 65_535 {
            return Err(Error::Unsupported(format!(
                "grouped experts: {n} rows of top-{k}, {experts} experts: too large"
            )));
        }
        let (n, k, cap) = (n as i32, k as i32, cap as i32);
        let cfg = LaunchConfig { grid_dim: (experts as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        let mut l = stream.launch_builder(&self.slots);
        l.arg(&idx).arg(&n).arg(&k).arg(&counts).arg(&cap).arg(&rows).arg(&pos_of);
        // SAFETY: the arguments match `moe_ht_slots(const long long*, int, int, const int*, int,
        // int*, int*)`; the caller gives n x k int64 at `idx`, `experts` int32 at `counts`,
        // `cap` int32 at `rows` and n x k int32 at `pos_of` (positions past `cap` are not
        // written); one block of 32 warps per expert.
        unsafe { l.launch(cfg) }.map(drop).map_err(launched("moe_ht_slots"))
    }

    /// `out[p] = tokens[rows[p]]` for `p < positions` (rows of `hidden` BF16, `hidden` a
    /// multiple of 8, 16-byte aligned rows).
    pub(crate) fn ht_gather(
        &self,
        stream: &CudaStream,
        tokens: u64,
        rows: u64,
        positions: usize,
        hidden: usize,
        out: u64,
    ) -> Result<()> {
        if positions == 0 {
            return Ok(());
        }
        if hidden % 8 != 0 || positions > i32::MAX as usize || hidden > i32::MAX as usize {
            return Err(Error::Unsupported(format!(
                "gather of {positions} rows of {hidden}: H must be a multiple of 8"
            )));
        }
        let (p, h) = (positions as i32, hidden as i32);
        let cfg = LaunchConfig {
            grid_dim: (positions.min(65_535 * 4) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = stream.launch_builder(&self.gather);
        l.arg(&tokens).arg(&rows).arg(&p).arg(&h).arg(&out);
        // SAFETY: the arguments match `moe_ht_gather(const bf16*, const int*, int, int, bf16*)`;
        // the caller gives `positions` int32 row numbers at `rows`, each a row of `tokens`, and
        // positions x hidden BF16 at `out` (device allocations are 256-byte aligned and rows
        // are a multiple of 16 bytes, so the 16-byte vectors are aligned).
        unsafe { l.launch(cfg) }.map(drop).map_err(launched("moe_ht_gather"))
    }

    /// `out[r] = bf16(fma chain over k of w[r][k] * y[pos_of[r][k]])` over the local entries
    /// (`idx >= 0`) of each of `n` rows: `y` `[positions x hidden]` BF16, `idx` `[n x k]` int64,
    /// `w` `[n x k]` FP32, `pos_of` `[n x k]` int32, `out` `[n x hidden]` BF16.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ht_reduce(
        &self,
        stream: &CudaStream,
        y: u64,
        idx: u64,
        w: u64,
        pos_of: u64,
        n: usize,
        k: usize,
        hidden: usize,
        out: u64,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if n.saturating_mul(k) > i32::MAX as usize || hidden > i32::MAX as usize {
            return Err(Error::Unsupported(format!("reduce of {n} rows of top-{k}: too large")));
        }
        let (nn, kk, h) = (n as i32, k as i32, hidden as i32);
        let cfg =
            LaunchConfig { grid_dim: (n.min(65_535 * 4) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut l = stream.launch_builder(&self.reduce);
        l.arg(&y).arg(&idx).arg(&w).arg(&pos_of).arg(&nn).arg(&kk).arg(&h).arg(&out);
        // SAFETY: the arguments match `moe_ht_reduce(const bf16*, const long long*, const
        // float*, const int*, int, int, int, bf16*)`; the caller gives the tensors described
        // above, with `pos_of` written by `ht_slots` for every local entry.
        unsafe { l.launch(cfg) }.map(drop).map_err(launched("moe_ht_reduce"))
    }
}
