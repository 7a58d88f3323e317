// Causal attention over the paged KV cache, plus the split combine of decode.
//
// Layouts: q [T, nh, d]; caches [num_blocks, block_size, nkv, d]; block_tables [B, W];
// out [T, nh * d]. Sequence b owns query rows query_start_loc[b] .. query_start_loc[b+1];
// its new tokens are positions seq_lens[b] - num_new .. seq_lens[b] - 1, and a query at
// position p attends to cache positions 0 .. p, or with a sliding window W > 0 (`window`)
// to p - W + 1 .. p only (W keys, itself included, as transformers masks them). GQA: query
// head h reads kv head h / group. With a soft cap (`softcap` > 0, Gemma 2) a score s
// (after the scale) becomes softcap * tanh(s / softcap) before the softmax: only the scalar
// kernel takes one (the tanh in the fast kernels' inner loops costs them registers, and
// spills, whether a cap is set or not), so the launcher sends capped attention there.
//
// Three kernels (the launcher in cupy_llama/backends/cuda/attention.py picks one):
// - decode_attention_d{64,128,256}_g{1,2,4,8}: one new token per sequence, vectorized
//   fp32 CUDA cores, split-KV (the _cluster variants, sm_90+, merge the splits of a
//   cluster on chip, without the combine kernel);
// - prefill_attention_d{64,128}: any number of new tokens, tensor cores (mma.sync bf16);
// - paged_attention_dpl*: the scalar fallback for every other shape (any head_dim <= 256,
//   any block size, any group), prefill and decode.
// All three write 0, never NaN, for a query row that sees no key (padding rows of a graph
// batch have seq_len 0), and never read a cache slot at or past seq_len (never-written
// slots may hold NaN).
//
// Split-KV decode (num_splits > 1; every sequence has exactly one new token, so token
// index == b): split s covers keys [lo + s * split_len, lo + (s + 1) * split_len), lo
// the first key the token sees (0, or seq_len - W with a window), and writes its
// normalized partial output and natural-log log-sum-exp to partial_out [B, nh, splits, d] /
// partial_lse [B, nh, splits] for attention_combine_kernel. split_len == 0 (CUDA-graph
// decode, where the host does not know the lengths) derives each sequence's split length
// on the device from the keys it sees, so splits past a short sequence's end see no key
// and only write lse = -inf.

#include "common.cuh"
#include "head_norm.cuh"

// ======================================================================== scalar fallback
// Launch (paged_attention_dpl*): grid (num_row_tiles * num_splits, nkv, B), block (128),
// dynamic shared memory attention_smem_bytes(d) (see the launcher).
// A CTA serves one sequence, one kv head and ROWS_PER_CTA "rows", a row being a
// (new token, query head of this kv head's group) pair: row = token * group + g. Warp w
// owns rows w, w + 4, w + 8, w + 12. The CTA walks its key range in tiles of 32 keys
// (loaded to shared memory as fp32); lane j scores key j of the tile for each row, and the
// warp keeps a flash-style online softmax per row (fp32 running max m, sum l; each lane
// accumulates output dims lane, lane + 32, ...). With split_len == 0 the split length is
// ceil(seq_len / num_splits) rounded up to KEY_TILE.

#define ATTN_WARPS 4
#define ROWS_PER_WARP 4
#define ROWS_PER_CTA (ATTN_WARPS * ROWS_PER_WARP)
#define KEY_TILE 32
#define K_TILE_PAD 1  // floats after each key of the shared K tile (no bank conflicts)

template <int DIMS_PER_LANE>
__device__ __forceinline__ void paged_attention_body(
        const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
        const bf16* __restrict__ v_cache, const int* __restrict__ block_tables,
        const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
        bf16* __restrict__ out, float* __restrict__ partial_out,
        float* __restrict__ partial_lse, int num_heads, int num_kv_heads, int head_dim,
        int block_size, int max_blocks_per_seq, float scale, int num_row_tiles,
        int num_splits, int split_len, int window, float softcap) {
    extern __shared__ float smem[];
    const int d = head_dim;
    float* q_s = smem;                      // [ROWS_PER_CTA][d]
    float* k_s = q_s + ROWS_PER_CTA * d;    // [KEY_TILE][d + K_TILE_PAD]
    float* v_s = k_s + KEY_TILE * (d + K_TILE_PAD);  // [KEY_TILE][d]

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
    // the first key any row of the CTA sees (a window's first row's), and the splits of the
    // keys from there (decode)
    const int lo = window > 0 ? max(0, context_start + first_row / group - window + 1) : 0;
    if (num_splits > 1 && split_len == 0) {
        const int per_split = (seq_len - lo + num_splits - 1) / num_splits;
        split_len = max(KEY_TILE, (per_split + KEY_TILE - 1) / KEY_TILE * KEY_TILE);
    }
    const int key_begin = lo + split * split_len;
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
            k_s[j * (d + K_TILE_PAD) + c] = k_value;
            v_s[j * d + c] = v_value;
        }
        __syncthreads();

        const int key_pos = tile + lane;
