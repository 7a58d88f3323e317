// Token sampling on the device: one CTA per sequence (and while the batch leaves SMs idle,
// more for its argmax pass: "Split argmax" below), only the chosen ids leave the GPU.
// Launch: grid (B, splits), block (SAMPLE_THREADS = 1024), dynamic shared memory slots * 8
// * SAMPLE_THREADS bytes (the candidate slots below; slots may be 0).
//
// Greedy (temperature <= 0): argmax, lowest index on ties. Otherwise, with
// w_i = exp((logit_i - max) / temperature) (unnormalized probabilities, max 1; NaN counts
// as 0), the same filters and order as numpy_ops.filtered_probs (vLLM's order):
//   min-p  keep w_i >= min_p (that is p_i >= min_p * p_max);
//   top-k  among those, keep the k largest (ties broken by lower index), when 0 < k < vocab;
//   top-p  among those, in descending order, keep a token while the mass of the tokens
//          before it is < top_p (of the mass min-p and top-k kept), when top_p < 1.
// min-p and top-k each keep a prefix of the same order (key descending, index ascending),
// so top-k among min-p's tokens is the two sets' intersection, selected over the row.
// Thresholds are found without sorting: radix select over the order-preserving 32-bit key
// of each fp32 logit (four 8-bit passes, counting or summing mass per digit). A kept set
// is "key > threshold, or key == threshold and index <= last_index", which handles ties
// exactly like a stable sort. The token is then drawn by inverse CDF with u = hash(seed,
// step) in [0, 1) (splitmix64) over the kept tokens in a fixed order: thread t owns the
// groups of four tokens g = t, t + 1024, ... (tokens 4g .. 4g + 3: 16-byte loads), the
// order is thread by thread, each thread's tokens in increasing index. A request's seed
// reproduces its tokens whatever the batch.
//
// Candidates. Tokens below max - CANDIDATE_CUT * temperature weigh less than e^-16 each,
// and a trained model's next-token distribution puts few tokens above that (SmolLM2-135M-
// Instruct at temperature 0.6 over 184 chat steps: a median of 282, at most 6,539). The
// pass that sums the row's mass also writes each thread's candidates (key, index) to its
// own shared-memory slots, in its order. When every thread's candidates fit
// and the filters can only keep candidates (top-k with at least k of them; top-p alone
// with their mass above the target), every later pass reads the slots instead of the
// row. The selections see the same candidate keys, with exact integer counts and masses,
// and each thread's CDF sum adds the same weights in the same order, so the drawn token is
// the one the passes over the whole row would draw (a GPU test runs both).
//
// Structured outputs. mask_rows[b] (when given) picks row b's bitmask: -1 reads none, a
// row r >= 0 allows token i only where bit i % 32 of word i / 32 of bitmask row r is set
// (a disallowed logit counts as -inf wherever the row is read, so there is no extra pass
// and the logits stay raw for the log-probabilities), and MASK_SKIP leaves row b alone
// (its token is drawn by another launch). structured.apply_token_bitmask is the reference.

#include "common.cuh"

#define SAMPLE_THREADS 1024
// shared memory of one candidate slot of every thread: a uint2 (see Candidates)
#define SLOT_BYTES (8 * SAMPLE_THREADS)
#define ARGMAX_UNROLL 8    // 16-byte loads in flight per thread in the argmax pass
#define ARGMAX_MAX_SPLITS WARP_SIZE  // CTAs sharing a row's argmax pass (merged by one warp)
#define SELECT_UNROLL 8    // a thread's elements loaded together in the radix passes (2 groups)
#define ROW_GROUPS 4       // groups of 4 loaded together in the row's mass pass (4 16-byte loads)
#define CDF_UNROLL 16      // a thread's elements loaded together in the mass and draw passes
#define RADIX_BINS 256
#define LOG2_E 1.4426950408889634f
#define CANDIDATE_CUT 16.0f  // candidates: logit >= max - CANDIDATE_CUT * temperature
#define PROCESS_THREADS 1024  // process_logits_kernel and reset_state_kernel
#define CANDIDATE_MARGIN 1.001f  // top-p alone: candidate mass >= target * this, for float sums
// a min-p at least this keeps candidates only: e^-CANDIDATE_CUT (the weight at the cut) with
// room for the cut key's rounding
#define MIN_P_OF_CANDIDATES 2.25e-7f
#define MASK_SKIP -2  // mask_rows: this launch draws no token for the row

// whether a bitmask row (null: no constraint) allows token i
__device__ __forceinline__ bool token_allowed(const unsigned int* __restrict__ mask, int i) {
    return mask == nullptr || ((__ldg(mask + (i >> 5)) >> (i & 31)) & 1u);
}

