// RoPE on q and k, fused with the paged KV-cache write.
// Launch: grid (T), block (ROPE_THREADS); threads stride over groups of rotation pairs of
// all q and k heads, then over the v elements. With vector != 0 (head_dim a multiple of
// 2 ROPE_VECTOR and nkv head_dim of ROPE_V_VECTOR, every operand 16-byte aligned) a group is
// 4 adjacent pairs, read and written in 8-byte words, and v moves in 16-byte words; else a
// group is one pair and v one element at a time.
//
// qkv [T, (nh + 2 nkv) d]: q heads, then k heads, then v heads.
// cos_sin [max_pos, d] float32: cos in columns [0, d/2), sin in [d/2, d).
// Half-split pairs (i, i + d/2), rotated by rotate_pair (common.cuh).
// Caches [num_blocks, block_size, nkv, d]: flat slot s = block * block_size + row starts at
// element s * nkv * d. Tokens with slot < 0 are not written (padding).

#include "common.cuh"

#define ROPE_THREADS 256
#define ROPE_VECTOR 4    // rotation pairs per group on the vector path: one 8-byte word
#define ROPE_V_VECTOR 8  // v elements per copy on the vector path: one 16-byte word
static_assert(ROPE_VECTOR == 4, "rotate_group moves a group in one uint2 and one float4");
static_assert(ROPE_V_VECTOR * sizeof(bf16) == sizeof(uint4), "v moves in uint4 words");

// the pairs (i + k, i + k + half), k < ROPE_VECTOR, of one head: src -> dst
__device__ __forceinline__ void rotate_group(const bf16* src, bf16* dst, const float* table,
                                             int i, int half) {
    float x1[ROPE_VECTOR], x2[ROPE_VECTOR];
    unpack_bf16x4(*reinterpret_cast<const uint2*>(src + i), x1);
    unpack_bf16x4(*reinterpret_cast<const uint2*>(src + i + half), x2);
    const float4 c = *reinterpret_cast<const float4*>(table + i);
    const float4 s = *reinterpret_cast<const float4*>(table + half + i);
    const float cs[ROPE_VECTOR] = {c.x, c.y, c.z, c.w}, sn[ROPE_VECTOR] = {s.x, s.y, s.z, s.w};
    bf16 o1[ROPE_VECTOR], o2[ROPE_VECTOR];
#pragma unroll
    for (int k = 0; k < ROPE_VECTOR; ++k) rotate_pair(x1[k], x2[k], cs[k], sn[k], o1[k], o2[k]);
    *reinterpret_cast<uint2*>(dst + i) = pack_bf16x4(o1);
    *reinterpret_cast<uint2*>(dst + i + half) = pack_bf16x4(o2);
}

extern "C" __global__ void rope_and_cache_kernel(
        const bf16* __restrict__ qkv, const int* __restrict__ positions,
        const int* __restrict__ slot_mapping, const float* __restrict__ cos_sin,
        bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, bf16* __restrict__ q_out,
        int num_heads, int num_kv_heads, int head_dim, int vector) {
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
        if (vector) {
            rotate_group(src, dst, table, i, half);
        } else {
            rotate_pair(to_float(src[i]), to_float(src[i + half]), table[i], table[half + i],
                        dst[i], dst[i + half]);
        }
    }
    if (slot < 0) return;
    const bf16* v = row + (num_heads + num_kv_heads) * head_dim;
    const int v_size = num_kv_heads * head_dim;
    if (vector) {
        for (int j = threadIdx.x * ROPE_V_VECTOR; j < v_size; j += blockDim.x * ROPE_V_VECTOR)
            *reinterpret_cast<uint4*>(v_cache + cache_row + j) =
                *reinterpret_cast<const uint4*>(v + j);
    } else {
        for (int j = threadIdx.x; j < v_size; j += blockDim.x) v_cache[cache_row + j] = v[j];
    }
}
