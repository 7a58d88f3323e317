"""What passes between the models and the backends: the per-step arrays, the sampling
settings and their results, and the ops a backend supplies. The models (models/) are
written against this, the backends (backends/) implement it, and neither imports the
other.

Two backends implement the ops: `numpy_ops.NumpyOps` (float32 reference, CPU) and
`cuda.ops.CudaOps` (bf16 storage as uint16, fp32 math, kernels from cuda_src/). Every op
writes into an `out` array the caller owns, so the CUDA backend can hand out views of one
buffer pool and nothing is allocated inside the step loop.

Shapes (T = tokens in this step, B = sequences in this step, H = hidden size,
nh / nkv = query / key-value heads, d = head_dim, V = vocab size):

KV cache, one per layer and kind: [num_blocks, block_size, nkv, d]. A token at position p
of a sequence lives in block `block_table[p // block_size]`, row `p % block_size`; its
flat slot is `block * block_size + row` (the slot mapping).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np


# The per-step arrays, described once: each one's name and shape in T (tokens of the step),
# B (sequences) and W (block-table width). ForwardBatch holds them on the host; StepLayout
# packs them into one int32 buffer, which is how the CUDA backend stages a step, views it
# on the device and keeps the fixed inputs of its CUDA graphs. A new per-step array is a
# line here and a field of ForwardBatch (checked below).
STEP_ARRAYS = (
    ("token_ids", ("T",)),
    ("positions", ("T",)),
    ("slot_mapping", ("T",)),
    ("query_start_loc", ("B+1",)),
    ("seq_lens", ("B",)),
    ("last_token_indices", ("B",)),
    ("block_tables", ("B", "W")),
)


@dataclass
class ForwardBatch:
    """One step's inputs: the new tokens and what attention needs, built on the host by
    the model runner.

    The arrays here are host numpy int32; a backend copies them to its own memory with
    `Ops.upload` before the forward pass (the CUDA backend into fixed buffers). A step may
    be launched before the previous step's tokens reach the host: a token id -(r + 1)
    stands for the token that the previous `sample_async` call picked for its row r, and
    the embedding lookup reads it where it already is (on the device).
    Sequence b owns query rows query_start_loc[b]:query_start_loc[b+1]; its new tokens
    sit at the END of its context: they are positions seq_lens[b]-num_new .. seq_lens[b]-1,
    and each attends causally to every cached position <= its own.
    """
    token_ids: np.ndarray        # [T] int32, the new tokens of all sequences, concatenated;
                                 # -(r + 1): the token sampled for row r of the previous step
    positions: np.ndarray        # [T] int32, position of each token in its sequence
    slot_mapping: np.ndarray     # [T] int32, flat KV slot each token's K/V are written to;
                                 # -1: not written (they are in a shared cached block already)
    query_start_loc: np.ndarray  # [B+1] int32, prefix sums of new tokens per sequence
    seq_lens: np.ndarray         # [B] int32, context length after this step's tokens
    block_tables: np.ndarray     # [B, max_blocks_per_seq] int32, unused entries -1
    max_query_len: int
    max_seq_len: int

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @property
    def last_token_indices(self) -> np.ndarray:
        """[B] int32: the row of each sequence's last token (the one whose logits we need)."""
        return (self.query_start_loc[1:] - 1).astype(np.int32)

    @property
    def width(self) -> int:
        """W: the block tables' width."""
        return int(self.block_tables.shape[1])


assert {name for name, _ in STEP_ARRAYS} == {"last_token_indices"} | {
    name for name in ForwardBatch.__dataclass_fields__ if name not in ("max_query_len", "max_seq_len")
}, "STEP_ARRAYS and ForwardBatch must name the same arrays"


