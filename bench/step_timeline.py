"""An engine's steps, burst by burst, from the JSON lines of `--step-log FILE`
(`rosejax.engine.step_log`): each process's and replica's steps split into bursts wherever the
engine idled longer than --gap-ms, and the last --last bursts of each printed step by step, times
in ms from the burst's first step (or from --start, a `time.monotonic()` instant of this host:
e.g. when a benchmark's clients started). A window reads steps x rows/width (the decode program's
batch bucket); waiting and running read before>after the step.

    python -m rosejax.serve --model random:gpt2 --step-log /tmp/steps.jsonl ...
    python bench/step_timeline.py /tmp/steps.jsonl --last 1
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Iterable, Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="step logs (JSON lines)")
    p.add_argument(
        "--gap-ms",
        type=float,
        default=100.0,
        help="an idle pause longer than this between two steps starts a new burst; "
        "default: %(default)s",
    )
    p.add_argument(
        "--last", type=int, default=2, help="bursts printed per engine, the last ones; default: 2"
    )
    p.add_argument(
        "--start",
        type=float,
        default=None,
        help="a time.monotonic() instant to give times from (default: each burst's first step)",
    )
    return p


def read_steps(files: Iterable[str]) -> dict[tuple[int, int], list[dict]]:
    """Every line of `files`, per engine ((pid, replica)), in time order."""
    engines: dict[tuple[int, int], list[dict]] = collections.defaultdict(list)
    for path in files:
        with open(path) as f:
            for line in f:
                step = json.loads(line)
                engines[step["pid"], step["replica"]].append(step)
    return {k: sorted(v, key=lambda s: s["start"]) for k, v in engines.items()}


def bursts(steps: Sequence[dict], gap_ms: float) -> list[list[dict]]:
    """`steps` split wherever one ends more than `gap_ms` before the next starts."""
    out: list[list[dict]] = []
    for step in steps:
        if out:
            prev = out[-1][-1]
            if (step["start"] - prev["start"]) * 1e3 - prev["ms"] <= gap_ms:
                out[-1].append(step)
                continue
        out.append([step])
    return out


def format_burst(burst: Sequence[dict], start: float | None) -> str:
    """One burst as a table, times in ms from `start` (None: its first step)."""
    t0 = burst[0]["start"] if start is None else start
    end = (burst[-1]["start"] - t0) * 1e3 + burst[-1]["ms"]
    tokens = sum(s["tokens"] for s in burst)
    prefills = sum(1 for s in burst if s["prefill_tokens"])
    lines = [
        f"{len(burst)} steps, {prefills} with a prefill, {tokens} tokens out; first step at "
        f"{(burst[0]['start'] - t0) * 1e3:.1f} ms, last ends at {end:.1f} ms",
        f"{'start':>8} {'ms':>7} {'waiting':>9} {'running':>9} {'prefill':>7} "
        f"{'window':>13} {'dispatch':>8} {'wait':>7} {'harvest':>7} {'out':>4} {'tokens':>6}",
    ]
    for s in burst:
        window = "-" if s["window"] is None else "{}x{}/{}".format(*s["window"])
        waiting, running = ("{}>{}".format(*s[k]) for k in ("waiting", "running"))
        lines.append(
            f"{(s['start'] - t0) * 1e3:8.1f} {s['ms']:7.2f} {waiting:>9} "
            f"{running:>9} {s['prefill_tokens']:7d} {window:>13} "
            f"{s['dispatch_ms']:8.2f} {s['wait_ms']:7.2f} {s['harvest_ms']:7.2f} "
            f"{s['outputs']:4d} {s['tokens']:6d}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for (pid, replica), steps in read_steps(args.files).items():
        split = bursts(steps, args.gap_ms)
        print(f"== engine pid {pid} replica {replica}: {len(steps)} steps, {len(split)} bursts")
        for i, burst in enumerate(split[-args.last :], start=max(0, len(split) - args.last)):
            print(f"-- burst {i}: " + format_burst(burst, args.start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
