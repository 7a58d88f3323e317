// RoPE on q and k, fused with the paged KV-cache write.
// Launch: grid (T), block (128); threads stride over the rotation pairs of all q and k
// heads, then over the v elements.
//
// qkv [T, (nh + 2 nkv) d]: q heads, then k heads, then v heads.
// cos_sin [max_pos, d] float32: cos in columns [0, d/2), sin in [d/2, d).
// Half-split pairs (i, i + d/2), rotated by rotate_pair (common.cuh).
// Caches [num_blocks, block_size, nkv, d]: flat slot s = block * block_size + row starts at
// element s * nkv * d. Tokens with slot < 0 are not written (padding).

#include "common.cuh"

extern "C" __global__ void rope_and_cache_kernel(
        const bf16* __restrict__ qkv, const int* __restrict__ positions,
        const int* __restrict__ slot_mapping, const float* __restrict__ cos_sin,
        bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, bf16* __restrict__ q_out,
        int num_heads, int num_kv_heads, int head_dim) {
    const int t = blockIdx.x;
    const int half = head_dim / 2;
    const int width = (num_heads + 2 * num_kv_heads) * head_dim;
    const bf16* row = qkv + (long long)t * width;
    const float* table = cos_sin + (long long)positions[t] * head_dim;
    const long long slot = slot_mapping[t];
    const long long cache_row = slot * num_kv_heads * head_dim;

    const int num_pairs = (num_heads + num_kv_heads) * half;
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
        const int head = p / half;  // q heads first, then k heads
        const int i = p - head * half;
        const float x1 = to_float(row[head * head_dim + i]);
        const float x2 = to_float(row[head * head_dim + i + half]);
        const float c = table[i], s = table[half + i];
        bf16 o1, o2;
        rotate_pair(x1, x2, c, s, o1, o2);
        if (head < num_heads) {
            bf16* dst = q_out + ((long long)t * num_heads + head) * head_dim;
            dst[i] = o1;
            dst[i + half] = o2;
        } else if (slot >= 0) {
            bf16* dst = k_cache + cache_row + (long long)(head - num_heads) * head_dim;
            dst[i] = o1;
            dst[i + half] = o2;
        }
    }
    if (slot < 0) return;
    const bf16* v = row + (num_heads + num_kv_heads) * head_dim;
    for (int j = threadIdx.x; j < num_kv_heads * head_dim; j += blockDim.x)
        v_cache[cache_row + j] = v[j];
}