#pragma unroll
        for (int rr = 0; rr < ROWS_PER_WARP; ++rr) {
            if (q_pos[rr] < 0) continue;  // uniform across the warp
            float score = neg_inf();
            if (key_pos < key_end && key_pos <= q_pos[rr]
                    && (window <= 0 || key_pos > q_pos[rr] - window)) {
                const float* q_row = q_s + (rr * ATTN_WARPS + warp) * d;
                const float* k_row = k_s + lane * (d + K_TILE_PAD);
                float dot = 0.0f;
                for (int c = 0; c < d; ++c) dot += q_row[c] * k_row[c];
                score = dot * scale;
                if (softcap > 0.0f) score = soft_capped(score, softcap);
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

// Every kernel of this file is instantiated by one DEFINE_* line whose first argument is
// its name: the launcher reads the names and the template arguments off those lines
// (kernels.instances), so the list of kernels lives here only.
#define DEFINE_PAGED_ATTENTION(NAME, DPL)                                                  \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP_SIZE)                  \
    NAME(                                                                                 \
        const bf16* q, const bf16* k_cache, const bf16* v_cache, const int* block_tables, \
        const int* seq_lens, const int* query_start_loc, bf16* out, float* partial_out,   \
        float* partial_lse, int num_heads, int num_kv_heads, int head_dim, int block_size, \
        int max_blocks_per_seq, float scale, int num_row_tiles, int num_splits,           \
        int split_len, int window, float softcap) {                                       \
        paged_attention_body<DPL>(q, k_cache, v_cache, block_tables, seq_lens,            \
                                  query_start_loc, out, partial_out, partial_lse,         \
                                  num_heads, num_kv_heads, head_dim, block_size,          \
                                  max_blocks_per_seq, scale, num_row_tiles, num_splits,   \
                                  split_len, window, softcap);                            \
    }

// head_dim <= 32 * DPL
DEFINE_PAGED_ATTENTION(paged_attention_dpl1, 1)
DEFINE_PAGED_ATTENTION(paged_attention_dpl2, 2)
DEFINE_PAGED_ATTENTION(paged_attention_dpl4, 4)
DEFINE_PAGED_ATTENTION(paged_attention_dpl8, 8)

// Merge the splits of a decode batch: out[b, h] = sum_s w_s o_s / sum_s w_s with
// w_s = exp(lse_s - max lse), over the splits that saw a key (lse > -inf), in split order.
// partial_out [B, nh, num_splits, d], partial_lse [B, nh, num_splits]; out [B, nh * d].
// Launch: grid (nh, B), block (128); num_splits <= COMBINE_MAX_SPLITS (the launcher
// checks). This sits between attention and the o_proj product on the critical path of
// every decode layer, so nothing waits on one load before issuing the next: warp 0 reads
// every split's lse at once (one per lane) and leaves the weights in shared memory, then
// each thread issues the loads of all non-empty splits for its dim before it sums them.
#define COMBINE_MAX_SPLITS 32  // one lse per lane of warp 0

extern "C" __global__ void attention_combine_kernel(const float* __restrict__ partial_out,
                                                    const float* __restrict__ partial_lse,
                                                    bf16* __restrict__ out, int num_heads,
                                                    int head_dim, int num_splits) {
    __shared__ float weight[COMBINE_MAX_SPLITS];
    __shared__ unsigned seen_keys;  // bit s: split s saw a key
    let_next_kernel_start();     // the next product may load its weights meanwhile
    wait_for_previous_kernel();  // launched programmatically: the partials are not written yet
    const int head = blockIdx.x, b = blockIdx.y;
    const long long base = ((long long)b * num_heads + head) * num_splits;
    // the partials come from the kernel before (read at L2: it may still have been running
    // when this one started)
    if (threadIdx.x < WARP_SIZE) {
        const int s = threadIdx.x;
        const float lse = s < num_splits ? __ldcg(partial_lse + base + s) : neg_inf();
        const float max_lse = warp_max(lse);
        const unsigned mask = __ballot_sync(FULL_MASK, lse != neg_inf());
        weight[s] = mask ? expf(lse - max_lse) : 0.0f;  // max_lse finite where mask != 0
        if (s == 0) seen_keys = mask;
    }
    __syncthreads();
    const unsigned mask = seen_keys;
    bf16* dst = out + ((long long)b * num_heads + head) * head_dim;
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float value[COMBINE_MAX_SPLITS];
#pragma unroll
        for (int s = 0; s < COMBINE_MAX_SPLITS; ++s)
            value[s] = mask >> s & 1u ? __ldcg(partial_out + (base + s) * head_dim + c) : 0.0f;
        float numerator = 0.0f, denominator = 0.0f;
#pragma unroll
        for (int s = 0; s < COMBINE_MAX_SPLITS; ++s) {
            if (!(mask >> s & 1u)) continue;  // an empty split (or past num_splits)
            numerator += weight[s] * value[s];
            denominator += weight[s];
        }
        dst[c] = to_bf16(denominator > 0.0f ? numerator / denominator : 0.0f);
    }
}

// ============================================================ helpers of the fast kernels

#define LN_2 0.6931471805599453f
#define SPLIT_ALIGN 64  // device-derived split lengths are multiples of this

// ceil(seq_len / num_splits) rounded up to SPLIT_ALIGN: num_splits * result >= seq_len
__device__ __forceinline__ int device_split_len(int seq_len, int num_splits) {
    const int per_split = (seq_len + num_splits - 1) / num_splits;
    return max(SPLIT_ALIGN, (per_split + SPLIT_ALIGN - 1) / SPLIT_ALIGN * SPLIT_ALIGN);
}

// 8 bf16 (16 bytes, 16-byte aligned) in one load (unpack_bf16x8 in common.cuh splits them)
__device__ __forceinline__ uint4 load16(const bf16* p) {
    return *reinterpret_cast<const uint4*>(p);
}

// Merge N partial results of an online softmax in order: part r has running max m(r)
// (base 2), sum l(r) and unnormalized output acc(r). m_max is -inf only when no part saw
// a key; the sums are then 0.
template <int N, typename M, typename L, typename Acc>
__device__ __forceinline__ void merge_parts(M m, L l, Acc acc, float& m_max, float& sum_l,
                                            float& sum_acc) {
    m_max = neg_inf();
#pragma unroll
    for (int r = 0; r < N; ++r) m_max = fmaxf(m_max, m(r));
    const float m_use = m_max == neg_inf() ? 0.0f : m_max;  // avoid inf - inf
    sum_l = 0.0f;
    sum_acc = 0.0f;
#pragma unroll
    for (int r = 0; r < N; ++r) {
        const float weight = exp2f(m(r) - m_use);  // 0 for a part without keys
        sum_l += l(r) * weight;
        sum_acc += acc(r) * weight;
    }
}

// A decode cluster's inboxes (both clustered decode kernels; benchmarks/NOTES.md, changes
// 50 and 52): CTA r of the cluster writes outputs [r * per, (r + 1) * per) of its heads
// (head g, dim c is output g * D + c). Every CTA sends its result for its key range where
// it is read, at its own rank: each output's sum into the inbox of the CTA that writes it
// (acc, [CLUSTER][acc_stride]), every head's running max and sum into every CTA's (m, l,
// [CLUSTER][head_stride]). After one cluster barrier each CTA merges its inbox in rank
// order and writes its outputs.
struct ClusterInboxes {
    float* m;
    float* l;
    float* acc;
    int head_stride, acc_stride, per;
};

// this CTA's (rank `rank`) result for output i = g * D + c: its sum, m_max and sum_l ->
// the inboxes (the head's max and sum go out from its first CLUSTER dims, to CTA c)
template <int CLUSTER>
__device__ __forceinline__ void cluster_send(const ClusterInboxes& box, int rank, int i, int g,
                                             int c, float m_max, float sum_l, float sum_acc) {
    const int owner = i / box.per;
    cluster_store(cluster_address(box.acc + rank * box.acc_stride + i - owner * box.per, owner),
                  sum_acc);
    if (c < CLUSTER) {
        cluster_store(cluster_address(box.m + rank * box.head_stride + g, c), m_max);
        cluster_store(cluster_address(box.l + rank * box.head_stride + g, c), sum_l);
    }
}

// after the barrier: this CTA's outputs of the `outputs` (heads x D) merged over the
// senders in rank order -> out_row (0 for a head without any key: seq_len 0, a padding row
// of a CUDA graph)
template <int CLUSTER, int D, int THREADS>
__device__ __forceinline__ void cluster_merge_inbox(const ClusterInboxes& box, int rank,
                                                    int outputs, bf16* out_row) {
    const int first = rank * box.per, end = min(outputs, first + box.per);
    for (int i = first + threadIdx.x; i < end; i += THREADS) {
        const int g = i / D, at = i - first;
        float m_max, sum_l, sum_acc;
        merge_parts<CLUSTER>([&](int r) { return box.m[r * box.head_stride + g]; },
                             [&](int r) { return box.l[r * box.head_stride + g]; },
                             [&](int r) { return box.acc[r * box.acc_stride + at]; },
                             m_max, sum_l, sum_acc);
        out_row[i] = to_bf16(sum_l > 0.0f ? sum_acc / sum_l : 0.0f);
    }
}

// cache slot of key position pos: table[pos / block_size] * block_size + pos % block_size
__device__ __forceinline__ long long cache_slot(const int* table, int pos, int block_shift) {
    return ((long long)table[pos >> block_shift] << block_shift) + (pos & ((1 << block_shift) - 1));
}

// ====================================================================== decode (CUDA cores)
// Launch: grid (num_splits, nkv << head_parts_log2, B), block (WARPS * WARP_SIZE: the last
// argument of the kernel's DEFINE_DECODE_ATTENTION line), no dynamic shared memory.
// Every sequence has at most one new token (a sequence with none is skipped). A CTA serves
// one (sequence, kv head, split) and the query heads of that kv head: all of them where
// head_parts_log2 is 0, so each K/V row is read once; a larger group may be shared out
// evenly among 2^head_parts_log2 CTAs, each reading the kv head's keys (the repeats mostly
// from L2), so that a CTA's registers go to keys in flight (attention.py, decode_head_parts);
// a clustered step of one sequence shares it out further, down to a head a CTA, where the
// GPU holds the clusters, since each CTA's own work is then shorter (cluster_head_parts).
// A key row of D bf16 is read by a "slot" of D/8 lanes with one 16-byte load each (lane
// `sub` holds dims sub*8 .. sub*8+7); a warp holds 32/(D/8) slots. Slot s
// takes keys base + u * SLOTS + s (u < UNROLL: that many loads in flight per lane), scores
// them against all query heads (dot products reduced over the slot's lanes by xor
// shuffles, so every lane of a slot holds the same score), and keeps its own online
// softmax per head (base-2: q is pre-scaled by scale * log2(e)). At the end the slots of a
// warp merge through shuffles and the warps through shared memory: at most
// DECODE_MERGE_WARPS warps' results at once (its size), so wider CTAs first fold their
// upper half of warps onto the lower half.
//
// A step of the loop covers SLOTS * UNROLL keys, and a step costs a round trip to memory
// (the block-table lookup, then K and V). The CTA width is chosen per head_dim so that a
// step covers SPLIT_ALIGN keys (the unit of split lengths) where the register file allows:
// 4 warps at head_dim 64, 8 at 128, 16 in the clusters of 256 (a 64-key split, and each
// CTA of a cluster up to 512 keys, is then one step); 8 query heads per kv head take 2
// keys per slot and as many registers as 4 heads take for 4, so they step half as far.

#define DECODE_CLUSTER 8  // CTAs per cluster of the clustered variant
#define DECODE_MERGE_WARPS 8  // warps' results merged at once (the merge buffers' size)
// CTAs per SM the register budget must allow: at most 128 registers per thread below 8
// heads per group (65,536 per SM), 255 at 8; without the hint ptxas picks 64 for some
// variants and spills
#define DECODE_MIN_CTAS(MAXG, WARPS) \
    ((((MAXG) >= 8 ? 8 : 16) / (WARPS)) > 0 ? (((MAXG) >= 8 ? 8 : 16) / (WARPS)) : 1)
// keys per slot per step (the register budget): DECODE_UNROLL, or DECODE_UNROLL_G8 for
// variants of 8 query heads per kv head
#define DECODE_UNROLL 4
#define DECODE_UNROLL_G8 2

// The head norms fused into decode (the _norm kernels, Qwen3 and Gemma 3): q is not read.
// A CTA norms and rotates its query heads from the qkv product's output row, a warp a
// head, with rope.cu's own code (head_norm.cuh: the same bits as the head-norm kernel),
// into shared memory; a CTA whose key range ends at the new token does the same for that
// token's key, takes the token's key and value from there instead of the cache, and the
// first CTA of the kv head's head parts writes them into the cache (a token without a
// cache slot reads them from the cache instead, as attention after the rope kernel does).
// So no kernel between the qkv product and attention. qkv [T, (nh + 2 nkv) D] (no bias);
// q_norm, k_norm [D]; cos_sin, positions, slot_mapping as rope.cu reads them.
struct DecodeHeadNorm {
    const bf16* qkv;  // written by the kernel before: not __restrict__ (see below)
    const bf16* q_norm;
    const bf16* k_norm;
    const float* cos_sin;
    const int* positions;
    const int* slot_mapping;
    float eps, offset;
};

// q and the caches are not __restrict__: with it the compiler may read them through the
// read-only path and hoist those loads above wait_for_previous_kernel (their addresses are
// known before it), reading q and K/V the kernel before has not written yet.
template <int D, int MAXG, int CLUSTER, int WARPS, bool NORM>
__device__ __forceinline__ void decode_attention_body(
        const bf16* q, const bf16* k_cache, const bf16* v_cache,
        const int* __restrict__ block_tables,
        const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
        bf16* __restrict__ out, float* __restrict__ partial_out,
        float* __restrict__ partial_lse, int num_heads, int num_kv_heads, int block_shift,
        int max_blocks_per_seq, float scale_log2, int num_splits, int split_len, int window,
        int head_parts_log2, const DecodeHeadNorm hn) {
    constexpr int LANES_PER_KEY = D / 8;
    constexpr int SLOTS_PER_WARP = WARP_SIZE / LANES_PER_KEY;
    constexpr int NUM_WARPS = WARPS;
    constexpr int THREADS = NUM_WARPS * WARP_SIZE;
    constexpr int SLOTS = NUM_WARPS * SLOTS_PER_WARP;
    constexpr int UNROLL = MAXG >= 8 ? DECODE_UNROLL_G8 : DECODE_UNROLL;
    constexpr int STEP = SLOTS * UNROLL;       // keys per CTA per step
    // warps whose results the shared-memory merge takes at once; wider CTAs fold first
    constexpr int MERGE_WARPS = NUM_WARPS < DECODE_MERGE_WARPS ? NUM_WARPS : DECODE_MERGE_WARPS;
    static_assert(NUM_WARPS == MERGE_WARPS || NUM_WARPS == 2 * MERGE_WARPS, "one fold at most");
    __shared__ float merge_m[MERGE_WARPS][MAXG];
    __shared__ float merge_l[MERGE_WARPS][MAXG];
    // NORM reads its q heads from here in 16-byte words (the plain kernels keep their layout)
    __shared__ alignas(NORM ? 16 : 4) float merge_acc[MERGE_WARPS][MAXG][D];
    // CLUSTER: the inboxes (ClusterInboxes) of this CTA, by the sender's rank
    constexpr int INBOX = CLUSTER > 0 ? CLUSTER : 1;
    constexpr int INBOX_PER = CLUSTER > 0 ? (MAXG * D + CLUSTER - 1) / CLUSTER : 1;
    __shared__ struct {
        float m[INBOX][MAXG], l[INBOX][MAXG], acc[INBOX][INBOX_PER];
    } inbox;

    const int b = blockIdx.z, split = blockIdx.x;
    // the query heads this CTA serves: 2^head_parts_log2 CTAs share out each kv head's
    // group evenly, so the CTAs along y serve consecutive runs of `heads` query heads (a
    // shift, not a division, finds the kv head: the division's result would take a
    // register through the loop, and d128_g4 would spill)
    const int heads = (num_heads / num_kv_heads) >> head_parts_log2;
    const int head0 = blockIdx.y * heads;  // the first
    const int q_row = query_start_loc[b];
    if (query_start_loc[b + 1] == q_row) return;  // no new token (the whole cluster: same b)
    // CLUSTER: this CTA has started (its inbox may be written once every CTA has)
    if constexpr (CLUSTER > 0) cluster_arrive_relaxed();
    const int seq_len = seq_lens[b];
    // the keys the token sees: from lo (a window's first) to seq_len. CTA `split` takes the
    // split-th range of them; a cluster's CTAs and graph decode (split_len 0) derive the
    // ranges' length from the keys seen
    const int lo = window > 0 ? max(0, seq_len - window) : 0;
    const int parts = CLUSTER > 0 ? CLUSTER : num_splits;
    int key_begin = lo, key_end = seq_len;
    if (parts > 1) {
        if (CLUSTER > 0 || split_len == 0) split_len = device_split_len(seq_len - lo, parts);
        key_begin = min(seq_len, lo + split * split_len);
        key_end = min(seq_len, key_begin + split_len);
    }
    // no key: output 0 / an empty split (uniform per CTA). A CTA of a cluster goes on with
    // an empty range: the others read its (empty) result
    if (CLUSTER == 0 && key_begin >= key_end) {
        wait_for_previous_kernel();  // which may still read the outputs
        if (num_splits == 1) {
            for (int i = threadIdx.x; i < heads * D; i += THREADS)
                out[((long long)q_row * num_heads + head0) * D + i] = to_bf16(0.0f);
        } else if (threadIdx.x < heads) {
            const long long part = ((long long)b * num_heads + head0 + threadIdx.x) * num_splits + split;
            partial_lse[part] = neg_inf();
        }
        return;
    }
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int sub = lane % LANES_PER_KEY;
    const int slot = warp * SLOTS_PER_WARP + lane / LANES_PER_KEY;
    const int* table = block_tables + (long long)b * max_blocks_per_seq;
    const long long row_stride = (long long)num_kv_heads * D;  // elements per cache slot
    const int kv_head = blockIdx.y >> head_parts_log2;
    const int head_offset = kv_head * D + sub * 8;

    // The first step's cache slots come from the metadata, copied before this step's first
    // kernel: they are looked up before waiting for the kernel before (the qkv product,
    // which writes q and the new token's K/V), so that q and the first keys are then read
    // in one round trip. Kept in shared memory (registers are at their budget); -1: past
    // the range (slots fit an int: the KV pool's size).
    __shared__ int first_slot[UNROLL][SLOTS];
    if (sub == 0) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int pos = key_begin + u * SLOTS + slot;
            first_slot[u][slot] = pos < key_end ? (int)cache_slot(table, pos, block_shift) : -1;
        }
    }
    // NORM: the token's rope row and cache slot, from the metadata (there before the wait)
    const float* rope_row = nullptr;
    long long new_slot = -1;
    if constexpr (NORM) {
        rope_row = hn.cos_sin + (long long)hn.positions[q_row] * D;
        new_slot = hn.slot_mapping[q_row];
    }
    __syncwarp();  // a slot's lanes are in one warp
    wait_for_previous_kernel();

    // NORM (see DecodeHeadNorm): the new q heads [heads][D] in merge_acc's memory, which
    // the merges use only after every warp has read them (the barrier below); the new
    // token's rotated key and its value in new_kv
    constexpr int NEW_KV = NORM ? D / 8 : 1;
    __shared__ uint4 new_kv[2][NEW_KV];
    bf16* new_q = reinterpret_cast<bf16*>(&merge_acc[0][0][0]);
    static_assert(sizeof(merge_acc) >= MAXG * D * sizeof(bf16), "the new q heads fit");
    int new_pos = -1;  // the new token's key position, where this CTA's range ends at it
                       // and the token has a cache slot
    if constexpr (NORM) {
        const bf16* qkv_row = hn.qkv + (long long)q_row * (num_heads + 2 * num_kv_heads) * D;
        // a token without a cache slot (the recomputed last token of a cached prompt) reads
        // its key and value from the cache, as after the rope kernel
        const bool has_new = key_begin < key_end && key_end == seq_len && new_slot >= 0;
        const int jobs = heads + (has_new ? 1 : 0);  // the query heads, then the new key
        for (int j = warp; j < jobs; j += NUM_WARPS) {  // warp-uniform: the warp sums a head
            const bool is_key = j == heads;
            const HeadNormPairs pairs = load_head_norm_pairs(is_key ? hn.k_norm : hn.q_norm,
                                                             rope_row, D / 2);
            norm_rotate_head(qkv_row + (is_key ? num_heads + kv_head : head0 + j) * D, nullptr,
                             pairs, is_key ? reinterpret_cast<bf16*>(new_kv[0]) : new_q + j * D,
                             D, hn.eps, hn.offset);
        }
        if (has_new) {
            new_pos = seq_len - 1;
            for (int i = threadIdx.x; i < D / 8; i += THREADS)
                new_kv[1][i] = load16(qkv_row + (num_heads + num_kv_heads + kv_head) * D + i * 8);
        }
        __syncthreads();
        // one CTA of the kv head writes the token's key and value (the others of its head
        // parts read them from new_kv, never from the cache)
        if (has_new && (blockIdx.y & ((1 << head_parts_log2) - 1)) == 0) {
            const long long at = new_slot * row_stride + kv_head * D;
            for (int i = threadIdx.x; i < 2 * (D / 8); i += THREADS) {
                const int kv = i / (D / 8), c = i % (D / 8);
                bf16* cache = const_cast<bf16*>(kv == 0 ? k_cache : v_cache);
                *reinterpret_cast<uint4*>(cache + at + c * 8) = new_kv[kv][c];
            }
        }
    }

    float q_reg[MAXG][8];  // this lane's 8 dims of each query head, times scale * log2(e)
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        if (g < heads) {
            const uint4 raw = NORM ? *reinterpret_cast<const uint4*>(new_q + g * D + sub * 8)
                                   : load16(q + ((long long)q_row * num_heads + head0 + g) * D + sub * 8);
            unpack_bf16x8(raw, q_reg[g]);
#pragma unroll
            for (int i = 0; i < 8; ++i) q_reg[g][i] *= scale_log2;
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) q_reg[g][i] = 0.0f;
        }
    }
    if constexpr (NORM) __syncthreads();  // every warp has its q: merge_acc is free again
    float m[MAXG], l[MAXG], acc[MAXG][8];  // per slot: running max (base 2), sum, output
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        m[g] = neg_inf();
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = 0.0f;
    }

    for (int base = key_begin; base < key_end; base += STEP) {
        uint4 k_raw[UNROLL], v_raw[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int pos = base + u * SLOTS + slot;
            const long long cached = base == key_begin ? first_slot[u][slot]
                                     : pos < key_end ? cache_slot(table, pos, block_shift) : -1;
            k_raw[u] = make_uint4(0u, 0u, 0u, 0u);  // keys past the range: zeros, masked below
            v_raw[u] = make_uint4(0u, 0u, 0u, 0u);
            if (NORM && pos == new_pos) {  // the new token's, not in the cache yet
                k_raw[u] = new_kv[0][sub];
                v_raw[u] = new_kv[1][sub];
            } else if (cached >= 0) {
                const long long offset = cached * row_stride + head_offset;
                k_raw[u] = load16(k_cache + offset);
                v_raw[u] = load16(v_cache + offset);
            }
        }
        float p[UNROLL][MAXG];  // scores, then probabilities
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float k_val[8];
            unpack_bf16x8(k_raw[u], k_val);
            const bool visible = base + u * SLOTS + slot < key_end;
#pragma unroll
            for (int g = 0; g < MAXG; ++g) {
                float dot = 0.0f;
                if (g < heads) {  // uniform: the shuffles below stay warp-wide
#pragma unroll
                    for (int i = 0; i < 8; ++i) dot = fmaf(q_reg[g][i], k_val[i], dot);
#pragma unroll
                    for (int offset = LANES_PER_KEY / 2; offset > 0; offset >>= 1)
                        dot += __shfl_xor_sync(FULL_MASK, dot, offset);
                }
                p[u][g] = visible ? dot : neg_inf();
            }
        }
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            if (g >= heads) continue;
            float step_max = p[0][g];
