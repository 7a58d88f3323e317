"""float32 reference ops on the CPU (docs/ARCHITECTURE.md, Decisions 10).

Plain NumPy, written for clarity: the CUDA kernels are tested against these, and the
engine runs on them where there is no GPU. Same paged-KV layout as the CUDA backend.
"""
from __future__ import annotations

import math

import numpy as np

from ..interface import (Fp8Weight, ForwardBatch, Logprobs, SampledTokens, SamplingTensors,
                         SlotReset, SublayerOps)
from ..structured import apply_token_bitmask


class NumpyOps(SublayerOps):
    act_dtype = np.float32
    _last_sampled = np.zeros(0, np.int32)  # the tokens of the latest sample call

    def empty(self, shape, dtype=np.float32):
        return np.empty(shape, dtype=dtype)

    def upload(self, batch: ForwardBatch) -> ForwardBatch:
        return batch

    def embedding(self, token_ids, table, out, *, scale=None):
        ids = np.asarray(token_ids)
        pending = ids < 0  # the token sampled for row -id - 1 of the previous sample call
        if pending.any():
            ids = ids.copy()
            ids[pending] = self._last_sampled[-ids[pending] - 1]
        out[...] = table[ids]
        if scale is not None:
            out *= np.float32(scale)

    def rms_norm(self, x, weight, eps, out, *, offset=0.0):
        out[...] = normed(x, weight, eps, offset)

    def add_rms_norm(self, x, weight, eps, residual, *, offset=0.0, out=None):
        if out is None:
            residual += normed(x, weight, eps, offset)
        else:
            np.add(residual, normed(x, weight, eps, offset), out=out)

    def linear(self, x, weight, out, accumulate=False):
        if isinstance(weight, Fp8Weight):  # the codes' values, then each row's scale
            product = (x @ weight.data.T) * weight.scale
            if accumulate:
                out += product
            else:
                out[...] = product
        elif accumulate:
            out += x @ weight.T
        else:
            np.matmul(x, weight.T, out=out)

    def rope_and_cache(self, qkv, meta, cos_sin, k_cache, v_cache, q_out, *, bias=None,
                       head_norm=None):
        num_tokens = qkv.shape[0]
        num_heads, head_dim = q_out.shape[1], q_out.shape[2]
        num_kv_heads = k_cache.shape[2]
        if bias is not None:
            qkv = qkv + bias
        q = qkv[:, :num_heads * head_dim].reshape(num_tokens, num_heads, head_dim)
        kv_start = num_heads * head_dim
        k = qkv[:, kv_start:kv_start + num_kv_heads * head_dim].reshape(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, kv_start + num_kv_heads * head_dim:].reshape(num_tokens, num_kv_heads, head_dim)
        if head_norm is not None:
            q = normed(q, head_norm.q_weight, head_norm.eps, head_norm.offset)
            k = normed(k, head_norm.k_weight, head_norm.eps, head_norm.offset)
        table = cos_sin[meta.positions]                  # [T, d]
        half = head_dim // 2
        cos, sin = table[:, None, :half], table[:, None, half:]  # [T, 1, d/2]
        q_out[...] = rotate(q, cos, sin)
        block_size = k_cache.shape[1]
        written = meta.slot_mapping >= 0  # slot -1: the token's K/V are in the cache already
        blocks, rows = np.divmod(meta.slot_mapping[written], block_size)
        k_cache[blocks, rows] = rotate(k[written], cos[written], sin[written])
        v_cache[blocks, rows] = v[written]

    def attention(self, q, k_cache, v_cache, meta, scale, out, *, window=None, softcap=None):
        """Per sequence, as batched products over the kv heads (BLAS), each kv head's query
        heads stacked as rows: [nkv, n * group, d] @ [nkv, d, S]."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        starts = meta.query_start_loc
        for b, seq_len in enumerate(meta.seq_lens):
            num_new = starts[b + 1] - starts[b]
            if num_new == 0:
                continue
            first = 0 if window is None else max(0, seq_len - num_new - window + 1)
            positions = np.arange(first, seq_len)                     # the keys any query sees
            blocks = meta.block_tables[b][positions // block_size]
            keys = k_cache[blocks, positions % block_size]            # [S, nkv, d]
            values = v_cache[blocks, positions % block_size]
            # [nkv, n * group, d]: query head h = kv head h // group, row t * group + h % group
            queries = (q[starts[b]:starts[b + 1]].reshape(num_new, num_kv_heads, group, head_dim)
                       .transpose(1, 0, 2, 3).reshape(num_kv_heads, num_new * group, head_dim))
            scores = np.matmul(queries, keys.transpose(1, 2, 0)) * np.float32(scale)  # [nkv, n*g, S]
            if softcap is not None:
                scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
            query_positions = np.repeat(np.arange(seq_len - num_new, seq_len), group)  # [n*g]
            visible = positions[None, :] <= query_positions[:, None]
            if window is not None:
                visible &= positions[None, :] > query_positions[:, None] - window
            scores = np.where(visible[None], scores, -np.inf)
            scores -= scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            attended = np.matmul(probs, values.transpose(1, 0, 2))    # [nkv, n * g, d]
            out[starts[b]:starts[b + 1]] = (attended.reshape(num_kv_heads, num_new, group, head_dim)
                                            .transpose(1, 0, 2, 3).reshape(num_new, num_heads * head_dim))

    def act_and_mul(self, gate_up, out, act="silu"):
        gate, up = np.split(gate_up, 2, axis=-1)
        out[...] = ACTIVATIONS[act](gate) * up

    def softcap(self, x, cap):
        x[...] = np.float32(cap) * np.tanh(x / np.float32(cap))

    def gather_rows(self, x, indices, out):
        out[...] = x[indices]

    def device_array(self, host):
        return np.asarray(host)

    def token_logprobs(self, logits, targets, k, values, ids, ranks):
        targets = np.asarray(targets)
        result = logprobs(logits, targets, np.arange(logits.shape[0]), k)
        values[...] = result.values
        ids[...] = result.ids
        ranks[...] = token_ranks(logits, targets)

    def sample(self, logits, sampling: SamplingTensors) -> np.ndarray:
        return self.sample_async(logits, sampling).get()

    def sample_async(self, logits, sampling: SamplingTensors) -> "SampledTokens":
        """The CPU computes synchronously: the tokens are ready when this returns (those of
        deferred rows once sample_masked has drawn them). Rows with device state
        (sampling.state_slot) have their logits processed in place first (penalized_logits),
        and their kept tokens counted after."""
        if sampling.processes_logits:
            self._process_logits(logits, sampling)
        tokens = np.argmax(logits, axis=-1).astype(np.int32)
        sampled = sampling.temperature > 0
        if sampling.deferred is not None:
            sampled &= ~sampling.deferred
        for b in np.flatnonzero(sampled):
            tokens[b] = draw(logits[b], sampling, b)
        self._count_kept(tokens, sampling, None if sampling.deferred is None else ~sampling.deferred)
        self._last_sampled = tokens
        if sampling.deferred is not None and sampling.deferred.any():
            pending = SampledTokens(tokens)
            pending.deferred_inputs = (logits, sampling)  # for sample_masked
            return pending
        rows, k = sampling.logprob_rows()
        return SampledTokens(tokens, logprobs(logits, tokens, rows, k) if rows.size else None)

    def sample_masked(self, pending: SampledTokens, rows, bitmask) -> None:
        logits, sampling = pending.deferred_inputs
        tokens = pending.get()  # the array the next step's placeholders read (_last_sampled)
        rows = np.asarray(rows, dtype=np.intp)
        masked = logits[rows]  # a copy: the raw logits stay for the log-probabilities
        apply_token_bitmask(masked, bitmask[:rows.size])
        for i, b in enumerate(rows):
            tokens[b] = draw(masked[i], sampling, b)
        drawn = np.zeros(tokens.shape[0], bool)
        drawn[rows] = True
        self._count_kept(tokens, sampling, drawn)
        asked, k = sampling.logprob_rows()
        pending.set_logprobs(logprobs(logits, tokens, asked, k) if asked.size else None)

    def _process_logits(self, logits, sampling: SamplingTensors) -> None:
        """Rebuild the slots sampling.resets names, then apply each state row's biases,
        bans and penalties to its logits (in place)."""
        if not hasattr(self, "_state"):
            self._state = {}
        vocab = logits.shape[1]
        for reset in sampling.resets or ():
            self._state[reset.slot] = SlotState.made(reset, vocab, self._last_sampled)
        steps, min_tokens = sampling.row("steps"), sampling.row("min_tokens")
        num_biases, num_min_bans = sampling.row("num_biases"), sampling.row("num_min_bans")
        for b in np.flatnonzero(sampling.state_slot >= 0).tolist():
            state = self._state[int(sampling.state_slot[b])]
            count = num_biases[b] + (num_min_bans[b] if steps[b] < min_tokens[b] else 0)
            logits[b] = penalized_logits(
                logits[b], state.prompt_seen, state.counts,
                float(sampling.row("repetition_penalty")[b]),
                float(sampling.row("frequency_penalty")[b]),
                float(sampling.row("presence_penalty")[b]),
                state.bias_ids[:count], state.bias_values[:count])

    def _count_kept(self, tokens, sampling: SamplingTensors, drawn=None) -> None:
        """Add each kept token (count_token) to its slot's counts; drawn: the rows whose
        tokens this call drew (None: all)."""
        if not sampling.processes_logits:
            return
        kept = sampling.row("count_token") != 0
        if drawn is not None:
            kept &= drawn
        for b in np.flatnonzero(kept).tolist():
            self._state[int(sampling.state_slot[b])].counts[tokens[b]] += 1


def draw(logits_row, sampling: SamplingTensors, b: int) -> int:
    """Row b's token from its logits under its settings (argmax at temperature 0; a row
    whose every logit is -inf or NaN gives token 0, as the kernel's argmax does)."""
    temperature = float(sampling.temperature[b])
    if not temperature > 0 or not np.isfinite(logits_row).any():
        return int(np.argmax(np.where(np.isnan(logits_row), -np.inf, logits_row)))
    probs = filtered_probs(logits_row, temperature, int(sampling.top_k[b]),
                           float(sampling.top_p[b]), float(sampling.min_p[b]))
    rng = np.random.default_rng([int(sampling.seeds[b]), int(sampling.steps[b])])
    return int(rng.choice(probs.shape[0], p=probs))


