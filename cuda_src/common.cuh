// Shared helpers for every kernel file; each .cu includes this header. The loader
// compiles with -I for this folder and a -D carrying the headers' hash, so an edit here
// changes CuPy's kernel cache key (which covers the source text and the options only).
//
// bf16 values live in memory as __nv_bfloat16 (uint16 bits on the Python side); all math
// is fp32. No standard library headers: NVRTC compiles these without a host toolchain.
#pragma once

#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }

// round to nearest, ties to even (the same rule as cupy_llama.bf16.float32_to_bf16_bits)
__device__ __forceinline__ bf16 to_bf16(float x) { return __float2bfloat16_rn(x); }

// 8 bf16 (one 16-byte load) -> 8 floats, exactly; element 0 is the low half of word 0
__device__ __forceinline__ void unpack_bf16x8(const uint4 raw, float (&f)[8]) {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(words[i] << 16);
        f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}

// 4 bf16 (one 8-byte word) <-> 4 floats; element 0 is the low half of word x
__device__ __forceinline__ void unpack_bf16x4(const uint2 raw, float (&f)[4]) {
    f[0] = __uint_as_float(raw.x << 16);
    f[1] = __uint_as_float(raw.x & 0xffff0000u);
    f[2] = __uint_as_float(raw.y << 16);
    f[3] = __uint_as_float(raw.y & 0xffff0000u);
}

__device__ __forceinline__ uint2 pack_bf16x4(const bf16 (&b)[4]) {
    return make_uint2(__bfloat16_as_ushort(b[0]) | (unsigned)__bfloat16_as_ushort(b[1]) << 16,
                      __bfloat16_as_ushort(b[2]) | (unsigned)__bfloat16_as_ushort(b[3]) << 16);
}

// two floats -> bf16x2 (round to nearest even); lo in the low half
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&pair);
}

// 8 e4m3 codes (one 8-byte word, fp8.py's format) -> 8 bf16 (one 16-byte word), exactly;
// element 0 is the low byte of word x. The code's sign, exponent and mantissa bits slide
// into bf16's places (two codes a 32-bit word: byte permute, shift, mask), which gives a
// bf16 of value * 2^-120 (e4m3's exponent bias is 7, bf16's 127), subnormals included;
// one bf16x2 multiply by 2^120 makes it the value. Needs no FP8 hardware.
__device__ __forceinline__ unsigned e4m3x2_to_bf16x2(unsigned bytes_in_high_halves) {
    const unsigned t = bytes_in_high_halves;  // [code1, 0, code0, 0]
    const unsigned scaled = ((t >> 4) & 0x07F007F0u) | (t & 0x80008000u);
    const __nv_bfloat162 two_120 = __halves2bfloat162(__ushort_as_bfloat16(0x7B80),
                                                      __ushort_as_bfloat16(0x7B80));
    __nv_bfloat162 value = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&scaled), two_120);
    return *reinterpret_cast<unsigned*>(&value);
}

__device__ __forceinline__ uint4 e4m3x8_to_bf16x8(const uint2 codes) {
    return make_uint4(e4m3x2_to_bf16x2(__byte_perm(codes.x, 0, 0x1404)),
                      e4m3x2_to_bf16x2(__byte_perm(codes.x, 0, 0x3424)),
                      e4m3x2_to_bf16x2(__byte_perm(codes.y, 0, 0x1404)),
                      e4m3x2_to_bf16x2(__byte_perm(codes.y, 0, 0x3424)));
}

// The elementwise math that both a separate kernel and a fused epilogue compute, written
// once so that the two give the same bits.

// The gated MLP's activation: act(gate) * up, rounded to bf16 (act_and_mul_kernel; the
// gate/up product's epilogue). ACT_SILU: silu (Llama, Qwen, Mistral); ACT_GELU_TANH: GELU
// with the tanh approximation (Gemma), 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
#define ACT_SILU 0
#define ACT_GELU_TANH 1
#define SQRT_2_OVER_PI 0.7978845608028654f