#pragma unroll
            for (int u = 1; u < UNROLL; ++u) step_max = fmaxf(step_max, p[u][g]);
            const float m_new = fmaxf(m[g], step_max);
            const float m_use = m_new == neg_inf() ? 0.0f : m_new;  // no key yet: avoid inf - inf
            const float correction = exp2f(m[g] - m_use);           // 0 while m was -inf
            m[g] = m_new;
            float sum = 0.0f;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                p[u][g] = exp2f(p[u][g] - m_use);  // 0 for keys past the range
                sum += p[u][g];
            }
            l[g] = l[g] * correction + sum;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[g][i] *= correction;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float v_val[8];
            unpack_bf16x8(v_raw[u], v_val);  // zeros past the range: p * v stays finite
#pragma unroll
            for (int g = 0; g < MAXG; ++g) {
                if (g >= heads) continue;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(p[u][g], v_val[i], acc[g][i]);
            }
        }
    }

    // merge the slots of this warp: lanes holding the same dims differ in the slot bits
#pragma unroll
    for (int offset = LANES_PER_KEY; offset < WARP_SIZE; offset <<= 1) {
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            if (g >= heads) continue;
            const float m_other = __shfl_xor_sync(FULL_MASK, m[g], offset);
            const float l_other = __shfl_xor_sync(FULL_MASK, l[g], offset);
            const float m_new = fmaxf(m[g], m_other);
            const float m_use = m_new == neg_inf() ? 0.0f : m_new;
            const float w_self = exp2f(m[g] - m_use), w_other = exp2f(m_other - m_use);
            l[g] = l[g] * w_self + l_other * w_other;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float a_other = __shfl_xor_sync(FULL_MASK, acc[g][i], offset);
                acc[g][i] = acc[g][i] * w_self + a_other * w_other;
            }
            m[g] = m_new;
        }
    }
    if constexpr (NUM_WARPS > MERGE_WARPS) {
        // fold: warp w + MERGE_WARPS hands its result to warp w through shared memory
        if (warp >= MERGE_WARPS && lane < LANES_PER_KEY) {
#pragma unroll
            for (int g = 0; g < MAXG; ++g) {
                if (g >= heads) continue;
#pragma unroll
                for (int i = 0; i < 8; ++i) merge_acc[warp - MERGE_WARPS][g][sub * 8 + i] = acc[g][i];
                if (lane == 0) {
                    merge_m[warp - MERGE_WARPS][g] = m[g];
                    merge_l[warp - MERGE_WARPS][g] = l[g];
                }
            }
        }
        __syncthreads();
        if (warp < MERGE_WARPS && lane < LANES_PER_KEY) {
#pragma unroll
            for (int g = 0; g < MAXG; ++g) {
                if (g >= heads) continue;
                const float m_other = merge_m[warp][g], l_other = merge_l[warp][g];
                const float m_new = fmaxf(m[g], m_other);
                const float m_use = m_new == neg_inf() ? 0.0f : m_new;
                const float w_self = exp2f(m[g] - m_use), w_other = exp2f(m_other - m_use);
                l[g] = l[g] * w_self + l_other * w_other;
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    acc[g][i] = acc[g][i] * w_self + merge_acc[warp][g][sub * 8 + i] * w_other;
                m[g] = m_new;
            }
        }
        __syncthreads();  // the buffers are read; the lower warps write them again below
    }
    // slot 0 of each of the first MERGE_WARPS warps now holds the result of its warps
    if ((NUM_WARPS == MERGE_WARPS || warp < MERGE_WARPS) && lane < LANES_PER_KEY) {
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            if (g >= heads) continue;
#pragma unroll
            for (int i = 0; i < 8; ++i) merge_acc[warp][g][sub * 8 + i] = acc[g][i];
            if (lane == 0) {
                merge_m[warp][g] = m[g];
                merge_l[warp][g] = l[g];
            }
        }
    }
    __syncthreads();
    // CLUSTER: the key ranges merge through the inboxes (ClusterInboxes). No CTA reads
    // another's shared memory, so after the barrier none waits for the others before it
    // leaves (two barriers around a round trip of distributed shared-memory loads took
    // longer; benchmarks/NOTES.md, change 50)
    const ClusterInboxes box = {&inbox.m[0][0], &inbox.l[0][0], &inbox.acc[0][0], MAXG, INBOX_PER,
                                CLUSTER > 0 ? (heads * D + CLUSTER - 1) / CLUSTER : 0};
    if constexpr (CLUSTER > 0) cluster_wait();  // every CTA has started
    // merge the warps: thread i writes dim i % D of head i / D
    for (int i = threadIdx.x; i < heads * D; i += THREADS) {
        const int g = i / D, c = i % D;
        // m_max is finite where the range holds a key (its slot has l >= 1); -inf only for
        // an empty range of a cluster CTA, whose sums then stay 0
        float m_max, sum_l, sum_acc;
        merge_parts<MERGE_WARPS>([&](int w) { return merge_m[w][g]; },
                               [&](int w) { return merge_l[w][g]; },
                               [&](int w) { return merge_acc[w][g][c]; }, m_max, sum_l, sum_acc);
        if constexpr (CLUSTER > 0) {
            cluster_send<CLUSTER>(box, split, i, g, c, m_max, sum_l, sum_acc);
            continue;
        }
        const float value = sum_acc / sum_l;
        if (num_splits == 1) {
            out[((long long)q_row * num_heads + head0) * D + i] = to_bf16(value);
        } else {
            const long long part = ((long long)b * num_heads + head0 + g) * num_splits + split;
            partial_out[part * D + c] = value;
            if (c == 0) partial_lse[part] = (m_max + log2f(sum_l)) * LN_2;
        }
    }
    if constexpr (CLUSTER > 0) {
        static_assert(D >= CLUSTER, "a head's max and sum go out from its first CLUSTER dims");
        cluster_barrier();  // every CTA's result is in the inboxes
        cluster_merge_inbox<CLUSTER, D, THREADS>(box, split, heads * D,
                                                 out + ((long long)q_row * num_heads + head0) * D);
    }
}

