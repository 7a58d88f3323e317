// Shared helpers for every kernel file. The loader prepends this header to each .cu
// source, so the source text (and with it CuPy's kernel cache key) includes it.
//
// bf16 values live in memory as __nv_bfloat16 (uint16 bits on the Python side); all math
// is fp32. No standard library headers: NVRTC compiles these without a host toolchain.
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }

// round to nearest, ties to even (the same rule as cupy_llama.bf16.float32_to_bf16_bits)
__device__ __forceinline__ bf16 to_bf16(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1)
        v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1)
        v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

// Sum over the whole block; every thread gets the result. `scratch` holds >= 32 floats.
// Contains __syncthreads(): every thread of the block must call it.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int num_warps = (blockDim.x + WARP_SIZE - 1) / WARP_SIZE;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int num_warps = (blockDim.x + WARP_SIZE - 1) / WARP_SIZE;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : neg_inf();
    return warp_max(v);
}

// Programmatic dependent launch (sm_90+; no-ops before): a kernel launched with the
// programmatic-serialization attribute may start while the kernel before it still runs.
// It must wait before touching anything that kernel writes or reads; the kernel before it
// lets it start early by calling let_next_kernel_start.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void let_next_kernel_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
