// RMSNorm and the fused residual add + RMSNorm.
// Launch: grid (num_rows), block (256..1024, a multiple of 32); one block per row.
// `out` may alias `x`: every element is read (pass 1) before the block barrier inside
// block_sum, and pass 2 reads and writes each element from the same thread.
//
// Rounding follows transformers' bf16 Llama, so greedy decoding picks the same tokens:
// the residual stream is bf16 (each add rounds), the normalized value is rounded to bf16
// before it is multiplied by the bf16 weight, and that product is rounded again.

__device__ __forceinline__ bf16 scale_row_value(float v, float inv_rms, bf16 weight) {
    return to_bf16(to_float(to_bf16(v * inv_rms)) * to_float(weight));
}

// out = x / sqrt(mean(x^2) + eps) * weight; x, out [T, H], weight [H]
extern "C" __global__ void rms_norm_kernel(const bf16* x, const bf16* __restrict__ weight,
                                           bf16* out, int hidden, float eps) {
    __shared__ float scratch[WARP_SIZE];
    const long long row = (long long)blockIdx.x * hidden;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = to_float(x[row + i]);
        sum_sq += v * v;
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[row + i] = scale_row_value(to_float(x[row + i]), inv_rms, weight[i]);
}

// residual += x (rounded to bf16), then out = rms_norm(residual) * weight, computed from
// the stored residual so the next layer sees exactly what was normalized.
extern "C" __global__ void add_rms_norm_kernel(const bf16* x, bf16* residual,
                                               const bf16* __restrict__ weight, bf16* out,
                                               int hidden, float eps) {
    __shared__ float scratch[WARP_SIZE];
    const long long row = (long long)blockIdx.x * hidden;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const bf16 sum = to_bf16(to_float(residual[row + i]) + to_float(x[row + i]));
        residual[row + i] = sum;
        const float v = to_float(sum);
        sum_sq += v * v;
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[row + i] = scale_row_value(to_float(residual[row + i]), inv_rms, weight[i]);
}