// The per-sequence settings, one [capacity] array each, back to back in this order in one
// buffer (the staging layout of interface.py's SAMPLING_ROWS, whose kernel rows these are:
// the CUDA backend checks that both list the same names and types in the same order).
#define SAMPLING_ROWS(X) \
    X(unsigned long long, seeds) \
    X(float, temperature) \
    X(int, top_k) \
    X(float, top_p) \
    X(float, min_p) \
    X(int, steps) \
    X(float, repetition_penalty) \
    X(float, frequency_penalty) \
    X(float, presence_penalty) \
    X(int, min_tokens) \
    X(int, num_biases) \
    X(int, num_min_bans) \
    X(int, state_slot) \
    X(int, count_token)

struct SamplingRows {
#define SAMPLING_ROW_FIELD(type, name) const type* __restrict__ name;
    SAMPLING_ROWS(SAMPLING_ROW_FIELD)
#undef SAMPLING_ROW_FIELD

    // the arrays of a buffer that holds `capacity` sequences' settings
    __device__ SamplingRows(const unsigned char* buffer, int capacity) {
        unsigned long long offset = 0;
#define SAMPLING_ROW_VIEW(type, name)                                   \
        name = reinterpret_cast<const type*>(buffer + offset);          \
        offset += (unsigned long long)capacity * sizeof(type);
        SAMPLING_ROWS(SAMPLING_ROW_VIEW)
#undef SAMPLING_ROW_VIEW
    }
};

// the sampling kernel's last act: a kept token of a row with state is counted in its slot
// (see "penalties, biases and bans" below)
__device__ __forceinline__ void count_chosen(const SamplingRows& rows, int b, int vocab,
                                             int* counts, int token) {
    const int slot = rows.state_slot[b];
    if (counts != nullptr && slot >= 0 && rows.count_token[b])
        counts[(long long)slot * vocab + token] += 1;
}

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
    unsigned int count_equal;  // candidates with that key (mass select: from its last pass)
    unsigned long long mass_above;  // (mass select) mass of candidates with larger keys
                                    // (fixed point, MASS_ONE)
    bool found;                // (mass select) false: the target was never reached
};

#define MASS_ONE 1099511627776.0f  // 2^40: a weight of 1 in the fixed-point mass histogram

struct SampleShared {
    unsigned int count_hist[RADIX_BINS];
    unsigned long long mass_hist[RADIX_BINS];  // fixed point (MASS_ONE): order-free sums
    float scratch[WARP_SIZE];
    float totals[WARP_SIZE][4];
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

// A token's weight exp((logit - max) / temperature), as 2^((logit - max) * log2_scale)
// (one multiply and the hardware's exp2); NaN counts as 0. Every pass computes it here.
// NaN is caught in the exponent: fmaxf takes the number over NaN, and 2^-200 rounds to 0
// (an exponent that low gives 0 anyway). A test on exp2f's result would be compiled away:
// ptxas takes MUFU.EX2 never to return NaN, though it does.
__device__ __forceinline__ float weight_of_logit(float logit, float max_logit, float log2_scale) {
    return exp2f(fmaxf((logit - max_logit) * log2_scale, -200.0f));
}

// U of a thread's elements: their keys, token indices and whether they exist
template <int U>
struct Elements {
    unsigned int key[U];
    int index[U];
    bool valid[U];
};

// The whole row: element r of thread t is token 4 g + r % 4 of group g = t + (r / 4) T.
struct RowView {
    const float* row;
    int vocab;
    bool aligned;    // the row starts at a 16-byte boundary
    int per_thread;  // elements per thread (the same for every thread)
    const unsigned int* mask;  // the row's bitmask row, or null

    // the values of this thread's groups q0 .. q0 + G - 1 (0 past the row, -inf where the
    // mask disallows); loads issue together
    template <int G>
    __device__ __forceinline__ void load_values(int q0, float (&v)[G][4]) const {
#pragma unroll
        for (int h = 0; h < G; ++h) {
            const int g = threadIdx.x + (q0 + h) * blockDim.x, first = 4 * g;
            if (aligned && first + 3 < vocab) {
                const float4 q = reinterpret_cast<const float4*>(row)[g];
                v[h][0] = q.x; v[h][1] = q.y; v[h][2] = q.z; v[h][3] = q.w;
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) v[h][j] = first + j < vocab ? row[first + j] : 0.0f;
            }
            if (mask != nullptr) {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (first + j < vocab && !token_allowed(mask, first + j)) v[h][j] = neg_inf();
            }
        }
    }

    // token index of element j of this thread's group q
    __device__ __forceinline__ int index_of(int q, int j) const {
        return 4 * (threadIdx.x + q * blockDim.x) + j;
    }

    // elements r0 .. r0 + U - 1 (r0 a multiple of U, U of 4)
    template <int U>
    __device__ __forceinline__ void load(int r0, Elements<U>& e) const {
        float v[U / 4][4];
        load_values<U / 4>(r0 / 4, v);
#pragma unroll
        for (int h = 0; h < U / 4; ++h)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int i = index_of(r0 / 4 + h, j);
                e.key[4 * h + j] = order_key(v[h][j]);
                e.index[4 * h + j] = i;
                e.valid[4 * h + j] = i < vocab;
            }
    }
};

