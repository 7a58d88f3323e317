// The RMSNorm of one q or k head and its rotation, by one warp (Qwen3, Gemma 3): what
// rope.cu's head-norm kernel and attention.cu's fused decode kernels share, so that both
// give the same bits. See rope.cu's header for the layouts.
#pragma once

#include "common.cuh"

#define HEAD_NORM_PAIRS 4  // rotation pairs per lane with head norms: head_dim <= 256

__device__ __forceinline__ float bf16_rounded(float v) { return to_float(to_bf16(v)); }

__device__ __forceinline__ float load_biased(const bf16* src, const bf16* bias, int i) {
    return bias != nullptr ? bf16_rounded(to_float(src[i]) + to_float(bias[i])) : to_float(src[i]);
}

// What a lane of a head-norm warp needs besides the head's values: the norm weights and
// cos / sin of its pairs (p, p + d/2), p = lane, lane + 32, ... (zeros past d/2). They are
// fixed for the step, so they load before the kernel waits for the one before.
struct HeadNormPairs {
    float w1[HEAD_NORM_PAIRS], w2[HEAD_NORM_PAIRS], c[HEAD_NORM_PAIRS], s[HEAD_NORM_PAIRS];
};

__device__ __forceinline__ HeadNormPairs load_head_norm_pairs(const bf16* __restrict__ norm,
                                                              const float* table, int half) {
    const int lane = threadIdx.x % WARP_SIZE;
    HeadNormPairs pairs;
#pragma unroll
    for (int k = 0; k < HEAD_NORM_PAIRS; ++k) {
        const int p = lane + k * WARP_SIZE;
        pairs.w1[k] = pairs.w2[k] = pairs.c[k] = pairs.s[k] = 0.0f;
        if (p < half) {
            pairs.w1[k] = to_float(norm[p]);
            pairs.w2[k] = to_float(norm[p + half]);
            pairs.c[k] = table[p];
            pairs.s[k] = table[half + p];
        }
    }
    return pairs;
}

// one q or k head by one warp: its values (+ bias), normed over the head, rotated. Every
// value is loaded before the first is used (the stores could alias them, so the compiler
// would not move a later pair's loads above an earlier pair's stores by itself); the sums
// and roundings are the same whichever order the loads come in.
__device__ __forceinline__ void norm_rotate_head(const bf16* src, const bf16* bias,
                                                 const HeadNormPairs& pairs, bf16* dst,
                                                 int head_dim, float eps, float offset) {
    const int lane = threadIdx.x % WARP_SIZE, half = head_dim / 2;
    float x1[HEAD_NORM_PAIRS], x2[HEAD_NORM_PAIRS];
#pragma unroll
    for (int k = 0; k < HEAD_NORM_PAIRS; ++k) {
        const int p = lane + k * WARP_SIZE;
        x1[k] = x2[k] = 0.0f;
        if (p < half) {
            x1[k] = load_biased(src, bias, p);
            x2[k] = load_biased(src, bias, p + half);
        }
    }
    // the sum of squares in one fixed rounding order, x2^2 fused onto the rounded x1^2 (left
    // to itself the compiler may contract either product, and that choice follows the code
    // around it)
    float sum_sq = 0.0f;
#pragma unroll
    for (int k = 0; k < HEAD_NORM_PAIRS; ++k)
        if (lane + k * WARP_SIZE < half)
            sum_sq = __fadd_rn(sum_sq, __fmaf_rn(x2[k], x2[k], __fmul_rn(x1[k], x1[k])));
    const float inv_rms = rms_inv(warp_sum(sum_sq), head_dim, eps);
#pragma unroll
    for (int k = 0; k < HEAD_NORM_PAIRS; ++k) {
        const int p = lane + k * WARP_SIZE;
        if (p >= half) continue;
        const float n1 = bf16_rounded(rms_scaled(x1[k], inv_rms, pairs.w1[k], offset));
        const float n2 = bf16_rounded(rms_scaled(x2[k], inv_rms, pairs.w2[k], offset));
        rotate_pair(n1, n2, pairs.c[k], pairs.s[k], dst[p], dst[p + half]);
    }
}
