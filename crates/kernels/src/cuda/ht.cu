// epflow high-throughput kernels, part 4 of 5 (after ht_receive.cuh): the dispatch and combine
// kernels. Handle creation's kernels follow in ht_handle.cuh.

// High-throughput dispatch (forward or backward), one launch: blocks [0, C) send, [C, 2C) receive;
// a receiving block first tells its direct sources where their rows go, then helps its own
// sending block with its direct pairs, then receives. Block 0 first readies the balanced
// dispatch's pools for the next operation (`ht_pool_prepare`).
extern "C" __global__ void __launch_bounds__(HT_BLOCK) ep_ht_dispatch_kernel(HtParams p) {
    ht_pool_prepare(p);
    ht_signal_start(p);
    if ((int)blockIdx.x < p.channels) {
        ht_send<true>(p, blockIdx.x);
    } else {
        const int c = blockIdx.x - p.channels;
        ht_offer_outputs(p, c);
        ht_help_direct(p, c);
        ht_dispatch_recv(p, c);
    }
}

// High-throughput combine (forward or backward), one launch: blocks [0, C) send, [C, 2C) receive.
// With pull combine a sending block, once its offers are out, waits until its readers are done.
// One kernel per bound on the ranks, so that the receiver's loads in flight fill the registers
// the smaller bound leaves (the host picks the smallest that covers the group).
template <int NR, int G>
__device__ __forceinline__ void ht_combine(const HtParams& p) {
    ht_signal_start(p);
    if ((int)blockIdx.x < p.channels) {
        ht_send<false>(p, blockIdx.x);
        __syncthreads();
        ht_await_readers(p, blockIdx.x);
    } else {
        ht_combine_recv<NR, G>(p, blockIdx.x - p.channels);
    }
}
// Up to 8 ranks (EP_MAX_RANKS).
extern "C" __global__ void __launch_bounds__(HT_BLOCK) ep_ht_combine_kernel(HtParams p) {
    ht_combine<EP_MAX_RANKS, 2>(p);
}
// Up to 4 ranks.
extern "C" __global__ void __launch_bounds__(HT_BLOCK) ep_ht_combine_kernel_4ranks(HtParams p) {
    ht_combine<4, 4>(p);
}
// Up to 2 ranks.
extern "C" __global__ void __launch_bounds__(HT_BLOCK) ep_ht_combine_kernel_2ranks(HtParams p) {
    ht_combine<2, 8>(p);
}
