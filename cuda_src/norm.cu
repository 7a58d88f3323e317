// RMSNorm of bf16 or float32 rows (the residual add rides in the products, gemv.cu).
// Launch: grid (num_rows), block (256..1024, a multiple of 32); one block per row.
// `out` may alias `x`: every element is read (pass 1) before the block barrier inside
// block_sum, and pass 2 reads and writes each element from the same thread.
//
// Rows may be bf16 or float32 (R): the model keeps its residual stream in float32, as a
// sublayer's small update added to a large bf16 residual would lose most of its bits.

#include "common.cuh"

__device__ __forceinline__ float load_f(const bf16* p) { return to_float(*p); }
__device__ __forceinline__ float load_f(const float* p) { return *p; }

// out = x / sqrt(mean(x^2) + eps) * weight; x, out [T, H], weight [H]
template <typename R>
__device__ void rms_norm_row(const R* x, const bf16* __restrict__ weight, bf16* out,
                             int hidden, float eps) {
    __shared__ float scratch[WARP_SIZE];
    const long long row = (long long)blockIdx.x * hidden;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = load_f(x + row + i);
        sum_sq += v * v;
    }
    const float inv_rms = rms_inv(block_sum(sum_sq, scratch), hidden, eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[row + i] = to_bf16(rms_scaled(load_f(x + row + i), inv_rms, to_float(weight[i])));
}

extern "C" __global__ void rms_norm_kernel(const bf16* x, const bf16* __restrict__ weight,
                                           bf16* out, int hidden, float eps) {
    rms_norm_row(x, weight, out, hidden, eps);
}

extern "C" __global__ void rms_norm_f32_kernel(const float* x, const bf16* __restrict__ weight,
                                               bf16* out, int hidden, float eps) {
    rms_norm_row(x, weight, out, hidden, eps);
}