// A thread's candidates in its shared-memory slots: slot r of thread t at r * T + t.
struct SlotView {
    const uint2* slots;  // (key, index)
    int count;           // this thread's candidates
    int per_thread;      // the most any thread has (the same for every thread)

    template <int U>
    __device__ __forceinline__ void load(int r0, Elements<U>& e) const {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int r = r0 + u;
            const uint2 slot = r < count ? slots[r * blockDim.x + threadIdx.x] : make_uint2(0u, 0u);
            e.key[u] = slot.x;
            e.index[u] = (int)slot.y;
            e.valid[u] = r < count;
        }
    }
};

// f(key, index, valid) on each of this thread's elements of the view, in its order, U
// loaded together, while !done() (tested before each load). f may be warp-wide
// (digit_peers) only where done() gives every thread of the warp the same answer (or in
// for_each_element, where it is always false).
template <int U, typename View, typename Done, typename F>
__device__ __forceinline__ void for_each_element_until(const View& view, Done done, F f) {
    for (int r0 = 0; r0 < view.per_thread && !done(); r0 += U) {
        Elements<U> e;
        view.load(r0, e);
#pragma unroll
        for (int u = 0; u < U; ++u) f(e.key[u], e.index[u], e.valid[u]);
    }
}

template <int U, typename View, typename F>
__device__ __forceinline__ void for_each_element(const View& view, F f) {
    for_each_element_until<U>(view, [] { return false; }, f);
}

// Inclusive prefix sum over the lanes of a warp, lane 0 first (a fixed order).
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
    const int lane = threadIdx.x % WARP_SIZE;
    for (int offset = 1; offset < WARP_SIZE; offset <<= 1) {
        const T other = __shfl_up_sync(FULL_MASK, v, offset);
        if (lane >= offset) v += other;
    }
    return v;
}

// Run by the 32 lanes of warp 0 on a histogram of RADIX_BINS bins, scanned from the top
// digit down: the first digit with a nonzero bin where base + the bins down to it reach
// target; `above` gets base + the bins above that digit. Lane l adds digits 255 - 8 l down
// to 248 - 8 l, a scan over the lanes gives each lane what lies above it, and the lane
// that reaches the target walks its eight bins. Not reached: the lowest digit with a
// nonzero bin, reached false; -1 if every bin is 0. Every lane gets the result.
template <typename T>
__device__ __forceinline__ int find_digit(const T* hist, T base, T target, T& above,
                                          bool& reached) {
    const int lane = threadIdx.x % WARP_SIZE;
    constexpr int PER_LANE = RADIX_BINS / WARP_SIZE;
    T bins[PER_LANE];
    T block = 0;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        bins[j] = hist[RADIX_BINS - 1 - PER_LANE * lane - j];
        block += bins[j];
    }
    // base + the bins of the lanes above
    const T before = base + (warp_inclusive_scan(block) - block);
    const unsigned hits = __ballot_sync(FULL_MASK, block > 0 && before + block >= target);
    const unsigned nonzero = __ballot_sync(FULL_MASK, block > 0);
    reached = hits != 0u;
    above = base;
    if (nonzero == 0u) return -1;
    const int owner = reached ? __ffs(hits) - 1 : WARP_SIZE - 1 - __clz(nonzero);
    int digit = -1;
    T run = before, digit_above = before;
    if (lane == owner) {
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            if (bins[j] == 0 || (reached && digit >= 0)) continue;
            if (!reached || run + bins[j] >= target) {  // not reached: the last nonzero bin
                digit = RADIX_BINS - 1 - PER_LANE * lane - j;
                digit_above = run;
            }
            run += bins[j];
        }
    }
    above = __shfl_sync(FULL_MASK, digit_above, owner);
    return __shfl_sync(FULL_MASK, digit, owner);
}

