// RMSNorm of bf16 or float32 rows (the residual add rides in the products, gemv.cu), and
// the norm that adds a sublayer's output into the residual stream (Gemma's norms on the
// attention and MLP outputs).
// Launch: grid (num_rows), block (256..1024, a multiple of 32); one block per row. With
// vector != 0 (hidden % 4 == 0, every operand 16-byte aligned) each thread takes 4 adjacent
// elements at a time, in one 16-byte (float32) or 8-byte (bf16) word; else one.
// `out` may alias `x`: every element is read (pass 1) before the block barrier inside
// block_sum, and pass 2 reads and writes each element from the same thread.
// Weights scale by (offset + weight): offset 0 for Llama's norms, 1 for Gemma's.
//
// Rows may be bf16 or float32 (R): the model keeps its residual stream in float32, as a
// sublayer's small update added to a large bf16 residual would lose most of its bits.

#include "common.cuh"

#define NORM_VECTOR 4  // elements per load on the vector path

__device__ __forceinline__ float load_f(const bf16* p) { return to_float(*p); }
__device__ __forceinline__ float load_f(const float* p) { return *p; }

__device__ __forceinline__ void load4(const bf16* p, float (&v)[NORM_VECTOR]) {
    unpack_bf16x4(*reinterpret_cast<const uint2*>(p), v);
}

__device__ __forceinline__ void load4(const float* p, float (&v)[NORM_VECTOR]) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
}

// 1 / rms of this block's row of x (every thread of the block calls it)
template <typename R>
__device__ __forceinline__ float row_inv_rms(const R* x, long long row, int hidden, float eps,
                                             int vector) {
    __shared__ float scratch[WARP_SIZE];
    float sum_sq = 0.0f;
    if (vector) {
        for (int i = threadIdx.x * NORM_VECTOR; i < hidden; i += blockDim.x * NORM_VECTOR) {
            float v[NORM_VECTOR];
            load4(x + row + i, v);
#pragma unroll
            for (int k = 0; k < NORM_VECTOR; ++k) sum_sq += v[k] * v[k];
        }
    } else {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
            const float v = load_f(x + row + i);
            sum_sq += v * v;
        }
    }
    return rms_inv(block_sum(sum_sq, scratch), hidden, eps);
}

// out = x / sqrt(mean(x^2) + eps) * (offset + weight); x, out [T, H], weight [H]
template <typename R>
__device__ void rms_norm_row(const R* x, const bf16* __restrict__ weight, bf16* out,
                             int hidden, float eps, float offset, int vector) {
    const long long row = (long long)blockIdx.x * hidden;
    const float inv_rms = row_inv_rms(x, row, hidden, eps, vector);
    if (vector) {
        for (int i = threadIdx.x * NORM_VECTOR; i < hidden; i += blockDim.x * NORM_VECTOR) {
            float v[NORM_VECTOR], w[NORM_VECTOR];
            load4(x + row + i, v);
            load4(weight + i, w);
            bf16 o[NORM_VECTOR];
#pragma unroll
            for (int k = 0; k < NORM_VECTOR; ++k)
                o[k] = to_bf16(rms_scaled(v[k], inv_rms, w[k], offset));
            *reinterpret_cast<uint2*>(out + row + i) = pack_bf16x4(o);
        }
    } else {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x)
            out[row + i] = to_bf16(rms_scaled(load_f(x + row + i), inv_rms, to_float(weight[i]),
                                              offset));
    }
}

extern "C" __global__ void rms_norm_kernel(const bf16* x, const bf16* __restrict__ weight,
                                           bf16* out, int hidden, float eps, float offset,
                                           int vector) {
    rms_norm_row(x, weight, out, hidden, eps, offset, vector);
}

extern "C" __global__ void rms_norm_f32_kernel(const float* x, const bf16* __restrict__ weight,
                                               bf16* out, int hidden, float eps, float offset,
                                               int vector) {
    rms_norm_row(x, weight, out, hidden, eps, offset, vector);
}

// out [T, H] float32 = residual + x / sqrt(mean(x^2) + eps) * (offset + weight), x [T, H]
// bf16: a sublayer's output, normed in float32 and added unrounded; out is residual (in
// place) or another buffer (the model's second residual buffer, models/decoder.py). Where every thread holds at
// most one vector group (hidden <= NORM_VECTOR * blockDim.x: the launcher's thread count
// gives that up to 4,096), x, the weight and the residual are loaded once, together, before
// the sum (one round trip to memory, not two); the sums and roundings are the loops'.
// It may be launched programmatically (common.cuh): the weight loads before it waits for
// the kernel before (the product whose output x is), x and the residual after; so neither
// is __restrict__ (nor residual and out, which may be one).
extern "C" __global__ void add_rms_norm_kernel(const bf16* x, const bf16* __restrict__ weight,
                                               const float* residual, float* out, int hidden,
                                               float eps, float offset, int vector) {
    let_next_kernel_start();  // the next product may load its weights meanwhile
    const long long row = (long long)blockIdx.x * hidden;
    if (vector && hidden <= NORM_VECTOR * (int)blockDim.x) {
        __shared__ float scratch[WARP_SIZE];
        const int i = threadIdx.x * NORM_VECTOR;
        float v[NORM_VECTOR] = {0.0f, 0.0f, 0.0f, 0.0f}, w[NORM_VECTOR];
        float4 r = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < hidden) load4(weight + i, w);
        wait_for_previous_kernel();
        if (i < hidden) {
            load4(x + row + i, v);
            r = *reinterpret_cast<const float4*>(residual + row + i);
        }
        float sum_sq = 0.0f;
#pragma unroll
        for (int k = 0; k < NORM_VECTOR; ++k) sum_sq += v[k] * v[k];
        const float inv_rms = rms_inv(block_sum(sum_sq, scratch), hidden, eps);
        if (i < hidden) {
            r.x += rms_scaled(v[0], inv_rms, w[0], offset);
            r.y += rms_scaled(v[1], inv_rms, w[1], offset);
            r.z += rms_scaled(v[2], inv_rms, w[2], offset);
            r.w += rms_scaled(v[3], inv_rms, w[3], offset);
            *reinterpret_cast<float4*>(out + row + i) = r;
        }
        return;
    }
    wait_for_previous_kernel();
    const float inv_rms = row_inv_rms(x, row, hidden, eps, vector);
    if (vector) {
        for (int i = threadIdx.x * NORM_VECTOR; i < hidden; i += blockDim.x * NORM_VECTOR) {
            float v[NORM_VECTOR], w[NORM_VECTOR];
            load4(x + row + i, v);
            load4(weight + i, w);
            float4 r = *reinterpret_cast<const float4*>(residual + row + i);
            r.x += rms_scaled(v[0], inv_rms, w[0], offset);
            r.y += rms_scaled(v[1], inv_rms, w[1], offset);
            r.z += rms_scaled(v[2], inv_rms, w[2], offset);
            r.w += rms_scaled(v[3], inv_rms, w[3], offset);
            *reinterpret_cast<float4*>(out + row + i) = r;
        }
    } else {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x)
            out[row + i] = residual[row + i] + rms_scaled(to_float(x[row + i]), inv_rms,
                                                          to_float(weight[i]), offset);
    }
}