#define DECODE_ATTENTION_PARAMS                                                           \
    const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int *block_tables,    \
        const int *seq_lens, const int *query_start_loc, bf16 *out, float *partial_out,   \
        float *partial_lse, int num_heads, int num_kv_heads, int block_shift,             \
        int max_blocks_per_seq, float scale_log2, int num_splits, int split_len,          \
        int window, int head_parts_log2
#define DECODE_ATTENTION_ARGS                                                             \
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, partial_out,       \
        partial_lse, num_heads, num_kv_heads, block_shift, max_blocks_per_seq,            \
        scale_log2, num_splits, split_len, window, head_parts_log2

#define DEFINE_DECODE_ATTENTION(NAME, D, MAXG, CLUSTER, WARPS)                             \
    extern "C" __global__ void                                                            \
    __launch_bounds__((WARPS) * WARP_SIZE, DECODE_MIN_CTAS(MAXG, WARPS))                  \
    NAME(DECODE_ATTENTION_PARAMS) {                                                       \
        let_next_kernel_start(); /* the next product may load its weights meanwhile */    \
        /* launched programmatically: the body waits before it reads q or writes */       \
        decode_attention_body<D, MAXG, CLUSTER, WARPS, false>(DECODE_ATTENTION_ARGS,      \
                                                              DecodeHeadNorm{});          \
    }

// The same with the head norms, RoPE and the new token's cache write fused in
// (DecodeHeadNorm): q is not read
#define DEFINE_DECODE_ATTENTION_NORM(NAME, D, MAXG, CLUSTER, WARPS)                        \
    extern "C" __global__ void                                                            \
    __launch_bounds__((WARPS) * WARP_SIZE, DECODE_MIN_CTAS(MAXG, WARPS))                  \
    NAME(DECODE_ATTENTION_PARAMS, const bf16* qkv, const bf16* __restrict__ q_norm,      \
         const bf16* __restrict__ k_norm, const float* __restrict__ cos_sin,              \
         const int* __restrict__ positions, const int* __restrict__ slot_mapping,         \
         float norm_eps, float norm_offset) {                                             \
        let_next_kernel_start();                                                          \
        decode_attention_body<D, MAXG, CLUSTER, WARPS, true>(                             \
            DECODE_ATTENTION_ARGS, DecodeHeadNorm{qkv, q_norm, k_norm, cos_sin, positions, \
                                                  slot_mapping, norm_eps, norm_offset});  \
    }