// The rank-th largest key_of(key, index) (1-based) among the view's elements with
// keep(key, index).
template <typename View, typename Keep, typename KeyOf>
__device__ Selected select_by_count(SampleShared& sh, const View& view, Keep keep, KeyOf key_of,
                                    unsigned int rank) {
    unsigned int prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < RADIX_BINS; i += blockDim.x) sh.count_hist[i] = 0;
        __syncthreads();
        for_each_element<SELECT_UNROLL>(view, [&](unsigned int key, int i, bool valid) {
            const bool candidate = valid && keep(key, i);
            const unsigned int radix_key = candidate ? key_of(key, i) : 0u;
            const int digit = (radix_key >> shift) & 0xFF;
            add_count(sh.count_hist,
                      digit_peers(candidate && (radix_key & mask) == prefix, digit), digit);
        });
        __syncthreads();
        if (threadIdx.x < WARP_SIZE) {
            unsigned int above;
            bool reached;
            int digit = find_digit<unsigned int>(sh.count_hist, 0u, rank, above, reached);
            if (!reached) {  // fewer candidates than rank (never, for the callers' ranks)
                digit = max(digit, 0);
                above = 0;
            }
            if (threadIdx.x == 0) {
                sh.selected.key = prefix | ((unsigned int)digit << shift);
                sh.selected.rank = rank - above;
                sh.selected.count_equal = sh.count_hist[digit];
            }
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

// The key where the descending cumulative mass of the view's elements with keep(key,
// index) first reaches `target`: mass(keys > key) < target <= mass(keys >= key).
template <typename View, typename Keep, typename WeightOf>
__device__ Selected select_by_mass(SampleShared& sh, const View& view, Keep keep,
                                   WeightOf weight_of, float target) {
    const unsigned long long target_fixed = __float2ull_rn(fmaxf(target, 0.0f) * MASS_ONE);
    unsigned int prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        // only count_equal (candidates with the whole key) needs counts: the last pass
        const bool last = shift == 0;
        for (int i = threadIdx.x; i < RADIX_BINS; i += blockDim.x) {
            if (last) sh.count_hist[i] = 0;
            sh.mass_hist[i] = 0ull;
        }
        __syncthreads();
        for_each_element<SELECT_UNROLL>(view, [&](unsigned int key, int i, bool valid) {
            const bool in_prefix = (key & mask) == prefix;  // the digits chosen so far
            const bool counted = valid && keep(key, i) && in_prefix;
            const int digit = (key >> shift) & 0xFF;
            const unsigned peers = digit_peers(counted, digit);
            if (last) add_count(sh.count_hist, peers, digit);
            // integer sums do not depend on the order the threads arrive in, so the
            // same seed draws the same token every time (weights are at most 1)
            add_mass(sh.mass_hist, peers, digit,
                     counted ? (unsigned long long)__float2ull_rn(weight_of(key) * MASS_ONE) : 0ull);
        });
        __syncthreads();
        if (threadIdx.x < WARP_SIZE) {
            // the first digit from the largest whose mass reaches the target (exact fixed
            // point sums). If the target is out of reach inside the range narrowed by an
            // earlier pass (the fixed-point weights round), the range's last digit with
            // mass is chosen.
            unsigned long long above;
            bool reached;
            const int chosen = find_digit<unsigned long long>(
                sh.mass_hist, shift == 24 ? 0ull : sh.selected.mass_above, target_fixed, above,
                reached);
            // not reached on the first pass: the candidates hold less mass than the
            // target (top_p rounding to about 1), so nothing is cut
            if (threadIdx.x == 0) {
                sh.selected.found = chosen >= 0 && (reached || shift != 24);
                if (sh.selected.found) {
                    sh.selected.key = prefix | ((unsigned int)chosen << shift);
                    sh.selected.mass_above = above;
                    if (last) sh.selected.count_equal = sh.count_hist[chosen];
                }
            }
        }
        __syncthreads();
        const bool found = sh.selected.found;
        prefix = sh.selected.key;
        mask |= 0xFFu << shift;
        if (!found) break;  // the same for every thread
        // thread 0 writes sh.selected again only past the next pass's two barriers
    }
    Selected result = sh.selected;
    __syncthreads();
    return result;
}

// Block sums of v[0], v[1], v[2] and the block maximum of v[3] in one exchange, in a
// fixed order (every thread gets them). Every thread of the block must call it.
__device__ __forceinline__ void block_totals(SampleShared& sh, float (&v)[4]) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
#pragma unroll
    for (int j = 0; j < 3; ++j) v[j] = warp_sum(v[j]);
    v[3] = warp_max(v[3]);
    if (lane == 0)
#pragma unroll
        for (int j = 0; j < 4; ++j) sh.totals[warp][j] = v[j];
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 4; ++j)
        v[j] = lane < num_warps ? sh.totals[lane][j] : (j < 3 ? 0.0f : neg_inf());
#pragma unroll
    for (int j = 0; j < 3; ++j) v[j] = warp_sum(v[j]);
    v[3] = warp_max(v[3]);
}

// What the filters and the draw need besides the view.
struct DrawInputs {
    int vocab, top_k;
    float top_p, min_p, max_logit;
    float log2_scale;      // log2(e) / temperature
    float row_mass;        // the sum of every weight (block total)
    float thread_mass;     // this thread's share of it, summed in its order
    unsigned long long bits;  // the draw's random bits
    __device__ bool top_k_active() const { return top_k > 0 && top_k < vocab; }
};

