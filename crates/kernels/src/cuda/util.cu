// epflow utilities.

// Dequantizes `rows` FP8 rows (`hidden` e4m3 values, `hidden / 128` fp32 scales each) into BF16:
// out = bf16(e4m3_to_f32(q) * scale), as the CPU reference's identity experts do.
extern "C" __global__ void ep_dequant_fp8_rows(u64 q_ptr, u64 scales_ptr, u64 out_ptr, u64 rows, int hidden) {
    const unsigned char* q = reinterpret_cast<const unsigned char*>(q_ptr);
    const float* scales = reinterpret_cast<const float*>(scales_ptr);
    __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(out_ptr);
    const u64 total = rows * (u64)hidden;
    const int cols = hidden / 128;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / hidden;
        const int c = (int)(i % hidden);
        __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q[i], __NV_E4M3);
        const float v = __half2float(*reinterpret_cast<__half*>(&h));
        out[i] = __float2bfloat16_rn(__fmul_rn(v, scales[r * cols + c / 128]));
    }
}

// Holds its stream for `ns` nanoseconds of the global timer (one thread): a deliberately slow
// consumer for tests of stream-ordered buffer release.
extern "C" __global__ void ep_spin(u64 ns) {
    u64 start;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    u64 now = start;
    while (now - start < ns) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    }
}

// Copies `bytes` (a multiple of 16) from `src` to `dst` (local or a peer's, over NVLink) with
// SM loads and stores: each warp moves 4 KB at a time, 8 vectors in flight per lane, as the
// high-throughput kernels' sending warps do. A probe of the SM-store ceiling (`nvlink_ceiling
// --sms`), not part of any operation.
extern "C" __global__ void __launch_bounds__(512) ep_sm_copy(u64 dst, u64 src, u64 bytes) {
    const u64 n = bytes / 16;
    const u64 lane = threadIdx.x & 31;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    const char* s = reinterpret_cast<const char*>(src);
    char* d = reinterpret_cast<char*>(dst);
    for (u64 base = ((u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * 256; base < n; base += warps * 256) {
        int4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const u64 i = base + 32 * u + lane;
            if (i < n) v[u] = ld_cg_int4(s + i * 16);
        }
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const u64 i = base + 32 * u + lane;
            if (i < n) st_na_int4(d + i * 16, v[u]);
        }
    }
}
