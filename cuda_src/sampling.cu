// Token sampling on the device: one CTA per sequence, only the chosen ids leave the GPU.
// Launch: grid (B), block (SAMPLE_THREADS = 1024).
//
// Greedy (temperature <= 0): argmax, lowest index on ties. Otherwise, with
// w_i = exp((logit_i - max) / temperature) (unnormalized probabilities, max 1), the same
// filters and order as numpy_ops.filtered_probs:
//   top-k  keep the k largest (ties broken by lower index), when 0 < k < vocab;
//   top-p  among those, in descending order, keep a token while the mass of the tokens
//          before it is < top_p (of the top-k mass), when top_p < 1;
//   min-p  keep w_i >= min_p (that is p_i >= min_p * p_max).
// Thresholds are found without sorting: radix select over the order-preserving 32-bit key
// of each fp32 logit (four 8-bit passes over the row, counting or summing mass per digit).
// A kept set is "key > threshold, or key == threshold and index <= last_index", which
// handles ties exactly like a stable sort. The token is then drawn by inverse CDF with
// u = hash(seed, step) in [0, 1) (splitmix64) over the kept tokens in a fixed order (thread
// t's tokens t, t + 1024, ... in turn: coalesced reads), so a request's seed reproduces
// its tokens whatever the batch.

#define SAMPLE_THREADS 1024
#define ARGMAX_UNROLL 8  // 16-byte loads in flight per thread in the argmax pass
#define CDF_UNROLL 8     // token weights computed together in the inverse-CDF walk
#define RADIX_BINS 256

__device__ __forceinline__ unsigned int order_key(float f) {
    const unsigned int u = __float_as_uint(f == 0.0f ? 0.0f : f);  // -0 and +0 are equal
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // larger float, larger key
}

__device__ __forceinline__ float key_to_float(unsigned int key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

struct Selected {
    unsigned int key;          // the selected key
    unsigned int rank;         // rank still wanted among the candidates with that key
    unsigned int count_equal;  // candidates with that key
    float mass_above;          // (mass select) mass of candidates with larger keys
    bool found;                // (mass select) false: the target was never reached
};

#define MASS_ONE 1099511627776.0f  // 2^40: a weight of 1 in the fixed-point mass histogram

struct SampleShared {
    unsigned int count_hist[RADIX_BINS];
    unsigned long long mass_hist[RADIX_BINS];  // fixed point (MASS_ONE): order-free sums
    float scratch[WARP_SIZE];
    float prefix[SAMPLE_THREADS + 1];
    int best_index[WARP_SIZE];
    Selected selected;
};

// Histogram adds with one shared-memory atomic per distinct digit in the warp: the
// passes' first digit (sign and top exponent bits) is the same for almost every logit, and
// 32 lanes adding to one bin one after another made the passes the sampler's cost. Every
// lane of the warp calls these together; `active` lanes add. The mass is fixed point
// below 2^41 per lane, summed over a digit's lanes in two parts that cannot overflow 32
// bits (21 low bits, the rest), so the total is exact and order-free.
__device__ __forceinline__ unsigned digit_peers(bool active, int digit) {
    const unsigned active_lanes = __ballot_sync(FULL_MASK, active);
    return active ? __match_any_sync(active_lanes, digit) : 0u;
}

__device__ __forceinline__ void add_count(unsigned int* hist, unsigned peers, int digit) {
    if (peers != 0u && (threadIdx.x % WARP_SIZE) == __ffs(peers) - 1)
        atomicAdd(&hist[digit], (unsigned int)__popc(peers));
}

__device__ __forceinline__ void add_mass(unsigned long long* hist, unsigned peers, int digit,
                                         unsigned long long mass) {
    if (peers == 0u) return;
    const unsigned low = __reduce_add_sync(peers, (unsigned int)(mass & 0x1FFFFFull));
    const unsigned high = __reduce_add_sync(peers, (unsigned int)(mass >> 21));
    if ((threadIdx.x % WARP_SIZE) == __ffs(peers) - 1)
        atomicAdd(&hist[digit], ((unsigned long long)high << 21) + low);
}

// The rank-th largest key (1-based) among candidates i < n.
template <typename Candidate, typename KeyOf>
__device__ Selected select_by_count(SampleShared& sh, int n, Candidate is_candidate,
                                    KeyOf key_of, unsigned int rank) {
    unsigned int prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < RADIX_BINS; i += blockDim.x) sh.count_hist[i] = 0;
        __syncthreads();
        // the lanes of a warp go through the loop together (digit_peers is warp-wide)
        for (int start = threadIdx.x - threadIdx.x % WARP_SIZE; start < n; start += blockDim.x) {
            const int i = start + threadIdx.x % WARP_SIZE;
            const bool candidate = i < n && is_candidate(i);
            const unsigned int key = candidate ? key_of(i) : 0u;
            const int digit = (key >> shift) & 0xFF;
            add_count(sh.count_hist, digit_peers(candidate && (key & mask) == prefix, digit), digit);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned int above = 0;
            int digit = RADIX_BINS - 1;
            for (; digit > 0; --digit) {
                if (above + sh.count_hist[digit] >= rank) break;
                above += sh.count_hist[digit];
            }
            sh.selected.key = prefix | ((unsigned int)digit << shift);
            sh.selected.rank = rank - above;
            sh.selected.count_equal = sh.count_hist[digit];
        }
        __syncthreads();
        prefix = sh.selected.key;
        rank = sh.selected.rank;
        mask |= 0xFFu << shift;
    }
    Selected result = sh.selected;
    __syncthreads();  // everyone has read sh.selected before it is written again
    return result;
}

