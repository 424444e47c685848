#!/usr/bin/env bash
# The correctness checks a GPU call runs after a change to the kernels or the decode program, in
# one call (under 10 minutes on an H100): the engine's greedy tokens against HF for a small GPT-2,
# Qwen3 and Llama (`check_engine_parity.py`, the three at once, each with a small KV cache and no
# preallocation), then the kernel and parity tests compiled through Triton over WORKERS pytest
# processes (tests/conftest.py gives each an equal share of the card's memory). Each step has a
# time limit and a log in OUTDIR; summary.txt has each step's verdict. Exit status 1 if a request
# differs from HF or a test fails or runs out of time.
#
#   PYTHONPATH=. JAX_PLATFORMS=cuda bash bench/run_gpu_checks.sh OUTDIR
#
# KERNEL (env): `--kernel`/`--kernel-tile` flags for the parity runs (a switch under test, e.g.
# KERNEL="--kernel fused_swiglu=off"); PROMPTS (8): prompts a family; TESTS: the pytest
# arguments (default: the kernel and parity test files); WORKERS (4): pytest processes;
# TEST_LIMIT (480): seconds for the tests. A CPU smoke run:
# JAX_PLATFORMS=cpu PROMPTS=2 WORKERS=1 TESTS="tests/test_linear.py -k reference" bash ...
set -uo pipefail
OUT=$(mkdir -p "${1:-bench/out/gpu-checks}" && cd "${1:-bench/out/gpu-checks}" && pwd)
PY=${PYTHON:-python3}
PROMPTS=${PROMPTS:-8}
KERNEL=${KERNEL:-}
TEST_LIMIT=${TEST_LIMIT:-480}
WORKERS=${WORKERS:-4}
TESTS=${TESTS:-tests/test_gqa_kernels.py tests/test_kv_append.py tests/test_paged_attention.py \
tests/test_layer_norm.py tests/test_linear.py tests/test_model.py tests/test_llama_family.py \
tests/test_decoder_step.py tests/test_engine_sampling_params.py tests/test_engine.py}
SUMMARY=$OUT/summary.txt
FAILED=0
declare -A pids
: > "$SUMMARY"

note() { echo "$*" | tee -a "$SUMMARY"; }

{
    nvidia-smi -L 2> /dev/null || echo "no nvidia-smi"
    "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
    git log -1 --format="tree %h %s" 2> /dev/null
    date -u
} > "$OUT/card.txt" 2>&1
note "$(head -1 "$OUT/card.txt")"

for family in gpt2 qwen3 llama; do
    # shellcheck disable=SC2086  # KERNEL is a list of flags
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 "$PY" bench/check_engine_parity.py \
        --family "$family" --num-prompts "$PROMPTS" --kv-cache-tokens 4096 $KERNEL \
        > "$OUT/parity-$family.log" 2>&1 &
    pids[$family]=$!
done
for family in gpt2 qwen3 llama; do
    wait "${pids[$family]}"
    status=$?
    verdict=$(grep -E "requests differ" "$OUT/parity-$family.log" | tail -1)
    note "parity $family: exit $status, ${verdict:-no verdict (see parity-$family.log)}"
    [ "$status" -eq 0 ] || FAILED=1
done

# -v: a line per test, so a run cut by its time limit still shows what passed and failed.
# shellcheck disable=SC2086  # TESTS is a list of pytest arguments
workers=(); [ "$WORKERS" -gt 1 ] && workers=(-n "$WORKERS")
timeout "$TEST_LIMIT" "$PY" -m pytest -v -p no:cacheprovider --tb=short "${workers[@]}" $TESTS \
    > "$OUT/tests.log" 2>&1
status=$?
counts=$(grep -cE " PASSED" "$OUT/tests.log")
# A failed test: "path::test FAILED" (one process), "[gw1] [ 5%] FAILED path::test" (xdist),
# "FAILED path::test - why" (the summary).
failures=$(grep -oE "^\S+::\S+ (FAILED|ERROR)|(FAILED|ERROR) tests/\S+" "$OUT/tests.log" |
    sed -E 's/^(FAILED|ERROR) //; s/ (FAILED|ERROR)$//' | sort -u)
note "tests: exit $status$([ "$status" -eq 124 ] && echo " (cut at ${TEST_LIMIT}s)"), $counts passed"
[ -n "$failures" ] && note "$failures"
[ "$status" -eq 0 ] || FAILED=1
note "verdict: $([ "$FAILED" -eq 0 ] && echo pass || echo FAIL)"
exit "$FAILED"
