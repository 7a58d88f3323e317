"""Attention kernel selection, split arithmetic and the build of attention.cu (registers,
spills), without a GPU. The kernels' numbers are tested against the reference in
test_cuda_ops.py on a GPU machine."""
import itertools
import re
import shutil
import subprocess

import pytest

from cupy_llama.backends.cuda import attention
from cupy_llama.backends.cuda.attention import attention_plan, choose_decode_splits, split_length
from cupy_llama.backends.cuda.kernels import kernel_dir
from cupy_llama.util import cdiv

H200_SMS = 132


def plan(**overrides):
    """Llama-3.2-1B shape by default: 32 query heads, 8 kv heads, head_dim 64, block 16."""
    args = dict(num_seqs=4, num_heads=32, num_kv_heads=8, head_dim=64, block_size=16,
                max_query_len=1, num_splits=1, num_sms=H200_SMS)
    args.update(overrides)
    return attention_plan(**args)


def test_the_cuda_core_decode_kernel_takes_the_smallest_group_bound():
    p = plan(num_seqs=3, num_splits=5)
    assert p.kernel == "decode_attention_d64_g4"
    assert p.grid == (5, 8, 3) and p.block == 128 and p.shared_mem == 0
    # the smallest instantiated group bound that holds a CTA's share of the group: past
    # DECODE_MAX_CTA_HEADS (4) heads, the group is shared out among CTAs along y
    for group, bound, parts in ((1, 1, 1), (2, 2, 1), (3, 4, 1), (4, 4, 1), (5, 8, 1),
                                (6, 4, 2), (7, 8, 1), (8, 4, 2), (12, 4, 4), (16, 4, 4),
                                (24, 4, 8), (32, 4, 8)):
        got = plan(num_heads=2 * group, num_kv_heads=2, head_dim=128, num_splits=5)
        assert got.kernel == f"decode_attention_d128_g{bound}", (group, got)
        assert got.grid == (5, 2 * parts, 4), (group, got)
        clustered = plan(num_heads=2 * group, num_kv_heads=2, head_dim=128, num_splits=5,
                         clusters=True, num_seqs=7)  # 7 x 2 kv heads x 8: no room for more
        assert clustered.grid == (attention.DECODE_CLUSTER, 2 * parts, 7), (group, clustered)


