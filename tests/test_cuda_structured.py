"""The sampling kernel under structured-output bitmasks (cuda_src/sampling.cu, "Structured
outputs") against the NumPy reference (structured.apply_token_bitmask, then the same
draw): greedy rows pick the masked argmax, sampled rows only allowed tokens with the
masked distribution's frequencies, unconstrained rows are untouched, and the two launches
of a step (CudaOps.sample_async leaving the deferred rows, sample_masked drawing them)
give every row its token with the log-probabilities of the raw logits. Needs CuPy and a
CUDA GPU; skipped elsewhere."""
from __future__ import annotations

import numpy as np
import pytest

from cupy_llama.backends.numpy_ops import NumpyOps, filtered_probs
from cupy_llama.interface import SamplingTensors
from cupy_llama.structured import apply_token_bitmask, bitmask_words
from test_cuda_ops import _gpu_available, cp, rng  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")]


def random_bitmask(rng, rows, vocab, density):
    """[rows, words] uint32 with each token allowed with probability `density` (at least
    one per row); bits past the vocabulary set, which the kernel must ignore."""
    words = bitmask_words(vocab) + 1  # a wider row than needed: the stride is the row's
    bits = rng.random((rows, words * 32)) < density
    bits[np.arange(rows), rng.integers(0, vocab, rows)] = True
    bits[:, vocab:] = True
    return np.packbits(bits, axis=1, bitorder="little").view("<u4").astype(np.uint32)


def settings(cp, n, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None):
    full = lambda value, dtype: cp.asarray(np.broadcast_to(np.asarray(value, dtype), (n,)).copy())
    return (full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32),
            full(min_p, np.float32), full(0 if seeds is None else seeds, np.uint64),
            cp.zeros(n, np.int32))


@pytest.mark.parametrize("vocab", [128256, 1001])
def test_masked_greedy_is_the_masked_argmax(cp, rng, vocab):
    """mask_rows: -1 rows read nothing, r >= 0 rows their bitmask row, MASK_SKIP rows are
    left alone; masked greedy equals argmax of the reference's masked logits."""
    from cupy_llama.backends.cuda import sampling
    num_seqs = 8
    logits = rng.standard_normal((num_seqs, vocab), dtype=np.float32) * 4
    bitmask = random_bitmask(rng, 3, vocab, density=0.01)
    mask_rows = np.array([0, -1, 2, sampling.MASK_SKIP, 1, 0, -1, 2], np.int32)
    out = cp.full(num_seqs, -7, np.int32)
    sampling.sample(cp.asarray(logits), *settings(cp, num_seqs), out,
                    bitmask=cp.asarray(bitmask), mask_rows=cp.asarray(mask_rows))
    expected = logits.copy()
    apply_token_bitmask(expected, bitmask, mask_rows)
    tokens = cp.asnumpy(out)
    drawn = mask_rows != sampling.MASK_SKIP
    np.testing.assert_array_equal(tokens[drawn], np.argmax(expected, axis=-1)[drawn])
    assert tokens[3] == -7, "a MASK_SKIP row was written"


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                    dict(temperature=1.3, top_p=0.8), dict(temperature=1.0, min_p=0.2)])
def test_masked_draws_follow_the_masked_distribution(cp, rng, params):
    """Many seeds on one row under one mask: no disallowed token ever, and frequencies that
    match filtered_probs of the masked logits (chi-square)."""
    from cupy_llama.backends.cuda import sampling
    vocab, draws = 300, 40000
    logits = rng.standard_normal(vocab).astype(np.float32) * 1.5
    bitmask = random_bitmask(rng, 1, vocab, density=0.1)
    masked = logits[None].copy()
    apply_token_bitmask(masked, bitmask)
    expected = filtered_probs(masked[0], params["temperature"], params.get("top_k", 0),
                              params.get("top_p", 1.0), params.get("min_p", 0.0))
    out = cp.full(draws, -1, np.int32)
    sampling.sample(cp.asarray(np.broadcast_to(logits, (draws, vocab)).copy()),
                    *settings(cp, draws, seeds=rng.integers(0, 2**63, draws), **params), out,
                    bitmask=cp.asarray(bitmask), mask_rows=cp.zeros(draws, np.int32))
    counts = np.bincount(cp.asnumpy(out), minlength=vocab)
    assert counts.size == vocab
    assert counts[expected == 0].sum() == 0, "a disallowed or filtered token was drawn"
    wanted = expected * draws
    common = wanted >= 5
    chi2 = float(((counts[common] - wanted[common]) ** 2 / wanted[common]).sum())
    dof = max(1, int(common.sum()) - 1)
    assert chi2 < dof + 6 * np.sqrt(2 * dof) + 10, (chi2, dof)


