// Log-probabilities of the sampled tokens, for the requests that ask: the model's raw
// log-softmax (before temperature and the filters), of the chosen token and of the k most
// likely ones. Only the asked-for numbers leave the GPU.
// Launch: grid (R), block (LOGPROB_THREADS); R rows of the step's logits (rows[r]), the
// tokens sampling chose for them (tokens[rows[r]]), k <= LOGPROB_MAX_K.
//
// One CTA per row: the row's maximum and log(sum exp(x - max)) in one pass over it (each
// thread's sum rescaled as its maximum grows, once per group of four logits it reads), the
// maximum being the first of the top k;
// then the rest of the top k one pass at a time, each the largest (logit, lower index
// first) after the one before, so no list of the chosen is kept. NaN logits count as -inf: never chosen, no mass. Output row r:
// values[r][0] = logprob of the sampled token, values[r][1 + j] = the j-th most likely
// token's (ids[r][...] alike).

#include "common.cuh"

#define LOGPROB_THREADS 1024
#define LOGPROB_MAX_K 20

// the larger of two (logit, index) pairs: larger logit, then lower index
__device__ __forceinline__ void keep_better(float& best, int& best_i, float v, int i) {
    if (v > best || (v == best && i < best_i)) {
        best = v;
        best_i = i;
    }
}

// the best pair of the block; every thread gets it. scratch_v / scratch_i hold >= 32
__device__ __forceinline__ void block_best(float& best, int& best_i, float* scratch_v,
                                           int* scratch_i) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1)
        keep_better(best, best_i, __shfl_xor_sync(FULL_MASK, best, offset),
                    __shfl_xor_sync(FULL_MASK, best_i, offset));
    __syncthreads();  // the scratch may still be read by a previous call
    if (lane == 0) {
        scratch_v[warp] = best;
        scratch_i[warp] = best_i;
    }
    __syncthreads();
    const int num_warps = blockDim.x / WARP_SIZE;
    best = lane < num_warps ? scratch_v[lane] : neg_inf();
    best_i = lane < num_warps ? scratch_i[lane] : 0x7fffffff;
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1)
        keep_better(best, best_i, __shfl_xor_sync(FULL_MASK, best, offset),
                    __shfl_xor_sync(FULL_MASK, best_i, offset));
}

__device__ __forceinline__ float finite_or_low(float x) { return x == x ? x : neg_inf(); }

extern "C" __global__ void __launch_bounds__(LOGPROB_THREADS)
logprobs_kernel(const float* __restrict__ logits, int vocab, const int* __restrict__ rows,
                const int* __restrict__ tokens, int k, float* __restrict__ values,
                int* __restrict__ ids) {
    __shared__ float scratch_v[WARP_SIZE];
    __shared__ int scratch_i[WARP_SIZE];
    __shared__ float sum_scratch[WARP_SIZE];
    const int row = rows[blockIdx.x];
    const float* x = logits + (long long)row * vocab;

    float best = neg_inf();
    int best_i = 0x7fffffff;
    // one pass: each thread's best pair and its sum of exp(x - its maximum), rescaled as
    // the maximum grows (a thread sees its indices in increasing order, so a tie keeps
    // the first); then the block's best pair and the sums rescaled to its maximum
    float sum = 0.0f;
    // rows of a vocabulary that is a multiple of 4 start at 16-byte boundaries: read four
    // logits a load, two loads in flight, then the remaining ones one by one (a thread's
    // indices still increase, groups of four before the rest)
    const int vec_end = vocab % 4 == 0 ? vocab : 0;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int g = threadIdx.x; 4 * g < vec_end; g += 2 * LOGPROB_THREADS) {
        float4 pair[2];
        pair[0] = x4[g];
        const bool second = 4 * (g + LOGPROB_THREADS) < vec_end;
        if (second) pair[1] = x4[g + LOGPROB_THREADS];
        for (int p = 0; p < (second ? 2 : 1); ++p) {
            const float v[4] = {finite_or_low(pair[p].x), finite_or_low(pair[p].y),
                                finite_or_low(pair[p].z), finite_or_low(pair[p].w)};
            const int base = 4 * (g + p * LOGPROB_THREADS);
            // the group's maximum and its first index, then one rescale where it is new
            float m = v[0];
            int m_i = base;
            for (int j = 1; j < 4; ++j)
                if (v[j] > m) { m = v[j]; m_i = base + j; }
            if (m > best) {
                sum *= expf(best - m);  // 0 while best is -inf
                best = m;
                best_i = m_i;
            } else if (best_i == 0x7fffffff) {
                best_i = base;  // -inf so far (keep_better's lowest index of equals)
            }
            if (best > neg_inf())
                sum += expf(v[0] - best) + expf(v[1] - best) + expf(v[2] - best) + expf(v[3] - best);
        }
    }
    for (int i = vec_end + threadIdx.x; i < vocab; i += LOGPROB_THREADS) {
        const float v = finite_or_low(x[i]);
        if (v > best) {
            sum = sum * expf(best - v) + 1.0f;  // expf(-inf) = 0 at the first finite value
            best = v;
            best_i = i;
        } else if (best_i == 0x7fffffff) {
            best_i = i;  // -inf so far (keep_better's lowest index of equals)
        } else if (v > neg_inf()) {
            sum += expf(v - best);
        }
    }
    const float own_max = best, own_sum = sum;
    block_best(best, best_i, scratch_v, scratch_i);
    const float max_logit = best;  // -inf only for a row of NaN and -inf: then every value is NaN
    const int max_i = best_i;
    const float rescaled = own_sum > 0.0f ? own_sum * expf(own_max - max_logit) : 0.0f;
    const float log_total = max_logit + logf(block_sum(rescaled, sum_scratch));

    float* out_values = values + (long long)blockIdx.x * (k + 1);
    int* out_ids = ids + (long long)blockIdx.x * (k + 1);
    if (threadIdx.x == 0) {
        const int chosen = tokens[row];
        out_ids[0] = chosen;
        out_values[0] = finite_or_low(x[chosen]) - log_total;
    }
    // the top k: the first is the row's best pair, the j-th the best pair below the
    // (j-1)-th in the (logit, -index) order
    if (k > 0 && threadIdx.x == 0) {
        out_ids[1] = max_i < vocab ? max_i : 0;
        out_values[1] = max_i < vocab ? max_logit - log_total : neg_inf();
    }
    float prev = max_logit;
    int prev_i = max_i;
    for (int j = 1; j < k; ++j) {
        best = neg_inf();
        best_i = 0x7fffffff;
        for (int i = threadIdx.x; i < vocab; i += LOGPROB_THREADS) {
            const float v = finite_or_low(x[i]);
            if (v < prev || (v == prev && i > prev_i)) keep_better(best, best_i, v, i);
        }
        block_best(best, best_i, scratch_v, scratch_i);
        if (threadIdx.x == 0) {
            out_ids[1 + j] = best_i < vocab ? best_i : 0;  // fewer than k tokens: id 0, -inf
            out_values[1 + j] = best_i < vocab ? best - log_total : neg_inf();
        }
        prev = best;
        prev_i = best_i;
    }
}