// a CTA's heads <= MAXG (decode_head_parts); WARPS: the CTA's width (see above). The split
// kernels of head_dim 256 keep 4 warps: they serve every batch size of that head_dim (there
// is no tensor-core decode kernel for it), and a CTA of 16 warps takes a whole SM's
// registers, so large batches would lose the overlap of several CTAs per SM. Its clusters,
// which run at small batches only (decode_clusters_pay), take 16.
DEFINE_DECODE_ATTENTION(decode_attention_d64_g1, 64, 1, 0, 4)
DEFINE_DECODE_ATTENTION(decode_attention_d64_g2, 64, 2, 0, 4)
DEFINE_DECODE_ATTENTION(decode_attention_d64_g4, 64, 4, 0, 4)
DEFINE_DECODE_ATTENTION(decode_attention_d64_g8, 64, 8, 0, 4)
DEFINE_DECODE_ATTENTION(decode_attention_d128_g1, 128, 1, 0, 8)
DEFINE_DECODE_ATTENTION(decode_attention_d128_g2, 128, 2, 0, 8)
DEFINE_DECODE_ATTENTION(decode_attention_d128_g4, 128, 4, 0, 8)
DEFINE_DECODE_ATTENTION(decode_attention_d128_g8, 128, 8, 0, 8)
DEFINE_DECODE_ATTENTION(decode_attention_d256_g1, 256, 1, 0, 4)
DEFINE_DECODE_ATTENTION(decode_attention_d256_g2, 256, 2, 0, 4)
DEFINE_DECODE_ATTENTION(decode_attention_d256_g4, 256, 4, 0, 4)
DEFINE_DECODE_ATTENTION(decode_attention_d256_g8, 256, 8, 0, 4)
// Clustered (sm_90+): grid (DECODE_CLUSTER, nkv, B) launched as clusters of DECODE_CLUSTER
// CTAs along x; the CTAs of a cluster split one (sequence, kv head)'s keys and merge their
// results through distributed shared memory, so no partials go through global memory and
// no combine kernel follows. num_splits, split_len, partial_out and partial_lse are not
// read.
DEFINE_DECODE_ATTENTION(decode_attention_d64_g1_cluster, 64, 1, DECODE_CLUSTER, 4)
DEFINE_DECODE_ATTENTION(decode_attention_d64_g2_cluster, 64, 2, DECODE_CLUSTER, 4)
DEFINE_DECODE_ATTENTION(decode_attention_d64_g4_cluster, 64, 4, DECODE_CLUSTER, 4)
DEFINE_DECODE_ATTENTION(decode_attention_d64_g8_cluster, 64, 8, DECODE_CLUSTER, 4)
DEFINE_DECODE_ATTENTION(decode_attention_d128_g1_cluster, 128, 1, DECODE_CLUSTER, 8)
DEFINE_DECODE_ATTENTION(decode_attention_d128_g2_cluster, 128, 2, DECODE_CLUSTER, 8)
DEFINE_DECODE_ATTENTION(decode_attention_d128_g4_cluster, 128, 4, DECODE_CLUSTER, 8)
DEFINE_DECODE_ATTENTION(decode_attention_d128_g8_cluster, 128, 8, DECODE_CLUSTER, 8)
DEFINE_DECODE_ATTENTION(decode_attention_d256_g1_cluster, 256, 1, DECODE_CLUSTER, 16)
DEFINE_DECODE_ATTENTION(decode_attention_d256_g2_cluster, 256, 2, DECODE_CLUSTER, 16)
DEFINE_DECODE_ATTENTION(decode_attention_d256_g4_cluster, 256, 4, DECODE_CLUSTER, 16)
// The head-norm forms (DEFINE_DECODE_ATTENTION_NORM) of the head dims of the models with
// q/k head norms (Qwen3: 128, Gemma 3: 256)
DEFINE_DECODE_ATTENTION_NORM(decode_attention_d128_g1_norm, 128, 1, 0, 8)
DEFINE_DECODE_ATTENTION_NORM(decode_attention_d128_g2_norm, 128, 2, 0, 8)
DEFINE_DECODE_ATTENTION_NORM(decode_attention_d128_g4_norm, 128, 4, 0, 8)
DEFINE_DECODE_ATTENTION_NORM(decode_attention_d128_g8_norm, 128, 8, 0, 8)
DEFINE_DECODE_ATTENTION_NORM(decode_attention_d256_g1_norm, 256, 1, 0, 4)
DEFINE_DECODE_ATTENTION_NORM(decode_attention_d256_g2_norm, 256, 2, 0, 4)
DEFINE_DECODE_ATTENTION_NORM(decode_attention_d256_g4_norm, 256, 4, 0, 4)
DEFINE_DECODE_ATTENTION_NORM(decode_attention_d256_g8_norm, 256, 8, 0, 4)
DEFINE_DECODE_ATTENTION_NORM(decode_attention_d128_g1_cluster_norm, 128, 1, DECODE_CLUSTER, 8)
DEFINE_DECODE_ATTENTION_NORM(decode_attention_d128_g2_cluster_norm, 128, 2, DECODE_CLUSTER, 8)
DEFINE_DECODE_ATTENTION_NORM(decode_attention_d128_g4_cluster_norm, 128, 4, DECODE_CLUSTER, 8)
DEFINE_DECODE_ATTENTION_NORM(decode_attention_d128_g8_cluster_norm, 128, 8, DECODE_CLUSTER, 8)
DEFINE_DECODE_ATTENTION_NORM(decode_attention_d256_g1_cluster_norm, 256, 1, DECODE_CLUSTER, 16)
DEFINE_DECODE_ATTENTION_NORM(decode_attention_d256_g2_cluster_norm, 256, 2, DECODE_CLUSTER, 16)
DEFINE_DECODE_ATTENTION_NORM(decode_attention_d256_g4_cluster_norm, 256, 4, DECODE_CLUSTER, 16)

// ================================================================== prefill (tensor cores)
// Launch: grid (num_row_tiles, nkv, B), block (PREFILL_THREADS), dynamic shared memory
// prefill_smem_bytes(D, TILES, KEYS) = (ROWS + 4 * KEYS) * (D + PREFILL_ROW_PAD) * 2,
// ROWS = PREFILL_WARPS * 16 * TILES.
// Flash-attention 2. A CTA owns ROWS rows of one sequence and one kv head, a row being a
// (new token, query head of the group) pair, row = token * group + g, so the K/V tiles
// serve the whole group; warp w owns the TILES 16-row mma tiles from row 16 * TILES * w.
// Each K or V fragment a warp loads from shared memory feeds TILES products, so two tiles
// a warp halve the shared-memory reads per product (head_dim 64; at 128 the registers
// hold one tile). Row tiles run in reverse order of blockIdx.x so the longest (latest)
// ones start first. The CTA streams tiles of KEYS keys, gathered from the paged cache by
// cp.async into a double buffer (keys past the tile's range are zero-filled:
// never-written slots hold NaN, and 0 * NaN would poison P V). S = Q K^T and O += P V run
// on mma.sync m16n8k16 (bf16 in, fp32 accumulate); the online softmax is in fp32
// registers, base 2 (the scale folded into the exponent's FMA), P rounded to bf16 for the
// second product. The causal mask is applied only to tiles that reach past a warp's first
// row; the CTA reads no tile past its last row's position. Shared rows are padded by 16
// bytes, so the 8 rows an ldmatrix phase reads fall in distinct banks. Up to head_dim
// 128 each warp keeps its Q fragments in registers; at 256 they would take 64 registers
// beside O's 128, so they are read from shared memory for each tile, and tiles of 32
// keys keep two CTAs' buffers within an SM's shared memory.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 .bf16; g = lane / 4, t = lane % 4):
// A (16x16): reg0 (row g, cols 2t, 2t+1), reg1 (row g+8, same), reg2 (row g, cols 2t+8,
// 2t+9), reg3 (row g+8, same); B (16x8, k x n): reg0 (k 2t, 2t+1; n g), reg1 (k 2t+8,
// 2t+9; n g); C (16x8): c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, same). The lower
// index sits in the low 16 bits.

#define PREFILL_THREADS 128
#define PREFILL_WARPS (PREFILL_THREADS / WARP_SIZE)
#define PREFILL_ROW_PAD 8   // bf16 after each shared Q/K/V row (16 bytes)

// 16 bytes global -> shared, or (copy false) 16 zero bytes and no read
__device__ __forceinline__ void cp_async16_or_zero(void* shared_dst, const void* global_src,
                                                   bool copy) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(shared_address(shared_dst)), "l"(global_src), "r"(copy ? 16 : 0)
                 : "memory");
}

// One tile of KEYS keys' K and V rows, from position first_pos on, gathered from the paged
// cache into shared rows of STRIDE bf16 by THREADS threads, each the same 16-byte chunk of
// every (THREADS / (D / 8))-th key. A thread looks up all its keys' cache slots before it
// issues a copy, so the block-table reads are in flight together, and keys from key_end
// on are zero-filled by the copy itself (never-written slots hold NaN, and 0 * NaN would
// poison P V), with no branch. Shared by the prefill and the tensor-core decode kernels.
template <int D, int KEYS, int THREADS, int STRIDE>
__device__ __forceinline__ void gather_kv_tile(
        bf16* k_dst, bf16* v_dst, const bf16* __restrict__ k_cache,
        const bf16* __restrict__ v_cache, const int* __restrict__ table, int first_pos,
        int key_end, int block_shift, int num_kv_heads, int kv_head, int tid) {
    constexpr int CHUNKS = D / 8;  // 16-byte pieces per row
    constexpr int STEP = THREADS / CHUNKS;
    constexpr int PER_THREAD = KEYS / STEP;
    static_assert(THREADS % CHUNKS == 0 && KEYS % STEP == 0, "whole rows per pass");
    const int c = tid % CHUNKS, j0 = tid / CHUNKS;
    long long offset[PER_THREAD];
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {  // a key past the range reads a slot that exists
        const int pos = max(0, min(first_pos + j0 + i * STEP, key_end - 1));
        offset[i] = (cache_slot(table, pos, block_shift) * num_kv_heads + kv_head) * D + c * 8;
    }
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int j = j0 + i * STEP;
        const bool copy = first_pos + j < key_end;
        cp_async16_or_zero(k_dst + j * STRIDE + c * 8, k_cache + offset[i], copy);
        cp_async16_or_zero(v_dst + j * STRIDE + c * 8, v_cache + offset[i], copy);
    }
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// wait until at most one committed group (the newest) is still in flight
__device__ __forceinline__ void cp_async_wait_all_but_newest() {
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

// four 8x8 bf16 matrices; lanes 8i .. 8i+7 give the row addresses of matrix i, and lane L
// receives (row L/4, cols 2(L%4), 2(L%4)+1) of each: r[i] from matrix i
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const bf16* row_address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row_address)) : "memory");
}

