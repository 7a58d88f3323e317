"""The graph-replayed decode step with RoPE inside the tensor-core decode kernel
(KernelSwitches.mma_rope of mma_rope.patch beside this script, which applies to c56f475;
NOTES "Tried, dropped: RoPE ... inside the tensor-core decode kernel") against the rope
kernel before it, on one loaded model: rounds of both variants in turn (use_switches drops
the graphs with the old ops), batches 8, 64 and 256 at context 512, medians of
scripts/perf.py's event timing; and the logits of each variant's step, which must be the
same bits (the rope form gives the rope kernel's bits).

    PYTHONPATH=. python3 benchmarks/products/mma_rope/steps_ab.py MODEL_DIR [--rounds 3]
        [--json PATH]

from the root of that patched checkout, with this script copied to the same place in it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import perf  # noqa: E402  (scripts/perf.py: decode_batch, event_time)

from cupy_llama.models import model_for, read_config  # noqa: E402
from cupy_llama.util import cdiv  # noqa: E402
from cupy_llama.weights import open_checkpoint  # noqa: E402

BATCHES, CONTEXT = (8, 64, 256), 512


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import cupy
    from cupy_llama.backends.cuda.backend import CudaBackend
    from cupy_llama.backends.cuda.switches import KernelSwitches

    config = read_config(args.model_dir)
    checkpoint = open_checkpoint(args.model_dir, model_for(config))
    blocks_per_seq = cdiv(2048, 16)
    backend = CudaBackend(model_for(config), checkpoint, max_model_len=2048,
                          max_num_seqs=max(BATCHES), max_num_batched_tokens=4096,
                          block_size=16, num_kv_blocks=max(BATCHES) * blocks_per_seq)
    checkpoint.close()
    backend._kv.fill(0)
    rng = np.random.default_rng(0)
    batches = {b: perf.decode_batch(b, CONTEXT, 16, blocks_per_seq, rng) for b in BATCHES}
    times = {v: {b: [] for b in BATCHES} for v in ("off", "on")}
    logits = {}
    for _ in range(args.rounds):
        for variant in ("off", "on"):
            backend.use_switches(KernelSwitches(mma_rope=variant == "on"))
            for b, batch in batches.items():
                times[variant][b].append(perf.event_time(cupy, lambda: backend.forward(batch)))
                logits[variant, b] = cupy.asnumpy(backend.forward(batch))
    result = {"model_dir": args.model_dir, "context": CONTEXT,
              "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
              "graph_ms": {v: {str(b): t for b, t in by_batch.items()}
                           for v, by_batch in times.items()},
              "same_logits": {str(b): bool(np.array_equal(logits["off", b], logits["on", b]))
                              for b in BATCHES}}
    for b in BATCHES:
        off, on = np.median(times["off"][b]), np.median(times["on"][b])
        print(f"batch {b:>3}: rope kernel {off:.4f} ms, in attention {on:.4f} ms "
              f"({(off - on) * 1e3:+.1f} us, {(off / on - 1) * 100:+.2f}%), "
              f"same logits: {result['same_logits'][str(b)]}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
