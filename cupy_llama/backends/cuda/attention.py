"""Launchers for attention.cu: paged causal attention (prefill and decode) and the
combine step of split-KV decode."""
from __future__ import annotations

from .kernels import BF16, F32, I32, check, f32, get_kernel, i32

ROWS_PER_CTA = 16   # attention.cu: ATTN_WARPS * ROWS_PER_WARP
KEY_TILE = 32       # attention.cu: KEY_TILE
THREADS = 128       # attention.cu: ATTN_WARPS * 32
MIN_SPLIT_LEN = 256  # a decode split covers at least this many keys
MAX_SPLITS = 32      # and there are at most this many (bounds the workspace)
DEFAULT_SMEM_LIMIT = 48 * 1024


def dims_per_lane(head_dim: int) -> int:
    for dpl in (1, 2, 4, 8):
        if head_dim <= 32 * dpl:
            return dpl
    raise ValueError(f"head_dim {head_dim} is not supported by the attention kernel (at most 256)")


def smem_bytes(head_dim: int) -> int:
    """q rows, the padded K tile and the V tile, all fp32 (attention.cu)."""
    return 4 * (ROWS_PER_CTA * head_dim + KEY_TILE * (head_dim + 1) + KEY_TILE * head_dim)


def max_decode_splits(max_model_len: int) -> int:
    return max(1, min(MAX_SPLITS, -(-max_model_len // MIN_SPLIT_LEN)))


def workspace_sizes(max_num_seqs: int, num_heads: int, head_dim: int, max_model_len: int):
    """Element counts of the float32 split workspace: (partial_out, partial_lse)."""
    splits = max_decode_splits(max_model_len)
    return max_num_seqs * num_heads * splits * head_dim, max_num_seqs * num_heads * splits


def choose_decode_splits(num_seqs: int, num_kv_heads: int, group: int, max_seq_len: int,
                         num_sms: int, max_splits: int) -> int:
    """How many key ranges each sequence of a decode batch is split into: enough CTAs to
    fill the GPU about twice, each range at least MIN_SPLIT_LEN keys."""
    ctas = num_seqs * num_kv_heads * -(-group // ROWS_PER_CTA)
    wanted = -(-2 * num_sms // ctas)
    return max(1, min(wanted, max_splits, max_seq_len // MIN_SPLIT_LEN))


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, *,
                    scale: float, max_query_len: int, max_seq_len: int | None,
                    num_splits: int = 1, partial_out=None, partial_lse=None):
    """out [T, nh*d] = causal attention of q [T, nh, d] over the paged caches.

    num_splits > 1 (decode batches only, max_query_len == 1) splits each sequence's keys
    into num_splits ranges of split_len keys, written to the flat float32 workspaces
    partial_out / partial_lse, then merged. max_seq_len=None (CUDA-graph decode: nothing
    that changes between steps may be baked into the launch) keeps num_splits as given and
    lets the kernel derive each sequence's split length from its seq_len."""
    num_tokens, num_heads, head_dim = check("q", q, BF16, ndim=3).shape
    _, block_size, num_kv_heads, _ = check("k_cache", k_cache, BF16,
                                           shape=(None, None, None, head_dim)).shape
    check("v_cache", v_cache, BF16, shape=k_cache.shape)
    num_seqs, max_blocks = check("block_tables", block_tables, I32, ndim=2).shape
    check("seq_lens", seq_lens, I32, shape=(num_seqs,))
    check("query_start_loc", query_start_loc, I32, shape=(num_seqs + 1,))
    check("out", out, BF16, shape=(num_tokens, num_heads * head_dim))
    if num_heads % num_kv_heads:
        raise ValueError(f"q: {num_heads} heads is not a multiple of {num_kv_heads} kv heads")
    if num_tokens == 0 or num_seqs == 0:
        return
    group = num_heads // num_kv_heads
    dpl = dims_per_lane(head_dim)
    kernel = get_kernel("attention", f"paged_attention_dpl{dpl}")
    smem = smem_bytes(head_dim)
    if smem > DEFAULT_SMEM_LIMIT and kernel.max_dynamic_shared_size_bytes < smem:
        kernel.max_dynamic_shared_size_bytes = smem
    row_tiles = max(1, -(-max_query_len * group // ROWS_PER_CTA))
    split_len = 0
    if num_splits > 1:
        if max_query_len != 1 or num_tokens != num_seqs:
            raise ValueError("num_splits > 1 needs a decode batch (one new token per sequence)")
        if max_seq_len is not None:
            split_len = -(-max_seq_len // num_splits)
            split_len = -(-split_len // KEY_TILE) * KEY_TILE
            num_splits = -(-max_seq_len // split_len)
    if num_splits > 1:
        parts = num_seqs * num_heads * num_splits
        check("partial_out", partial_out, F32, ndim=1)
        check("partial_lse", partial_lse, F32, ndim=1)
        if partial_out.size < parts * head_dim or partial_lse.size < parts:
            raise ValueError(f"partial_out/partial_lse: workspace too small for {num_seqs} "
                             f"sequences x {num_heads} heads x {num_splits} splits")
    else:
        partial_out = partial_lse = out  # not read by the kernel
    grid = (row_tiles * num_splits, num_kv_heads, num_seqs)
    kernel(grid, (THREADS,),
           (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, partial_out,
            partial_lse, i32(num_heads), i32(num_kv_heads), i32(head_dim), i32(block_size),
            i32(max_blocks), f32(scale), i32(row_tiles), i32(num_splits), i32(split_len)),
           shared_mem=smem)
    if num_splits > 1:
        get_kernel("attention", "attention_combine_kernel")(
            (num_heads, num_seqs), (min(128, -(-head_dim // 32) * 32),),
            (partial_out, partial_lse, out, i32(num_heads), i32(head_dim), i32(num_splits)))
