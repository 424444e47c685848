#!/usr/bin/env bash
# The seed workloads (rosejax's side) for two checkouts of rosejax on one GPU, alternated in one
# call (A, B, then B, A while the budget lasts), so a change's effect can be told from process
# noise. Each checkout runs its own bench/ scripts with its own package on PYTHONPATH.
#
#   JAX_PLATFORMS=cuda bash bench/compare_checkouts.sh BASE_DIR NEW_DIR OUTDIR [BUDGET_S]
#
# Prints a table (median of each run's figures, every run's value beside it) and writes
# OUTDIR/compare.json. BUDGET_S (default 540): no new round starts past it. MODEL (env) overrides
# random:gpt2 and EXTRA (env) adds flags to every script, e.g. MODEL=random:qwen3-0.6b
# EXTRA="--max-model-len 2048".
set -uo pipefail
BASE=$(cd "$1" && pwd) || exit 2
NEW=$(cd "$2" && pwd) || exit 2
OUT=$(mkdir -p "$3" && cd "$3" && pwd)
BUDGET=${4:-540}
PY=${PYTHON:-python3}
# shellcheck disable=SC2206  # EXTRA is split into flags on purpose
COMMON=(--model "${MODEL:-random:gpt2}" --dtype float16 --no-stop-on-eos --no-warmup --no-progress
    --bandwidth-gbs 1 ${EXTRA:-})

run() {  # tree label round
    local tree=$1 label=$2 round=$3 dir="$OUT/$2-$3"
    mkdir -p "$dir"
    echo "=== $label round $round (${SECONDS}s in)"
    (
        cd "$tree" || exit 1
        export PYTHONPATH=$tree
        timeout 120 "$PY" bench/benchmark_streaming.py "${COMMON[@]}" --num-requests 1 \
            --max-new-tokens 256 --max-batch-size 1 --warmup-runs 1 --repeat-runs 3 \
            --json "$dir/w4.json" >"$dir/w4.log" 2>&1
        timeout 120 "$PY" bench/benchmark_streaming.py "${COMMON[@]}" --num-requests 128 \
            --prompt-repeats 1,4 --max-new-tokens 128 --max-batch-size 128 --warmup-runs 1 \
            --repeat-runs 3 --json "$dir/w2.json" >"$dir/w2.log" 2>&1
        timeout 150 "$PY" bench/benchmark_streaming.py "${COMMON[@]}" --num-requests 256 \
            --max-new-tokens 256 --max-batch-size 16 --warmup-runs 1 --repeat-runs 2 \
            --json "$dir/w1.json" >"$dir/w1.log" 2>&1
        timeout 150 "$PY" bench/compare_hf.py "${COMMON[@]}" --skip-hf --batch-sizes 256 \
            --input-len 8 --max-new-tokens 256 --warmup-runs 1 --repeat-runs 2 \
            --json "$dir/w3.json" >"$dir/w3.log" 2>&1
    ) || echo "=== $label round $round failed: see $dir/*.log"
}

round=1
while :; do
    if ((round % 2)); then order=(base new); else order=(new base); fi
    for label in "${order[@]}"; do
        if [[ $label == base ]]; then run "$BASE" base $round; else run "$NEW" new $round; fi
    done
    round=$((round + 1))
    # A round took about SECONDS / (round - 1): start another only if it fits the budget.
    ((SECONDS + SECONDS / (round - 1) <= BUDGET)) || break
done

"$PY" - "$OUT" <<'EOF'
import glob, json, os, statistics, sys

out = sys.argv[1]
metrics = {  # workload: (file, how to read it, unit)
    "w1 tok/s (256 req, batch 16)": ("w1", lambda d: d["summary"]["throughput_tok_s"]["median"]),
    "w1 TPOT p50 ms": ("w1", lambda d: d["summary"]["tpot_ms.p50"]["median"]),
    "w2 tok/s (128 req, prefix repeats)": ("w2", lambda d: d["summary"]["throughput_tok_s"]["median"]),
    "w3 tok/s (256 x 256, batch 256)": ("w3", lambda d: d["table"][0]["rosejax_tok_s"]),
    "w3 decode tok/s": ("w3", lambda d: d["table"][0]["rosejax_decode_tok_s"]),
    "w4 TPOT p50 ms (1 request)": ("w4", lambda d: d["summary"]["tpot_ms.p50"]["median"]),
}
table = {}
print(f"{'workload':38} {'base':>10} {'new':>10} {'new/base':>9}   runs (base | new)")
for name, (w, read) in metrics.items():
    row = {}
    for label in ("base", "new"):
        vals = []
        for path in sorted(glob.glob(os.path.join(out, f"{label}-*", f"{w}.json"))):
            try:
                vals.append(read(json.load(open(path))))
            except (KeyError, IndexError, ValueError, TypeError):
                pass
        row[label] = vals
    table[name] = row
    med = {k: statistics.median(v) if v else float("nan") for k, v in row.items()}
    runs = " ".join(f"{v:.4g}" for v in row["base"]) + " | " + " ".join(f"{v:.4g}" for v in row["new"])
    print(f"{name:38} {med['base']:10.4g} {med['new']:10.4g} {med['new'] / med['base']:9.3f}   {runs}")
json.dump(table, open(os.path.join(out, "compare.json"), "w"), indent=1)
EOF
