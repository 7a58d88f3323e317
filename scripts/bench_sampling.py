"""The sampling kernel, and batch-1 decode with sampling, timed on the GPU (the numbers of
benchmarks/NOTES.md, change 17).

    python scripts/bench_sampling.py [--model DIR] [--json OUT]

Kernel: the sampling kernel alone, 16 calls in a CUDA graph (at batch 1 each call takes
another row, at batch 16 every call all 16), logits in L2, median us per call, for greedy,
temperature 0.6 with top-p 0.9 (Llama-3.2-Instruct's generation config) or 0.95,
temperature 0.8 with top-k 50 and top-p 0.9, and temperature 1.0 with no filter. Rows:
"peaked" (a N(0, 1.5^2) bulk of 128,256 logits and 60-400 tokens at 25 and more), "flat"
(N(0, 3^2): every token is a candidate, so the passes read the whole row) and, with
--model, 16 of the model's own next-token rows, captured while it answers chat prompts
with temperature 0.6 and top-p 0.9. Beside each time: how many rows the candidate slots
served. With --model also the candidate counts of every captured row (tokens within
16 temperatures of the maximum logit) and batch-1 decode tok/s of a chat reply (256
tokens, end of sequence ignored), greedy and with temperature 0.6 and top-p 0.9.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cupy_llama.backends.cuda.sampling import CANDIDATE_CUT  # noqa: E402

VOCAB = 128256
CASES = {  # name: (temperature, top_k, top_p)
    "greedy": (0.0, 0, 1.0),
    "t0.6 top-p 0.9": (0.6, 0, 0.9),
    "t0.6 top-p 0.95": (0.6, 0, 0.95),
    "t0.8 top-k 50 top-p 0.9": (0.8, 50, 0.9),
    "t1.0 no filter": (1.0, 0, 1.0),
}
CHAT_PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.",
                "Explain how a bicycle works.", "List three fruits and their colors.",
                "Tell me a story about a dragon who learns to cook."]


def peaked_rows(rng, rows: int, vocab: int) -> np.ndarray:
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 1.5
    for r in range(rows):
        near = int(rng.integers(60, 400))
        top = rng.choice(vocab, near, replace=False)
        logits[r, top] = 25 + np.round(rng.exponential(0.75, near) * 4) / 4
    return logits


def time_kernel(cupy, sampling, rows: np.ndarray) -> dict:
    """{batch: {case: (us per call, rows the slots served)}}"""
    import perf  # scripts/perf.py, beside this file
    logits = cupy.asarray(rows)
    result = {}
    for batch in (1, 16):
        views = [logits[i:i + 1] for i in range(16)] if batch == 1 else [logits] * 16
        tokens = cupy.zeros(batch, np.int32)
        result[batch] = {}
        for name, (temperature, top_k, top_p) in CASES.items():
            settings = sampling.pack_settings(batch, temperature=temperature, top_k=top_k,
                                              top_p=top_p, min_p=0.0,
                                              seeds=np.arange(batch, dtype=np.uint64), steps=0)
            used, served = cupy.zeros(batch, np.int32), 0
            for view in views:
                sampling.sample_settings(view, settings, batch, tokens, used_slots=used)
                served += int(used.sum())
            us = perf.graph_us_per_call(
                cupy, lambda view: sampling.sample_settings(view, settings, batch, tokens), views)
            result[batch][name] = (us, served)
    return result


def capture_rows(llm, cupy) -> list:
    """The model's next-token logits rows while it answers CHAT_PROMPTS, one per step."""
    from cupy_llama import SamplingParams
    from cupy_llama.backends.cuda.ops import CudaOps
    rows = []
    original = CudaOps.sample_async

    def recording(self, logits, sampling):
        rows.append(cupy.asnumpy(logits[0]))
        return original(self, logits, sampling)

    CudaOps.sample_async = recording
    try:
        for prompt in CHAT_PROMPTS:
            llm.chat([{"role": "user", "content": prompt}],
                     SamplingParams(temperature=0.6, top_p=0.9, max_tokens=40, seed=1))
    finally:
        CudaOps.sample_async = original
    return rows


def candidate_counts(rows: list, temperature: float = 0.6) -> dict:
    counts = [int((row >= row.max() - CANDIDATE_CUT * temperature).sum()) for row in rows]
    return {"rows": len(counts), "median": statistics.median(counts),
            "p90": float(np.percentile(counts, 90)), "max": max(counts)}


def decode_rates(llm) -> dict:
    from cupy_llama import SamplingParams
    from cupy_llama.bench import offline as bench
    text = ("Write a long, detailed story about a lighthouse keeper who finds a strange map "
            "washed up on the shore, and the journey it leads her on.")
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": text}])
    rates = {}
    for name, params in (
            ("greedy", SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)),
            ("t0.6 top-p 0.9", SamplingParams(temperature=0.6, top_p=0.9, max_tokens=256,
                                              ignore_eos=True, seed=1))):
        runs = [r["tok_s"] for r in bench.batch1_runs(llm, lambda: list(ids), params)[1]]
        rates[name] = {"tok_s": statistics.median(runs), "runs": runs}
    return rates


def print_kernel(label: str, timings: dict) -> None:
    for batch, cases in timings.items():
        cells = []
        for name, (us, served) in cases.items():
            cells.append(f"{name} {us:.1f} [{served}/{16 * batch}]")
        print(f"{label} batch {batch}, us per call [rows the slots served]: " + " | ".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (for its own logits and decode rates)")
    parser.add_argument("--json", help="write every number here")
    args = parser.parse_args()
    import cupy
    from cupy_llama.backends.cuda import sampling

    rng = np.random.default_rng(0)
    report = {"kernel": {}}
    for label, rows in (("peaked", peaked_rows(rng, 16, VOCAB)),
                        ("flat", rng.standard_normal((16, VOCAB)).astype(np.float32) * 3)):
        report["kernel"][label] = time_kernel(cupy, sampling, rows)
        print_kernel(label, report["kernel"][label])
    if args.model:
        from cupy_llama import LLM
        llm = LLM(args.model, device="cuda", max_num_seqs=8, log=lambda *a, **k: None)
        rows = capture_rows(llm, cupy)
        report["candidates"] = candidate_counts(rows)
        print(f"model rows: {report['candidates']}")
        picked = np.stack([rows[i] for i in np.linspace(0, len(rows) - 1, 16).astype(int)])
        report["kernel"]["model"] = time_kernel(cupy, sampling, picked)
        print_kernel("model", report["kernel"]["model"])
        report["decode"] = decode_rates(llm)
        for name, rate in report["decode"].items():
            print(f"batch-1 decode, {name}: {rate['tok_s']:,.1f} tok/s "
                  f"({1e3 / rate['tok_s']:.3f} ms per token)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
