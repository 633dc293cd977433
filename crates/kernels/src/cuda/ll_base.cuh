// epflow low-latency kernels, part 1 of 7. NVRTC compiles common.cuh, then ll_base.cuh,
// ll_tagged.cuh, ll_send.cuh, ll_receive.cuh, ll_combine.cuh, ll.cu and ll_handle.cuh in that
// order as one unit (epflow-kernels compile/sources.rs). This part: the message formats, the parameter block,
// operation numbers, the trace, rank masking and credit waits.
//
// epflow low-latency dispatch and combine: a send half and a complete half, launched as two
// kernels (staged operations) or as one (the synchronous form; see the kernels in ll.cu).
//
// Dispatch message (one per token and destination rank), in the receiver's region for this
// sender, slot = token index (rank-major over NVLink, from a handle's dispatch: slot = the
// token's place among the sender's tokens routed to the receiver, `send_slot`, so the receiver
// copies slot i into its output row i without reading the headers first): [u64 seq+1][i32
// token][i32 1: the sender's combine wants tagged rows (`wants_tagged`), else 0][i16 local
// expert per k, -1 if the k-th expert is elsewhere (bytes 16..48)][rank-major: f32 weight per k
// (bytes 48..112)][pad to 128 B][payload: BF16 row, or FP8 row + fp32 scales]. Tagged (a dispatch of at most
// EP_TAG_TOKENS tokens, `sends_tagged`): the same message with each 4-byte word as an 8-byte
// pair {word, tag}, in the receiver's tagged dispatch area at [sender][token], one for every
// token (a token routed elsewhere sends only its header, every local expert -1), or compacted
// as the plain messages from a rank-major handle (at [sender][send_slot], routed tokens only).
// Combine message (one per token and expert; rank-major: one per token and rank reached, in the
// slot of the rank's first top-k entry): the BF16 row, in the source rank's region at [token][k];
// or, tagged (see EP_TAG_TOKENS), in the source rank's tagged area at [token][sending rank]
// (rank-major) or [token][k] (expert-major).
//
// Layouts (epflow_core::ops::Layout): expert-major packs a row per (token, local expert) into
// [L x R*M x H]; rank-major packs a row per (source, token) into [R*M x H] with the weights and
// local expert indices [R*M x K], and its combine adds the pre-reduced rows with weight 1.