class StepLayout:
    """Where each of STEP_ARRAYS sits in one flat int32 buffer that holds a step of up to
    `num_tokens` tokens and `num_seqs` sequences with block tables `width` wide: array
    after array, each at its full size."""

    def __init__(self, num_tokens: int, num_seqs: int, width: int):
        sizes = {"T": num_tokens, "B": num_seqs, "B+1": num_seqs + 1, "W": width}
        self.axes = dict(STEP_ARRAYS)
        self.shapes = {name: tuple(sizes[axis] for axis in axes) for name, axes in STEP_ARRAYS}
        self.offsets, offset = {}, 0
        for name, shape in self.shapes.items():
            self.offsets[name] = offset
            offset += int(np.prod(shape))
        self.size = offset  # int32 elements in all

    def view(self, buffer, name: str, rows: int | None = None):
        """The array `name` in `buffer` (numpy or cupy, flat int32); rows: only the first
        `rows` tokens or sequences (B+1 arrays: rows + 1), for a smaller step in buffers
        sized for a larger one."""
        shape = self.shapes[name]
        if rows is not None:
            shape = (rows + (self.axes[name][0] == "B+1"), *shape[1:])
        start = self.offsets[name]
        return buffer[start:start + int(np.prod(shape))].reshape(shape)

    def views(self, buffer, rows: int | None = None) -> dict:
        return {name: self.view(buffer, name, rows) for name in self.shapes}

    def write(self, buffer, batch: ForwardBatch) -> None:
        """Copy the batch's arrays (each exactly its shape here) into the host buffer."""
        for name, shape in self.shapes.items():
            array = getattr(batch, name)
            if tuple(array.shape) != shape:
                raise ValueError(f"batch.{name}: expected shape {shape}, got {array.shape}")
            start = self.offsets[name]
            buffer[start:start + array.size] = array.reshape(-1)


class SamplingRow(NamedTuple):
    """One per-sequence sampling setting (a row of SAMPLING_ROWS)."""
    name: str
    dtype: Any
    default: Any   # the value of a slot no sequence holds
    neutral: Any   # the value that turns the control off (None: it is never off)
    per: str       # "request": fixed while a sequence holds its slot, kept in the model
                   # runner's slot tables; "step": set anew every step
    kernel: bool   # read by the sampling kernel: in its staging layout and argument list


# The per-sequence sampling settings, described once. SamplingTensors has one field per
# row, the model runner's SlotTables one column per "request" row, and the CUDA backend
# stages the kernel's rows in this order, one [max_num_seqs] array after another, for the
# sampling kernel, whose SAMPLING_ROWS macro in cuda_src/sampling.cu lists the same rows
# in the same order (checked when the CUDA backend is imported). The 8-byte rows come
# first, so every array of the staging buffer is aligned (checked below). A new control is
# a row here, a field of SamplingTensors, its kernel code and its tests.
SAMPLING_ROWS = (
    SamplingRow("seeds", np.uint64, 0, None, "request", True),
    SamplingRow("temperature", np.float32, 0.0, 1.0, "request", True),
    SamplingRow("top_k", np.int32, 0, 0, "request", True),
    SamplingRow("top_p", np.float32, 1.0, 1.0, "request", True),
    SamplingRow("min_p", np.float32, 0.0, 0.0, "request", True),
    SamplingRow("steps", np.int32, 0, None, "step", True),
    # the penalties (SamplingParams) and the per-slot device state they read: a row with
    # state_slot >= 0 reads that slot's token counts and bias entries (SlotState)
    SamplingRow("repetition_penalty", np.float32, 1.0, 1.0, "request", True),
    SamplingRow("frequency_penalty", np.float32, 0.0, 0.0, "request", True),
    SamplingRow("presence_penalty", np.float32, 0.0, 0.0, "request", True),
    SamplingRow("min_tokens", np.int32, 0, 0, "request", True),
    SamplingRow("num_biases", np.int32, 0, 0, "request", True),    # bias entries always applied
    SamplingRow("num_min_bans", np.int32, 0, 0, "request", True),  # banned while steps < min_tokens
    SamplingRow("state_slot", np.int32, -1, -1, "step", True),
    SamplingRow("count_token", np.int32, 0, 0, "step", True),  # 1: the sampled token is kept: count it
    SamplingRow("num_logprobs", np.int32, -1, -1, "request", False),
    # structured outputs: the row's token is drawn later, under its grammar's bitmask, by
    # Ops.sample_masked (the kernel learns it per launch, from its mask_rows argument)
    SamplingRow("deferred", np.bool_, False, False, "request", False),
)
SAMPLING_ROW = {row.name: row for row in SAMPLING_ROWS}
KERNEL_ROWS = tuple(row for row in SAMPLING_ROWS if row.kernel)
assert all(np.dtype(a.dtype).itemsize >= np.dtype(b.dtype).itemsize
           for a, b in zip(KERNEL_ROWS, KERNEL_ROWS[1:])), \
    "SAMPLING_ROWS: the kernel's rows go widest first, so the staged arrays stay aligned"