def test_a_kv_heads_ctas_share_out_its_heads_evenly():
    """The kernel takes its heads from the grid (attention.cu: group >> head_parts_log2
    heads from blockIdx.y times as many, its kv head blockIdx.y >> head_parts_log2), so
    the parts are a power of two that divides the group; the fewest that bring a CTA's
    share to DECODE_MAX_CTA_HEADS, or one CTA where none does."""
    most = attention.DECODE_MAX_CTA_HEADS
    for group in range(1, 65):
        parts = attention.decode_head_parts(group)
        assert parts & (parts - 1) == 0 and group % parts == 0, group
        splits = [p for p in (1, 2, 4, 8, 16, 32, 64) if group % p == 0 and group // p <= most]
        assert parts == (splits[0] if splits else 1), group
        if attention.decode_group_bound(group) is not None:
            assert group // parts <= attention.decode_group_bound(group)
        # every CTA's heads belong to the kv head it reads
        shift, heads = parts.bit_length() - 1, group // parts
        for y in range(3 * parts):  # three kv heads
            first = y * heads
            assert y >> shift == first // group == (first + heads - 1) // group, (group, y)


def test_clustered_batches_share_a_kv_heads_query_heads_out_as_far_as_the_gpu_holds():
    """A clustered batch gives each share of a kv head's query heads a cluster of its own,
    halving the shares down to one head a CTA while the batch's CTAs fit the GPU at one
    an SM and CLUSTER_WARPS_PER_SM warps an SM."""
    def clustered(num_seqs, num_heads, num_kv_heads, head_dim):
        return plan(num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, num_splits=8, clusters=True)
    cluster = attention.DECODE_CLUSTER
    most_warps = attention.CLUSTER_WARPS_PER_SM * H200_SMS
    # Gemma-3-1B: one kv head of 4 query heads, a CTA each
    assert clustered(1, 4, 1, 256)[:2] == ("decode_attention_d256_g1_cluster", (cluster, 4, 1))
    # ... at batch 2 too (64 CTAs of 16 warps); two a CTA at 3 and 4 (one a CTA would take
    # 96 and 128 CTAs of 16 warps, past 8 warps an SM); none shared out at 5 (two a CTA
    # would take 80 CTAs of 16 warps)
    assert clustered(2, 4, 1, 256)[:2] == ("decode_attention_d256_g1_cluster", (cluster, 4, 2))
    assert clustered(3, 4, 1, 256)[:2] == ("decode_attention_d256_g2_cluster", (cluster, 2, 3))
    assert clustered(4, 4, 1, 256)[:2] == ("decode_attention_d256_g2_cluster", (cluster, 2, 4))
    assert clustered(5, 4, 1, 256)[:2] == ("decode_attention_d256_g4_cluster", (cluster, 1, 5))
    # Llama-3.2-1B: 8 kv heads of 4; two CTAs of 2 take 128 CTAs, four would take 256
    assert clustered(1, 32, 8, 64)[:2] == ("decode_attention_d64_g2_cluster", (cluster, 16, 1))
    assert clustered(2, 32, 8, 64)[:2] == ("decode_attention_d64_g4_cluster", (cluster, 8, 2))
    # Qwen3-0.6B: 8 kv heads of 2, one a CTA: 128 CTAs of 8 warps
    assert clustered(1, 16, 8, 128)[:2] == ("decode_attention_d128_g1_cluster", (cluster, 16, 1))
    assert clustered(2, 16, 8, 128)[:2] == ("decode_attention_d128_g2_cluster", (cluster, 8, 2))
    # Qwen2.5-1.5B: 6 heads halve once (two CTAs of 3), never into 4
    assert clustered(1, 12, 2, 128)[:2] == ("decode_attention_d128_g4_cluster", (cluster, 4, 1))
    # an unclustered batch keeps the fewest parts
    assert plan(num_seqs=1, num_splits=5)[:2] == ("decode_attention_d64_g4", (5, 8, 1))
    capped_by_warps = 0  # cases where only the warps stop one halving more
    for head_dim, kv_heads, group, num_seqs in itertools.product(
            (128, 256), (1, 2), range(1, 33), (1, 2, 3, 4)):
        p = clustered(num_seqs, kv_heads * group, kv_heads, head_dim)
        if p.kernel not in attention.DECODE_KERNELS.values():
            continue  # the tensor-core kernel: no CUDA-core kernel takes the group
        case = (head_dim, kv_heads, group, num_seqs, p)
        parts = p.grid[1] // kv_heads
        least = attention.decode_head_parts(group)
        assert parts & (parts - 1) == 0 and group % parts == 0 and parts >= least, case
        ctas = num_seqs * kv_heads * parts * cluster
        fits = ctas <= H200_SMS and ctas * attention.DECODE_WARPS[p.kernel] <= most_warps
        assert parts == least or fits, case
        bound = int(p.kernel.split("_g")[1].split("_")[0])
        assert group // parts <= bound, case
        # not one halving more that would have fitted
        if parts < group and group % (2 * parts) == 0:
            more = attention.DECODE_KERNELS.get((head_dim, attention.decode_heads_bound(
                group // (2 * parts)), True))
            warps_past = more is not None and 2 * ctas * attention.DECODE_WARPS[more] > most_warps
            assert more is None or 2 * ctas > H200_SMS or warps_past, case
            capped_by_warps += warps_past and 2 * ctas <= H200_SMS
    assert capped_by_warps > 0


def test_split_decode_batches_take_the_cluster_kernel_where_clusters_launch():
    """One cluster of DECODE_CLUSTER CTAs per sequence and kv head replaces the splits
    (and the combine kernel); an unsplit batch keeps the plain kernel."""
    p = plan(num_seqs=3, num_splits=5, clusters=True)
    assert p.kernel == "decode_attention_d64_g4_cluster"
    assert p.grid == (attention.DECODE_CLUSTER, 8, 3) and p.block == 128 and p.shared_mem == 0
    assert p.cluster == attention.DECODE_CLUSTER
    assert plan(num_seqs=3, num_splits=5).cluster == 1
    assert plan(num_seqs=3, num_splits=1, clusters=True).kernel == "decode_attention_d64_g4"
    assert plan(num_splits=5, clusters=False).kernel == "decode_attention_d64_g4"
    # the other kernels do not change with it
    assert plan(max_query_len=30, clusters=True).kernel == "prefill_attention_d64_t1"
    assert plan(num_splits=4, num_slots=2 ** 31).kernel == "decode_attention_mma_d64"
    # where the tensor-core kernel runs, its own clusters
    assert plan(num_splits=4, num_slots=2 ** 31, clusters=True).kernel == "decode_attention_mma_d64_c4"


def test_clusters_pay_for_one_step_of_keys_per_cta_and_one_cta_per_sm():
    """The measured rule (NOTES change 14): contexts whose keys each CTA of the cluster
    scores in one step, and clusters of all sequences and kv heads within one CTA per SM."""
    def pay(num_seqs, max_seq_len, num_heads=32, num_kv_heads=8, head_dim=64):
        return attention.decode_clusters_pay(num_seqs=num_seqs, num_heads=num_heads,
                                             num_kv_heads=num_kv_heads, head_dim=head_dim,
                                             max_seq_len=max_seq_len, num_sms=H200_SMS)
    # one step: 16 slots x 4 keys (head_dim 64 in 4 warps, 128 in 8, 256 in 16: its
    # clusters); a CTA serves at most 4 query heads (decode_head_parts), so every group
    # steps as far (attention.cu: SLOTS * UNROLL)
    step = attention.decode_step_keys
    assert step(64, 4) == step(64, 1) == step(128, 4) == step(256, 3, cluster=True) == 64
    assert step(128, 2, cluster=True) == step(256, 4, cluster=True) == 64
    assert step(64, 8) == step(128, 6) == step(128, 16) == 64 and step(256, 4) == 16
    assert step(64, 7) == step(128, 5) == 32  # 7 and 5 heads: one CTA of the 8-head variant
    # a CTA's range is a multiple of SPLIT_ALIGN (64) keys: only 64-key steps give one step
    for head_dim, group in ((64, 4), (64, 1), (128, 4), (128, 2), (256, 4), (256, 1),
                            (64, 8), (128, 6), (128, 8), (256, 8), (64, 16)):
        assert attention.cluster_max_keys(head_dim, group) == 512, (head_dim, group)
    for head_dim, group in ((64, 7), (128, 5), (256, 7), (96, 4)):
        assert attention.cluster_max_keys(head_dim, group) == 0, (head_dim, group)
    assert pay(1, 289) and pay(2, 512)
    assert not pay(1, 513)  # two steps per CTA
    assert not pay(4, 289)  # 256 CTAs on 132 SMs
    assert pay(4, 289, num_kv_heads=4, num_heads=16) and not pay(5, 289, num_kv_heads=4, num_heads=16)
    assert pay(1, 512, head_dim=128) and not pay(1, 513, head_dim=128)
    assert pay(1, 512, head_dim=256, num_heads=4, num_kv_heads=1)  # Gemma-3-1B
    assert pay(16, 289, head_dim=256, num_heads=4, num_kv_heads=1)  # 128 CTAs
    # 6 heads per kv head (Qwen2.5-1.5B): 2 CTAs per kv head, so 8 x 2 x 8 CTAs
    assert pay(1, 100, head_dim=128, num_heads=48, num_kv_heads=8)
    assert pay(1, 512, head_dim=128, num_heads=12, num_kv_heads=2)  # Qwen2.5-1.5B itself
    assert not pay(2, 100, head_dim=128, num_heads=48, num_kv_heads=8)  # 256 CTAs
    assert pay(1, 100, num_heads=32, num_kv_heads=2)  # 16 heads per kv head: 4 CTAs each
    assert not pay(1, 100, head_dim=96)
    # the tensor-core kernel's batches: clustered at every context (NOTES change 38)
    mma_min = attention.DECODE_MMA_MIN_SEQS
    assert pay(mma_min, 4096) and pay(256, 100) and pay(64, 8192, head_dim=128, num_heads=16)
    assert pay(mma_min, 4096, num_heads=32, num_kv_heads=2)  # 16 heads per kv head
    assert not pay(mma_min, 4096, head_dim=256, num_heads=4, num_kv_heads=1)  # no mma kernel
    assert not pay(17, 289, head_dim=256, num_heads=4, num_kv_heads=1)  # 136 CTAs


def test_tensor_core_clusters_launch_no_more_ctas_than_the_splits():
    """The clustered tensor-core kernel takes the largest instantiated cluster that the
    split count holds."""
    sizes = {n: attention.mma_cluster_size(n) for n in (1, 2, 3, 4, 5, 7, 8, 9, 32)}
    assert sizes == {1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 7: 4, 8: 8, 9: 8, 32: 8}
    p = plan(num_seqs=16, num_splits=5, clusters=True)
    assert p.kernel == "decode_attention_mma_d64_c4" and p.cluster == 4
    # the K and V tiles, then the inboxes: 4 CTAs' max and sum of up to 16 heads, and
    # their sums for a quarter of the 4 heads x 64 dims
    assert p.grid == (4, 8, 16)
    assert p.shared_mem == 2 * 4 * 64 * (64 + 8) + 4 * 4 * (2 * 16 + 4 * 64 // 4)
    p = plan(num_seqs=16, num_splits=9, head_dim=128, num_heads=16, clusters=True)
    assert p.kernel == "decode_attention_mma_d128_c8" and p.grid == (8, 8, 16)
    assert p.shared_mem == 2 * 4 * 64 * (128 + 8) + 4 * 8 * (2 * 16 + 2 * 128 // 8)
    assert plan(num_seqs=16, num_splits=1, clusters=True).kernel == "decode_attention_mma_d64"


def test_decode_step_matches_the_cuda_source():
    source = (kernel_dir() / "attention.cu").read_text()
    assert "constexpr int LANES_PER_KEY = D / 8;" in source  # decode_step_keys: head_dim // 8
    assert "constexpr int UNROLL = MAXG >= 8 ? DECODE_UNROLL_G8 : DECODE_UNROLL;" in source
    assert "constexpr int SLOTS = NUM_WARPS * SLOTS_PER_WARP;" in source
    assert "constexpr int STEP = SLOTS * UNROLL;" in source


def test_prefill_batches_take_the_tensor_core_kernel():
    p = plan(num_seqs=2, max_query_len=1000)
    assert p.kernel == "prefill_attention_d64_t2"  # 32 row tiles x 8 kv heads x 2 sequences
    assert p.grid == (cdiv(1000 * 4, 128), 8, 2)  # rows are (token, head of the group) pairs
    assert p.shared_mem == 2 * (128 + 4 * 64) * (64 + 8)  # Q, then K and V double-buffered
    p = plan(head_dim=128, max_query_len=17, num_heads=9, num_kv_heads=3)
    assert p.kernel == "prefill_attention_d128_t1" and p.grid[0] == 1
    assert p.shared_mem == 2 * (64 + 4 * 64) * (128 + 8)
    # head_dim 256 (Gemma 3): tiles of 32 keys, so two CTAs' buffers fit an SM
    p = plan(head_dim=256, max_query_len=30, num_heads=4, num_kv_heads=1)
    assert p.kernel == "prefill_attention_d256_t1" and p.grid == (2, 1, 4)
    assert p.shared_mem == 2 * (64 + 4 * 32) * (256 + 8)
    # more than 8 heads per kv head that no power of two shares out in CTAs of at most 4
    # (decode_head_parts): decode rows go through the tensor-core decode kernel up to 16
    # heads, split or not; past that through the prefill kernel, and when split through
    # the scalar kernel (it splits any shape)
    assert plan(num_heads=20, num_kv_heads=2).kernel == "decode_attention_mma_d64"
    assert plan(num_heads=20, num_kv_heads=2, num_splits=3).kernel == "decode_attention_mma_d64"
    assert plan(num_heads=40, num_kv_heads=2).kernel == "prefill_attention_d64_t1"
    assert plan(num_heads=40, num_kv_heads=2, num_splits=3).kernel == "paged_attention_dpl2"
    # 16 and 32 heads per kv head: 4 and 8 CTAs of 4 heads on the CUDA cores
    assert plan(num_heads=32, num_kv_heads=2, num_splits=3).grid == (3, 8, 4)
    assert plan(num_heads=64, num_kv_heads=2, num_splits=3).kernel == "decode_attention_d64_g4"


def test_two_prefill_ctas_fit_an_sm():
    """The prefill kernels' launch bound asks for two CTAs an SM: their shared memory (the
    Q tile and the double-buffered K/V tiles, plus the 1 KB the hardware keeps per CTA)
    must fit twice in the H100's and H200's 228 KB."""
    for (head_dim, tiles), name in attention.PREFILL_KERNELS.items():
        assert 2 * (attention.prefill_smem_bytes(head_dim, tiles) + 1024) <= 228 * 1024, name


def test_prefill_takes_the_widest_kernel_that_fills_the_gpu():
    """Two 16-row tiles a warp (128 rows a CTA) where that grid still gives every SM
    PREFILL_WIDE_CTAS_PER_SM CTAs; one tile (64 rows) below that; head_dim 128 has one
    width."""
    assert attention.prefill_rows(1) == 64 and attention.prefill_rows(2) == 128
    wide = attention.PREFILL_WIDE_CTAS_PER_SM * H200_SMS
    # Llama-3.2-1B: 4 query heads per kv head, 8 kv heads, one sequence: 17 row tiles of
    # 128 rows (32 tokens each) give 136 CTAs
    tokens_at_the_edge = cdiv(wide, 8) * 32
    assert tokens_at_the_edge == 544
    assert plan(num_seqs=1, max_query_len=tokens_at_the_edge).kernel == "prefill_attention_d64_t2"
    assert plan(num_seqs=1, max_query_len=tokens_at_the_edge - 32).kernel == \
        "prefill_attention_d64_t1"
    assert plan(num_seqs=1, max_query_len=128).grid == (8, 8, 1)
    assert plan(num_seqs=1, max_query_len=4096).grid == (128, 8, 1)
    assert plan(num_seqs=16, max_query_len=300).kernel == "prefill_attention_d64_t2"
    # rows that would leave a wide CTA mostly empty: many sequences of a few tokens
    assert plan(num_seqs=256, max_query_len=16).kernel == "prefill_attention_d64_t1"
    assert plan(num_seqs=256, max_query_len=32).kernel == "prefill_attention_d64_t2"
    assert plan(num_seqs=1, max_query_len=8192, head_dim=128).kernel == "prefill_attention_d128_t1"
    # forced either way, for tests and benchmarks
    assert plan(num_seqs=1, max_query_len=8, prefill_tiles=2).grid == (1, 8, 1)
    assert plan(num_seqs=1, max_query_len=4096, prefill_tiles=1).grid == (256, 8, 1)
    with pytest.raises(ValueError, match="no prefill kernel of 2 tiles a warp for head_dim 128"):
        plan(max_query_len=30, head_dim=128, prefill_tiles=2)


def test_a_pool_of_2_31_slots_or_more_keeps_decode_off_the_cuda_core_kernel():
    """The CUDA-core decode kernel keeps cache slot numbers in 32 bits: past that, decode
    batches take the tensor-core decode kernel (64-bit slots), split or not."""
    assert plan(num_slots=2 ** 31 - 1).kernel == "decode_attention_d64_g4"
    assert plan(num_slots=2 ** 31, kernel="decode").kernel == "prefill_attention_d64_t1"
    assert plan(num_slots=2 ** 31).kernel == "decode_attention_mma_d64"
    assert plan(num_slots=2 ** 31, num_splits=4).kernel == "decode_attention_mma_d64"


def test_decode_batches_of_many_sequences_take_the_tensor_core_kernel():
    small = attention.DECODE_MMA_MIN_SEQS - 1
    assert plan(num_seqs=small, num_splits=3).kernel == "decode_attention_d64_g4"
    p = plan(num_seqs=small + 1, num_splits=3)
    assert p.kernel == "decode_attention_mma_d64" and p.grid == (3, 8, small + 1)
    assert p.block == 128 and p.shared_mem == 2 * 4 * 64 * (64 + 8)
    assert plan(num_seqs=256, head_dim=128).shared_mem == 2 * 4 * 64 * (128 + 8)
    assert plan(num_seqs=2, num_splits=3, clusters=True).kernel == "decode_attention_d64_g4_cluster"
    assert plan(num_seqs=64, num_splits=3, clusters=True).kernel == "decode_attention_mma_d64_c2"
    # either kernel on demand, where it can run
    assert plan(num_seqs=1, num_splits=3, clusters=True, kernel="decode_mma").kernel == \
        "decode_attention_mma_d64_c2"
    assert plan(num_seqs=64, num_splits=3, clusters=True, kernel="decode").kernel == \
        "decode_attention_d64_g4_cluster"
    assert plan(num_seqs=256, kernel="decode").kernel == "decode_attention_d64_g4"
    assert plan(num_seqs=256, kernel="decode", num_heads=20, num_kv_heads=2).kernel == \
        "prefill_attention_d64_t1"  # no CUDA-core kernel for 10 heads per kv head


@pytest.mark.parametrize("overrides", [
    dict(head_dim=16), dict(head_dim=32), dict(head_dim=80), dict(head_dim=96, max_query_len=30),
    dict(softcap=True), dict(softcap=True, max_query_len=30),
    dict(block_size=12), dict(block_size=24), dict(aligned=False), dict(kernel="scalar"),
    dict(kernel="scalar", max_query_len=300)])
def test_other_shapes_fall_back_to_the_scalar_kernel(overrides):
    p = plan(**overrides)
    head_dim = overrides.get("head_dim", 64)
    assert p.kernel == f"paged_attention_dpl{attention.dims_per_lane(head_dim)}"
    assert p.shared_mem == attention.smem_bytes(head_dim)


def test_wider_head_dims_decode_in_wider_ctas():
    """head_dim 128 decodes in CTAs of 8 warps, and 256 in clusters of CTAs of 16 (a step of
    64 keys, as head_dim 64 takes in 4); Gemma's head_dim 256 decodes on the CUDA cores at
    every batch size (no tensor-core decode kernel), split in CTAs of 4 warps, and prefills
    on the scalar kernel."""
    for num_seqs in (1, 64):
        p = plan(head_dim=256, num_heads=4, num_kv_heads=1, num_seqs=num_seqs, num_splits=3)
        assert p.kernel == "decode_attention_d256_g4" and p.block == 128
        assert p.grid == (3, 1, num_seqs) and p.shared_mem == 0
    p = plan(head_dim=256, num_heads=4, num_kv_heads=1, num_seqs=16, num_splits=3, clusters=True)
    assert p.kernel == "decode_attention_d256_g4_cluster" and p.block == 512
    assert p.grid == (attention.DECODE_CLUSTER, 1, 16) and p.cluster == attention.DECODE_CLUSTER
    p = plan(head_dim=128, num_heads=16, num_kv_heads=8, num_seqs=2, num_splits=8, clusters=True)
    assert p.kernel == "decode_attention_d128_g2_cluster" and p.block == 256
    assert plan(head_dim=128, num_seqs=3, num_splits=5).block == 256
    # 7 query heads per kv head at head_dim 256: one CTA of 4 warps, no cluster variant
    p = plan(head_dim=256, num_heads=14, num_kv_heads=2, num_seqs=1, num_splits=3, clusters=True)
    assert p.kernel == "decode_attention_d256_g8" and p.block == 128 and p.cluster == 1
    # prefill of head_dim 256 on the tensor cores; soft-capped scores on the scalar kernel
    assert plan(head_dim=256, max_query_len=40).kernel == "prefill_attention_d256_t1"
    assert plan(head_dim=256, max_query_len=40, softcap=True).kernel == "paged_attention_dpl8"


def test_plan_rejects_an_unknown_kernel_choice():
    with pytest.raises(ValueError, match="kernel must be one of"):
        plan(kernel="fast")


def test_decode_split_choice():
    # batch 1, context 512: 8 ranges of 64 keys (64 CTAs), not 32 nearly empty ones
    assert choose_decode_splits(1, 8, 4, 512, H200_SMS, 32) == 8
    assert choose_decode_splits(1, 8, 4, 8192, H200_SMS, 32) == 32    # graph bucket 1
    assert choose_decode_splits(8, 8, 4, 2048, H200_SMS, 32) == 9     # ~4 CTAs per SM
    assert choose_decode_splits(256, 8, 4, 2048, H200_SMS, 32) == 1   # the batch fills the GPU
    assert choose_decode_splits(4, 8, 4, 40, H200_SMS, 32) == 1       # too short to split
    for num_seqs in (1, 2, 7, 64, 300):
        for max_seq_len in (1, 63, 64, 1000, 131072):
            n = choose_decode_splits(num_seqs, 8, 4, max_seq_len, H200_SMS, 16)
            assert 1 <= n <= 16 and (n == 1 or n * attention.MIN_SPLIT_LEN <= max_seq_len)


def test_split_lengths_cover_every_key_without_empty_splits():
    for max_seq_len in list(range(0, 300)) + [1327, 2047, 4098, 4099, 8192, 131071]:
        for wanted in (1, 2, 3, 7, 8, 32):
            split_len, num_splits = split_length(max_seq_len, wanted)
            assert split_len % attention.SPLIT_ALIGN == 0 and split_len > 0
            assert 1 <= num_splits <= wanted
            assert split_len * num_splits >= max_seq_len
            assert (num_splits - 1) * split_len < max(1, max_seq_len), (max_seq_len, wanted)


def test_workspace_holds_the_largest_split_count():
    for max_model_len in (16, 64, 1000, 1024, 8192, 131072):
        splits = attention.max_decode_splits(max_model_len)
        assert 1 <= splits <= attention.MAX_SPLITS
        out, lse = attention.workspace_sizes(3, 32, 64, max_model_len)
        assert (out, lse) == (3 * 32 * splits * 64, 3 * 32 * splits)
        # the graph path asks for choose_decode_splits(..., max_model_len, ..., splits)
        assert choose_decode_splits(1, 1, 1, max_model_len, H200_SMS, splits) <= splits


def test_kernel_names_and_variants_come_from_the_define_lines():
    """The planner's kernels are the DEFINE_* lines of attention.cu, read off the source
    (kernels.instances), and the variants it can pick follow from them."""
    source = (kernel_dir() / "attention.cu").read_text()
    lines = re.findall(r"^DEFINE_DECODE_ATTENTION\((\w+), (\d+), (\d+), (\w+), (\d+)\)$",
                       source, re.M)
    assert len(lines) == len(attention.DECODE_KERNELS) == 23
    for name, d, g, cluster, warps in lines:
        assert attention.DECODE_KERNELS[int(d), int(g), cluster != "0"] == name
        assert attention.DECODE_WARPS[name] == int(warps)
    # the head-norm forms: one for each CUDA-core decode kernel of head_dim 128 and 256,
    # of the same shape and width, so that the plain kernel's launch plan serves both
    norm_lines = re.findall(r"^DEFINE_DECODE_ATTENTION_NORM\((\w+), (\d+), (\d+), (\w+), (\d+)\)$",
                            source, re.M)
    plain = {(d, g, cluster): (name, warps) for name, d, g, cluster, warps in lines}
    assert sorted((d, g, c) for _, d, g, c, _ in norm_lines) == sorted(
        key for key in plain if key[0] in ("128", "256"))
    for name, d, g, cluster, warps in norm_lines:
        plain_name, plain_warps = plain[d, g, cluster]
        assert attention.DECODE_NORM_KERNELS[plain_name] == name and warps == plain_warps
        assert attention.DECODE_WARPS[name] == int(warps)
    assert len(attention.DECODE_WARPS) == 23 + len(norm_lines) == 38
    assert attention.DECODE_GROUPS == (1, 2, 4, 8) and attention.DECODE_HEAD_DIMS == (64, 128, 256)
    prefill = re.findall(r"^DEFINE_PREFILL_ATTENTION\((\w+), (\d+), (\d+), (\d+)\)$", source,
                         re.M)
    assert {(int(d), int(t)): name for name, d, t, _ in prefill} == attention.PREFILL_KERNELS
    assert {name: int(keys) for name, _, _, keys in prefill} == attention.PREFILL_KEYS
    assert attention.PREFILL_HEAD_DIMS == (64, 128, 256)
    scalar = re.findall(r"^DEFINE_PAGED_ATTENTION\((\w+), (\d+)\)$", source, re.M)
    assert {int(dpl): name for name, dpl in scalar} == attention.SCALAR_KERNELS


NVCC = shutil.which("nvcc")


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fast_kernels_build_without_spills(tmp_path, arch):
    cubin = tmp_path / "attention.cubin"
    result = subprocess.run([NVCC, "-std=c++17", f"-arch={arch}", f"-I{kernel_dir()}", "-cubin",
                             "-Xptxas", "-v", "-o", str(cubin), str(kernel_dir() / "attention.cu")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    report = {}  # kernel -> (registers, spill store bytes)
    for name, body in re.findall(r"Function properties for (\w+)\n(.*?)(?=ptxas info\s+: Function|\Z)",
                                 result.stderr, flags=re.S):
        spills = int(re.search(r"(\d+) bytes spill stores", body).group(1))
        registers = int(re.search(r"Used (\d+) registers", body).group(1))
        report[name] = (registers, spills)
    symbols = cubin.read_bytes()
    wanted = [*attention.DECODE_KERNELS.values(), *attention.DECODE_NORM_KERNELS.values(),
              *attention.PREFILL_KERNELS.values(), *attention.DECODE_MMA_KERNELS.values()]
    for kernel in wanted:
        assert kernel.encode() + b"\0" in symbols, f"{kernel} missing from the {arch} build"
        assert kernel in report, f"no ptxas report for {kernel}: {result.stderr[-2000:]}"
        registers, spills = report[kernel]
        assert spills == 0, f"{kernel} ({arch}) spills {spills} bytes with {registers} registers"


# ------------------------------------------------ attention_bench's pure parts on NumPy

def test_bench_references_match_the_numpy_ops():
    import numpy as np
    from cupy_llama.interface import ForwardBatch
    from conftest import script_module
    bench = script_module("attention_bench")
    from cupy_llama.backends.numpy_ops import NumpyOps
    from cupy_llama.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
    rng = np.random.default_rng(0)
    num_blocks, block_size, nkv, nh, d = 40, 16, 2, 6, 16
    k_bits = float32_to_bf16_bits(rng.standard_normal((num_blocks, block_size, nkv, d), dtype=np.float32))
    v_bits = float32_to_bf16_bits(rng.standard_normal((num_blocks, block_size, nkv, d), dtype=np.float32))
    k, v = bf16_bits_to_float32(k_bits), bf16_bits_to_float32(v_bits)
    tables = rng.permutation(num_blocks)[:3 * 5].reshape(3, 5).astype(np.int32)

    def reference(q, seq_lens, starts, table_rows):
        batch = ForwardBatch(token_ids=np.zeros(q.shape[0], np.int32), positions=np.zeros(q.shape[0], np.int32),
                             slot_mapping=np.zeros(q.shape[0], np.int32), query_start_loc=starts,
                             seq_lens=seq_lens, block_tables=table_rows,
                             max_query_len=int(np.diff(starts).max()), max_seq_len=int(seq_lens.max()))
        out = np.empty((q.shape[0], nh * d), np.float32)
        NumpyOps().attention(q, k, v, batch, d ** -0.5, out)
        return out

    q = rng.standard_normal((3, nh, d), dtype=np.float32)
    got = bench.decode_reference(np, q, bench.gather_dense(np, k_bits, tables, 70),
                                 bench.gather_dense(np, v_bits, tables, 70), d ** -0.5)
    expected = reference(q, np.full(3, 70, np.int32), np.arange(4, dtype=np.int32), tables)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)

    q = rng.standard_normal((30, nh, d), dtype=np.float32)  # the last 30 of 75 positions
    got = bench.prefill_reference(np, q, bench.gather_dense(np, k_bits, tables[:1], 75)[0],
                                  bench.gather_dense(np, v_bits, tables[:1], 75)[0], d ** -0.5)
    expected = reference(q, np.array([75], np.int32), np.array([0, 30], np.int32), tables[:1])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_bench_split_rules_and_table(capsys):
    from conftest import script_module
    bench = script_module("attention_bench")
    # the rule the scalar kernel shipped with (16 rows per CTA, 256 keys per split, 2 CTAs per SM)
    assert bench.old_decode_splits(1, 8, 4, 512, H200_SMS) == 2
    assert bench.old_decode_splits(1, 8, 4, 8192, H200_SMS) == 32
    assert bench.old_decode_splits(64, 8, 4, 2048, H200_SMS) == 1
    assert bench.new_decode_splits(1, 512, H200_SMS) == 8
    results = [
        dict(case="decode b=1 ctx=512", us={"old": 40.0, "new": 5.0, "old graph": 30.0, "new graph": 6.0},
             splits={"old": 2, "new": 8, "old graph": 32, "new graph": 32},
             max_diff_vs_old={"new": 0.004, "new graph": 0.004},
             max_err_vs_reference={"old": 0.003, "new": 0.002, "new graph": 0.002}),
        dict(case="prefill 1024", us={"old": 900.0, "new": 30.0}, splits={"old": 1, "new": 1},
             max_diff_vs_old={"new": 0.004}, max_err_vs_reference={}),
        dict(case="decode b=256 ctx=2048", error="CUDARuntimeError: out of memory"),
    ]
    bench.print_table(results)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 5
    assert "8.0x" in lines[2] and "5.0x" in lines[2] and "2/8/32/32" in lines[2]
    assert "30.0x" in lines[3]
    assert "FAILED" in lines[4]
