// Skinny matrix products for decode: out[M, N] = x[M, K] w[N, K]^T for M <= 16 rows.
// A decode step reads every weight once, so these are bound by the weight stream: each
// warp owns R consecutive weight rows and walks K in 16-byte chunks (8 bf16 per lane per
// load, U chunks per lane in flight), the few x rows come through the read-only cache, and
// each (x row, weight row) pair keeps an fp32 sum per lane, reduced over the warp at the end.
// Needs K % 8 == 0 and 16-byte aligned x and w (the launcher checks, else uses cuBLAS).
// Launch: grid (ceil(N / (GEMV_WARPS * R))), block (GEMV_WARPS * 32); out is bf16 or, with
// out_f32 != 0, float32.

#define GEMV_WARPS 4

__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float* f) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 t = __bfloat1622float2(pairs[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

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
            for (int r = 0; r < R; ++r) bf16x8_to_float(wv[u][r], wf[r]);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                if (m >= m_rows) break;
                float xf[8];
                bf16x8_to_float(__ldg(x4 + (long long)m * chunks + c), xf);
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

#define DEFINE_GEMV(M, R, U)                                                                \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE) gemv_m##M(          \
        const bf16* x, const bf16* w, void* out, int m_rows, int n, int k, int out_f32) {   \
        gemv_body<M, R, U>(x, w, out, m_rows, n, k, out_f32);                               \
    }

// keep in step with gemm.GEMV_VARIANTS (M: weight rows per warp)
DEFINE_GEMV(1, 2, 4)
DEFINE_GEMV(2, 2, 4)
DEFINE_GEMV(4, 2, 4)
DEFINE_GEMV(8, 4, 2)
DEFINE_GEMV(16, 4, 2)

// ------------------------------------------------------------------------------------------
// Tensor-core skinny products: the same out[M, N] = x[M, K] w[N, K]^T, M <= 16, built to
// stream the weights at HBM speed whatever N and K are.
//
// A weight tile of 16 rows is the A operand of mma.m16n8k16 (bf16 in, fp32 sums) and up to
// 8 x rows are its B operand (M > 8: two of them), so the products cost next to nothing and
// the kernel is bound by its loads. A dot product does not care in which order K is
// summed, so every lane loads whole 16-byte chunks (8 consecutive k) of its two weight rows
// and feeds them to the mma as if they were the k slots the fragment layout assigns it,
// reading x from the same k positions: lane (g = lane / 4, t = lane % 4) of a warp holds,
// for one 64-wide k step s, chunks s*8 + t and s*8 + 4 + t of weight rows g and g + 8 and
// of x row g. The four lanes of one row read 64 contiguous bytes per load, the warp's two
// loads per row cover a whole 128-byte line.
//
// A block of SKINNY_WARPS warps owns one 16-row tile at a time and splits K among its warps
// (warp w takes k steps w, w + SKINNY_WARPS, ...; SKINNY_UNROLL steps, i.e. 16 loads of
// 16 bytes per lane, in flight before the first use); the warps' partial tiles are summed
// through shared memory in a fixed order (deterministic). Blocks stride over the tiles, so
// a grid of a few blocks per SM covers any N; x is staged once per block into shared
// memory, each row padded so the warp's fragment reads hit distinct banks.
// Weights go through the non-coherent path without L1 allocation: they are read once.
//
// Needs K % 8 == 0 and 16-byte aligned x and w; any N (rows of the last tile past N re-read
// row N - 1 and are never stored); shared memory m_rows * x_stride * 16 + SKINNY_PARTIAL
// bytes (gemm.py computes it). Launch: grid (min(tiles, resident blocks)), block
// (SKINNY_WARPS * 32), dynamic shared memory as above.

#define SKINNY_WARPS 8
#define SKINNY_TILE 16     // weight rows per tile: the mma's M
#define SKINNY_STEP 64     // k per step: 4 mma of k16
#define SKINNY_UNROLL 4    // steps per warp loaded before any is used
#define SKINNY_X_PAD 4     // 16-byte chunks after each staged x row: row stride = 64 mod 128 B

__device__ __forceinline__ uint4 load_streaming(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// d[16 x 8] += a[16 x 16] b[16 x 8]: a0..a3 and b0, b1 in the m16n8k16 fragment layout
__device__ __forceinline__ void mma_bf16_16x8x16(float (&d)[4], unsigned a0, unsigned a1,
                                                 unsigned a2, unsigned a3, unsigned b0,
                                                 unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// one 64-wide k step of one 8-column x tile: w_lo / w_hi are the chunks c and c + 4 of
// weight rows g and g + 8, xa / xb the same chunks of x row g
__device__ __forceinline__ void mma_step(float (&d)[4], const uint4& lo_a, const uint4& lo_b,
                                         const uint4& hi_a, const uint4& hi_b, const uint4& xa,
                                         const uint4& xb) {
    mma_bf16_16x8x16(d, lo_a.x, hi_a.x, lo_a.y, hi_a.y, xa.x, xa.y);
    mma_bf16_16x8x16(d, lo_a.z, hi_a.z, lo_a.w, hi_a.w, xa.z, xa.w);
    mma_bf16_16x8x16(d, lo_b.x, hi_b.x, lo_b.y, hi_b.y, xb.x, xb.y);
    mma_bf16_16x8x16(d, lo_b.z, hi_b.z, lo_b.w, hi_b.w, xb.z, xb.w);
}

// NT: 8-column x tiles (1 for m_rows <= 8, 2 for m_rows <= 16)
template <int NT>
__device__ __forceinline__ void skinny_mma_body(const bf16* __restrict__ x,
                                                const bf16* __restrict__ w,
                                                void* __restrict__ out, int m_rows, int n, int k,
                                                int out_f32) {
    extern __shared__ uint4 skinny_smem[];
    constexpr int PARTIAL_FLOATS = SKINNY_WARPS * NT * 4 * WARP_SIZE;  // one buffer
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    const int chunks = k / 8;                                   // 16-byte chunks per row
    const int steps = (k + SKINNY_STEP - 1) / SKINNY_STEP;
    const int x_chunks = steps * (SKINNY_STEP / 8);             // staged row, zero past k
    const int x_stride = x_chunks + SKINNY_X_PAD;
    uint4* xs = skinny_smem;                                    // [m_rows][x_stride]
    float* partial = reinterpret_cast<float*>(skinny_smem + m_rows * x_stride);  // [2][...]
    const uint4 zero = make_uint4(0, 0, 0, 0);

    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    for (int i = threadIdx.x; i < m_rows * x_chunks; i += blockDim.x) {
        const int m = i / x_chunks, c = i - m * x_chunks;
        xs[m * x_stride + c] = c < chunks ? __ldg(x4 + (long long)m * chunks + c) : zero;
    }
    __syncthreads();

    const uint4* w4 = reinterpret_cast<const uint4*>(w);
    const int tiles = (n + SKINNY_TILE - 1) / SKINNY_TILE;
    int buffer = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int row0 = tile * SKINNY_TILE;
        const uint4* w_lo = w4 + (long long)min(row0 + g, n - 1) * chunks;
        const uint4* w_hi = w4 + (long long)min(row0 + g + 8, n - 1) * chunks;
        float acc[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[nt][j] = 0.0f;

        for (int first = warp; first < steps; first += SKINNY_WARPS * SKINNY_UNROLL) {
            uint4 wv[SKINNY_UNROLL][4];  // [step][lo c, lo c + 4, hi c, hi c + 4]
#pragma unroll
            for (int u = 0; u < SKINNY_UNROLL; ++u) {
                const int c = (first + u * SKINNY_WARPS) * (SKINNY_STEP / 8) + t;
                wv[u][0] = c < chunks ? load_streaming(w_lo + c) : zero;
                wv[u][1] = c + 4 < chunks ? load_streaming(w_lo + c + 4) : zero;
                wv[u][2] = c < chunks ? load_streaming(w_hi + c) : zero;
                wv[u][3] = c + 4 < chunks ? load_streaming(w_hi + c + 4) : zero;
            }
#pragma unroll
            for (int u = 0; u < SKINNY_UNROLL; ++u) {
                const int step = first + u * SKINNY_WARPS;
                if (step >= steps) continue;  // the same for the whole warp
                const int c = step * (SKINNY_STEP / 8) + t;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const int m = nt * 8 + g;
                    uint4 xa = zero, xb = zero;
                    if (m < m_rows) {
                        xa = xs[m * x_stride + c];
                        xb = xs[m * x_stride + c + 4];
                    }
                    mma_step(acc[nt], wv[u][0], wv[u][1], wv[u][2], wv[u][3], xa, xb);
                }
            }
        }

        // sum the warps' partial tiles; two buffers, so one barrier per tile suffices
        float* part = partial + buffer * PARTIAL_FLOATS;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j)
                part[((warp * NT + nt) * 4 + j) * WARP_SIZE + lane] = acc[nt][j];
        __syncthreads();
        for (int e = threadIdx.x; e < NT * 4 * WARP_SIZE; e += blockDim.x) {
            float sum = 0.0f;
#pragma unroll
            for (int v = 0; v < SKINNY_WARPS; ++v) sum += part[v * NT * 4 * WARP_SIZE + e];
            // e = (nt * 4 + j) * 32 + owner lane: fragment element j of x tile nt
            const int owner = e % WARP_SIZE, j = (e / WARP_SIZE) % 4, nt = e / (4 * WARP_SIZE);
            const int m = nt * 8 + (owner % 4) * 2 + (j & 1);
            const int col = row0 + owner / 4 + (j >= 2 ? 8 : 0);
            if (m < m_rows && col < n) {
                const long long idx = (long long)m * n + col;
                if (out_f32) static_cast<float*>(out)[idx] = sum;
                else static_cast<bf16*>(out)[idx] = to_bf16(sum);
            }
        }
        buffer ^= 1;
    }
}

#define DEFINE_SKINNY_MMA(NT)                                                                \
    extern "C" __global__ void __launch_bounds__(SKINNY_WARPS * WARP_SIZE, 2)                 \
        skinny_mma_n##NT(const bf16* x, const bf16* w, void* out, int m_rows, int n, int k,  \
                         int out_f32) {                                                      \
        skinny_mma_body<NT>(x, w, out, m_rows, n, k, out_f32);                               \
    }

// keep in step with gemm.MMA_VARIANTS (NT: 8-column x tiles)
DEFINE_SKINNY_MMA(1)
DEFINE_SKINNY_MMA(2)
