#!/usr/bin/env bash
# The serving checks of issues 17 and 20 on one GPU, in one call (each step time-limited, 580 s
# in all): HTTP against in process (the engine thread, then --engine-process), a quarter of the
# clients leaving, Poisson arrivals, survivors of a burst, and the cost of logprobs=5. Each step's
# JSON and log go into OUTDIR; one compilation cache for all, so only the first step compiles
# from scratch.
#
#   PYTHONPATH=. JAX_PLATFORMS=cuda bash bench/run_serving_checks.sh OUTDIR
#
# MODEL (env, default random:gpt2), N (streams, 256), LEN (new tokens, 256), RATE (Poisson
# requests/s, 300) size it; a CPU smoke run: MODEL=random:tiny N=8 LEN=8 RATE=20.
set -uo pipefail
OUT=${1:-bench/out/serving}
PY=${PYTHON:-python3}
MODEL=${MODEL:-random:gpt2}
N=${N:-256}
LEN=${LEN:-256}
RATE=${RATE:-300}
mkdir -p "$OUT"
CACHE=${CACHE:-$OUT/jax-cache}
ENGINE=(--model "$MODEL" --max-batch-size "$N" --compilation-cache-dir "$CACHE")
SERVE=("${ENGINE[@]}" --launch --num-prompts "$N" --output-len "$LEN" --no-progress)

step() {  # name, time limit (s), script and flags
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), ${SECONDS}s in, limit ${limit}s)"
    timeout "$limit" "$PY" "$@" > "$OUT/$name.log" 2>&1
    echo "=== $name exit $? at ${SECONDS}s"
    grep -E "server up|compiled .* after|Output token|Median TTFT|Median TPOT|Max event|Disconnected|HTTP /|oodput|after burst|tok/s" \
        "$OUT/$name.log" | head -12
}

step http 180 bench/benchmark_serving.py "${SERVE[@]}" --in-process --warmup-runs 2 \
    --server-log "$OUT/http-server.log" --json "$OUT/http.json"
step http-engine-process 90 bench/benchmark_serving.py "${SERVE[@]}" --warmup-runs 2 \
    --server-args "--max-waiting -1 --engine-process" --server-log "$OUT/ep-server.log" \
    --json "$OUT/http-engine-process.json"
step disconnect 60 bench/benchmark_serving.py "${SERVE[@]}" --disconnect-fraction 0.25 \
    --json "$OUT/disconnect.json"
step poisson 60 bench/benchmark_serving.py "${SERVE[@]}" --num-prompts $((4 * N)) \
    --request-rate "$RATE" --goodput ttft:200 tpot:10 --json "$OUT/poisson.json"
step slot-reuse 70 bench/benchmark_slot_reuse.py "${ENGINE[@]}" --json "$OUT/slot-reuse.json" \
    --survivor-tokens "$LEN" --skip-tokens $((LEN / 4)) --burst-tokens $((LEN / 16 + 1))
for lp in none 5; do
    flag=()
    [[ $lp != none ]] && flag=(--logprobs "$lp")
    step "logprobs-$lp" 60 bench/benchmark_streaming.py "${ENGINE[@]}" --num-requests "$N" \
        --max-new-tokens "$LEN" --no-stop-on-eos --no-warmup --no-progress --warmup-runs 1 \
        --repeat-runs 3 "${flag[@]}" --json "$OUT/logprobs-$lp.json"
done