// The key where the descending cumulative mass of the candidates first reaches `target`:
// mass(keys > key) < target <= mass(keys >= key).
template <typename Candidate, typename KeyOf, typename WeightOf>
__device__ Selected select_by_mass(SampleShared& sh, int n, Candidate is_candidate,
                                   KeyOf key_of, WeightOf weight_of, float target) {
    unsigned int prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < RADIX_BINS; i += blockDim.x) {
            sh.count_hist[i] = 0;
            sh.mass_hist[i] = 0ull;
        }
        __syncthreads();
        for (int start = threadIdx.x - threadIdx.x % WARP_SIZE; start < n; start += blockDim.x) {
            const int i = start + threadIdx.x % WARP_SIZE;
            const bool candidate = i < n && is_candidate(i);
            const unsigned int key = candidate ? key_of(i) : 0u;
            const bool counted = candidate && (key & mask) == prefix;
            const int digit = (key >> shift) & 0xFF;
            const unsigned peers = digit_peers(counted, digit);
            add_count(sh.count_hist, peers, digit);
            // integer sums do not depend on the order the threads arrive in, so the same
            // seed draws the same token every time (weights are at most 1)
            add_mass(sh.mass_hist, peers, digit,
                     counted ? (unsigned long long)__float2ull_rn(weight_of(i) * MASS_ONE) : 0ull);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            // scan digits from the largest; the first one whose mass reaches the target is
            // chosen. If float rounding keeps the target out of reach inside the range
            // narrowed by an earlier pass, the range's last digit with mass is chosen.
            float above = shift == 24 ? 0.0f : sh.selected.mass_above;
            float above_chosen = above;
            int chosen = -1;
            bool reached = false;
            for (int digit = RADIX_BINS - 1; digit >= 0; --digit) {
                const float mass = (float)sh.mass_hist[digit] * (1.0f / MASS_ONE);
                if (!(mass > 0.0f)) continue;
                chosen = digit;
                above_chosen = above;
                if (above + mass >= target) {
                    reached = true;
                    break;
                }
                above += mass;
            }
            // not reached on the first pass: the candidates hold less mass than the
            // target (top_p rounding to about 1), so nothing is cut
            sh.selected.found = chosen >= 0 && (reached || shift != 24);
            if (sh.selected.found) {
                sh.selected.key = prefix | ((unsigned int)chosen << shift);
                sh.selected.mass_above = above_chosen;
                sh.selected.count_equal = sh.count_hist[chosen];
            }
        }
        __syncthreads();
        const bool found = sh.selected.found;
        prefix = sh.selected.key;
        mask |= 0xFFu << shift;
        if (!found) break;  // the same for every thread
        __syncthreads();    // sh.selected read before thread 0 updates it
    }
    Selected result = sh.selected;
    __syncthreads();
    return result;
}

