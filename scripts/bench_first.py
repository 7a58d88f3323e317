"""First GPU numbers, before CUDA graphs: batch-1 decode tok/s (32-token prompt, 256 new
tokens) and the time of a 1,024-token prefill, for cupy-llama and, in the same process,
Hugging Face transformers on the same weights.

    python scripts/bench_first.py MODEL_DIR [--json OUT] [--commit SHA] [--no-hf]

Decode tok/s counts the tokens after the first over the time after the first (the clock
starts at the first token); prefill time is the time to the first token of a request
with max_tokens=1. Each figure is the median of several runs after a warm-up.
"""
import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cupy_llama import LLM, SamplingParams  # noqa: E402

PROMPT_LEN, NEW_TOKENS, PREFILL_LEN = 32, 256, 1024


def median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_ours(llm, rng):
    prompt = rng.integers(0, 10000, PROMPT_LEN).tolist()
    decode_rates = []
    for _ in range(4):
        stamps = []
        for out in llm.stream(prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)):
            stamps.append(time.perf_counter())
        decode_rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    long_prompt = rng.integers(0, 10000, PREFILL_LEN).tolist()
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(long_prompt, one)  # warm-up
    prefill = median_time(lambda: llm.generate(long_prompt, one), 7)
    return {"decode_tok_s": statistics.median(decode_rates[1:]), "prefill_1024_ms": prefill * 1e3}


def bench_hf(model_dir, rng):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    prompt = torch.tensor([rng.integers(0, 10000, PROMPT_LEN).tolist()], device="cuda")
    long_prompt = torch.tensor([rng.integers(0, 10000, PREFILL_LEN).tolist()], device="cuda")

    def generate(ids, n):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()

    generate(prompt, 8)
    full = median_time(lambda: generate(prompt, NEW_TOKENS), 2)
    first = median_time(lambda: generate(prompt, 1), 3)
    decode = (NEW_TOKENS - 1) / (full - first)

    def prefill():
        with torch.no_grad():
            model(long_prompt)
        torch.cuda.synchronize()

    prefill()
    return {"decode_tok_s": decode, "prefill_1024_ms": median_time(prefill, 7) * 1e3}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--json")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--no-hf", action="store_true")
    args = parser.parse_args()

    import cupy
    t0 = time.perf_counter()
    llm = LLM(args.model_dir, device="cuda", max_num_seqs=8)
    load_s = time.perf_counter() - t0
    ours = bench_ours(llm, np.random.default_rng(0))
    result = {
        "what": "first numbers, eager (no CUDA graphs)",
        "command": "python scripts/bench_first.py " + " ".join(sys.argv[1:]),
        "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "commit": args.commit, "python": platform.python_version(), "cupy": cupy.__version__,
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "numpy": np.__version__,
        "model": json.loads((Path(args.model_dir) / "config.json").read_text()),
        "settings": {"prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "prefill_len": PREFILL_LEN},
        "load_seconds": round(load_s, 2), "cupy_llama": ours,
    }
    del llm
    if not args.no_hf:
        import transformers
        result["transformers_version"] = transformers.__version__
        result["transformers"] = bench_hf(args.model_dir, np.random.default_rng(0))
        result["ratio_decode"] = ours["decode_tok_s"] / result["transformers"]["decode_tok_s"]
        result["ratio_prefill_speedup"] = result["transformers"]["prefill_1024_ms"] / ours["prefill_1024_ms"]
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
