// Skinny matrix products for decode: out[M, N] = x[M, K] w[N, K]^T for M <= 16 rows, on
// the tensor cores. A decode step reads every weight once, so these are built to stream
// the weights at HBM speed whatever N and K are, with the small ops around a
// decode-step product folded in, so a layer of a small step is four products and the
// attention kernels (see model/llama.py) instead of ten kernels:
//   prologue PRO_PLAIN  x is bf16 [M, K];
//            PRO_NORM   x is the float32 residual stream [M, K]; the kernel stages
//                       bf16(x / rms(x) * (norm_offset + norm_weight)),
//                       rms_norm_f32_kernel's formula (its sum of squares in another
//                       order: the last bit may differ);
//            PRO_ADD_NORM as PRO_NORM, of x' = x + h / rms(h) * (norm_offset + weight)
//                       (AddedRows h and weight; add_rms_norm_kernel's formula, Gemma's
//                       sandwich norms: the output of the sublayer before joins the
//                       stream), and block 0 writes x' to AddedRows out: the add costs no
//                       kernel of its own. Every block reads x, so x' cannot go back into x; the model
//                       keeps the stream in two buffers (models/decoder.py). Only where
//                       one batch of loads holds a row (stage_x; gemm.py, fuses_added);
//   epilogue EPI_STORE  out [M, N]: bf16 (out_mode OUT_BF16), float32 (OUT_F32) or added
//                       to a float32 out (OUT_F32_ADD: the residual stream);
//            EPI_GLU    w is gate_up [2I, K] (gate rows, then up rows); out [M, I] =
//                       act(gate) * up (act_mul: silu or the tanh GELU), both rounded to
//                       bf16 first as act_and_mul sees them;
//            EPI_ROPE   w is qkv [(nh + 2 nkv) d, K]; the biases where given (bias), then
//                       RoPE and the paged KV-cache write of rope_and_cache_kernel (rope.cu,
//                       the same arithmetic): rotated q -> out [M, nh, d], rotated k and
//                       plain v -> the caches at slot_mapping.
//
// A weight tile of 16 rows is the A operand of mma.m16n8k16 (bf16 in, fp32 sums) and up to
// 8 x rows are its B operand (M > 8: two of them), so the products cost next to nothing and
// the kernel is bound by its loads. A dot product does not care in which order K is
// summed, so every lane loads whole 16-byte chunks (8 consecutive k) of its two weight rows
// and feeds them to the mma as if they were the k slots the fragment layout assigns it,
// reading x from the same k positions: lane (g = lane / 4, t = lane % 4) of a warp holds,
// for one 64-wide k step s, chunks s*8 + t and s*8 + 4 + t of the tile's weight rows
// lo(g) and hi(g) and of x row g. The four lanes of one row read 64 contiguous bytes per
// load, the warp's two loads per row cover a whole 128-byte line.
//
// Which weight rows a tile holds (tile_rows) is what lets an epilogue see the values it
// combines in one thread: for EPI_STORE lo(g) = 16 tile + g and hi(g) = lo(g) + 8; for
// EPI_GLU the pair (gate j, up j), j = 8 tile + g; for EPI_ROPE the rotation pair
// (i, i + d/2) of a q or k head, then plain 16-row tiles over v. The mma leaves the sums of
// lo(g) and hi(g) for one x row in the same lane.
//
// A block of WARPS warps (SKINNY_WARPS; SKINNY_WIDE_WARPS for the wide variant) owns one
// tile at a time and splits K among its warps (warp w takes k steps w, w + WARPS, ...;
// SKINNY_UNROLL steps, i.e. 16 loads of 16 bytes per lane, in flight before the first
// use); the warps' partial tiles are summed through shared memory in a fixed order
// (deterministic). Blocks stride over the tiles, so a grid
// of one or two blocks per SM covers any N; x is staged once per block into shared
// memory, each row padded so the warp's fragment reads hit distinct banks. Weights go
// through the non-coherent path without L1 allocation: they are read once.
//
// Latency: the weights do not depend on the kernel before, so every block loads the first
// k steps of its first tile into registers, then lets the next kernel start and waits for
// the one before (programmatic dependent launch, see launch.py; no-ops when launched
// plainly), and stages x while its loads arrive; meanwhile the next group of k steps
// (the first tile's second, or where one group holds a tile, the block's second tile) is
// asked into L2 with a bulk prefetch (prefetch_rows). Likewise the first k steps of a block's
// next tile are loaded before the current tile's sums are reduced, and what a tile's
// epilogue reads besides the sums is loaded when the tile starts (EpilogueInputs: RoPE's
// step metadata before the wait, the residual after it).
//
// Needs K % 8 == 0, 16-byte aligned x and w, for EPI_GLU N % 16 == 0, for EPI_ROPE
// (d / 2) % 8 == 0; any N for EPI_STORE (rows of the last tile past N re-read row N - 1 and
// are never stored); shared memory m_rows * x_stride * 16 + partials (gemm.py computes it).
// Launch: grid (min(tiles, resident blocks)), block (WARPS * 32), dynamic shared
// memory as above, a SkinnyArgs and an AddedRows by value.

#include "common.cuh"

#define SKINNY_WARPS 8
#define SKINNY_WIDE_WARPS 16
#define SKINNY_TILE 16     // weight rows per tile: the mma's M
#define SKINNY_STEP 64     // k per step: 4 mma of k16
#define SKINNY_UNROLL 4    // steps per warp loaded before any is used
#define SKINNY_X_PAD 4     // 16-byte chunks after each staged x row: row stride = 64 mod 128 B
// shared memory of the warps' partial sums, per warp and 8-column x tile: two buffers of
// 4 fragment floats per lane
#define SKINNY_PARTIAL_BYTES (2 * 4 * WARP_SIZE * 4)

#define W_BF16 0   // weights bf16 [N, K]
#define W_FP8 1    // weights e4m3 [N, K] (uint8) times w_scale [N] (cupy_llama/fp8.py)
#define PRO_PLAIN 0
#define PRO_NORM 1
#define PRO_ADD_NORM 2
#define EPI_STORE 0
#define EPI_GLU 1
#define EPI_ROPE 2
#define OUT_BF16 0
#define OUT_F32 1
#define OUT_F32_ADD 2
#define STAGE_ALONE 0   // every block stages all of x
#define STAGE_SHARED 1  // the blocks of a cluster share x's staging (stage_x)

