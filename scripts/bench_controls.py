"""What the sampling controls and prompt log-probabilities cost, measured in one run on one
loaded model (docs/ARCHITECTURE.md, "Penalties, biases and bans" and "Prompt
log-probabilities"):

  (a) the standard offline workload (cupy_llama.bench: 256 requests, prompt and output
      lengths uniform in [100, 1024], temperature 0.6, EOS ignored) plain, then with every
      request carrying repetition_penalty 1.1 and frequency_penalty 0.5; output tok/s of
      each (the better of --repeats runs, taken in turn) and their ratio (target >= 0.95).
      Each run has the workload's lengths and fresh prompt ids: a run of prompts the one
      before computed would find them in the prefix cache and skip their prefill;
  (b) time to first token of a 1,024-token prompt, plain and with prompt_logprobs=1 (the
      median of 5 runs each, fresh random prompts taken in turn); their ratio (target
      <= 1.20).

Load, warm-up and the runs are timed apart; one JSON goes to --json, a summary to stderr.

    PYTHONPATH=. python3 scripts/bench_controls.py --json $OUT/controls.json
    (--model DIR for a checkpoint; default: the random llama-3.2-1b bench model)
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from cupy_llama import LLM, SamplingParams
from cupy_llama.bench.offline import max_token_id, warm_up
from cupy_llama.bench.report import commit_info, environment
from cupy_llama.bench.workloads import (THROUGHPUT_TEMPERATURE, BenchSettings, Workload,
                                        prepare_model, random_ids, throughput_numbers,
                                        throughput_workload)

PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.5)
TTFT_PROMPT, TTFT_RUNS = 1024, 5
TARGETS = {"penalized_over_plain_output_tok_s": 0.95, "prompt_logprobs_over_plain_ttft": 1.20}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def throughput_run(llm, work, seed: int, controls: dict) -> dict:
    params = [SamplingParams(temperature=THROUGHPUT_TEMPERATURE, max_tokens=n, ignore_eos=True,
                             seed=seed + i, **controls) for i, n in enumerate(work.output_lens)]
    started = time.perf_counter()
    outputs = llm.generate(work.prompts, params)
    wall_s = time.perf_counter() - started
    return throughput_numbers(work, sum(len(o.token_ids) for o in outputs), wall_s)


def ttft_ms(llm, prompt: list[int], params: SamplingParams) -> float:
    started = time.perf_counter()
    out = llm.generate(prompt, params)
    elapsed = 1e3 * (time.perf_counter() - started)
    if params.prompt_logprobs is not None:
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a checkpoint folder (default: the random bench model)")
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every length")
    parser.add_argument("--repeats", type=int, default=2, help="throughput runs of each kind")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    settings = BenchSettings("throughput", model_dir=args.model, preset=args.preset,
                             device=args.device, seed=args.seed, num_requests=args.num_requests,
                             scale=args.scale)
    model_dir, _ = prepare_model(settings, log)
    started = time.perf_counter()
    llm = LLM(model_dir, device=args.device, log=log, **settings.engine_options())
    load_s = time.perf_counter() - started

    started = time.perf_counter()
    warm_up(llm, settings)
    rng = random.Random(args.seed + 7)
    top = max_token_id(llm)
    length = min(settings.scaled(TTFT_PROMPT), llm.context_limit - 1)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
    llm.generate([random_ids(rng, 64, top) for _ in range(4)],
                 SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True, **PENALTIES))
    for params in (one, scored):  # each path's kernels once before the clock
        llm.generate(random_ids(rng, length, top), params)
    warmup_s = time.perf_counter() - started

    work = throughput_workload(settings, top)
    runs = {"plain": [], "penalized": []}
    for _ in range(args.repeats):  # in turn, so drift hits both alike
        for kind, controls in (("plain", {}), ("penalized", PENALTIES)):
            fresh = Workload([random_ids(rng, len(p), top) for p in work.prompts],
                             work.output_lens)
            result = throughput_run(llm, fresh, args.seed, controls)
            runs[kind].append(result)
            log(f"throughput {kind}: {result['output_tokens']:,} output tokens in "
                f"{result['wall_s']:.2f} s: {result['output_tok_s']:,.0f} output tok/s")
    best = {kind: max(r["output_tok_s"] for r in results) for kind, results in runs.items()}

    times = {"plain": [], "prompt_logprobs": []}
    for _ in range(TTFT_RUNS):
        for kind, params in (("plain", one), ("prompt_logprobs", scored)):
            times[kind].append(ttft_ms(llm, random_ids(rng, length, top), params))
    ttft = {kind: statistics.median(values) for kind, values in times.items()}
    log(f"ttft {length} tokens: plain {ttft['plain']:.2f} ms, prompt_logprobs "
        f"{ttft['prompt_logprobs']:.2f} ms")

    ratios = {"penalized_over_plain_output_tok_s": best["penalized"] / best["plain"],
              "prompt_logprobs_over_plain_ttft": ttft["prompt_logprobs"] / ttft["plain"]}
    report = {
        "commit": commit_info(None), "environment": environment(args.device, False),
        "model": str(model_dir), "device": llm.device, "load_s": load_s, "warmup_s": warmup_s,
        "throughput": {"controls": PENALTIES, "runs": runs, "best_output_tok_s": best},
        "ttft": {"prompt_tokens": length, "runs_ms": times, "median_ms": ttft,
                 "prompt_logprobs": 1},
        "ratios": ratios, "targets": TARGETS,
        "met": {"penalized_over_plain_output_tok_s":
                ratios["penalized_over_plain_output_tok_s"] >= TARGETS["penalized_over_plain_output_tok_s"],
                "prompt_logprobs_over_plain_ttft":
                ratios["prompt_logprobs_over_plain_ttft"] <= TARGETS["prompt_logprobs_over_plain_ttft"]},
    }
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    log(f"penalized / plain output tok/s: {ratios['penalized_over_plain_output_tok_s']:.3f} "
        f"(target >= 0.95); prompt_logprobs / plain TTFT: "
        f"{ratios['prompt_logprobs_over_plain_ttft']:.3f} (target <= 1.20); {args.json}")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
