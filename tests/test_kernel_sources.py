"""Where each number the launchers share with a kernel comes from: the kernel source, read by
kernels.constants and kernels.instances, never a copy kept in step by hand. No GPU needed."""
import functools
import inspect
import re

import pytest

from cupy_llama import sampling as sampling_params
from cupy_llama.backends.cuda import attention, gemm, kernels, logprobs, sampling
from cupy_llama.backends.cuda.kernels import kernel_dir

# launcher constant -> (module, the define it is read from)
SHARED = {
    (attention, "ROWS_PER_CTA"): ("attention", "ROWS_PER_CTA"),
    (attention, "KEY_TILE"): ("attention", "KEY_TILE"),
    (attention, "K_TILE_PAD"): ("attention", "K_TILE_PAD"),
    (attention, "DECODE_CLUSTER"): ("attention", "DECODE_CLUSTER"),
    (attention, "PREFILL_THREADS"): ("attention", "PREFILL_THREADS"),
    (attention, "PREFILL_WARPS"): ("attention", "PREFILL_WARPS"),
    (attention, "PREFILL_ROW_PAD"): ("attention", "PREFILL_ROW_PAD"),
    (attention, "SPLIT_ALIGN"): ("attention", "SPLIT_ALIGN"),
    (attention, "MAX_SPLITS"): ("attention", "COMBINE_MAX_SPLITS"),
    (gemm, "GEMV_WARPS"): ("gemv", "GEMV_WARPS"),
    (gemm, "MMA_WARPS"): ("gemv", "SKINNY_WARPS"),
    (gemm, "MMA_WIDE_WARPS"): ("gemv", "SKINNY_WIDE_WARPS"),
    (gemm, "MMA_TILE_ROWS"): ("gemv", "SKINNY_TILE"),
    (gemm, "MMA_STEP"): ("gemv", "SKINNY_STEP"),
    (gemm, "MMA_X_PAD_CHUNKS"): ("gemv", "SKINNY_X_PAD"),
    (gemm, "MMA_PARTIAL_BYTES"): ("gemv", "SKINNY_PARTIAL_BYTES"),
    (gemm, "OUT_BF16"): ("gemv", "OUT_BF16"),
    (gemm, "OUT_F32"): ("gemv", "OUT_F32"),
    (gemm, "OUT_F32_ADD"): ("gemv", "OUT_F32_ADD"),
    (sampling, "THREADS"): ("sampling", "SAMPLE_THREADS"),
    (sampling, "CANDIDATE_CUT"): ("sampling", "CANDIDATE_CUT"),
    (sampling, "SLOT_BYTES"): ("sampling", "SLOT_BYTES"),
    (logprobs, "THREADS"): ("logprobs", "LOGPROB_THREADS"),
    (logprobs, "MAX_K"): ("logprobs", "LOGPROB_MAX_K"),
    (attention, "DECODE_MMA_THREADS"): ("attention", "DECODE_MMA_THREADS"),
    (attention, "DECODE_MMA_KEYS"): ("attention", "DECODE_MMA_KEYS"),
}


def test_the_api_asks_for_no_more_logprobs_than_the_kernel_gives():
    assert sampling_params.MAX_LOGPROBS == logprobs.MAX_K


def define(module: str, name: str) -> str:
    """The text of `#define name ...` in the module's .cu or common.cuh, read here on its own."""
    for file_name in (f"{module}.cu", "common.cuh"):
        match = re.search(rf"^#define {name} (.+?)\s*(?://.*)?$",
                          (kernel_dir() / file_name).read_text(), re.M)
        if match:
            return match[1]
    raise AssertionError(f"no #define {name} in {module}.cu")


@pytest.mark.parametrize("where, source", SHARED.items(), ids=lambda v: getattr(v, "__name__", v))
def test_each_shared_constant_is_read_from_its_kernel(where, source):
    launcher, attr = where
    module, name = source
    text = define(module, name)
    literal = re.fullmatch(r"(\d+(?:\.\d+)?)f?", text)
    if literal:  # a plain number: the launcher holds exactly it
        assert getattr(launcher, attr) == float(literal[1])
    assert getattr(launcher, attr) == kernels.constants(module)[name]
    # and the launcher's own text reads it rather than writing the number down
    assignment = re.search(rf"^(?:\w+, )*{attr}(?:, \w+)* = (.+)$", inspect.getsource(launcher), re.M)
    assert assignment and f'_C["{name}"]' in assignment[1], (attr, assignment and assignment[1])


def test_expressions_and_unreadable_defines(tmp_path, monkeypatch):
    folder = tmp_path / "cuda_src"
    folder.mkdir()
    (folder / "common.cuh").write_text("#define WARP_SIZE 32\n#define MASK 0xffffffffu\n")
    (folder / "m.cu").write_text('#include "common.cuh"\n#define TILE (2 * WARP_SIZE)  // a note\n'
                                 "#define HALF (TILE / 3)\n#define CUT 16.0f\n#define F(x) (x)\n"
                                 "#define DEFINE_K(NAME, D) void NAME()\n"
                                 "DEFINE_K(k_64, TILE)\nDEFINE_K(k_8, 8)\n")
    monkeypatch.setattr(kernels, "kernel_dir", lambda: folder)
    for cached in (kernels.constants, kernels.instances, kernels.kernel_names, kernels._lines):
        cached.cache_clear()
    try:
        c = kernels.constants("m")
        assert (c["TILE"], c["HALF"], c["CUT"], c["WARP_SIZE"]) == (64, 21, 16.0, 32)
        assert "F" not in c  # a function-like macro is no constant
        with pytest.raises(ValueError, match="MASK"):
            c["MASK"]
        with pytest.raises(KeyError, match="NOPE"):
            c["NOPE"]
        assert kernels.instances("m", "DEFINE_K") == (("k_64", 64), ("k_8", 8))
        assert kernels.kernel_names("m") == ("k_64", "k_8")
    finally:
        for cached in (kernels.constants, kernels.instances, kernels.kernel_names, kernels._lines):
            cached.cache_clear()


