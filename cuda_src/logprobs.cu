// Log-probabilities of the sampled tokens, for the requests that ask: the model's raw
// log-softmax (before temperature and the filters), of the chosen token and of the k most
// likely ones. Only the asked-for numbers leave the GPU.
// Launch: grid (R), block (LOGPROB_THREADS); R rows of the step's logits (rows[r]), the
// tokens sampling chose for them (tokens[rows[r]]), k <= LOGPROB_MAX_K:
// logprobs_kernel for k <= 1, logprobs_top_kernel for any k (its lists take registers).
//
// One CTA per row and one pass over it. Each thread keeps the row's maximum and
// sum exp(x - max) over the logits it reads (the sum rescaled as its maximum grows, once
// per group of four logits), and its own best max(k, 1) (logit, index) pairs, best first,
// in registers. Then k rounds over the block: the best of the threads' first pairs is the
// next of the row's top k, and the thread that held it moves its list up. Round 0's best is
// the row's maximum, which turns the threads' sums into log(sum exp(x - max)). Both kernels
// do the same arithmetic for the maximum and the sum, so a row's values do not depend on
// which one ran. Ties go to the lower index; NaN logits count as -inf: never chosen, no
// mass. Output row r: values[r][0] = logprob of the sampled token, values[r][1 + j] = the
// j-th most likely token's (ids[r][...] alike; past the vocabulary, id 0 and -inf); where
// ranks is not null, ranks[r] = the sampled token's place in the row's order, 1 + the
// logits that rank before it (so a token among the top k has its place there).

#include "common.cuh"

#define LOGPROB_THREADS 256
#define LOGPROB_MAX_K 20
#define NO_INDEX 0x7fffffff

// whether pair (v, i) ranks before (w, j): larger logit, then lower index
__device__ __forceinline__ bool ranks_before(float v, int i, float w, int j) {
    return v > w || (v == w && i < j);
}

// the first-ranked pair of the block; every thread gets it. scratch_v / scratch_i hold >= 32
__device__ __forceinline__ void block_best(float& best, int& best_i, float* scratch_v,
                                           int* scratch_i) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        const float v = __shfl_xor_sync(FULL_MASK, best, offset);
        const int i = __shfl_xor_sync(FULL_MASK, best_i, offset);
        if (ranks_before(v, i, best, best_i)) { best = v; best_i = i; }
    }
    __syncthreads();  // the scratch may still be read by a previous call
    if (lane == 0) {
        scratch_v[warp] = best;
        scratch_i[warp] = best_i;
    }
    __syncthreads();
    const int num_warps = blockDim.x / WARP_SIZE;
    best = lane < num_warps ? scratch_v[lane] : neg_inf();
    best_i = lane < num_warps ? scratch_i[lane] : NO_INDEX;
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        const float v = __shfl_xor_sync(FULL_MASK, best, offset);
        const int i = __shfl_xor_sync(FULL_MASK, best_i, offset);
        if (ranks_before(v, i, best, best_i)) { best = v; best_i = i; }
    }
}

__device__ __forceinline__ float finite_or_low(float x) { return x == x ? x : neg_inf(); }

// A thread's best `keep` (logit, index) pairs, best first, keep <= CAP, and apart from them,
// in registers, the bar a new pair must rank before: the list's keep-th pair, or its warp's
// best bar where that ranks higher (logprobs_row); a pair that does not clear it costs one
// test. The list itself is touched only when a pair
// enters it (local memory, cached in L1, for a list of several; registers for one).
template <int CAP>
struct TopList {
    float v[CAP];
    int i[CAP];
};

