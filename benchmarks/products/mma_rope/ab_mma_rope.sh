#!/usr/bin/env bash
# RoPE and the cache write inside the tensor-core decode kernel (attention.cu's _rope forms,
# NOTES "Tried, dropped: RoPE ... inside the tensor-core decode kernel"), on against off
# (KernelSwitches.mma_rope; CUPY_LLAMA_MMA_ROPE=0 runs the rope kernel before attention) in
# one tree: a checkout of c56f475 with mma_rope.patch beside this script applied (`git
# apply`) and this folder's two scripts copied into benchmarks/products/mma_rope/ there. First call: the GPU tests of the rope
# forms and of graph decode; the graph-replayed decode step at batch 8, 64 and 256,
# context 512, of three presets, both variants in turn on one loaded model, three rounds,
# with the logits compared (steps_ab.py); the whole GPU suite in what is left of 560 s.
# With "second": bench throughput of the Llama shape, two rounds of each, then the whole
# GPU suite again.
#   OUT=DIR bash benchmarks/products/mma_rope/ab_mma_rope.sh [second]   (DIR exists)
# Run from the repository root on the GPU machine; random models go to /root/m, results
# to OUT/r.tgz.
set -u
export PYTHONUNBUFFERED=1 CUPY_LLAMA_CACHE=/root/cache PYTHONPATH=$PWD
T0=$SECONDS; PRESETS="llama-3.2-1b qwen3-0.6b qwen2.5-1.5b"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for p in $PRESETS; do
  [ -d /root/m/$p ] || python3 scripts/make_random_model.py --preset $p /root/m/$p > /dev/null 2>&1 &
done
wait; echo "models $((SECONDS-T0))s"
mkdir -p $OUT/r
throughput() {
  for v in 0 1; do
    j=$OUT/r/throughput_llama_rope${v}_$1
    CUPY_LLAMA_MMA_ROPE=$v timeout 100 python3 -m cupy_llama.cli bench throughput --device cuda \
      --model /root/m/llama-3.2-1b --json $j.json > $j.log 2>&1
    echo "throughput rope=$v $1 rc=$? $((SECONDS-T0))s $(grep -o 'throughput:.*' $j.log | head -1)"
  done
}
left() { local l=$(( $1 - (SECONDS - T0) )); echo $(( l > 1 ? l : 1 )); }  # of a budget of $1 s
if [ "${1:-}" != second ]; then
  timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_cuda_families.py \
    tests/test_cuda_graphs.py -k "rotates_as or rope_goes_to or graph_decode_matches_eager" \
    > $OUT/r/gpu_tests_rope.log 2>&1
  echo "tests rc=$? $((SECONDS-T0))s $(tail -1 $OUT/r/gpu_tests_rope.log)"
  for p in $PRESETS; do
    timeout 150 python3 benchmarks/products/mma_rope/steps_ab.py /root/m/$p \
      --json $OUT/r/steps_$p.json > $OUT/r/steps_$p.log 2>&1
    echo "$p rc=$? $((SECONDS-T0))s"; grep "^batch" $OUT/r/steps_$p.log
  done
  # the whole suite in what is left of the call (the rest in the second call)
  timeout $(left 560) python3 -m pytest -m gpu -q -p no:cacheprovider tests/ \
    > $OUT/r/gpu_tests_all.log 2>&1
  echo "all tests rc=$? $((SECONDS-T0))s $(tail -1 $OUT/r/gpu_tests_all.log)"
else
  throughput 1
  throughput 2
  timeout $(left 560) python3 -m pytest -m gpu -q -p no:cacheprovider tests/ \
    > $OUT/r/gpu_tests_all.log 2>&1
  echo "all tests rc=$? $((SECONDS-T0))s $(tail -1 $OUT/r/gpu_tests_all.log)"
fi
cd $OUT && tar -czf r.tgz r && rm -rf r
echo "all done $((SECONDS-T0))s"
