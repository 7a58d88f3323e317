#!/usr/bin/env bash
# The runs in this folder, in their order:
#   bash benchmarks/step_timeline/h100_e74d3ea/run.sh BASE_CHECKOUT OUT_DIR
# call1/ and call2/ ran as two calls on one H100 80GB HBM3 machine, one after the other.
# BASE_CHECKOUT: a checkout (or `git archive`) of 5a3c064. The model is a random one of the
# Llama-3.2-1B shape (MODEL, written by scripts/make_random_model.py when missing).
# call1 ran first_form.py, scripts/step_timeline.py's first form (the same events and
# clocks); call2 ran scripts/step_timeline.py as fb04d83 added it, so its JSON rows say
# steady_steps where the script now says timed_steps.
set -u
BASE=$1 OUT=$2 MODEL=${MODEL:-/tmp/round-model}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
[ -d "$MODEL" ] || python3 scripts/make_random_model.py --preset llama-3.2-1b "$MODEL"
first() { PYTHONPATH=$PWD python3 "$HERE/first_form.py" "$MODEL" "$1" "$OUT/diag_$1.json"; }
first_base() { (cd "$BASE" && PYTHONPATH=$BASE python3 "$HERE/first_form.py" "$MODEL" "$1" "$OUT/diag_$1.json"); }
# call1
first main1
first_base base1
KV_BLOCKS=8192 first kv8k_main
KV_BLOCKS=8192 first_base kv8k_base
STAGE_INLINE=1 first inline1
first main2
first_base base2
CUPY_LLAMA_PDL=0 first nopdl1
python3 scripts/perf.py "$MODEL" --kernels-only --batches 256 --contexts 128,256 \
  --json "$OUT/kernels_b256.json" > "$OUT/kernels_b256.txt"
# call2: decode-sweep as fb920aa times it (token ids only)
timeline() { python3 scripts/step_timeline.py "$MODEL" --label "$1" --json "$OUT/timeline_$1_$2.json" "${@:3}"; }
sweep() { python3 -c 'import sys; from cupy_llama.cli import main; sys.argv[0] = "cupy-llama"; sys.exit(main())' \
  bench decode-sweep --batch-sizes 128,256 --model "$MODEL" --json "$OUT/sweep_ids_$1.json"; }
timeline main 1; timeline base 1 --repo "$BASE"; sweep 1
timeline main 2; timeline base 2 --repo "$BASE"; sweep 2