// The filters, then the inverse-CDF draw over the kept elements of the view; returns the
// token in the thread that owns the draw, -1 elsewhere.
template <typename View>
__device__ int filter_and_draw(SampleShared& sh, const View& view, const DrawInputs& in) {
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    auto weight_of = [&](unsigned int key) {
        return weight_of_logit(key_to_float(key), in.max_logit, in.log2_scale);
    };
    auto every = [](unsigned int, int) { return true; };
    auto own_key = [](unsigned int key, int) { return key; };
    auto by_index = [](unsigned int, int i) { return ~(unsigned int)i; };  // lower index first

    // top-k: keep key > k_key, or key == k_key and index <= k_last
    unsigned int k_key = 0;
    int k_last = in.vocab;
    if (in.top_k_active()) {
        const Selected s = select_by_count(sh, view, every, own_key, (unsigned int)in.top_k);
        k_key = s.key;
        if (s.count_equal > s.rank) {  // a tie at the boundary: the lowest indices win
            const Selected idx = select_by_count(
                sh, view, [&](unsigned int key, int) { return key == k_key; }, by_index, s.rank);
            k_last = (int)~idx.key;
        }
    }
    // min-p and top-k: the set top-p takes its share of
    auto before_p = [&](unsigned int key, int i) {
        return (key > k_key || (key == k_key && i <= k_last)) && weight_of(key) >= in.min_p;
    };

    // top-p over that set
    unsigned int p_key = 0;
    int p_last = in.vocab;
    if (in.top_p < 1.0f) {
        float mass = in.row_mass;
        if (in.top_k_active() || in.min_p > 0.0f) {
            float own = 0.0f;
            for_each_element<CDF_UNROLL>(view, [&](unsigned int key, int i, bool valid) {
                if (valid && before_p(key, i)) own += weight_of(key);
            });
            mass = block_sum(own, sh.scratch);
        }
        const float target = fmaxf(in.top_p, 0.0f) * mass;
        const Selected s = select_by_mass(sh, view, before_p, weight_of, target);
        if (s.found) {
            p_key = s.key;
            // tokens with the threshold key, in index order, are kept while the mass before
            // them (mass_above + j * w) is below the target
            const float w = weight_of(p_key);
            const float wanted = ceilf((target - (float)s.mass_above * (1.0f / MASS_ONE)) / w);
            const unsigned int keep_equal =
                wanted >= (float)s.count_equal ? s.count_equal : (unsigned int)fmaxf(wanted, 1.0f);
            if (keep_equal < s.count_equal) {
                const Selected idx = select_by_count(
                    sh, view, [&](unsigned int key, int i) { return before_p(key, i) && key == p_key; },
                    by_index, keep_equal);
                p_last = (int)~idx.key;
            }
        }
    }
    auto kept_weight = [&](unsigned int key, int i) {
        return before_p(key, i) && (key > p_key || (key == p_key && i <= p_last))
            ? weight_of(key) : 0.0f;
    };

    // inverse CDF: this thread's kept mass, in its order (with no filter, the row's pass
    // summed it already)
    float chunk_mass = in.thread_mass;
    if (in.top_k_active() || in.top_p < 1.0f || in.min_p > 0.0f) {
        chunk_mass = 0.0f;
        for_each_element<CDF_UNROLL>(view, [&](unsigned int key, int i, bool valid) {
            if (valid) chunk_mass += kept_weight(key, i);
        });
    }
    // exclusive scan of the threads' masses into sh.prefix[0 .. blockDim.x]
    const float inclusive = warp_inclusive_scan(chunk_mass);
    if (lane == WARP_SIZE - 1) sh.scratch[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        const int num_warps = blockDim.x / WARP_SIZE;
        const float total = warp_inclusive_scan(lane < num_warps ? sh.scratch[lane] : 0.0f);
        __syncwarp();
        if (lane < num_warps) sh.scratch[lane] = total;  // inclusive warp totals
    }
    __syncthreads();
    const float warp_offset = warp > 0 ? sh.scratch[warp - 1] : 0.0f;
    sh.prefix[tid + 1] = warp_offset + inclusive;
    if (tid == 0) sh.prefix[0] = 0.0f;
    __syncthreads();

    const float total = sh.prefix[blockDim.x];
    const float target = (float)(in.bits >> 40) * (1.0f / 16777216.0f) * total;  // u in [0, 1)
    const float lo = sh.prefix[tid], hi = sh.prefix[tid + 1];
    // exactly one thread owns the target: ranges [lo, hi) tile [0, total); when rounding
    // puts the target at or past the total, the last thread with mass owns it
    if (!(lo < hi && lo <= target && (target < hi || hi >= total))) return -1;
    // the same elements in the same order as chunk_mass
    float cumulative = lo;
    int chosen = -1;
    bool reached = false;
    for_each_element_until<CDF_UNROLL>(
        view, [&] { return reached; },
        [&](unsigned int key, int i, bool valid) {
            const float w = valid ? kept_weight(key, i) : 0.0f;
            if (reached || w <= 0.0f) return;
            chosen = i;
            cumulative += w;
            reached = cumulative > target;
        });
    return chosen;
}

// the warp's (value, index) maximum in every lane: larger value, lower index on ties
__device__ __forceinline__ void warp_argmax(float& best, int& best_i) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(FULL_MASK, best, offset);
        const int other_i = __shfl_xor_sync(FULL_MASK, best_i, offset);
        if (other > best || (other == best && other_i < best_i)) { best = other; best_i = other_i; }
    }
}