template <int CAP>
__device__ __forceinline__ void offer(TopList<CAP>& top, float& bar_v, int& bar_i, float value,
                                      int index, int keep) {
    if (!ranks_before(value, index, bar_v, bar_i)) return;
    int s = keep - 1;  // the keep-th leaves; the pairs ranking after the new one move down
    for (; s > 0 && ranks_before(value, index, top.v[s - 1], top.i[s - 1]); --s) {
        top.v[s] = top.v[s - 1];
        top.i[s] = top.i[s - 1];
    }
    top.v[s] = value;
    top.i[s] = index;
    if (ranks_before(top.v[keep - 1], top.i[keep - 1], bar_v, bar_i)) {  // the bar only rises
        bar_v = top.v[keep - 1];
        bar_i = top.i[keep - 1];
    }
}

template <int CAP>
__device__ __forceinline__ void pop(TopList<CAP>& top, int keep) {
    for (int s = 0; s + 1 < keep; ++s) { top.v[s] = top.v[s + 1]; top.i[s] = top.i[s + 1]; }
    top.v[keep - 1] = neg_inf();
    top.i[keep - 1] = NO_INDEX;
}

// four logits at indices base..base + 3 into a thread's maximum, sum, list and count of
// the logits that rank before the sampled token's (chosen_v, chosen)
template <int CAP>
__device__ __forceinline__ void scan_group(float4 group, int base, float& own_max, float& sum,
                                           TopList<CAP>& top, float& bar_v, int& bar_i,
                                           int keep, float chosen_v, int chosen, int& ahead) {
    const float v0 = finite_or_low(group.x), v1 = finite_or_low(group.y),
                v2 = finite_or_low(group.z), v3 = finite_or_low(group.w);
    ahead += ranks_before(v0, base, chosen_v, chosen) + ranks_before(v1, base + 1, chosen_v, chosen)
             + ranks_before(v2, base + 2, chosen_v, chosen)
             + ranks_before(v3, base + 3, chosen_v, chosen);
    const float m = fmaxf(fmaxf(v0, v1), fmaxf(v2, v3));
    if (m > own_max) {
        sum *= expf(own_max - m);  // 0 while own_max is -inf
        own_max = m;
    }
    if (own_max > neg_inf())
        sum += expf(v0 - own_max) + expf(v1 - own_max) + expf(v2 - own_max) + expf(v3 - own_max);
    offer(top, bar_v, bar_i, v0, base, keep);
    offer(top, bar_v, bar_i, v1, base + 1, keep);
    offer(top, bar_v, bar_i, v2, base + 2, keep);
    offer(top, bar_v, bar_i, v3, base + 3, keep);
}

