"""Launchers for attention.cu: paged causal attention (prefill and decode) and the
combine step of split-KV decode.

Which kernel runs (`attention_plan`):
- decode batches (at most one new token per sequence) of fewer than DECODE_MMA_MIN_SEQS
  sequences, head_dim 64/128/256: decode_attention_d{D}_g{G} (one CTA per sequence, kv
  head and split, of DECODE_WARPS[kernel] warps, for at most DECODE_MAX_CTA_HEADS of the
  kv head's query heads: larger groups take decode_head_parts CTAs; 16-byte K/V loads;
  fp32 online softmax). Where the keys are
  split and the GPU launches thread-block clusters (sm_90+), and decode_clusters_pay says
  so, decode_attention_d{D}_g{G}_cluster instead: a cluster of DECODE_CLUSTER CTAs per
  sequence and kv head (and share of its query heads: cluster_head_parts, down to one a
  CTA where the GPU holds the batch's CTAs) splits the keys
  and merges on chip, with no combine kernel after it;
  given the qkv product's output and its head norms (`DecodeRope`: Qwen3, Gemma 3), the
  head-norm form of either (decode_attention_d{D}_g{G}[_cluster]_norm), which norms and
  rotates q and the new key itself and writes the new key and value into the cache, so
  that no rope kernel runs between the product and attention;
- larger decode batches, head_dim 64/128, at most 16 query heads per kv head:
  decode_attention_mma_d{D} on the tensor cores, split and combined; clustered likewise
  (decode_attention_mma_d{D}_c{C}, C = mma_cluster_size(splits)) where clusters launch;
- every other batch with head_dim 64/128/256 and no split: prefill_attention_d{D}_t{T}
  (tensor cores, flash-attention 2 over K/V tiles gathered from the paged cache; T 16-row
  tiles a warp, choose_prefill_tiles);
- anything else (other head dims, block sizes that are not powers of two, unaligned
  arrays, soft-capped scores): the scalar paged_attention_dpl* kernel, which handles every
  shape.
A sliding window reaches every kernel: a decode sequence's keys (and their splits) start
at its window's first, and prefill masks per row."""
from __future__ import annotations

from typing import Any, NamedTuple

from ...util import cdiv
from . import elementwise, launch
from .device import device_limits
from .kernels import (BF16, F32, I32, aligned16, check, constants, f32, get_kernel, i32, instances,
                      opt_in_shared)

# The kernels' sizes and the list of kernels come from attention.cu (kernels.py)
_C = constants("attention")
ROWS_PER_CTA = _C["ROWS_PER_CTA"]  # scalar fallback: query rows per CTA
KEY_TILE = _C["KEY_TILE"]
K_TILE_PAD = _C["K_TILE_PAD"]
THREADS = _C["ATTN_WARPS"] * _C["WARP_SIZE"]
DECODE_CLUSTER = _C["DECODE_CLUSTER"]  # CTAs per cluster of the clustered decode kernels
PREFILL_THREADS = _C["PREFILL_THREADS"]
PREFILL_WARPS = _C["PREFILL_WARPS"]
PREFILL_ROW_PAD = _C["PREFILL_ROW_PAD"]
SPLIT_ALIGN = _C["SPLIT_ALIGN"]        # split lengths are multiples of this many keys
MAX_SPLITS = _C["COMBINE_MAX_SPLITS"]  # the combine kernel merges at most this many
# kernel name by its template arguments, as the DEFINE_* lines instantiate them
SCALAR_KERNELS = {dpl: name for name, dpl in instances("attention", "DEFINE_PAGED_ATTENTION")}
DECODE_KERNELS = {(d, g, cluster > 0): name
                  for name, d, g, cluster, _ in instances("attention", "DEFINE_DECODE_ATTENTION")}
# a CUDA-core decode kernel's head-norm form, by the kernel's name (head_dim 128 and 256)
DECODE_NORM_KERNELS = {DECODE_KERNELS[d, g, cluster > 0]: name for name, d, g, cluster, _
                       in instances("attention", "DEFINE_DECODE_ATTENTION_NORM")}
DECODE_WARPS = {name: warps  # a CUDA-core decode kernel's CTA width
                for macro in ("DEFINE_DECODE_ATTENTION", "DEFINE_DECODE_ATTENTION_NORM")
                for name, _, _, _, warps in instances("attention", macro)}