def test_kernel_families_come_from_the_define_lines():
    source = (kernel_dir() / "gemv.cu").read_text()
    skinny = re.findall(r"^DEFINE_SKINNY\((\w+), (\d), (PRO_\w+), (EPI_\w+), (\w+), \d, (W_\w+), "
                        r"(STAGE_\w+)\)$", source, re.M)
    assert len(skinny) == len(gemm.SKINNY_KERNELS) == 32
    for name, nt, pro, epi, warps, w, stage in skinny:
        key = (getattr(gemm, w), getattr(gemm, pro), getattr(gemm, epi),
               kernels.constants("gemv")[warps], int(nt), getattr(gemm, stage))
        assert gemm.SKINNY_KERNELS[key] == name
    # every bf16 kernel that stages alone has its FP8 twin; the normed bf16 ones, a variant
    # that shares the staging in a cluster
    alone = [key for key in gemm.SKINNY_KERNELS if key[5] == gemm.STAGE_ALONE]
    assert {key[1:] for key in alone if key[0] == gemm.W_BF16} == {
        key[1:] for key in alone if key[0] == gemm.W_FP8}
    assert {key[:5] for key in gemm.SKINNY_KERNELS if key[5] == gemm.STAGE_SHARED} == {
        key[:5] for key in alone if key[0] == gemm.W_BF16 and key[1] == gemm.PRO_NORM}
    # clusters where x is large: 8 rows of 2,048 or 16 of 1,024, not 8 of 1,152 or 4 of 2,048
    bf16_norm = functools.partial(gemm.staging_cluster, gemm.W_BF16, gemm.PRO_NORM)
    assert bf16_norm(8, 2048) == bf16_norm(16, 1024) == gemm.STAGING_CLUSTER > 1
    assert bf16_norm(8, 1152) == bf16_norm(4, 2048) == bf16_norm(1, 8192) == 1
    assert gemm.staging_cluster(gemm.W_FP8, gemm.PRO_NORM, 16, 2048) == 1
    assert gemm.staging_cluster(gemm.W_BF16, gemm.PRO_PLAIN, 16, 2048) == 1
    # the adding norm's kernels (PRO_ADD_NORM): one x tile, every epilogue, never clustered
    added = {key for key in alone if key[1] == gemm.PRO_ADD_NORM}
    assert {(key[2], key[4]) for key in added} == {
        (epi, 1) for epi in (gemm.EPI_STORE, gemm.EPI_GLU, gemm.EPI_ROPE)}
    assert gemm.staging_cluster(gemm.W_BF16, gemm.PRO_ADD_NORM, 8, 2048) == 1
    simt = re.findall(r"^DEFINE_GEMV\((\w+), (\d+), (\d+), \d+\)$", source, re.M)
    assert {int(m): (name, int(rows)) for name, m, rows in simt} == gemm.GEMV_VARIANTS
    assert gemm.SKINNY_MAX_ROWS == 16


def test_wide_blocks_for_rows_past_one_group_of_k_steps(monkeypatch):
    """Plain products of few tiles take the 16-warp block once an 8-warp block's one group
    of k steps (2,048 of bf16 rows, 4,096 of FP8 ones) does not hold their rows: Qwen3-0.6B's
    down (3,072) and every longer one, not the o_proj products of 1,024 to 2,048; never
    past the SMs' count of tiles, nor for the fused products."""
    monkeypatch.setattr(gemm, "device_limits", lambda: {"sms": 132})
    plain = (gemm.W_BF16, gemm.PRO_PLAIN, gemm.EPI_STORE)
    assert gemm._skinny_warps(*plain, 1024, 3072) == gemm.MMA_WIDE_WARPS
    assert gemm._skinny_warps(*plain, 2048, 8192) == gemm.MMA_WIDE_WARPS
    assert gemm._skinny_warps(*plain, 1024, 2048) == gemm.MMA_WARPS
    assert gemm._skinny_warps(*plain, 1536, 1536) == gemm.MMA_WARPS
    assert gemm._skinny_warps(*plain, 4096, 3072) == gemm.MMA_WARPS  # 256 tiles
    assert gemm._skinny_warps(gemm.W_BF16, gemm.PRO_NORM, gemm.EPI_GLU, 1024, 3072) == \
        gemm.MMA_WARPS
    fp8 = (gemm.W_FP8, gemm.PRO_PLAIN, gemm.EPI_STORE)
    assert gemm._skinny_warps(*fp8, 1024, 3072) == gemm.MMA_WARPS
    assert gemm._skinny_warps(*fp8, 1024, 4096) == gemm.MMA_WIDE_WARPS