@dataclass
class SamplingTensors:
    """Per-sequence sampling settings for one step (host numpy arrays, length B), one field
    per row of SAMPLING_ROWS. A field left None holds the row's neutral value everywhere
    (no row of the step uses that control)."""
    temperature: np.ndarray  # float32; 0 means greedy
    top_k: np.ndarray        # int32; 0 or >= V means off
    top_p: np.ndarray        # float32; 1.0 means off
    min_p: np.ndarray        # float32; 0.0 means off
    seeds: np.ndarray        # uint64; the request's seed (a random one when the user gave none)
    steps: np.ndarray        # int32; how many tokens the request has generated so far
    # float32 / int32 (None: no row of the step uses it); see SAMPLING_ROWS
    repetition_penalty: np.ndarray | None = None
    frequency_penalty: np.ndarray | None = None
    presence_penalty: np.ndarray | None = None
    min_tokens: np.ndarray | None = None
    num_biases: np.ndarray | None = None
    num_min_bans: np.ndarray | None = None
    state_slot: np.ndarray | None = None
    count_token: np.ndarray | None = None
    # int32; -1: no log-probabilities, k >= 0: the sampled token's and the top k's
    # (None: no row asks)
    num_logprobs: np.ndarray | None = None
    # bool; True: the row's token is drawn later, under its grammar's bitmask, by
    # Ops.sample_masked (structured outputs; None: no row is)
    deferred: np.ndarray | None = None
    # the slots whose device state this step rebuilds before it samples (not a row)
    resets: "list[SlotReset] | None" = None

    @property
    def processes_logits(self) -> bool:
        """Whether any row reads device state (penalties, biases, bans)."""
        return self.state_slot is not None

    @property
    def num_seqs(self) -> int:
        return int(np.asarray(self.temperature).shape[0])

    def row(self, name: str) -> np.ndarray:
        """The setting `name` of every sequence, [B] of its row's dtype (the neutral value
        where the field is None)."""
        spec = SAMPLING_ROW[name]
        value = getattr(self, name)
        if value is None:
            return np.full(self.num_seqs, spec.neutral, spec.dtype)
        return np.asarray(value, spec.dtype).reshape(self.num_seqs)

    @property
    def all_greedy(self) -> bool:
        return bool(np.all(self.temperature == 0))

    def logprob_rows(self) -> tuple[np.ndarray, int]:
        """The rows that ask for log-probabilities, and the most alternatives any asks for."""
        if self.num_logprobs is None:
            return np.zeros(0, np.int32), 0
        rows = np.flatnonzero(self.num_logprobs >= 0).astype(np.int32)
        return rows, int(self.num_logprobs[rows].max()) if rows.size else 0


assert set(SamplingTensors.__dataclass_fields__) - {"resets"} == {row.name for row in SAMPLING_ROWS}, \
    "SAMPLING_ROWS and SamplingTensors must name the same settings"


MAX_BIAS_ENTRIES = 512  # bias entries of one slot: logit_bias (300), bans, min_tokens' bans


@dataclass
class SlotReset:
    """A slot's device state made anew for the sequence that now holds it, before the
    step samples. The state: how often each token occurs in the output and whether it
    occurs in the prompt (the penalties read both; the sampling kernel adds each kept
    token), and the bias entries: `num_biases` (token, value) pairs always added to the
    logits (-inf bans), then `num_min_bans` tokens banned while steps < min_tokens."""
    slot: int
    prompt_token_ids: list     # the prompt (empty where no penalty is on)
    output_token_ids: list     # the output so far; -(r + 1): row r of the last sampling
    bias_ids: list             # [num_biases + num_min_bans] distinct in each part
    bias_values: list          # float; -inf bans


