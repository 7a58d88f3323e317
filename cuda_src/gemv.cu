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