// the same, transposed: lane L receives (rows 2(L%4), 2(L%4)+1; col L/4) of each matrix
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const bf16* row_address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row_address)) : "memory");
}

template <int D, int TILES, int KEYS>
__device__ __forceinline__ void prefill_attention_body(
        const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
        const bf16* __restrict__ v_cache, const int* __restrict__ block_tables,
        const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
        bf16* __restrict__ out, int num_heads, int num_kv_heads, int block_shift,
        int max_blocks_per_seq, float scale_log2, int num_row_tiles, int window) {
    constexpr int ROWS = PREFILL_WARPS * 16 * TILES;  // query rows per CTA
    constexpr int WARP_ROWS = 16 * TILES;
    constexpr int STRIDE = D + PREFILL_ROW_PAD;  // bf16 per shared row
    constexpr int CHUNKS = D / 8;          // 16-byte pieces per row
    constexpr int KEY_NTILES = KEYS / 8;  // 8-key column tiles of S
    constexpr int DIM_NTILES = D / 8;     // 8-dim column tiles of O
    constexpr bool Q_IN_REGS = D <= 128;  // else Q's fragments are read from q_s per tile
    extern __shared__ __align__(16) unsigned char prefill_smem[];
    bf16* q_s = reinterpret_cast<bf16*>(prefill_smem);  // [ROWS][STRIDE]
    bf16* k_s = q_s + ROWS * STRIDE;                     // [2][KEYS][STRIDE]
    bf16* v_s = k_s + 2 * KEYS * STRIDE;                 // [2][KEYS][STRIDE]

    const int b = blockIdx.z, kv_head = blockIdx.y;
    const int row_tile = num_row_tiles - 1 - blockIdx.x;
    const int group = num_heads / num_kv_heads;
    const int q_start = query_start_loc[b];
    const int num_new = query_start_loc[b + 1] - q_start;
    const int context_start = seq_lens[b] - num_new;  // position of the first new token
    const int num_rows = num_new * group;
    const int first_row = row_tile * ROWS;
    if (first_row >= num_rows) return;  // the same for the whole CTA
    const int last_row = min(first_row + ROWS, num_rows) - 1;
    const int key_end = context_start + last_row / group + 1;  // keys 0 .. the last row's position
    const int num_tiles = (key_end + KEYS - 1) / KEYS;
    // with a window, no tile wholly before the first row's window
    const int first_tile = window > 0
        ? max(0, context_start + first_row / group - window + 1) / KEYS : 0;
    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int* table = block_tables + (long long)b * max_blocks_per_seq;

    for (int idx = tid; idx < ROWS * CHUNKS; idx += PREFILL_THREADS) {
        const int r = idx / CHUNKS, c = idx % CHUNKS;
        const int row = first_row + r;
        uint4 value = make_uint4(0u, 0u, 0u, 0u);  // rows past the sequence: zeros, never written
        if (row < num_rows) {
            const int token = row / group, head = kv_head * group + row % group;
            value = load16(q + ((long long)(q_start + token) * num_heads + head) * D + c * 8);
        }
        *reinterpret_cast<uint4*>(q_s + r * STRIDE + c * 8) = value;
    }

    auto load_tile = [&](int tile, int buffer) {
        gather_kv_tile<D, KEYS, PREFILL_THREADS, STRIDE>(
            k_s + buffer * KEYS * STRIDE, v_s + buffer * KEYS * STRIDE, k_cache, v_cache, table,
            tile * KEYS, key_end, block_shift, num_kv_heads, kv_head, tid);
    };

    load_tile(first_tile, first_tile & 1);
    cp_async_commit();
    __syncthreads();  // q_s written

    const int warp_row = first_row + warp * WARP_ROWS;  // this warp's first row
    // A fragment of this warp's mma tile mt, dims 16 kk .. 16 kk + 15, from q_s
    auto load_q = [&](unsigned (&frag)[4], int mt, int kk) {
        const int r = warp * WARP_ROWS + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        ldmatrix_x4(frag, q_s + r * STRIDE + kk * 16 + (lane >> 4) * 8);
    };
    // where Q_IN_REGS: every A fragment of this warp's rows, one per 16 dims
    unsigned q_frag[Q_IN_REGS ? TILES : 1][Q_IN_REGS ? D / 16 : 1][4];
    if constexpr (Q_IN_REGS) {
#pragma unroll
        for (int mt = 0; mt < TILES; ++mt) {
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) load_q(q_frag[mt][kk], mt, kk);
        }
    }
    float o[TILES][DIM_NTILES][4];
#pragma unroll
    for (int mt = 0; mt < TILES; ++mt) {
#pragma unroll
        for (int n = 0; n < DIM_NTILES; ++n)
            o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
    }
    // per tile, rows g (index 0) and g + 8 (index 1); m_row in the scaled base-2 domain
    float m_row[TILES][2], l_row[TILES][2];
    int pos_row[TILES][2];  // the rows' positions; -1: no such row (every key masked)
#pragma unroll
    for (int mt = 0; mt < TILES; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = warp_row + mt * 16 + (lane >> 2) + 8 * r;
            m_row[mt][r] = neg_inf();
            l_row[mt][r] = 0.0f;
            pos_row[mt][r] = row < num_rows ? context_start + row / group : -1;
        }
    }
    const int warp_first_pos = context_start + warp_row / group;
    const int warp_last_pos = context_start + min(warp_row + WARP_ROWS - 1, num_rows - 1) / group;

    for (int tile = first_tile; tile < num_tiles; ++tile) {
        if (tile + 1 < num_tiles) load_tile(tile + 1, (tile + 1) & 1);
        cp_async_commit();  // possibly empty: keeps the group count regular
        cp_async_wait_all_but_newest();  // this tile has landed (for this thread)
        __syncthreads();                 // ... and for every thread
        const bf16* k_tile = k_s + (tile & 1) * KEYS * STRIDE;
        const bf16* v_tile = v_s + (tile & 1) * KEYS * STRIDE;

        float s[TILES][KEY_NTILES][4];  // S: [16 rows, KEYS keys] per mma tile
#pragma unroll
        for (int mt = 0; mt < TILES; ++mt) {
#pragma unroll
            for (int j = 0; j < KEY_NTILES; ++j)
                s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            unsigned q_kk[TILES][4];
#pragma unroll
            for (int mt = 0; mt < TILES; ++mt) {
                if constexpr (Q_IN_REGS) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) q_kk[mt][e] = q_frag[mt][kk][e];
                } else {
                    load_q(q_kk[mt], mt, kk);
                }
            }
#pragma unroll
            for (int jj = 0; jj < KEY_NTILES / 2; ++jj) {  // 16 keys: two column tiles
                unsigned k_frag[4];
                const int key = jj * 16 + (lane & 7) + (lane >> 4) * 8;
                ldmatrix_x4(k_frag, k_tile + key * STRIDE + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
                for (int mt = 0; mt < TILES; ++mt) {
                    mma_bf16(s[mt][2 * jj], q_kk[mt], k_frag[0], k_frag[1]);
                    mma_bf16(s[mt][2 * jj + 1], q_kk[mt], k_frag[2], k_frag[3]);
                }
            }
        }

        const int key0 = tile * KEYS;
        // uniform per warp: a tile reaching past the warp's first row, or (with a window)
        // starting at or before the last row's window start, has keys some row must not see
        const bool needs_mask = key0 + KEYS - 1 > warp_first_pos
                                || (window > 0 && key0 <= warp_last_pos - window);
        if (needs_mask) {
#pragma unroll
            for (int mt = 0; mt < TILES; ++mt) {
#pragma unroll
                for (int j = 0; j < KEY_NTILES; ++j) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = key0 + j * 8 + (lane & 3) * 2 + (e & 1);
                        const int pos = pos_row[mt][e >> 1];
                        if (key > pos || (window > 0 && key <= pos - window))
                            s[mt][j][e] = neg_inf();
                    }
                }
            }
        }

#pragma unroll
        for (int mt = 0; mt < TILES; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {  // online softmax of rows g (e = 0, 1) and g + 8 (e = 2, 3)
                float tile_max = neg_inf();
#pragma unroll
                for (int j = 0; j < KEY_NTILES; ++j)
                    tile_max = fmaxf(tile_max, fmaxf(s[mt][j][2 * r], s[mt][j][2 * r + 1]));
                tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, 1));
                tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, 2));
                // scale_log2 > 0, so the scaled maximum is the maximum of the scaled scores
                const float m_new = fmaxf(m_row[mt][r], tile_max * scale_log2);
                const float m_use = m_new == neg_inf() ? 0.0f : m_new;  // no key yet: avoid inf - inf
                const float correction = exp2f(m_row[mt][r] - m_use);
                m_row[mt][r] = m_new;
                float sum = 0.0f;  // this thread's columns only; the quad is summed at the end
