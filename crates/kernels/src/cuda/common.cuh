// epflow: device helpers shared by every kernel. Compiled at run time with NVRTC (sm_90).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

typedef unsigned long long u64;
typedef unsigned int u32;

#define EP_MAX_RANKS 8
#define EP_MAX_TOPK 16
#define EP_MAX_SETS 16
#define EP_HDR_BYTES 128
#define EP_FULL_MASK 0xffffffffu

// Host-visible status page (pinned, mapped): [0] = first error (0 = none), then per
// (channel, set) the cancellation mask of the last completed operation. Channels: 0 dispatch,
// 1 combine, 2 handle (the high-throughput count exchange).
#define EP_ERR_TIMEOUT_ARRIVAL 1ull
#define EP_ERR_TIMEOUT_CREDIT 2ull
#define EP_ERR_TIMEOUT_RING 3ull

// The signal page of a rank starts with arrays of u64 indexed [array][set][rank].
#define EP_SIG_ARRIVED(chan) (chan)        // written by senders: ((seq + 1) << 1) | cancelled
#define EP_SIG_CONSUMED(chan) (3 + (chan)) // written by receivers: (seq + 1) << 1 (the sender's credit)
#define EP_SIG_SENT(chan) (6 + (chan))     // local: warps done sending, per destination
#define EP_SIG_DONE 9                      // local: blocks done receiving, [set][chan]
#define EP_SIG_ARRAYS 10
#define EP_SIG_ARRAY_WORDS (EP_SIG_ARRAYS * EP_MAX_SETS * EP_MAX_RANKS)

__device__ __forceinline__ u64* sig_at(u64* page, int array, int set, int rank) {
    return page + ((size_t)array * EP_MAX_SETS + set) * EP_MAX_RANKS + rank;
}

__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(u64* p, u64 v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ u64 atom_add_acq_rel_gpu(u64* p, u64 v) {
    u64 old;
    asm volatile("atom.add.acq_rel.gpu.global.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}

__device__ __forceinline__ u64 globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// 16-byte loads that bypass L1 (data written by peers or by earlier kernels).
__device__ __forceinline__ int4 ld_cg_int4(const void* p) {
    return __ldcg(reinterpret_cast<const int4*>(p));
}

// 16-byte stores that do not allocate in L1 (bulk payload, often to a peer).
__device__ __forceinline__ void st_na_int4(void* p, int4 v) {
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
}

// Records the first error in the host-visible status page: code | peer << 8 | seq << 16.
__device__ __forceinline__ void report_error(u64* status, u64 code, int peer, u64 seq) {
    st_relaxed_sys(status, code | ((u64)peer << 8) | (seq << 16));
}

// Waits until (*p >> 1) == want (acquire); false on timeout. *seen gets the last value.
__device__ __forceinline__ bool wait_signal(const u64* p, u64 want, u64 deadline, u64* seen) {
    u64 v = ld_acquire_sys(p);
    while ((v >> 1) != want) {
        if (globaltimer_ns() > deadline) {
            *seen = v;
            return false;
        }
        v = ld_acquire_sys(p);
    }
    *seen = v;
    return true;
}

// Waits until (*p >> 1) >= want (acquire); false on timeout.
__device__ __forceinline__ bool wait_at_least(const u64* p, u64 want, u64 deadline) {
    while ((ld_acquire_sys(p) >> 1) < want) {
        if (globaltimer_ns() > deadline) return false;
    }
    return true;
}

// Rounds a positive finite scale up to a power of two (as the CPU reference does).
__device__ __forceinline__ float pow2_ceil(float s) {
    u32 b = __float_as_uint(s);
    u32 m = b & 0x007fffffu, e = b & 0x7f800000u;
    if (e == 0u || m == 0u) return s;
    return __uint_as_float(e + 0x00800000u);
}

// Copies `bytes` (a multiple of 16) with one warp, 4 vectors in flight per lane.
__device__ __forceinline__ void warp_copy(void* dst, const void* src, size_t bytes, int lane) {
    const size_t n = bytes / 16;
    const char* s = reinterpret_cast<const char*>(src);
    char* d = reinterpret_cast<char*>(dst);
    size_t i = lane;
    for (; i + 96 < n; i += 128) {
        int4 a = ld_cg_int4(s + i * 16), b = ld_cg_int4(s + (i + 32) * 16);
        int4 c = ld_cg_int4(s + (i + 64) * 16), e = ld_cg_int4(s + (i + 96) * 16);
        st_na_int4(d + i * 16, a);
        st_na_int4(d + (i + 32) * 16, b);
        st_na_int4(d + (i + 64) * 16, c);
        st_na_int4(d + (i + 96) * 16, e);
    }
    for (; i < n; i += 32) st_na_int4(d + i * 16, ld_cg_int4(s + i * 16));
}
