// Row gathers: the token embedding lookup and picking each sequence's last hidden state.
// Launch: grid (num_rows), block (256); threads stride over the row.

// out[t, :] = table[token_ids[t], :]; table [vocab, hidden], out [T, hidden].
// An id outside the vocabulary writes NaN so the mistake shows in the logits.
extern "C" __global__ void embedding_kernel(const int* __restrict__ token_ids,
                                            const bf16* __restrict__ table,
                                            bf16* __restrict__ out, int hidden, int vocab) {
    const int t = blockIdx.x;
    const int id = token_ids[t];
    bf16* dst = out + (long long)t * hidden;
    if (id < 0 || id >= vocab) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x)
            dst[i] = __ushort_as_bfloat16((unsigned short)0x7FC0);
        return;
    }
    const bf16* src = table + (long long)id * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
}

// The same lookup into a float32 row (the model's residual stream is float32).
extern "C" __global__ void embedding_f32_kernel(const int* __restrict__ token_ids,
                                                const bf16* __restrict__ table,
                                                float* __restrict__ out, int hidden, int vocab) {
    const int t = blockIdx.x;
    const int id = token_ids[t];
    float* dst = out + (long long)t * hidden;
    const bool valid = id >= 0 && id < vocab;
    const bf16* src = table + (long long)(valid ? id : 0) * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        dst[i] = valid ? to_float(src[i]) : __int_as_float(0x7FC00000);
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
