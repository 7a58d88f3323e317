"""out = x @ weight.T: cuBLAS (bf16 in, fp32 compute, bf16 or fp32 out) or, for the skinny
products of decode (at most 16 rows), one of the kernels of gemv.cu:
  - "mma": the tensor-core streaming kernels (skinny_*), built to read the weights at HBM
    speed for every weight shape; their fused variants also take the RMSNorm before a
    product and the gated activation, the q/k/v biases with RoPE and KV-cache write, or
    the residual add after it (norm_linear, norm_gate_up_act, norm_qkv_rope,
    linear(accumulate=True)), and they
    launch programmatically (launch.py) so each starts streaming its weights while the
    kernel before it drains; the normed ones of bf16 weights from STAGING_CLUSTER_MIN_X
    elements of x launch as thread-block clusters whose blocks share the staging of x
    (gemv.cu, stage_x);
  - "gemv": the SIMT kernels (gemv_m*), which a measured choice table picks where they are
    fastest (the vocabulary-sized LM head at 1 and 2 rows on the H200).

cuBLAS is called through ctypes on a handle of this module's own: CuPy's binding refuses
every cuBLAS call while a stream is being captured into a CUDA graph (it checks in
setStream). The handle gets a fixed workspace, set again after each stream change (cuBLAS
resets it there), so captured products never allocate. Where the library cannot be found
through ctypes, eager products fall back to CuPy's binding and graphs stay off.

Who serves a skinny product is the backend's `Products`, made once from its switches
(switches.py, CUPY_LLAMA_SKINNY_GEMM):
  - "auto" (default): per weight shape and row count, the kernel a measured choice table
    for this GPU names (gemm_choice_*.json beside this file, written by
    `python3 scripts/perf.py MODEL_DIR --tune`); for a GPU without a table, "mma" up to
    FALLBACK_MMA_MAX_ROWS rows and cuBLAS above;
  - "mma" or "cublas": that kernel wherever it applies.
Under "auto" the fused products and accumulating products of at most 16 rows take the
skinny kernels (the table times plain products; norm_linear, where only a norm is at
stake, follows it); under "cublas" they are composed of cuBLAS and the separate small
kernels. A custom kernel that cannot take a product (alignment, K, shared memory) hands
it to cuBLAS. CUDA graphs bake in what a Products chose when they were captured, so a
backend's Products never changes (docs/ARCHITECTURE.md, "Kernels").

FP8 weights (interface.Fp8Weight: e4m3 codes and a float32 scale per row) take the skinny
kernels' FP8 variants up to 16 rows, which convert the codes to bf16 in registers and
scale the sums in the epilogue, whatever the skinny switch says. Above, the fp8_gemm
switch chooses: "cublaslt" quantizes x per row into a scratch the backend owns, runs
cuBLASLt's FP8 product into a float32 scratch (cublaslt.py) and scales it into out
(fp8.cu), where cuBLASLt can take the shape; otherwise, and under "dequantize", the weight
is dequantized to bf16 (fp8.cu) into another scratch and the product runs on cuBLAS
(docs/ARCHITECTURE.md, "FP8 weights")."""
from __future__ import annotations

import ctypes
import json
import re
from pathlib import Path

import numpy as np

from ...interface import AddedNorm, Fp8Weight
from ...util import cdiv
from . import launch
from .device import device_limits
from .elementwise import ACTS, check_rope_operands
from .cublaslt import fp8_lt
from .fp8 import dequantize, quantize_rows, scale_product
from .kernels import (BF16, F32, U8, aligned16, check, constants, get_kernel, i32, instances,
                      opt_in_shared)
from .switches import FP8_CHOICES, SKINNY_CHOICES

CUDA_R_32F = 0
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUBLAS_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20  # cuBLAS's recommendation for Hopper

# The kernels' sizes and the list of kernels come from gemv.cu (kernels.py)
_C = constants("gemv")
# SIMT kernels: rows -> (kernel, weight rows per warp), from the DEFINE_GEMV lines
GEMV_VARIANTS = {m: (name, rows) for name, m, rows, _ in instances("gemv", "DEFINE_GEMV")}
GEMV_WARPS = _C["GEMV_WARPS"]
# tensor-core kernels: (weight format, prologue, epilogue, warps, 8-column x tiles,
# staging) -> kernel, from the DEFINE_SKINNY lines
SKINNY_KERNELS = {(w, pro, epi, warps, nt, stage): name
                  for name, nt, pro, epi, warps, _, w, stage in instances("gemv", "DEFINE_SKINNY")}