template <int CAP>
__device__ __forceinline__ void logprobs_row(const float* __restrict__ logits, int vocab,
                                             const int* __restrict__ rows,
                                             const int* __restrict__ tokens, int k,
                                             float* __restrict__ values, int* __restrict__ ids,
                                             int* __restrict__ ranks) {
    __shared__ float scratch_v[WARP_SIZE];
    __shared__ int scratch_i[WARP_SIZE];
    __shared__ float sum_scratch[WARP_SIZE];
    const int row = rows[blockIdx.x];
    const float* x = logits + (long long)row * vocab;
    const int chosen = tokens[row];
    const float chosen_v = finite_or_low(x[chosen]);
    int ahead = 0;  // this thread's logits that rank before the chosen token's
    const int keep = CAP == 1 ? 1 : (k > 1 ? k : 1);  // a constant for a list of one

    TopList<CAP> top;
    for (int s = 0; s < keep; ++s) { top.v[s] = neg_inf(); top.i[s] = NO_INDEX; }
    float bar_v = neg_inf();
    int bar_i = NO_INDEX;
    float own_max = neg_inf(), sum = 0.0f;  // sum of exp(x - own_max) over finite x
    // rows of a vocabulary that is a multiple of 4 start at 16-byte boundaries: four
    // logits a load, two loads in flight; otherwise one by one. A thread's indices
    // increase, so a tie keeps the first it saw.
    const int vec_end = vocab % 4 == 0 ? vocab : 0;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const int lane = threadIdx.x % WARP_SIZE;
    // the warp steps together (its lane 0 has the most groups), so that lists of several
    // can share a bar: any lane's keep-th pair ranks after at least `keep` pairs of the
    // row, so a pair ranking after it is in no top k. Taking the best of the lanes' bars
    // after each step keeps most pairs out of every list once the first steps are read.
    for (int warp_g = threadIdx.x - lane; 4 * warp_g < vec_end; warp_g += 2 * LOGPROB_THREADS) {
        const int g = warp_g + lane;
        if (4 * g < vec_end) {
            const float4 first = x4[g];
            const bool second = 4 * (g + LOGPROB_THREADS) < vec_end;
            const float4 next = second ? x4[g + LOGPROB_THREADS] : first;
            scan_group(first, 4 * g, own_max, sum, top, bar_v, bar_i, keep, chosen_v, chosen,
                       ahead);
            if (second)
                scan_group(next, 4 * (g + LOGPROB_THREADS), own_max, sum, top, bar_v, bar_i,
                           keep, chosen_v, chosen, ahead);
        }
        if (CAP > 1) {
            for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
                const float v = __shfl_xor_sync(FULL_MASK, bar_v, offset);
                const int i = __shfl_xor_sync(FULL_MASK, bar_i, offset);
                if (ranks_before(v, i, bar_v, bar_i)) { bar_v = v; bar_i = i; }
            }
        }
    }
    for (int i = vec_end + threadIdx.x; i < vocab; i += LOGPROB_THREADS) {
        const float v = finite_or_low(x[i]);
        ahead += ranks_before(v, i, chosen_v, chosen);
        if (v > own_max) {
            sum = sum * expf(own_max - v) + 1.0f;  // expf(-inf) = 0 at the first finite value
            own_max = v;
        } else if (v > neg_inf()) {
            sum += expf(v - own_max);
        }
        offer(top, bar_v, bar_i, v, i, keep);
    }

    float* out_values = values + (long long)blockIdx.x * (k + 1);
    int* out_ids = ids + (long long)blockIdx.x * (k + 1);
    float log_total = 0.0f;
    for (int j = 0; j < keep; ++j) {
        float best = top.v[0];
        int best_i = top.i[0];
        block_best(best, best_i, scratch_v, scratch_i);
        if (j == 0) {  // the row's maximum: -inf only for a row of NaN and -inf (then NaN)
            const float rescaled = sum > 0.0f ? sum * expf(own_max - best) : 0.0f;
            log_total = best + logf(block_sum(rescaled, sum_scratch));
            if (threadIdx.x == 0) {
                out_ids[0] = chosen;
                out_values[0] = chosen_v - log_total;
            }
        }
        if (j < k && threadIdx.x == 0) {
            out_ids[1 + j] = best_i < vocab ? best_i : 0;
            out_values[1 + j] = best_i < vocab ? best - log_total : neg_inf();
        }
        if (best_i < vocab && top.i[0] == best_i) pop(top, keep);
    }
    if (ranks != nullptr) {  // counts below 2^24 add exactly in float32
        const float before = block_sum(static_cast<float>(ahead), sum_scratch);
        if (threadIdx.x == 0) ranks[blockIdx.x] = 1 + static_cast<int>(before);
    }
}

extern "C" __global__ void __launch_bounds__(LOGPROB_THREADS)
logprobs_kernel(const float* __restrict__ logits, int vocab, const int* __restrict__ rows,
                const int* __restrict__ tokens, int k, float* __restrict__ values,
                int* __restrict__ ids, int* __restrict__ ranks) {
    logprobs_row<1>(logits, vocab, rows, tokens, k, values, ids, ranks);
}

extern "C" __global__ void __launch_bounds__(LOGPROB_THREADS)
logprobs_top_kernel(const float* __restrict__ logits, int vocab, const int* __restrict__ rows,
                    const int* __restrict__ tokens, int k, float* __restrict__ values,
                    int* __restrict__ ids, int* __restrict__ ranks) {
    logprobs_row<LOGPROB_MAX_K>(logits, vocab, rows, tokens, k, values, ids, ranks);
}
