// epflow low-latency kernels, part 7 of 7 (after ll.cu): a low-latency handle built on the
// device.
//
// `ep_ll_handle` (one block) turns the caller's `topk_idx` [B x K] int64 into the start of a
// low-latency handle's memory, so that neither `topk_idx` nor the send slots cross to the host:
// - the handle's copy of each row, sanitized as `routed_entry` does (the entries from the row's
//   first invalid one on, outside [-1, E) or naming an expert an earlier entry named, become -1);
// - for a rank-major handle whose dispatches compact (`slots` != 0), per destination d and token
//   t < B, the token's place among this rank's tokens routed to d, or -1 (`slots[d * M + t]`, as
//   `epflow_core::routing::compacted_slots` numbers them; the slots of tokens B..M are not
//   written: no dispatch reads them): each tile of blockDim.x tokens is
//   numbered with one ballot per destination and warp, a scan of the warps' counts, and the
//   running count of the tiles before; then, after the [R x M] slots, the tokens routed to each
//   destination ([R] int32: what its dispatches announce when the host has not read them,
//   `announced_rows`);
// - in mapped host memory `report` (int64): [0] the first invalid entry t * K + k, [1] its value,
//   [2] the earlier k it repeats (or -1), written only for an invalid routing (the host sets [0]
//   to -1 before the launch: a valid routing crosses nothing to the host), then, with
//   `counts_to_host` (an awaited creation, whose host reads them), [3 + d] the tokens routed to
//   destination d (the messages its dispatches announce in the arrival word). The host reads them
//   after the kernel's event (epflow-kernels `ll/handle.rs`).
// The block's threads are a multiple of 32, at most EP_LL_HANDLE_BLOCK.

#define EP_LL_HANDLE_BLOCK 1024

extern "C" __global__ void __launch_bounds__(EP_LL_HANDLE_BLOCK)
    ep_ll_handle(u64 topk_in, u64 topk_out, u64 slots_out, u64 report, int B, int K, int E, int L, int R, int M,
                 int counts_to_host) {
    __shared__ int warp_base[EP_LL_HANDLE_BLOCK / 32][EP_MAX_RANKS];
    __shared__ int base[EP_MAX_RANKS];
    __shared__ int first_bad;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const long long* in = reinterpret_cast<const long long*>(topk_in);
    long long* out = reinterpret_cast<long long*>(topk_out);
    int* slots = reinterpret_cast<int*>(slots_out);
    if (threadIdx.x < EP_MAX_RANKS) base[threadIdx.x] = 0;
    if (threadIdx.x == 0) first_bad = 0x7fffffff;
    __syncthreads();
    for (int tile = 0; tile < B; tile += blockDim.x) {
        const int t = tile + threadIdx.x;
        unsigned reach = 0;  // bit d: the token reaches rank d
        if (t < B) {
            // Every load of the row in flight at once (unrolled), then the checks and the copy.
            long long row[EP_MAX_TOPK];
#pragma unroll
            for (int k = 0; k < EP_MAX_TOPK; ++k) row[k] = k < K ? in[(size_t)t * K + k] : -1;
            const int bad = topk_first_invalid(row, K, E);
            if (bad < K) atomicMin(&first_bad, t * K + bad);
#pragma unroll
            for (int k = 0; k < EP_MAX_TOPK; ++k) {
                if (k >= K) continue;
                const long long e = k < bad ? row[k] : -1;
                out[(size_t)t * K + k] = e;
                // 32-bit: a kept expert is below E.
                if (e >= 0) reach |= 1u << ((int)e / L);
            }
        }
        if (slots == nullptr) continue;
        int before[EP_MAX_RANKS];  // this token's place among its warp's tokens reaching d
#pragma unroll
        for (int d = 0; d < EP_MAX_RANKS; ++d) {
            const unsigned hits = __ballot_sync(EP_FULL_MASK, (reach >> d) & 1u);
            before[d] = __popc(hits & ((1u << lane) - 1u));
            if (lane == 0 && d < R) warp_base[warp][d] = __popc(hits);
        }
        __syncthreads();
        if ((int)threadIdx.x < R) {
            // Destination d's warp counts become the warps' first slots (after the tiles before).
            const int d = threadIdx.x;
            int run = base[d];
            for (int w = 0; w < warps; ++w) {
                const int c = warp_base[w][d];
                warp_base[w][d] = run;
                run += c;
            }
            base[d] = run;
        }
        __syncthreads();
        if (t < B) {
            for (int d = 0; d < R; ++d) {
                slots[(size_t)d * M + t] = (reach >> d) & 1u ? warp_base[warp][d] + before[d] : -1;
            }
        }
        __syncthreads();  // the next tile rewrites warp_base
    }
    __syncthreads();
    long long* rep = reinterpret_cast<long long*>(report);
    if (threadIdx.x == 0 && first_bad != 0x7fffffff) report_invalid_entry(in, K, first_bad, rep);
    if ((int)threadIdx.x < R) {
        if (counts_to_host) rep[3 + threadIdx.x] = slots != nullptr ? base[threadIdx.x] : 0;
        if (slots != nullptr) slots[(size_t)R * M + threadIdx.x] = base[threadIdx.x];
    }
}
