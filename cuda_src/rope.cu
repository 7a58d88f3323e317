// RoPE on q and k, fused with the paged KV-cache write; before it, where the model has
// them, the q/k/v biases (Qwen2) and an RMSNorm of each q and k head (Qwen3, Gemma 3).
//
// rope_and_cache_kernel (no head norms). Launch: grid (T), block (ROPE_THREADS). Threads
// stride over groups of rotation pairs of all q and k heads, then over the v elements. With
// vector != 0 (head_dim a multiple of 2 ROPE_VECTOR and nkv head_dim of ROPE_V_VECTOR, every
// operand 16-byte aligned) a group is 4 adjacent pairs, read and written in 8-byte words,
// and v moves in 16-byte words; else a group is one pair and v one element at a time.
//
// rope_head_norm_and_cache_kernel (q_norm, k_norm given). Launch: grid (T,
// cdiv(nh + nkv, HEAD_NORM_WARPS)), block (HEAD_NORM_WARPS * WARP_SIZE): one warp per q or
// k head, every head of a token at once (a small step is a few tokens, so a block per token
// walking its heads in turn would leave the step waiting on one block's loads, head after
// head). Each lane holds the pairs (p, p + d/2) for p = lane, lane + 32, ... (at most
// HEAD_NORM_PAIRS of them: d <= 256), issues every load of its head (values, biases,
// norm weights, cos and sin) before it uses any, the warp sums their squares, and the
// lanes rotate their normed pairs. The blocks of a token share its v copy. It may be
// launched programmatically (common.cuh): the weights, cos / sin and the step's metadata
// load before it waits for the kernel before, qkv after.
//
// qkv [T, (nh + 2 nkv) d]: q heads, then k heads, then v heads; bias [(nh + 2 nkv) d] or
// nullptr: added to qkv and the sum rounded to bf16, as a product with a bias rounds it.
// q_norm, k_norm [d]: x / rms(x) * (norm_offset + w) over each head, rounded to bf16, as
// the model's norm returns it.
// cos_sin [max_pos, d] float32: cos in columns [0, d/2), sin in [d/2, d).
// Half-split pairs (i, i + d/2), rotated by rotate_pair (common.cuh).
// Caches [num_blocks, block_size, nkv, d]: flat slot s = block * block_size + row starts at
// element s * nkv * d. Tokens with slot < 0 are not written (padding).

#include "common.cuh"
#include "head_norm.cuh"

#define ROPE_THREADS 256
#define ROPE_VECTOR 4    // rotation pairs per group on the vector path: one 8-byte word
#define ROPE_V_VECTOR 8  // v elements per copy on the vector path: one 16-byte word
#define HEAD_NORM_WARPS 8  // heads per block with head norms (a warp each)
static_assert(ROPE_VECTOR == 4, "rotate_group moves a group in one uint2 and one float4");
static_assert(ROPE_V_VECTOR * sizeof(bf16) == sizeof(uint4), "v moves in uint4 words");

// 4 adjacent elements of a q/k head, plus their biases (rounded, as the product's output
// with a bias), where there is a bias
__device__ __forceinline__ void load4_biased(const bf16* src, const bf16* bias, float (&x)[4]) {
    unpack_bf16x4(*reinterpret_cast<const uint2*>(src), x);
    if (bias != nullptr) {
        float b[4];
        unpack_bf16x4(*reinterpret_cast<const uint2*>(bias), b);
#pragma unroll
        for (int k = 0; k < 4; ++k) x[k] = bf16_rounded(x[k] + b[k]);
    }
}

// the pairs (i + k, i + k + half), k < ROPE_VECTOR, of one head: src (+ bias) -> dst
__device__ __forceinline__ void rotate_group(const bf16* src, const bf16* bias, bf16* dst,
                                             const float* table, int i, int half) {
    float x1[ROPE_VECTOR], x2[ROPE_VECTOR];
    load4_biased(src + i, bias == nullptr ? nullptr : bias + i, x1);
    load4_biased(src + i + half, bias == nullptr ? nullptr : bias + i + half, x2);
    const float4 c = *reinterpret_cast<const float4*>(table + i);
    const float4 s = *reinterpret_cast<const float4*>(table + half + i);
    const float cs[ROPE_VECTOR] = {c.x, c.y, c.z, c.w}, sn[ROPE_VECTOR] = {s.x, s.y, s.z, s.w};
    bf16 o1[ROPE_VECTOR], o2[ROPE_VECTOR];
#pragma unroll
    for (int k = 0; k < ROPE_VECTOR; ++k) rotate_pair(x1[k], x2[k], cs[k], sn[k], o1[k], o2[k]);
    *reinterpret_cast<uint2*>(dst + i) = pack_bf16x4(o1);
    *reinterpret_cast<uint2*>(dst + i + half) = pack_bf16x4(o2);
}

