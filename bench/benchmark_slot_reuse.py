"""Survivors of a burst: the TPOT of a few long requests that were given the highest decode slots
of a full batch, after the burst's short requests finished, beside the same requests run alone
on the same engine (fresh), alternated in one process.

The engine compacts running requests into the lowest slots, so once the burst is gone the
survivors decode at the smallest width that holds them; without it they would run at the full
batch's width (issue 17: their TPOT within 5% of fresh). TPOT is timed over the survivors'
tokens after --skip-tokens (the burst is long over by then), per run, median over the runs.

    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/benchmark_slot_reuse.py --max-batch-size 256 \\
        --json OUT/slot_reuse.json
    # CPU smoke test
    PYTHONPATH=. python bench/benchmark_slot_reuse.py --model random:tiny --max-batch-size 16 \\
        --survivor-tokens 48 --skip-tokens 24 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from bench import common
from rosejax.sampling import SamplingParams
from rosejax.settings import configure_process


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.new_parser(__doc__)
    common.add_engine_args(p, max_batch_size=256)
    p.add_argument("--survivors", type=int, default=4, help="long requests in the high slots")
    p.add_argument("--survivor-tokens", type=int, default=256, help="new tokens of each survivor")
    p.add_argument("--burst-tokens", type=int, default=16, help="new tokens of each burst request")
    p.add_argument(
        "--skip-tokens",
        type=int,
        default=64,
        help="survivor tokens left out of the TPOT (the burst runs during them)",
    )
    p.add_argument("--prompt-len", type=int, default=8, help="prompt tokens of every request")
    p.add_argument("--repeats", type=int, default=3, help="fresh / burst pairs, alternated")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    if not 0 < args.survivors < args.max_batch_size:
        p.error("--survivors must be in [1, --max-batch-size)")
    if not args.burst_tokens < args.skip_tokens < args.survivor_tokens - 1:
        p.error("need --burst-tokens < --skip-tokens < --survivor-tokens - 1")
    return args


def survivor_tpot(engine, args: argparse.Namespace, burst: int, rng, tag: str) -> float:
    """Median over the survivors of their TPOT after --skip-tokens (s), with `burst` short
    requests submitted before them (so the survivors take the highest slots)."""
    vocab = engine.config.vocab_size
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(burst)]
    prompts += [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.survivors)]
    short = SamplingParams(max_tokens=args.burst_tokens, temperature=0, ignore_eos=True)
    long = SamplingParams(max_tokens=args.survivor_tokens, temperature=0, ignore_eos=True)
    params = [short] * burst + [long] * args.survivors
    traces, _ = common.run_workload(engine, prompts, params, tag=tag, progress=False)
    tpots = []
    for trace in traces[burst:]:
        t = trace.token_times[args.skip_tokens :]
        tpots.append((t[-1] - t[0]) / (len(t) - 1))
    return statistics.median(tpots)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_process(args.compilation_cache_dir)  # before the backend starts
    engine, build_s = common.make_engine(args)
    result = {"benchmark": "slot_reuse", "args": vars(args), "build_seconds": build_s}
    result["environment"] = common.environment(engine)
    rng = np.random.default_rng(args.seed)
    burst = engine.max_batch_size - args.survivors
    survivor_tpot(engine, args, burst, rng, "warmup-burst")  # compiles every width on the way
    survivor_tpot(engine, args, 0, rng, "warmup-fresh")
    fresh, after = [], []
    with common.frozen_heap():  # no full collection inside a timed run
        for i in range(args.repeats):
            fresh.append(survivor_tpot(engine, args, 0, rng, f"fresh-{i}"))
            after.append(survivor_tpot(engine, args, burst, rng, f"burst-{i}"))
    f_ms, b_ms = statistics.median(fresh) * 1e3, statistics.median(after) * 1e3
    print(f"{'run':<32} {'survivor TPOT p50 (ms)':>24}")
    print(f"{'fresh engine':<32} {f_ms:>24.4f}")
    print(f"{f'after a burst of {burst}':<32} {b_ms:>24.4f}")
    # Both 0 when the survivors' timed tokens came in one delivery (too few --survivor-tokens).
    ratio = b_ms / f_ms if f_ms else None
    print(f"after burst / fresh: {ratio if ratio is None else f'{ratio:.3f}'}", file=sys.stderr)
    result["figures"] = {
        "survivors": args.survivors,
        "burst": burst,
        "fresh_tpot_ms": [x * 1e3 for x in fresh],
        "after_burst_tpot_ms": [x * 1e3 for x in after],
        "fresh_tpot_ms_median": f_ms,
        "after_burst_tpot_ms_median": b_ms,
        "ratio": ratio,
    }
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