class SlotState:
    """A slot's penalty state on the CPU (interface.SlotReset)."""

    def __init__(self, prompt_seen, counts, bias_ids, bias_values):
        self.prompt_seen, self.counts = prompt_seen, counts
        self.bias_ids, self.bias_values = bias_ids, bias_values

    @classmethod
    def made(cls, reset: SlotReset, vocab: int, last_sampled: np.ndarray) -> "SlotState":
        prompt_seen = np.zeros(vocab, bool)
        prompt_seen[np.asarray(reset.prompt_token_ids, np.int64)] = True
        output = np.asarray(reset.output_token_ids, np.int64)
        pending = output < 0  # the token the last sampling call picked for row -id - 1
        output[pending] = last_sampled[-output[pending] - 1]
        counts = np.bincount(output, minlength=vocab).astype(np.int32)
        return cls(prompt_seen, counts, np.asarray(reset.bias_ids, np.int64),
                   np.asarray(reset.bias_values, np.float32))


def penalized_logits(logits, prompt_seen, counts, repetition: float, frequency: float,
                     presence: float, bias_ids, bias_values) -> np.ndarray:
    """One row's logits [V] after its bias entries (added; -inf bans), then the penalties,
    in float32 as vLLM applies them: repetition divides a positive logit (multiplies a
    negative one) of each token in the prompt or the output, then frequency * count and
    presence * (count > 0) of the output are subtracted."""
    x = np.asarray(logits, np.float32).copy()
    x[bias_ids] += np.asarray(bias_values, np.float32)
    counts = np.asarray(counts)
    seen = np.asarray(prompt_seen, bool) | (counts > 0)
    p = np.float32(repetition)
    x = np.where(seen, np.where(x > 0, x / p, x * p), x).astype(np.float32)
    penalty = np.float32(frequency) * counts.astype(np.float32) + \
        np.float32(presence) * (counts > 0).astype(np.float32)
    return (x - penalty).astype(np.float32)