# (head_dim, tiles) -> name; tiles: 16-row mma tiles per warp
PREFILL_KERNELS = {(d, tiles): name
                   for name, d, tiles, _ in instances("attention", "DEFINE_PREFILL_ATTENTION")}
PREFILL_KEYS = {name: keys  # keys per K/V tile of a prefill kernel
                for name, _, _, keys in instances("attention", "DEFINE_PREFILL_ATTENTION")}
PREFILL_HEAD_DIMS = tuple(sorted({d for d, _ in PREFILL_KERNELS}))
# (head_dim, cluster) -> name; cluster 0: split ranges and the combine kernel
DECODE_MMA_KERNELS = {(d, cluster): name
                      for name, d, cluster in instances("attention", "DEFINE_DECODE_ATTENTION_MMA")}
DECODE_MMA_HEAD_DIMS = tuple(sorted({d for d, _ in DECODE_MMA_KERNELS}))
DECODE_MMA_CLUSTERS = tuple(sorted({c for _, c in DECODE_MMA_KERNELS if c > 0}))
DECODE_MMA_THREADS = _C["DECODE_MMA_THREADS"]
DECODE_MMA_KEYS = _C["DECODE_MMA_KEYS"]
DECODE_MMA_MAX_GROUP = 16  # the query heads of a kv head are the rows of one 16-row mma tile
DECODE_GROUPS = tuple(sorted({g for _, g, _ in DECODE_KERNELS}))  # bounds on a CTA's heads
DECODE_HEAD_DIMS = tuple(sorted({d for d, _, _ in DECODE_KERNELS}))
# the launcher's own choices
# a CUDA-core decode CTA serves at most this many query heads; a kv head with more shares
# them out among several CTAs, each reading its keys (decode_head_parts): past 4 heads a
# CTA has registers for half as many keys in flight, and at 6 heads per kv head (Qwen2.5)
# that made attention 13 us of a batch-1 layer (benchmarks/NOTES.md, change 45)
DECODE_MAX_CTA_HEADS = 4
MIN_SPLIT_LEN = 64   # a decode split covers at least this many keys
# the wider tensor-core prefill kernel from a grid of this many CTAs per SM (NOTES change 41)
PREFILL_WIDE_CTAS_PER_SM = 1
CTAS_PER_SM = 4      # decode splits aim at this many CTAs per SM
# Clustered decode CTAs shared out by cluster_head_parts hold at most this many warps an SM
# over the GPU: half of a decode CTA's register budget (attention.cu, DECODE_MIN_CTAS: 16
# warps of up to 128 registers), so that the next product's CTAs, launched
# programmatically, start beside them. Gemma-3-1B's batches of 4 and 8 lost 3 and 6% at
# 16 warps an SM (benchmarks/NOTES.md, change 53).
CLUSTER_WARPS_PER_SM = 8
# decode batches of at least this many sequences take the tensor-core decode kernel: it is
# the faster kernel alone at every batch size, but inside a batch-1 step (graph replay,
# programmatic launches) the CUDA-core kernel is (benchmarks/NOTES.md, change 27)
DECODE_MMA_MIN_SEQS = 8
LOG2_E = 1.4426950408889634
KERNEL_CHOICES = ("auto", "scalar", "decode", "decode_mma")


def dims_per_lane(head_dim: int) -> int:
    for dpl in sorted(SCALAR_KERNELS):
        if head_dim <= 32 * dpl:
            return dpl
    raise ValueError(f"head_dim {head_dim} is not supported by the attention kernel (at most 256)")


def smem_bytes(head_dim: int) -> int:
    """Scalar kernel: q rows, the padded K tile and the V tile, all fp32 (attention.cu)."""
    return 4 * (ROWS_PER_CTA * head_dim + KEY_TILE * (head_dim + K_TILE_PAD) + KEY_TILE * head_dim)


def prefill_rows(tiles: int) -> int:
    """Query rows a tensor-core prefill CTA owns: 16-row mma tiles per warp (attention.cu)."""
    return PREFILL_WARPS * 16 * tiles


def prefill_smem_bytes(head_dim: int, tiles: int) -> int:
    """Tensor-core prefill: the Q tile and double-buffered K and V tiles, bf16 rows padded
    by PREFILL_ROW_PAD elements (attention.cu)."""
    keys = PREFILL_KEYS[PREFILL_KERNELS[head_dim, tiles]]
    return 2 * (prefill_rows(tiles) + 4 * keys) * (head_dim + PREFILL_ROW_PAD)