// the CTA's (value, index) maximum of the row's logits [from, to) (16-byte groups from
// vectors from4 to to4 and single logits from one_from to one_to), lowest index on ties
// (NaN never wins), in thread 0. Loads of 16 bytes where the row is aligned, ARGMAX_UNROLL
// in flight per thread (at batch 1 the latency of this loop is the pass's); each thread
// visits its logits in increasing index order, so `>` keeps its first maximum
__device__ __forceinline__ void block_argmax(SampleShared& sh, const float* row,
                                             const unsigned int* mask, int from4, int to4,
                                             int one_from, int one_to, float& best, int& best_i) {
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    best = neg_inf();
    best_i = 0x7FFFFFFF;
    const float4* row4 = reinterpret_cast<const float4*>(row);
    for (int first = from4 + tid; first < to4; first += ARGMAX_UNROLL * blockDim.x) {
        float4 v[ARGMAX_UNROLL];
#pragma unroll
        for (int u = 0; u < ARGMAX_UNROLL; ++u)  // clamped, not skipped: all loads issue at once
            v[u] = row4[min(first + u * (int)blockDim.x, to4 - 1)];
#pragma unroll
        for (int u = 0; u < ARGMAX_UNROLL; ++u) {
            const int j = first + u * blockDim.x;
            const bool in_row = j < to4;  // a clamped load past the share: ignored
            const float values[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (in_row && values[e] > best && token_allowed(mask, 4 * j + e)) {
                    best = values[e]; best_i = 4 * j + e;
                }
        }
    }
    for (int i = one_from + tid; i < one_to; i += blockDim.x) {  // in order
        const float v = row[i];
        if (v > best && token_allowed(mask, i)) { best = v; best_i = i; }
    }
    warp_argmax(best, best_i);
    if (lane == 0) { sh.scratch[warp] = best; sh.best_index[warp] = best_i; }
    __syncthreads();
    if (warp == 0) {
        const int num_warps = blockDim.x / WARP_SIZE;
        best = lane < num_warps ? sh.scratch[lane] : neg_inf();
        best_i = lane < num_warps ? sh.best_index[lane] : 0x7FFFFFFF;
        warp_argmax(best, best_i);
    }
}

// one CTA per SM is enough (min blocks 1): ptxas may then use up to 64 registers per
// thread, which the argmax pass's loads in flight need (else it aims at 32 and spills).
// slots: candidate slots per thread in the dynamic shared memory (0: always the row);
// used_slots (may be null): [B], 1 where the slots served the draw, else 0.
// settings: SAMPLING_ROWS of `capacity` (>= B) sequences, row b of each for sequence b.
// bitmask [rows, mask_words] and mask_rows [B] (both may be null): see "Structured outputs".
//
// Split argmax. One CTA reads a row at one SM's bandwidth, so a batch too small to fill
// the GPU shares each row's argmax pass among gridDim.y CTAs (at most ARGMAX_MAX_SPLITS):
// CTA s scans share s of the row's 16-byte groups (the last also the logits past them, and
// an unaligned row is the last's alone), posts its maximum to argmax_parts[b][s], and takes
// a ticket from arrivals[b]. The CTA with the last ticket merges the posts (larger value,
// lower index: the same token as one CTA's pass), puts arrivals[b] back to 0 for the next
// launch, and goes on alone; the others leave. arrivals: [B] zeros before the launch, used
// by one launch at a time; both may be null when gridDim.y is 1.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 1) sample_kernel(
        const float* __restrict__ logits, int vocab, const unsigned char* __restrict__ settings,
        int capacity, int* __restrict__ out_tokens, int slots, int* __restrict__ used_slots,
        int* __restrict__ counts, const unsigned int* __restrict__ bitmask, int mask_words,
        const int* __restrict__ mask_rows, int2* __restrict__ argmax_parts,
        unsigned int* __restrict__ arrivals) {
    const SamplingRows rows(settings, capacity);
    // counts (may be null): [slots][vocab] output-token counts; the chosen token of a row
    // with state_slot >= 0 and count_token set is added to its slot's (see count_chosen)
    __shared__ int chosen_token;
    __shared__ bool last_to_arrive;
    __shared__ SampleShared sh;
    extern __shared__ uint2 candidate_slots[];  // [slots][blockDim.x]: SLOT_BYTES per slot
    static_assert(sizeof(uint2) * SAMPLE_THREADS == SLOT_BYTES, "slot layout");
    const int b = blockIdx.x;
    const int mask_row = mask_rows != nullptr ? mask_rows[b] : -1;
    if (mask_row == MASK_SKIP) return;  // the whole CTA: before any barrier
    const unsigned int* mask =
        mask_row >= 0 ? bitmask + (long long)mask_row * mask_words : nullptr;
    const float* row = logits + (long long)b * vocab;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;

    // argmax, lowest index on ties (NaN never wins), of this CTA's share of the row
    const bool aligned = ((unsigned long long)row & 15u) == 0;
    const int vectors = aligned ? vocab / 4 : 0;
    const int splits = gridDim.y, s = blockIdx.y;
    const int share = (vectors + splits - 1) / splits;
    const bool last_share = s == splits - 1;
    float best;
    int best_i;
    block_argmax(sh, row, mask, min(s * share, vectors), min((s + 1) * share, vectors),
                 last_share ? 4 * vectors : vocab, vocab, best, best_i);
    if (splits > 1) {
        if (tid == 0) {
            argmax_parts[(long long)b * splits + s] = make_int2(__float_as_int(best), best_i);
            __threadfence();  // the post before the ticket
            last_to_arrive = atomicAdd(arrivals + b, 1u) == (unsigned int)splits - 1;
        }
        __syncthreads();
        if (!last_to_arrive) return;  // the whole CTA
        if (warp == 0) {
            __threadfence();  // every post before this CTA's reads of them
            const int2 part = lane < splits ? __ldcg(argmax_parts + (long long)b * splits + lane)
                                            : make_int2(__float_as_int(neg_inf()), 0x7FFFFFFF);
            best = __int_as_float(part.x);
            best_i = part.y;
            warp_argmax(best, best_i);
            if (lane == 0) arrivals[b] = 0u;
        }
    }
    if (tid == 0) {
        if (best_i == 0x7FFFFFFF) best_i = 0;  // a row of NaN: token 0
        sh.scratch[0] = best;
        out_tokens[b] = best_i;
        chosen_token = best_i;
    }
    __syncthreads();
    const float temp = rows.temperature[b];
    if (used_slots != nullptr && tid == 0) used_slots[b] = 0;
    if (!(temp > 0.0f)) {
        if (tid == 0) count_chosen(rows, b, vocab, counts, chosen_token);
        return;
    }
    DrawInputs in;
    in.vocab = vocab;
    in.top_k = rows.top_k[b];
    in.top_p = rows.top_p[b];
    in.min_p = rows.min_p[b];
    in.max_logit = sh.scratch[0];
    in.log2_scale = LOG2_E / temp;
    in.bits = splitmix64(splitmix64((unsigned long long)rows.seeds[b]) ^
                         (unsigned long long)(unsigned int)rows.steps[b]);
    // sh.scratch is written again only past block_totals' barrier below

    // the row's pass: every weight summed in this thread's order, the candidates written
    // to this thread's slots (counted past the slots, so an overflow is seen)
    const RowView row_view = {row, vocab, aligned,
                              4 * (((vocab + 3) / 4 + (int)blockDim.x - 1) / (int)blockDim.x),
                              mask};
    const unsigned int cut_key = order_key(in.max_logit - CANDIDATE_CUT * temp);
    float mass = 0.0f, candidate_mass = 0.0f;
    int candidates = 0;
    for (int q0 = 0; q0 < row_view.per_thread / 4; q0 += ROW_GROUPS) {
        float v[ROW_GROUPS][4];
        row_view.load_values(q0, v);
#pragma unroll
        for (int h = 0; h < ROW_GROUPS; ++h)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int i = row_view.index_of(q0 + h, j);
                if (i >= vocab) continue;
                const unsigned int key = order_key(v[h][j]);
                // filter_and_draw's weight_of (key_to_float(key) is v, or +0 for -0)
                const float weight = weight_of_logit(v[h][j], in.max_logit, in.log2_scale);
                mass += weight;
                if (key >= cut_key) {
                    candidate_mass += weight;
                    if (candidates < slots)
                        candidate_slots[candidates * blockDim.x + tid] = make_uint2(key, (unsigned)i);
                    ++candidates;
                }
            }
    }
    in.thread_mass = mass;
    float totals[4] = {mass, candidate_mass, (float)candidates, (float)candidates};
    block_totals(sh, totals);
    in.row_mass = totals[0];
    const float all_candidate_mass = totals[1], all_candidates = totals[2], most = totals[3];

    // the slots serve when they hold every candidate and the filters keep only candidates:
    // a min-p past the cut's weight, top-k with at least k of them, or top-p alone with
    // their mass above its target (with a smaller min-p, its share would be of a mass the
    // slots do not hold all of)
    const bool covered =
        in.min_p >= MIN_P_OF_CANDIDATES ||
        (in.top_k_active() && all_candidates >= (float)in.top_k) ||
        (!in.top_k_active() && in.top_p < 1.0f && in.min_p <= 0.0f &&
         all_candidate_mass >= fmaxf(in.top_p, 0.0f) * in.row_mass * CANDIDATE_MARGIN);
    int chosen;
    if (slots > 0 && most <= (float)slots && covered) {
        if (used_slots != nullptr && tid == 0) used_slots[b] = 1;
        const SlotView slot_view = {candidate_slots, candidates, (int)most};
        chosen = filter_and_draw(sh, slot_view, in);
    } else {
        chosen = filter_and_draw(sh, row_view, in);
    }
    if (chosen >= 0) {
        out_tokens[b] = chosen;
        chosen_token = chosen;
    }
    __syncthreads();
    if (tid == 0) count_chosen(rows, b, vocab, counts, chosen_token);
}