struct LlParams {
    // Pointers (device addresses; host_counts and status are mapped host memory).
    u64 x;            // dispatch: tokens [B x H] BF16
    u64 topk_idx;     // [B x K] int64 (the handle's copy)
    u64 weights;      // combine: [B x K] fp32
    u64 row_of;       // [R x M x K] int32: expert-output row of each received (source, token, k)
    u64 out;          // dispatch: [L x R*M x H]; combine: [B x H] BF16
    u64 out_scales;   // dispatch FP8: [L x R*M x H/128] fp32
    u64 out_counts;   // dispatch: [L] int32 (device)
    u64 host_counts;  // dispatch: [L] int32 (mapped host) or 0
    u64 expert_out;   // combine: [L x R*M x H] BF16
    u64 signals;      // this rank's signal page
    u64 status;       // this rank's status page (mapped host)
    u64 own_recv;     // this rank's receive region of this channel
    u64 peer_recv[EP_MAX_RANKS];     // every rank's receive region of this channel
    u64 peer_signals[EP_MAX_RANKS];  // every rank's signal page
    u64 seq;          // operation number on this channel
    u64 timeout_ns;
    u64 recv_set_bytes;  // bytes of one buffer set of the receive region
    u64 msg_bytes;       // dispatch message bytes
    int rank, num_ranks, max_tokens, hidden;
    int top_k, num_local, num_tokens, set;
    int num_sets, fp8, round_scales, cancelled;
    int splits, chunks, nccl_mask, rank_major;
    // Ranks in `nccl_mask` are reached through NCCL (nccl.rs), not NVLink: the send kernels write
    // their messages into local staging (`nccl_out` + dest * `nccl_dest_bytes`), skip their
    // credits, and NCCL carries the staging and the arrival word after the kernel.
    u64 nccl_out;
    u64 nccl_in;          // combine: the packed rows NCCL delivered, [rows x H] BF16
    u64 nccl_pack;        // [R x M x K] int32: combine row index in the staging for that source, or -1
    u64 nccl_counts;      // dispatch: [R] int32 (mapped host): rows each NCCL source gets back in combine
    u64 nccl_pos;         // combine: [M x K] int32: row of (t, k) in `nccl_in`, or -1 (arrived over NVLink)
    u64 nccl_dest_bytes;  // staging bytes per destination
    u64 stamp;            // what every rank must agree on (epflow_core::stamp), checked per source
    u64 out_weights;      // rank-major dispatch: [R*M x K] fp32 received weights
    u64 out_idx;          // rank-major dispatch: [R*M x K] int32 local expert per top-k entry, or -1
    int recv_chunks;      // complete half: pieces a received row is copied (dispatch) or summed (combine) in
    int masking;          // 1: rank masking (epflow_core::mask): a peer that misses the deadline is masked
    // Operations captured in a CUDA graph (graph/ in epflow-kernels): the operation number is
    // `seq` (the operation's place on its channel within the captured step) plus the channel's
    // base, the u64 at `seq_base` in device memory, read when the kernel starts (the step advances
    // it after every replay); `set` follows from it. 0 for operations the host numbers.
    u64 seq_base;
    u64 verdict;          // captured: the step's failure word (mapped host), or 0 (see `report_failure`)
    u64 topk_src;         // captured dispatch, or one on a handle created in a stream's order: the caller's
                          // [B x K] int64 top-k buffer (see `routed_entry`), or 0
    u64 route_report;     // with `topk_src`: the handle's report of invalid rows (mapped host)
    u64 masked_out;       // combine with masking: [B] int32, per token its top-k entries on absent ranks, or 0
    // The handle's return list (written by one block of the dispatch receive, read by the
    // combine send): per source s, in (token, k) order, the entries t * K + k whose rows come back, at
    // ret_list[s * M * K ..][0 .. ret_count[s]] (a fixed place per source, so a combine warp
    // loads its first entry without waiting for the count); combine's warps share out only real
    // rows.
    u64 ret_list;         // [R x M x K] int32
    u64 ret_count;        // [R] int32
    int trace;            // 1: `EPFLOW_LL_TRACE` (see `trace_at`)
    int tag_tokens;       // most tokens of a combine that takes tagged rows (0: none; see `wants_tagged`, EP_TAG_TOKENS)
    int tag_dispatch_tokens;  // most tokens of a dispatch sent as tagged messages (0: none; see `sends_tagged`)
    // A rank-major dispatch on a handle (not captured): [R x M] int32 in the handle, per
    // (destination, token) the slot its plain message takes there (its place among this rank's
    // tokens routed to that destination), or -1 (not routed there); 0: messages at their tokens'
    // slots. Not for destinations reached through NCCL (nor for this rank itself when it has
    // such peers: NCCL carries its own arrival pair to them). Tagged sends use the same slots in
    // the tagged area. The per-destination counts follow the slots: [R] int32 at
    // send_slot + R * M * 4 (written by the handle's kernel, `ep_ll_handle`).
    u64 send_slot;
    // With `send_slot`: per destination, its messages (announced in the arrival word), or -1:
    // read them from the handle, after the slots (a handle built in stream order, whose counts
    // the host never saw).
    int send_rows[EP_MAX_RANKS];
    // A forwarded dispatch (epflow_core::DispatchDtype::Forwarded; fp8 = 0): each token is
    // `fwd_token_bytes` bytes at x + t * fwd_token_bytes and `fwd_scale_bytes` at
    // x_scales + t * fwd_scale_bytes, both multiples of 16, carried unchanged as the first
    // fwd_token_bytes + fwd_scale_bytes bytes of the BF16 message payload (2 H bytes), and
    // written to out (rows of fwd_token_bytes) and out_scales (rows of fwd_scale_bytes).
    // 0: a BF16 or FP8 dispatch.
    // A combine that travels as NVFP4 (epflow_core::nvfp4; `nvfp4` 1, its `_nvfp4` kernels):
    // `x_scales` holds each expert output row's fp32 global scale, and each row goes back as
    // [g: fp32, padded to 16 B][H / 2 bytes of E2M1 codes][H / 16 E4M3 block scales] at the
    // start of its BF16 slot.
    u64 x_scales;
    int fwd_token_bytes, fwd_scale_bytes;
    int nvfp4, pad_nvfp4;
};
// The Rust mirror (epflow-kernels params.rs) must agree byte for byte.
static_assert(sizeof(LlParams) == 536, "LlParams layout");

