// FP8 (e4m3) weights with one float32 scale per output row (cupy_llama/fp8.py is the
// reference, bit for bit).
//
// quantize_rows_kernel: w [N, K] bf16 -> codes [N, K] e4m3 (uint8), scale [N] float32, with
// scale = max(max|w[n, :]| / 448, FLT_MIN) and codes = e4m3(w / scale): IEEE division,
// then the hardware's round-to-nearest-even, saturating conversion (sm_89+). Codes may be
// written at an offset inside a larger matrix (the q/k/v or gate/up rows side by side).
// Launch: grid (N), block (FP8_THREADS).
//
// (scale_product_kernel, at the end: the scales of cuBLASLt's FP8 products.)
//
// dequantize_rows_kernel: codes [N, K] and scale [N] -> w [N, K] bf16 = bf16(value * scale),
// for the products that go to cuBLAS (more than 16 rows). Each thread converts one 8-byte
// word of codes (e4m3x8_to_bf16x8, common.cuh). Needs K % 8 == 0 and 16-byte aligned rows.
// Launch: grid (ceil(N * K / 8 / FP8_THREADS)), block (FP8_THREADS).

#include "common.cuh"

#define FP8_THREADS 256
#define E4M3_MAX 448.0f
#define FLOAT32_TINY 1.17549435e-38f  // the smallest normal float32, 2^-126

// two floats -> two e4m3 codes in the low 16 bits (lo in the low byte)
__device__ __forceinline__ unsigned short float2_to_e4m3x2(float lo, float hi) {
    unsigned short out = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(out) : "f"(hi), "f"(lo));
#else
    __trap();  // the loader refuses FP8 quantization before sm_89
#endif
    return out;
}

extern "C" __global__ void quantize_rows_kernel(const bf16* __restrict__ w,
                                                unsigned char* __restrict__ codes,
                                                float* __restrict__ scale, int k) {
    __shared__ float scratch[WARP_SIZE];
    const long long row = blockIdx.x;
    const bf16* src = w + row * k;
    float amax = 0.0f;
    for (int j = threadIdx.x; j < k; j += blockDim.x) amax = fmaxf(amax, fabsf(to_float(src[j])));
    amax = warp_max(amax);  // then over the block's warps
    __syncthreads();
    if (threadIdx.x % WARP_SIZE == 0) scratch[threadIdx.x / WARP_SIZE] = amax;
    __syncthreads();
    const int num_warps = (blockDim.x + WARP_SIZE - 1) / WARP_SIZE;
    amax = warp_max(threadIdx.x % WARP_SIZE < num_warps ? scratch[threadIdx.x % WARP_SIZE] : 0.0f);
    const float s = fmaxf(__fdiv_rn(amax, E4M3_MAX), FLOAT32_TINY);
    unsigned char* dst = codes + row * k;
    for (int j = 2 * threadIdx.x; j < k; j += 2 * blockDim.x) {
        const float lo = __fdiv_rn(to_float(src[j]), s);
        const float hi = j + 1 < k ? __fdiv_rn(to_float(src[j + 1]), s) : 0.0f;
        const unsigned short pair = float2_to_e4m3x2(lo, hi);
        dst[j] = (unsigned char)(pair & 0xFF);
        if (j + 1 < k) dst[j + 1] = (unsigned char)(pair >> 8);
    }
    if (threadIdx.x == 0) scale[row] = s;
}

extern "C" __global__ void dequantize_rows_kernel(const uint2* __restrict__ codes,
                                                  const float* __restrict__ scale,
                                                  uint4* __restrict__ w, int k,
                                                  long long num_words) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= num_words) return;
    const int words_per_row = k / 8;
    const float s = scale[i / words_per_row];
    float v[8];
    unpack_bf16x8(e4m3x8_to_bf16x8(codes[i]), v);
    unsigned packed[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) packed[j] = pack_bf16x2(v[2 * j] * s, v[2 * j + 1] * s);
    w[i] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// scale_product_kernel: the float32 sums of a product of e4m3 codes, acc [M, N] (cuBLASLt's
// FP8 product, gemm.py), times each x row's scale and each weight row's scale:
// out[m, n] = acc[m, n] * x_scale[m] * w_scale[n], stored as bf16 (OUT_BF16), float32
// (OUT_F32) or added to a float32 out (OUT_F32_ADD: the residual stream).
// Launch: grid (ceil(M * N / FP8_THREADS)), block (FP8_THREADS).
#define OUT_BF16 0
#define OUT_F32 1
#define OUT_F32_ADD 2

extern "C" __global__ void scale_product_kernel(const float* __restrict__ acc,
                                                const float* __restrict__ x_scale,
                                                const float* __restrict__ w_scale,
                                                void* __restrict__ out, int n,
                                                long long total, int out_mode) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const float v = acc[i] * x_scale[i / n] * w_scale[i % n];
    if (out_mode == OUT_BF16) static_cast<bf16*>(out)[i] = to_bf16(v);
    else if (out_mode == OUT_F32) static_cast<float*>(out)[i] = v;
    else static_cast<float*>(out)[i] += v;
}
