"""Host time of a prompt's log-probabilities: what scoring a 1,024-token prompt
(prompt_logprobs=1) costs the host beyond the device's work, on the tiny NumPy model.

Two measurements in one run:
- the engine as it is, generate() with max_tokens=1: the time in the engine's handling of
  the step's scores (LLMEngine._take_prompt_logprobs), the samples' deltas and the
  OutputAccumulator, per request (the step loop's share), then what a reader pays on top:
  RequestOutput.prompt_logprobs (the per-token objects) and the server's legacy JSON
  (protocol.prompt_completion_logprobs);
- on the same step arrays, the path of one object per token the engine used before
  (a tuple with a top-k list per token in the engine, a TokenLogprob per token in the
  accumulator, the server's JSON from those) against today's (the arrays kept, joined
  once, wrapped in a PromptScores, the JSON made from the arrays).

    PYTHONPATH=. python3 scripts/bench_prompt_scores_host.py [--tokens 1024] [--k 1]
        [--repeats 20] [--json FILE]
"""
import argparse
import json
import statistics
import sys
import tempfile
import time

import numpy as np


def _ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


class _Timer:
    """Wraps methods to add their wall time to one total (per request: reset between)."""

    def __init__(self):
        self.total = 0.0

    def wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - started
        setattr(owner, name, timed)


# ---- the path of one object per token (the engine before its scores stayed arrays) ---------

def before_engine(chunks, k: int) -> list:
    """_Sample.add_prompt_logprobs as it was: a (token id, logprob, top) tuple per token."""
    scored = [None]
    for first, values, ids in chunks:
        for j in range(max(0, len(scored) - first), values.shape[0]):
            row_ids, row_values = ids[j].tolist(), values[j].tolist()
            scored.append((row_ids[0], row_values[0],
                           list(zip(row_ids[1:1 + k], row_values[1:1 + k]))))
    return scored


def before_accumulator(scored) -> list:
    from cupy_llama.outputs import TokenLogprob
    return [None if e is None else TokenLogprob(*e) for e in scored]


def before_server(prompt_ids, entries, k: int, token_strings) -> dict:
    """The legacy JSON from TokenLogprobs, as protocol.prompt_completion_logprobs made it."""
    from cupy_llama.server.protocol import _number
    tokens, token_logprobs, top_logprobs, offsets, offset = [], [], [], [], 0
    for position, token_id in enumerate(prompt_ids):
        text = token_strings(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        entry = entries[position] if position < len(entries) else None
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_number(entry.logprob))
        alternatives = {token_strings(t): _number(lp) for t, lp in entry.top[:k]}
        if all(t != token_id for t, _ in entry.top[:k]):
            alternatives.setdefault(text, _number(entry.logprob))
        top_logprobs.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


# ---- today's path, through the project's own functions --------------------------------------

def after_engine(chunks, k: int, num_prompt_tokens: int):
    """The engine's _Sample.add_prompt_logprobs and complete_prompt_logprobs on the chunks."""
    from cupy_llama.engine.llm_engine import _Sample

    class _Seq:
        params = type("P", (), {"prompt_logprobs": k})()

    sample = _Sample.__new__(_Sample)
    sample.seq = _Seq()
    sample.seq.num_prompt_tokens = num_prompt_tokens
    sample.prompt_chunks, sample.num_scored, sample.prompt_scores = [], 1, None
    sample.prompt_source = sample
    for first, values, ids in chunks:
        sample.add_prompt_logprobs(first, values, ids)
    return sample.complete_prompt_logprobs()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    from cupy_llama import LLM, SamplingParams
    from cupy_llama.bench.random_model import make_random_model
    from cupy_llama.engine import llm_engine, output_processor
    from cupy_llama.outputs import PromptScores
    from cupy_llama.server import protocol

    folder = tempfile.mkdtemp(prefix="prompt-scores-")
    model_dir = make_random_model(folder + "/model", "tiny", seed=0, std=0.15)
    llm = LLM(model_dir, device="cpu", log=None)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, llm.config.vocab_size, args.tokens).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                            prompt_logprobs=args.k)
    strings = protocol.TokenStrings(llm.tokenizer)

    # the step arrays as the engine receives them, kept for the path comparison
    captured: list = []
    take = llm_engine.LLMEngine._take_prompt_logprobs

    def capture(engine, prompt_request):
        values, ids = prompt_request.host()
        offset = 0
        for _, first, count in prompt_request.spans:
            captured.append((first, values[offset:offset + count].copy(),
                             ids[offset:offset + count].copy()))
            offset += count
        return take(engine, prompt_request)
    llm_engine.LLMEngine._take_prompt_logprobs = capture
    llm.generate(prompt, params)  # also the warm-up
    llm_engine.LLMEngine._take_prompt_logprobs = take

    timer = _Timer()
    timer.wrap(llm_engine.LLMEngine, "_take_prompt_logprobs")
    timer.wrap(llm_engine._Sample, "delta")
    timer.wrap(output_processor.OutputAccumulator, "process")
    engine_ms, read_ms, json_ms, plain_ms = [], [], [], []
    plain = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(args.repeats):
        for wanted in (plain, params):  # in turn, so drift hits both alike
            timer.total = 0.0
            out = llm.generate(prompt, wanted)
            (engine_ms if wanted is params else plain_ms).append(timer.total)
        started = time.perf_counter()
        entries = out.prompt_logprobs
        read_ms.append(time.perf_counter() - started)
        started = time.perf_counter()
        protocol.prompt_completion_logprobs(prompt, out.prompt_scores, args.k, strings)
        json_ms.append(time.perf_counter() - started)
        assert len(entries) == len(prompt)

    paths = {"before": {"engine": [], "accumulator": [], "server_json": []},
             "after": {"engine": [], "accumulator": [], "server_json": []}}
    for _ in range(args.repeats):
        strings = protocol.TokenStrings(llm.tokenizer)  # its cache cold each time, both paths
        for name in ("before", "after"):
            times = paths[name]
            started = time.perf_counter()
            if name == "before":
                scored = before_engine(captured, args.k)
            else:
                scored = after_engine(captured, args.k, len(prompt))
            engine_done = time.perf_counter()
            if name == "before":
                entries = before_accumulator(scored)
            else:
                scores = PromptScores(*scored)
            accumulated = time.perf_counter()
            if name == "before":
                body = before_server(prompt, entries, args.k, strings)
            else:
                body, _ = protocol.prompt_completion_logprobs(prompt, scores, args.k, strings)
            done = time.perf_counter()
            times["engine"].append(engine_done - started)
            times["accumulator"].append(accumulated - engine_done)
            times["server_json"].append(done - accumulated)
            if name == "before":
                expected = body
        assert body == expected, "the two paths disagree"

    report = {
        "prompt_tokens": args.tokens, "k": args.k, "repeats": args.repeats,
        "engine_loop_ms": {"plain": _ms(plain_ms), "scored": _ms(engine_ms)},
        "reader_ms": {"prompt_logprobs_entries": _ms(read_ms), "server_json": _ms(json_ms)},
        "paths_ms": {name: {part: _ms(v) for part, v in parts.items()}
                     for name, parts in paths.items()},
    }
    for name in ("before", "after"):
        report["paths_ms"][name]["step_loop"] = (report["paths_ms"][name]["engine"]
                                                 + report["paths_ms"][name]["accumulator"])
    text = json.dumps(report, indent=2)
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(text + "\n")
    print(text, file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