// keep in step with gemm.SkinnyArgs (pointers first, then 4-byte fields: no padding inside)
struct SkinnyArgs {
    const void* x;            // bf16 [M, K] (PRO_PLAIN) or float32 [M, K] (PRO_*NORM)
    const bf16* norm_weight;  // [K] (PRO_*NORM)
    const void* w;            // [N, K]: bf16 (W_BF16) or e4m3 codes (W_FP8)
    void* out;                // see the epilogues
    const int* positions;     // [M] (EPI_ROPE, as the rest of this block)
    const int* slot_mapping;  // [M]; slot < 0: nothing written to the caches
    const float* cos_sin;     // [max_pos, d]: cos in columns [0, d/2), sin in [d/2, d)
    bf16* k_cache;            // [num_blocks, block_size, nkv, d]
    bf16* v_cache;
    const bf16* bias;         // [N] or nullptr (EPI_ROPE)
    const float* w_scale;     // [N] (W_FP8): row n of w is its codes' values times w_scale[n]
    int m_rows, n, k;
    int out_mode;             // EPI_STORE
    int num_heads, num_kv_heads, head_dim;  // EPI_ROPE
    float eps;                // PRO_NORM
    float norm_offset;        // PRO_NORM: weights scale by (norm_offset + w)
    int act;                  // EPI_GLU: ACT_SILU or ACT_GELU_TANH (common.cuh)
};

// PRO_ADD_NORM's operands, every skinny kernel's second parameter (null for the other
// prologues). Not fields of SkinnyArgs: past 128 bytes, the compiler reads every kernel's
// parameters another way, with more registers. Keep in step with gemm.AddedRows.
struct AddedRows {
    const bf16* h;       // [M, K]: a sublayer's output, joining x through its own norm
    const bf16* weight;  // [K]: that norm's weights
    float* out;          // [M, K] float32: the joined rows, a buffer other than x
};

__device__ __forceinline__ uint4 load_streaming(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ uint2 load_streaming(const uint2* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// What a lane loads of a weight row for 8 consecutive k (a "chunk"): 16 bytes of bf16 or 8
// bytes of e4m3 codes. A row is k / 8 chunks either way. FP8 blocks keep twice the steps in
// flight (Weights<W_FP8>::UNROLL), so that as many bytes are on their way as with bf16.
template <int W>
struct Weights {
    typedef uint4 Chunk;
    static constexpr int UNROLL = SKINNY_UNROLL;
    static constexpr int BYTES = 2;  // per weight
    static __device__ __forceinline__ uint4 bf16x8(const uint4& chunk) { return chunk; }
};

template <>
struct Weights<W_FP8> {
    typedef uint2 Chunk;
    static constexpr int UNROLL = 2 * SKINNY_UNROLL;
    static constexpr int BYTES = 1;
    static __device__ __forceinline__ uint4 bf16x8(const uint2& chunk) { return e4m3x8_to_bf16x8(chunk); }
};

// one group of UNROLL k steps of a warp (steps first, first + WARPS, ...): chunks c and
// c + 4 of weight rows lo and hi per step, zero past the row's end
template <int W, int WARPS, typename Chunk = typename Weights<W>::Chunk>
__device__ __forceinline__ void load_group(Chunk (&wv)[Weights<W>::UNROLL][4], const Chunk* w_lo,
                                           const Chunk* w_hi, int first, int t, int chunks) {
    const Chunk zero = {};
#pragma unroll
    for (int u = 0; u < Weights<W>::UNROLL; ++u) {
        const int c = (first + u * WARPS) * (SKINNY_STEP / 8) + t;
        wv[u][0] = c < chunks ? load_streaming(w_lo + c) : zero;
        wv[u][1] = c + 4 < chunks ? load_streaming(w_lo + c + 4) : zero;
        wv[u][2] = c < chunks ? load_streaming(w_hi + c) : zero;
        wv[u][3] = c + 4 < chunks ? load_streaming(w_hi + c + 4) : zero;
    }
}

// one 64-wide k step of one 8-column x tile: w_lo / w_hi are the chunks c and c + 4 of
// weight rows lo(g) and hi(g), xa / xb the same chunks of x row g
__device__ __forceinline__ void mma_step(float (&d)[4], const uint4& lo_a, const uint4& lo_b,
                                         const uint4& hi_a, const uint4& hi_b, const uint4& xa,
                                         const uint4& xb) {
    mma_bf16(d, {lo_a.x, hi_a.x, lo_a.y, hi_a.y}, xa.x, xa.y);
    mma_bf16(d, {lo_a.z, hi_a.z, lo_a.w, hi_a.w}, xa.z, xa.w);
    mma_bf16(d, {lo_b.x, hi_b.x, lo_b.y, hi_b.y}, xb.x, xb.y);
    mma_bf16(d, {lo_b.z, hi_b.z, lo_b.w, hi_b.w}, xb.z, xb.w);
}

struct TileRows {
    int lo, hi;
};

// the weight rows lo(g) and hi(g) of a tile (see the top of this section)
template <int EPI>
__device__ __forceinline__ TileRows tile_rows(const SkinnyArgs& a, int tile, int g) {
    if (EPI == EPI_GLU) return {tile * 8 + g, tile * 8 + g + a.n / 2};
    if (EPI == EPI_ROPE) {
        const int half = a.head_dim / 2;
        const int pair_tiles = (a.num_heads + a.num_kv_heads) * half / 8;
        if (tile < pair_tiles) {
            const int pair = tile * 8 + g, head = pair / half;
            const int lo = head * a.head_dim + pair - head * half;
            return {lo, lo + half};
        }
        const int lo = (a.num_heads + a.num_kv_heads) * a.head_dim + (tile - pair_tiles) * SKINNY_TILE + g;
        return {lo, lo + 8};
    }
    return {tile * SKINNY_TILE + g, tile * SKINNY_TILE + g + 8};
}

// a weight row as chunks of 8 weights; rows past n re-read row n - 1 (never stored)
template <int W>
__device__ __forceinline__ const typename Weights<W>::Chunk* weight_row(const SkinnyArgs& a, int row) {
    return reinterpret_cast<const typename Weights<W>::Chunk*>(a.w) + (long long)min(row, a.n - 1) * (a.k / 8);
}

// Bulk prefetch into L2 (sm_90; nothing before) of k columns [k_from, k_from + group_k)
// (at most to K; k_from < K) of weight rows lo and hi: the lanes with t == 0 of one warp
// cover a tile's 16 rows. No registers or shared memory hold them: the register loads of
// that part later find them in L2. One group of k steps at most, as much as the registers
// hold.
template <int W>
__device__ __forceinline__ void prefetch_rows(const SkinnyArgs& a, TileRows rows, int k_from,
                                              int group_k) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned bytes = (unsigned)(min(a.k, k_from + group_k) - k_from) * Weights<W>::BYTES;
    const typename Weights<W>::Chunk* starts[2] = {weight_row<W>(a, rows.lo) + k_from / 8,
                                                   weight_row<W>(a, rows.hi) + k_from / 8};
#pragma unroll
    for (int r = 0; r < 2; ++r)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(starts[r]), "r"(bytes) : "memory");
#endif
}

