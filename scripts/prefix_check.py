"""Greedy outputs with prefix caching on against off, on one loaded model: how many of 8
prompts come out identical, and where the others first differ. On the NumPy backend the
tests assert they always do; on a GPU, bf16 rounding depends on which tokens a step
computes together, so a cached prompt (only its tail computed) may turn a near-tie.

    python scripts/prefix_check.py MODEL_DIR [--device cuda] [--json OUT]

A first prompt fills the cache: 1,000 random token ids and a tail of its own. Then 8
prompts run together, sharing its first 16, 17, 100, 255, 256, 512, 700 and 1,000 tokens
(block boundaries and between them), each with a tail of its own; 64 new tokens each,
EOS ignored. The same runs again with the cache emptied and turned off.
"""
import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cupy_llama import LLM, SamplingParams  # noqa: E402

SHARED = (16, 17, 100, 255, 256, 512, 700, 1000)
BASE_TOKENS, NEW_TOKENS = 1000, 64


def workload(vocab: int, seed: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    top = min(vocab, 10000) - 1
    base = [rng.randint(0, top) for _ in range(BASE_TOKENS)]
    first = base + [rng.randint(0, top) for _ in range(9)]
    prompts = [base[:shared] + [rng.randint(0, top) for _ in range(rng.randint(1, 40))]
               for shared in SHARED]
    return first, prompts


def run(llm, first, prompts, params, caching: bool) -> list:
    llm.engine.reset_prefix_cache()
    llm.engine.set_prefix_caching(caching)
    llm.generate(first, params)
    return llm.generate(prompts, params)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args()
    llm = LLM(args.model_dir, device=args.device, log=lambda message: None)
    first, prompts = workload(llm.config.vocab_size, args.seed)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    on = run(llm, first, prompts, params, caching=True)
    off = run(llm, first, prompts, params, caching=False)
    llm.engine.set_prefix_caching(True)
    rows = []
    for shared, prompt, a, b in zip(SHARED, prompts, on, off):
        rows.append({"shared_tokens": shared, "prompt_tokens": len(prompt),
                     "cached_tokens": a.num_cached_tokens, "identical": a.token_ids == b.token_ids,
                     "first_difference": first_difference(a.token_ids, b.token_ids),
                     "tokens_cached": a.token_ids, "tokens_uncached": b.token_ids})
    report = {"model": str(args.model_dir), "device": llm.device, "seed": args.seed,
              "new_tokens": NEW_TOKENS, "identical": sum(r["identical"] for r in rows),
              "of": len(rows), "prompts": rows}
    for row in rows:
        where = "identical" if row["identical"] else f"first differs at {row['first_difference']}"
        print(f"shared {row['shared_tokens']:5d}, prompt {row['prompt_tokens']:5d}, cached "
              f"{row['cached_tokens']:5d}: {where}")
    print(f"{report['identical']} of {report['of']} identical with prefix caching on and off")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
