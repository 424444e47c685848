"""Latency and throughput metrics of a benchmark run, and the decode roofline. Pure functions.

Timestamps are host times (`time.perf_counter()` seconds) taken when `LLMEngine.step()` returns,
i.e. when the tokens have reached the host; a request's submit time is when it was due to arrive.

Definitions (per request unless said):

- TTFT: first token's arrival - submit time.
- TPOT: (last token's arrival - first token's arrival) / (n_tokens - 1); undefined for one token.
- ITL: the gaps between consecutive token arrivals. A step may deliver several tokens of one
  request at once (multi-step decode: `decode_steps` > 1). Each token then gets the arrival time
  of its step, so the gaps inside one window are 0 and the gap to the window before carries the
  whole wait: ITL percentiles then show zeros (reported as `itl_zero_fraction`), which is what a
  streaming client sees. `delivery_gap` is the gap between a request's consecutive deliveries
  (the zeros left out): the same as ITL when every step delivers one token.
- end to end (e2e): last token's arrival - submit time.
- throughput: all completion tokens / (last finish - first submit).
- decode-only throughput: tokens delivered by decode steps / those steps' decode time, each
  step's from the previous step's return to its own (`decode_seconds`): the engine dispatches a
  window a step before it delivers it, so the device runs it through the host's gap between the
  steps too. Prefill steps are left out.

Percentiles are numpy's 'linear' method (numpy's default, as the seed engine's benchmarks used).

Roofline (issue 6): the bytes a decode step must move through device memory at the least: every
weight once (the tied embedding read once as the LM head; of the position table only the rows
used), the K and V of every context token each row attends to, and the new K and V written; and
the FLOPs of the step (2 per multiply-add of the matmuls and of attention). Bytes over a measured
step time give the achieved GB/s, to set beside the card's copy bandwidth.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

PERCENTILES = (50, 95, 99)


# ------------------------------------------------------------------------------ percentiles


def percentiles(values: Iterable[float], ps: Sequence[float] = PERCENTILES) -> dict:
    """{'p50', 'p95', 'p99', 'mean', 'max', 'n'} of `values` (NaN and None left out).

    Empty input gives None for every statistic (so the dict stays valid JSON)."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    arr = arr[~np.isnan(arr)]
    out: dict = {}
    if arr.size == 0:
        out.update({f"p{_fmt_p(p)}": None for p in ps})
        out.update(mean=None, max=None, n=0)
        return out
    for p, v in zip(ps, np.percentile(arr, ps, method="linear"), strict=True):
        out[f"p{_fmt_p(p)}"] = float(v)
    out.update(mean=float(arr.mean()), max=float(arr.max()), n=int(arr.size))
    return out


def _fmt_p(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p).replace(".", "_")


def scaled(stats: Mapping, factor: float) -> dict:
    """Multiply the time statistics of a percentiles() dict (e.g. by 1000 for ms); 'n' stays."""
    return {k: (v * factor if v is not None and k != "n" else v) for k, v in stats.items()}


# ----------------------------------------------------------------------------- per request


@dataclasses.dataclass
class RequestTrace:
    """One request's timeline: submit time and the host arrival time of every output token."""

    request_id: str
    submit_time: float
    prompt_tokens: int = 0
    token_times: list[float] = dataclasses.field(default_factory=list)  # one per output token
    finish_reason: str | None = None

    def add_tokens(self, n: int, t: float) -> None:
        """`n` tokens reached the host at time `t` (one step's delivery)."""
        self.token_times.extend([t] * n)

    @property
    def num_tokens(self) -> int:
        return len(self.token_times)

    @property
    def finish_time(self) -> float | None:
        return self.token_times[-1] if self.token_times else None


def ttft(trace: RequestTrace) -> float | None:
    return trace.token_times[0] - trace.submit_time if trace.token_times else None


def tpot(trace: RequestTrace) -> float | None:
    n = len(trace.token_times)
    if n < 2:
        return None
    return (trace.token_times[-1] - trace.token_times[0]) / (n - 1)


def itl(trace: RequestTrace) -> list[float]:
    """Gaps between consecutive token arrivals; 0 between tokens delivered by the same step."""
    t = trace.token_times
    return [b - a for a, b in zip(t[:-1], t[1:], strict=True)]


def delivery_gaps(trace: RequestTrace) -> list[float]:
    """Gaps between consecutive deliveries (steps that brought this request tokens)."""
    return [g for g in itl(trace) if g > 0]


