#!/usr/bin/env bash
# `bench throughput` beside `bench serve --max-concurrency 256` of a Llama-3.2-1B random
# model, alternating, ROUNDS rounds: the server as it is with bench serve's default clients
# (8 processes of 32 streams) and with 4 processes of 64; with BASE_APP (an app.py, e.g.
# `git show c190ef0:cupy_llama/server/app.py`) also a copy of this tree whose server is
# that file (4 client processes). Each JSON holds the engine's counters over the run
# (results.engine) and the run's edges (results.first_token_s, last_start_s). The serve
# extra must be installed. On a GPU, from the repository root:
#   bash benchmarks/host_path/served_first_step/serve_beside.sh OUT_DIR [BASE_APP] [MODELS_DIR]
set -u
out=$(realpath -m "$1") base_app=${2:-} models=$(realpath -m "${3:-/tmp/serve_models}")
rounds=${ROUNDS:-2} here=$PWD copy=$(mktemp -d)
mkdir -p "$out" "$models"
model=$models/llama-3.2-1b
[ -d "$model" ] || python3 scripts/make_random_model.py --preset llama-3.2-1b "$model" > /dev/null
if [ -n "$base_app" ]; then
  cp -r "$here/cupy_llama" "$here/cuda_src" "$copy/" && cp "$base_app" "$copy/cupy_llama/server/app.py"
fi
served() {  # tag tree round [bench serve options]
  json=$out/serve_$1_$3.json tree=$2 round=$3
  shift 3
  (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" python3 -m cupy_llama.cli bench serve \
    --device cuda --model "$model" --max-concurrency 256 --json "$json" "$@" > "${json%.json}.log" 2>&1)
  python3 -c "import json; r = json.load(open('$json'))['results']; e = r['engine']
print('serve $(basename "$json" .json):', round(r['output_tok_s']), 'tok/s, first token',
      round(r['first_token_s'], 3), 's, engine idle', round(e['idle_s'], 3), 's')"
}
for i in $(seq "$rounds"); do
  PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" python3 -m cupy_llama.cli bench throughput \
    --device cuda --model "$model" --json "$out/throughput_$i.json" > "$out/throughput_$i.log" 2>&1
  echo "throughput $i: $(grep -o '"output_tok_s": [0-9.]*' "$out/throughput_$i.json" | head -1)"
  served 8_clients "$here" $i
  served 4_clients "$here" $i --client-processes 4
  [ -z "$base_app" ] || served base_app "$copy" $i --client-processes 4
done
