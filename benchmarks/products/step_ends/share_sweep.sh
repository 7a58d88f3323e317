#!/usr/bin/env bash
# bench latency of the llama-3.2-1b and gemma-3-1b random models with the split argmax
# pass's share (sampling.ARGMAX_SHARE) set per process: 16,384, then 8,192 and 4,096 twice.
#   bash benchmarks/products/step_ends/share_sweep.sh /tmp/m   (the models ab_step_ends.sh makes there)
# Run from the repository root on the GPU machine.
M=$1
for share in 16384 8192 4096 8192 4096; do
  for p in llama-3.2-1b gemma-3-1b; do
    PYTHONPATH=$PWD python3 -c "
import sys; import cupy_llama.backends.cuda.sampling as s; s.ARGMAX_SHARE=$share
from cupy_llama.cli import main
sys.argv = ['cupy-llama', 'bench', 'latency', '--device', 'cuda', '--model', '$M/$p']; main()" 2>&1 |
      grep -o '[0-9,.]* tok/s' | head -1 | sed "s/^/$share $p /"
  done
done
