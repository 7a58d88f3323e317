"""The CUDA kernels of the penalties, biases and bans (sampling.cu, "penalties, biases and
bans") against the NumPy reference: slot state made from tokens (placeholders read from
the last sampled tokens), logits processed in place, bit for bit, kept tokens counted by
the sampling kernel; then the engine on the GPU against the CPU with every control on.
Needs CuPy and a CUDA GPU; skipped elsewhere."""
from __future__ import annotations

import numpy as np
import pytest

from cupy_llama import LLM, SamplingParams
from cupy_llama.backends.numpy_ops import penalized_logits
from cupy_llama.interface import SlotReset
from test_cuda_ops import _gpu_available, rng  # noqa: F401 (rng: a fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")]


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


def settings(cp, capacity, **rows):
    from cupy_llama.backends.cuda import sampling
    return sampling.pack_settings(capacity, **rows)


@pytest.mark.parametrize("vocab", [1000, 128256])
def test_state_and_processing_equal_the_reference(cp, rng, vocab):
    from cupy_llama.backends.cuda import sampling
    num_slots, B = 6, 5
    state = sampling.SlotState(cp, num_slots, vocab)
    last_sampled = rng.integers(0, vocab, 8).astype(np.int32)
    resets, expected = [], {}
    for slot in (4, 1, 3, 0):  # state_slot of rows 0..3; row 4 has none
        prompt = rng.integers(0, vocab, rng.integers(1, 300)).tolist()
        output = rng.integers(0, vocab, rng.integers(0, 40)).tolist() + [-3]  # row 2 of last
        always = rng.choice(vocab, 40, replace=False).tolist()
        bans = rng.choice(vocab, 3, replace=False).tolist()
        values = rng.uniform(-100, 100, 40).astype(np.float32).tolist()
        values[0] = -np.inf
        resets.append(SlotReset(slot, prompt, output, always + bans, values + [-np.inf] * 3))
        resolved = [last_sampled[-t - 1] if t < 0 else t for t in output]
        expected[slot] = (np.isin(np.arange(vocab), prompt), np.bincount(resolved, minlength=vocab),
                          always, values, bans)
    sampling.reset_state(state, resets, cp.asarray(last_sampled))
    for slot, (seen, counts, *_) in expected.items():
        np.testing.assert_array_equal(cp.asnumpy(state.counts[slot]), counts)
        np.testing.assert_array_equal(cp.asnumpy(state.prompt_seen[slot]).astype(bool), seen)
    logits = (rng.standard_normal((B, vocab)) * 4).astype(np.float32)
    rows = dict(state_slot=np.array([4, 1, 3, 0, -1], np.int32),
                repetition_penalty=np.array([1.3, 0.7, 1.0, 2.0, 1.5], np.float32),
                frequency_penalty=np.array([0.5, -1.0, 0.0, 2.0, 1.0], np.float32),
                presence_penalty=np.array([-0.5, 1.5, 0.0, 2.0, 1.0], np.float32),
                # each row's count of its slot's entries, as the model runner stages them
                num_biases=np.array([40, 40, 40, 40, 0], np.int32),
                num_min_bans=np.array([3, 3, 3, 3, 0], np.int32),
                min_tokens=np.array([5, 0, 5, 5, 0], np.int32),
                steps=np.array([4, 0, 5, 0, 0], np.int32))
    device = cp.asarray(logits)
    sampling.process_logits(device, settings(cp, B, **rows), B, state)
    got = cp.asnumpy(device)
    for b, slot in enumerate(rows["state_slot"].tolist()):
        if slot < 0:
            np.testing.assert_array_equal(got[b], logits[b])  # untouched
            continue
        seen, counts, always, values, bans = expected[slot]
        n = rows["num_biases"][b]
        ids, vals = list(always[:n]), list(values[:n])
        if rows["steps"][b] < rows["min_tokens"][b]:
            ids, vals = ids + bans, vals + [-np.inf] * len(bans)
        want = penalized_logits(logits[b], seen, counts, float(rows["repetition_penalty"][b]),
                                float(rows["frequency_penalty"][b]),
                                float(rows["presence_penalty"][b]), np.array(ids, int), vals)
        np.testing.assert_array_equal(got[b], want, err_msg=f"row {b}")


def test_the_sampling_kernel_counts_kept_tokens_only(cp, rng):
    from cupy_llama.backends.cuda import sampling
    vocab, B = 5000, 4
    state = sampling.SlotState(cp, 4, vocab)
    logits = rng.standard_normal((B, vocab)).astype(np.float32)
    rows = dict(state_slot=np.array([2, 0, -1, 3], np.int32),
                count_token=np.array([1, 0, 1, 1], np.int32),
                temperature=np.array([0.0, 0.0, 0.0, 0.8], np.float32),
                seeds=np.arange(B, dtype=np.uint64))
    tokens = cp.zeros(B, np.int32)
    sampling.sample_settings(cp.asarray(logits), settings(cp, B, **rows), B, tokens,
                             counts=state.counts)
    tokens = cp.asnumpy(tokens)
    assert tokens[0] == np.argmax(logits[0])
    expected = np.zeros((4, vocab), np.int32)
    expected[2, tokens[0]] = 1
    expected[3, tokens[3]] = 1
    np.testing.assert_array_equal(cp.asnumpy(state.counts), expected)


