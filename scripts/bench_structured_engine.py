"""What structured outputs cost the engine on the device: the standard offline workload with
1 request in 8 constrained by a JSON schema against the same workload unconstrained (in the
same process, on one loaded model), and batch-1 decode of a constrained request against an
unconstrained one (docs/ARCHITECTURE.md, "Structured outputs and tools").

    python scripts/bench_structured_engine.py MODEL_DIR [--json OUT.json] [--device cuda]
        [--num-requests 256] [--scale 1.0] [--tokenizer-json PATH]

Targets: the mixed workload at >= 0.90 of the unconstrained output tok/s, batch-1
constrained decode at >= 0.85 of unconstrained ("ratio" in the JSON, and "meets_target").

The workload is `cupy-llama bench throughput`'s (cupy_llama/bench/workloads.py): random
prompt ids, output lengths uniform in [100, 1024], temperature 0.6, EOS ignored. A
constrained request cannot ignore EOS (the grammar decides where the output may end), so
it may stop before its length: both runs count the output tokens they produced. The schema
has a free-text string: a random model's output is noise, which keeps a string open for
hundreds of tokens, so constrained requests run about as long as the others.

Needs llguidance (pip install the llguidance wheel first). MODEL_DIR is a model folder,
for instance `scripts/make_random_model.py DIR --preset llama-3.2-1b`; --tokenizer-json
copies that tokenizer.json into a copy of the folder first (the mask's cost depends on the
vocabulary: give Llama 3's 128,256-token tokenizer.json where the model folder has the
byte-level test tokenizer).
"""
import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cupy_llama import LLM, SamplingParams  # noqa: E402
from cupy_llama.bench.offline import decode_numbers, max_token_id, timed_steps  # noqa: E402
from cupy_llama.bench.workloads import (THROUGHPUT_LENGTHS, THROUGHPUT_TEMPERATURE,  # noqa: E402
                                        offline_workload)
from cupy_llama.structured import StructuredSpec  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"enum": ["short", "long", "funny", "sad"]},
                 "maxItems": 4},
        "text": {"type": "string"},
    },
    "required": ["title", "rating", "tags", "text"],
    "additionalProperties": False,
}
CONSTRAINED_EVERY = 8
BATCH1_PROMPT, BATCH1_NEW_TOKENS, BATCH1_RUNS = 32, 256, 5
TARGETS = {"mixed_workload": 0.90, "batch1_decode": 0.85}


def model_folder(model_dir: Path, tokenizer_json: str | None, keep: list) -> Path:
    if tokenizer_json is None:
        return model_dir
    copy = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    keep.append(copy)
    for item in model_dir.iterdir():
        target = copy / item.name
        target.symlink_to(item.resolve())  # the weights are not copied
    (copy / "tokenizer.json").unlink()
    shutil.copyfile(tokenizer_json, copy / "tokenizer.json")
    return copy


def workload_run(llm, prompts, params) -> dict:
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall_s = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outputs)
    constrained = [o for o, p in zip(outputs, params) if p.structured is not None]
    valid = 0
    for output in constrained:
        try:
            json.loads(output.text)
            valid += 1
        except ValueError:
            pass  # cut by max_tokens
    return {"wall_s": wall_s, "output_tokens": tokens, "output_tok_s": tokens / wall_s,
            "constrained_requests": len(constrained),
            "constrained_output_tokens": sum(len(o.token_ids) for o in constrained),
            "constrained_finished_by_grammar": sum(o.finish_reason == "stop" for o in constrained),
            "constrained_whole_json": valid}


