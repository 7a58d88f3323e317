// Row gathers: the token embedding lookup and picking each sequence's last hidden state.
// Launch: grid (num_rows), block (256); threads stride over the row.

#include "common.cuh"

// out[t, :] = table[token_ids[t], :] * scale; table [vocab, hidden], out [T, hidden], bf16
// or float32 rows (the model's residual stream is float32). scale is 1 but for Gemma's
// sqrt(hidden) (x * 1 is x exactly).
// An id -(r + 1) with r < num_pending is the token sampled for row r of the previous step,
// read from pending_tokens: a step may be launched before that token reached the host.
// Any other id outside the vocabulary writes NaN so the mistake shows in the logits.
__device__ __forceinline__ void put(bf16* p, bf16 v, float scale, bool valid) {
    *p = valid ? to_bf16(to_float(v) * scale) : __ushort_as_bfloat16((unsigned short)0x7FC0);
}
__device__ __forceinline__ void put(float* p, bf16 v, float scale, bool valid) {
    *p = valid ? to_float(v) * scale : __int_as_float(0x7FC00000);
}

template <typename T>
__device__ __forceinline__ void embedding_row(const int* __restrict__ token_ids,
                                              const int* __restrict__ pending_tokens,
                                              int num_pending, const bf16* __restrict__ table,
                                              T* __restrict__ out, int hidden, int vocab,
                                              float scale) {
    let_next_kernel_start();  // a programmatic next kernel loads its weights meanwhile
    const int t = blockIdx.x;
    int id = token_ids[t];
    if (id < 0 && -id <= num_pending) id = pending_tokens[-id - 1];
    const bool valid = id >= 0 && id < vocab;
    const bf16* src = table + (long long)(valid ? id : 0) * hidden;
    T* dst = out + (long long)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) put(dst + i, src[i], scale, valid);
}

extern "C" __global__ void embedding_kernel(const int* token_ids, const int* pending_tokens,
                                            int num_pending, const bf16* table, bf16* out,
                                            int hidden, int vocab, float scale) {
    embedding_row(token_ids, pending_tokens, num_pending, table, out, hidden, vocab, scale);
}

extern "C" __global__ void embedding_f32_kernel(const int* token_ids, const int* pending_tokens,
                                                int num_pending, const bf16* table, float* out,
                                                int hidden, int vocab, float scale) {
    embedding_row(token_ids, pending_tokens, num_pending, table, out, hidden, vocab, scale);
}

// out[b, :] = x[indices[b], :] for rows of `width` 16-bit units (a float32 row counts as
// two units), so one kernel serves bf16 and float32 rows.
extern "C" __global__ void gather_rows_kernel(const unsigned short* __restrict__ x,
                                              const int* __restrict__ indices,
                                              unsigned short* __restrict__ out, int width) {
    const int b = blockIdx.x;
    const unsigned short* src = x + (long long)indices[b] * width;
    unsigned short* dst = out + (long long)b * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}
