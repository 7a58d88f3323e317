"""Run the CLI with one part of a decode step left out (its outputs are wrong: timing only).
    python3 ablate.py VARIANT bench latency ...
VARIANT: main | nosample (no sampling kernel) | no_o (Llama's o_proj product skipped) |
noembed (no embedding lookup)."""
import sys

variant = sys.argv[1]
from cupy_llama.backends.cuda import sampling as sampling_kernels
from cupy_llama.backends.cuda.ops import CudaOps

if variant == "nosample":
    sampling_kernels.sample_settings = lambda *a, **k: None
elif variant == "no_o":
    linear = CudaOps.linear

    def skip_o(self, x, weight, out, accumulate=False):
        if accumulate and tuple(weight.shape) == (2048, 2048):
            return
        return linear(self, x, weight, out, accumulate)
    CudaOps.linear = skip_o
elif variant == "noembed":
    CudaOps.embedding = lambda self, *a, **k: None
elif variant != "main":
    raise SystemExit(f"unknown variant {variant}")
from cupy_llama.cli import main
sys.exit(main(sys.argv[2:]))
