// Every layer of a small decode step in one persistent kernel.
//
// Built on gemv.cu and attention.cu, whose device functions the loader compiles into this
// module (kernels.MODULE_BASES). At batch 1 a step is bound by its 2.5 GB weight stream,
// but run as separate kernels each of the six launches of a layer pays a fill and a drain
// on every SM. Here one grid of LAYERS_BLOCKS_PER_SM blocks per SM (all resident at once:
// a cooperative launch) runs the phases of every layer back to back:
//   1. RMSNorm + qkv product + RoPE + KV-cache write  (skinny_body, EPI_ROPE) -> q, caches
//   2. decode attention per (sequence, kv head, split) (decode_attention_body) -> partials;
//      the last split of a (sequence, kv head) to end merges them (combine_value) -> attn
//   3. o_proj added into the float32 residual stream  (skinny_body, OUT_F32_ADD)
//   4. RMSNorm + gate/up product + SiLU-and-mul       (skinny_body, EPI_SILU)  -> act
//   5. down added into the residual stream            (skinny_body, OUT_F32_ADD)
// with the arithmetic of the separate kernels (the products and the merge give the same
// bits; attention runs each split with 8 warps instead of 4, so its sums are ordered
// differently). Attention items go to the last blocks, so that the first ones, which hold
// the o_proj tiles, load those weights meanwhile.
//
// Phases are separated by one grid-wide counter instead of kernel boundaries: a block that
// has done its share of a phase adds 1 to the counter and goes on to the next phase,
// where it loads the first weights of its first tile before it waits for the counter to
// reach (phases ended) * gridDim.x. So weights keep streaming while the slowest block of a
// phase finishes it, and a block with no work in a phase (attention keeps few blocks busy
// at batch 1) preloads the next product meanwhile. Everything one block writes and
// another reads in this kernel (residual, q, the caches, partials, attn, act) is read at
// L2 (ld.cg in stage_x, load16, combine_value, store_out), never through an SM's L1,
// which is not coherent.
//
// Needs: at most 8 rows (one new token per sequence), head_dim 64 or 128 with at most 4
// query heads per kv head, the counter zero at launch, and room for every block at once
// (the launcher checks; layers.py).

#define LAYERS_WARPS 8
#define LAYERS_BLOCKS_PER_SM 2
#define LAYER_PHASES 5

// one layer's weights and caches (keep in step with layers.LayerWeights)
struct LayerWeights {
    const bf16* input_norm;  // [H]
    const bf16* qkv;         // [(nh + 2 nkv) d, H]
    const bf16* o_proj;      // [H, nh d]
    const bf16* post_norm;   // [H]
    const bf16* gate_up;     // [2 I, H]: gate rows, then up rows
    const bf16* down;        // [H, I]
    bf16* k_cache;           // [num_blocks, block_size, nkv, d]
    bf16* v_cache;
};

// keep in step with layers.LayersArgs (pointers first, then 4-byte fields: no padding)
struct LayersArgs {
    const LayerWeights* layers;   // [num_layers]
    float* residual;              // [M, H] float32: the embeddings in, the last layer's out
    bf16* q;                      // [M, nh, d] scratch
    bf16* attn;                   // [M, nh d] scratch
    bf16* act;                    // [M, I] scratch
    float* partial_out;           // [M, nh, num_splits, d] scratch
    float* partial_lse;           // [M, nh, num_splits] scratch
    const int* positions;         // [M]
    const int* slot_mapping;      // [M]; slot < 0: nothing written to the caches
    const int* block_tables;      // [M, max_blocks_per_seq]
    const int* seq_lens;          // [M]
    const int* query_start_loc;   // [M + 1]: one new token per sequence
    const float* cos_sin;         // [max_pos, d]
    unsigned* counter;            // phase ends of all blocks so far; zero at launch
    unsigned* split_counts;       // [M, nkv]: splits ended in this layer; zero at launch
    unsigned long long* timings;  // null, or [num_layers * LAYER_PHASES + 1]: see below
    int num_layers, m_rows, hidden, intermediate, num_heads, num_kv_heads, head_dim;
    int block_shift, max_blocks_per_seq, num_splits;  // attention (see attention.cu)
    float eps, scale_log2;
};

// Wait until every block has ended `ended` phases (the skinny_body hook). With timings,
// block 0 notes the time it saw phase `ended` - 1 end (%globaltimer, ns).
struct AfterPhase {
    const unsigned* counter;
    unsigned target;
    unsigned long long* timing;
    __device__ __forceinline__ void wait() const {
        if (threadIdx.x == 0) {
            unsigned seen;
            do {  // acquire: what the blocks wrote before their release is visible after
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];"
                             : "=r"(seen) : "l"(counter) : "memory");
            } while (seen < target);
            if (timing != nullptr && blockIdx.x == 0) {
                unsigned long long now;
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
                *timing = now;
            }
        }
        __syncthreads();
    }
};

__device__ __forceinline__ AfterPhase after_phase(const LayersArgs& a, int ended) {
    return AfterPhase{a.counter, ended * gridDim.x,
                      a.timings != nullptr ? a.timings + ended : nullptr};
}

// this block's share of a phase is written: count it, after all of its threads (release:
// their writes are visible to whoever acquires the count)
__device__ __forceinline__ void end_phase(const LayersArgs& a) {
    __syncthreads();
    if (threadIdx.x == 0)
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(a.counter) : "memory");
}

