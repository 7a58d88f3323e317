#!/usr/bin/env bash
# Where batch-1 decode attention's time goes in a step's chain of kernels: `cupy-llama
# bench latency` of Qwen3-0.6B and Gemma-3-1B random models with this tree, with clusters
# off (CUPY_LLAMA_CLUSTERS=0: split and combine), and with four copies whose clustered
# CUDA-core decode kernels leave a part out (outputs wrong: bounds, not variants):
#   noload   no key or value read from the cache
#   nonorm   no q/k head norm or rotation
#   nomerge  no merge of the cluster's key ranges (of a kernel that merges through
#            inboxes: none after its barrier)
#   empty    nothing after the wait for the kernel before
# Alternating, ROUNDS rounds. Run from the repository root on a GPU:
#   bash benchmarks/products/decode_attention_ablation/ablate.sh OUT_DIR [MODELS_DIR]
set -eu
out=$(realpath -m "$1") models=$(realpath -m "${2:-/tmp/ablation_models}") rounds=${ROUNDS:-2}
here=$PWD copies=$(mktemp -d)
trap 'rm -rf "$copies"' EXIT
mkdir -p "$out" "$models"
for variant in noload nonorm nomerge empty; do
  mkdir -p "$copies/$variant" && cp -r cupy_llama cuda_src "$copies/$variant/"
done
python3 - "$copies" <<'PY'
import sys
root = sys.argv[1]
source = open(f"{root}/noload/cuda_src/attention.cu").read()
cuts = {
    "noload": ("""                k_raw[u] = load16(k_cache + offset);
                v_raw[u] = load16(v_cache + offset);""",
               """                k_raw[u].x = (unsigned)offset;  // no cache read"""),
    "nonorm": ("""            norm_rotate_head(qkv_row + (is_key ? num_heads + kv_head : head0 + j) * D, nullptr,
                             pairs, is_key ? reinterpret_cast<bf16*>(new_kv[0]) : new_q + j * D,
                             D, hn.eps, hn.offset);""",
               """            (void)pairs; (void)is_key;  // no head norm"""),
    "empty": ("""    __syncwarp();  // a slot's lanes are in one warp
    wait_for_previous_kernel();
""", """    __syncwarp();  // a slot's lanes are in one warp
    wait_for_previous_kernel();
    if (seq_len > 0) return;  // nothing after the wait
"""),
}
for variant, (old, new) in cuts.items():
    assert source.count(old) == 1, variant
    open(f"{root}/{variant}/cuda_src/attention.cu", "w").write(source.replace(old, new))
# the merge skipped: the pull form's whole cluster_merge_out, or what the inbox form does
# after its barrier (the sends and the barrier stay: no CTA may leave while another still
# writes into its shared memory)
merges = {"        cluster_merge_out<CLUSTER, D, THREADS>(":
              "        if (seq_len < 0) cluster_merge_out<CLUSTER, D, THREADS>(",
          "        cluster_barrier();  // every CTA's result is in the inboxes":
              "        cluster_barrier();\n        if (seq_len > 0) return;  // no merge"}
found = [old for old in merges if source.count(old) == 1]
assert len(found) == 1, "no cluster merge found"
open(f"{root}/nomerge/cuda_src/attention.cu", "w").write(source.replace(found[0], merges[found[0]]))
PY
for preset in qwen3-0.6b gemma-3-1b; do
  [ -d "$models/$preset" ] || python3 scripts/make_random_model.py --preset $preset "$models/$preset" > /dev/null
done
latency() {  # preset variant round
  local tree=$here clusters=1
  case $2 in main) ;; noclusters) clusters=0 ;; *) tree=$copies/$2 ;; esac
  json=$out/$1_$2_$3.json
  (cd "$tree" && CUPY_LLAMA_CLUSTERS=$clusters PYTHONPATH="$tree" python3 -m cupy_llama.cli \
    bench latency --device cuda --model "$models/$1" --json "$json" > "${json%.json}.log" 2>&1)
  echo "$1 $2 round $3: $(grep -o '"tok_s": [0-9.]*' "$json" | head -1)"
}
for i in $(seq "$rounds"); do
  for preset in qwen3-0.6b gemma-3-1b; do
    for variant in main noclusters noload nonorm nomerge empty; do
      latency $preset $variant $i
    done
  done
done
