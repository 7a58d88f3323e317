#!/usr/bin/env bash
# GPU checks in one go, for a machine with an NVIDIA GPU, CuPy, torch and transformers.
# Logs and JSON go to $OUT (default ./out). Steps run on even when one fails; the summary
# at the end lists each step's exit code.
#
#   STEPS="selftest gpu_tests compare_1b bench" bash scripts/gpu_session.sh [DEMO_GGUF]
#
# Steps: selftest gpu_tests attention_bench perf perf_steps perf_kernels perf_kernels_families
# bench compare_1b engine_1b info_1b demo fp8 bench_hf wheel prefix serve (= serve_base serve_load
# serve_c1) families (= family_latency family_throughput: bench latency and throughput of
# each family's preset shape)
# (perf_kernels_families: scripts/perf.py --kernels-only on the random models of
# $KERNEL_FAMILIES' preset shapes, default llama-3.2-1b qwen3-0.6b gemma-3-1b, batch 1, 8
# and 64 at contexts 288, 512 and 2,048, JSON to $OUT/perf_kernels_PRESET.json; the models
# are bench's, written once into its cache, and the Llama one is $M1B)
# (wheel: builds the wheel, installs it outside the checkout, runs the gpu tests and bench
# latency/throughput from it; serve: needs fastapi, uvicorn and pydantic, from wheels in
# ./.whl when they are not installed; prefix: bench prefix, scripts/prefix_check.py and the
# offline workload with caching off)
# (demo needs DEMO_GGUF: builds the demo model, compares it with transformers, runs the
# engine checks and the CLI on it; fp8: the FP8 gpu tests, bench latency, ttft and
# throughput of the Llama-3.2-1B shape in bf16 and with --quantization fp8 one after the
# other, and scripts/fp8_accuracy.py on it).
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
DEMO_GGUF=${1:-}
COMMIT=${COMMIT:-unknown}
WORK=${WORK:-/tmp/cupy-llama-gpu}
STEPS=${STEPS:-selftest gpu_tests compare_1b engine_1b info_1b perf bench demo}
export CUPY_LLAMA_CACHE=$WORK/cache
mkdir -p "$WORK"
declare -a SUMMARY

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  grep -v "Loading weights" "$OUT/$name.log" | tail -n "${TAIL:-20}"
  SUMMARY+=("$name rc=$rc $((SECONDS - t0))s")
}
wants() { [[ " $STEPS " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
M1B=$WORK/m1b
[ -d "$M1B" ] || step make_1b 300 python3 scripts/make_random_model.py "$M1B" --preset llama-3.2-1b
wants selftest && step selftest 300 python3 scripts/selftest.py
wants gpu_tests && step gpu_tests 400 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider
wants attention_bench && step attention_bench 240 python3 scripts/attention_bench.py
wants perf && step perf 300 python3 scripts/perf.py "$M1B"
wants perf_steps && step perf_steps 300 python3 scripts/perf.py "$M1B" --steps-only
wants perf_kernels && step perf_kernels 300 python3 scripts/perf.py "$M1B" --kernels-only
if wants perf_kernels_families; then
  for preset in ${KERNEL_FAMILIES:-llama-3.2-1b qwen3-0.6b gemma-3-1b}; do
    if [ "$preset" = llama-3.2-1b ]; then
      model=$M1B  # made above
    else
      model=$CUPY_LLAMA_CACHE/bench-models/$preset-seed0  # where bench keeps its preset models
      if [ ! -f "$model/.complete" ]; then
        rm -rf "$model"
        step make_$preset 300 bash -c "python3 scripts/make_random_model.py '$model' --preset $preset && touch '$model/.complete'"
      fi
    fi
    step perf_kernels_$preset 300 python3 scripts/perf.py "$model" --kernels-only --batches 1,8,64 --contexts 288,512,2048 --json "$OUT/perf_kernels_$preset.json"
  done
fi
wants bench && step bench 300 python3 -m cupy_llama.cli bench all --device cuda --model "$M1B" --commit "$COMMIT" --json "$OUT/bench_h200.json"
wants compare_1b && step compare_1b 400 python3 scripts/compare_hf.py "$M1B" --json "$OUT/compare_1b.json"
wants engine_1b && step engine_1b 300 python3 scripts/gpu_engine_checks.py "$M1B" --json "$OUT/engine_1b.json"
wants info_1b && step info_1b 120 python3 -m cupy_llama.cli info --model "$M1B" --device cuda
FAMILIES=${FAMILIES:-llama-3.2-1b qwen3-0.6b qwen2.5-1.5b gemma-3-1b}
for mode in latency throughput; do
  if wants families || wants family_$mode; then
    for preset in $FAMILIES; do
      step ${mode}_$preset 300 python3 -m cupy_llama.cli bench $mode --device cuda --preset $preset --commit "$COMMIT" --json "$OUT/bench_${mode}_$preset.json"
    done
  fi
done
if wants fp8; then
  step fp8_tests 300 python3 -m pytest -q -m gpu tests/test_cuda_fp8.py tests/test_cuda_fused.py -p no:cacheprovider
  for mode in latency ttft throughput; do
    step bf16_$mode 200 python3 -m cupy_llama.cli bench $mode --device cuda --model "$M1B" --commit "$COMMIT" --json "$OUT/bench_${mode}_bf16.json"
    step fp8_$mode 200 python3 -m cupy_llama.cli bench $mode --device cuda --model "$M1B" --quantization fp8 --commit "$COMMIT" --json "$OUT/bench_${mode}_fp8.json"
  done
  step fp8_accuracy_1b 300 python3 scripts/fp8_accuracy.py "$M1B" --device cuda --json "$OUT/fp8_accuracy_1b.json"
fi
if wants demo && [ -n "$DEMO_GGUF" ]; then
  [ -d "$WORK/demo" ] || step fetch_demo 300 python3 -m cupy_llama.cli fetch-demo --gguf "$DEMO_GGUF" --out "$WORK/demo" --no-check
  step compare_demo 300 python3 scripts/compare_hf.py "$WORK/demo" --chat --json "$OUT/compare_demo.json"
  step engine_demo 300 python3 scripts/gpu_engine_checks.py "$WORK/demo" --json "$OUT/engine_demo.json"
  step cli_chat 120 bash -c "echo 'What is the capital of France?' | python3 -m cupy_llama.cli chat --model '$WORK/demo' --temperature 0"
  step cli_generate 120 python3 -m cupy_llama.cli generate --model "$WORK/demo" --input examples/requests.jsonl --temperature 0
fi
wants bench_hf && step bench_hf 240 bash -c "python3 -m cupy_llama.cli bench latency --device cuda --hf --model '$M1B' --commit '$COMMIT' --json '$OUT/bench_latency_hf_h200.json' && python3 -m cupy_llama.cli bench ttft --device cuda --hf --model '$M1B' --commit '$COMMIT' --json '$OUT/bench_ttft_hf_h200.json'"
if wants wheel; then  # the package as installed from a wheel, outside the checkout
  rm -rf "$WORK/dist" "$WORK/wheel_site"
  step wheel_build 200 python3 -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" .
  step wheel_install 120 bash -c "python3 -m pip install -q --no-deps --no-index --target '$WORK/wheel_site' '$WORK'/dist/cupy_llama-*.whl"
  step wheel_tests 500 bash -c "cd '$WORK' && PYTHONPATH='$WORK/wheel_site' python3 -c 'import cupy_llama, sys; print(cupy_llama.__file__); sys.exit(0 if cupy_llama.__file__.startswith(\"$WORK/wheel_site\") else 1)' && PYTHONPATH='$WORK/wheel_site' python3 -m pytest -q -m gpu '$PWD/tests' -p no:cacheprovider"
  for mode in latency throughput; do
    step wheel_$mode 200 bash -c "cd '$WORK' && PYTHONPATH='$WORK/wheel_site' python3 -m cupy_llama.cli bench $mode --device cuda --model '$M1B' --commit '$COMMIT' --json '$OUT/bench_${mode}_wheel.json'"
    step editable_$mode 200 python3 -m cupy_llama.cli bench $mode --device cuda --model "$M1B" --commit "$COMMIT" --json "$OUT/bench_${mode}_editable.json"
  done
fi
if wants prefix; then
  step bench_prefix 300 python3 -m cupy_llama.cli bench prefix --device cuda --model "$M1B" --commit "$COMMIT" --json "$OUT/bench_prefix_h200.json"
  step prefix_check 300 python3 scripts/prefix_check.py "$M1B" --json "$OUT/prefix_check_h200.json"
  step throughput_no_cache 200 python3 -m cupy_llama.cli bench throughput --device cuda --no-prefix-caching --model "$M1B" --commit "$COMMIT" --json "$OUT/bench_throughput_no_cache_h200.json"
fi
if wants serve || wants serve_base || wants serve_load || wants serve_c1; then
  if ! python3 -c "import fastapi, uvicorn, pydantic" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/serve_site" .whl/*.whl
    export PYTHONPATH=$PYTHONPATH:$WORK/serve_site
  fi
fi
if wants serve || wants serve_base; then
  step serve_throughput 200 python3 -m cupy_llama.cli bench throughput --device cuda --model "$M1B" --commit "$COMMIT" --json "$OUT/serve_baseline_throughput.json"
  step serve_latency 200 python3 -m cupy_llama.cli bench latency --device cuda --model "$M1B" --commit "$COMMIT" --json "$OUT/serve_baseline_latency.json"
fi
if wants serve || wants serve_load; then
  for c in 256 64 16; do
    step serve_c$c 300 python3 -m cupy_llama.cli bench serve --device cuda --model "$M1B" --commit "$COMMIT" --max-concurrency $c --json "$OUT/serve_c$c.json"
  done
fi
if wants serve || wants serve_c1; then
  step serve_c1 300 python3 -m cupy_llama.cli bench serve --device cuda --model "$M1B" --commit "$COMMIT" --max-concurrency 1 --num-requests 32 --json "$OUT/serve_c1.json"
  step serve_latency_shape 200 python3 -m cupy_llama.cli bench serve --device cuda --model "$M1B" --commit "$COMMIT" --max-concurrency 1 --num-requests 16 --input-len 32 --output-len 256 --temperature 0 --json "$OUT/serve_latency_shape.json"
  step serve_ttft1024 200 python3 -m cupy_llama.cli bench serve --device cuda --model "$M1B" --commit "$COMMIT" --max-concurrency 1 --num-requests 32 --input-len 1024 --output-len 2 --temperature 0 --json "$OUT/serve_ttft1024.json"
fi
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
