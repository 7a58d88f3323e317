// Causal attention over the paged KV cache: one kernel for prefill (variable-length,
// chunked, prefix reuse) and decode (split over the key range), plus the split combine.
//
// Layouts: q [T, nh, d]; caches [num_blocks, block_size, nkv, d]; block_tables [B, W];
// out [T, nh * d]. Sequence b owns query rows query_start_loc[b] .. query_start_loc[b+1];
// its new tokens are positions seq_lens[b] - num_new .. seq_lens[b] - 1, and a query at
// position p attends to cache positions 0 .. p. GQA: query head h reads kv head h / group.
//
// Launch (paged_attention_*): grid (num_row_tiles * num_splits, nkv, B), block (128),
// dynamic shared memory attention_smem_bytes(d) (see the launcher).
// A CTA serves one sequence, one kv head and ROWS_PER_CTA "rows", a row being a
// (new token, query head of this kv head's group) pair: row = token * group + g. Warp w
// owns rows w, w + 4, w + 8, w + 12. The CTA walks its key range in tiles of 32 keys
// (loaded to shared memory as fp32); lane j scores key j of the tile for each row, and the
// warp keeps a flash-style online softmax per row (fp32 running max m, sum l; each lane
// accumulates output dims lane, lane + 32, ...).
// With num_splits == 1 the CTA covers keys 0 .. (its latest query position) and writes the
// normalized output. With num_splits > 1 (decode batches only: one new token per sequence,
// so token index == b) split s covers keys [s * split_len, (s + 1) * split_len) and writes
// its normalized partial output and log-sum-exp for attention_combine_kernel.
// split_len == 0 (CUDA-graph decode, where the host does not know the lengths) derives each
// sequence's split length on the device: ceil(seq_len / num_splits) rounded up to KEY_TILE,
// so splits past a short sequence's end see no key.
// Keys past the range are loaded as zeros (never-written slots hold NaN), and a row that
// sees no key writes 0, never NaN (padding rows of a graph batch have seq_len 0).

#define ATTN_WARPS 4
#define ROWS_PER_WARP 4
#define ROWS_PER_CTA (ATTN_WARPS * ROWS_PER_WARP)
#define KEY_TILE 32

template <int DIMS_PER_LANE>
__device__ __forceinline__ void paged_attention_body(
        const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
        const bf16* __restrict__ v_cache, const int* __restrict__ block_tables,
        const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
        bf16* __restrict__ out, float* __restrict__ partial_out,
        float* __restrict__ partial_lse, int num_heads, int num_kv_heads, int head_dim,
        int block_size, int max_blocks_per_seq, float scale, int num_row_tiles,
        int num_splits, int split_len) {
    extern __shared__ float smem[];
    const int d = head_dim;
    float* q_s = smem;                      // [ROWS_PER_CTA][d]
    float* k_s = q_s + ROWS_PER_CTA * d;    // [KEY_TILE][d + 1] (padded: no bank conflicts)
    float* v_s = k_s + KEY_TILE * (d + 1);  // [KEY_TILE][d]

    const int b = blockIdx.z, kv_head = blockIdx.y;
    const int row_tile = blockIdx.x % num_row_tiles, split = blockIdx.x / num_row_tiles;
    const int group = num_heads / num_kv_heads;
    const int q_start = query_start_loc[b];
    const int num_new = query_start_loc[b + 1] - q_start;
    const int seq_len = seq_lens[b];
    const int context_start = seq_len - num_new;  // position of the first new token
    const int num_rows = num_new * group;
    const int first_row = row_tile * ROWS_PER_CTA;
    if (first_row >= num_rows) return;  // the same for the whole CTA
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;

    const int last_row = min(first_row + ROWS_PER_CTA, num_rows) - 1;
    if (num_splits > 1 && split_len == 0) {
        const int per_split = (seq_len + num_splits - 1) / num_splits;
        split_len = max(KEY_TILE, (per_split + KEY_TILE - 1) / KEY_TILE * KEY_TILE);
    }
    const int key_begin = split * split_len;
    int key_end = min(seq_len, context_start + last_row / group + 1);
    if (num_splits > 1) key_end = min(key_end, key_begin + split_len);

    for (int idx = threadIdx.x; idx < ROWS_PER_CTA * d; idx += blockDim.x) {
        const int r = idx / d, c = idx - r * d;
        const int row = first_row + r;
        float value = 0.0f;
        if (row < num_rows) {
            const int token = row / group, head = kv_head * group + row % group;
            value = to_float(q[((long long)(q_start + token) * num_heads + head) * d + c]);
        }
        q_s[idx] = value;
    }

    float m[ROWS_PER_WARP], l[ROWS_PER_WARP], acc[ROWS_PER_WARP][DIMS_PER_LANE];
    int q_pos[ROWS_PER_WARP];  // -1: no such row
#pragma unroll
    for (int rr = 0; rr < ROWS_PER_WARP; ++rr) {
        const int row = first_row + rr * ATTN_WARPS + warp;
        q_pos[rr] = row < num_rows ? context_start + row / group : -1;
        m[rr] = neg_inf();
        l[rr] = 0.0f;
#pragma unroll
        for (int cc = 0; cc < DIMS_PER_LANE; ++cc) acc[rr][cc] = 0.0f;
    }

    const int* table = block_tables + (long long)b * max_blocks_per_seq;
    for (int tile = key_begin; tile < key_end; tile += KEY_TILE) {
        __syncthreads();  // q_s written / the previous tile consumed
        for (int idx = threadIdx.x; idx < KEY_TILE * d; idx += blockDim.x) {
            const int j = idx / d, c = idx - j * d;
            const int pos = tile + j;
            float k_value = 0.0f, v_value = 0.0f;
            if (pos < key_end) {
                const long long slot =
                    (long long)table[pos / block_size] * block_size + pos % block_size;
                const long long offset = (slot * num_kv_heads + kv_head) * d + c;
                k_value = to_float(k_cache[offset]);
                v_value = to_float(v_cache[offset]);
            }
            k_s[j * (d + 1) + c] = k_value;
            v_s[j * d + c] = v_value;
        }
        __syncthreads();

        const int key_pos = tile + lane;
#pragma unroll
        for (int rr = 0; rr < ROWS_PER_WARP; ++rr) {
            if (q_pos[rr] < 0) continue;  // uniform across the warp
            float score = neg_inf();
            if (key_pos < key_end && key_pos <= q_pos[rr]) {
                const float* q_row = q_s + (rr * ATTN_WARPS + warp) * d;
                const float* k_row = k_s + lane * (d + 1);
                float dot = 0.0f;
                for (int c = 0; c < d; ++c) dot += q_row[c] * k_row[c];
                score = dot * scale;
            }
            const float m_new = fmaxf(m[rr], warp_max(score));
            if (m_new == neg_inf()) continue;  // no visible key yet (uniform)
            const float correction = expf(m[rr] - m_new);  // 0 while m was -inf
            const float p = expf(score - m_new);           // 0 for masked keys
            l[rr] = l[rr] * correction + warp_sum(p);
            m[rr] = m_new;
#pragma unroll
            for (int cc = 0; cc < DIMS_PER_LANE; ++cc) acc[rr][cc] *= correction;
            for (int j = 0; j < KEY_TILE; ++j) {
                const float p_j = __shfl_sync(FULL_MASK, p, j);
#pragma unroll
                for (int cc = 0; cc < DIMS_PER_LANE; ++cc) {
                    const int c = lane + cc * WARP_SIZE;
                    if (c < d) acc[rr][cc] += p_j * v_s[j * d + c];
                }
            }
        }
    }

#pragma unroll
    for (int rr = 0; rr < ROWS_PER_WARP; ++rr) {
        const int row = first_row + rr * ATTN_WARPS + warp;
        if (row >= num_rows) continue;  // rows without a visible key have l == 0: write 0
        const int token = row / group, head = kv_head * group + row % group;
        const float inv_l = l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f;
        if (num_splits == 1) {
            bf16* dst = out + ((long long)(q_start + token) * num_heads + head) * d;
#pragma unroll
            for (int cc = 0; cc < DIMS_PER_LANE; ++cc) {
                const int c = lane + cc * WARP_SIZE;
                if (c < d) dst[c] = to_bf16(acc[rr][cc] * inv_l);
            }
        } else {
            const long long part = ((long long)b * num_heads + head) * num_splits + split;
#pragma unroll
            for (int cc = 0; cc < DIMS_PER_LANE; ++cc) {
                const int c = lane + cc * WARP_SIZE;
                if (c < d) partial_out[part * d + c] = acc[rr][cc] * inv_l;
            }
            if (lane == 0) partial_lse[part] = l[rr] > 0.0f ? m[rr] + logf(l[rr]) : neg_inf();
        }
    }
}