class Logprobs:
    """Log-probabilities of one sampling call, for the rows that asked: ids and values
    [R, 1 + k] (column 0 the sampled token, then the k most likely, best first)."""

    def __init__(self, rows: np.ndarray, ids: np.ndarray, values: np.ndarray):
        self.rows, self.ids, self.values = rows, ids, values
        self._index = {int(row): i for i, row in enumerate(rows)}

    def of_row(self, row: int, k: int) -> tuple[int, float, list[tuple[int, float]]]:
        """(sampled token, its logprob, the top k as (id, logprob)) of one batch row."""
        i = self._index[row]
        ids, values = self.ids[i].tolist(), self.values[i].tolist()
        return ids[0], values[0], list(zip(ids[1:1 + k], values[1:1 + k]))


@dataclass
class PromptLogprobRequest:
    """The prompt positions of a step whose next-token log-probabilities are wanted (the
    requests with SamplingParams.prompt_logprobs): the model computes the logits of these
    rows too, in pieces, and keeps only each row's log-softmax of its target and the k
    largest, and its target's rank. values, ids and ranks (backend arrays) are set by the
    forward pass."""
    rows: np.ndarray     # [P] int32: rows of the step's tokens (T axis)
    targets: np.ndarray  # [P] int32: the prompt token that follows each row's token
    k: int               # alternatives per row: the most any request of the step asks
    values: Any = None   # [P, 1 + k] float32: column 0 the target's, then the k best
    ids: Any = None      # [P, 1 + k] int32
    ranks: Any = None    # [P] int32: the target's place in its row (1: the most likely)
    spans: list = field(default_factory=list)  # the caller's: whose rows are whose

    def host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """values, ids and ranks as host numpy arrays (waits for the device where needed)."""
        arrays = (self.values, self.ids, self.ranks)
        if getattr(self.values, "get", None) is not None:  # cupy
            return tuple(a.get() for a in arrays)
        return tuple(np.asarray(a) for a in arrays)


class SampledTokens:
    """Token ids of one sampling call, ready now (`get` returns them), and the
    log-probabilities of the rows that asked (`logprobs`, None where none did)."""

    prompt_logprobs: PromptLogprobRequest | None = None  # the step's, where it had some
    # not None while rows deferred by sampling.deferred wait for Ops.sample_masked (what
    # the backend keeps for it)
    deferred_inputs = None

    def __init__(self, tokens: np.ndarray, logprobs: Logprobs | None = None):
        self._tokens = tokens
        self._logprobs = logprobs

    def get(self) -> np.ndarray:
        """Host numpy int32 [B]; waits for the device where the tokens are still coming."""
        return self._tokens

    def logprobs(self) -> Logprobs | None:
        """Call after get()."""
        return self._logprobs

    def set_logprobs(self, logprobs: Logprobs | None) -> None:
        """(Ops.sample_masked) the log-probabilities, once the deferred rows are drawn."""
        self._logprobs = logprobs


class HeadNorm(NamedTuple):
    """RMSNorm of each q and k head over head_dim before RoPE (Qwen3, Gemma 3): one weight
    [d] for all q heads and one for all k heads; out = x / rms(x) * (offset + weight)."""
    q_weight: Any
    k_weight: Any
    eps: float
    offset: float = 0.0


class AddedNorm(NamedTuple):
    """A sublayer's output that joins the residual stream through a norm of its own as the
    next sublayer opens (Gemma's sandwich norms): out = x + rms_norm(h) * (offset +
    weight), with the opening op's eps and offset, and the op then norms out, not x. out is
    a float32 buffer other than x: a GPU kernel that does both reads x in every block
    (docs/ARCHITECTURE.md, "Sandwich norms")."""
    h: Any       # [T, H], the sublayer's output
    weight: Any  # [H]
    out: Any     # [T, H] float32


class Fp8Weight(NamedTuple):
    """A product's weight [N, K] in FP8 (docs/ARCHITECTURE.md, "FP8 weights"): row n is
    value(codes[n]) * scale[n], e4m3 codes and float32 scales (cupy_llama/fp8.py). On the
    GPU `data` holds the codes (uint8); the NumPy backend keeps their float32 values."""
    data: Any   # [N, K]
    scale: Any  # [N] float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)


