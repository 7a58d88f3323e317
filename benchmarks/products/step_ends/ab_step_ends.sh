#!/usr/bin/env bash
# A step's two ends, the split argmax pass (sampling.cu, "Split argmax") and the embedding
# lookup that lets layer 0's product start, against the files before them, each tree in
# turn: bench latency (greedy, batch 1) of random models of the llama-3.2-1b (vocabulary
# 128,256), qwen3-0.6b (151,936) and gemma-3-1b (262,144) presets, bench decode-sweep of
# the Llama one at batches 8, 16 and 64, and in the first round the kernel table of a
# Llama batch-1 step (scripts/perf.py --kernels-only).
#   [ROUNDS="1 2"] bash benchmarks/products/step_ends/ab_step_ends.sh OUT BASE_DIR
# BASE_DIR holds the base's copies of the files below (e.g. `git archive 0e4ed92 $FILES |
# tar -x -C DIR`). Run from the repository root on the GPU machine; the files are swapped
# in place and put back at the end, or when the script stops early. The random models go
# to /tmp/m; the results to OUT/ab_<rounds>.tgz.
set -u
OUT=$1; BASE=$2
R=$PWD; T0=$SECONDS
export PYTHONUNBUFFERED=1
FILES="cuda_src/sampling.cu cupy_llama/backends/cuda/sampling.py cuda_src/embedding.cu"
mkdir -p "$OUT/ab" /tmp/new_files
for f in $FILES; do mkdir -p /tmp/new_files/$(dirname $f); cp $f /tmp/new_files/$f; done
trap 'for f in $FILES; do cp /tmp/new_files/$f "$R/$f"; done' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
for preset in llama-3.2-1b qwen3-0.6b gemma-3-1b; do
  [ -d /tmp/m/$preset ] || PYTHONPATH=$R python3 scripts/make_random_model.py --preset $preset /tmp/m/$preset > /dev/null 2>&1 &
done
wait
echo "models $((SECONDS-T0))s"
for i in ${ROUNDS:-1 2}; do
  for v in base new; do
    if [ $v = base ]; then src=$BASE; else src=/tmp/new_files; fi
    for f in $FILES; do cp $src/$f $f; done
    for preset in llama-3.2-1b qwen3-0.6b gemma-3-1b; do
      j=$OUT/ab/latency_${preset}_${v}_$i
      PYTHONPATH=$R timeout 120 python3 -m cupy_llama.cli bench latency --device cuda --model /tmp/m/$preset --json $j.json > $j.log 2>&1
      echo "$preset $v $i rc=$? $((SECONDS-T0))s $(grep -o '[0-9,.]* tok/s' $j.log | head -1)"
    done
    j=$OUT/ab/sweep_llama-3.2-1b_${v}_$i
    PYTHONPATH=$R timeout 120 python3 -m cupy_llama.cli bench decode-sweep --device cuda --model /tmp/m/llama-3.2-1b --batch-sizes 8,16,64 --json $j.json > $j.log 2>&1
    echo "llama sweep $v $i rc=$? $((SECONDS-T0))s $(grep 'decode-sweep: batch' $j.log | sed 's/decode-sweep: batch //' | tr '\n' ' ')"
    if [ $i = 1 ]; then
      PYTHONPATH=$R timeout 150 python3 scripts/perf.py /tmp/m/llama-3.2-1b --batches 1 --contexts 512 --kernels-only --json $OUT/ab/perf_llama_${v}.json > $OUT/ab/perf_llama_${v}.txt 2>&1
      echo "perf $v rc=$? $((SECONDS-T0))s $(grep -E '^(sample|== decode)' $OUT/ab/perf_llama_${v}.txt | tr '\n' ' ')"
    fi
  done
done
TAG=$(echo ${ROUNDS:-1 2} | tr " " _)
cd "$OUT" && tar -czf ab_$TAG.tgz ab && rm -rf ab
