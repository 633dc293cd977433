// epflow low-latency kernels, part 6 of 7 (after ll_combine.cuh): the kernels, and the graph
// and rank-masking kernels. NVRTC compiles common.cuh and the seven parts in order as one unit
// (epflow-kernels compile/sources.rs).

// The kernels. Two launches (staged operations, and any operation whose grid cannot be all
// resident): the send half, then the complete half. One launch (the synchronous form, launched
// cooperatively so every block is resident): each block sends its share, then takes its receive
// tasks; a block waiting for arrivals never keeps a sender of this kernel off the GPU. A
// one-launch grid has at most one block per SM, and its registers are bounded so that two blocks
// fit on an SM: the other channel's one-launch kernel (ranks may interleave the channels
// differently) always finds room beside a waiting one. The tagged one-launch kernels run in
// blocks of 256 threads (epflow-kernels op/ll_geometry.rs `TAGGED_ONE_LAUNCH_THREADS`), so they
// have 128 registers: at 512 threads and 64 they spilled (the dispatch ~200 bytes on the
// receive's path, the combine 20). The plain ones keep 512 threads (in 256 their receives take
// twice the rounds).
// FWD: the kernels of a forwarded dispatch (`LlParams::fwd_token_bytes`; the `_fwd` names),
// compiled apart so that the BF16 and FP8 kernels carry none of its branches (inlined in them,
// the one-launch dispatch's stack grew from 112 to 128 bytes and its time by 1-2 us).
template <bool FWD>
__device__ __forceinline__ void dispatch_send_half(const LlParams& p) {
    trace_at(p, 0, 0);
    const OpNum n = op_num(p, 0);
    if (!n.dead) dispatch_send<SEND_ANY, FWD>(p, n);
    trace_at(p, 0, 1);
}
template <bool FWD>
__device__ __forceinline__ void dispatch_recv_half(const LlParams& p) {
    const OpNum n = op_num(p, 0);
    if (!n.dead) dispatch_recv<FWD, false>(p, n);
}
extern "C" __global__ void __launch_bounds__(512) ep_ll_dispatch_send(LlParams p) { dispatch_send_half<false>(p); }
extern "C" __global__ void __launch_bounds__(512) ep_ll_dispatch_recv(LlParams p) { dispatch_recv_half<false>(p); }
extern "C" __global__ void __launch_bounds__(512) ep_ll_dispatch_send_fwd(LlParams p) { dispatch_send_half<true>(p); }
extern "C" __global__ void __launch_bounds__(512) ep_ll_dispatch_recv_fwd(LlParams p) { dispatch_recv_half<true>(p); }
// TAGGED: this rank sends tagged messages (`LlParams::sends_tagged`, the host's mirror of
// `sends_tagged`): `ep_ll_dispatch_kernel_tagged`.
template <bool TAGGED, bool FWD>
__device__ __forceinline__ void dispatch_one(const LlParams& p) {
    const OpNum n = op_num(p, 0);
    if (n.dead) return;
    trace_at(p, 0, 0);
    dispatch_send<TAGGED ? SEND_TAGGED : SEND_PLAIN, FWD>(p, n);
    trace_at(p, 0, 1);
    dispatch_recv<FWD, !TAGGED, TAGGED>(p, n);
}
extern "C" __global__ void __launch_bounds__(512, 2) ep_ll_dispatch_kernel(LlParams p) { dispatch_one<false, false>(p); }
extern "C" __global__ void __launch_bounds__(256, 2) ep_ll_dispatch_kernel_tagged(LlParams p) {
    dispatch_one<true, false>(p);
}
extern "C" __global__ void __launch_bounds__(512, 2) ep_ll_dispatch_kernel_fwd(LlParams p) {
    dispatch_one<false, true>(p);
}
extern "C" __global__ void __launch_bounds__(256, 2) ep_ll_dispatch_kernel_tagged_fwd(LlParams p) {
    dispatch_one<true, true>(p);
}
// The combine send is held to two blocks per SM (64 registers for sm_90 with NVRTC 13.0.88, 12 B
// of spill stores and 24 of loads; with `__launch_bounds__(512)` alone ptxas also takes 64, with
// more spills), so a send block leaves room on its SM for another operation's receive.
template <bool NVFP4>
__device__ __forceinline__ void combine_send_half(const LlParams& p) {
    trace_at(p, 1, 0);
    const OpNum n = op_num(p, 1);
    if (!n.dead) combine_send<NVFP4>(p, n);
    trace_at(p, 1, 1);
}
extern "C" __global__ void __launch_bounds__(512, 2) ep_ll_combine_send(LlParams p) { combine_send_half<false>(p); }
// NVFP4 (`LlParams::nvfp4`; the `_nvfp4` names): the combine that travels as NVFP4, compiled
// apart as the forwarded dispatch is.
extern "C" __global__ void __launch_bounds__(512, 2) ep_ll_combine_send_nvfp4(LlParams p) {
    combine_send_half<true>(p);
}
extern "C" __global__ void __launch_bounds__(256) ep_ll_combine_recv_nvfp4(LlParams p) {
    const OpNum n = op_num(p, 1);
    if (!n.dead) combine_recv<false, true>(p, n);
}
extern "C" __global__ void __launch_bounds__(256) ep_ll_combine_recv(LlParams p) {
    const OpNum n = op_num(p, 1);
    if (!n.dead) combine_recv<false>(p, n);
}
extern "C" __global__ void __launch_bounds__(256) ep_ll_combine_recv_tagged(LlParams p) {
    const OpNum n = op_num(p, 1);
    if (!n.dead) combine_recv<true>(p, n);
}
template <bool TAGGED, bool NVFP4 = false>
__device__ __forceinline__ void combine_one(const LlParams& p) {
    const OpNum n = op_num(p, 1);
    if (n.dead) return;
    trace_at(p, 1, 0);
    combine_send<NVFP4>(p, n);
    trace_at(p, 1, 1);
    combine_recv<TAGGED, NVFP4>(p, n);
}
extern "C" __global__ void __launch_bounds__(512, 2) ep_ll_combine_kernel(LlParams p) { combine_one<false>(p); }
extern "C" __global__ void __launch_bounds__(256, 2) ep_ll_combine_kernel_tagged(LlParams p) { combine_one<true>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) ep_ll_combine_kernel_nvfp4(LlParams p) {
    combine_one<false, true>(p);
}

