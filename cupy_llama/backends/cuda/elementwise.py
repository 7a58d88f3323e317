"""Launchers for the row-wise kernels: embedding.cu, norm.cu, activation.cu, rope.cu.
Each checks its arguments, then launches on the current stream. The kernels that wait for
the kernel before (the adding norm, the head-norm rope) launch programmatically where the
caller asks (launch.py)."""
from __future__ import annotations

import ctypes

import numpy as np

from ...util import cdiv
from . import launch
from .kernels import BF16, F32, I32, aligned16, check, constants, f32, get_kernel, i32

ROW_THREADS = 256
# the vector paths' sizes, from the kernel sources (kernels.py)
NORM_VECTOR = constants("norm")["NORM_VECTOR"]
_ACTIVATION = constants("activation")
SILU_VECTOR = _ACTIVATION["SILU_VECTOR"]
ACTS = {"silu": _ACTIVATION["ACT_SILU"], "gelu_tanh": _ACTIVATION["ACT_GELU_TANH"]}
_ROPE = constants("rope")


def embedding(token_ids, table, out, pending_tokens=None, scale=None):
    """out[t] = table[token_ids[t]] (times scale, where given); token_ids [T] int32, table
    [V, H], out [T, H] bf16 or float32. pending_tokens [R] int32 (on the device): an id
    -(r + 1), r < R, stands for pending_tokens[r] (a token sampled by the previous step,
    not yet on the host)."""
    check("token_ids", token_ids, I32, ndim=1)
    vocab, hidden = check("table", table, BF16, ndim=2).shape
    check("out", out, _bf16_or_f32("out", out), shape=(token_ids.shape[0], hidden))
    if pending_tokens is None:
        pending_tokens, num_pending = token_ids, 0  # never read
    else:
        num_pending = check("pending_tokens", pending_tokens, I32, ndim=1).shape[0]
    kernel = "embedding_kernel" if out.dtype == BF16 else "embedding_f32_kernel"
    if out.shape[0]:
        get_kernel("embedding", kernel)(
            (out.shape[0],), (ROW_THREADS,),
            (token_ids, pending_tokens, i32(num_pending), table, out, i32(hidden), i32(vocab),
             f32(1.0 if scale is None else scale)))


def gather_rows(x, indices, out):
    """out[b] = x[indices[b]]; x [N, W] and out [B, W], bf16 or float32 alike."""
    if x.dtype not in (BF16, F32):
        raise ValueError(f"x: expected dtype uint16 (bf16) or float32, got {x.dtype.name}")
    check("x", x, x.dtype, ndim=2)
    check("indices", indices, I32, ndim=1)
    check("out", out, x.dtype, shape=(indices.shape[0], x.shape[1]))
    units = x.shape[1] * x.dtype.itemsize // 2  # 16-bit units per row
    if out.shape[0]:
        get_kernel("embedding", "gather_rows_kernel")(
            (out.shape[0],), (ROW_THREADS,), (x, indices, out, i32(units)))


def _norm_threads(hidden: int) -> int:
    """About four elements per thread, a multiple of 32, at most 1024."""
    return min(1024, max(32, cdiv(hidden, 128) * 32))


def _bf16_or_f32(name, array):
    if array.dtype not in (BF16, F32):
        raise ValueError(f"{name}: expected dtype uint16 (bf16) or float32, got {array.dtype.name}")
    return array.dtype


def rms_norm(x, weight, eps, out, offset: float = 0.0):
    """out = x / sqrt(mean(x^2) + eps) * (offset + weight); x [T, H] bf16 or float32, out
    [T, H] bf16 (out may be x when both are bf16)."""
    rows, hidden = check("x", x, _bf16_or_f32("x", x), ndim=2).shape
    check("weight", weight, BF16, shape=(hidden,))
    check("out", out, BF16, shape=(rows, hidden))
    kernel = "rms_norm_kernel" if x.dtype == BF16 else "rms_norm_f32_kernel"
    vector = hidden % NORM_VECTOR == 0 and aligned16(x, weight, out)
    if rows:
        get_kernel("norm", kernel)(
            (rows,), (_norm_threads(hidden),),
            (x, weight, out, i32(hidden), f32(eps), f32(offset), i32(vector)))


def add_rms_norm(x, weight, eps, residual, offset: float = 0.0, programmatic: bool = False,
                 out=None):
    """out [T, H] float32 = residual + x / sqrt(mean(x^2) + eps) * (offset + weight); x [T,
    H] bf16; out None: residual itself. programmatic: launch programmatically (the caller
    has checked that the GPU can)."""
    rows, hidden = check("x", x, BF16, ndim=2).shape
    check("weight", weight, BF16, shape=(hidden,))
    check("residual", residual, F32, shape=(rows, hidden))
    out = residual if out is None else check("out", out, F32, shape=(rows, hidden))
    vector = hidden % NORM_VECTOR == 0 and aligned16(x, weight, residual, out)
    if rows:
        _launch(get_kernel("norm", "add_rms_norm_kernel"), (rows,), _norm_threads(hidden),
                (x, weight, residual, out, i32(hidden), f32(eps), f32(offset), i32(vector)),
                programmatic)


