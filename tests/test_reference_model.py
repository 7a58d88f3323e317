"""The NumPy reference forward pass against Hugging Face transformers (float32).

Fixtures come from scripts/make_hf_fixtures.py: logits at a spread of positions of a
2,100-token prompt and 32 greedy tokens, for tiny random models covering GQA ratios 1, 3
and 4, tied and untied heads, and rope scaling none and llama3.
"""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from cupy_llama import LLM, SamplingParams
from cupy_llama.interface import ForwardBatch
from cupy_llama.backends.cpu import CpuBackend
from cupy_llama.models import model_for, read_config
from cupy_llama.bench.random_model import TINY, make_random_model
from cupy_llama.weights import open_checkpoint
from cupy_llama.util import cdiv

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = sorted(p.stem[3:] for p in FIXTURES.glob("hf_*.npz"))


def test_fixtures_present():
    assert len(NAMES) >= 3, "run scripts/make_hf_fixtures.py"


@pytest.fixture(scope="module", params=NAMES)
def case(request, tmp_path_factory):
    fixture = np.load(FIXTURES / f"hf_{request.param}.npz")
    overrides = json.loads(str(fixture["overrides"]))
    model_dir = make_random_model(tmp_path_factory.mktemp(request.param) / "model",
                                  dict(TINY, **overrides), seed=int(fixture["seed"]),
                                  std=float(fixture["std"]))
    digest = hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()
    assert digest == str(fixture["weights_sha256"]), \
        "random weights differ from the fixture's; rerun scripts/make_hf_fixtures.py"
    return model_dir, fixture


def prefill_batch(prompt: np.ndarray, block_table: np.ndarray, block_size: int) -> ForwardBatch:
    """One sequence, whole prompt in one step, every position's logits wanted: each token
    is presented as the last token of its own 'sequence' sharing one block table."""
    n = len(prompt)
    positions = np.arange(n, dtype=np.int32)
    slots = block_table[positions // block_size] * block_size + positions % block_size
    return ForwardBatch(token_ids=prompt.astype(np.int32), positions=positions,
                        slot_mapping=slots.astype(np.int32),
                        query_start_loc=np.array([0, n], np.int32),
                        seq_lens=np.array([n], np.int32), block_tables=block_table[None],
                        max_query_len=n, max_seq_len=n)


def test_long_prompt_logits_match_transformers(case):
    """All fixture rows from ONE prefill of 2,100 tokens (RoPE errors show at long positions)."""
    model_dir, fixture = case
    config = read_config(model_dir)
    with open_checkpoint(model_dir, model_for(config)) as checkpoint:
        backend = CpuBackend(model_for(config), checkpoint, max_model_len=4096, max_num_seqs=1,
                             num_kv_blocks=140)
    prompt = fixture["long_prompt"]
    positions = fixture["logit_positions"]
    n = len(prompt)
    block_table = np.arange(cdiv(n, 16), dtype=np.int32)[::-1].copy()  # reversed blocks
    batch = prefill_batch(prompt, block_table, 16)
    # ask for the rows at `positions` by making each a "last token" of a query range
    starts = np.concatenate([[0], positions + 1]).astype(np.int32)
    batch = ForwardBatch(
        token_ids=batch.token_ids, positions=batch.positions, slot_mapping=batch.slot_mapping,
        query_start_loc=starts, seq_lens=(positions + 1).astype(np.int32),
        block_tables=np.repeat(block_table[None], len(positions), axis=0),
        max_query_len=int(np.diff(starts).max()), max_seq_len=n)
    logits = backend.model.forward(backend, batch)
    diff = np.abs(logits - fixture["logits"])
    assert diff.max() < 1e-3, f"max abs logit difference {diff.max():.2e} at row {diff.max(1).argmax()}"


@pytest.mark.parametrize("which", ["short", "long"])
def test_greedy_matches_transformers(case, which):
    """Through the whole engine: chunked prefill (2,048-token budget), then paged decode with
    block size 16."""
    model_dir, fixture = case
    llm = LLM(model_dir, device="cpu", max_num_batched_tokens=1024, block_size=16, log=lambda m: None)
    prompt = fixture[f"{which}_prompt"].tolist()
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert out.token_ids == fixture[f"greedy_{which}"].tolist()
    assert out.finish_reason == "length"
