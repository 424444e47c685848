"""The table, the HTTP / in-process comparison and the timeline plot."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bench import common
from bench.serving.records import Record

ROWS = [  # (label, key, format)
    ("Successful requests", "completed", ",d"),
    ("Failed requests", "failed", ",d"),
    ("Disconnected requests", "disconnected", ",d"),
    ("Benchmark duration (s)", "duration_s", ",.3f"),
    ("Total input tokens", "total_input_tokens", ",d"),
    ("Total generated tokens", "total_output_tokens", ",d"),
    ("Request throughput (req/s)", "request_throughput", ",.2f"),
    ("Output token throughput (tok/s)", "output_throughput", ",.1f"),
    ("Total token throughput (tok/s)", "total_token_throughput", ",.1f"),
]
SECTIONS = [  # (title, key, short name)
    ("Time to First Token", "ttft_ms", "TTFT"),
    ("Time per Output Token (excl. 1st token)", "tpot_ms", "TPOT"),
    ("Inter-token Latency", "itl_ms", "ITL"),
    ("End-to-end Latency", "e2el_ms", "E2EL"),
    ("Gap between streamed events", "event_gap_ms", "event gap"),
]


def _pkey(p: float) -> str:
    return "p" + (str(int(p)) if float(p).is_integer() else str(p).replace(".", "_"))


def format_table(results: dict[str, dict], percentiles: Sequence[float]) -> str:
    """vLLM's result table, one column per result (e.g. HTTP, in-process), and their ratio
    (first / second) when there are two."""
    labels = list(results)
    ratio = len(labels) == 2
    width = 46
    head = f"{'':<{width}}" + "".join(f"{x:>14}" for x in labels) + ("   ratio" if ratio else "")

    def fmt(v, f) -> str:
        return f"{'n/a':>14}" if v is None else f"{format(v, f):>14}"

    def row(label: str, values: list, f: str) -> str:
        line = f"{label + ':':<{width}}" + "".join(fmt(v, f) for v in values)
        if ratio and all(isinstance(v, (int, float)) for v in values) and values[1]:
            line += f"{values[0] / values[1]:8.3f}"
        return line

    rule = "=" * len(head)
    lines = [" Serving Benchmark Result ".center(len(head), "="), head]
    res = list(results.values())
    for label, key, f in ROWS:
        lines.append(row(label, [r[key] for r in res], f))
    if "goodput" in res[0]:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in res[0]["goodput"]["slo_ms"].items())
        lines.append(row("Good requests", [r["goodput"]["good_requests"] for r in res], ",d"))
        lines.append(
            row("Request goodput (req/s)", [r["goodput"]["request_goodput"] for r in res], ",.2f")
        )
        lines.append(f"  (SLOs: {slos})")
    for title, key, short in SECTIONS:
        lines.append(f" {title} ".center(len(head), "-"))
        lines.append(row(f"Mean {short} (ms)", [r[key]["mean"] for r in res], ",.2f"))
        lines.append(row(f"Median {short} (ms)", [r[key]["p50"] for r in res], ",.2f"))
        for p in percentiles:
            if p != 50:
                lines.append(row(f"P{p:g} {short} (ms)", [r[key][_pkey(p)] for r in res], ",.2f"))
    lines.append(row("Max event gap (ms)", [r["event_gap_max_ms"] for r in res], ",.2f"))
    lines.append(
        row("Tokens per streamed event (mean)", [r["tokens_per_event"] for r in res], ",.2f")
    )
    lines.append(rule)
    return "\n".join(lines)


def compare(http: dict, local: dict) -> dict[str, Any]:
    """HTTP / in-process for issue 17's two figures, and whether each meets its bound."""
    tput = http["output_throughput"] / local["output_throughput"]
    a, b = http["ttft_ms"]["p50"], local["ttft_ms"]["p50"]
    ttft = a / b if a is not None and b else None
    return {
        "output_throughput_ratio": tput,
        "ttft_p50_ratio": ttft,
        "throughput_at_least_90pct": tput >= 0.9,
        "ttft_p50_within_2x": ttft is not None and ttft <= 2.0,
    }


def series_of(records: Sequence[Record]) -> dict[str, list]:
    return {
        "ttft_ms": [r.ttft() * 1e3 for r in records if r.ok],
        "itl_ms": [x * 1e3 for r in records for x in r.itls()],
    }


def plot_timeline(path: str, runs: dict[str, Sequence[Record]], title: str) -> None:
    """Per request TTFT and E2EL against send time, and output tokens/s over the run."""
    plt = common.load_pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, records in runs.items():
        ok = [r for r in records if r.ok]
        if not ok:
            continue
        sent = [r.sent_s for r in ok]
        axes[0].scatter(sent, [r.ttft() * 1e3 for r in ok], s=8, label=f"{label} TTFT")
        axes[0].scatter(sent, [r.e2el() * 1e3 for r in ok], s=8, marker="x", label=f"{label} E2EL")
        times = [t for r in ok for t in r.event_s]
        weights = [k for r in ok for k in r.counts]
        end = max(r.end_s for r in ok)
        bins = np.linspace(0.0, end, min(100, max(10, len(times) // 20)) + 1)
        hist, edges = np.histogram(times, bins=bins, weights=weights)
        axes[1].step(edges[:-1], hist / np.diff(edges), where="post", label=label)
    axes[0].set(xlabel="sent at (s)", ylabel="ms", title="latency per request")
    axes[1].set(xlabel="time (s)", ylabel="output tokens / s", title="output throughput")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    common.save_figure(plt, fig, path, title)