// ---- penalties, biases and bans -----------------------------------------------------------
// Each slot of the engine (a running sequence) may keep state on the device: how often each
// token occurs in its output (counts, [slots][vocab] int32), whether it occurs in its prompt
// (prompt_seen, [slots][vocab] uint8), and bias entries (bias_ids / bias_values,
// [slots][max_entries]): num_biases (token, value) pairs added to the logits always, then
// num_min_bans tokens banned (-inf) while steps < min_tokens. Each part holds a token once,
// so the threads of a part write distinct logits. reset_state_kernel makes a slot's state
// for a new sequence; process_logits_kernel applies it before the sampling kernel, which
// adds each kept token to its slot's counts (count_chosen). The reference is
// numpy_ops.penalized_logits: the entries first, then (vLLM's order) repetition over the
// prompt and the output, then frequency * count and presence over the output.

// grid (B), block (PROCESS_THREADS): row b of logits, in place, where state_slot[b] >= 0
extern "C" __global__ void __launch_bounds__(PROCESS_THREADS) process_logits_kernel(
        float* __restrict__ logits, int vocab, const unsigned char* __restrict__ settings,
        int capacity, const int* __restrict__ counts,
        const unsigned char* __restrict__ prompt_seen, const int* __restrict__ bias_ids,
        const float* __restrict__ bias_values, int max_entries) {
    const SamplingRows rows(settings, capacity);
    const int b = blockIdx.x, slot = rows.state_slot[b];
    if (slot < 0) return;
    float* row = logits + (long long)b * vocab;
    const long long base = (long long)slot * max_entries;
    const int always = rows.num_biases[b];
    for (int j = threadIdx.x; j < always; j += blockDim.x)
        row[bias_ids[base + j]] += bias_values[base + j];
    __syncthreads();
    if (rows.steps[b] < rows.min_tokens[b]) {
        const int bans = rows.num_min_bans[b];
        for (int j = threadIdx.x; j < bans; j += blockDim.x)
            row[bias_ids[base + always + j]] = neg_inf();
    }
    __syncthreads();
    const float repetition = rows.repetition_penalty[b];
    const float frequency = rows.frequency_penalty[b], presence = rows.presence_penalty[b];
    if (repetition == 1.0f && frequency == 0.0f && presence == 0.0f) return;
    const int* own_counts = counts + (long long)slot * vocab;
    const unsigned char* own_seen = prompt_seen + (long long)slot * vocab;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const int count = own_counts[i];
        if (count == 0 && !own_seen[i]) continue;
        float x = row[i];
        x = x > 0.0f ? __fdiv_rn(x, repetition) : __fmul_rn(x, repetition);
        // rounded step by step, as the NumPy reference computes it (no fused multiply-add)
        const float penalty = __fadd_rn(__fmul_rn(frequency, (float)count),
                                        __fmul_rn(presence, count > 0 ? 1.0f : 0.0f));
        row[i] = __fsub_rn(x, penalty);
    }
}

