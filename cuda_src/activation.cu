// The gated MLP's activation, and the soft cap of the logits.
// act_and_mul: grid (T, ceil(ceil(I / 8) / 256)), block (256); each thread writes 8
// adjacent outputs of one row. With I % 8 == 0 and 16-byte aligned rows (vector != 0) it
// reads and writes them in 16-byte words; else one element at a time. Either way the row
// comes from the grid, not from dividing a flat index.

#include "common.cuh"

#define SILU_VECTOR 8  // outputs per thread

__device__ __forceinline__ unsigned bf16_bits(bf16 x) { return __bfloat16_as_ushort(x); }

// gate_up [T, 2I] (gate first, then up); out [T, I] = act(gate) * up (act_mul, common.cuh)
extern "C" __global__ void act_and_mul_kernel(const bf16* __restrict__ gate_up,
                                              bf16* __restrict__ out, int inter, int vector,
                                              int act) {
    const long long t = blockIdx.x;
    const int i = (blockIdx.y * blockDim.x + threadIdx.x) * SILU_VECTOR;
    if (i >= inter) return;
    const bf16* gate = gate_up + t * 2 * inter + i;
    const bf16* up = gate + inter;
    bf16* dst = out + t * inter + i;
    if (vector) {
        float g[SILU_VECTOR], u[SILU_VECTOR];
        unpack_bf16x8(*reinterpret_cast<const uint4*>(gate), g);
        unpack_bf16x8(*reinterpret_cast<const uint4*>(up), u);
        unsigned words[SILU_VECTOR / 2];
#pragma unroll
        for (int k = 0; k < SILU_VECTOR / 2; ++k)
            words[k] = bf16_bits(act_mul(act, g[2 * k], u[2 * k])) |
                       bf16_bits(act_mul(act, g[2 * k + 1], u[2 * k + 1])) << 16;
        *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
        return;
    }
    const int count = min(SILU_VECTOR, inter - i);
    for (int k = 0; k < count; ++k)
        dst[k] = act_mul(act, to_float(gate[k]), to_float(up[k]));
}

// x [n] float32 (the logits), in place: x = cap * tanh(x / cap).
// Launch: grid (ceil(n / 256)), block (256).
extern "C" __global__ void softcap_kernel(float* x, long long n, float cap) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = soft_capped(x[i], cap);
}