class Backend(Protocol):
    """A loaded model on one device: ops, weights, KV cache and the activation pool."""
    ops: "Ops"
    weights: dict           # keys of the model's weight_plan: "embed", "layers.{i}.qkv", ...
    kv_caches: list         # per layer (k_cache, v_cache), each [num_blocks, block_size, nkv, d]
    rope_tables: dict       # layer type -> [max_model_len, d] float32 cos/sin (models/rope.py)
    num_kv_blocks: int
    block_size: int

    def buffers(self, num_tokens: int, num_seqs: int) -> dict:
        """Activation buffers for one step, views of the pool (models/decoder.py
        buffer_shapes names them). The CUDA backend hands out views of memory allocated
        once."""


class Ops(Protocol):
    """Array type `A` is numpy.ndarray (float32) or cupy.ndarray (uint16 = bf16 bits).
    Norm weights scale by (offset + weight): offset 0 for Llama's, 1 for Gemma's."""

    act_dtype: Any  # dtype of activations and KV cache

    def empty(self, shape, dtype=None) -> Any: ...
    def upload(self, batch: ForwardBatch) -> Any:
        """Copy the batch's arrays to backend memory; the result is what the ops below take
        as `meta` (same field names; host ints stay host ints)."""
    def embedding(self, token_ids, table, out, *, scale=None) -> None:
        """out[t] = table[token_ids[t]] (times scale, where given); token_ids [T] int32,
        table [V, H], out [T, H]. An id -(r + 1) is the token the latest sample_async call
        picked for row r."""
    def rms_norm(self, x, weight, eps: float, out, *, offset: float = 0.0) -> None:
        """out = x / sqrt(mean(x^2) + eps) * (offset + weight); x, out [T, H]."""
    def add_rms_norm(self, x, weight, eps: float, residual, *, offset: float = 0.0,
                     out=None) -> None:
        """out (float32) = residual + rms_norm(x): a sublayer's output normed before it
        joins the residual stream (Gemma); out None: residual, in place."""
    def linear(self, x, weight, out, accumulate: bool = False) -> None:
        """out = x @ weight.T; x [M, K], weight [N, K] (or an Fp8Weight), out [M, N]. out
        may be float32; accumulate: out (float32) += x @ weight.T."""
    def rope_and_cache(self, qkv, meta, cos_sin, k_cache, v_cache, q_out, *, bias=None,
                       head_norm: HeadNorm | None = None) -> None:
        """qkv [T, (nh + 2 nkv) d], plus bias [(nh + 2 nkv) d] where given, each q and k
        head normed by head_norm where given: rotate q and k with RoPE at meta.positions
        (half-split pairs (i, i + d/2)), write rotated q to q_out [T, nh, d], write rotated
        k and plain v to the caches at meta.slot_mapping. cos_sin [max_pos, d] float32: cos
        in the first d/2 columns, sin in the last d/2."""
    def attention(self, q, k_cache, v_cache, meta, scale: float, out, *,
                  window: int | None = None, softcap: float | None = None) -> None:
        """Causal attention of q [T, nh, d] over the paged cache; out [T, nh * d]. GQA: query
        head h reads kv head h // (nh // nkv). window: a token at position p sees the keys
        at p - window + 1 .. p only. softcap: scores (after the scale) become
        softcap * tanh(score / softcap)."""
    def act_and_mul(self, gate_up, out, act: str = "silu") -> None:
        """gate_up [T, 2 I] (gate first); out [T, I] = act(gate) * up; act "silu" or
        "gelu_tanh"."""
    def softcap(self, x, cap: float) -> None:
        """x = cap * tanh(x / cap), in place (float32 logits)."""
    def gather_rows(self, x, indices, out) -> None:
        """out[b] = x[indices[b]]; picks each sequence's last hidden state."""
    def norm_linear(self, x, norm_weight, eps: float, weight, out, h, *,
                    offset: float = 0.0, added: AddedNorm | None = None) -> None:
        """out = rms_norm(x) @ weight.T (SublayerOps); with added, of added.out = x +
        rms_norm(added.h)."""
    def norm_gate_up_act(self, x, norm_weight, eps: float, weight, out, h, gate_up, *,
                         offset: float = 0.0, act: str = "silu",
                         added: AddedNorm | None = None) -> None:
        """out = act_and_mul(rms_norm(x) @ weight.T) (SublayerOps); added as above."""
    def norm_qkv_rope(self, x, norm_weight, eps: float, weight, meta, cos_sin, k_cache,
                      v_cache, q_out, h, qkv, *, offset: float = 0.0, bias=None,
                      head_norm: HeadNorm | None = None,
                      added: AddedNorm | None = None) -> None:
        """rope_and_cache(rms_norm(x) @ weight.T) (SublayerOps); added as above."""
    def device_array(self, host: np.ndarray) -> Any:
        """A copy of a host array in backend memory (the NumPy backend: the array itself)."""
    def token_logprobs(self, logits, targets, k: int, values, ids, ranks) -> None:
        """logits [n, V] float32, targets [n] int32 -> values [n, 1 + k] float32 and ids
        [n, 1 + k] int32: column 0 each target's log-softmax, then the k largest, best
        first (ties to the lower id); ranks [n] int32: each target's place in its row (1:
        the most likely, in the same order)."""
    def sample(self, logits, sampling: SamplingTensors) -> np.ndarray:
        """logits [B, V] float32 -> host numpy int32 [B] token ids."""
    def sample_async(self, logits, sampling: SamplingTensors) -> SampledTokens:
        """sample() without waiting: the tokens come back while the host prepares the next
        step, which may already name them (token id -(r + 1), see ForwardBatch). The rows
        that ask (sampling.num_logprobs) also get log-probabilities of the raw logits.
        Rows marked sampling.deferred are left for sample_masked, which must be called
        before the tokens are read or the next step is launched, and after the previous
        step's tokens were read."""
    def sample_masked(self, pending: SampledTokens, rows, bitmask) -> None:
        """Draw the deferred rows of a sample_async call: logits row rows[i] (host int32
        [R]) under bitmask row i (host uint32 [R, W], W * 32 >= V; a disallowed token's
        logit counts as -inf, as structured.apply_token_bitmask says), with the row's own
        sampling settings; log-probabilities stay those of the raw logits. Deferred rows
        left out of `rows` get no token (their sequences ended)."""