def mixed_workload(llm, num_requests: int, scale: float, seed: int, log,
                   repeats: int = 2) -> dict:
    lengths = tuple(max(1, int(n * scale)) for n in THROUGHPUT_LENGTHS)
    work = offline_workload(num_requests, seed, lengths, max_token_id(llm))
    spec = StructuredSpec.json(SCHEMA)
    plain = [SamplingParams(temperature=THROUGHPUT_TEMPERATURE, max_tokens=n, ignore_eos=True,
                            seed=seed + i) for i, n in enumerate(work.output_lens)]
    mixed = [replace(p, structured=spec, ignore_eos=False) if i % CONSTRAINED_EVERY == 0 else p
             for i, p in enumerate(plain)]
    started = time.perf_counter()
    llm.engine.compile_structured(spec)
    compile_s = time.perf_counter() - started
    warm = [replace(p, max_tokens=8) for p in mixed[:2 * CONSTRAINED_EVERY]]
    llm.generate(work.prompts[:len(warm)], warm)  # kernels, graphs, the mask's lexer states
    result = {"num_requests": num_requests, "constrained_every": CONSTRAINED_EVERY,
              "compile_s_with_compiler": compile_s}
    # in turn, the best of each kept: the first whole workload of a process runs slower
    # (its first long prefill and decode steps), whichever kind it is
    runs = {"unconstrained": [], "mixed": []}
    for _ in range(repeats):
        runs["unconstrained"].append(workload_run(llm, work.prompts, plain))
        runs["mixed"].append(workload_run(llm, work.prompts, mixed))
    for kind, kind_runs in runs.items():
        result[kind] = max(kind_runs, key=lambda run: run["output_tok_s"])
        result[kind]["output_tok_s_of_each_run"] = [run["output_tok_s"] for run in kind_runs]
    result["ratio"] = result["mixed"]["output_tok_s"] / result["unconstrained"]["output_tok_s"]
    result["target"] = TARGETS["mixed_workload"]
    result["meets_target"] = result["ratio"] >= result["target"]
    log(f"mixed workload: {result['unconstrained']['output_tok_s']:,.0f} output tok/s "
        f"unconstrained, {result['mixed']['output_tok_s']:,.0f} with 1 in {CONSTRAINED_EVERY} "
        f"constrained: {result['ratio']:.3f} (target {result['target']})")
    return result


def batch1_decode(llm, seed: int, log) -> dict:
    import random
    rng = random.Random(seed)
    top = max_token_id(llm)
    prompt = [rng.randint(0, top) for _ in range(BATCH1_PROMPT)]
    base = SamplingParams(temperature=THROUGHPUT_TEMPERATURE, max_tokens=BATCH1_NEW_TOKENS,
                          seed=seed)
    runs = {"unconstrained": replace(base, ignore_eos=True),
            "constrained": replace(base, structured=StructuredSpec.json(SCHEMA))}
    result = {"prompt_tokens": BATCH1_PROMPT, "new_tokens": BATCH1_NEW_TOKENS}
    for name, params in runs.items():
        timed_steps(llm, [prompt], params)  # warm-up
        numbers = [decode_numbers(*timed_steps(llm, [prompt], params), 1)
                   for _ in range(BATCH1_RUNS)]
        result[name] = {"tok_s": statistics.median(n["tok_s"] for n in numbers),
                        "ms_per_step": statistics.median(n["ms_per_step"] for n in numbers),
                        "decode_tokens": [n["decode_tokens"] for n in numbers]}
    result["ratio"] = result["constrained"]["tok_s"] / result["unconstrained"]["tok_s"]
    result["target"] = TARGETS["batch1_decode"]
    result["meets_target"] = result["ratio"] >= result["target"]
    log(f"batch 1: {result['unconstrained']['tok_s']:,.1f} tok/s unconstrained, "
        f"{result['constrained']['tok_s']:,.1f} constrained: {result['ratio']:.3f} "
        f"(target {result['target']})")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiplies the workload's lengths (quick checks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each workload, in turn; the best of each is compared")
    parser.add_argument("--tokenizer-json", help="use this tokenizer.json instead of the "
                                                 "model folder's")
    args = parser.parse_args()
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    keep: list = []
    try:
        folder = model_folder(args.model_dir, args.tokenizer_json, keep)
        started = time.perf_counter()
        llm = LLM(folder, device=args.device, log=log)
        load_s = time.perf_counter() - started
        report = {"model_dir": str(args.model_dir), "device": llm.device,
                  "vocab_size": llm.config.vocab_size,
                  "tokenizer_vocab_size": llm.tokenizer.vocab_size,
                  "platform": platform.platform(), "load_s": load_s, "schema": SCHEMA,
                  "mixed_workload": mixed_workload(llm, args.num_requests, args.scale,
                                                   args.seed, log, args.repeats),
                  "batch1_decode": batch1_decode(llm, args.seed, log)}
        llm.close()
    finally:
        for folder in keep:
            shutil.rmtree(folder, ignore_errors=True)
    text = json.dumps(report, indent=2)
    if args.json_path:
        Path(args.json_path).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
