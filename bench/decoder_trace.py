"""Read a profile of the one-kernel decode step (`decoder_step(..., profile_dir=...)`: Mosaic GPU's
profiler, one Perfetto JSON a call) into where each program's time goes and how long each of a
layer's phases holds the step up.

The profiler stamps each named range of the kernel (`phase_wait`, `rms_norm`, `norm_inputs`,
`merge_inputs`, `mlp_inputs`, `weights_wait`, `tile`, `store_signal`, `attention` with its
parts, `attention_*`, and `signal` inside `store_signal` and `attention`) with the SM's cycle
counter, one trace a program (`tid`). Its file writes
cycles as if they were nanoseconds (`ts` in thousands of cycles), so times here are cycles
divided by the SM clock (`clock_mhz`). That file also takes an estimate of a stamp's cost off
every stamp, times its index in the trace: up to ~10k cycles by a trace's end, a different shift
in each program (its waits then end before the signals they wait for). `trace_from_buffer` reads
the profiler's raw buffer instead, uncorrected: `bench_decoder_step.py --profile` writes that as
trace.json, the file to read here.

A program's ranges in order give each of its runs of a phase (a `phase_wait`, then the tiles,
whose inputs name the phase: `norm_inputs` are q/k/v after a layer's down projection or at the
start, gate/up after q/k/v or o_proj; `merge_inputs` o_proj; `mlp_inputs` down) and so each
run's layer. SMs' cycle counters drift apart (on an H100, two groups of programs by ~900 cycles a
layer), so each program's ranges of a layer are moved to line up on the end of its q/k/v wait:
every program's ends on the same last signal of the layer before. A phase's span runs from its
first tile's start on any program to its last `store_signal`'s end (attention's: its items'
first start to last end); its wake-up is from the end of the phase before it (in the chain q/k/v,
attention, o_proj, gate/up, down) to the first end of a wait for it.

The summary also has the time between a program's consecutive ranges (what no range names: the
loop's own work and the copies it issues, e.g. from one tile's end to the next one's inputs), and
`--critical` prints, for one layer, each link's last program and its ranges: the chain's critical
path, as far as the programs' lined-up clocks tell it (a wake-up's spread, ~0.5 µs, is in them).

    python bench/decoder_trace.py TRACE.json [--clock-mhz 1980] [--plot timeline.png]
    python bench/decoder_trace.py TRACE.json --critical --layer 6
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys

import numpy as np

if __package__ in (None, ""):  # run as a file: make `bench` importable (for its plots)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHAIN = ("qkv", "attention", "o_proj", "gate_up", "down")  # each waits for the one before
# norm_inputs: by order; head_inputs: the final norm and LM head's tiles after the last layer
INPUTS = {"merge_inputs": "o_proj", "mlp_inputs": "down", "head_inputs": "head"}


EXIT = 1 << 31  # the profiler's tag bit of a range's end


def trace_from_buffer(
    buffer: np.ndarray, names: dict[str, int], words: int, clock_mhz: float
) -> dict:
    """The profiler's raw buffer (u32, `words` a trace: its start in ns, SM, the words used, then
    (tag, cycle counter) pairs) -> events as the profiler's file has them, `ts` in thousands of
    cycles from the trace's start time, with no per-stamp correction and the 32-bit counter
    unwrapped."""
    by_id = {i: n for n, i in names.items()}
    traces = np.asarray(buffer).reshape(-1, words).astype(np.int64)
    events = []
    for tid, trace in enumerate(traces):
        start, sm, used = trace[:3]
        tags, clocks = trace[3 : 3 + used : 2], trace[4 : 4 + used : 2]
        cycles = np.concatenate([[0], np.cumsum(np.diff(clocks) % 2**32)])
        base = start * clock_mhz / 1e3  # the start in cycles
        for tag, t in zip(tags, cycles, strict=True):
            end = bool(tag & EXIT)
            events.append(
                dict(
                    name=by_id[int(tag & ~EXIT)],
                    ph="E" if end else "B",
                    ts=(base + t) / 1e3,
                    pid=int(sm) + 1,
                    tid=tid + 1,
                )
            )
    return {"traceEvents": events}


def ranges(trace: dict) -> dict[int, list[tuple[str, float, float, int]]]:
    """Each program's ranges (name, start, end in the file's units, depth), by start (a range
    before those inside it)."""
    out = collections.defaultdict(list)
    stacks = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        tid = e["tid"] - 1
        if e["ph"] == "B":
            stacks[tid].append((e["name"], e["ts"]))
        else:
            name, start = stacks[tid].pop()
            if name != e["name"]:
                raise ValueError(f"program {tid}: {e['name']} ends inside {name}")
            out[tid].append((name, start, e["ts"], len(stacks[tid])))
    return {tid: sorted(rs, key=lambda r: (r[1], r[3])) for tid, rs in sorted(out.items())}


def label_runs(rs: list) -> list[tuple[int, str, list]]:
    """A program's phase runs: (layer, phase, its ranges from the phase's wait on). Attention
    items join the q/k/v run they follow (they run before the program's next phase)."""
    runs, layer, current = [], -1, None
    for r in rs:
        name = r[0]
        if name == "phase_wait":
            current = [None, None, [r]]
            runs.append(current)
            continue
        if current is None:
            continue
        if current[1] is None and name.endswith("_inputs") and not name.startswith("attention"):
            if name == "norm_inputs":
                previous = runs[-2][1] if len(runs) > 1 else None
                phase = "qkv" if previous in (None, "down") else "gate_up"
            else:
                phase = INPUTS[name]
            if phase == "qkv":
                layer += 1
            current[0], current[1] = layer, phase
        current[2].append(r)
    return [(lay, phase, body) for lay, phase, body in runs if phase is not None]


def aligned_runs(by_program: dict) -> dict[int, list[tuple[int, str, list]]]:
    """`label_runs` of each program, each layer's ranges moved so that its q/k/v wait ends
    where the median program's does (see above)."""
    runs = {tid: label_runs(rs) for tid, rs in by_program.items()}
    anchors = {  # (program, layer) -> the end of its q/k/v wait
        (tid, lay): body[0][2]
        for tid, rs in runs.items()
        for lay, phase, body in rs
        if phase == "qkv"
    }
    by_layer = collections.defaultdict(list)
    for (_, lay), t in anchors.items():
        by_layer[lay].append(t)
    middle = {lay: statistics.median(ts) for lay, ts in by_layer.items()}
    out = {}
    for tid, rs in runs.items():
        out[tid] = []
        for lay, phase, body in rs:
            shift = anchors[(tid, lay)] - middle[lay] if (tid, lay) in anchors else 0.0
            out[tid].append((lay, phase, [(n, a - shift, b - shift, d) for n, a, b, d in body]))
    return out


def summarize(trace: dict, clock_mhz: float) -> dict:
    """Per program and layer, µs in each named range less the ranges inside it (an attention
    item's parts and signal, a run's signal); along the chain, each link's span and wake-up (means over the layers after the
    first); the layer's period (first q/k/v tile to the next layer's, mean)."""
    us = 1e3 / clock_mhz  # the file's unit (1,000 cycles) in µs
    by_program = ranges(trace)
    runs = aligned_runs(by_program)
    totals, head_totals = collections.Counter(), collections.Counter()
    spans = collections.defaultdict(lambda: [float("inf"), float("-inf")])  # (layer, phase)
    waits_end = collections.defaultdict(lambda: float("inf"))
    layers = 0
    for tid, rs in by_program.items():
        enclosing = {}  # depth -> the last range that began there
        for name, start, end, depth in rs:
            totals[name] += end - start
            if depth:  # inside another range: what is left of that one is its own
                totals[enclosing[depth - 1]] -= end - start
            enclosing[depth] = name
        for lay, phase, body in runs[tid]:
            layers = max(layers, lay + 1)
            key = (lay, phase)
            for name, start, end, depth in body:
                if phase == "head":  # its own totals, its span to its last range's end
                    head_totals[name] += end - start
                    totals[name] -= end - start
                    spans[key][1] = max(spans[key][1], end)
                if name in ("phase_wait", "attention_wait"):
                    link = (lay, "attention") if name == "attention_wait" else key
                    waits_end[link] = min(waits_end[link], end)
                elif depth:  # a part of the ranges below
                    continue
                elif name == "attention":
                    span = spans[(lay, "attention")]
                    span[0], span[1] = min(span[0], start), max(span[1], end)
                elif name == "store_signal":
                    spans[key][1] = max(spans[key][1], end)
                elif name != "rms_norm":
                    spans[key][0] = min(spans[key][0], start)
    programs = len(by_program)
    per_layer = {name: t * us / programs / max(layers, 1) for name, t in sorted(totals.items())}
    phases = {}
    for i, phase in enumerate(CHAIN):
        span, wake = [], []
        for lay in range(1, layers):
            start, end = spans[(lay, phase)]
            span.append((end - start) * us)
            before = (lay, CHAIN[i - 1]) if i else (lay - 1, CHAIN[-1])
            wake.append((waits_end[(lay, phase)] - spans[before][1]) * us)
        if span:
            phases[phase] = {"span_us": statistics.mean(span), "wake_us": statistics.mean(wake)}
    head = spans[(layers - 1, "head")]
    if head[1] > head[0]:  # from the last layer's down to the head's last range
        down_end = spans[(layers - 1, "down")][1]
        phases["head"] = {
            "span_us": (head[1] - head[0]) * us,
            "wake_us": (waits_end[(layers - 1, "head")] - down_end) * us,
            "after_down_us": (head[1] - down_end) * us,
        }
    firsts = [spans[(lay, "qkv")][0] for lay in range(layers)]
    period = (firsts[-1] - firsts[0]) * us / (layers - 1) if layers > 1 else float("nan")
    return {
        "programs": programs,
        "layers": layers,
        "clock_mhz": clock_mhz,
        "layer_period_us": period,
        "phases": phases,
        "us_a_program_a_layer": per_layer,
        "us_a_program_head": {name: t * us / programs for name, t in sorted(head_totals.items())},
        "gaps_us": gaps(by_program, us),
    }


def gaps(by_program: dict, us: float) -> dict[str, float]:
    """The time between a program's consecutive outermost ranges, by the pair of names (median
    µs, pairs seen at least once a program): what no range names, such as the loop's own work
    and the copies it issues between one tile and the next."""
    seen = collections.defaultdict(list)
    for rs in by_program.values():
        outer = [r for r in rs if r[3] == 0]
        for before, after in zip(outer, outer[1:], strict=False):
            seen[f"{before[0]} -> {after[0]}"].append((after[1] - before[2]) * us)
    return {
        pair: statistics.median(ts)
        for pair, ts in sorted(seen.items())
        if len(ts) >= len(by_program)
    }


def critical_path(trace: dict, layer: int, clock_mhz: float) -> list[dict]:
    """Each link of `layer` (in the chain's order): the program whose run of it ends last (for
    attention, its item with the item's signal), when, and that run's ranges (name, start, end,
    depth), in µs from the end of the layer's q/k/v waits (where `aligned_runs` lines them up)."""
    us = 1e3 / clock_mhz
    runs = aligned_runs(ranges(trace))
    zero = next(body[0][2] for rs in runs.values() for lay, ph, body in rs if lay == layer)
    ends = collections.defaultdict(list)  # link -> [(end, program, ranges)]
    for tid, rs in runs.items():
        for lay, phase, body in rs:
            if lay != layer:
                continue
            items = [(a, b) for n, a, b, _ in body if n == "attention"]
            inside = [any(a <= r[1] and r[2] <= b for a, b in items) for r in body]
            for link, in_item in ((phase, False), ("attention", True)):
                part = [r for r, i in zip(body, inside, strict=True) if i == in_item]
                if part:
                    ends[link].append((max(r[2] for r in part), tid, part))
    out = []
    for link in (link for link in CHAIN if ends[link]):
        end, tid, part = max(ends[link], key=lambda x: x[0])
        shifted = [(n, (a - zero) * us, (b - zero) * us, d) for n, a, b, d in part]
        out.append({"link": link, "program": tid, "end_us": (end - zero) * us, "ranges": shifted})
    return out


def print_summary(summary: dict) -> None:
    print(
        f"{summary['programs']} programs, {summary['layers']} layers, "
        f"a layer every {summary['layer_period_us']:.2f} µs (at {summary['clock_mhz']:.0f} MHz)"
    )
    print(f"{'link':10s} {'span µs':>9s} {'wake-up µs':>11s}")
    for phase, row in summary["phases"].items():
        print(f"{phase:10s} {row['span_us']:9.2f} {row['wake_us']:11.2f}")
    if "head" in summary["phases"]:
        print(f"the head ends {summary['phases']['head']['after_down_us']:.2f} µs after down")
    head = summary["us_a_program_head"]
    print(f"{'range':18s} {'µs a program a layer':>21s} {'in the head':>12s}")
    for name, t in summary["us_a_program_a_layer"].items():
        print(f"{name:18s} {t:21.2f} {head.get(name, 0.0):12.2f}")
    print(f"{'between ranges':36s} {'median µs':>9s}")
    for pair, t in sorted(summary["gaps_us"].items(), key=lambda kv: -kv[1]):
        print(f"{pair:36s} {t:9.2f}")


def print_critical_path(links: list[dict]) -> None:
    for link in links:
        print(f"{link['link']}: program {link['program']} ends at {link['end_us']:.2f} µs")
        for name, start, end, depth in link["ranges"]:
            print(f"  {'  ' * depth}{name:20s} {start:8.2f} -> {end:8.2f} ({end - start:5.2f})")


def plot_layer(trace: dict, layer: int, path: str, clock_mhz: float) -> None:
    """Every program's ranges (its runs') during one layer, lined up as `summarize` lines them
    up: a row a program, a color a range name."""
    from bench.common import load_pyplot, save_figure

    plt = load_pyplot()
    us = 1e3 / clock_mhz
    runs = aligned_runs(ranges(trace))
    shown = {
        tid: [r for lay, _, body in rs if lay == layer for r in body] for tid, rs in runs.items()
    }
    window = min(r[1] for rs in shown.values() for r in rs)
    names = sorted({r[0] for rs in shown.values() for r in rs})
    colors = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(14, 8))
    for tid, rs in shown.items():
        for name, start, end, depth in rs:
            ax.barh(
                tid,
                (end - start) * us,
                left=(start - window) * us,
                height=0.8 - 0.3 * depth,
                color=colors[name],
                linewidth=0,
            )
    for name in names:
        ax.barh(0, 0, color=colors[name], label=name)
    ax.set_xlabel(f"µs from layer {layer}'s first range (SM clock {clock_mhz:.0f} MHz)")
    ax.set_ylabel("program")
    ax.legend(loc="upper right", fontsize=8)
    save_figure(plt, fig, path)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("trace", help="a JSON trace the kernel's profiler wrote")
    p.add_argument("--clock-mhz", type=float, default=1980.0, help="the SM clock the run held")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--plot", default=None, help="a PNG of one layer's ranges, a row a program")
    p.add_argument(
        "--layer",
        type=int,
        default=None,
        help="the plotted layer (default: middle), and --critical's",
    )
    p.add_argument(
        "--critical",
        action="store_true",
        help="each link's last program in that layer and its ranges (the chain's critical path)",
    )
    args = p.parse_args()
    with open(args.trace) as f:
        trace = json.load(f)
    summary = summarize(trace, args.clock_mhz)
    print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    layer = summary["layers"] // 2 if args.layer is None else args.layer
    if args.critical:
        print_critical_path(critical_path(trace, layer, args.clock_mhz))
    if args.plot:
        plot_layer(trace, layer, args.plot, args.clock_mhz)


if __name__ == "__main__":
    main()