#define DEFINE_PAGED_ATTENTION(DPL)                                                        \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP_SIZE)                  \
    paged_attention_dpl##DPL(                                                             \
        const bf16* q, const bf16* k_cache, const bf16* v_cache, const int* block_tables, \
        const int* seq_lens, const int* query_start_loc, bf16* out, float* partial_out,   \
        float* partial_lse, int num_heads, int num_kv_heads, int head_dim, int block_size, \
        int max_blocks_per_seq, float scale, int num_row_tiles, int num_splits,           \
        int split_len) {                                                                  \
        paged_attention_body<DPL>(q, k_cache, v_cache, block_tables, seq_lens,            \
                                  query_start_loc, out, partial_out, partial_lse,         \
                                  num_heads, num_kv_heads, head_dim, block_size,          \
                                  max_blocks_per_seq, scale, num_row_tiles, num_splits,   \
                                  split_len);                                             \
    }

// head_dim <= 32 * DPL
DEFINE_PAGED_ATTENTION(1)
DEFINE_PAGED_ATTENTION(2)
DEFINE_PAGED_ATTENTION(4)
DEFINE_PAGED_ATTENTION(8)

// Merge the splits of a decode batch: out[b, h] = sum_s w_s o_s / sum_s w_s with
// w_s = exp(lse_s - max lse). partial_out [B, nh, num_splits, d], partial_lse
// [B, nh, num_splits]; out [B, nh * d]. Launch: grid (nh, B), block (128).
extern "C" __global__ void attention_combine_kernel(const float* __restrict__ partial_out,
                                                    const float* __restrict__ partial_lse,
                                                    bf16* __restrict__ out, int num_heads,
                                                    int head_dim, int num_splits) {
    const int head = blockIdx.x, b = blockIdx.y;
    const long long base = ((long long)b * num_heads + head) * num_splits;
    float max_lse = neg_inf();
    for (int s = 0; s < num_splits; ++s) max_lse = fmaxf(max_lse, partial_lse[base + s]);
    bf16* dst = out + ((long long)b * num_heads + head) * head_dim;
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float numerator = 0.0f, denominator = 0.0f;
        if (max_lse != neg_inf()) {
            for (int s = 0; s < num_splits; ++s) {
                const float lse = partial_lse[base + s];
                if (lse == neg_inf()) continue;  // an empty split
                const float w = expf(lse - max_lse);
                numerator += w * partial_out[(base + s) * head_dim + c];
                denominator += w;
            }
        }
        dst[c] = to_bf16(denominator > 0.0f ? numerator / denominator : 0.0f);
    }
}