W_BF16, W_FP8 = _C["W_BF16"], _C["W_FP8"]
PRO_PLAIN, PRO_NORM, PRO_ADD_NORM = _C["PRO_PLAIN"], _C["PRO_NORM"], _C["PRO_ADD_NORM"]
EPI_STORE, EPI_GLU, EPI_ROPE = _C["EPI_STORE"], _C["EPI_GLU"], _C["EPI_ROPE"]
OUT_BF16, OUT_F32, OUT_F32_ADD = _C["OUT_BF16"], _C["OUT_F32"], _C["OUT_F32_ADD"]
STAGE_ALONE, STAGE_SHARED = _C["STAGE_ALONE"], _C["STAGE_SHARED"]
MMA_WARPS = _C["SKINNY_WARPS"]
MMA_WIDE_WARPS = _C["SKINNY_WIDE_WARPS"]  # plain products of long rows in few tiles
MMA_TILE_ROWS = _C["SKINNY_TILE"]         # weight rows per tile
MMA_STEP = _C["SKINNY_STEP"]              # k per step; x rows are staged zero-padded to it
MMA_X_PAD_CHUNKS = _C["SKINNY_X_PAD"]     # 16-byte chunks after each staged x row
MMA_PARTIAL_BYTES = _C["SKINNY_PARTIAL_BYTES"]  # per warp and x tile
SKINNY_MAX_ROWS = 8 * max(key[4] for key in SKINNY_KERNELS)
assert SKINNY_MAX_ROWS == max(GEMV_VARIANTS), "gemv.cu: the SIMT and mma kernels' row limits differ"
# the launcher's own choices
# Plain products of bf16 rows longer than one group of an 8-warp block's k steps (2,048)
# may take the wide variant, which loads a tile of up to 4,096 in one group before
# waiting for the kernel before: Qwen3-0.6B's down (K = 3,072, 64 tiles) took 3.5 against
# 4.2 us at 1 row (benchmarks/NOTES.md, change 47); 4,096 before. FP8 blocks keep twice
# the steps in flight, so an 8-warp group holds 4,096 of their rows: they keep 4,096 (not
# measured again).
WIDE_MIN_K = {W_BF16: MMA_WARPS * _C["SKINNY_UNROLL"] * MMA_STEP + 1, W_FP8: 4096}
FALLBACK_MMA_MAX_ROWS = 4
KERNELS = ("cublas", "gemv", "mma")
CHOICE_DIR = Path(__file__).resolve().parent

# alpha and beta live in host memory for the whole process (pointer mode host)
_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)
_cublas = None  # _CublasLibrary once loaded; False when ctypes could not load it


def check_product(x, weight, out, accumulate: bool = False):
    """x [M, K] bf16, weight [N, K] bf16 (or an Fp8Weight), out [M, N] bf16 or float32
    (float32 when accumulating); returns (M, N)."""
    m_rows, k = check("x", x, BF16, ndim=2).shape
    n_cols = check_weight(weight, k).shape[0]
    _check_out(out, m_rows, n_cols, accumulate)
    return m_rows, n_cols


def check_weight(weight, k: int | None = None, rows: int | None = None):
    """A product's weight [rows, k]: bf16, or an Fp8Weight (uint8 codes, float32 scales
    [rows]); returns the matrix (the codes of an Fp8Weight)."""
    if isinstance(weight, Fp8Weight):
        matrix = check("weight codes", weight.data, U8, shape=(rows, k))
        check("weight scale", weight.scale, F32, shape=(matrix.shape[0],))
        return matrix
    return check("weight", weight, BF16, shape=(rows, k))


def weight_format(weight) -> int:
    """W_FP8 for an Fp8Weight, else W_BF16."""
    return W_FP8 if isinstance(weight, Fp8Weight) else W_BF16


def _matrix(weight):
    """The [N, K] matrix a kernel streams: the weight, or an Fp8Weight's codes."""
    return weight.data if isinstance(weight, Fp8Weight) else weight


def _check_out(out, m_rows: int, n_cols: int, accumulate: bool = False) -> None:
    """out [m_rows, n_cols], bf16 or float32 (float32 when accumulating)."""
    if out.dtype not in (BF16, F32) or (accumulate and out.dtype != F32):
        allowed = "float32" if accumulate else "uint16 (bf16) or float32"
        raise ValueError(f"out: expected dtype {allowed}, got {out.dtype.name}")
    check("out", out, out.dtype, shape=(m_rows, n_cols))


# ------------------------------------------------------------------- choosing a kernel

def choose(switch: str, n: int, k: int, m: int, table: dict, accumulate: bool = False) -> str:
    """The kernel for an [m, k] x [n, k]^T product: the switch's, or for "auto" the table's
    entry, else "mma" up to FALLBACK_MMA_MAX_ROWS rows; cuBLAS past SKINNY_MAX_ROWS. An
    accumulating product takes "mma" under "auto" (the table times plain products; the
    fused residual add is what the skinny kernel adds), and never the SIMT gemv kernel,
    which cannot add to its output."""
    if m > SKINNY_MAX_ROWS or switch == "cublas":
        return "cublas"
    if switch == "mma" or accumulate:
        return "mma"
    entry = table.get((n, k), {}).get(m)
    if entry is not None:
        return entry
    return "mma" if m <= FALLBACK_MMA_MAX_ROWS else "cublas"


def parse_choice_table(data: dict, source: str = "choice table") -> dict:
    """{"choices": {"NxK": {"M": kernel}}} -> {(n, k): {m: kernel}}; ValueError naming the
    bad entry."""
    table = {}
    for shape, per_rows in data.get("choices", {}).items():
        match = re.fullmatch(r"(\d+)x(\d+)", shape)
        if match is None or not isinstance(per_rows, dict):
            raise ValueError(f"{source}: shape keys must look like '3072x2048' with a "
                             f"{{rows: kernel}} object, got {shape!r}")
        rows = table.setdefault((int(match[1]), int(match[2])), {})
        for m, kernel in per_rows.items():
            if not str(m).isdigit() or kernel not in KERNELS:
                raise ValueError(f"{source}: {shape} row count {m!r} -> {kernel!r}: row counts "
                                 f"must be integers and kernels one of {KERNELS}")
            rows[int(m)] = kernel
    return table


