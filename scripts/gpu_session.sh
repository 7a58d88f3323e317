#!/usr/bin/env bash
# Every GPU check in one go, for a machine with an NVIDIA GPU, CuPy, torch and transformers:
# kernel self-test, GPU tests, whole-model comparisons with transformers (a random model of
# Llama-3.2-1B's shape and, when its GGUF is given, the demo model) and first benchmark
# numbers. Logs and JSON go to $OUT (default ./out).
#
#   bash scripts/gpu_session.sh [DEMO_GGUF]
#
# Steps run on even when one fails; the summary at the end lists each step's exit code.
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
DEMO_GGUF=${1:-}
COMMIT=${COMMIT:-unknown}
WORK=${WORK:-/tmp/cupy-llama-gpu}
mkdir -p "$WORK"
declare -a SUMMARY

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  SUMMARY+=("$name rc=$rc $((SECONDS - t0))s")
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step selftest 300 python3 -m cupy_llama.backends.cuda.selftest
[ -n "${SKIP_GPU_TESTS:-}" ] || step gpu_tests 400 python3 -m pytest -q -m gpu tests/ -x -p no:cacheprovider
[ -d "$WORK/m1b" ] || step make_1b 300 python3 scripts/make_random_model.py "$WORK/m1b" --preset llama-3.2-1b
step compare_1b 400 python3 scripts/compare_hf.py "$WORK/m1b" --json "$OUT/compare_1b.json"
if [ -n "$DEMO_GGUF" ]; then
  [ -d "$WORK/demo" ] || step fetch_demo 300 python3 -m cupy_llama.cli fetch-demo --gguf "$DEMO_GGUF" --out "$WORK/demo" --no-check
  step compare_demo 300 python3 scripts/compare_hf.py "$WORK/demo" --chat --json "$OUT/compare_demo.json"
  step engine_demo 300 python3 scripts/gpu_engine_checks.py "$WORK/demo" --json "$OUT/engine_demo.json"
  step cli_chat 120 bash -c "echo 'What is the capital of France?' | python3 -m cupy_llama.cli chat --model '$WORK/demo' --temperature 0"
  step cli_generate 120 python3 -m cupy_llama.cli generate --model "$WORK/demo" --input examples/requests.jsonl --temperature 0
fi
step engine_1b 300 python3 scripts/gpu_engine_checks.py "$WORK/m1b" --json "$OUT/engine_1b.json"
step cli_info 120 python3 -m cupy_llama.cli info --model "$WORK/m1b" --device cuda
[ -n "${SKIP_BENCH:-}" ] || step bench_first 400 python3 scripts/bench_first.py "$WORK/m1b" --commit "$COMMIT" --json "$OUT/first_numbers.json"
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
