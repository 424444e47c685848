#!/usr/bin/env bash
# The seed engine's workloads (shared/DESIGN.md's table) on one GPU, each JSON and one log into OUTDIR.
# GPT-2 124M shape, random weights, fp16, EOS off, greedy; compile happens in each script's
# untimed warm-up run (--no-warmup skips the engine's compile-every-bucket start-up).
#
#   PYTHONPATH=. JAX_PLATFORMS=cuda bash bench/run_seed_workloads.sh OUTDIR [BUDGET_S] [HF_BATCHES]
#
# BUDGET_S (default 340): the last step (rosejax beside HF) gets what is left of it.
# HF_BATCHES (default 256): --batch-sizes of compare_hf. MODEL (env) overrides random:gpt2.
set -uo pipefail
OUT=${1:-bench/out/seed}
BUDGET=${2:-340}
HF_BATCHES=${3:-256}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
COMMON=(--model "${MODEL:-random:gpt2}" --dtype float16 --no-stop-on-eos --no-warmup --no-progress)
plot() { if "$PY" -c "import matplotlib" 2>/dev/null; then echo --plot "$OUT/$1"; fi; }

"$PY" - <<'EOF'
import jax, flax, torch, transformers
print("versions: jax", jax.__version__, "flax", flax.__version__, "torch", torch.__version__,
      "transformers", transformers.__version__, "device", jax.devices()[0].device_kind)
EOF
# Copy bandwidth of this card (bench/common.py), for every roofline.
BW=$("$PY" -c 'from bench.common import copy_bandwidth_gbs; print(round(copy_bandwidth_gbs()))')
echo "copy bandwidth: ${BW} GB/s"
# Every script's roofline takes its % of this (else each would measure it again itself).
if [[ $BW =~ ^[0-9]+$ ]]; then COMMON+=(--bandwidth-gbs "$BW"); fi

step() {  # name, time limit (s), script and flags
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), ${SECONDS}s in, limit ${limit}s): $*"
    timeout "$limit" "$PY" "$@"
    echo "=== $name exit $? at ${SECONDS}s"
}

step w2 90 bench/benchmark_streaming.py "${COMMON[@]}" --num-requests 128 --prompt-repeats 1,4 \
    --max-new-tokens 128 --max-batch-size 128 --warmup-runs 1 --repeat-runs 3 --json "$OUT/w2.json"
step w4 60 bench/benchmark_streaming.py "${COMMON[@]}" --num-requests 1 --max-new-tokens 256 \
    --max-batch-size 1 --warmup-runs 1 --repeat-runs 3 --json "$OUT/w4.json"
step w1 120 bench/benchmark_streaming.py "${COMMON[@]}" --num-requests 256 --max-new-tokens 256 \
    --max-batch-size 16 --warmup-runs 1 --repeat-runs 2 --json "$OUT/w1.json" $(plot w1.png)
step w3 $((BUDGET - SECONDS)) bench/compare_hf.py "${COMMON[@]}" --batch-sizes "$HF_BATCHES" \
    --input-len 8 --max-new-tokens 256 --warmup-runs 1 --repeat-runs 2 \
    --json "$OUT/w3.json" $(plot w3.png)