// The messages a compacted dispatch sends to `dest` (see `LlParams::send_rows`).
__device__ __forceinline__ int announced_rows(const LlParams& p, int dest) {
    const int rows = p.send_rows[dest];
    if (rows >= 0) return rows;
    return reinterpret_cast<const int*>(p.send_slot)[(size_t)p.num_ranks * p.max_tokens + dest];
}

// The number and buffer set of the operation a launch runs: the host's, or for a captured
// operation its offset plus the step's base in device memory (written by an earlier kernel of the
// stream: the previous replay's advance, or a rebase). `dead`: a captured operation of a step
// that already timed out on this rank (it does nothing, so a failed replay ends at once).
struct OpNum {
    u64 seq;
    int set;
    bool dead;
};

// The step's bases are [dispatch, combine, replay, failed, dispatches, combines, last] (see
// `advance_step`); `seq_base` points at the channel's. `last` is EP_NUMBERED_PER_OP for the
// bases of operations numbered on the device one by one (`graph/numbered.rs`).
#define EP_NUMBERED_PER_OP 0xffffffffffffffffull
__device__ __forceinline__ u64* step_failed_flag(const LlParams& p, int chan) {
    return reinterpret_cast<u64*>(p.seq_base) - chan + 3;
}

__device__ __forceinline__ OpNum op_num(const LlParams& p, int chan) {
    if (!p.seq_base) return OpNum{p.seq, p.set, false};
    const u64 seq = p.seq + __ldcg(reinterpret_cast<const u64*>(p.seq_base));
    return OpNum{seq, (int)(seq % (u64)p.num_sets), __ldcg(step_failed_flag(p, chan)) != 0};
}

// `EPFLOW_LL_TRACE=1` (a diagnostic, off by default): block 0's thread 0 stamps the global
// timer at the kernel's entry (0), after its send part (1), once every source arrived (2) and
// when its receive work is done (3), per channel; block 0 also when its `done` count returned
// (4), and the last block when it starts returning the credits (5). The last block to finish
// prints them every 64th operation, relative to the entry (of the send kernel, in the
// two-launch form), with the end after the credits. One set of stamps per GPU (a module global):
// ranks sharing a GPU mix.
__device__ u64 ep_ll_trace[2][6];

__device__ __forceinline__ void trace_at(const LlParams& p, int chan, int i) {
    if (p.trace && blockIdx.x == 0 && threadIdx.x == 0) ep_ll_trace[chan][i] = globaltimer_ns();
}

// The last block's report of the stamps (out of line: the printf's frame stays off the kernels).
__device__ __noinline__ void trace_print(int rank, int chan, u64 seq) {
    const u64 end = globaltimer_ns();
    const volatile u64* t = ep_ll_trace[chan];
    const u64 t0 = t[0];
    // A stamp this operation did not write (older than its entry) prints as -1.
    double us[6];
    for (int i = 1; i < 6; i++) us[i] = t[i] >= t0 ? (t[i] - t0) * 1e-3 : -1.0;
    printf("EPFLOW_LL_TRACE rank %d %s seq %llu: entry at %.2f us (global timer mod 1 s: compare ranks), block 0 "
           "sent %.2f, all arrived %.2f, received %.2f, done-add %.2f; last block's credits %.2f, end %.2f us after "
           "the entry\n",
           rank, chan == 0 ? "dispatch" : "combine", (unsigned long long)seq, (double)(t0 % 1000000000ull) * 1e-3,
           us[1], us[2], us[3], us[4], us[5], (end - t0) * 1e-3);
}

// A captured operation timed out: the step's later operations on this rank skip their work.
__device__ __forceinline__ void mark_step_failed(const LlParams& p, int chan) {
    if (p.seq_base) atomicExch(step_failed_flag(p, chan), 1ull);
}

// Tagged data (a dispatch message, a combine row, or a block of `land_tagged`'s meeting) that
// never came by the deadline, from `src`: reported like a missing arrival, the captured step
// marked failed.
__device__ __forceinline__ void report_lost(const LlParams& p, const OpNum& n, int chan, int src) {
    report_error(reinterpret_cast<u64*>(p.status), EP_ERR_TIMEOUT_ARRIVAL, src, n.seq);
    mark_step_failed(p, chan);
}

