"""Summarise a jax.profiler perfetto trace: device time per kernel name, largest first.

python bench/trace_summary.py TRACE_DIR [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os


def load_events(trace_dir: str) -> list[dict]:
    paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        raise SystemExit(f"no *.trace.json.gz under {trace_dir}")
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        return json.load(f)["traceEvents"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("trace_dir", help="directory given to jax.profiler.start_trace")
    p.add_argument("--top", type=int, default=25, help="kernels to list")
    args = p.parse_args()
    events = load_events(args.trace_dir)
    names = {}
    for e in events:  # process names tell device streams from host threads
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e["pid"]] = e["args"]["name"]
    device = {pid for pid, n in names.items() if "GPU" in n or "/device" in n}
    total = collections.Counter()
    count = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device:
            total[e["name"]] += e.get("dur", 0)
            count[e["name"]] += 1
    busy = sum(total.values())
    print(f"device busy {busy / 1e3:.1f} ms over {sum(count.values())} kernel launches")
    for name, us in total.most_common(args.top):
        print(f"{us / 1e3:9.2f} ms {100 * us / busy:5.1f}% {count[name]:7d}x  {name[:90]}")


if __name__ == "__main__":
    main()
