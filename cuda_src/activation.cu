// SiLU-and-mul for the gated MLP.
// Launch: grid-stride, block (256), grid (min(ceil(T*I/256), 65535)).

#include "common.cuh"

// gate_up [T, 2I] (gate first, then up); out [T, I] = silu(gate) * up
extern "C" __global__ void silu_and_mul_kernel(const bf16* __restrict__ gate_up,
                                               bf16* __restrict__ out, int inter,
                                               long long total) {
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long t = idx / inter;
        const int i = (int)(idx - t * inter);
        const float gate = to_float(gate_up[t * 2 * inter + i]);
        const float up = to_float(gate_up[t * 2 * inter + inter + i]);
        out[idx] = silu_mul(gate, up);
    }
}
