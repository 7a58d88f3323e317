#!/usr/bin/env bash
# The round in this folder: main beside issue 30's base on one GPU, one after the other.
#   bash benchmarks/round_43005eb_h100/run.sh BASE_CHECKOUT OUT_DIR
# BASE_CHECKOUT: a checkout (or `git archive`) of 5a3c064; the model is a random one of the
# Llama-3.2-1B shape, written by scripts/make_random_model.py. bench serve needs the serve
# extra (fastapi, uvicorn, pydantic).
set -u
BASE=$1 OUT=$2 MODEL=${MODEL:-/tmp/round-model}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
cli() { python3 -c 'import sys; from cupy_llama.cli import main; sys.argv[0] = "cupy-llama"; sys.exit(main())' "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
[ -d "$MODEL" ] || python3 scripts/make_random_model.py --preset llama-3.2-1b "$MODEL"
python3 -m pytest -m gpu tests/ -q -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
cli bench all --model "$MODEL" --json "$OUT/bench_all_main.json" > "$OUT/bench_all_main.log" 2>&1
(cd "$BASE" && PYTHONPATH=$BASE cli bench all --model "$MODEL" --commit 5a3c064 \
  --json "$OUT/bench_all_base.json" > "$OUT/bench_all_base.log" 2>&1)
cli bench serve --max-concurrency 256 --model "$MODEL" --json "$OUT/serve_c256.json" > "$OUT/serve_c256.log" 2>&1
cli bench throughput --model "$MODEL" --json "$OUT/throughput_after_serve.json" > /dev/null 2>&1
for i in 1 2; do  # batches 128 and 256 alone, alternating
  cli bench decode-sweep --batch-sizes 128,256 --model "$MODEL" --json "$OUT/sweep_${i}_main.json" > /dev/null 2>&1
  (cd "$BASE" && PYTHONPATH=$BASE cli bench decode-sweep --batch-sizes 128,256 --model "$MODEL" \
    --commit 5a3c064 --json "$OUT/sweep_${i}_base.json" > /dev/null 2>&1)
done
# the kernel table of a batch-256 step at 512 cached tokens; 5a3c064's script takes no
# --batches or --contexts, so its two lists are edited to that one shape (in BASE's copy)
sed -i 's/^GRAPH_BATCHES = (1, 8, 64, 256)/GRAPH_BATCHES = (256,)/; s/^KERNEL_CONTEXTS = (512, 2048)/KERNEL_CONTEXTS = (512,)/' \
  "$BASE/scripts/perf.py"
python3 scripts/perf.py "$MODEL" --kernels-only --batches 256 --contexts 512 \
  --json "$OUT/kernels_main.json" > "$OUT/kernels_main.txt" 2>&1
(cd "$BASE" && PYTHONPATH=$BASE OUT=$OUT/base python3 scripts/perf.py "$MODEL" --kernels-only \
  > "$OUT/kernels_base.txt" 2>&1)