// x rows -> shared memory as 16-byte chunks of bf16, zero from k up to x_chunks. x was
// written by the kernel before, which may have been running when this one started: it is
// read at L2 (ld.global.cg), never through a cache this SM filled earlier.
//
// Staging sits between the wait for the kernel before and the first mma, so its loads are
// issued STAGE_BATCH at a time before any is used: a loop of one load per turn would pay a
// round trip to L2 per turn, m_rows times over (at 8 x rows and k 2,048, 24 round trips,
// about 6 us, against 1 row's 3).
//
// Every block stages the whole of x, so past a few rows staging is what a block reads most
// from L2 (16 rows of the norm's float32 x at K = 2,048: 128 KB twice, sums then scaling,
// against a 64 KB weight tile). Launched as clusters (gemm.py, staging_cluster; the normed
// products of bf16 weights), the blocks of a cluster share the work: each loads and scales
// one C-th of the chunks (of the sums: one C-th of every row) and stores what it staged
// into every block's shared memory of the cluster. The norm's row sums go round the
// cluster too and are added in rank order, so every block scales by the same inv_rms.
// Before the first store into another block every block of the cluster must have started
// (the caller arrived at the cluster barrier before its wait); after the last, a cluster
// barrier orders the stores before the mma read them. Without clusters (C = 1) this is
// the plain staging, ending in __syncthreads.
#define STAGE_BATCH 8  // x chunks (PRO_PLAIN) or float4 (PRO_NORM's sums) a thread asks at once
#define NORM_BATCH 2   // chunks a thread scales at once (each two float4 and a weight chunk)
#define NORM_ONCE_BATCH 4  // float4 a thread holds where x is normalized in one pass
#define SKINNY_MAX_CLUSTER 4  // blocks sharing x's staging at most (gemm.STAGING_CLUSTER)

// Where a staged chunk goes: this block's xs and the same offset in every other block of
// the cluster (mapped per store: an address per block would hold registers all the way)
struct StagedX {
    uint4* xs;
    int rank, size;

    __device__ __forceinline__ void put(int index, uint4 value) const {
        xs[index] = value;
#pragma unroll
        for (int q = 1; q < SKINNY_MAX_CLUSTER; ++q) {
            if (q >= size) break;
            const int other = rank + q < size ? rank + q : rank + q - size;
            cluster_store(cluster_address(xs + index, other), value);
        }
    }
};

// sum += the squares of v's elements, element by element in order
template <int N>
__device__ __forceinline__ void add_squares(float& sum, const float4 (&v)[N]) {
#pragma unroll
    for (int b = 0; b < N; ++b)
        sum += v[b].x * v[b].x + v[b].y * v[b].y + v[b].z * v[b].z + v[b].w * v[b].w;
}

// x row m's sum of squares: its group's warps' sums (row_sums[m]), added in warp order
template <int WARPS>
__device__ __forceinline__ float row_sum(const float (&row_sums)[16][WARPS], int m, int row_warps) {
    float sum_sq = 0.0f;
    for (int v = 0; v < row_warps; ++v) sum_sq += row_sums[m][v];
    return sum_sq;
}

// inv_rms[m] of every x row m (norm-once staging, a row a group at most): each group's
// warps leave their lanes' sums of squares (sum_sq, of a row where has_row, the same
// across a warp) in row_sums, then the first m_rows threads add them in warp order. Ends
// in a barrier.
template <int WARPS>
__device__ __forceinline__ void group_inv_rms(const SkinnyArgs& a, float sum_sq, bool has_row,
                                              int m, int part, int row_warps,
                                              float (&row_sums)[16][WARPS], float (&inv_rms)[16]) {
    if (has_row) {
        sum_sq = warp_sum(sum_sq);
        if (threadIdx.x % WARP_SIZE == 0) row_sums[m][part] = sum_sq;
    }
    __syncthreads();
    if (threadIdx.x < a.m_rows)
        inv_rms[threadIdx.x] = rms_inv(row_sum(row_sums, threadIdx.x, row_warps), a.k, a.eps);
    __syncthreads();
}

