"""The whole model on the GPU against transformers' float32 fixtures (the tiny random
models of tests/test_reference_model.py): logits of a 2,100-token prompt within bf16
accuracy, and greedy continuations through the engine (chunked prefill, CUDA-graph
decode) on at least 7 of the 8 fixture runs."""
import numpy as np
import pytest

from test_cuda_ops import pytestmark  # noqa: F401  (gpu marker, skipped without a GPU)
from test_reference_model import NAMES, case, prefill_batch  # noqa: F401

from cupy_llama import LLM, SamplingParams
from cupy_llama.backends.base import ForwardBatch
from cupy_llama.model.llama import forward


def test_long_prompt_logits_on_the_gpu(case):
    model_dir, fixture = case
    llm = LLM(model_dir, device="cuda", max_model_len=4096, max_num_batched_tokens=4096,
              max_num_seqs=64, num_kv_blocks=512, log=lambda m: None)
    prompt, positions = fixture["long_prompt"], fixture["logit_positions"]
    n = len(prompt)
    block_table = np.arange(-(-n // 16), dtype=np.int32)[::-1].copy()
    full = prefill_batch(prompt, block_table, 16)
    starts = np.concatenate([[0], positions + 1]).astype(np.int32)
    batch = ForwardBatch(
        token_ids=full.token_ids, positions=full.positions, slot_mapping=full.slot_mapping,
        query_start_loc=starts, seq_lens=(positions + 1).astype(np.int32),
        block_tables=np.repeat(block_table[None], len(positions), axis=0),
        max_query_len=int(np.diff(starts).max()), max_seq_len=n)
    logits = forward(llm.backend, llm.config, batch).get()
    expected = fixture["logits"]
    # bf16 weights are exact; activations rounded to bf16 give errors of a few 1e-3 of the
    # logit range
    scale = np.abs(expected).max()
    assert np.abs(logits - expected).max() < 0.03 * scale
    assert (logits.argmax(1) == expected.argmax(1)).mean() >= 0.9


def test_greedy_on_the_gpu_matches_transformers():
    import json
    from pathlib import Path
    from cupy_llama.random_model import TINY, make_random_model
    import tempfile

    identical, runs = 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in NAMES:
            fixture = np.load(Path(__file__).parent / "fixtures" / f"hf_{name}.npz")
            overrides = json.loads(str(fixture["overrides"]))
            model_dir = make_random_model(Path(tmp) / name, dict(TINY, **overrides),
                                          seed=int(fixture["seed"]), std=float(fixture["std"]))
            llm = LLM(model_dir, device="cuda", max_model_len=4096, max_num_batched_tokens=1024,
                      max_num_seqs=8, num_kv_blocks=512, log=lambda m: None)
            params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
            for which in ("short", "long"):
                out = llm.generate(fixture[f"{which}_prompt"].tolist(), params)
                identical += out.token_ids == fixture[f"greedy_{which}"].tolist()
                runs += 1
    print(f"greedy identical to transformers float32: {identical} of {runs}")
    assert identical >= runs - 1