__device__ __forceinline__ bool via_nccl(const LlParams& p, int r) { return (p.nccl_mask >> r) & 1; }

// Rank masking (epflow_core::mask): this rank's mask word (0 without masking).
__device__ __forceinline__ u64 mask_word(const LlParams& p) {
    return p.masking ? ld_acquire_sys(mask_area(reinterpret_cast<u64*>(p.signals))) : 0ull;
}

// Whether mask word `m` masks rank `a` or rank `b` (a pair that exchanges nothing).
__device__ __forceinline__ bool either_masked(u64 m, int a, int b) { return ((m >> a) | (m >> b)) & 1ull; }

// ORs `bits` into this rank's mask word, then into every peer's (the masked ranks' own included,
// so they learn it), and mirrors this rank's word in its status page for its host.
__device__ void mask_everywhere(u64 signals, const u64* peer_signals, u64 status, int rank, int num_ranks, u64 bits) {
    u64* own = mask_area(reinterpret_cast<u64*>(signals));
    atomicOr(own, bits);
    for (int r = 0; r < num_ranks; r++) {
        if (r != rank) atomicOr_system(mask_area(reinterpret_cast<u64*>(peer_signals[r])), bits);
    }
    __threadfence_system();
    st_relaxed_sys(reinterpret_cast<u64*>(status) + EP_STATUS_MASK, ld_acquire_sys(own));
}

// This rank gave up on the ranks of `bits`: masks them everywhere, unless this rank finds itself
// masked — then it masks no one (a slow rank never masks the survivors that gave up on it).
__device__ void spread_mask(const LlParams& p, u64 bits) {
    if ((ld_acquire_sys(mask_area(reinterpret_cast<u64*>(p.signals))) >> p.rank) & 1ull) return;
    mask_everywhere(p.signals, p.peer_signals, p.status, p.rank, p.num_ranks, bits);
}

// Whether operation `n` waits for a credit from `dest` (not at the first use of its buffer set,
// nor from a destination reached through NCCL), and the word of `chan` it comes in.
__device__ __forceinline__ bool needs_credit(const LlParams& p, const OpNum& n, int dest) {
    return n.seq >= (u64)p.num_sets && !via_nccl(p, dest);
}
__device__ __forceinline__ const u64* credit_word(const LlParams& p, const OpNum& n, int chan, int dest) {
    return sig_at(reinterpret_cast<u64*>(p.signals), EP_SIG_CONSUMED(chan), n.set, dest);
}

// A first look at the credit word (an acquire, as every look of `wait_credit`), which a send loads
// beside its other first loads rather than after them (one round trip less before its first
// store: 0.15-0.3 us per half below 128 tokens, benches/NOTES.md item 183); 0 where no credit is
// needed, or for a spare warp's `dest` (num_ranks or more).
__device__ __forceinline__ u64 credit_first_look(const LlParams& p, const OpNum& n, int chan, int dest) {
    if (dest >= p.num_ranks || !needs_credit(p, n, dest)) return 0ull;
    return ld_acquire_sys(credit_word(p, n, chan, dest));
}

// Waits (lane 0) for destination `dest`'s credit for this operation's set; `first` is this
// thread's `credit_first_look`, and the wait ends at once if it already holds the credit. With
// masking it stops when `dest` is masked (by a peer, or here at the deadline) and returns true:
// skip `dest`.
__device__ bool wait_credit(const LlParams& p, const OpNum& n, int chan, int dest, u64 first) {
    if (!needs_credit(p, n, dest)) return false;
    const u64* c = credit_word(p, n, chan, dest);
    const u64 want = n.seq + 1 - p.num_sets;
    if ((first >> 1) >= want) return false;
    const u64 deadline = globaltimer_ns() + p.timeout_ns;
    while ((ld_acquire_sys(c) >> 1) < want) {
        if ((mask_word(p) >> dest) & 1ull) return true;
        if (globaltimer_ns() > deadline) {
            if (p.masking) {
                spread_mask(p, 1ull << dest);
                return true;
            }
            report_error(reinterpret_cast<u64*>(p.status), EP_ERR_TIMEOUT_CREDIT, dest, n.seq);
            mark_step_failed(p, chan);
            return false;
        }
    }
    return false;
}

#define EP_HDR_WEIGHTS 48  // byte offset of the rank-major weights in a dispatch message header

