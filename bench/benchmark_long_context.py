"""Long context: one prompt of --context-len random token ids, its time to first token against
the compute floor, and its decode steps at that context against the memory floor.

- TTFT floor: the prefill's FLOPs (every token through every layer, causal attention: token i
  attends to i keys; logits of the last token only) over the card's dense bf16 matmul rate,
  measured here (an 8192^3 product in a loop) or --peak-tflops.
- Decode floor: the bytes a step must read (weights + the KV cache attended + the new K/V,
  `bench/metrics.py:decode_step_bytes`) over the card's copy bandwidth, measured here or
  --bandwidth-gbs.

Each run sends a fresh prompt (no prefix-cache hit); --warmup-runs compile what the runs use.
Prefill follows the engine's flags: chunks of --prefill-chunk-tokens (default:
--max-prefill-tokens); one prefill with --prefill-chunk-tokens at least the context.

    # issue 19: Qwen3-0.6B shape at 32k context on one GPU
    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/benchmark_long_context.py \\
        --model random:qwen3-0.6b --dtype bfloat16 --context-len 32768 --json out/long.json
    # CPU smoke test
    python bench/benchmark_long_context.py --model random:tiny --context-len 100 \\
        --output-len 8 --no-warmup --warmup-runs 0 --repeat-runs 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

if __package__ in (None, ""):  # run as a file: make `bench` and `rosejax` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from bench import metrics as m  # noqa: E402
from rosejax.sampling import SamplingParams  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = common.new_parser(__doc__)
    common.add_engine_args(p, max_batch_size=1)
    p.set_defaults(model="random:qwen3-0.6b")
    p.add_argument("--context-len", type=int, default=32768, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated after it")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the card's dense matmul TFLOP/s in the model's dtype, for the TTFT floor; "
        "default: measured here on a GPU (none on CPU)",
    )
    common.add_run_args(p, warmup_runs=1, repeat_runs=3)
    return p


def prefill_flops(config, prompt_len: int) -> float:
    """FLOPs of prefilling one prompt: each token a decode row at its own context, minus the
    LM head of every token but the last."""
    width = config.n_embd if hasattr(config, "n_embd") else config.hidden_size
    every_row = m.decode_step_flops(config, prompt_len, list(range(1, prompt_len + 1)))
    return every_row - 2.0 * (prompt_len - 1) * config.vocab_size * width


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.context_len < 1 or args.output_len < 2 or args.repeat_runs < 1:
        raise SystemExit("--context-len >= 1, --output-len >= 2 and --repeat-runs >= 1 needed")
    engine, result = common.start(args, "long_context")
    if args.peak_tflops is None and result["environment"].get("backend") == "gpu":
        args.peak_tflops = common.matmul_tflops()
        print(f"dense bf16 matmul (measured): {args.peak_tflops:,.0f} TFLOP/s", file=sys.stderr)
    vocab = engine.config.vocab_size

    def prompts(run: int) -> list[list[int]]:
        rng = np.random.default_rng([args.seed, run])
        return [rng.integers(0, vocab - 1, args.context_len).tolist()]

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    runs = common.run_repeated(engine, args, prompts, params)
    flops = prefill_flops(engine.config, args.context_len)
    dtype_bytes = np.dtype(engine.dtype).itemsize
    step_bytes = m.decode_step_bytes(
        engine.config, 1, args.context_len + args.output_len / 2, dtype_bytes
    )["total"]
    ttft_ms = [r["summary"]["ttft_ms"]["p50"] for r in runs["runs"]]
    tpot_ms = [r["summary"]["tpot_ms"]["p50"] for r in runs["runs"]]
    floors = {
        "prefill_tflop": flops / 1e12,
        "ttft_floor_ms": flops / (args.peak_tflops * 1e12) * 1e3 if args.peak_tflops else None,
        "decode_step_gb": step_bytes / 1e9,
        "decode_floor_ms": step_bytes / (args.bandwidth_gbs * 1e9) * 1e3
        if args.bandwidth_gbs
        else None,
    }
    result["floors"] = floors
    code = common.finish(args, engine, result, runs, "long context")
    print(f"{args.context_len:,}-token prompt, then {args.output_len} tokens (median of runs):")
    for label, values, floor in (
        ("TTFT ms", ttft_ms, floors["ttft_floor_ms"]),
        ("decode ms/step", tpot_ms, floors["decode_floor_ms"]),
    ):
        got = statistics.median(values)
        share = f"   floor {floor:.3f} ms, {floor / got:.0%} of it" if floor else ""
        print(f"  {label:<15} {got:10.3f}{share}")
    return code


if __name__ == "__main__":
    sys.exit(main())