// v (+ bias) of token row `row` -> the v cache at cache_row: element j by thread `index`
// of `count` (every thread of the token's blocks)
__device__ __forceinline__ void copy_v(const bf16* row, const bf16* bias, bf16* v_cache,
                                       long long cache_row, int v_start, int v_size, int vector,
                                       int index, int count) {
    const bf16* v = row + v_start;
    if (bias != nullptr) {
        const bf16* v_bias = bias + v_start;
        for (int j = index; j < v_size; j += count)
            v_cache[cache_row + j] = to_bf16(to_float(v[j]) + to_float(v_bias[j]));
    } else if (vector) {
        for (int j = index * ROPE_V_VECTOR; j < v_size; j += count * ROPE_V_VECTOR)
            *reinterpret_cast<uint4*>(v_cache + cache_row + j) =
                *reinterpret_cast<const uint4*>(v + j);
    } else {
        for (int j = index; j < v_size; j += count) v_cache[cache_row + j] = v[j];
    }
}

extern "C" __global__ void rope_and_cache_kernel(
        const bf16* __restrict__ qkv, const int* __restrict__ positions,
        const int* __restrict__ slot_mapping, const float* __restrict__ cos_sin,
        bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, bf16* __restrict__ q_out,
        int num_heads, int num_kv_heads, int head_dim, int vector, const bf16* bias) {
    const int t = blockIdx.x;
    const int half = head_dim / 2;
    const int width = (num_heads + 2 * num_kv_heads) * head_dim;
    const bf16* row = qkv + (long long)t * width;
    const float* table = cos_sin + (long long)positions[t] * head_dim;
    const long long slot = slot_mapping[t];
    const long long cache_row = slot * num_kv_heads * head_dim;

    const int group = vector ? ROPE_VECTOR : 1;
    const int groups_per_head = half / group;
    const int num_groups = (num_heads + num_kv_heads) * groups_per_head;
    for (int p = threadIdx.x; p < num_groups; p += blockDim.x) {
        const int head = p / groups_per_head;  // q heads first, then k heads
        const int i = (p - head * groups_per_head) * group;
        bf16* dst;
        if (head < num_heads)
            dst = q_out + ((long long)t * num_heads + head) * head_dim;
        else if (slot >= 0)
            dst = k_cache + cache_row + (long long)(head - num_heads) * head_dim;
        else
            continue;
        const bf16* src = row + head * head_dim;
        const bf16* head_bias = bias == nullptr ? nullptr : bias + head * head_dim;
        if (vector) {
            rotate_group(src, head_bias, dst, table, i, half);
        } else {
            rotate_pair(load_biased(src, head_bias, i), load_biased(src, head_bias, i + half),
                        table[i], table[half + i], dst[i], dst[i + half]);
        }
    }
    if (slot < 0) return;
    copy_v(row, bias, v_cache, cache_row, (num_heads + num_kv_heads) * head_dim,
           num_kv_heads * head_dim, vector, threadIdx.x, blockDim.x);
}

// Neither qkv nor the outputs are __restrict__: the product before writes qkv, and with
// only restricted pointers written the compiler may read qkv through the non-coherent path
// (DEVELOPERS.md, programmatic launches)
extern "C" __global__ void rope_head_norm_and_cache_kernel(
        const bf16* qkv, const int* __restrict__ positions,
        const int* __restrict__ slot_mapping, const float* __restrict__ cos_sin,
        bf16* k_cache, bf16* v_cache, bf16* q_out,
        int num_heads, int num_kv_heads, int head_dim, int vector, const bf16* bias,
        const bf16* __restrict__ q_norm, const bf16* __restrict__ k_norm, float norm_eps,
        float norm_offset) {
    let_next_kernel_start();  // attention may look up its first cache slots meanwhile
    const int t = blockIdx.x;
    const int head = blockIdx.y * HEAD_NORM_WARPS + threadIdx.x / WARP_SIZE;
    const int width = (num_heads + 2 * num_kv_heads) * head_dim;
    const bf16* row = qkv + (long long)t * width;
    // the step's metadata and the weights and tables are there before its first kernel
    const float* table = cos_sin + (long long)positions[t] * head_dim;
    const long long slot = slot_mapping[t];
    const long long cache_row = slot * num_kv_heads * head_dim;

    // this warp's head (the same for the whole warp): q, or k where the token has a slot
    bf16* dst = nullptr;
    if (head < num_heads)
        dst = q_out + ((long long)t * num_heads + head) * head_dim;
    else if (head < num_heads + num_kv_heads && slot >= 0)
        dst = k_cache + cache_row + (long long)(head - num_heads) * head_dim;
    HeadNormPairs pairs;
    if (dst != nullptr)
        pairs = load_head_norm_pairs(head < num_heads ? q_norm : k_norm, table, head_dim / 2);
    // launched programmatically: qkv comes from the product before, and the caches and q
    // may still be read by the kernels before it
    wait_for_previous_kernel();
    if (dst != nullptr)
        norm_rotate_head(row + head * head_dim, bias == nullptr ? nullptr : bias + head * head_dim,
                         pairs, dst, head_dim, norm_eps, norm_offset);
    if (slot < 0) return;
    copy_v(row, bias, v_cache, cache_row, (num_heads + num_kv_heads) * head_dim,
           num_kv_heads * head_dim, vector, blockIdx.y * blockDim.x + threadIdx.x,
           gridDim.y * blockDim.x);
}
