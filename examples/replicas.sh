#!/usr/bin/env bash
# N replicas of `cupy-llama serve` on this machine, one per GPU, with nginx in front of them
# (examples/nginx.conf with its upstream list filled in):
#
#   examples/replicas.sh N [serve options]          e.g. examples/replicas.sh 2 --model DIR
#
# Replica i (0, 1, ...) listens on 127.0.0.1:$((BASE_PORT + i)) and sees one GPU: the i-th
# of $CUDA_VISIBLE_DEVICES when that is set, else of nvidia-smi's list (none with --device
# cpu, or where there is no GPU). nginx listens on $HOST:$PORT, in the foreground and as
# whoever runs this, with its config, pid file and logs in a temp folder. The script waits
# for every replica's /health and for nginx and prints the URL. A replica that exits later
# (a crash, a stuck engine) is started again after a pause that doubles with each restart
# (1 s, 2 s, ... up to 30 s; back to 1 s once it has run for a minute), while nginx sends
# its requests to the others. Ctrl-C or SIGTERM stops them all; so does nginx exiting, or
# a replica that fails before it ever served.
#
# Environment: PORT (default 8000), HOST (127.0.0.1; 0.0.0.0 for every interface), BASE_PORT
# ($PORT + 1), NGINX (nginx on the PATH, else /usr/sbin/nginx), CUPY_LLAMA (the command
# that runs cupy-llama, default cupy-llama).
set -euo pipefail

usage() {
    echo "usage: $0 N [cupy-llama serve options]   (N replicas, one per GPU)" >&2
    exit 2
}