// one CTA per SM is enough (min blocks 1): ptxas may then use up to 64 registers per
// thread, which the argmax pass's loads in flight need (else it aims at 32 and spills)
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 1) sample_kernel(
        const float* __restrict__ logits, int vocab, const float* __restrict__ temperature,
        const int* __restrict__ top_k, const float* __restrict__ top_p,
        const float* __restrict__ min_p, const unsigned long long* __restrict__ seeds,
        const int* __restrict__ steps, int* __restrict__ out_tokens) {
    __shared__ SampleShared sh;
    const int b = blockIdx.x;
    const float* row = logits + (long long)b * vocab;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;

    // argmax, lowest index on ties (NaN never wins). A 16-byte aligned row is read four
    // floats per load, ARGMAX_UNROLL loads in flight per thread (one CTA reads the whole
    // row: at batch 1 the latency of this loop is the kernel's); each thread visits its
    // elements in increasing index order, so `>` keeps its first maximum
    float best = neg_inf();
    int best_i = 0x7FFFFFFF;
    const int vectors = ((unsigned long long)row & 15u) == 0 ? vocab / 4 : 0;
    const float4* row4 = reinterpret_cast<const float4*>(row);
    for (int first = tid; first < vectors; first += ARGMAX_UNROLL * blockDim.x) {
        float4 v[ARGMAX_UNROLL];
#pragma unroll
        for (int u = 0; u < ARGMAX_UNROLL; ++u)  // clamped, not skipped: all loads issue at once
            v[u] = row4[min(first + u * (int)blockDim.x, vectors - 1)];
#pragma unroll
        for (int u = 0; u < ARGMAX_UNROLL; ++u) {
            const int j = first + u * blockDim.x;
            const bool in_row = j < vectors;  // a clamped load past the row: ignored
            const float values[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (in_row && values[e] > best) { best = values[e]; best_i = 4 * j + e; }
        }
    }
    for (int i = 4 * vectors + tid; i < vocab; i += blockDim.x) {  // the rest, in order
        const float v = row[i];
        if (v > best) { best = v; best_i = i; }
    }
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(FULL_MASK, best, offset);
        const int other_i = __shfl_xor_sync(FULL_MASK, best_i, offset);
        if (other > best || (other == best && other_i < best_i)) { best = other; best_i = other_i; }
    }
    if (lane == 0) { sh.scratch[warp] = best; sh.best_index[warp] = best_i; }
    __syncthreads();
    if (warp == 0) {
        const int num_warps = blockDim.x / WARP_SIZE;
        best = lane < num_warps ? sh.scratch[lane] : neg_inf();
        best_i = lane < num_warps ? sh.best_index[lane] : 0x7FFFFFFF;
        for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(FULL_MASK, best, offset);
            const int other_i = __shfl_xor_sync(FULL_MASK, best_i, offset);
            if (other > best || (other == best && other_i < best_i)) { best = other; best_i = other_i; }
        }
        if (lane == 0) {
            if (best_i == 0x7FFFFFFF) best_i = 0;  // a row of NaN: token 0
            sh.best_index[0] = best_i;
            sh.scratch[0] = best;
            out_tokens[b] = best_i;
        }
    }
    __syncthreads();
    const float temp = temperature[b];
    if (!(temp > 0.0f)) return;
    const float max_logit = sh.scratch[0];
    const float inv_temp = 1.0f / temp;
    __syncthreads();  // sh.scratch is reused below

    auto key_of = [&](int i) { return order_key(row[i]); };
    auto weight_of_key = [&](unsigned int key) {
        return expf((key_to_float(key) - max_logit) * inv_temp);
    };
    auto weight_of = [&](int i) { return expf((row[i] - max_logit) * inv_temp); };
    auto every = [](int) { return true; };

    // top-k: keep key > k_key, or key == k_key and index <= k_last
    unsigned int k_key = 0;
    int k_last = vocab;
    const int k = top_k[b];
    if (k > 0 && k < vocab) {
        const Selected s = select_by_count(sh, vocab, every, key_of, (unsigned int)k);
        k_key = s.key;
        if (s.count_equal > s.rank) {  // a tie at the boundary: the lowest indices win
            const Selected idx = select_by_count(
                sh, vocab, [&](int i) { return key_of(i) == k_key; },
                [](int i) { return ~(unsigned int)i; }, s.rank);
            k_last = (int)~idx.key;
        }
    }
    auto in_top_k = [&](int i) {
        const unsigned int key = key_of(i);
        return key > k_key || (key == k_key && i <= k_last);
    };

    // top-p over the top-k set
    unsigned int p_key = 0;
    int p_last = vocab;
    const float p = top_p[b];
    if (p < 1.0f) {
        float mass = 0.0f;
        for (int i = tid; i < vocab; i += blockDim.x)
            if (in_top_k(i)) mass += weight_of(i);
        const float target = fmaxf(p, 0.0f) * block_sum(mass, sh.scratch);
        const Selected s = select_by_mass(sh, vocab, in_top_k, key_of, weight_of, target);
        if (s.found) {
            p_key = s.key;
            // tokens with the threshold key, in index order, are kept while the mass before
            // them (mass_above + j * w) is below the target
            const float w = weight_of_key(p_key);
            const float wanted = ceilf((target - s.mass_above) / w);
            const unsigned int keep_equal =
                wanted >= (float)s.count_equal ? s.count_equal : (unsigned int)fmaxf(wanted, 1.0f);
            if (keep_equal < s.count_equal) {
                const Selected idx = select_by_count(
                    sh, vocab, [&](int i) { return in_top_k(i) && key_of(i) == p_key; },
                    [](int i) { return ~(unsigned int)i; }, keep_equal);
                p_last = (int)~idx.key;
            }
        }
    }
    const float mp = min_p[b];
    auto kept_weight = [&](int i) {
        const unsigned int key = key_of(i);
        if (!in_top_k(i) || !(key > p_key || (key == p_key && i <= p_last))) return 0.0f;
        const float w = weight_of(i);
        return w >= mp ? w : 0.0f;
    };

    // inverse CDF: thread t owns tokens t, t + blockDim.x, ... (its "chunk"; the order is
    // thread by thread, each thread's tokens in increasing index)
    // kept weights of CDF_UNROLL of this thread's tokens from `first` on, computed together
    // (clamped indices, so their loads issue at once; 0 past the row)
    auto kept_weights = [&](int first, float (&w)[CDF_UNROLL]) {
#pragma unroll
        for (int u = 0; u < CDF_UNROLL; ++u) {
            const int i = first + u * blockDim.x;
            w[u] = kept_weight(min(i, vocab - 1));
            if (i >= vocab) w[u] = 0.0f;
        }
    };
    float chunk_mass = 0.0f;
    for (int first = tid; first < vocab; first += CDF_UNROLL * blockDim.x) {
        float w[CDF_UNROLL];
        kept_weights(first, w);
#pragma unroll
        for (int u = 0; u < CDF_UNROLL; ++u) chunk_mass += w[u];  // in index order
    }
    // exclusive scan of chunk masses into sh.prefix[0 .. blockDim.x]
    float inclusive = chunk_mass;
    for (int offset = 1; offset < WARP_SIZE; offset <<= 1) {
        const float other = __shfl_up_sync(FULL_MASK, inclusive, offset);
        if (lane >= offset) inclusive += other;
    }
    if (lane == WARP_SIZE - 1) sh.scratch[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        const int num_warps = blockDim.x / WARP_SIZE;
        float total = lane < num_warps ? sh.scratch[lane] : 0.0f;
        for (int offset = 1; offset < WARP_SIZE; offset <<= 1) {
            const float other = __shfl_up_sync(FULL_MASK, total, offset);
            if (lane >= offset) total += other;
        }
        __syncwarp();
        if (lane < num_warps) sh.scratch[lane] = total;  // inclusive warp totals
    }
    __syncthreads();
    const float warp_offset = warp > 0 ? sh.scratch[warp - 1] : 0.0f;
    sh.prefix[tid + 1] = warp_offset + inclusive;
    if (tid == 0) sh.prefix[0] = 0.0f;
    __syncthreads();

    const float total = sh.prefix[blockDim.x];
    const unsigned long long bits =
        splitmix64(splitmix64((unsigned long long)seeds[b]) ^ (unsigned long long)(unsigned int)steps[b]);
    const float target = (float)(bits >> 40) * (1.0f / 16777216.0f) * total;  // u in [0, 1)
    const float lo = sh.prefix[tid], hi = sh.prefix[tid + 1];
    // exactly one thread owns the target: ranges [lo, hi) tile [0, total); when rounding
    // puts the target at or past the total, the last chunk with mass owns it
    if (lo < hi && lo <= target && (target < hi || hi >= total)) {
        // the same tokens in the same order as chunk_mass
        float cumulative = lo;
        int chosen = -1;
        bool reached = false;
        for (int first = tid; first < vocab && !reached; first += CDF_UNROLL * blockDim.x) {
            float w[CDF_UNROLL];
            kept_weights(first, w);
#pragma unroll
            for (int u = 0; u < CDF_UNROLL; ++u) {
                if (reached || w[u] <= 0.0f) continue;
                chosen = first + u * blockDim.x;
                cumulative += w[u];
                reached = cumulative > target;
            }
        }
        if (chosen >= 0) out_tokens[b] = chosen;
    }
}