def e2e(trace: RequestTrace) -> float | None:
    return trace.finish_time - trace.submit_time if trace.token_times else None


# ---------------------------------------------------------------------------------- per run


@dataclasses.dataclass
class StepRecord:
    """One `step()` call: host time before the call and after it returned, tokens it delivered,
    and its kind: 'prefill' (every output is a first token), 'decode' (none is), 'mixed', or
    'empty' (no output)."""

    start: float
    end: float
    num_tokens: int
    kind: str

    @property
    def seconds(self) -> float:
        return self.end - self.start


def step_kind(num_outputs: int, num_first: int) -> str:
    """Classify a step by how many of its outputs carried a request's first token."""
    if num_outputs == 0:
        return "empty"
    if num_first == num_outputs:
        return "prefill"
    return "decode" if num_first == 0 else "mixed"


def throughput(traces: Sequence[RequestTrace]) -> float | None:
    """Completion tokens / (last finish - first submit), tokens per second."""
    done = [t for t in traces if t.token_times]
    if not done:
        return None
    span = max(t.finish_time for t in done) - min(t.submit_time for t in traces)
    tokens = sum(t.num_tokens for t in done)
    return tokens / span if span > 0 else None


def decode_seconds(steps: Sequence[StepRecord]) -> float:
    """The decode steps' time, each from the previous step's end (its own start if it is the
    first): the window a step delivers was dispatched by the step before, behind that step's
    prefill if it had one, and ran on the device through the host's gap between the two."""
    ends = [None] + [s.end for s in steps[:-1]]
    return sum(
        s.end - (s.start if before is None else before)
        for s, before in zip(steps, ends, strict=True)
        if s.kind == "decode"
    )


def decode_throughput(steps: Sequence[StepRecord]) -> float | None:
    """Tokens delivered by decode steps / `decode_seconds`, tokens per second."""
    seconds = decode_seconds(steps)
    tokens = sum(s.num_tokens for s in steps if s.kind == "decode")
    return tokens / seconds if seconds > 0 else None


def summarize(traces: Sequence[RequestTrace], steps: Sequence[StepRecord] = ()) -> dict:
    """Every metric of one run as a JSON-ready dict; latencies in milliseconds."""
    done = [t for t in traces if t.token_times]
    span = None
    if done:
        span = max(t.finish_time for t in done) - min(t.submit_time for t in traces)
    completion = sum(t.num_tokens for t in traces)
    all_itl = [g for t in traces for g in itl(t)]
    kinds: dict[str, int] = {}
    for s in steps:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    dec = [s for s in steps if s.kind == "decode"]
    pre = [s for s in steps if s.kind in ("prefill", "mixed")]
    return {
        "num_requests": len(traces),
        "num_finished": sum(t.finish_reason is not None for t in traces),
        "prompt_tokens": sum(t.prompt_tokens for t in traces),
        "completion_tokens": completion,
        "duration_s": span,
        "throughput_tok_s": throughput(traces),
        "request_throughput_req_s": len(done) / span if span else None,
        "decode_throughput_tok_s": decode_throughput(steps),
        "decode_tokens": sum(s.num_tokens for s in dec),
        "decode_time_s": decode_seconds(steps),
        "prefill_time_s": sum(s.seconds for s in pre),
        "steps": kinds,
        "ttft_ms": scaled(percentiles(ttft(t) for t in traces), 1e3),
        "tpot_ms": scaled(percentiles(tpot(t) for t in traces), 1e3),
        "itl_ms": scaled(percentiles(all_itl), 1e3),
        "itl_zero_fraction": (sum(g == 0 for g in all_itl) / len(all_itl)) if all_itl else None,
        "delivery_gap_ms": scaled(percentiles(g for t in traces for g in delivery_gaps(t)), 1e3),
        "e2e_ms": scaled(percentiles(e2e(t) for t in traces), 1e3),
    }