#pragma unroll
                for (int j = 0; j < KEY_NTILES; ++j) {
                    s[mt][j][2 * r] = exp2f(fmaf(s[mt][j][2 * r], scale_log2, -m_use));
                    s[mt][j][2 * r + 1] = exp2f(fmaf(s[mt][j][2 * r + 1], scale_log2, -m_use));
                    sum += s[mt][j][2 * r] + s[mt][j][2 * r + 1];
                }
                l_row[mt][r] = l_row[mt][r] * correction + sum;
#pragma unroll
                for (int n = 0; n < DIM_NTILES; ++n) {
                    o[mt][n][2 * r] *= correction;
                    o[mt][n][2 * r + 1] *= correction;
                }
            }
        }

#pragma unroll
        for (int kk = 0; kk < KEYS / 16; ++kk) {  // O += P V, 16 keys at a time
            unsigned p_frag[TILES][4];
#pragma unroll
            for (int mt = 0; mt < TILES; ++mt) {
                p_frag[mt][0] = pack_bf16x2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                p_frag[mt][1] = pack_bf16x2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                p_frag[mt][2] = pack_bf16x2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                p_frag[mt][3] = pack_bf16x2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
            const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
            for (int nn = 0; nn < D / 16; ++nn) {  // 16 dims: two column tiles
                unsigned v_frag[4];
                ldmatrix_x4_trans(v_frag, v_tile + key * STRIDE + nn * 16 + (lane >> 4) * 8);
#pragma unroll
                for (int mt = 0; mt < TILES; ++mt) {
                    mma_bf16(o[mt][2 * nn], p_frag[mt], v_frag[0], v_frag[1]);
                    mma_bf16(o[mt][2 * nn + 1], p_frag[mt], v_frag[2], v_frag[3]);
                }
            }
        }
        __syncthreads();  // every warp is done with this buffer before it is refilled
    }

#pragma unroll
    for (int mt = 0; mt < TILES; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = l_row[mt][r];
            l += __shfl_xor_sync(FULL_MASK, l, 1);
            l += __shfl_xor_sync(FULL_MASK, l, 2);
            const int row = warp_row + mt * 16 + (lane >> 2) + 8 * r;
            if (row >= num_rows) continue;
            const int token = row / group, head = kv_head * group + row % group;
            const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
            bf16* dst = out + ((long long)(q_start + token) * num_heads + head) * D + (lane & 3) * 2;
#pragma unroll
            for (int n = 0; n < DIM_NTILES; ++n)
                *reinterpret_cast<unsigned*>(dst + n * 8) =
                    pack_bf16x2(o[mt][n][2 * r] * inv_l, o[mt][n][2 * r + 1] * inv_l);
        }
    }
}

// TILES: 16-row mma tiles per warp (a CTA's rows: PREFILL_WARPS * 16 * TILES); KEYS: keys
// per K/V tile
#define DEFINE_PREFILL_ATTENTION(NAME, D, TILES, KEYS)                                     \
    extern "C" __global__ void __launch_bounds__(PREFILL_THREADS, 2)                      \
    NAME(                                                                                 \
        const bf16* q, const bf16* k_cache, const bf16* v_cache, const int* block_tables, \
        const int* seq_lens, const int* query_start_loc, bf16* out, int num_heads,        \
        int num_kv_heads, int block_shift, int max_blocks_per_seq, float scale_log2,      \
        int num_row_tiles, int window) {                                                  \
        prefill_attention_body<D, TILES, KEYS>(q, k_cache, v_cache, block_tables,         \
                                               seq_lens, query_start_loc, out, num_heads, \
                                               num_kv_heads, block_shift,                 \
                                               max_blocks_per_seq, scale_log2,            \
                                               num_row_tiles, window);                    \
    }

DEFINE_PREFILL_ATTENTION(prefill_attention_d64_t1, 64, 1, 64)
DEFINE_PREFILL_ATTENTION(prefill_attention_d64_t2, 64, 2, 64)
DEFINE_PREFILL_ATTENTION(prefill_attention_d128_t1, 128, 1, 64)
DEFINE_PREFILL_ATTENTION(prefill_attention_d256_t1, 256, 1, 32)

// ====================================================== decode on tensor cores (batches)
// Launch: grid (num_splits, nkv, B), block (DECODE_MMA_THREADS), dynamic shared memory
// attention.py's decode_mma_smem_bytes: the tile buffers, DECODE_MMA_TILE_BYTES(D). The same
// work as decode_attention (one new token per sequence; a CTA serves one sequence, kv head
// and split, the same key ranges, the same partials), with both products on mma.sync: the
// group's query heads are the rows of one 16-row A tile (group <= 16; rows past the group
// are zeros), so S = Q K^T and O += P V cost a few mma per 16 keys instead of the CUDA
// cores' dot products, shuffles and redundant exponentials, and the kernel is left to
// stream K and V. The CTA gathers tiles of DECODE_MMA_KEYS keys from the paged cache with
// cp.async into a double buffer (keys past the range zero-filled, as in prefill); warp w
// takes keys 16w .. 16w + 15 of every tile with its own online softmax (fragment layouts as
// prefill_attention below), and the warps merge through shared memory at the end, reusing
// the tile buffers.
//
// Clustered (CLUSTER > 0, sm_90+): grid (CLUSTER, nkv, B) launched as clusters of CLUSTER
// CTAs along x. The CTAs of a cluster split one (sequence, kv head)'s keys as num_splits
// ranges would (each derives its range from seq_len) and merge their results through
// inboxes, as the clustered CUDA-core kernel does: no partials in memory and no combine
// kernel after it. The inboxes follow the tile buffers in dynamic shared memory
// (decode_mma_smem_bytes gives both): another CTA may send while this one still streams.
#define DECODE_MMA_THREADS 128
#define DECODE_MMA_KEYS 64  // keys per tile: 16 per warp
// bytes of the double-buffered K and V tiles (rows padded like prefill's)
#define DECODE_MMA_TILE_BYTES(D) (2 * 2 * DECODE_MMA_KEYS * ((D) + PREFILL_ROW_PAD) * 2)

template <int D, int CLUSTER>
__device__ __forceinline__ void decode_attention_mma_body(
        const bf16* q, const bf16* k_cache, const bf16* v_cache,
        const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
        const int* __restrict__ query_start_loc, bf16* __restrict__ out,
        float* __restrict__ partial_out, float* __restrict__ partial_lse, int num_heads,
        int num_kv_heads, int block_shift, int max_blocks_per_seq, float scale_log2,
        int num_splits, int split_len, int window) {
    constexpr int STRIDE = D + PREFILL_ROW_PAD;  // bf16 per shared row
    constexpr int DIM_NTILES = D / 8;            // 8-dim column tiles of O
    constexpr int NUM_WARPS = DECODE_MMA_THREADS / WARP_SIZE;
    static_assert(DECODE_MMA_KEYS == 16 * NUM_WARPS, "16 keys per warp and tile");
    extern __shared__ __align__(16) unsigned char decode_mma_smem[];
    bf16* k_s = reinterpret_cast<bf16*>(decode_mma_smem);  // [2][DECODE_MMA_KEYS][STRIDE]
    bf16* v_s = k_s + 2 * DECODE_MMA_KEYS * STRIDE;        // [2][DECODE_MMA_KEYS][STRIDE]

    const int b = blockIdx.z, kv_head = blockIdx.y, split = blockIdx.x;
    const int group = num_heads / num_kv_heads;  // <= 16 (the launcher checks)
    const int head0 = kv_head * group;
    const int q_row = query_start_loc[b];
    if (query_start_loc[b + 1] == q_row) return;  // no new token (the whole cluster: same b)
    // CLUSTER: this CTA has started (its inbox may be written once every CTA has)
    if constexpr (CLUSTER > 0) cluster_arrive_relaxed();
    const int seq_len = seq_lens[b];
    const int lo = window > 0 ? max(0, seq_len - window) : 0;  // the first key the token sees
    const int parts = CLUSTER > 0 ? CLUSTER : num_splits;
    int key_begin = lo, key_end = seq_len;
    if (parts > 1) {
        if (CLUSTER > 0 || split_len == 0) split_len = device_split_len(seq_len - lo, parts);
        key_begin = min(seq_len, lo + split * split_len);
        key_end = min(seq_len, key_begin + split_len);
    }
    let_next_kernel_start();     // the next product may load its weights meanwhile
    wait_for_previous_kernel();  // launched programmatically: q and the new K/V come from it
    // no key (uniform per CTA): output 0 / an empty split. A CTA of a cluster goes on with
    // an empty range (no tile; its merged result is -inf, 0, 0): the others read it
    if (CLUSTER == 0 && key_begin >= key_end) {
        if (num_splits == 1) {
            for (int i = threadIdx.x; i < group * D; i += DECODE_MMA_THREADS)
                out[((long long)q_row * num_heads + head0) * D + i] = to_bf16(0.0f);
        } else if (threadIdx.x < group) {
            const long long part = ((long long)b * num_heads + head0 + threadIdx.x) * num_splits + split;
            partial_lse[part] = neg_inf();
        }
        return;
    }
    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int* table = block_tables + (long long)b * max_blocks_per_seq;
    const int num_tiles = (key_end - key_begin + DECODE_MMA_KEYS - 1) / DECODE_MMA_KEYS;

    auto load_tile = [&](int tile, int buffer) {
        gather_kv_tile<D, DECODE_MMA_KEYS, DECODE_MMA_THREADS, STRIDE>(
            k_s + buffer * DECODE_MMA_KEYS * STRIDE, v_s + buffer * DECODE_MMA_KEYS * STRIDE,
            k_cache, v_cache, table, key_begin + tile * DECODE_MMA_KEYS, key_end, block_shift,
            num_kv_heads, kv_head, tid);
    };
    if (num_tiles > 0) load_tile(0, 0);  // a cluster's CTA of no keys reads no block table
    cp_async_commit();

    // A fragments of the query heads (rows g and g + 8 of this lane), straight from memory
    const int g = lane >> 2, t = lane & 3;
    unsigned q_frag[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = g + (e & 1) * 8, dim = kk * 16 + (e >> 1) * 8 + 2 * t;
            q_frag[kk][e] = row < group ? *reinterpret_cast<const unsigned*>(
                q + ((long long)q_row * num_heads + head0 + row) * D + dim) : 0u;
        }
    }
    float o[DIM_NTILES][4];