def logprobs(logits, tokens, rows: np.ndarray, k: int) -> Logprobs:
    """The raw log-softmax (float64) of each row in rows: the sampled token's value and the k
    largest, best first, ties to the lower id (as logprobs.cu orders them)."""
    ids = np.empty((rows.size, 1 + k), np.int32)
    values = np.empty((rows.size, 1 + k), np.float64)
    for i, row in enumerate(rows):
        x = logits[row].astype(np.float64)
        x = np.where(np.isnan(x), -np.inf, x)
        top = x.max()
        log_softmax = x - (top + np.log(np.sum(np.exp(x - top))))
        best = np.argsort(-log_softmax, kind="stable")[:k]
        ids[i, 0], values[i, 0] = tokens[row], log_softmax[tokens[row]]
        ids[i, 1:], values[i, 1:] = best, log_softmax[best]
    return Logprobs(rows, ids, values)


def token_ranks(logits, tokens) -> np.ndarray:
    """Each row's token's place in the row (1: the most likely): 1 + the logits that rank
    before it, larger or equal with a lower id (as logprobs.cu orders them; NaN as -inf)."""
    x = np.where(np.isnan(logits), -np.inf, logits)
    own = x[np.arange(x.shape[0]), tokens][:, None]
    ids = np.arange(x.shape[1])[None, :]
    before = (x > own) | ((x == own) & (ids < np.asarray(tokens)[:, None]))
    return (1 + before.sum(axis=1)).astype(np.int32)