def act_and_mul(gate_up, out, act: str = "silu"):
    """gate_up [T, 2I] (gate first); out [T, I] = act(gate) * up; act "silu" or
    "gelu_tanh"."""
    rows, width = check("gate_up", gate_up, BF16, ndim=2).shape
    if width % 2:
        raise ValueError(f"gate_up: width must be even (gate and up halves), got {width}")
    check("out", out, BF16, shape=(rows, width // 2))
    inter = width // 2
    vector = inter % SILU_VECTOR == 0 and aligned16(gate_up, out)
    if rows and inter:
        column_blocks = cdiv(inter, SILU_VECTOR * ROW_THREADS)
        get_kernel("activation", "act_and_mul_kernel")(
            (rows, column_blocks), (ROW_THREADS,),
            (gate_up, out, i32(inter), i32(vector), i32(ACTS[act])))


def softcap(x, cap: float):
    """x = cap * tanh(x / cap), in place; x float32 (the logits)."""
    check("x", x, F32, ndim=None)
    if x.size:
        get_kernel("activation", "softcap_kernel")(
            (cdiv(x.size, ROW_THREADS),), (ROW_THREADS,), (x, x.size, f32(cap)))


def rope_and_cache(qkv, positions, slot_mapping, cos_sin, k_cache, v_cache, q_out, bias=None,
                   head_norm=None, programmatic: bool = False):
    """Rotate q and k (half-split pairs), q -> q_out [T, nh, d]; rotated k and plain v ->
    the caches [num_blocks, block_size, nkv, d] at slot_mapping (slot < 0: skipped).
    bias [(nh + 2 nkv) d] bf16: added to qkv first. head_norm (interface.HeadNorm, weights
    [d] bf16, d <= 256): each q and k head normed before it is rotated (a kernel of its own:
    a warp per head, HEAD_NORM_WARPS heads per block), launched programmatically where
    `programmatic` (the caller has checked that the GPU can); the kernel without head norms
    always launches the plain way."""
    num_tokens, num_heads, num_kv_heads, head_dim = check_rope_operands(
        q_out, k_cache, v_cache, positions, slot_mapping, cos_sin)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    check("qkv", qkv, BF16, shape=(num_tokens, width))
    if bias is not None:
        check("bias", bias, BF16, shape=(width,))
    if head_norm is not None:
        check("q_norm", head_norm.q_weight, BF16, shape=(head_dim,))
        check("k_norm", head_norm.k_weight, BF16, shape=(head_dim,))
        if head_dim > 2 * _ROPE["HEAD_NORM_PAIRS"] * _ROPE["WARP_SIZE"]:
            raise ValueError(f"q_out: head norms take head_dim up to "
                             f"{2 * _ROPE['HEAD_NORM_PAIRS'] * _ROPE['WARP_SIZE']}, got {head_dim}")
    vector = (head_dim % (2 * _ROPE["ROPE_VECTOR"]) == 0
              and num_kv_heads * head_dim % _ROPE["ROPE_V_VECTOR"] == 0
              and aligned16(qkv, cos_sin, k_cache, v_cache, q_out,
                            *(() if bias is None else (bias,))))
    if not num_tokens:
        return
    args = (qkv, positions, slot_mapping, cos_sin, k_cache, v_cache, q_out, i32(num_heads),
            i32(num_kv_heads), i32(head_dim), i32(vector), _pointer(bias))
    if head_norm is None:
        get_kernel("rope", "rope_and_cache_kernel")((num_tokens,), (_ROPE["ROPE_THREADS"],), args)
    else:
        warps = _ROPE["HEAD_NORM_WARPS"]
        _launch(get_kernel("rope", "rope_head_norm_and_cache_kernel"),
                (num_tokens, cdiv(num_heads + num_kv_heads, warps)), warps * _ROPE["WARP_SIZE"],
                args + (head_norm.q_weight, head_norm.k_weight, f32(head_norm.eps),
                        f32(head_norm.offset)), programmatic)


def _pointer(array):
    """A kernel's optional array argument: the array, or a null pointer (0) without one."""
    return array if array is not None else np.uint64(0)


def _launch(kernel, grid: tuple, block: int, args: tuple, programmatic: bool) -> None:
    """Launch a row kernel that calls wait_for_previous_kernel on the current stream:
    programmatically where asked, else with CuPy's plain call. args as CuPy's call takes
    them, _pointer's null pointers included."""
    if not programmatic:
        kernel(grid, (block,), args)
        return
    import cupy
    launch.launch(kernel, grid, block, 0, cupy.cuda.get_current_stream().ptr,
                  launch_values(args), programmatic=True)


def launch_values(args: tuple) -> list:
    """A row kernel's arguments as CuPy's call takes them (arrays, NumPy int32 and float32
    scalars, _pointer's null pointers) -> the ctypes values launch.launch takes."""
    return [ctypes.c_void_p(int(value)) if isinstance(value, np.uint64)
            else launch.kernel_args(value)[0] for value in args]


def check_rope_operands(q_out, k_cache, v_cache, positions, slot_mapping, cos_sin,
                        num_tokens: int | None = None) -> tuple[int, int, int, int]:
    """What rope_and_cache and the fused qkv product (gemm.norm_qkv_rope) share: q_out
    [T, nh, d] bf16 (T = num_tokens where given), caches [num_blocks, block_size, nkv, d]
    bf16, positions and slot_mapping [T] int32, cos_sin [max_pos, d] float32, d even;
    returns (T, nh, nkv, d)."""
    num_tokens, num_heads, head_dim = check("q_out", q_out, BF16,
                                            shape=(num_tokens, None, None)).shape
    num_kv_heads = check("k_cache", k_cache, BF16, shape=(None, None, None, head_dim)).shape[2]
    check("v_cache", v_cache, BF16, shape=k_cache.shape)
    check("positions", positions, I32, shape=(num_tokens,))
    check("slot_mapping", slot_mapping, I32, shape=(num_tokens,))
    check("cos_sin", cos_sin, F32, shape=(None, head_dim))
    if head_dim % 2:
        raise ValueError(f"q_out: head_dim must be even for RoPE, got {head_dim}")
    return num_tokens, num_heads, num_kv_heads, head_dim