// grid (R), block (PROCESS_THREADS): slot reset_slots[r] made anew. Its tokens are
// tokens[token_start[r] .. token_start[r + 1]), the first num_prompt[r] of them the prompt
// (seen), the rest the output (counted); an id -(i + 1) is the token the last sampling call
// chose for its row i (last_sampled). Its entries are entry_ids / entry_values[entry_start[r]
// .. entry_start[r + 1]).
extern "C" __global__ void __launch_bounds__(PROCESS_THREADS) reset_state_kernel(
        int* __restrict__ counts, unsigned char* __restrict__ prompt_seen,
        int* __restrict__ bias_ids, float* __restrict__ bias_values, int vocab,
        int max_entries, const int* __restrict__ reset_slots,
        const int* __restrict__ token_start, const int* __restrict__ num_prompt,
        const int* __restrict__ tokens, const int* __restrict__ entry_start,
        const int* __restrict__ entry_ids, const float* __restrict__ entry_values,
        const int* __restrict__ last_sampled) {
    const int r = blockIdx.x, slot = reset_slots[r];
    int* own_counts = counts + (long long)slot * vocab;
    unsigned char* own_seen = prompt_seen + (long long)slot * vocab;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        own_counts[i] = 0;
        own_seen[i] = 0;
    }
    __syncthreads();
    const int first = token_start[r], prompt_end = first + num_prompt[r];
    for (int j = first + threadIdx.x; j < token_start[r + 1]; j += blockDim.x) {
        int token = tokens[j];
        if (token < 0) token = last_sampled[-token - 1];
        if (j < prompt_end) own_seen[token] = 1;
        else atomicAdd(&own_counts[token], 1);
    }
    const long long base = (long long)slot * max_entries;
    const int entries = entry_start[r + 1] - entry_start[r];
    for (int j = threadIdx.x; j < entries; j += blockDim.x) {
        bias_ids[base + j] = entry_ids[entry_start[r] + j];
        bias_values[base + j] = entry_values[entry_start[r] + j];
    }
}