// Captured steps (graph/ in epflow-kernels).
//
// `bases` is the step's [dispatch base, combine base, replay, failed, ...] in device memory (see
// `advance_step`): the numbers its operations add their places to, the replay's index, and
// whether an operation of the step timed out on this rank (set by `mark_step_failed`; never
// cleared: the group is poisoned). The step's last operation advances them after each replay;
// this one-thread kernel sets them before a replay whose channels moved on without the step
// (operations outside it took numbers in between), or before the first.
extern "C" __global__ void ep_graph_rebase(u64 bases, u64 dispatch, u64 combine, u64 replay) {
    u64* b = reinterpret_cast<u64*>(bases);
    b[0] = dispatch;
    b[1] = combine;
    b[2] = replay;
}

// Rank masking from the host (epflow_core::mask; `mask.rs` in epflow-kernels). One thread each.
struct MaskParams {
    u64 signals;                     // this rank's signal page
    u64 status;                      // this rank's status page (mapped host)
    u64 peer_signals[EP_MAX_RANKS];  // every rank's signal page
    u64 bits;                        // ep_mask_spread: the ranks to mask
    u64 epoch;                       // ep_mask_rejoin: the number of this unmask_all (1, 2, ...)
    u64 next[3];                     // ep_mask_rejoin: this rank's next operation number per channel
    u64 timeout_ns;
    int rank, num_ranks;
};
static_assert(sizeof(MaskParams) == 136, "MaskParams layout");

// Waits until, for every rank r, word first[r * stride] of this rank's mask area has reached
// `m.epoch` (with `skip_masked`, not for a rank the mask word names); false, with the first
// missing rank reported as `err`, at the deadline. The boards of `ep_meet` and `ep_mask_rejoin`.
__device__ bool board_wait(const MaskParams& m, const u64* first, int stride, bool skip_masked, int err, u64 deadline) {
    const u64* area = mask_area(reinterpret_cast<u64*>(m.signals));
    for (int r = 0; r < m.num_ranks; r++) {
        while (ld_acquire_sys(first + (size_t)r * stride) < m.epoch &&
               !(skip_masked && ((ld_acquire_sys(area) >> r) & 1ull))) {
            if (globaltimer_ns() > deadline) {
                report_error(reinterpret_cast<u64*>(m.status), err, r, m.epoch);
                return false;
            }
        }
    }
    return true;
}