def normed(x, weight, eps, offset=0.0):
    """RMSNorm over the last axis, in float32: x / sqrt(mean(x^2) + eps) * (offset + weight)."""
    variance = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    return x / np.sqrt(variance + np.float32(eps)) * (np.float32(offset) + weight)


def gelu_tanh(x):
    """GELU, tanh approximation (transformers' gelu_pytorch_tanh)."""
    inner = np.float32(math.sqrt(2.0 / math.pi)) * (x + np.float32(0.044715) * x * x * x)
    return np.float32(0.5) * x * (np.float32(1) + np.tanh(inner))


ACTIVATIONS = {"silu": lambda gate: gate / (np.float32(1) + np.exp(-gate)), "gelu_tanh": gelu_tanh}


def rotate(x, cos, sin):
    """Half-split RoPE: pairs (i, i + d/2). x [T, heads, d]; cos, sin [T, 1, d/2]."""
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def filtered_probs(logits, temperature, top_k, top_p, min_p) -> np.ndarray:
    """Probabilities after temperature, then min-p, top-k and top-p filtering, in vLLM's
    order (top-p takes its share of the mass the others kept); filtered tokens get
    probability 0 and the rest are renormalized."""
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.ones(probs.shape[0], dtype=bool)
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
    if 0 < top_k < probs.shape[0]:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        sorted_probs = np.where(keep[order], probs[order], 0.0)
        sorted_probs /= sorted_probs.sum()
        before = np.cumsum(sorted_probs) - sorted_probs  # mass of strictly more likely tokens
        keep[order[before >= top_p]] = False
    keep[order[0]] = True  # the most likely token always survives
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()
