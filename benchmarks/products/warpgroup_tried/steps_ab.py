"""The graph-replayed decode step with the warpgroup kernels (warpgroup.cu of either patch
beside this script, which apply to 5d73b42; NOTES "Tried, dropped: products of 17 to 256
rows on TMA and warpgroup MMA") against cuBLAS (KernelSwitches.warpgroup_gemm off), on
one loaded model: rounds of both variants in turn (use_switches drops the graphs with the
old ops), batches 24, 64, 128 and 256 at context 512, medians of scripts/perf.py's event
timing; and how far the variants' logits are apart (where the kernel's sums go in another
order than cuBLAS's, the bits differ).

    PYTHONPATH=. python3 benchmarks/products/warpgroup_tried/steps_ab.py MODEL_DIR [--rounds 3]
        [--json PATH]

from the root of a patched checkout.
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

BATCHES, CONTEXT = (24, 64, 128, 256), 512


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
    times = {v: {b: [] for b in BATCHES} for v in ("cublas", "warpgroup")}
    logits = {}
    for _ in range(args.rounds):
        for variant in ("cublas", "warpgroup"):
            backend.use_switches(KernelSwitches(warpgroup_gemm=variant == "warpgroup"))
            for b, batch in batches.items():
                times[variant][b].append(perf.event_time(cupy, lambda: backend.forward(batch)))
                logits[variant, b] = cupy.asnumpy(backend.forward(batch))
    result = {"model_dir": args.model_dir, "context": CONTEXT,
              "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
              "graph_ms": {v: {str(b): t for b, t in by_batch.items()}
                           for v, by_batch in times.items()},
              "logits_max_abs_diff": {
                  str(b): float(np.abs(logits["cublas", b] - logits["warpgroup", b]).max())
                  for b in BATCHES},
              "same_argmax": {
                  str(b): float(np.mean(logits["cublas", b].argmax(-1)
                                        == logits["warpgroup", b].argmax(-1)))
                  for b in BATCHES}}
    for b in BATCHES:
        base, new = np.median(times["cublas"][b]), np.median(times["warpgroup"][b])
        print(f"batch {b:>3}: cuBLAS {base:.4f} ms, warpgroup {new:.4f} ms "
              f"({(base - new) * 1e3:+.1f} us, {(base / new - 1) * 100:+.2f}%), logits apart "
              f"by {result['logits_max_abs_diff'][str(b)]:.3g}, same argmax "
              f"{result['same_argmax'][str(b)]:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
