"""What FP8 weights cost in accuracy: a model with its projections quantized to FP8 at load
against the same model in bf16, teacher-forced over a text, and their greedy answers to
README's questions.

    python scripts/fp8_accuracy.py MODEL_DIR [--device cpu|cuda] [--tokens 2048] [--json OUT]

For every position of the text (README.md and docs/ARCHITECTURE.md, tokenized, the first
--tokens tokens) both models give their next-token distribution; the report has the share
of positions where their most likely tokens agree, the mean and largest KL divergence
KL(bf16 || fp8) in nats, and each model's perplexity on the text. The NumPy backend
computes with the e4m3 values exactly (cupy_llama/fp8.py), so `--device cpu` measures the
format itself; `--device cuda` measures the GPU's kernels.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cupy_llama import LLM, SamplingParams  # noqa: E402
from cupy_llama.interface import ForwardBatch  # noqa: E402

QUESTIONS = ("What is the capital of France?", "What is 2 + 2?")
CHUNK = 128  # positions per forward pass (each its own row of logits)
BLOCK_SIZE = 16


def text_ids(llm, tokens: int) -> list[int]:
    text = "\n\n".join((ROOT / name).read_text(encoding="utf-8")
                       for name in ("README.md", "docs/ARCHITECTURE.md"))
    ids = llm.tokenizer.encode(text)
    if len(ids) < tokens + 1:
        raise SystemExit(f"the text holds {len(ids)} tokens, fewer than --tokens {tokens} + 1")
    return ids[:tokens + 1]


def log_softmax_rows(llm, ids: list[int]) -> np.ndarray:
    """float64 log-probabilities [len(ids) - 1, V] of the next token at every position:
    CHUNK positions a step, each a sequence of its own that reads the cache the positions
    before it wrote (one block table for all)."""
    backend = llm.engine.backend
    n = len(ids) - 1
    table = np.arange(-(-n // BLOCK_SIZE), dtype=np.int32)
    rows = []
    for start in range(0, n, CHUNK):
        positions = np.arange(start, min(n, start + CHUNK), dtype=np.int32)
        count = len(positions)
        batch = ForwardBatch(
            token_ids=np.array(ids, np.int32)[positions], positions=positions,
            slot_mapping=(table[positions // BLOCK_SIZE] * BLOCK_SIZE
                          + positions % BLOCK_SIZE).astype(np.int32),
            query_start_loc=np.arange(count + 1, dtype=np.int32), seq_lens=positions + 1,
            block_tables=np.repeat(table[None], count, axis=0), max_query_len=1,
            max_seq_len=int(positions[-1]) + 1)
        logits = backend.forward(batch)
        logits = np.asarray(logits.get() if hasattr(logits, "get") else logits, np.float64)
        top = logits.max(axis=1, keepdims=True)
        rows.append(logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True)))
    return np.concatenate(rows)


def answers(llm) -> list[str]:
    greedy = SamplingParams(temperature=0, max_tokens=48)
    return [llm.chat([{"role": "user", "content": q}], greedy).text for q in QUESTIONS]


def measure(model_dir: str, device: str, tokens: int, quantization) -> tuple[np.ndarray, list[str], list[int]]:
    started = time.perf_counter()
    with LLM(model_dir, device=device, quantization=quantization, max_num_seqs=CHUNK,
             max_model_len=tokens + 64, num_kv_blocks=-(-(tokens + 64) // BLOCK_SIZE) + 8,
             enable_prefix_caching=False) as llm:
        ids = text_ids(llm, tokens)
        logprobs = log_softmax_rows(llm, ids)
        replies = answers(llm)
    print(f"{quantization or 'bf16'}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return logprobs, replies, ids


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    bf16, bf16_answers, ids = measure(args.model_dir, args.device, args.tokens, None)
    fp8, fp8_answers, _ = measure(args.model_dir, args.device, args.tokens, "fp8")
    targets = np.array(ids[1:])
    kl = np.sum(np.exp(bf16) * (bf16 - fp8), axis=1)
    position = np.arange(len(targets))
    report = {
        "model_dir": args.model_dir, "device": args.device, "positions": int(len(targets)),
        "text": "README.md + docs/ARCHITECTURE.md",
        "top1_agreement": float(np.mean(bf16.argmax(1) == fp8.argmax(1))),
        "kl_mean_nats": float(kl.mean()), "kl_p99_nats": float(np.quantile(kl, 0.99)),
        "kl_max_nats": float(kl.max()),
        "perplexity_bf16": float(np.exp(-bf16[position, targets].mean())),
        "perplexity_fp8": float(np.exp(-fp8[position, targets].mean())),
        "answers": [{"question": q, "bf16": a, "fp8": b}
                    for q, a, b in zip(QUESTIONS, bf16_answers, fp8_answers)],
    }
    print(json.dumps(report, indent=2))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