__device__ __forceinline__ bf16 act_mul(int act, float gate, float up) {
    if (act == ACT_GELU_TANH) {
        const float inner = SQRT_2_OVER_PI * (gate + 0.044715f * gate * gate * gate);
        return to_bf16(0.5f * gate * (1.0f + tanhf(inner)) * up);
    }
    return to_bf16(gate / (1.0f + expf(-gate)) * up);
}

// RoPE of the half-split pair (x1, x2) = (x[i], x[i + d/2]) by the angle with cos c and
// sin s: o1 = x1 c - x2 s, o2 = x2 c + x1 s, with explicit round-to-nearest products and
// sums (no FMA contraction), so the result is the fp32 value the NumPy reference
// computes, rounded once to bf16 (rope_and_cache_kernel; the qkv product's epilogue)
__device__ __forceinline__ void rotate_pair(float x1, float x2, float c, float s, bf16& o1,
                                            bf16& o2) {
    o1 = to_bf16(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    o2 = to_bf16(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
}

// RMSNorm (rms_norm_row; the norm prologue of the products): 1 / sqrt(mean(x^2) + eps)
// from a row's sum of squares, and one element's x * inv_rms * (offset + weight) before
// rounding; offset 0 for Llama's norms, 1 for Gemma's (whose weights store w - 1)
__device__ __forceinline__ float rms_inv(float sum_sq, int hidden, float eps) {
    return rsqrtf(sum_sq / hidden + eps);
}

__device__ __forceinline__ float rms_scaled(float x, float inv_rms, float weight, float offset) {
    return x * inv_rms * (offset + weight);
}

// cap * tanh(x / cap), the soft cap of attention scores and logits (Gemma 2); cap > 0
__device__ __forceinline__ float soft_capped(float x, float cap) {
    return cap * tanhf(x / cap);
}

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

// c[16 x 8] += a[16 x 16] b[16 x 8] on the tensor cores (sm_80+): bf16 in, fp32 sums,
// a[0..3] and b0, b1 in the mma.m16n8k16 fragment layout
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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

// Thread-block clusters (sm_90+; the launchers cluster kernels only there, and a build
// for an older GPU traps if a clustered kernel is launched anyway).
// Every thread of the CTA calls cluster_barrier; it orders shared-memory writes before it
// with the other CTAs' reads after it (release / acquire).
__device__ __forceinline__ void cluster_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __trap();
#endif
}

// This CTA's rank in its cluster and the cluster's size (0 and 1 where the launch has no
// clusters, and before sm_90)
__device__ __forceinline__ int cluster_rank() {
    unsigned rank = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
#endif
    return static_cast<int>(rank);
}

__device__ __forceinline__ int cluster_size() {
    unsigned size = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
#endif
    return static_cast<int>(size);
}

// The two halves of cluster_barrier, for work between them: arrive (nothing ordered), and
// wait for every thread of the cluster to have arrived
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
    __trap();
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#else
    __trap();
#endif
}

// the 32-bit shared-state-space address of a __shared__ object (what cp.async, ldmatrix
// and mapa take)
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// The address of `local` (a __shared__ object of this CTA) in the shared memory of the
// cluster's CTA `rank`: one mapping, to which the offsets of the object's members add
__device__ __forceinline__ unsigned cluster_address(const void* local, int rank) {
    unsigned remote = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(local)), "r"(rank));
#else
    __trap();
#endif
    return remote;
}

// stores to a cluster_address: 16 bytes (16-byte aligned) and a float
__device__ __forceinline__ void cluster_store(unsigned remote, uint4 value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(remote), "r"(value.x),
                 "r"(value.y), "r"(value.z), "r"(value.w) : "memory");
#else
    __trap();
#endif
}

__device__ __forceinline__ void cluster_store(unsigned remote, float value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(value) : "memory");
#else
    __trap();
#endif
}