CONTROLS = [
    dict(repetition_penalty=1.3, frequency_penalty=0.6, presence_penalty=0.3),
    dict(logit_bias={77: 3.0, 12: -100}, min_tokens=4, stop_token_ids=[300]),
    dict(presence_penalty=2.0),
    dict(repetition_penalty=0.8, logit_bias={5: 1.5}),
]


def test_the_engine_on_the_gpu_equals_the_cpu_with_every_control(tmp_path):
    from cupy_llama.bench.random_model import make_random_model
    model_dir = make_random_model(tmp_path / "model", "tiny", seed=0, std=0.15)
    prompts = [list(range(10 + i, 40 + 3 * i)) for i in range(len(CONTROLS))]
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=24, **c) for c in CONTROLS]
    cpu = [o.token_ids for o in LLM(model_dir, device="cpu", log=None).generate(prompts, params)]
    gpu_llm = LLM(model_dir, device="cuda", log=None, gpu_memory_utilization=0.3)
    try:
        gpu = [o.token_ids for o in gpu_llm.generate(prompts, params)]
        n = gpu_llm.generate(prompts[0], SamplingParams(n=3, temperature=0, ignore_eos=True,
                                                        max_tokens=24, **CONTROLS[0]))
    finally:
        gpu_llm.close()
    # bf16 on the GPU against float32 on the CPU: the first few tokens of a tiny random
    # model agree (a near tie may flip later ones)
    for c, g in zip(cpu, gpu):
        assert g[:8] == c[:8]
    assert [o.token_ids for o in n] == [gpu[0]] * 3  # each sample its own counts


@pytest.mark.parametrize("logits_bytes, options, rows", [
    (None, {"max_num_seqs": 64}, 300),  # the whole prompt in one product
    (0, {"max_num_seqs": 64}, 64),  # pieces of max_num_seqs rows
    (None, {"max_num_seqs": 64, "max_num_batched_tokens": 128}, 128)])  # chunked
def test_prompt_logprobs_on_the_gpu_equal_the_cpu(tmp_path, monkeypatch, logits_bytes,
                                                  options, rows):
    """The pieces of the LM head and the log-probability kernel on the GPU (bf16 weights)
    against the CPU (float32): a prompt of 300 tokens, scored in one product, in pieces of
    max_num_seqs rows (the logits buffer held to its least), and in chunks."""
    from cupy_llama.backends.cuda import backend as cuda_backend
    from cupy_llama.bench.random_model import make_random_model
    if logits_bytes is not None:
        monkeypatch.setattr(cuda_backend, "SCORE_LOGITS_BYTES", logits_bytes)
    model_dir = make_random_model(tmp_path / "model", "tiny", seed=1, std=0.15)
    prompt = [(7 * i + 3) % 500 for i in range(300)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    cpu = LLM(model_dir, device="cpu", log=None).generate(prompt, params).prompt_logprobs
    llm = LLM(model_dir, device="cuda", log=None, gpu_memory_utilization=0.3, **options)
    try:
        assert min(llm.engine.backend.score_rows, len(prompt)) == rows
        gpu = llm.generate(prompt, params).prompt_logprobs
    finally:
        llm.close()
    assert gpu[0] is None and len(gpu) == len(cpu)
    got = np.array([e.logprob for e in gpu[1:]])
    want = np.array([e.logprob for e in cpu[1:]])
    # bf16 weights and activations: every value within the whole-model tolerance of the
    # other GPU-against-CPU tests (5e-2 of the values' scale), and most far closer (a row
    # scored at the wrong position would be off by units, not hundredths)
    diff = np.abs(got - want)
    assert diff.max() <= 5e-2 * np.abs(want).max(), diff.max()
    assert np.median(diff) <= 2e-2, np.median(diff)
    assert [e.token_id for e in gpu[1:]] == prompt[1:]
    # each token's place among all: the device's count, the same order as the CPU's up to
    # the places bf16 moves (near neighbours swap)
    gpu_ranks = np.array([e.rank for e in gpu[1:]])
    cpu_ranks = np.array([e.rank for e in cpu[1:]])
    assert gpu_ranks.min() >= 1 and gpu_ranks.max() <= llm.config.vocab_size
    assert np.corrcoef(gpu_ranks, cpu_ranks)[0, 1] > 0.95
