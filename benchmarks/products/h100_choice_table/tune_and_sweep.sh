#!/usr/bin/env bash
# A choice table for this GPU from every family shape (scripts/perf.py --tune --merge, the
# presets' configs alone: --tune loads no weights), then `cupy-llama bench decode-sweep`
# of each family's random model at 1 to 16 rows with that table beside gemm.py and
# without one (the fallback: mma up to 4 rows, cuBLAS above), alternating, ROUNDS rounds.
# The tree's own table for this GPU is set aside while it runs and put back after. Run
# from the repository root on a GPU:
#   bash benchmarks/products/h100_choice_table/tune_and_sweep.sh OUT_DIR [MODELS_DIR]
set -eu
out=$(realpath -m "$1") models=$(realpath -m "${2:-/tmp/inbox_models}")
rounds=${ROUNDS:-2}
mkdir -p "$out" "$models"
gpu=$(python3 -c "import cupy; print(cupy.cuda.runtime.getDeviceProperties(0)['name'].decode())")
name=$(python3 -c "import re, sys; print('gemm_choice_' + re.sub(r'[^a-z0-9]+', '_', sys.argv[1].lower().replace('nvidia', '')).strip('_') + '.json')" "$gpu")
table=cupy_llama/backends/cuda/$name
[ -f "$table" ] && mv "$table" "$out/committed_$name"
trap '[ -f "$out/committed_$name" ] && cp "$out/committed_$name" "$table" || rm -f "$table"' EXIT
for preset in llama-3.2-1b qwen3-0.6b qwen2.5-1.5b gemma-3-1b gemma-3-4b; do
  mkdir -p "$out/config/$preset"
  python3 -c "import json, sys; from cupy_llama.bench.random_model import PRESETS, config_json; json.dump(config_json(PRESETS[sys.argv[1]]), open(sys.argv[2], 'w'))" \
    $preset "$out/config/$preset/config.json"
  OUT=$out python3 scripts/perf.py "$out/config/$preset" --tune --merge > "$out/tune_$preset.log" 2>&1
  cp "$out/$name" "$table"
done
mv "$table" "$out/tuned_$name"
for preset in qwen3-0.6b gemma-3-1b llama-3.2-1b qwen2.5-1.5b; do
  [ -d "$models/$preset" ] || python3 scripts/make_random_model.py --preset $preset "$models/$preset" > /dev/null
done
for i in $(seq "$rounds"); do
  for tag in fallback table; do
    if [ $tag = table ]; then cp "$out/tuned_$name" "$table"; else rm -f "$table"; fi
    for preset in qwen3-0.6b gemma-3-1b llama-3.2-1b qwen2.5-1.5b; do
      json=$out/${preset}_${tag}_$i.json
      python3 -m cupy_llama.cli bench decode-sweep --device cuda --model "$models/$preset" \
        --batch-sizes 1,4,5,8,16 --json "$json" > "${json%.json}.log" 2>&1
      echo "$preset $tag round $i: $(grep 'decode-sweep: batch' "${json%.json}.log" | tr '\n' ' ')"
    done
  done
done