// this block's (sequence, kv head, split) items, one after another, from the last block
// down; the last split of a (sequence, kv head) to end merges its group of query heads
template <int D, int MAXG>
__device__ __forceinline__ void attention_phase(const LayersArgs& a, const LayerWeights& lw) {
    __shared__ unsigned ended_before;  // splits of this item's (sequence, kv head) ended before it
    const int nh = a.num_heads, nkv = a.num_kv_heads, splits = a.num_splits;
    const int group = nh / nkv;
    for (int item = gridDim.x - 1 - blockIdx.x; item < a.m_rows * nkv * splits;
         item += gridDim.x) {
        const int b = item / (splits * nkv), kv_head = item / splits % nkv;
        decode_attention_body<D, MAXG, LAYERS_WARPS>(
            b, kv_head, item % splits, a.q, lw.k_cache, lw.v_cache, a.block_tables,
            a.seq_lens, a.query_start_loc, a.attn, a.partial_out, a.partial_lse, nh, nkv,
            a.block_shift, a.max_blocks_per_seq, a.scale_log2, splits, 0);
        __syncthreads();  // its partials are written, its shared merge arrays free again
        if (splits == 1) continue;  // it wrote attn itself
        unsigned* count = a.split_counts + b * nkv + kv_head;
        if (threadIdx.x == 0)
            asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                         : "=r"(ended_before) : "l"(count) : "memory");
        __syncthreads();
        if (ended_before == splits - 1) {  // the last: every split's partials are visible
            for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
                const long long row = (long long)b * nh + kv_head * group + i / D;
                a.attn[row * D + i % D] = to_bf16(combine_value(
                    a.partial_out, a.partial_lse, row * splits, splits, D, i % D));
            }
            if (threadIdx.x == 0) *count = 0;  // for the next layer (phases away)
        }
        __syncthreads();
    }
}

template <int D, int MAXG>
__device__ __forceinline__ void decode_layers_body(const LayersArgs& a) {
    const int nh = a.num_heads, nkv = a.num_kv_heads, m_rows = a.m_rows;
    wait_for_previous_kernel();  // a no-op unless launched programmatically
    // a product's arguments, written by thread 0 between phases: in shared memory they
    // take no registers from the weight loads in flight
    __shared__ SkinnyArgs p;
    const bool writer = threadIdx.x == 0;
    int ended = 0;  // phases every block has to have ended before the next
    for (int layer = 0; layer < a.num_layers; ++layer) {
        const LayerWeights& lw = a.layers[layer];

        if (writer) {  // 1. norm, qkv, RoPE, cache write
        p = SkinnyArgs{};
        p.x = a.residual;
        p.norm_weight = lw.input_norm;
        p.w = lw.qkv;
        p.out = a.q;
        p.positions = a.positions;
        p.slot_mapping = a.slot_mapping;
        p.cos_sin = a.cos_sin;
        p.k_cache = lw.k_cache;
        p.v_cache = lw.v_cache;
        p.m_rows = m_rows;
        p.n = (nh + 2 * nkv) * D;
        p.k = a.hidden;
        p.num_heads = nh;
        p.num_kv_heads = nkv;
        p.head_dim = D;
        p.eps = a.eps;
        }
        __syncthreads();
        skinny_body<1, PRO_NORM, EPI_ROPE, LAYERS_WARPS>(p, after_phase(a, ended++));
        end_phase(a);

        after_phase(a, ended++).wait();  // 2. attention and the split merge
        attention_phase<D, MAXG>(a, lw);
        end_phase(a);

        if (writer) {  // 3. residual += attn o_proj^T
        p = SkinnyArgs{};
        p.x = a.attn;
        p.w = lw.o_proj;
        p.out = a.residual;
        p.out_mode = OUT_F32_ADD;
        p.m_rows = m_rows;
        p.n = a.hidden;
        p.k = nh * D;
        }
        __syncthreads();
        skinny_body<1, PRO_PLAIN, EPI_STORE, LAYERS_WARPS>(p, after_phase(a, ended++));
        end_phase(a);

        if (writer) {  // 4. norm, gate/up, SiLU-and-mul
        p = SkinnyArgs{};
        p.x = a.residual;
        p.norm_weight = lw.post_norm;
        p.w = lw.gate_up;
        p.out = a.act;
        p.m_rows = m_rows;
        p.n = 2 * a.intermediate;
        p.k = a.hidden;
        p.eps = a.eps;
        }
        __syncthreads();
        skinny_body<1, PRO_NORM, EPI_SILU, LAYERS_WARPS>(p, after_phase(a, ended++));
        end_phase(a);

        if (writer) {  // 5. residual += act down^T
        p = SkinnyArgs{};
        p.x = a.act;
        p.w = lw.down;
        p.out = a.residual;
        p.out_mode = OUT_F32_ADD;
        p.m_rows = m_rows;
        p.n = a.hidden;
        p.k = a.intermediate;
        }
        __syncthreads();
        skinny_body<1, PRO_PLAIN, EPI_STORE, LAYERS_WARPS>(p, after_phase(a, ended++));
        end_phase(a);
    }
    if (a.timings != nullptr && blockIdx.x == 0) after_phase(a, ended).wait();  // the last end
}

#define DEFINE_DECODE_LAYERS(D, MAXG)                                                      \
    extern "C" __global__ void __launch_bounds__(LAYERS_WARPS * WARP_SIZE,                 \
                                                 LAYERS_BLOCKS_PER_SM)                     \
        decode_layers_d##D##_g##MAXG(const LayersArgs args) {                              \
        decode_layers_body<D, MAXG>(args);                                                 \
    }

// keep in step with layers.HEAD_DIMS and MAX_GROUP (query heads per kv head <= MAXG)
DEFINE_DECODE_LAYERS(64, 4)
DEFINE_DECODE_LAYERS(128, 4)