def decode_mma_smem_bytes(head_dim: int, group: int = 1, cluster: int = 1) -> int:
    """Tensor-core decode: double-buffered K and V tiles, rows padded like prefill's, and
    in a cluster of `cluster` CTAs the inboxes after them (attention.cu): every CTA's
    running max and sum of up to 16 heads, and its sums for this CTA's share of the
    `group` heads' outputs."""
    tiles = 2 * 4 * DECODE_MMA_KEYS * (head_dim + PREFILL_ROW_PAD)
    if cluster <= 1:
        return tiles
    return tiles + 4 * cluster * (2 * DECODE_MMA_MAX_GROUP + cdiv(group * head_dim, cluster))


def max_decode_splits(max_model_len: int) -> int:
    return max(1, min(MAX_SPLITS, cdiv(max_model_len, MIN_SPLIT_LEN)))


def workspace_sizes(max_num_seqs: int, num_heads: int, head_dim: int, max_model_len: int):
    """Element counts of the float32 split workspace: (partial_out, partial_lse)."""
    splits = max_decode_splits(max_model_len)
    return max_num_seqs * num_heads * splits * head_dim, max_num_seqs * num_heads * splits


def choose_decode_splits(num_seqs: int, num_kv_heads: int, group: int, max_seq_len: int,
                         num_sms: int, max_splits: int) -> int:
    """How many key ranges each sequence of a decode batch is split into: enough CTAs for
    about CTAS_PER_SM per SM (the decode kernel runs decode_head_parts(group) CTAs per
    sequence and kv head), each range at least MIN_SPLIT_LEN keys."""
    ctas = max(1, num_seqs * num_kv_heads * decode_head_parts(group))
    wanted = cdiv(CTAS_PER_SM * num_sms, ctas)
    return max(1, min(wanted, max_splits, max_seq_len // MIN_SPLIT_LEN))


def choose_prefill_tiles(head_dim: int, rows: int, ctas_per_row_tile: int, num_sms: int) -> int:
    """16-row mma tiles per warp of the tensor-core prefill kernel for `rows` query rows (new
    tokens x query heads per kv head, of the longest sequence) of ctas_per_row_tile kv heads
    x sequences: the widest variant of the head_dim whose CTA the rows fill and whose grid
    still gives every SM PREFILL_WIDE_CTAS_PER_SM CTAs; the narrowest where none does. A
    wider CTA reads each K/V fragment from shared memory once for more rows (a third less
    time from 2,048 tokens on the H200), but a grid that leaves SMs idle finishes with its
    slowest CTA (benchmarks/NOTES.md, change 41)."""
    widths = sorted(tiles for d, tiles in PREFILL_KERNELS if d == head_dim)
    for tiles in reversed(widths):
        ctas = cdiv(rows, prefill_rows(tiles)) * ctas_per_row_tile
        if rows >= prefill_rows(tiles) and ctas >= PREFILL_WIDE_CTAS_PER_SM * num_sms:
            return tiles
    return widths[0]


def decode_head_parts(group: int) -> int:
    """CTAs of the CUDA-core decode kernel that share out the `group` query heads of one
    kv head (of one sequence and key range): the fewest that divide the group evenly into
    at most DECODE_MAX_CTA_HEADS heads each, a power of two (the kernel finds its kv head
    with a shift); 1 where none does. So 6 heads take 2 CTAs of 3, 16 take 4 of 4, and 5 or
    7 one CTA (the 8-head variant)."""
    parts = 1
    while parts <= group:
        if group % parts == 0 and group // parts <= DECODE_MAX_CTA_HEADS:
            return parts
        parts *= 2
    return 1


def cluster_head_parts(num_seqs: int, num_kv_heads: int, group: int, head_dim: int,
                       num_sms: int) -> int:
    """CTAs that share out a kv head's `group` query heads where a decode batch runs
    clustered: twice as many as decode_head_parts, and twice again, down to one head a
    CTA, while the parts divide the group, a clustered kernel serves the share, and the
    batch's CTAs fit the GPU at one CTA an SM and CLUSTER_WARPS_PER_SM warps an SM.
    A cluster's path is the step's, and fewer heads a CTA shorten each CTA's own work (its
    dot products, folds and merges); the extra CTAs read the kv head's keys again, mostly
    from L2. On an H100, Gemma-3-1B decodes 8% more tokens a second at batch 1 with one
    head a CTA than with four, and 6 to 9% more at batches 2 to 4 with one or two;
    Llama-3.2-1B 2% at batch 1 with two than with four; Qwen3-0.6B 1.3% with one than with
    two (benchmarks/NOTES.md, changes 51 and 53)."""
    parts = decode_head_parts(group)
    while group % (2 * parts) == 0:
        bound = decode_heads_bound(group // (2 * parts))
        name = DECODE_KERNELS.get((head_dim, bound, True))
        ctas = num_seqs * num_kv_heads * 2 * parts * DECODE_CLUSTER
        if (name is None or ctas > num_sms
                or ctas * DECODE_WARPS[name] > CLUSTER_WARPS_PER_SM * num_sms):
            break
        parts *= 2
    return parts


def decode_heads_bound(heads: int) -> int | None:
    """The smallest instantiated bound on a CTA's query heads (DECODE_GROUPS) that holds
    `heads`, None past the largest."""
    return next((g for g in DECODE_GROUPS if g >= heads), None)


def decode_group_bound(group: int) -> int | None:
    """The CUDA-core decode kernel variant for `group` query heads per kv head: the
    bound (decode_heads_bound) of one CTA's share of them where decode_head_parts share
    them out (a clustered batch may share them further: cluster_head_parts)."""
    return decode_heads_bound(group // decode_head_parts(group))


def decode_step_keys(head_dim: int, group: int, cluster: bool = False) -> int:
    """Keys a decode CTA scores per step of its loop (attention.cu: SLOTS * UNROLL), for
    the kernel variant of this group size (decode_group_bound), clustered or not."""
    bound = decode_group_bound(group)
    warp = _C["WARP_SIZE"]
    warps = DECODE_WARPS[DECODE_KERNELS[head_dim, bound, cluster]]
    slots = warps * (warp // (head_dim // 8))  # a key: 16 bytes per lane
    return slots * (_C["DECODE_UNROLL_G8"] if bound >= 8 else _C["DECODE_UNROLL"])


def cluster_max_keys(head_dim: int, group: int) -> int:
    """The longest context the clustered kernel runs at: one step of keys per CTA (512 where
    a CTA's step covers SPLIT_ALIGN keys: head_dim 64, 128 and 256 up to 4 query heads per
    CTA, which decode_head_parts keeps to). The kernel rounds each CTA's range up to
    SPLIT_ALIGN keys, so a variant whose step covers fewer (8 query heads per CTA) would take
    several steps per CTA, where the cluster was measured to lose: 0 for those, and for
    shapes without a decode kernel."""
    if (head_dim, decode_group_bound(group), True) not in DECODE_KERNELS:
        return 0
    step = decode_step_keys(head_dim, group, cluster=True)
    return DECODE_CLUSTER * step if step >= SPLIT_ALIGN else 0


def decode_clusters_pay(*, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                        max_seq_len: int, num_sms: int) -> bool:
    """Whether a split decode batch runs faster clustered than split and combined, as
    measured on the H200 for the Llama-3.2-1B shape (benchmarks/NOTES.md change 14): where
    each CTA of a cluster takes one step of keys (cluster_max_keys; none for shapes where it
    cannot) and the clusters take at most one CTA per SM. Per layer at batch 1 (qkv,
    attention, o_proj in a graph chain): context 288 14.0 against 15.3 us; 513 keys (two
    steps per CTA) 17.1 against 15.7; batch 2 at context 288 16.2 against 16.3. The same
    rule serves head_dim 128 and 256, whose CTAs are wider so that one step covers as many
    keys (change 33)."""
    group = num_heads // num_kv_heads
    if (num_seqs >= DECODE_MMA_MIN_SEQS and head_dim in DECODE_MMA_HEAD_DIMS
            and group <= DECODE_MMA_MAX_GROUP):
        return True  # the tensor-core kernel's clusters: at every context (NOTES change 38)
    ctas = num_seqs * num_kv_heads * decode_head_parts(group) * DECODE_CLUSTER
    return max_seq_len <= cluster_max_keys(head_dim, group) and ctas <= num_sms


def mma_cluster_size(num_splits: int) -> int:
    """CTAs per cluster of the clustered tensor-core decode kernel for a batch whose keys
    split num_splits ways: the largest instantiated size (DECODE_MMA_CLUSTERS) that
    num_splits holds, so the clusters launch no more CTAs than the splits would; 1 where
    none does (no split)."""
    return max((c for c in DECODE_MMA_CLUSTERS if c <= num_splits), default=1)


def split_length(max_seq_len: int, num_splits: int) -> tuple[int, int]:
    """(split_len, num_splits) for a decode batch whose longest sequence is known: ranges
    of a multiple of SPLIT_ALIGN keys, no range wholly past max_seq_len."""
    per_split = cdiv(max(1, max_seq_len), num_splits)
    split_len = max(SPLIT_ALIGN, cdiv(per_split, SPLIT_ALIGN) * SPLIT_ALIGN)
    return split_len, max(1, cdiv(max_seq_len, split_len))


class DecodeRope(NamedTuple):
    """What rope_and_cache would do before a decode step's attention, handed to attention
    instead (paged_attention's `rope`): qkv [T, (nh + 2 nkv) d] bf16, the qkv product's
    output (no bias); head_norm (interface.HeadNorm); cos_sin [P, d] float32; positions
    and slot_mapping [T] int32, as elementwise.rope_and_cache takes them."""
    qkv: Any
    head_norm: Any
    cos_sin: Any
    positions: Any
    slot_mapping: Any


class AttentionPlan(NamedTuple):
    kernel: str      # kernel name in attention.cu (SCALAR_, DECODE_ or PREFILL_KERNELS)
    grid: tuple
    block: int
    shared_mem: int  # dynamic shared memory bytes
    cluster: int = 1  # CTAs per thread-block cluster along x (1: a plain launch)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def attention_plan(*, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   block_size: int, max_query_len: int, num_splits: int, aligned: bool = True,
                   num_slots: int = 0, kernel: str = "auto", clusters: bool = False,
                   softcap: bool = False, num_sms: int,
                   prefill_tiles: int | None = None) -> AttentionPlan:
    """The kernel and launch shape for one attention call (pure arithmetic, no GPU).
    aligned: q, the caches and out start at 16-byte boundaries (the fast kernels use
    16-byte loads). num_slots: the KV pool's cache slots (blocks x block_size); the CUDA-core
    decode kernel keeps slot numbers in 32 bits, so a pool of 2^31 or more takes another
    kernel. kernel="scalar" forces the scalar fallback, "decode" and "decode_mma" the CUDA-core
    and tensor-core decode kernels where they can run (tests, benchmarks). clusters: the GPU
    can launch thread-block clusters; a split decode batch then takes the clustered kernel
    where the CUDA-core kernel would run. softcap: the scores are soft-capped, which only the
    scalar kernel does. num_sms (the GPU's) and prefill_tiles: the tensor-core prefill
    kernel's width (choose_prefill_tiles; prefill_tiles forces one, for tests and
    benchmarks)."""
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"kernel must be one of {KERNEL_CHOICES}, got {kernel!r}")
    group = num_heads // num_kv_heads
    fast = (kernel != "scalar" and not softcap and aligned and _is_power_of_two(block_size))
    bound = decode_group_bound(group)
    if fast and max_query_len == 1 and head_dim in DECODE_HEAD_DIMS:
        mma_can = head_dim in DECODE_MMA_HEAD_DIMS and group <= DECODE_MMA_MAX_GROUP
        cuda_core_can = ((head_dim, bound, False) in DECODE_KERNELS and num_slots < 2 ** 31)
        # the tensor-core kernel from DECODE_MMA_MIN_SEQS sequences (or where the CUDA-core
        # kernel cannot run), else the CUDA-core kernel; either in clusters that merge the
        # key ranges on chip instead of a combine kernel, where clusters launch
        clustered = (clusters and num_splits > 1 and cuda_core_can and kernel != "decode_mma"
                     and (head_dim, bound, True) in DECODE_KERNELS)
        mma_wanted = kernel == "decode_mma" or (
            kernel == "auto" and (num_seqs >= DECODE_MMA_MIN_SEQS or not cuda_core_can))
        if mma_can and mma_wanted:
            cluster = mma_cluster_size(num_splits) if clusters else 1
            shared = decode_mma_smem_bytes(head_dim, group, cluster)
            if cluster > 1:
                return AttentionPlan(DECODE_MMA_KERNELS[head_dim, cluster],
                                     (cluster, num_kv_heads, num_seqs), DECODE_MMA_THREADS,
                                     shared, cluster)
            return AttentionPlan(DECODE_MMA_KERNELS[head_dim, 0],
                                 (num_splits, num_kv_heads, num_seqs), DECODE_MMA_THREADS, shared)
        if cuda_core_can and kernel != "decode_mma":
            parts = (cluster_head_parts(num_seqs, num_kv_heads, group, head_dim, num_sms)
                     if clustered else decode_head_parts(group))
            name = DECODE_KERNELS[head_dim, decode_heads_bound(group // parts), clustered]
            threads = DECODE_WARPS[name] * _C["WARP_SIZE"]
            ctas_y = num_kv_heads * parts  # the kernel reads the parts here
            if clustered:
                return AttentionPlan(name, (DECODE_CLUSTER, ctas_y, num_seqs), threads, 0,
                                     DECODE_CLUSTER)
            return AttentionPlan(name, (num_splits, ctas_y, num_seqs), threads, 0)
    if fast and num_splits == 1 and head_dim in PREFILL_HEAD_DIMS:
        rows = max_query_len * group
        tiles = prefill_tiles or choose_prefill_tiles(head_dim, rows, num_kv_heads * num_seqs,
                                                      num_sms)
        if (head_dim, tiles) not in PREFILL_KERNELS:
            raise ValueError(f"no prefill kernel of {tiles} tiles a warp for head_dim {head_dim}")
        row_tiles = max(1, cdiv(rows, prefill_rows(tiles)))
        return AttentionPlan(PREFILL_KERNELS[head_dim, tiles], (row_tiles, num_kv_heads, num_seqs),
                             PREFILL_THREADS, prefill_smem_bytes(head_dim, tiles))
    row_tiles = max(1, cdiv(max_query_len * group, ROWS_PER_CTA))
    return AttentionPlan(SCALAR_KERNELS[dims_per_lane(head_dim)],
                         (row_tiles * num_splits, num_kv_heads, num_seqs), THREADS,
                         smem_bytes(head_dim))


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, *,
                    scale: float, max_query_len: int, max_seq_len: int | None,
                    num_splits: int = 1, partial_out=None, partial_lse=None,
                    kernel: str = "auto", clusters: bool = False, programmatic: bool = False,
                    window: int | None = None, softcap: float | None = None,
                    num_sms: int | None = None, prefill_tiles: int | None = None,
                    rope: DecodeRope | None = None) -> bool:
    """out [T, nh*d] = causal attention of q [T, nh, d] over the paged caches.

    num_splits > 1 (decode batches only, max_query_len == 1) splits each sequence's keys
    into num_splits ranges of split_len keys, written to the flat float32 workspaces
    partial_out / partial_lse, then merged. max_seq_len=None (CUDA-graph decode: nothing
    that changes between steps may be baked into the launch) keeps num_splits as given and
    lets the kernel derive each sequence's split length from its seq_len.
    clusters (sm_90+, launch.launch_attributes_usable()): a split decode batch runs the
    clustered kernel instead, which needs no workspace and no combine kernel.
    programmatic (likewise): the decode and combine kernels launch programmatically.
    kernel="scalar" runs the scalar fallback kernel whatever the shape.
    window: a token at position p sees the keys p - window + 1 .. p only (a decode
    sequence's splits then cover its window). softcap: scores become
    softcap * tanh(score / softcap) (the scalar kernel). num_sms: the GPU's (None: asked
    of the device). prefill_tiles: the tensor-core prefill kernel's 16-row tiles per warp
    (None: choose_prefill_tiles).
    rope: q is not computed yet, nor the new tokens' keys and values written: the decode
    kernel's head-norm form does that where the plan runs a CUDA-core decode kernel that has
    one (returns True: q is left as it was), else elementwise.rope_and_cache runs first,
    into q and the caches (returns False)."""
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
    dims_per_lane(head_dim)  # rejects head_dim > 256
    if rope is not None:
        check("qkv", rope.qkv, BF16, shape=(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim))
        check("q_norm", rope.head_norm.q_weight, BF16, shape=(head_dim,))
        check("k_norm", rope.head_norm.k_weight, BF16, shape=(head_dim,))
        check("cos_sin", rope.cos_sin, F32, shape=(None, head_dim))
        check("positions", rope.positions, I32, shape=(num_tokens,))
        check("slot_mapping", rope.slot_mapping, I32, shape=(num_tokens,))
    if num_tokens == 0 or num_seqs == 0:
        return False
    split_len = 0
    if num_splits > 1:
        if max_query_len != 1 or num_tokens != num_seqs:
            raise ValueError("num_splits > 1 needs a decode batch (one new token per sequence)")
        if max_seq_len is not None:  # the keys a sequence sees: its window at most
            seen = max_seq_len if window is None else min(max_seq_len, window)
            split_len, num_splits = split_length(seen, num_splits)
    if num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits: at most {MAX_SPLITS} (the combine kernel), got {num_splits}")
    plan = attention_plan(num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, block_size=block_size,
                          max_query_len=max_query_len, num_splits=num_splits,
                          aligned=aligned16(q, k_cache, v_cache, out),
                          num_slots=k_cache.shape[0] * block_size, kernel=kernel,
                          clusters=clusters, softcap=softcap is not None,
                          num_sms=device_limits()["sms"] if num_sms is None else num_sms,
                          prefill_tiles=prefill_tiles)
    clustered = plan.cluster > 1
    norm_kernel = None if rope is None else DECODE_NORM_KERNELS.get(plan.kernel)
    if rope is not None and (norm_kernel is None or not aligned16(rope.qkv)):
        elementwise.rope_and_cache(rope.qkv, rope.positions, rope.slot_mapping, rope.cos_sin,
                                   k_cache, v_cache, q, head_norm=rope.head_norm,
                                   programmatic=programmatic)
        norm_kernel, rope = None, None
    if num_splits > 1 and not clustered:
        parts = num_seqs * num_heads * num_splits
        check("partial_out", partial_out, F32, ndim=1)
        check("partial_lse", partial_lse, F32, ndim=1)
        if partial_out.size < parts * head_dim or partial_lse.size < parts:
            raise ValueError(f"partial_out/partial_lse: workspace too small for {num_seqs} "
                             f"sequences x {num_heads} heads x {num_splits} splits")
    else:
        partial_out = partial_lse = out  # not read by the kernels
    function = get_kernel("attention", norm_kernel or plan.kernel)
    opt_in_shared(function, plan.shared_mem)
    tables = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    is_decode = plan.kernel in DECODE_KERNELS.values() or plan.kernel in DECODE_MMA_KERNELS.values()
    window = i32(0 if window is None else window)  # 0: no window
    if is_decode:
        args = tables + (partial_out, partial_lse, i32(num_heads), i32(num_kv_heads),
                         i32(block_size.bit_length() - 1), i32(max_blocks),
                         f32(scale * LOG2_E), i32(num_splits), i32(split_len), window)
        if plan.kernel in DECODE_KERNELS.values():  # the CUDA-core kernel's head parts
            args += (i32((plan.grid[1] // num_kv_heads).bit_length() - 1),)
        if norm_kernel is not None:
            norm = rope.head_norm
            args += (rope.qkv, norm.q_weight, norm.k_weight, rope.cos_sin, rope.positions,
                     rope.slot_mapping, f32(norm.eps), f32(norm.offset))
    elif plan.kernel in PREFILL_KERNELS.values():
        args = tables + (i32(num_heads), i32(num_kv_heads), i32(block_size.bit_length() - 1),
                         i32(max_blocks), f32(scale * LOG2_E), i32(plan.grid[0]), window)
    else:
        row_tiles = plan.grid[0] // num_splits
        args = tables + (partial_out, partial_lse, i32(num_heads), i32(num_kv_heads),
                         i32(head_dim), i32(block_size), i32(max_blocks), f32(scale),
                         i32(row_tiles), i32(num_splits), i32(split_len), window,
                         f32(0.0 if softcap is None else softcap))
    # decode kernels and the split combine wait for the kernel before on the device, so
    # they may launch programmatically: start while the qkv product (or the split kernel)
    # drains
    if is_decode:
        launch.launch_waiting(function, plan.grid, plan.block, args, plan.shared_mem,
                              cluster=plan.cluster, programmatic=programmatic)
    else:
        function(plan.grid, (plan.block,), args, shared_mem=plan.shared_mem)
    if num_splits > 1 and not clustered:
        combine = get_kernel("attention", "attention_combine_kernel")
        grid, block = (num_heads, num_seqs), min(128, cdiv(head_dim, 32) * 32)
        launch.launch_waiting(combine, grid, block, (partial_out, partial_lse, out,
                                                     i32(num_heads), i32(head_dim),
                                                     i32(num_splits)),
                              programmatic=programmatic)
    return norm_kernel is not None
