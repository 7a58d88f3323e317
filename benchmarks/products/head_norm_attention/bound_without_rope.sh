#!/usr/bin/env bash
# What a decode step of Qwen3-0.6B and Gemma-3-1B shape could gain without the head-norm
# rope kernel: `cupy-llama bench latency` in this tree and in a copy whose ops skip that
# kernel in one-sequence steps (their outputs are then wrong: an upper bound, not a
# variant). Alternating, ROUNDS rounds. Run from the repository root on a GPU:
#   bash benchmarks/products/head_norm_attention/bound_without_rope.sh OUT_DIR [MODELS_DIR]
set -eu
# the rope kernel as before: the decode kernels' head-norm forms off (a tree without them
# does not read the variable)
export CUPY_LLAMA_HEAD_NORM_ATTENTION=0
out=$1 models=${2:-/tmp/head_norm_models} rounds=${ROUNDS:-2}
copy=$(mktemp -d)
trap 'rm -rf "$copy"' EXIT
mkdir -p "$out" "$models"
cp -r cupy_llama cuda_src setup.cfg pyproject.toml README.md "$copy/"
python3 - "$copy/cupy_llama/backends/cuda/ops.py" <<'PY'
import sys
path = sys.argv[1]
source = open(path).read()
call = "        elementwise.rope_and_cache(qkv, meta.positions"
assert source.count(call) == 1
source = source.replace(call, "        if head_norm is not None and qkv.shape[0] == 1: return\n" + call)
open(path, "w").write(source)
PY
for preset in qwen3-0.6b gemma-3-1b; do
  [ -d "$models/$preset" ] || python3 scripts/make_random_model.py --preset $preset "$models/$preset" > /dev/null
done
for i in $(seq "$rounds"); do
  for preset in qwen3-0.6b gemma-3-1b; do
    for tree in here without_rope; do
      [ $tree = here ] && dir=$PWD || dir=$copy
      json=$out/lat_${preset}_${tree}_$i.json
      (cd "$dir" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" python3 -m cupy_llama.cli bench latency \
        --device cuda --model "$models/$preset" --json "$json" > "${json%.json}.log" 2>&1)
      echo "$preset $tree round $i: $(grep -o '"tok_s": [0-9.]*' "$json" | head -1)"
    done
  done
done