// SHARED: whether the kernel stages in clusters at all (STAGE_SHARED kernels; the others
// carry no cluster code, which would lengthen their start)
template <int PRO, int WARPS, bool SHARED>
__device__ __forceinline__ void stage_x(const SkinnyArgs& a, const AddedRows& add, uint4* xs,
                                        int x_chunks, int x_stride) {
    const int chunks = a.k / 8;
    const int total = a.m_rows * x_chunks;  // staged chunks, row by row
    const uint4 zero = make_uint4(0, 0, 0, 0);
    static_assert(!SHARED || PRO == PRO_NORM, "only the norm prologue's staging is shared");
    const int size = SHARED ? cluster_size() : 1, rank = SHARED ? cluster_rank() : 0;
    const StagedX staged = {xs, rank, size};
    if (size > 1) cluster_wait();  // every block of the cluster has started
    // this block's share of the staged chunks, [first, last) in row order (no division
    // without clusters: it would sit between the wait and the first mma)
    const int first = size > 1 ? total * rank / size : 0;
    const int last = size > 1 ? total * (rank + 1) / size : total;
    if (PRO == PRO_PLAIN) {  // never shared (static_assert above)
        const uint4* x4 = reinterpret_cast<const uint4*>(a.x);
        for (int base = threadIdx.x; base < total; base += STAGE_BATCH * blockDim.x) {
            uint4 v[STAGE_BATCH];
#pragma unroll
            for (int b = 0; b < STAGE_BATCH; ++b) {
                const int i = base + b * blockDim.x, m = i / x_chunks, c = i - m * x_chunks;
                v[b] = i < total && c < chunks ? __ldcg(x4 + (long long)m * chunks + c) : zero;
            }
#pragma unroll
            for (int b = 0; b < STAGE_BATCH; ++b) {
                const int i = base + b * blockDim.x, m = i / x_chunks;
                if (i < total) xs[m * x_stride + i - m * x_chunks] = v[b];
            }
        }
        __syncthreads();
        return;
    }
    // PRO_NORM. The sums of squares of this block's share of every row (all of it without
    // clusters): each row goes to a group of row_warps warps (all WARPS for one row, one
    // warp a row from WARPS / 2 + 1 rows on), whose lanes sum its float4 in turn; a
    // group's warps leave their sums in row_sums, added in warp order.
    __shared__ float row_sums[16][WARPS];  // [x row][warp of its group]; m_rows <= 16
    __shared__ float cluster_sums[SKINNY_MAX_CLUSTER][16];  // [rank][x row]
    __shared__ float inv_rms[16];
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const float4* x4 = reinterpret_cast<const float4*>(a.x);
    const int quads = a.k / 4;
    const int quad_first = size > 1 ? quads * rank / size : 0;
    const int quad_last = size > 1 ? quads * (rank + 1) / size : quads;
    const int row_warps = max(1, WARPS / a.m_rows), groups = WARPS / row_warps;
    const int group = warp / row_warps, part = warp - group * row_warps;
    const int group_lane = part * WARP_SIZE + lane, group_threads = row_warps * WARP_SIZE;
    if (PRO == PRO_ADD_NORM || (size == 1 && a.m_rows <= groups
                                 && quads <= NORM_ONCE_BATCH * group_threads)) {
        // A row a group at most, held whole in one batch of loads: x and the norm weights
        // are loaded once, together, and scaled from registers (no second trip to L2 for
        // x). The same sums in the same order and the same products as below: the same bits.
        // (PRO_ADD_NORM launches only where this holds: gemm.py, fuses_added.)
        const int m = group;  // this group's row, if it has one
        const bool has_row = m < a.m_rows;
        float4 v[NORM_ONCE_BATCH];
        uint2 weight[NORM_ONCE_BATCH];
        const uint2* weight4 = reinterpret_cast<const uint2*>(a.norm_weight);
        uint2 added[PRO == PRO_ADD_NORM ? NORM_ONCE_BATCH : 1];
#pragma unroll
        for (int b = 0; b < NORM_ONCE_BATCH; ++b) {
            const int q = group_lane + b * group_threads;
            const bool present = has_row && q < quads;
            v[b] = present ? __ldcg(x4 + (long long)m * quads + q) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            // (PRO_ADD_NORM: loaded once the add is done, so they and the added rows are
            // never held at once; the RoPE epilogue's registers would spill)
            weight[b] = present && PRO != PRO_ADD_NORM ? __ldg(weight4 + q) : make_uint2(0u, 0u);
            if constexpr (PRO == PRO_ADD_NORM)
                added[b] = present ? __ldcg(reinterpret_cast<const uint2*>(add.h) + (long long)m * quads + q)
                                   : make_uint2(0u, 0u);
        }
        if constexpr (PRO == PRO_ADD_NORM) {
            // x' = x + the added rows normed by their own weights, as add_rms_norm_kernel
            // adds them (its sum of squares in another order: the last bit may differ)
            float added_sq = 0.0f;
#pragma unroll
            for (int b = 0; b < NORM_ONCE_BATCH; ++b) {
                float h[4];
                unpack_bf16x4(added[b], h);
                added_sq += h[0] * h[0] + h[1] * h[1] + h[2] * h[2] + h[3] * h[3];
            }
            group_inv_rms(a, added_sq, has_row, m, part, row_warps, row_sums, inv_rms);
            if (has_row) {
                const float added_scale = inv_rms[m];
                const uint2* added_weight4 = reinterpret_cast<const uint2*>(add.weight);
                float4* out4 = reinterpret_cast<float4*>(add.out) + (long long)m * quads;
#pragma unroll
                for (int b = 0; b < NORM_ONCE_BATCH; ++b) {
                    const int q = group_lane + b * group_threads;
                    if (q >= quads) continue;
                    float h[4], w4[4];
                    unpack_bf16x4(added[b], h);
                    unpack_bf16x4(__ldg(added_weight4 + q), w4);
                    v[b].x += rms_scaled(h[0], added_scale, w4[0], a.norm_offset);
                    v[b].y += rms_scaled(h[1], added_scale, w4[1], a.norm_offset);
                    v[b].z += rms_scaled(h[2], added_scale, w4[2], a.norm_offset);
                    v[b].w += rms_scaled(h[3], added_scale, w4[3], a.norm_offset);
                    if (blockIdx.x == 0) out4[q] = v[b];  // no block reads add.out
                }
            }
#pragma unroll
            for (int b = 0; b < NORM_ONCE_BATCH; ++b) {
                const int q = group_lane + b * group_threads;
                weight[b] = has_row && q < quads ? __ldg(weight4 + q) : make_uint2(0u, 0u);
            }
        }
        float sum_sq = 0.0f;
        if (has_row) add_squares(sum_sq, v);
        group_inv_rms(a, sum_sq, has_row, m, part, row_warps, row_sums, inv_rms);
        if (has_row) {
            uint2* staged_row = reinterpret_cast<uint2*>(xs + m * x_stride);  // 4 bf16 a quad
            const float scale = inv_rms[m];
#pragma unroll
            for (int b = 0; b < NORM_ONCE_BATCH; ++b) {
                const int q = group_lane + b * group_threads;
                if (q >= quads) continue;
                float w4[4];
                unpack_bf16x4(weight[b], w4);
                staged_row[q] = make_uint2(
                    pack_bf16x2(rms_scaled(v[b].x, scale, w4[0], a.norm_offset),
                                rms_scaled(v[b].y, scale, w4[1], a.norm_offset)),
                    pack_bf16x2(rms_scaled(v[b].z, scale, w4[2], a.norm_offset),
                                rms_scaled(v[b].w, scale, w4[3], a.norm_offset)));
            }
        }
        const int pad = x_chunks - chunks;  // zero chunks up to the last k step's end
        for (int i = threadIdx.x; i < a.m_rows * pad; i += blockDim.x)
            xs[(i / pad) * x_stride + chunks + i % pad] = zero;
        __syncthreads();
        return;
    }
    if (group < groups) {
        for (int m = group; m < a.m_rows; m += groups) {
            const float4* row = x4 + (long long)m * quads;
            float sum_sq = 0.0f;
            for (int base = quad_first + group_lane; base < quad_last;
                 base += STAGE_BATCH * group_threads) {
                float4 v[STAGE_BATCH];
#pragma unroll
                for (int b = 0; b < STAGE_BATCH; ++b) {
                    const int q = base + b * group_threads;
                    v[b] = q < quad_last ? __ldcg(row + q) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
                add_squares(sum_sq, v);
            }
            sum_sq = warp_sum(sum_sq);
            if (lane == 0) row_sums[m][part] = sum_sq;
        }
    }
    __syncthreads();
    if (threadIdx.x < a.m_rows) {
        const float sum_sq = row_sum(row_sums, threadIdx.x, row_warps);
        if (size > 1) {  // to every block of the cluster, as this rank's part
            cluster_sums[rank][threadIdx.x] = sum_sq;
            for (int q = 0; q < size - 1; ++q)
                cluster_store(cluster_address(&cluster_sums[rank][threadIdx.x], (rank + 1 + q) % size),
                              sum_sq);
        } else {
            inv_rms[threadIdx.x] = rms_inv(sum_sq, a.k, a.eps);
        }
    }
    if (size > 1) {
        cluster_barrier();
        if (threadIdx.x < a.m_rows) {
            float sum_sq = 0.0f;
            for (int q = 0; q < size; ++q) sum_sq += cluster_sums[q][threadIdx.x];
            inv_rms[threadIdx.x] = rms_inv(sum_sq, a.k, a.eps);
        }
    }
    __syncthreads();
    // the scaled rows, NORM_BATCH chunks of 8 at a time per thread
    const uint4* weight4 = reinterpret_cast<const uint4*>(a.norm_weight);
    for (int base = first + threadIdx.x; base < last; base += NORM_BATCH * blockDim.x) {
        float4 v[NORM_BATCH][2];
        uint4 weight_chunk[NORM_BATCH];
#pragma unroll
        for (int b = 0; b < NORM_BATCH; ++b) {
            const int i = base + b * blockDim.x, m = i / x_chunks, c = i - m * x_chunks;
            const bool present = i < last && c < chunks;
            const float4 none = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            v[b][0] = present ? __ldcg(x4 + (long long)m * quads + 2 * c) : none;
            v[b][1] = present ? __ldcg(x4 + (long long)m * quads + 2 * c + 1) : none;
            weight_chunk[b] = present ? __ldg(weight4 + c) : zero;
        }
#pragma unroll
        for (int b = 0; b < NORM_BATCH; ++b) {
            const int i = base + b * blockDim.x, m = i / x_chunks, c = i - m * x_chunks;
            if (i >= last) continue;
            unsigned packed[4] = {0u, 0u, 0u, 0u};
            if (c < chunks) {
                const float x[8] = {v[b][0].x, v[b][0].y, v[b][0].z, v[b][0].w,
                                    v[b][1].x, v[b][1].y, v[b][1].z, v[b][1].w};
                float weight[8];
                unpack_bf16x8(weight_chunk[b], weight);
                const float scale = inv_rms[m];
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    packed[j] = pack_bf16x2(rms_scaled(x[2 * j], scale, weight[2 * j], a.norm_offset),
                                            rms_scaled(x[2 * j + 1], scale, weight[2 * j + 1],
                                                       a.norm_offset));
            }
            staged.put(m * x_stride + c, make_uint4(packed[0], packed[1], packed[2], packed[3]));
        }
    }
    if (size > 1) cluster_barrier();
    else __syncthreads();
}

__device__ __forceinline__ float bf16_rounded(float v) { return to_float(to_bf16(v)); }

// What an epilogue reads besides the sums, loaded long before the sums are ready, so that
// the end of a tile costs no round trip to memory: the values an accumulating product adds
// to (OUT_F32_ADD: the residual stream, written by the kernel before, so loaded after
// waiting for it) and RoPE's cache slot and rotation (step metadata, copied before the
// step's first kernel, and a constant table: loaded before the wait).
struct EpilogueInputs {
    float prior_lo, prior_hi;  // OUT_F32_ADD: out[m, lo], out[m, hi]
    int slot, position;        // EPI_ROPE: slot_mapping[m], positions[m]
    float cos, sin;            // EPI_ROPE: the rotation of row lo's pair at that position
    float bias_lo, bias_hi;    // EPI_ROPE: bias[lo], bias[hi] (0 without a bias)
    float scale_lo, scale_hi;  // W_FP8: w_scale[lo], w_scale[hi] (1 for bf16 weights)
};

// RoPE's metadata of x row m (the same for every tile)
template <int EPI>
__device__ __forceinline__ void load_row_metadata(const SkinnyArgs& a, int m, EpilogueInputs& in) {
    if (EPI != EPI_ROPE) return;
    in.slot = a.slot_mapping[m];
    in.position = a.positions[m];
}

// RoPE's rotation of a tile's pair (lo, hi) at the row's position, and the pair's biases
// (weights: constant, read before the wait like the table)
template <int EPI>
__device__ __forceinline__ void load_rotation(const SkinnyArgs& a, TileRows rows, EpilogueInputs& in) {
    if (EPI != EPI_ROPE) return;
    in.bias_lo = a.bias != nullptr ? to_float(a.bias[rows.lo]) : 0.0f;
    in.bias_hi = a.bias != nullptr ? to_float(a.bias[rows.hi]) : 0.0f;
    const int d = a.head_dim;
    if (rows.lo < (a.num_heads + a.num_kv_heads) * d) {  // a q or k row: rotated
        const float* table = a.cos_sin + (long long)in.position * d;
        const int i = rows.lo % d;
        in.cos = table[i];
        in.sin = table[d / 2 + i];
    }
}

// the rows' FP8 scales (weights: constant, read before the wait)
template <int W>
__device__ __forceinline__ void load_scales(const SkinnyArgs& a, TileRows rows, EpilogueInputs& in) {
    if (W != W_FP8) return;
    in.scale_lo = a.w_scale[min(rows.lo, a.n - 1)];
    in.scale_hi = a.w_scale[min(rows.hi, a.n - 1)];
}

template <int EPI>
__device__ __forceinline__ void load_residual_inputs(const SkinnyArgs& a, int m, TileRows rows,
                                                     EpilogueInputs& in) {
    if (EPI != EPI_STORE || a.out_mode != OUT_F32_ADD) return;
    const float* row = static_cast<const float*>(a.out) + (long long)m * a.n;
    in.prior_lo = rows.lo < a.n ? __ldcg(row + rows.lo) : 0.0f;
    in.prior_hi = rows.hi < a.n ? __ldcg(row + rows.hi) : 0.0f;
}

__device__ __forceinline__ void store_out(const SkinnyArgs& a, int m, int col, float sum,
                                          float prior) {
    if (col >= a.n) return;
    const long long idx = (long long)m * a.n + col;
    if (a.out_mode == OUT_BF16) static_cast<bf16*>(a.out)[idx] = to_bf16(sum);
    else if (a.out_mode == OUT_F32) static_cast<float*>(a.out)[idx] = sum;
    else static_cast<float*>(a.out)[idx] = prior + sum;
}

// x row m's sums of the tile's weight rows lo(g) and hi(g) -> memory
template <int EPI>
__device__ __forceinline__ void finish(const SkinnyArgs& a, int m, TileRows rows, float lo_sum,
                                       float hi_sum, const EpilogueInputs& in) {
    const int lo = rows.lo, hi = rows.hi;
    if (EPI == EPI_STORE) {
        store_out(a, m, lo, lo_sum, in.prior_lo);
        store_out(a, m, hi, hi_sum, in.prior_hi);
    } else if (EPI == EPI_GLU) {
        const float gate = bf16_rounded(lo_sum), up = bf16_rounded(hi_sum);
        static_cast<bf16*>(a.out)[(long long)m * (a.n / 2) + lo] = act_mul(a.act, gate, up);
    } else {
        const int d = a.head_dim, half = d / 2, nh = a.num_heads, nkv = a.num_kv_heads;
        const long long slot = in.slot;
        const long long cache_row = slot * nkv * d;
        const int v_start = (nh + nkv) * d;
        if (lo < v_start) {
            const int head = lo / d, i = lo - head * d;
            const float x1 = bf16_rounded(lo_sum + in.bias_lo), x2 = bf16_rounded(hi_sum + in.bias_hi);
            const float c = in.cos, s = in.sin;
            bf16 o1, o2;
            rotate_pair(x1, x2, c, s, o1, o2);
            bf16* dst = nullptr;
            if (head < nh) dst = static_cast<bf16*>(a.out) + ((long long)m * nh + head) * d;
            else if (slot >= 0) dst = a.k_cache + cache_row + (long long)(head - nh) * d;
            if (dst != nullptr) {
                dst[i] = o1;
                dst[i + half] = o2;
            }
        } else if (slot >= 0) {
            a.v_cache[cache_row + lo - v_start] = to_bf16(lo_sum + in.bias_lo);
            a.v_cache[cache_row + hi - v_start] = to_bf16(hi_sum + in.bias_hi);
        }
    }
}

// NT: 8-column x tiles (1 for m_rows <= 8, 2 for m_rows <= 16); WARPS per block; W: the
// weights' format
template <int NT, int PRO, int EPI, int WARPS, int W, int STAGE>
__device__ __forceinline__ void skinny_body(const SkinnyArgs& a, const AddedRows& add) {
    typedef typename Weights<W>::Chunk Chunk;
    constexpr int UNROLL = Weights<W>::UNROLL;
    extern __shared__ uint4 skinny_smem[];
    constexpr int PARTIAL_FLOATS = WARPS * NT * 4 * WARP_SIZE;  // one buffer
    static_assert(2 * PARTIAL_FLOATS * 4 == WARPS * NT * SKINNY_PARTIAL_BYTES, "partials");
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    const int n = a.n, m_rows = a.m_rows;
    const int chunks = a.k / 8;                                 // 16-byte chunks per row
    const int steps = (a.k + SKINNY_STEP - 1) / SKINNY_STEP;
    const int x_chunks = steps * (SKINNY_STEP / 8);             // staged row, zero past k
    const int x_stride = x_chunks + SKINNY_X_PAD;
    uint4* xs = skinny_smem;                                    // [m_rows][x_stride]
    float* partial = reinterpret_cast<float*>(skinny_smem + m_rows * x_stride);  // [2][...]
    const uint4 zero = make_uint4(0, 0, 0, 0);
    const int tiles = (n + SKINNY_TILE - 1) / SKINNY_TILE;
    // the element of every tile this thread finishes, if any: fragment element e_j of lane
    // `lane` in x tile e_nt, i.e. x row e_m and weight rows lo(g), hi(g)
    static_assert(WARPS * WARP_SIZE >= NT * 2 * WARP_SIZE, "one element per thread");
    const int e_j = warp % 2, e_nt = warp / 2, e_m = e_nt * 8 + t * 2 + e_j;
    const bool finisher = threadIdx.x < NT * 2 * WARP_SIZE && e_m < m_rows;
    EpilogueInputs inputs = {0.0f, 0.0f, -1, 0, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 1.0f};  // of the tile being computed
    constexpr bool SHARED = STAGE == STAGE_SHARED;

    // the first k steps of the first tile do not depend on the kernel before: load them,
    // then wait for that kernel and stage x while they arrive
    Chunk wv[UNROLL][4];  // [step][lo c, lo c + 4, hi c, hi c + 4]
    TileRows rows = tile_rows<EPI>(a, blockIdx.x, g);  // of the tile being computed
    bool preloaded = blockIdx.x < tiles;  // wv holds the first group of the first tile
    if (preloaded) {
        load_group<W, WARPS>(wv, weight_row<W>(a, rows.lo), weight_row<W>(a, rows.hi), warp, t, chunks);
        // the next group of k steps streams into L2 meanwhile: the first tile's second
        // group, or where one group holds a whole tile, the block's next tile
        constexpr int GROUP_K = WARPS * UNROLL * SKINNY_STEP;
        if (warp == 0 && t == 0) {
            if (GROUP_K < a.k) prefetch_rows<W>(a, rows, GROUP_K, GROUP_K);
            else if (blockIdx.x + gridDim.x < tiles)
                prefetch_rows<W>(a, tile_rows<EPI>(a, blockIdx.x + gridDim.x, g), 0, GROUP_K);
        }
    }
    let_next_kernel_start();
    // RoPE's metadata lookup is two dependent loads: issued after the start signal, so the
    // next kernel's launch does not wait for them
    if (preloaded && finisher) {
        load_row_metadata<EPI>(a, e_m, inputs);
        load_rotation<EPI>(a, rows, inputs);
        load_scales<W>(a, rows, inputs);
    }
    // clustered (stage_x): this block has started, for the blocks that store x into it
    // (after the weights' first loads, which nothing must hold up)
    if (SHARED && cluster_size() > 1) cluster_arrive_relaxed();
    wait_for_previous_kernel();
    if (preloaded && finisher) load_residual_inputs<EPI>(a, e_m, rows, inputs);
    stage_x<PRO, WARPS, SHARED>(a, add, xs, x_chunks, x_stride);  // ends in a barrier

    int buffer = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const Chunk *w_lo = weight_row<W>(a, rows.lo), *w_hi = weight_row<W>(a, rows.hi);
        if (tile != blockIdx.x && finisher) {  // in flight while the tile streams
            load_rotation<EPI>(a, rows, inputs);
            load_scales<W>(a, rows, inputs);
            load_residual_inputs<EPI>(a, e_m, rows, inputs);
        }
        float acc[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[nt][j] = 0.0f;

        for (int first = warp; first < steps; first += WARPS * UNROLL) {
            if (!preloaded) load_group<W, WARPS>(wv, w_lo, w_hi, first, t, chunks);
            preloaded = false;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int step = first + u * WARPS;
                if (step >= steps) continue;  // the same for the whole warp
                const int c = step * (SKINNY_STEP / 8) + t;
                const uint4 lo_a = Weights<W>::bf16x8(wv[u][0]), lo_b = Weights<W>::bf16x8(wv[u][1]);
                const uint4 hi_a = Weights<W>::bf16x8(wv[u][2]), hi_b = Weights<W>::bf16x8(wv[u][3]);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const int m = nt * 8 + g;
                    uint4 xa = zero, xb = zero;
                    if (m < m_rows) {
                        xa = xs[m * x_stride + c];
                        xb = xs[m * x_stride + c + 4];
                    }
                    mma_step(acc[nt], lo_a, lo_b, hi_a, hi_b, xa, xb);
                }
            }
        }

        // the next tile's first k steps: in flight while this tile's sums are reduced
        TileRows next_rows = rows;
        if (tile + gridDim.x < tiles) {
            next_rows = tile_rows<EPI>(a, tile + gridDim.x, g);
            load_group<W, WARPS>(wv, weight_row<W>(a, next_rows.lo), weight_row<W>(a, next_rows.hi),
                                 warp, t, chunks);
            preloaded = true;
        }

        // sum the warps' partial tiles; two buffers, so one barrier per tile suffices
        float* part = partial + buffer * PARTIAL_FLOATS;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j)
                part[((warp * NT + nt) * 4 + j) * WARP_SIZE + lane] = acc[nt][j];
        __syncthreads();
        // fragment element j of this lane in x tile nt: x row nt * 8 + 2 t + (j & 1), weight
        // row lo(g) for j < 2, hi(g) for j >= 2
        if (finisher) {
            float lo_sum = 0.0f, hi_sum = 0.0f;
#pragma unroll
            for (int v = 0; v < WARPS; ++v) {
                lo_sum += part[v * NT * 4 * WARP_SIZE + (e_nt * 4 + e_j) * WARP_SIZE + lane];
                hi_sum += part[v * NT * 4 * WARP_SIZE + (e_nt * 4 + e_j + 2) * WARP_SIZE + lane];
            }
            if (W == W_FP8) {  // the rows' scales, before anything else sees the sums
                lo_sum *= inputs.scale_lo;
                hi_sum *= inputs.scale_hi;
            }
            finish<EPI>(a, e_m, rows, lo_sum, hi_sum, inputs);
        }
        rows = next_rows;
        buffer ^= 1;
    }
}