[[ $# -ge 1 && $1 =~ ^[1-9][0-9]*$ ]] || usage
count=$1
shift
serve_options=("$@")
port=${PORT:-8000}
host=${HOST:-127.0.0.1}
base_port=${BASE_PORT:-$((port + 1))}
read -ra cupy_llama <<< "${CUPY_LLAMA:-cupy-llama}"
here=$(cd "$(dirname "$0")" && pwd)

nginx=${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}
if [[ ! -x $nginx ]]; then
    echo "error: nginx is not installed (Debian, Ubuntu: apt-get install nginx), or set NGINX" >&2
    exit 1
fi

# the GPUs, one per replica: none when the replicas run on the CPU
on_cpu=false
previous=
for arg in "$@"; do
    [[ $arg == --device=cpu || ($previous == --device && $arg == cpu) ]] && on_cpu=true
    previous=$arg
done
gpus=()
if ! $on_cpu; then
    if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
        IFS=, read -ra gpus <<< "$CUDA_VISIBLE_DEVICES"
    elif command -v nvidia-smi > /dev/null; then
        mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader 2> /dev/null || true)
    fi
    if ((${#gpus[@]} && ${#gpus[@]} < count)); then
        echo "error: $count replicas need $count GPUs, and there are ${#gpus[@]}" \
             "(${gpus[*]}); start fewer, or list more in CUDA_VISIBLE_DEVICES" >&2
        exit 2
    fi
fi

folder=$(mktemp -d "${TMPDIR:-/tmp}/cupy-llama-replicas.XXXXXX")
mkdir "$folder/logs"

# The replicas and nginx each run in a process group of their own (started under job
# control, set -m), so that Ctrl-C reaches this script alone, which then stops each group
# whole (a replica is two processes: the server and its engine).
replicas=()  # the replicas' process ids, which are also their process groups
nginx_pid=

alive() {
    kill -0 "$1" 2> /dev/null
}

stop_all() {
    local status=$? pid
    trap - EXIT INT TERM
    set +e  # a process that is gone already is no reason to stop stopping the others
    # nginx first, then the replicas at once (SIGINT: no drain delay, there is no balancer
    # left to tell); past 15 s, SIGKILL to whatever is left
    [[ -n $nginx_pid ]] && kill -TERM -- "-$nginx_pid" 2> /dev/null
    for pid in "${replicas[@]}"; do
        kill -INT -- "-$pid" 2> /dev/null
    done
    local deadline=$((SECONDS + 15))
    for pid in $nginx_pid "${replicas[@]}"; do
        while alive "$pid" && ((SECONDS < deadline)); do
            sleep 0.1
        done
        kill -KILL -- "-$pid" 2> /dev/null
    done
    echo "stopped; the logs are in $folder/logs" >&2
    exit "$status"
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

started_at=()  # when each replica was last started ($SECONDS)

start_replica() {  # $1: the replica's index; its log grows across restarts
    local i=$1 device=()
    ((${#gpus[@]})) && device=(env "CUDA_VISIBLE_DEVICES=${gpus[i]}")
    set -m
    "${device[@]}" "${cupy_llama[@]}" serve "${serve_options[@]}" --host 127.0.0.1 \
        --port "$((base_port + i))" < /dev/null >> "$folder/logs/replica-$i.log" 2>&1 &
    set +m
    replicas[i]=$!
    started_at[i]=$SECONDS
}

addresses=()
for ((i = 0; i < count; i++)); do
    addresses+=("127.0.0.1:$((base_port + i))")
    start_replica "$i"
done

# examples/nginx.conf with one upstream line per replica (copied from the first one) and
# this script's listening address
awk -v replicas="${addresses[*]}" -v listen="$host:$port" '
    /^[ \t]*server[ \t]+[^ \t{]+:[0-9]+[ \t;]/ {
        if (!written) {
            n = split(replicas, address, " ")
            for (i = 1; i <= n; i++) {
                line = $0
                sub(/server[ \t]+[^ \t;]+/, "server " address[i], line)
                print line
            }
            written = 1
        }
        next
    }
    /^[ \t]*listen[ \t]/ { sub(/listen[ \t]+[^;]+/, "listen " listen) }
    { print }
' "$here/nginx.conf" > "$folder/nginx.conf"
set -m
"$nginx" -p "$folder" -c "$folder/nginx.conf" -g 'daemon off;' \
    < /dev/null > "$folder/logs/nginx.out" 2>&1 &
set +m
nginx_pid=$!

# GET /health on 127.0.0.1:$1 answers 200 (bash's /dev/tcp: no curl needed)
healthy() {
    local status
    { exec 3<> "/dev/tcp/$2/$1"; } 2> /dev/null || return 1
    printf 'GET /health HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n' "$2" >&3
    IFS= read -r -t 5 status <&3 || status=
    exec 3<&-
    [[ $status == "HTTP/1."?" 200 "* ]]
}

died() {  # $1: the log of what exited
    echo "error: $2 exited; the end of its log ($1):" >&2
    tail -n 20 "$1" >&2
    exit 1
}

[[ $host == 0.0.0.0 ]] && probe=127.0.0.1 || probe=${host#[}
probe=${probe%]}
if ((${#gpus[@]})); then
    where="GPUs ${gpus[*]:0:count}, one each"
else
    where="no GPU assigned"
fi
echo "starting $count replicas on 127.0.0.1:$base_port-$((base_port + count - 1)) ($where)" \
     "and nginx on $host:$port; logs in $folder/logs" >&2
waiting=("${!replicas[@]}")
while ((${#waiting[@]})); do
    alive "$nginx_pid" || died "$folder/logs/nginx.out" nginx
    still=()
    for i in "${waiting[@]}"; do
        alive "${replicas[i]}" || died "$folder/logs/replica-$i.log" "replica $i"
        healthy $((base_port + i)) 127.0.0.1 || still+=("$i")
    done
    waiting=("${still[@]}")
    ((${#waiting[@]})) && sleep 0.2
done
until healthy "$port" "$probe"; do
    alive "$nginx_pid" || died "$folder/logs/nginx.out" nginx
    sleep 0.2
done
echo "serving at http://$host:$port/v1 through nginx, $count replicas; Ctrl-C stops"

# Until a signal comes (its trap exits): a replica that exits is started again after its
# pause, while nginx sends its requests to the others.
pause=()
for i in "${!replicas[@]}"; do
    pause[i]=1
done
while true; do
    wait -n || true
    alive "$nginx_pid" || died "$folder/logs/nginx.out" nginx
    for i in "${!replicas[@]}"; do
        alive "${replicas[i]}" && continue
        code=0
        wait "${replicas[i]}" || code=$?
        ((SECONDS - started_at[i] >= 60)) && pause[i]=1  # it ran a while: a fresh start
        echo "replica $i exited (code $code); restarting it in ${pause[i]} s; its log:" \
             "$folder/logs/replica-$i.log" >&2
        sleep "${pause[i]}" &
        wait $!  # (a signal's trap runs at once)
        start_replica "$i"
        pause[i]=$((pause[i] * 2 > 30 ? 30 : pause[i] * 2))
    done
done