def flatten(d: Mapping, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested dict as {'a.b': value} (None and non-numbers left out)."""
    out: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[key] = float(v)
    return out


def summarize_runs(runs: Sequence[Mapping]) -> dict[str, dict[str, float]]:
    """For every numeric metric of the runs' summaries: {'mean', 'median', 'min', 'max', 'n'}."""
    flat = [flatten(r) for r in runs]
    keys = sorted({k for f in flat for k in f})
    out = {}
    for k in keys:
        vals = np.asarray([f[k] for f in flat if k in f])
        out[k] = {
            "mean": float(vals.mean()),
            "median": float(np.median(vals)),
            "min": float(vals.min()),
            "max": float(vals.max()),
            "n": int(vals.size),
        }
    return out


def format_summary(s: Mapping, title: str = "") -> str:
    """A few human lines for one run's summary()."""

    def pct(name: str) -> str:
        d = s[name]
        if d["n"] == 0:
            return f"{name[:-3].upper():>5} (ms)  n/a"
        return (
            f"{name[:-3].upper():>5} (ms)  p50 {d['p50']:9.2f}  p95 {d['p95']:9.2f}  "
            f"p99 {d['p99']:9.2f}  mean {d['mean']:9.2f}"
        )

    def num(v, fmt=",.1f"):
        return "n/a" if v is None else format(v, fmt)

    lines = [title] if title else []
    lines += [
        f"  requests {s['num_requests']}  prompt tokens {s['prompt_tokens']:,}  "
        f"completion tokens {s['completion_tokens']:,}  duration {num(s['duration_s'], '.3f')} s",
        f"  throughput {num(s['throughput_tok_s'])} tok/s  decode-only "
        f"{num(s['decode_throughput_tok_s'])} tok/s  ({s['steps']})",
        "  " + pct("ttft_ms"),
        "  " + pct("tpot_ms"),
        "  "
        + pct("itl_ms")
        + (f"  (zero gaps {s['itl_zero_fraction']:.0%})" if s["itl_zero_fraction"] else ""),
        "  " + pct("e2e_ms"),
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------- roofline


def _context_total(batch: int, context: float | Sequence[float]) -> float:
    """Context tokens attended over the batch: `context` per row, or one value per row."""
    if isinstance(context, (int, float)):
        return batch * float(context)
    if len(context) != batch:
        raise ValueError(f"{len(context)} context lengths for a batch of {batch}")
    return float(sum(context))


def _is_gpt2(config) -> bool:
    return hasattr(config, "n_positions")


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers (the KV heads only, under grouped queries)."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes


def weight_bytes(config, dtype_bytes: int = 2) -> int:
    """Weights a decode step reads once: all of them but the tables it reads rows of (GPT-2's
    position table; an untied input embedding)."""
    if _is_gpt2(config):
        return (config.num_params() - config.n_positions * config.n_embd) * dtype_bytes
    unread = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return (config.num_params() - unread) * dtype_bytes


def decode_step_bytes(
    config, batch: int, context: float | Sequence[float], dtype_bytes: int = 2
) -> dict[str, float]:
    """Least bytes one decode step moves: weights + gathered embedding rows + KV read + KV write.

    `context`: tokens each row attends to, the new one included (a number, or one per row).
    Logits and activations are left out (at GPT-2 sizes they are < 1% of the total at B <= 256,
    and a fused LM head + sampling need not write them)."""
    per_tok = kv_bytes_per_token(config, dtype_bytes)
    # GPT-2 reads a wte and a wpe row per token; Llama-style models one embedding row.
    rows = 2 * config.n_embd if _is_gpt2(config) else config.hidden_size
    out = {
        "weights": float(weight_bytes(config, dtype_bytes)),
        "embedding_rows": float(batch * rows * dtype_bytes),
        "kv_read": _context_total(batch, context) * per_tok,
        "kv_write": float(batch * per_tok),
    }
    out["total"] = sum(out.values())
    return out


def decode_step_flops(config, batch: int, context: float | Sequence[float]) -> float:
    """FLOPs of one decode step: matmuls (2 per weight per row) + attention (QK^T and PV)."""
    if _is_gpt2(config):
        e, f = config.n_embd, config.mlp_dim
        per_row = config.n_layer * (4 * e * e + 2 * e * f) + config.vocab_size * e
        attention = 4 * config.n_layer * e * _context_total(batch, context)
        return 2.0 * batch * per_row + attention
    e, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    hq, h = config.num_attention_heads, config.num_kv_heads
    per_layer = e * (hq + 2 * h) * d + hq * d * e + 3 * e * f
    per_row = config.num_layers * per_layer + config.vocab_size * e
    attention = 4 * config.num_layers * hq * d * _context_total(batch, context)
    return 2.0 * batch * per_row + attention


def mean_decode_context(prompt_len: int, new_tokens: int) -> float:
    """Mean tokens attended per decode step of a request: decode steps make tokens 2..N and
    step j (1..N-1) attends prompt_len + j tokens, so the mean is prompt_len + N / 2."""
    if new_tokens < 2:
        raise ValueError("no decode step for fewer than 2 new tokens")
    return prompt_len + new_tokens / 2


def roofline(
    config,
    batch: int,
    context: float | Sequence[float],
    step_seconds: float,
    bandwidth_gbs: float | None = None,
    dtype_bytes: int = 2,
) -> dict[str, float | None]:
    """A decode step of `step_seconds` against the memory floor: achieved GB/s and TFLOP/s, and
    (given the card's bandwidth in GB/s) the % of it, the floor time and the tokens/s ceiling."""
    nbytes = decode_step_bytes(config, batch, context, dtype_bytes)["total"]
    flops = decode_step_flops(config, batch, context)
    out: dict[str, float | None] = {
        "bytes": nbytes,
        "flops": flops,
        "step_seconds": step_seconds,
        "tokens_per_s": batch / step_seconds,
        "achieved_gbs": nbytes / step_seconds / 1e9,
        "achieved_tflops": flops / step_seconds / 1e12,
        "arithmetic_intensity": flops / nbytes,
        "bandwidth_gbs": bandwidth_gbs,
        "pct_of_bandwidth": None,
        "floor_seconds": None,
        "tokens_per_s_ceiling": None,
    }
    if bandwidth_gbs:
        floor = nbytes / (bandwidth_gbs * 1e9)
        out.update(
            pct_of_bandwidth=100.0 * out["achieved_gbs"] / bandwidth_gbs,
            floor_seconds=floor,
            tokens_per_s_ceiling=batch / floor,
        )
    return out


def traced_decode_roofline(
    config,
    traces: Sequence[RequestTrace],
    steps: Sequence[StepRecord],
    bandwidth_gbs: float | None = None,
    dtype_bytes: int = 2,
) -> dict[str, float | None] | None:
    """The decode roofline of any run (several waves, arrivals over time, mixed prompt lengths),
    from its traces: which rows each decode step advanced and at what context. None if no step
    decoded. Adds 'decode_steps' (device iterations), 'mean_batch' and 'mean_context'."""
    decode_ends = {s.end for s in steps if s.kind == "decode"}
    seconds = decode_seconds(steps)
    width: dict[float, int] = {}  # decode step (its end time) -> device iterations inside it
    rows = 0  # row-iterations: one per decode token
    context = 0.0  # tokens attended, summed over row-iterations
    for t in traces:
        n = 0  # tokens the request had before this delivery
        for when, group in itertools.groupby(t.token_times):
            k = len(list(group))
            if when in decode_ends:
                width[when] = max(width.get(when, 0), k)
                rows += k
                context += k * (t.prompt_tokens + n) + k * (k - 1) / 2  # tokens n+1 .. n+k
            n += k
    iterations = sum(width.values())
    if not iterations or seconds <= 0:
        return None
    # Bytes and FLOPs are summed over decode iterations (weights once per iteration + each row's
    # KV attended), which, both being linear in rows and context, is the mean iteration (mean
    # running batch at mean context) times the iterations. A step() delivering up to k tokens a
    # row (multi-step decode) counts as k iterations; rows that finished inside it count only
    # for their tokens, and padding rows of a batch bucket not at all.
    mean_batch, mean_context = rows / iterations, context / rows
    out = roofline(
        config, mean_batch, mean_context, seconds / iterations, bandwidth_gbs, dtype_bytes
    )
    out.update(decode_steps=iterations, mean_batch=mean_batch, mean_context=mean_context)
    return out


def format_roofline(r: Mapping) -> str:
    """One line for a roofline() dict with 'decode_steps' and 'mean_context' (and 'mean_batch')."""
    batch = f"mean batch {r['mean_batch']:.1f}, " if "mean_batch" in r else ""
    line = (
        f"  decode roofline: {r['decode_steps']} steps of {r['step_seconds'] * 1e3:.3f} ms, "
        f"{batch}{r['bytes'] / 1e9:.3f} GB and {r['flops'] / 1e9:.3g} GFLOP/step at mean "
        f"context {r['mean_context']:.0f} -> {r['achieved_gbs']:,.0f} GB/s, "
        f"{r['achieved_tflops']:.2f} TFLOP/s, {r['tokens_per_s']:,.0f} tok/s"
    )
    if r.get("pct_of_bandwidth") is not None:
        line += (
            f" ({r['pct_of_bandwidth']:.0f}% of {r['bandwidth_gbs']:,.0f} GB/s; floor "
            f"{r['floor_seconds'] * 1e3:.3f} ms/step, {r['tokens_per_s_ceiling']:,.0f} tok/s)"
        )
    return line
