"""The host's time inside one forward of a prompt alone, beside the forward's span, on the
backend directly (no engine), in one command on the GPU machine:

    python3 scripts/forward_host_time.py MODEL_DIR [--tokens 4096] [--runs 10] [--cprofile N]

The prompt's step runs as the engine would run it (the step graphs up to their largest
bucket, eagerly past it). host: from the forward call to its return; span: from the call
to the end of its work on the GPU. Where host is close to span, the GPU waits for the
host's launches; where it is well under, the GPU's own time is the forward's. Medians of
--runs after three warm-up forwards; --cprofile N: the host's top N functions (own time)
over one more forward. JSON to $OUT/forward_host_time.json (or --json)."""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's package
from cupy_llama.bench.report import output_json_path  # noqa: E402
from cupy_llama.interface import ForwardBatch  # noqa: E402
from cupy_llama.models import model_for, read_config  # noqa: E402
from cupy_llama.util import cdiv  # noqa: E402
from cupy_llama.weights import open_checkpoint  # noqa: E402

BLOCK_SIZE = 16


def prompt_batch(tokens: int, vocab_size: int) -> ForwardBatch:
    """One sequence's first `tokens` tokens (ids below vocab_size), in blocks 0, 1, ..."""
    positions = np.arange(tokens, dtype=np.int32)
    return ForwardBatch(token_ids=(positions * 7 % vocab_size).astype(np.int32),
                        positions=positions, slot_mapping=positions.copy(),
                        query_start_loc=np.array([0, tokens], np.int32),
                        seq_lens=np.array([tokens], np.int32),
                        block_tables=np.arange(cdiv(tokens, BLOCK_SIZE), dtype=np.int32)[None, :],
                        max_query_len=tokens, max_seq_len=tokens)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import cupy
    from cupy_llama.backends.cuda.backend import CudaBackend

    config = read_config(args.model_dir)
    checkpoint = open_checkpoint(args.model_dir, model_for(config))
    max_len = max(8192, args.tokens)
    backend = CudaBackend(model_for(config), checkpoint, max_model_len=max_len, max_num_seqs=8,
                          max_num_batched_tokens=max_len, block_size=BLOCK_SIZE,
                          num_kv_blocks=cdiv(max_len, BLOCK_SIZE) + 8, log=lambda m: None)
    checkpoint.close()
    batch = prompt_batch(args.tokens, config.vocab_size)
    stream = cupy.cuda.get_current_stream()
    for _ in range(3):
        backend.forward(batch)
    host, span = [], []
    for _ in range(args.runs):
        stream.synchronize()
        start = time.perf_counter()
        backend.forward(batch)
        returned = time.perf_counter()
        stream.synchronize()
        host.append((returned - start) * 1e3)
        span.append((time.perf_counter() - start) * 1e3)
    result = {"model_dir": str(args.model_dir), "tokens": args.tokens, "runs": args.runs,
              "host_ms": statistics.median(host), "span_ms": statistics.median(span)}
    print(f"{args.tokens} tokens: host {result['host_ms']:.2f} ms, span {result['span_ms']:.2f} ms")
    if args.cprofile:
        profile = cProfile.Profile()
        stream.synchronize()
        profile.enable()
        backend.forward(batch)
        profile.disable()
        stream.synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.cprofile)
    path = output_json_path(args.json, "forward_host_time.json")
    if path:
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