#define DEFINE_SKINNY(NAME, NT, PRO, EPI, WARPS, MIN_BLOCKS, W, STAGE)                     \
    extern "C" __global__ void __launch_bounds__(WARPS * WARP_SIZE, MIN_BLOCKS)               \
        NAME(const SkinnyArgs args, const AddedRows add) {                                   \
        skinny_body<NT, PRO, EPI, WARPS, W, STAGE>(args, add);                               \
    }

// NT: 8-column x tiles. The wide variant gives a
// block twice the warps (and loads in flight): for long rows in too few tiles to give
// every SM two blocks, such as the down projection. W: bf16 or FP8 weights.
DEFINE_SKINNY(skinny_n1, 1, PRO_PLAIN, EPI_STORE, SKINNY_WARPS, 2, W_BF16, STAGE_ALONE)
DEFINE_SKINNY(skinny_n2, 2, PRO_PLAIN, EPI_STORE, SKINNY_WARPS, 2, W_BF16, STAGE_ALONE)
DEFINE_SKINNY(skinny_wide_n1, 1, PRO_PLAIN, EPI_STORE, SKINNY_WIDE_WARPS, 1, W_BF16, STAGE_ALONE)
DEFINE_SKINNY(skinny_wide_n2, 2, PRO_PLAIN, EPI_STORE, SKINNY_WIDE_WARPS, 1, W_BF16, STAGE_ALONE)
DEFINE_SKINNY(skinny_norm_n1, 1, PRO_NORM, EPI_STORE, SKINNY_WARPS, 2, W_BF16, STAGE_ALONE)
DEFINE_SKINNY(skinny_norm_n2, 2, PRO_NORM, EPI_STORE, SKINNY_WARPS, 2, W_BF16, STAGE_ALONE)
DEFINE_SKINNY(skinny_norm_glu_n1, 1, PRO_NORM, EPI_GLU, SKINNY_WARPS, 2, W_BF16, STAGE_ALONE)
DEFINE_SKINNY(skinny_norm_glu_n2, 2, PRO_NORM, EPI_GLU, SKINNY_WARPS, 2, W_BF16, STAGE_ALONE)
DEFINE_SKINNY(skinny_norm_rope_n1, 1, PRO_NORM, EPI_ROPE, SKINNY_WARPS, 2, W_BF16, STAGE_ALONE)
DEFINE_SKINNY(skinny_norm_rope_n2, 2, PRO_NORM, EPI_ROPE, SKINNY_WARPS, 2, W_BF16, STAGE_ALONE)
// the normed products of 8 rows and more, launched in clusters that share x's staging
DEFINE_SKINNY(skinny_norm_n1_shared, 1, PRO_NORM, EPI_STORE, SKINNY_WARPS, 2, W_BF16, STAGE_SHARED)
DEFINE_SKINNY(skinny_norm_n2_shared, 2, PRO_NORM, EPI_STORE, SKINNY_WARPS, 2, W_BF16, STAGE_SHARED)
DEFINE_SKINNY(skinny_norm_glu_n1_shared, 1, PRO_NORM, EPI_GLU, SKINNY_WARPS, 2, W_BF16, STAGE_SHARED)
DEFINE_SKINNY(skinny_norm_glu_n2_shared, 2, PRO_NORM, EPI_GLU, SKINNY_WARPS, 2, W_BF16, STAGE_SHARED)
DEFINE_SKINNY(skinny_norm_rope_n1_shared, 1, PRO_NORM, EPI_ROPE, SKINNY_WARPS, 2, W_BF16, STAGE_SHARED)
DEFINE_SKINNY(skinny_norm_rope_n2_shared, 2, PRO_NORM, EPI_ROPE, SKINNY_WARPS, 2, W_BF16, STAGE_SHARED)
// the normed products that first add the sublayer before (PRO_ADD_NORM), up to 8 rows
DEFINE_SKINNY(skinny_add_norm_n1, 1, PRO_ADD_NORM, EPI_STORE, SKINNY_WARPS, 2, W_BF16, STAGE_ALONE)
DEFINE_SKINNY(skinny_add_norm_glu_n1, 1, PRO_ADD_NORM, EPI_GLU, SKINNY_WARPS, 2, W_BF16, STAGE_ALONE)
DEFINE_SKINNY(skinny_add_norm_rope_n1, 1, PRO_ADD_NORM, EPI_ROPE, SKINNY_WARPS, 2, W_BF16, STAGE_ALONE)
DEFINE_SKINNY(skinny_fp8_n1, 1, PRO_PLAIN, EPI_STORE, SKINNY_WARPS, 2, W_FP8, STAGE_ALONE)
DEFINE_SKINNY(skinny_fp8_n2, 2, PRO_PLAIN, EPI_STORE, SKINNY_WARPS, 2, W_FP8, STAGE_ALONE)
DEFINE_SKINNY(skinny_fp8_wide_n1, 1, PRO_PLAIN, EPI_STORE, SKINNY_WIDE_WARPS, 1, W_FP8, STAGE_ALONE)
DEFINE_SKINNY(skinny_fp8_wide_n2, 2, PRO_PLAIN, EPI_STORE, SKINNY_WIDE_WARPS, 1, W_FP8, STAGE_ALONE)
DEFINE_SKINNY(skinny_fp8_norm_n1, 1, PRO_NORM, EPI_STORE, SKINNY_WARPS, 2, W_FP8, STAGE_ALONE)
DEFINE_SKINNY(skinny_fp8_norm_n2, 2, PRO_NORM, EPI_STORE, SKINNY_WARPS, 2, W_FP8, STAGE_ALONE)
DEFINE_SKINNY(skinny_fp8_norm_glu_n1, 1, PRO_NORM, EPI_GLU, SKINNY_WARPS, 2, W_FP8, STAGE_ALONE)
DEFINE_SKINNY(skinny_fp8_norm_glu_n2, 2, PRO_NORM, EPI_GLU, SKINNY_WARPS, 2, W_FP8, STAGE_ALONE)
DEFINE_SKINNY(skinny_fp8_norm_rope_n1, 1, PRO_NORM, EPI_ROPE, SKINNY_WARPS, 2, W_FP8, STAGE_ALONE)
DEFINE_SKINNY(skinny_fp8_norm_rope_n2, 2, PRO_NORM, EPI_ROPE, SKINNY_WARPS, 2, W_FP8, STAGE_ALONE)
DEFINE_SKINNY(skinny_fp8_add_norm_n1, 1, PRO_ADD_NORM, EPI_STORE, SKINNY_WARPS, 2, W_FP8, STAGE_ALONE)
DEFINE_SKINNY(skinny_fp8_add_norm_glu_n1, 1, PRO_ADD_NORM, EPI_GLU, SKINNY_WARPS, 2, W_FP8, STAGE_ALONE)
DEFINE_SKINNY(skinny_fp8_add_norm_rope_n1, 1, PRO_ADD_NORM, EPI_ROPE, SKINNY_WARPS, 2, W_FP8, STAGE_ALONE)