def load_choice_table(gpu_name: str, directory: Path = CHOICE_DIR) -> dict:
    """The table of the first gemm_choice_*.json in `directory` whose "gpu" is gpu_name, or
    {} when none is."""
    for path in sorted(directory.glob("gemm_choice_*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("gpu") == gpu_name:
            return parse_choice_table(data, str(path))
    return {}


def device_name() -> str:
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


class Products:
    """The matrix products of one backend: which kernel serves each shape (the skinny
    switch, and under "auto" the choice table), and whether the skinny kernels launch
    programmatically. Made once per backend; a choice is worked out once per shape."""

    def __init__(self, skinny: str = "auto", programmatic: bool = False,
                 table: dict | None = None, clusters: bool = True, dequantized=None,
                 fp8_activations=None, fp8_gemm: str = "cublaslt"):
        """table: {(n, k): {m: kernel}} for "auto"; None: this GPU's choice file.
        For FP8 weights past SKINNY_MAX_ROWS rows: dequantized, flat bf16 device scratch
        that holds the largest weight as bf16; fp8_activations, (codes, scales, sums)
        scratch for x quantized per row and the product's float32 sums (flat uint8 of the
        most rows times the longest K, float32 of the most rows, float32 of the most rows
        times the widest N), or None; fp8_gemm, the switch (switches.py)."""
        if skinny not in SKINNY_CHOICES:
            raise ValueError(f"skinny must be one of {SKINNY_CHOICES}, got {skinny!r}")
        if fp8_gemm not in FP8_CHOICES:
            raise ValueError(f"fp8_gemm must be one of {FP8_CHOICES}, got {fp8_gemm!r}")
        self.skinny = skinny
        self.programmatic = bool(programmatic) and launch.launch_attributes_usable()
        self.clusters = bool(clusters) and launch.launch_attributes_usable()
        self._table = table
        self._chosen = {}  # (n, k, m, accumulate) -> kernel
        self.dequantized = dequantized
        self.fp8_activations, self.fp8_gemm = fp8_activations, fp8_gemm
        self._fp8_paths = {}  # (m, n, k) -> path

    @property
    def fusing(self) -> bool:
        """Whether the fused skinny kernels may run ("cublas" names one kernel for every
        product, so the sublayer ops are composed around it)."""
        return self.skinny != "cublas"

    def fuses_norm(self, m_rows: int, k: int, weight) -> bool:
        """Whether a normed sublayer product (norm_qkv_rope, norm_gate_up_act) of m_rows x
        rows of length k takes its fused skinny kernel: never under "cublas"; under "auto",
        for bf16 weights, while x holds at most FUSED_NORM_MAX_X elements (past that the
        norm, cuBLAS and the RoPE or activation kernel take it)."""
        if not self.fusing:
            return False
        return (self.skinny != "auto" or isinstance(weight, Fp8Weight)
                or m_rows * k <= FUSED_NORM_MAX_X)

    def kernel_for(self, n: int, k: int, m: int, accumulate: bool = False,
                   fp8: bool = False) -> str:
        """The kernel for an [m, k] x [n, k]^T product (accumulate: added to a float32 out;
        fp8: of FP8 weights, which only the skinny kernels read as they are)."""
        if m > SKINNY_MAX_ROWS:
            return "cublas"
        if fp8:
            return "mma"
        key = (n, k, m, accumulate)
        kernel = self._chosen.get(key)
        if kernel is None:
            if self.skinny == "auto" and self._table is None:
                self._table = load_choice_table(device_name())
            table = self._table if self.skinny == "auto" else {}
            kernel = self._chosen[key] = choose(self.skinny, n, k, m, table, accumulate)
        return kernel

    def fp8_path(self, m: int, n: int, k: int) -> str:
        """How an [m, k] x [n, k]^T product of FP8 weights past SKINNY_MAX_ROWS rows runs:
        "cublaslt" where the switch asks, the scratch holds it and cuBLASLt has an FP8
        algorithm for the shape, else "dequantize"."""
        key = (m, n, k)
        path = self._fp8_paths.get(key)
        if path is None:
            path = "dequantize"
            scratch = self.fp8_activations
            lt = fp8_lt() if self.fp8_gemm == "cublaslt" and scratch is not None else None
            if (lt is not None and m * k <= scratch[0].size and m <= scratch[1].size
                    and m * n <= scratch[2].size and k % 16 == 0 and n % 16 == 0):
                try:
                    lt.shape(m, n, k)
                    path = "cublaslt"
                except RuntimeError:
                    pass  # no FP8 algorithm for this shape: the dequantized weight
            self._fp8_paths[key] = path
        return path

    def _fp8_lt_linear(self, x, weight, out, accumulate: bool) -> None:
        """x quantized per row into the scratch, cuBLASLt's FP8 product of the codes, then
        both rows' scales on its sums."""
        import cupy
        m_rows, k = x.shape
        n = weight.data.shape[0]
        codes_scratch, scales_scratch, sums_scratch = self.fp8_activations
        codes = codes_scratch[:m_rows * k].reshape(m_rows, k)
        scales = scales_scratch[:m_rows]
        sums = sums_scratch[:m_rows * n].reshape(m_rows, n)
        quantize_rows(x, codes, scales)
        fp8_lt().matmul(codes, weight.data, sums, cupy.cuda.get_current_stream().ptr)
        scale_product(sums, scales, weight.scale, out, accumulate)

    def bf16_weight(self, weight):
        """A product's weight as a bf16 [N, K] matrix cuBLAS reads: the weight itself, or
        an Fp8Weight dequantized into the scratch (valid until the next call)."""
        if not isinstance(weight, Fp8Weight):
            return weight
        n, k = weight.data.shape
        if self.dequantized is None or self.dequantized.size < n * k:
            raise ValueError(f"an FP8 weight of {n} x {k} past {SKINNY_MAX_ROWS} rows needs a "
                             f"dequantization scratch of {n * k} bf16 elements")
        out = self.dequantized[:n * k].reshape(n, k)
        dequantize(weight, out)
        return out

    def linear(self, x, weight, out, accumulate: bool = False):
        """x [M, K] bf16, weight [N, K] bf16, out [M, N] bf16 or float32, all row-major.
        accumulate: out (float32) += x @ weight.T (the residual stream takes a sublayer's
        output this way, with no rounding to bf16 in between)."""
        m_rows, n_cols = check_product(x, weight, out, accumulate)
        k = x.shape[1]
        if m_rows == 0 or n_cols == 0:
            return
        fp8 = isinstance(weight, Fp8Weight)
        kernel = self.kernel_for(n_cols, k, m_rows, accumulate, fp8)
        if kernel == "mma" and mma_unsupported(x, weight) is None:
            _launch_mma(x, weight, out, accumulate, self.programmatic)
        elif kernel == "gemv" and gemv_supported(x, weight):
            _launch_gemv(x, weight, out)
        elif fp8 and self.fp8_path(m_rows, n_cols, k) == "cublaslt":
            self._fp8_lt_linear(x, weight, out, accumulate)
        else:
            cublas_linear(x, self.bf16_weight(weight), out, accumulate)

    def norm_linear(self, x, norm_weight, eps, weight, out, offset: float = 0.0,
                    added: AddedNorm | None = None) -> bool:
        """out = rms_norm(x) @ weight.T in one kernel: x [M, K] float32, norm_weight [K]
        (scaling by offset + weight), weight [N, K], out [M, N] bf16 or float32; with added
        (interface.AddedNorm), of added.out = x + rms_norm(added.h), which the kernel
        writes too. False (nothing launched) where the fused kernel cannot take it (with
        added: where it cannot take the add, fuses_added), or where the switch (or under
        "auto" the choice table) names another kernel for the product: the caller then
        composes the ops."""
        if x.shape[0] > SKINNY_MAX_ROWS:
            return False  # a prefill step: composed, without checking twice
        m_rows, k = _check_norm_product(x, norm_weight, weight, added)
        n = weight.shape[0]
        _check_out(out, m_rows, n)
        if self.kernel_for(n, k, m_rows, fp8=isinstance(weight, Fp8Weight)) != "mma":
            return False  # only the norm is at stake: the faster product wins
        if fused_unsupported(x, weight, norm_weight, added) is not None:
            return False
        args = _norm_args(x, norm_weight, eps, weight, out, offset)
        args.out_mode = OUT_F32 if out.dtype == F32 else OUT_BF16
        if m_rows:
            _launch_skinny(weight_format(weight), _prologue(added), EPI_STORE, m_rows, n, k,
                           args, self.programmatic, self.clusters, _added_rows(added))
        return True

    def norm_gate_up_act(self, x, norm_weight, eps, weight, out, offset: float = 0.0,
                         act: str = "silu", added: AddedNorm | None = None) -> bool:
        """out = act(gate) * up of rms_norm(x) @ weight.T (weight: I gate rows, then I up
        rows) in one kernel; out [M, I] bf16. added, and False, as in norm_linear."""
        if x.shape[0] > SKINNY_MAX_ROWS:
            return False  # a prefill step: composed, without checking twice
        m_rows, k = _check_norm_product(x, norm_weight, weight, added)
        n = weight.shape[0]
        check("out", out, BF16, shape=(m_rows, n // 2))
        if (not self.fuses_norm(m_rows, k, weight) or n % MMA_TILE_ROWS
                or fused_unsupported(x, weight, norm_weight, added) is not None):
            return False
        args = _norm_args(x, norm_weight, eps, weight, out, offset)
        args.act = ACTS[act]
        if m_rows:
            _launch_skinny(weight_format(weight), _prologue(added), EPI_GLU, m_rows, n, k, args,
                           self.programmatic, self.clusters, _added_rows(added))
        return True

    def norm_qkv_rope(self, x, norm_weight, eps, weight, positions, slot_mapping, cos_sin,
                      k_cache, v_cache, q_out, offset: float = 0.0, bias=None,
                      added: AddedNorm | None = None) -> bool:
        """rms_norm(x) @ weight.T (+ bias [N] bf16), then what rope_and_cache does with it
        (elementwise.py), in one kernel: q_out [M, nh, d] bf16, caches [num_blocks,
        block_size, nkv, d]. added, and False, as in norm_linear (also where d / 2 is no
        multiple of 8)."""
        if x.shape[0] > SKINNY_MAX_ROWS:
            return False  # a prefill step: composed, without checking twice
        m_rows, k = _check_norm_product(x, norm_weight, weight, added)
        _, num_heads, num_kv_heads, head_dim = check_rope_operands(
            q_out, k_cache, v_cache, positions, slot_mapping, cos_sin, num_tokens=m_rows)
        check_weight(weight, k, rows=(num_heads + 2 * num_kv_heads) * head_dim)
        if bias is not None:
            check("bias", bias, BF16, shape=(weight.shape[0],))
        if (not self.fuses_norm(m_rows, k, weight) or head_dim % 16
                or fused_unsupported(x, weight, norm_weight, added) is not None):
            return False
        args = _norm_args(x, norm_weight, eps, weight, q_out, offset)
        args.bias = None if bias is None else bias.data.ptr
        args.positions, args.slot_mapping = positions.data.ptr, slot_mapping.data.ptr
        args.cos_sin, args.k_cache, args.v_cache = cos_sin.data.ptr, k_cache.data.ptr, v_cache.data.ptr
        args.num_heads, args.num_kv_heads, args.head_dim = num_heads, num_kv_heads, head_dim
        if m_rows:
            _launch_skinny(weight_format(weight), _prologue(added), EPI_ROPE, m_rows,
                           weight.shape[0], k, args, self.programmatic, self.clusters,
                           _added_rows(added))
        return True


# ------------------------------------------------------------------ SIMT skinny kernels

def gemv_supported(x, weight) -> bool:
    """The SIMT kernels need at most SKINNY_MAX_ROWS rows, K % 8 == 0 and 16-byte aligned
    rows."""
    m_rows, k = x.shape
    return (not isinstance(weight, Fp8Weight) and m_rows <= SKINNY_MAX_ROWS and k % 8 == 0
            and aligned16(x, weight))


def gemv(x, weight, out):
    """The SIMT kernel whatever the table says (tests, timing); same shapes as linear."""
    m_rows, n_cols = check_product(x, weight, out)
    if not gemv_supported(x, weight):
        raise ValueError(f"gemv: needs at most {SKINNY_MAX_ROWS} rows, K a multiple of 8 and "
                         f"16-byte aligned x and weight (got x {x.shape}, weight {weight.shape})")
    if m_rows and n_cols:
        _launch_gemv(x, weight, out)


def _launch_gemv(x, weight, out):
    m_rows, k = x.shape
    n_cols = weight.shape[0]
    name, rows_per_warp = GEMV_VARIANTS[min(v for v in GEMV_VARIANTS if v >= m_rows)]
    get_kernel("gemv", name)(
        (cdiv(n_cols, GEMV_WARPS * rows_per_warp),), (GEMV_WARPS * 32,),
        (x, weight, out, i32(m_rows), i32(n_cols), i32(k), i32(out.dtype == F32)))


# ------------------------------------------------------------ tensor-core skinny kernels

class SkinnyArgs(ctypes.Structure):
    """The one by-value parameter of every skinny_* kernel (gemv.cu struct SkinnyArgs)."""
    _fields_ = [("x", ctypes.c_void_p), ("norm_weight", ctypes.c_void_p),
                ("w", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("positions", ctypes.c_void_p), ("slot_mapping", ctypes.c_void_p),
                ("cos_sin", ctypes.c_void_p), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("w_scale", ctypes.c_void_p),
                ("m_rows", ctypes.c_int), ("n", ctypes.c_int), ("k", ctypes.c_int),
                ("out_mode", ctypes.c_int), ("num_heads", ctypes.c_int),
                ("num_kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int),
                ("eps", ctypes.c_float), ("norm_offset", ctypes.c_float),
                ("act", ctypes.c_int)]


class AddedRows(ctypes.Structure):
    """Every skinny kernel's second by-value parameter (gemv.cu struct AddedRows): the
    adding norm's operands for PRO_ADD_NORM, null otherwise."""
    _fields_ = [("h", ctypes.c_void_p), ("weight", ctypes.c_void_p), ("out", ctypes.c_void_p)]


def mma_shared_bytes(m_rows: int, k: int, warps: int = MMA_WARPS) -> int:
    """Dynamic shared memory of a skinny kernel for m_rows x rows of length k: the staged x
    rows (zero-padded to a multiple of MMA_STEP, plus MMA_X_PAD_CHUNKS) and the warp
    partials."""
    x_tiles = cdiv(m_rows, 8)
    x_stride_bytes = (cdiv(k, MMA_STEP) * MMA_STEP // 8 + MMA_X_PAD_CHUNKS) * 16
    return m_rows * x_stride_bytes + x_tiles * warps * MMA_PARTIAL_BYTES


def skinny_kernel(w: int, pro: int, epi: int, warps: int, m_rows: int,
                  stage: int = STAGE_ALONE):
    """The skinny kernel of a weight format, prologue, epilogue and block size for m_rows x
    rows, staging x alone or shared in a cluster."""
    return get_kernel("gemv", SKINNY_KERNELS[w, pro, epi, warps, cdiv(m_rows, 8), stage])


def mma_unsupported(x, weight, pro: int = PRO_PLAIN, epi: int = EPI_STORE) -> str | None:
    """Why the skinny kernels of that prologue and epilogue cannot take this product, or
    None when they can."""
    m_rows, k = x.shape
    warps = _skinny_warps(weight_format(weight), pro, epi, weight.shape[0], k)
    if m_rows > SKINNY_MAX_ROWS:
        return f"at most {SKINNY_MAX_ROWS} rows (got {m_rows})"
    if k % 8:
        return f"K a multiple of 8 (got {k})"
    if x.data.ptr % 16 or _matrix(weight).data.ptr % 16:
        return "16-byte aligned x and weight"
    if not launch.available():
        return "the CUDA driver's cuLaunchKernelEx"
    variant = (weight_format(weight), pro, epi, warps, cdiv(max(1, m_rows), 8))
    static = max(get_kernel("gemv", name).shared_size_bytes  # staging alone or shared
                 for key, name in SKINNY_KERNELS.items() if key[:5] == variant)
    limit = device_limits()["max_shared_per_block"] - static
    if mma_shared_bytes(m_rows, k, warps) > limit:
        return (f"x of {m_rows} x {k} in {limit} bytes of shared memory "
                f"(needs {mma_shared_bytes(m_rows, k, warps)})")
    return None


def mma(x, weight, out, programmatic: bool = False):
    """The tensor-core skinny kernel whatever the table says (tests, timing); same shapes
    as linear. ValueError where it cannot take the product (linear uses cuBLAS there)."""
    m_rows, n_cols = check_product(x, weight, out)
    reason = mma_unsupported(x, weight)
    if reason is not None:
        raise ValueError(f"skinny mma: needs {reason}; use linear(), which falls back to cuBLAS")
    if m_rows and n_cols:
        _launch_mma(x, weight, out, False, programmatic and launch.launch_attributes_usable())


def _launch_mma(x, weight, out, accumulate: bool, programmatic: bool):
    mode = OUT_F32_ADD if accumulate else OUT_F32 if out.dtype == F32 else OUT_BF16
    args = SkinnyArgs(x=x.data.ptr, w=_matrix(weight).data.ptr, out=out.data.ptr,
                      out_mode=mode, w_scale=_scale_pointer(weight))
    _launch_skinny(weight_format(weight), PRO_PLAIN, EPI_STORE, x.shape[0], weight.shape[0],
                   x.shape[1], args, programmatic)


def _scale_pointer(weight):
    return weight.scale.data.ptr if isinstance(weight, Fp8Weight) else None


# fused variants (gemv.cu): the x rows are the float32 residual stream, normalized by the
# kernel on the way into shared memory (after adding the sublayer before, PRO_ADD_NORM);
# the epilogue stores, applies SiLU-and-mul, or RoPE and the KV-cache write

def fused_unsupported(x, weight, norm_weight, added: AddedNorm | None = None) -> str | None:
    """Why the fused skinny kernels cannot take rms_norm(x) @ weight.T (with added: and the
    add before it; the callers have checked the operands: _check_norm_product), or None."""
    if added is not None:  # first: PRO_ADD_NORM has kernels for fuses_added's rows only
        if not fuses_added(*x.shape):
            return f"{x.shape[0]} x rows of {x.shape[1]} held in one batch of loads (fuses_added)"
        if not aligned16(added.h, added.weight, added.out):
            return "16-byte aligned added operands"
    reason = mma_unsupported(x, weight, _prologue(added))
    if reason is None and norm_weight.data.ptr % 16:
        reason = "16-byte aligned norm weights"
    return reason


def fuses_added(m_rows: int, k: int) -> bool:
    """Whether a normed skinny kernel can add the sublayer before (PRO_ADD_NORM) to m_rows x
    rows of length k: where the warps of an MMA_WARPS block hold each row in one batch
    of loads (gemv.cu, stage_x): rows of up to 4,096 at 1 row, 2,048 at 2 (Gemma-3-1B's
    1,152 at 1 and 2 rows), 1,024 at 3 and 4, 512 at 5 to 8; never in a cluster."""
    if m_rows < 1 or m_rows > MMA_WARPS:
        return m_rows == 0
    row_warps = max(1, MMA_WARPS // m_rows)
    return (m_rows <= MMA_WARPS // row_warps
            and k // 4 <= _C["NORM_ONCE_BATCH"] * row_warps * 32)


def _prologue(added: AddedNorm | None) -> int:
    return PRO_NORM if added is None else PRO_ADD_NORM


def _norm_args(x, norm_weight, eps, weight, out, offset: float = 0.0) -> SkinnyArgs:
    return SkinnyArgs(x=x.data.ptr, norm_weight=norm_weight.data.ptr, w=_matrix(weight).data.ptr,
                      out=out.data.ptr, eps=float(eps), norm_offset=float(offset),
                      w_scale=_scale_pointer(weight))


def _added_rows(added: AddedNorm | None) -> AddedRows | None:
    if added is None:
        return None
    return AddedRows(h=added.h.data.ptr, weight=added.weight.data.ptr, out=added.out.data.ptr)


def _check_norm_product(x, norm_weight, weight, added: AddedNorm | None = None):
    m_rows, k = check("x", x, F32, ndim=2).shape
    check("norm_weight", norm_weight, BF16, shape=(k,))
    check_weight(weight, k)
    if added is not None:
        check("added.h", added.h, BF16, shape=(m_rows, k))
        check("added.weight", added.weight, BF16, shape=(k,))
        check("added.out", added.out, F32, shape=(m_rows, k))
        if _overlap(added.out, x) or _overlap(added.out, added.h):
            raise ValueError("added.out: must be a buffer of its own (the kernel reads x "
                             "in every block while one block writes added.out)")
    return m_rows, k


def _overlap(a, b) -> bool:
    return a.data.ptr < b.data.ptr + b.nbytes and b.data.ptr < a.data.ptr + a.nbytes


_NO_ADDED_ROWS = AddedRows()


def _launch_skinny(w: int, pro: int, epi: int, m_rows: int, n: int, k: int, args: SkinnyArgs,
                   programmatic: bool, clusters: bool = False,
                   added: AddedRows | None = None) -> None:
    import cupy
    cluster = staging_cluster(w, pro, m_rows, k) if clusters else 1
    kernel, grid, warps, shared = _mma_launch_shape(w, pro, epi, n, k, m_rows, cluster)
    args.m_rows, args.n, args.k = m_rows, n, k
    launch.launch(kernel, grid, warps * 32, shared, cupy.cuda.get_current_stream().ptr,
                  [args, _NO_ADDED_ROWS if added is None else added], programmatic,
                  cluster if grid % cluster == 0 else 1)


# Blocks of a normed skinny product of bf16 weights that share the staging of x (gemv.cu,
# stage_x): clusters of STAGING_CLUSTER where x holds at least STAGING_CLUSTER_MIN_X
# elements (64 KB of float32 read per pass). Measured on the H200 (benchmarks/NOTES.md,
# change 40), graph-timed per call: from there on the normed products take less in
# clusters of 2 (Llama-3.2-1B's qkv and gate/up at 8 and 16 rows of 2,048, Qwen3-0.6B's
# and Gemma-3-1B's gate/up at 16 rows of 1,024 and 1,152), below it more (Llama at 4
# rows, Qwen3 and Gemma at 8); in clusters of 4 the gate/up product takes longer (its
# clusters do not all fit at once); plain products, whose bf16 x is half the bytes and
# read once, took longer in clusters. The clustered kernels are variants of their own
# (STAGE_SHARED): the cluster code would lengthen every other kernel's start, which
# batch 1 feels.
STAGING_CLUSTER = 2
STAGING_CLUSTER_MIN_X = 16384
# Under "auto", the normed sublayer products fuse while x holds at most this many
# elements: past it (Llama-3.2-1B's 14 to 16 rows of 2,048) the decode step replayed from
# its graph took about 2% less with them composed of the norm, cuBLAS and the RoPE or
# activation kernel, whose cuBLAS products read x from L2 once per tile where every
# skinny block stages all of it (benchmarks/NOTES.md, change 44). Qwen3-0.6B's,
# Qwen2.5-1.5B's and Gemma-3-1B's 16 rows stay under it.
FUSED_NORM_MAX_X = 13 * 2048
assert STAGING_CLUSTER <= _C["SKINNY_MAX_CLUSTER"]


def staging_cluster(w: int, pro: int, m_rows: int, k: int) -> int:
    """The cluster size of a skinny product (weight format, prologue, x rows and their
    length) where clusters launch: 1 where no STAGE_SHARED kernel takes it."""
    shared = (pro == PRO_NORM and m_rows * k >= STAGING_CLUSTER_MIN_X
              and any(key[:2] == (w, pro) and key[5] == STAGE_SHARED for key in SKINNY_KERNELS))
    return STAGING_CLUSTER if shared else 1


_mma_shapes = {}  # (w, pro, epi, n, k, m, cluster) -> (kernel, grid, warps, shared bytes)


def _mma_launch_shape(w: int, pro: int, epi: int, n: int, k: int, m_rows: int,
                      cluster: int = 1):
    """Kernel, grid, warps per block and shared memory of a product, computed once per
    shape: enough blocks to fill every SM as far as registers and shared memory allow, at
    most one per tile, and a multiple of `cluster` where there are that many (else the
    launch goes without clusters). Plain products of rows of at least WIDE_MIN_K in no
    more tiles than SMs take the wide variant (twice the loads in flight per block)."""
    key = (w, pro, epi, n, k, m_rows, cluster)
    if key not in _mma_shapes:
        limits = device_limits()
        tiles = cdiv(n, MMA_TILE_ROWS)
        warps = _skinny_warps(w, pro, epi, n, k)
        kernel = skinny_kernel(w, pro, epi, warps, m_rows,
                               STAGE_SHARED if cluster > 1 else STAGE_ALONE)
        shared = mma_shared_bytes(m_rows, k, warps)
        opt_in_shared(kernel, shared)
        per_sm = mma_blocks_per_sm(kernel.num_regs, shared, kernel.shared_size_bytes, limits,
                                   warps)
        grid = max(1, min(tiles, per_sm * limits["sms"]))
        if grid >= cluster:
            grid -= grid % cluster
        _mma_shapes[key] = (kernel, grid, warps, shared)
    return _mma_shapes[key]


def _skinny_warps(w: int, pro: int, epi: int, n: int, k: int) -> int:
    """Warps per block: plain products of rows of at least WIDE_MIN_K[w] in no more tiles than
    SMs take the wide variant."""
    if ((pro, epi) == (PRO_PLAIN, EPI_STORE) and k >= WIDE_MIN_K[w]
            and cdiv(n, MMA_TILE_ROWS) <= device_limits()["sms"]):
        return MMA_WIDE_WARPS
    return MMA_WARPS


def mma_blocks_per_sm(regs_per_thread: int, shared: int, static_shared: int, limits: dict,
                      warps: int = MMA_WARPS) -> int:
    """Resident skinny blocks per SM: registers (allocated per warp in units of 256),
    shared memory (dynamic plus static, and 1 KB reserved per block) and threads; at
    least 1."""
    threads = warps * 32
    regs_per_warp = cdiv(regs_per_thread * 32, 256) * 256
    by_regs = limits["regs_per_sm"] // (regs_per_warp * warps)
    by_shared = limits["shared_per_sm"] // (shared + static_shared + 1024)
    by_threads = limits["threads_per_sm"] // threads
    return max(1, min(by_regs, by_shared, by_threads))


# ------------------------------------------------------------------ cuBLAS via ctypes

def cublas_linear(x, weight, out, accumulate: bool = False):
    """Row-major out = x W^T is column-major out^T = W x^T: op(A) = W^T read as [K, N]
    column-major transposed (transa=T, lda=K), B = x^T ([K, M] column-major, ldb=K),
    m=N, n=M, ldc=N; accumulate: beta = 1 (out float32)."""
    import cupy
    m_rows, k = x.shape
    n_cols = weight.shape[0]
    out_type = CUDA_R_16BF if out.dtype == BF16 else CUDA_R_32F
    args = (CUBLAS_OP_T, CUBLAS_OP_N, n_cols, m_rows, k,
            _ONE.ctypes.data, weight.data.ptr, CUDA_R_16BF, k, x.data.ptr, CUDA_R_16BF, k,
            (_ONE if accumulate else _ZERO).ctypes.data, out.data.ptr, out_type, n_cols,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    library = cublas_library()
    stream = cupy.cuda.get_current_stream().ptr
    if library is not None:
        library.gemm(stream, *args)
        return
    from cupy_backends.cuda.libs import cublas
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, stream)  # raises NotImplementedError while capturing
    cublas.setPointerMode(handle, 0)  # host
    cublas.gemmEx(handle, *args)


def cublas_library():
    """The ctypes cuBLAS handle, or None where the library could not be loaded."""
    global _cublas
    if _cublas is None:
        try:
            _cublas = _CublasLibrary()
        except (OSError, AttributeError, RuntimeError):
            _cublas = False
    return _cublas or None


class _CublasLibrary:
    def __init__(self):
        import cupy
        cupy.cuda.device.get_cublas_handle()  # CuPy loads libcublas into the process
        lib = ctypes.CDLL(_loaded_library_path())
        self._lib = lib
        handle = ctypes.c_void_p()
        self._check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle
        self.workspace = cupy.empty(WORKSPACE_BYTES, np.uint8)  # lives as long as the handle
        self._set_stream = lib.cublasSetStream_v2
        self._set_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._set_workspace = getattr(lib, "cublasSetWorkspace_v2", None)
        if self._set_workspace is not None:
            self._set_workspace.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        self._gemm = lib.cublasGemmEx
        c_int, c_ptr = ctypes.c_int, ctypes.c_void_p
        self._gemm.argtypes = [c_ptr, c_int, c_int, c_int, c_int, c_int, c_ptr, c_ptr, c_int,
                               c_int, c_ptr, c_int, c_int, c_ptr, c_ptr, c_int, c_int, c_int,
                               c_int]
        self._gemm.restype = c_int
        self._stream = None
        self.use_stream(cupy.cuda.get_current_stream().ptr)

    def use_stream(self, stream: int) -> None:
        if stream == self._stream:
            return
        self._check(self._set_stream(self.handle, ctypes.c_void_p(stream)), "cublasSetStream")
        if self._set_workspace is not None:  # setStream resets the workspace
            self._check(self._set_workspace(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                            ctypes.c_size_t(WORKSPACE_BYTES)), "cublasSetWorkspace")
        self._stream = stream

    def gemm(self, stream: int, *args) -> None:
        self.use_stream(stream)
        self._check(self._gemm(self.handle, *args), "cublasGemmEx")

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")


def _loaded_library_path() -> str:
    """The libcublas CuPy loaded (so both use one copy), else the first soname found."""
    loaded = launch.loaded_library_path("cublas")
    if loaded is not None:
        return loaded
    for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so.11", "libcublas.so"):
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    raise OSError("libcublas not found")
