#!/usr/bin/env bash
# The serving checks of issues 17 and 20 on one GPU, in one call (about 9 minutes): HTTP against
# in process, the other engine path (SERVE_B), h11 against httptools, a quarter of the clients
# leaving, Poisson arrivals, survivors of a burst, and the cost of logprobs=5. Each step's JSON
# and log go into OUTDIR; one compilation cache for all, so only the first step compiles from
# scratch. Servers after the first serve several workloads each (`--base-url`): a start with a
# full cache still loads every program (about 45 s for gpt2 at batch 256).
#
#   PYTHONPATH=. JAX_PLATFORMS=cuda bash bench/run_serving_checks.sh OUTDIR
#
# MODEL (env, default random:gpt2), N (streams, 256), LEN (new tokens, 256), RATE (Poisson
# requests/s, 300) size it; SERVE_B (default --api-server-count 1: one process, the engine on a
# thread) is the second server's flags beside the default server's (on a GPU host of 16 cores or
# more: four API server processes on one listening socket in front of an engine process);
# SERVE_B="--api-server-count 1 --engine-process" is one API process in front of the engine
# process. A CPU smoke run: MODEL=random:tiny N=8 LEN=8
# RATE=20. CHECKS=http runs the HTTP steps alone (no h11 server, slot reuse or logprobs).
set -uo pipefail
OUT=$(mkdir -p "${1:-bench/out/serving}" && cd "${1:-bench/out/serving}" && pwd)
PY=${PYTHON:-python3}
MODEL=${MODEL:-random:gpt2}
N=${N:-256}
LEN=${LEN:-256}
RATE=${RATE:-300}
SERVE_B=${SERVE_B:---api-server-count 1}
CHECKS=${CHECKS:-all}
CACHE=${CACHE:-$OUT/jax-cache}
ENGINE=(--model "$MODEL" --max-batch-size "$N" --compilation-cache-dir "$CACHE")
RUN=(--num-prompts "$N" --output-len "$LEN" --no-progress)
SERVER_PID=

step() {  # name, time limit (s), script and flags
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), ${SECONDS}s in, limit ${limit}s)"
    timeout "$limit" "$PY" "$@" > "$OUT/$name.log" 2>&1
    echo "=== $name exit $? at ${SECONDS}s"
    grep -E "server up|compiled .* after|Output token|Median TTFT|Median TPOT|Max event|Disconnected|HTTP /|oodput|after burst|tok/s" \
        "$OUT/$name.log" | head -12
}

serve() {  # name, limit (s) to serve and compile, server flags: a server in the background
    local name=$1 limit=$2 port
    shift 2
    echo "=== server $name ($(date -u +%H:%M:%S), ${SECONDS}s in): $*"
    port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])")
    URL=http://127.0.0.1:$port
    "$PY" -m rosejax.serve "${ENGINE[@]}" --port "$port" --max-waiting -1 --log-level warning \
        --no-access-log "$@" > "$OUT/server-$name.log" 2>&1 &
    SERVER_PID=$!
    # /health 200, then the programs_to_compile gauge at 0, timed from the launch.
    timeout "$limit" "$PY" - "$URL" <<'EOF'
import sys, time, urllib.request
url, t0, up = sys.argv[1], time.monotonic(), None
while True:
    try:
        with urllib.request.urlopen(url + ("/metrics" if up else "/health"), timeout=2) as r:
            body = r.read().decode()
    except OSError:
        time.sleep(0.1)
        continue
    if up is None:
        up = time.monotonic() - t0
        continue
    left = [ln for ln in body.splitlines() if ln.startswith("rosejax_programs_to_compile")]
    if not any(float(ln.split()[-1]) for ln in left):
        break
    time.sleep(0.25)
print(f"server up in {up:.1f} s; every program compiled {time.monotonic() - t0:.1f} s after launch")
EOF
    echo "=== server $name ready (exit $?)"
}

unserve() {
    kill -INT "$SERVER_PID" 2>/dev/null
    timeout 30 tail --pid="$SERVER_PID" -f /dev/null || kill -9 "$SERVER_PID" 2>/dev/null
}

# The default server against the same workload in process; its start from an empty cache.
step http 240 bench/benchmark_serving.py "${ENGINE[@]}" "${RUN[@]}" --launch --in-process \
    --warmup-runs 2 --server-log "$OUT/http-server.log" --json "$OUT/http.json"
# The default server again: a quarter of the clients leave; Poisson arrivals near saturation.
serve default 90
step disconnect 30 bench/benchmark_serving.py "${RUN[@]}" --base-url "$URL" \
    --disconnect-fraction 0.25 --warmup-runs 1 --json "$OUT/disconnect.json"
step poisson 40 bench/benchmark_serving.py --base-url "$URL" --num-prompts $((4 * N)) \
    --output-len "$LEN" --no-progress --request-rate "$RATE" --goodput ttft:200 tpot:10 \
    --warmup-runs 0 --json "$OUT/poisson.json"
unserve
sides=(b h11)
[[ $CHECKS == http ]] && sides=(b)
for side in "${sides[@]}"; do
    flags=($SERVE_B)
    [[ $side == h11 ]] && flags=(--http h11)
    serve "$side" 90 "${flags[@]}"
    step "http-$side" 30 bench/benchmark_serving.py "${RUN[@]}" --base-url "$URL" \
        --warmup-runs 2 --json "$OUT/http-$side.json"
    unserve
done
[[ $CHECKS == http ]] && exit 0
step slot-reuse 60 bench/benchmark_slot_reuse.py "${ENGINE[@]}" --json "$OUT/slot-reuse.json" \
    --survivor-tokens "$LEN" --skip-tokens $((LEN / 4)) --burst-tokens $((LEN / 16 + 1))
for lp in none 5; do
    flag=()
    [[ $lp != none ]] && flag=(--logprobs "$lp")
    step "logprobs-$lp" 45 bench/benchmark_streaming.py "${ENGINE[@]}" --num-requests "$N" \
        --max-new-tokens "$LEN" --no-stop-on-eos --no-warmup --no-progress --warmup-runs 1 \
        --repeat-runs 3 "${flag[@]}" --json "$OUT/logprobs-$lp.json"
done
