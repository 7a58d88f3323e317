"""Engine behaviour on a GPU, where bf16 results may depend on batch composition: reports
(rather than asserts) how often preemption, batching and aborts change greedy outputs.
On the NumPy backend the tests assert these are always identical.

    python scripts/gpu_engine_checks.py MODEL_DIR [--device cuda] [--json OUT]
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cupy_llama import LLM, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def prompts_for(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, min(vocab, 10000), int(n)).tolist() for n in rng.integers(8, 80, count)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json")
    args = parser.parse_args()
    report = {}

    # 1. preemption: 32 blocks of 16 tokens for 34 prompts vs an ample pool
    ample = LLM(args.model_dir, device=args.device, num_kv_blocks=4096, log=lambda m: None)
    vocab = ample.config.vocab_size
    prompts = prompts_for(vocab, 34, 0)
    reference = [o.token_ids for o in ample.generate(prompts, GREEDY)]
    solo = [ample.generate(p, GREEDY).token_ids for p in prompts[:20]]
    # 2. batch invariance: alone vs inside the batch of 34
    report["batch_invariance"] = {"identical": sum(a == b for a, b in zip(solo, reference[:20])),
                                  "of": 20}
    # 3. abort: 20 concurrent requests, 5 aborted after 5 steps
    engine = ample.engine
    ids = [engine.add_request(p, GREEDY) for p in prompts[:20]]
    finished = {}
    for step in range(1000):
        if step == 5:
            for request_id in ids[::4]:
                engine.abort(request_id)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        if not engine.has_unfinished_requests():
            break
    kept = [i for i in range(20) if i % 4]
    report["abort"] = {
        "kept_equal_solo": sum(finished.get(ids[i]) == solo[i] for i in kept), "of": len(kept),
        "aborted_absent": all(ids[i] not in finished for i in range(0, 20, 4)),
        "free_blocks_after": engine.stats().num_free_blocks,
        "total_blocks": engine.stats().num_blocks}
    del ample, engine

    tight = LLM(args.model_dir, device=args.device, num_kv_blocks=32, block_size=16,
                max_model_len=512, log=lambda m: None)
    outputs = [o.token_ids for o in tight.generate(prompts, GREEDY)]
    report["preemption"] = {"identical": sum(a == b for a, b in zip(outputs, reference)), "of": 34,
                            "preemptions": tight.stats().num_preemptions,
                            "free_blocks_after": tight.stats().num_free_blocks}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