def test_deferred_rows_are_drawn_by_the_second_launch(cp, rng):
    """sample_async leaves the deferred rows to sample_masked; the other rows get the
    tokens of a plain call, the deferred ones their masked argmax, and log-probabilities
    are those of the raw logits for every row that asks."""
    from cupy_llama.backends.cuda.ops import CudaOps
    num_seqs, vocab = 6, 32000
    ops = CudaOps(max_num_tokens=num_seqs, max_num_seqs=num_seqs, max_blocks_per_seq=1,
                  num_heads=1, head_dim=64, max_model_len=16)
    logits = rng.standard_normal((num_seqs, vocab), dtype=np.float32) * 3
    deferred = np.array([False, True, False, True, True, False])
    tensors = SamplingTensors(
        temperature=np.zeros(num_seqs, np.float32), top_k=np.zeros(num_seqs, np.int32),
        top_p=np.ones(num_seqs, np.float32), min_p=np.zeros(num_seqs, np.float32),
        seeds=np.arange(num_seqs, dtype=np.uint64), steps=np.zeros(num_seqs, np.int32),
        num_logprobs=np.array([2, 2, -1, 3, -1, -1], np.int32), deferred=deferred)
    bitmask = random_bitmask(rng, 2, vocab, density=0.05)
    for _ in range(3):  # the buffers are reused step after step
        pending = ops.sample_async(cp.asarray(logits), tensors)
        ops.sample_masked(pending, [1, 3], bitmask)  # row 4's sequence ended: no token
        tokens = pending.get()
        expected = logits.copy()
        apply_token_bitmask(expected, bitmask, [-1, 0, -1, 1, -1, -1])
        wanted = np.argmax(expected, axis=-1)
        np.testing.assert_array_equal(tokens[[0, 1, 2, 3, 5]], wanted[[0, 1, 2, 3, 5]])
        reference = NumpyOps().sample_async(logits, SamplingTensors(
            **{**tensors.__dict__, "deferred": None}))
        raw = reference.logprobs()
        got = pending.logprobs()
        np.testing.assert_array_equal(got.rows, raw.rows)
        for row in (0, 1, 3):
            token, value, top = got.of_row(row, 2)
            assert token == tokens[row]
            x = logits[row].astype(np.float64)
            log_softmax = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
            assert abs(value - log_softmax[token]) < 1e-3
            assert [t for t, _ in top] == [t for t, _ in raw.of_row(row, 2)[2]]


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_constrained_requests_through_the_cuda_engine(tmp_path, enforce_eager):
    """The engine on the GPU (graphs on and off): constrained requests beside plain ones,
    greedy and sampled, n > 1 and logprobs, each answer following its constraint."""
    pytest.importorskip("llguidance")
    import json
    import re

    from cupy_llama import LLM, SamplingParams
    from cupy_llama.bench.random_model import make_random_model
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["name", "age", "tags"], "additionalProperties": False}
    model_dir = make_random_model(tmp_path / "model", "tiny", seed=0, std=0.15)
    with LLM(model_dir, device="cuda", log=None, enforce_eager=enforce_eager) as llm:
        prompts = [f"Request {i}:" for i in range(12)]
        params = []
        for i in range(12):
            kind = i % 4
            structured = ({"json": schema}, {"regex": "[a-c]{3}-[0-9]{2}"},
                          {"choice": ["yes", "no"]}, None)[kind]
            params.append(SamplingParams(temperature=0.0 if i < 6 else 1.0, seed=i,
                                         max_tokens=300, structured=structured,
                                         n=2 if i == 5 else 1, logprobs=2 if i % 3 == 0 else None))
        outputs = llm.generate(prompts, params)
        index = 0
        for i, p in enumerate(params):
            for _ in range(p.n):
                output = outputs[index]
                index += 1
                kind = i % 4
                if kind == 0:
                    json.loads(output.text)  # and the schema's bounds:
                    value = json.loads(output.text)
                    assert 0 <= value["age"] <= 120 and len(value["name"]) <= 8
                elif kind == 1:
                    assert re.fullmatch("[a-c]{3}-[0-9]{2}", output.text), output.text
                elif kind == 2:
                    assert output.text in ("yes", "no")
                if kind != 3:
                    assert output.finish_reason == "stop", output.text
                if p.logprobs is not None:
                    assert len(output.logprobs) == len(output.token_ids)