// ------------------------------------------------------------------------------------------
// SIMT products, the same out[M, N] = x[M, K] w[N, K]^T for M <= 16 on the CUDA cores: each
// warp owns R consecutive weight rows and walks K in 16-byte chunks (8 bf16 per lane per
// load, U chunks per lane in flight), the few x rows come through the read-only cache, and
// each (x row, weight row) pair keeps an fp32 sum per lane, reduced over the warp at the end.
// The choice table (gemm.py) routes a product here where it measured fastest: on the H200
// the vocabulary-sized LM head at 1 and 2 rows (120.7 against cuBLAS's 126.3 and the
// tensor-core kernel's 154.9 us at 1 row).
// Needs K % 8 == 0 and 16-byte aligned x and w (the launcher checks, else uses cuBLAS).
// Launch: grid (ceil(N / (GEMV_WARPS * R))), block (GEMV_WARPS * 32); out is bf16 or, with
// out_f32 != 0, float32.

#define GEMV_WARPS 4

// M: x rows this variant handles (m_rows <= M are present); R: weight rows per warp;
// U: chunks per lane loaded before any is used
template <int M, int R, int U>
__device__ __forceinline__ void gemv_body(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                          void* __restrict__ out, int m_rows, int n, int k,
                                          int out_f32) {
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int row0 = (blockIdx.x * GEMV_WARPS + warp) * R;
    if (row0 >= n) return;  // the same for the whole warp
    const int chunks = k / 8;
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    const uint4* w_rows[R];
#pragma unroll
    for (int r = 0; r < R; ++r)  // rows past n re-read row n - 1 and are never stored
        w_rows[r] = reinterpret_cast<const uint4*>(w) + (long long)min(row0 + r, n - 1) * chunks;

    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;

    for (int base = lane; base < chunks; base += WARP_SIZE * U) {
        uint4 wv[U][R];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = base + u * WARP_SIZE;
#pragma unroll
            for (int r = 0; r < R; ++r)
                wv[u][r] = c < chunks ? __ldg(w_rows[r] + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = base + u * WARP_SIZE;
            if (c >= chunks) break;
            float wf[R][8];
#pragma unroll
            for (int r = 0; r < R; ++r) unpack_bf16x8(wv[u][r], wf[r]);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                if (m >= m_rows) break;
                float xf[8];
                unpack_bf16x8(__ldg(x4 + (long long)m * chunks + c), xf);
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[m][r] = fmaf(xf[j], wf[r][j], acc[m][r]);
            }
        }
    }

#pragma unroll
    for (int m = 0; m < M; ++m) {
        if (m >= m_rows) break;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float sum = warp_sum(acc[m][r]);
            const int col = row0 + r;
            if (lane == (m * R + r) % WARP_SIZE && col < n) {
                const long long idx = (long long)m * n + col;
                if (out_f32) static_cast<float*>(out)[idx] = sum;
                else static_cast<bf16*>(out)[idx] = to_bf16(sum);
            }
        }
    }
}

#define DEFINE_GEMV(NAME, M, R, U)                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE) NAME(               \
        const bf16* x, const bf16* w, void* out, int m_rows, int n, int k, int out_f32) {   \
        gemv_body<M, R, U>(x, w, out, m_rows, n, k, out_f32);                               \
    }

// M: x rows (m_rows <= M are present); R: weight rows per warp; U: chunks in flight
DEFINE_GEMV(gemv_m1, 1, 2, 4)
DEFINE_GEMV(gemv_m2, 2, 2, 4)
DEFINE_GEMV(gemv_m4, 4, 2, 4)
DEFINE_GEMV(gemv_m8, 8, 4, 2)
DEFINE_GEMV(gemv_m16, 16, 4, 2)