#pragma unroll
    for (int n = 0; n < DIM_NTILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_row[2] = {neg_inf(), neg_inf()}, l_row[2] = {0.0f, 0.0f};  // rows g, g + 8

    for (int tile = 0; tile < num_tiles; ++tile) {
        if (tile + 1 < num_tiles) load_tile(tile + 1, (tile + 1) & 1);
        cp_async_commit();  // possibly empty: keeps the group count regular
        cp_async_wait_all_but_newest();  // this tile has landed (for this thread)
        __syncthreads();                 // ... and for every thread
        const bf16* k_tile = k_s + (tile & 1) * DECODE_MMA_KEYS * STRIDE;
        const bf16* v_tile = v_s + (tile & 1) * DECODE_MMA_KEYS * STRIDE;

        float s[2][4];  // S: [16 rows, this warp's 16 keys]
        s[0][0] = s[0][1] = s[0][2] = s[0][3] = s[1][0] = s[1][1] = s[1][2] = s[1][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            unsigned k_frag[4];
            const int key = warp * 16 + (lane & 7) + (lane >> 4) * 8;
            ldmatrix_x4(k_frag, k_tile + key * STRIDE + kk * 16 + ((lane >> 3) & 1) * 8);
            mma_bf16(s[0], q_frag[kk], k_frag[0], k_frag[1]);
            mma_bf16(s[1], q_frag[kk], k_frag[2], k_frag[3]);
        }
        const int key0 = key_begin + tile * DECODE_MMA_KEYS + warp * 16;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                s[j][e] = key0 + j * 8 + 2 * t + (e & 1) < key_end ? s[j][e] * scale_log2 : neg_inf();

#pragma unroll
        for (int r = 0; r < 2; ++r) {  // online softmax of rows g (e = 0, 1) and g + 8 (e = 2, 3)
            float tile_max = fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]),
                                   fmaxf(s[1][2 * r], s[1][2 * r + 1]));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, 2));
            const float m_new = fmaxf(m_row[r], tile_max);
            const float m_use = m_new == neg_inf() ? 0.0f : m_new;  // no key yet: avoid inf - inf
            const float correction = exp2f(m_row[r] - m_use);
            m_row[r] = m_new;
            float sum = 0.0f;  // this thread's keys only; the quad is summed at the end
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                s[j][2 * r] = exp2f(s[j][2 * r] - m_use);
                s[j][2 * r + 1] = exp2f(s[j][2 * r + 1] - m_use);
                sum += s[j][2 * r] + s[j][2 * r + 1];
            }
            l_row[r] = l_row[r] * correction + sum;
#pragma unroll
            for (int n = 0; n < DIM_NTILES; ++n) {
                o[n][2 * r] *= correction;
                o[n][2 * r + 1] *= correction;
            }
        }

        const unsigned p_frag[4] = {pack_bf16x2(s[0][0], s[0][1]), pack_bf16x2(s[0][2], s[0][3]),
                                    pack_bf16x2(s[1][0], s[1][1]), pack_bf16x2(s[1][2], s[1][3])};
        const int key = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int nn = 0; nn < D / 16; ++nn) {  // 16 dims: two column tiles
            unsigned v_frag[4];
            ldmatrix_x4_trans(v_frag, v_tile + key * STRIDE + nn * 16 + (lane >> 4) * 8);
            mma_bf16(o[2 * nn], p_frag, v_frag[0], v_frag[1]);
            mma_bf16(o[2 * nn + 1], p_frag, v_frag[2], v_frag[3]);
        }
        __syncthreads();  // every warp is done with this buffer before it is refilled
    }

    // merge the warps through shared memory (the tile buffers are free now): warp w's
    // running max, sum and unnormalized output of each head
    float* merge_acc = reinterpret_cast<float*>(decode_mma_smem);  // [NUM_WARPS][16][D]
    float* merge_m = merge_acc + NUM_WARPS * 16 * D;                // [NUM_WARPS][16]
    float* merge_l = merge_m + NUM_WARPS * 16;                      // [NUM_WARPS][16]
    static_assert(NUM_WARPS * (D + 2) * 16 * 4 <= DECODE_MMA_TILE_BYTES(D),
                  "the merge buffers fit the tile buffers");
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = l_row[r];
        l += __shfl_xor_sync(FULL_MASK, l, 1);
        l += __shfl_xor_sync(FULL_MASK, l, 2);
        const int row = g + 8 * r;
        if (row >= group) continue;
        float* acc_row = merge_acc + (warp * 16 + row) * D + 2 * t;
#pragma unroll
        for (int n = 0; n < DIM_NTILES; ++n) {
            acc_row[n * 8] = o[n][2 * r];
            acc_row[n * 8 + 1] = o[n][2 * r + 1];
        }
        if (t == 0) {
            merge_m[warp * 16 + row] = m_row[r];
            merge_l[warp * 16 + row] = l;
        }
    }
    __syncthreads();
    // CLUSTER: the key ranges merge through the inboxes, as the CUDA-core kernel's do
    // (ClusterInboxes): m and l [CLUSTER][16], then acc [CLUSTER][per], after the tiles
    const int per = CLUSTER > 0 ? (group * D + CLUSTER - 1) / CLUSTER : 0;
    float* inbox_m = reinterpret_cast<float*>(decode_mma_smem + DECODE_MMA_TILE_BYTES(D));
    float* inbox_l = inbox_m + (CLUSTER > 0 ? CLUSTER : 1) * 16;
    const ClusterInboxes box = {inbox_m, inbox_l, inbox_l + (CLUSTER > 0 ? CLUSTER : 1) * 16, 16,
                                per, per};
    if constexpr (CLUSTER > 0) cluster_wait();  // every CTA has started
    for (int i = tid; i < group * D; i += DECODE_MMA_THREADS) {
        const int head = i / D, c = i % D;
        // m_max is -inf only for an empty range of a cluster CTA, whose sums then stay 0
        float m_max, sum_l, sum_acc;
        merge_parts<NUM_WARPS>([&](int w) { return merge_m[w * 16 + head]; },
                               [&](int w) { return merge_l[w * 16 + head]; },
                               [&](int w) { return merge_acc[(w * 16 + head) * D + c]; },
                               m_max, sum_l, sum_acc);
        if constexpr (CLUSTER > 0) {
            cluster_send<CLUSTER>(box, split, i, head, c, m_max, sum_l, sum_acc);
            continue;
        }
        const float value = sum_acc / sum_l;
        if (num_splits == 1) {
            out[((long long)q_row * num_heads + head0) * D + i] = to_bf16(value);
        } else {
            const long long part = ((long long)b * num_heads + head0 + head) * num_splits + split;
            partial_out[part * D + c] = value;
            if (c == 0) partial_lse[part] = (m_max + log2f(sum_l)) * LN_2;
        }
    }
    if constexpr (CLUSTER > 0) {
        static_assert(D >= CLUSTER, "a head's max and sum go out from its first CLUSTER dims");
        cluster_barrier();  // every CTA's result is in the inboxes
        cluster_merge_inbox<CLUSTER, D, DECODE_MMA_THREADS>(
            box, split, group * D, out + ((long long)q_row * num_heads + head0) * D);
    }
}

#define DEFINE_DECODE_ATTENTION_MMA(NAME, D, CLUSTER)                                      \
    extern "C" __global__ void __launch_bounds__(DECODE_MMA_THREADS)                      \
    NAME(                                                                                 \
        const bf16* q, const bf16* k_cache, const bf16* v_cache, const int* block_tables, \
        const int* seq_lens, const int* query_start_loc, bf16* out, float* partial_out,   \
        float* partial_lse, int num_heads, int num_kv_heads, int block_shift,             \
        int max_blocks_per_seq, float scale_log2, int num_splits, int split_len,          \
        int window) {                                                                     \
        decode_attention_mma_body<D, CLUSTER>(q, k_cache, v_cache, block_tables, seq_lens, \
                                              query_start_loc, out, partial_out,          \
                                              partial_lse, num_heads, num_kv_heads,       \
                                              block_shift, max_blocks_per_seq,            \
                                              scale_log2, num_splits, split_len, window); \
    }

// CLUSTER: 0 (split into num_splits ranges, combined by attention_combine_kernel) or the
// CTAs of a cluster (2, 4 or 8: the launcher takes the largest that the split count holds)
DEFINE_DECODE_ATTENTION_MMA(decode_attention_mma_d64, 64, 0)
DEFINE_DECODE_ATTENTION_MMA(decode_attention_mma_d128, 128, 0)
DEFINE_DECODE_ATTENTION_MMA(decode_attention_mma_d64_c2, 64, 2)
DEFINE_DECODE_ATTENTION_MMA(decode_attention_mma_d64_c4, 64, 4)
DEFINE_DECODE_ATTENTION_MMA(decode_attention_mma_d64_c8, 64, 8)
DEFINE_DECODE_ATTENTION_MMA(decode_attention_mma_d128_c2, 128, 2)
DEFINE_DECODE_ATTENTION_MMA(decode_attention_mma_d128_c4, 128, 4)
DEFINE_DECODE_ATTENTION_MMA(decode_attention_mma_d128_c8, 128, 8)