// `GpuRank::meet_on` (every rank, the same number of times): meeting number `epoch`. This rank's
// board word on every rank goes to `epoch`, then it waits until every rank's word on its own
// board has (a masked rank is not waited for). At the deadline it reports the first missing rank.
extern "C" __global__ void ep_meet(MaskParams m) {
    u64* area = mask_area(reinterpret_cast<u64*>(m.signals));
    for (int r = 0; r < m.num_ranks; r++) {
        st_release_sys(mask_area(reinterpret_cast<u64*>(m.peer_signals[r])) + EP_MASK_MEET + m.rank, m.epoch);
    }
    board_wait(m, area + EP_MASK_MEET, 1, true, EP_ERR_MEET, globaltimer_ns() + m.timeout_ns);
}

// `GpuRank::mask_ranks`: ORs `bits` into every rank's word (this one's first) and mirrors it.
extern "C" __global__ void ep_mask_spread(MaskParams m) {
    mask_everywhere(m.signals, m.peer_signals, m.status, m.rank, m.num_ranks, m.bits);
}

// Waits until board word `i` of every rank in this rank's mask area reaches `epoch`; false (and
// the first missing rank reported) at the deadline.
__device__ bool rejoin_meet(const MaskParams& m, u64* area, int i, u64 deadline) {
    return board_wait(m, area + EP_MASK_REJOIN + i, 5, false, EP_ERR_REJOIN, deadline);
}

// `GpuRank::unmask_all` (every rank, no operation in flight): post this rank's next operation
// numbers on every rank's board and meet; take the largest of each channel; set every credit of
// this rank's page as if every operation before it had been consumed, clear the local counters
// and the mask word, and tell the host the numbers; meet again (nobody sends before every rank has
// reset, so no credit written for a new operation is overwritten).
extern "C" __global__ void ep_mask_rejoin(MaskParams m) {
    u64* page = reinterpret_cast<u64*>(m.signals);
    u64* area = mask_area(page);
    u64* status = reinterpret_cast<u64*>(m.status);
    const u64 deadline = globaltimer_ns() + m.timeout_ns;
    for (int r = 0; r < m.num_ranks; r++) {
        u64* b = mask_area(reinterpret_cast<u64*>(m.peer_signals[r])) + EP_MASK_REJOIN + m.rank * 5;
        for (int c = 0; c < 3; c++) st_relaxed_sys(b + 1 + c, m.next[c]);
        st_release_sys(b, m.epoch);
    }
    if (!rejoin_meet(m, area, 0, deadline)) return;
    u64 next[3] = {0, 0, 0};
    for (int r = 0; r < m.num_ranks; r++) {
        for (int c = 0; c < 3; c++) next[c] = max(next[c], ld_acquire_sys(area + EP_MASK_REJOIN + r * 5 + 1 + c));
    }
    for (int c = 0; c < 3; c++) {
        for (int set = 0; set < EP_MAX_SETS; set++) {
            for (int r = 0; r < EP_MAX_RANKS; r++) {
                *sig_at(page, EP_SIG_CONSUMED(c), set, r) = next[c] << 1;
                *sig_at(page, EP_SIG_SENT(c), set, r) = 0ull;
            }
        }
    }
    for (int set = 0; set < EP_MAX_SETS; set++) {
        for (int c = 0; c < 3; c++) *sig_at(page, EP_SIG_DONE, set, c) = 0ull;
    }
    *area = 0ull;
    for (int c = 0; c < 3; c++) st_relaxed_sys(status + EP_STATUS_REJOIN + c, next[c]);
    st_relaxed_sys(status + EP_STATUS_MASK, 0ull);
    __threadfence_system();
    for (int r = 0; r < m.num_ranks; r++) {
        st_release_sys(mask_area(reinterpret_cast<u64*>(m.peer_signals[r])) + EP_MASK_REJOIN + m.rank * 5 + 4, m.epoch);
    }
    rejoin_meet(m, area, 4, deadline);
}