class SublayerOps:
    """The ops that open a sublayer (a norm, a product, and what follows the product),
    composed of the primitive ops. A backend may run any of them as one kernel: CudaOps
    does for steps of at most 16 tokens. `h` (the normalized x) and `qkv` / `gate_up` (the
    raw product) are scratch buffers only the composed form writes. With `added`
    (AddedNorm), the sublayer before joins first and the op norms added.out."""

    def join(self, x, added: AddedNorm | None, eps, offset):
        """x, or where a sublayer's output joins first, added.out = x + rms_norm(added.h)."""
        if added is None:
            return x
        self.add_rms_norm(added.h, added.weight, eps, x, offset=offset, out=added.out)
        return added.out

    def norm_linear(self, x, norm_weight, eps, weight, out, h, *, offset=0.0, added=None):
        """out = rms_norm(x) @ weight.T; x [T, H], out [T, N]."""
        x = self.join(x, added, eps, offset)
        self.rms_norm(x, norm_weight, eps, h, offset=offset)
        self.linear(h, weight, out)

    def norm_gate_up_act(self, x, norm_weight, eps, weight, out, h, gate_up, *, offset=0.0,
                         act="silu", added=None):
        """out [T, I] = act(gate) * up of rms_norm(x) @ weight.T (gate rows first)."""
        self.norm_linear(x, norm_weight, eps, weight, gate_up, h, offset=offset, added=added)
        self.act_and_mul(gate_up, out, act)

    def norm_qkv_rope(self, x, norm_weight, eps, weight, meta, cos_sin, k_cache, v_cache,
                      q_out, h, qkv, *, offset=0.0, bias=None, head_norm=None, added=None):
        """rms_norm(x) @ weight.T, then rope_and_cache (with bias and head_norm): rotated q
        -> q_out [T, nh, d], rotated k and plain v -> the caches."""
        self.norm_linear(x, norm_weight, eps, weight, qkv, h, offset=offset, added=added)
        self.rope_and_cache(qkv, meta, cos_sin, k_cache, v_cache, q_out, bias=bias,
                            head_norm=head_norm)
