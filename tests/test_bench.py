"""bench/: metric arithmetic against hand-computed values, and each script end to end on CPU."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from bench import metrics as m
from bench.bench_sampling import CASES as SAMPLING_CASES
from rosejax.engine_args import kernel_tile
from rosejax.models.gpt2.config import PRESETS

# ------------------------------------------------------------------------------ arithmetic


def test_percentiles_linear():
    p = m.percentiles([4.0, 1.0, 3.0, 2.0])
    # numpy 'linear': rank q/100 * (n-1) between the sorted values 1, 2, 3, 4
    assert p["p50"] == pytest.approx(2.5)
    assert p["p95"] == pytest.approx(3.85)
    assert p["p99"] == pytest.approx(3.97)
    assert p["mean"] == pytest.approx(2.5) and p["max"] == 4.0 and p["n"] == 4


def test_percentiles_skip_missing_and_empty():
    assert m.percentiles([None, float("nan"), 7.0])["p99"] == 7.0
    empty = m.percentiles([])
    assert empty["n"] == 0 and empty["p50"] is None and empty["mean"] is None
    assert m.scaled({"p50": 0.25, "n": 3}, 1e3) == {"p50": 250.0, "n": 3}


def _trace(submit, times, prompt=3):
    t = m.RequestTrace("r", submit, prompt_tokens=prompt)
    for x in times:
        t.add_tokens(1, x)
    return t


def test_per_request_metrics():
    # first token from prefill at 0.5, then a 3-token window at 0.6, then one at 0.9
    t = m.RequestTrace("a", submit_time=0.0)
    t.add_tokens(1, 0.5)
    t.add_tokens(3, 0.6)
    t.add_tokens(1, 0.9)
    assert t.num_tokens == 5 and t.finish_time == 0.9
    assert m.ttft(t) == pytest.approx(0.5)
    assert m.tpot(t) == pytest.approx((0.9 - 0.5) / 4)
    assert m.itl(t) == pytest.approx([0.1, 0.0, 0.0, 0.3])
    assert m.delivery_gaps(t) == pytest.approx([0.1, 0.3])
    assert m.e2e(t) == pytest.approx(0.9)


def test_single_token_and_empty_requests():
    one = _trace(1.0, [1.25])
    assert m.ttft(one) == pytest.approx(0.25) and m.tpot(one) is None and m.itl(one) == []
    none = m.RequestTrace("x", 0.0)
    assert m.ttft(none) is None and m.e2e(none) is None and m.throughput([none]) is None


def test_throughput_and_decode_throughput():
    a = _trace(0.0, [1.0, 2.0])
    b = _trace(0.5, [1.5, 2.5, 3.0])
    assert m.throughput([a, b]) == pytest.approx(5 / 3.0)  # 5 tokens, first submit 0, last 3.0
    steps = [
        m.StepRecord(0.0, 1.0, 2, "prefill"),
        m.StepRecord(1.0, 1.5, 2, "decode"),
        m.StepRecord(2.0, 2.5, 1, "decode"),
        m.StepRecord(2.5, 2.75, 3, "mixed"),
    ]
    # Each decode step from the previous step's end: 0.5 s, then 1.0 with the host's gap.
    assert m.decode_seconds(steps) == pytest.approx(1.5)
    assert m.decode_throughput(steps) == pytest.approx(3 / 1.5)
    assert m.decode_throughput(steps[:1]) is None
    assert m.decode_seconds(steps[2:]) == pytest.approx(0.5)  # the first step: from its start


def test_step_kind():
    assert m.step_kind(0, 0) == "empty"
    assert m.step_kind(3, 3) == "prefill"
    assert m.step_kind(3, 0) == "decode"
    assert m.step_kind(3, 1) == "mixed"


def test_summarize_hand_values():
    a = m.RequestTrace("a", 0.0, prompt_tokens=2)
    a.add_tokens(1, 0.1)
    a.add_tokens(2, 0.3)  # two tokens in one delivery: one zero gap
    a.finish_reason = "length"
    b = _trace(0.0, [0.2, 0.4], prompt=5)
    b.finish_reason = "length"
    steps = [
        m.StepRecord(0.0, 0.1, 1, "prefill"),
        m.StepRecord(0.1, 0.2, 1, "prefill"),
        m.StepRecord(0.2, 0.3, 2, "decode"),
        m.StepRecord(0.3, 0.4, 1, "decode"),
    ]
    s = m.summarize([a, b], steps)
    assert s["num_requests"] == 2 and s["num_finished"] == 2
    assert s["prompt_tokens"] == 7 and s["completion_tokens"] == 5
    assert s["duration_s"] == pytest.approx(0.4)
    assert s["throughput_tok_s"] == pytest.approx(5 / 0.4)
    assert s["decode_throughput_tok_s"] == pytest.approx(3 / 0.2)
    assert s["steps"] == {"prefill": 2, "decode": 2}
    assert s["ttft_ms"]["p50"] == pytest.approx(150.0)  # ttfts 100 and 200 ms
    assert s["tpot_ms"]["mean"] == pytest.approx((100.0 + 200.0) / 2)  # (0.3-0.1)/2, 0.2/1
    assert s["itl_ms"]["n"] == 3 and s["itl_zero_fraction"] == pytest.approx(1 / 3)
    assert s["delivery_gap_ms"]["n"] == 2
    assert s["e2e_ms"]["max"] == pytest.approx(400.0)
    json.dumps(s)  # JSON-ready
    over = m.summarize_runs([s, dict(s, throughput_tok_s=s["throughput_tok_s"] * 3)])
    assert over["throughput_tok_s"]["mean"] == pytest.approx(2 * 5 / 0.4)
    assert over["ttft_ms.p50"]["n"] == 2
    text = m.format_summary(s, "run")
    assert "TTFT (ms)  p50    150.00" in text and "throughput 12.5 tok/s" in text


def test_roofline_gpt2_124m():
    cfg = PRESETS["gpt2"]
    assert cfg.num_params() == 124_439_808
    assert m.weight_bytes(cfg) == (124_439_808 - 1024 * 768) * 2
    assert m.kv_bytes_per_token(cfg) == 2 * 12 * 768 * 2 == 36_864
    # 256 rows at the mean context of 8-token prompts with 256 new tokens: 8 + 128 = 136
    ctx = m.mean_decode_context(8, 256)
    assert ctx == 136
    b = m.decode_step_bytes(cfg, 256, ctx)
    assert b["weights"] == 247_306_752
    assert b["kv_read"] == 256 * 136 * 36_864 == 1_283_457_024
    assert b["kv_write"] == 256 * 36_864
    assert b["embedding_rows"] == 2 * 256 * 768 * 2
    assert b["total"] == 1_540_987_392  # DESIGN: "about 1.5 GB ... per step"
    assert m.decode_step_bytes(cfg, 2, [10, 30])["kv_read"] == 40 * 36_864
    with pytest.raises(ValueError):
        m.decode_step_bytes(cfg, 2, [10])


def test_flops_and_roofline_ratios():
    cfg = PRESETS["gpt2"]
    per_row = 12 * (4 * 768**2 + 2 * 768 * 3072) + 50257 * 768
    assert per_row == 123_532_032
    assert m.decode_step_flops(cfg, 1, 100) == 2 * per_row + 4 * 12 * 768 * 100
    r = m.roofline(cfg, 256, 136, step_seconds=1e-3, bandwidth_gbs=4000.0)
    assert r["achieved_gbs"] == pytest.approx(1_540_987_392 / 1e-3 / 1e9)
    assert r["pct_of_bandwidth"] == pytest.approx(100 * r["achieved_gbs"] / 4000)
    assert r["floor_seconds"] == pytest.approx(1_540_987_392 / 4e12)
    assert r["tokens_per_s"] == pytest.approx(256_000)
    assert r["tokens_per_s_ceiling"] == pytest.approx(256 / r["floor_seconds"])
    assert m.roofline(cfg, 1, 10, 1e-3)["pct_of_bandwidth"] is None
    assert m.mean_decode_context(8, 256) == 136  # steps 1..255 attend 9..263 tokens


def test_prefill_flops_by_hand():
    from bench.benchmark_long_context import prefill_flops

    cfg = PRESETS["gpt2"]
    layers = 12 * (4 * 768**2 + 2 * 768 * 3072)  # per token
    head = 50257 * 768  # the last token's logits only
    attention = 4 * 12 * 768 * (1 + 2 + 3)  # token i attends to i keys
    assert prefill_flops(cfg, 3) == 2 * (3 * layers + head) + attention


def test_roofline_tiny_by_hand():
    cfg = PRESETS["tiny"]  # vocab 50257, 128 positions, E 64, 2 layers, fp32 here
    e, f, v = 64, 256, 50257
    params = v * e + 128 * e + 2 * (4 * e + 3 * e * e + 3 * e + e * e + e + e * f + f + f * e + e)
    params += 2 * e
    assert cfg.num_params() == params
    b = m.decode_step_bytes(cfg, 3, 20, dtype_bytes=4)
    assert b["weights"] == (params - 128 * e) * 4
    assert b["kv_read"] == 3 * 20 * 2 * 2 * e * 4
    assert b["kv_write"] == 3 * 2 * 2 * e * 4
    assert b["embedding_rows"] == 3 * 2 * e * 4


def test_traced_decode_roofline_one_wave_is_the_mean_step():
    cfg = PRESETS["gpt2"]
    traces = [_trace(0.0, [1.0, 2.0, 3.0, 4.0], prompt=5) for _ in range(2)]
    steps = [m.StepRecord(0.5, 1.0, 2, "prefill")] + [
        m.StepRecord(t - 0.5, t, 2, "decode") for t in (2.0, 3.0, 4.0)
    ]
    r = m.traced_decode_roofline(cfg, traces, steps, bandwidth_gbs=4000.0)
    # One wave of 2 rows, 5-token prompts, 4 new tokens: 3 steps of 1 s (each from the step
    # before's end) at mean context 7.
    ref = m.roofline(cfg, 2, m.mean_decode_context(5, 4), 1.0, bandwidth_gbs=4000.0)
    assert r["decode_steps"] == 3 and r["mean_batch"] == 2 and r["mean_context"] == 7
    for key in ("bytes", "flops", "step_seconds", "achieved_gbs", "pct_of_bandwidth"):
        assert r[key] == pytest.approx(ref[key])
    assert m.traced_decode_roofline(cfg, traces, steps[:1]) is None
    assert "mean batch 2.0" in m.format_roofline(r) and "% of 4,000" in m.format_roofline(r)


def test_traced_decode_roofline_waves_and_windows_by_hand():
    cfg = PRESETS["tiny"]
    a = _trace(0.0, [1.0, 2.0, 2.0, 2.0], prompt=4)  # a 3-token window: contexts 5, 6, 7
    b = _trace(0.0, [1.0, 2.0], prompt=2)  # finished inside the window: context 3
    c = _trace(2.5, [3.0, 4.0, 4.0], prompt=6)  # a later wave: contexts 7, 8
    steps = [
        m.StepRecord(0.5, 1.0, 2, "prefill"),
        m.StepRecord(1.5, 2.0, 4, "decode"),
        m.StepRecord(2.8, 3.0, 1, "prefill"),
        m.StepRecord(3.5, 4.0, 2, "decode"),
    ]
    r = m.traced_decode_roofline(cfg, [a, b, c], steps, dtype_bytes=4)
    iterations, rows, context = 3 + 2, 3 + 1 + 2, 18 + 3 + 15
    assert r["decode_steps"] == iterations
    assert r["mean_batch"] == pytest.approx(rows / iterations)
    assert r["mean_context"] == pytest.approx(context / rows)
    per_tok = m.kv_bytes_per_token(cfg, 4)
    total = (
        iterations * m.weight_bytes(cfg, 4)
        + context * per_tok
        + rows * per_tok
        + rows * 2 * cfg.n_embd * 4
    )
    assert r["bytes"] * iterations == pytest.approx(total)
    flops = sum(m.decode_step_flops(cfg, 1, x) for x in (5, 6, 7, 3, 7, 8))
    assert r["flops"] * iterations == pytest.approx(flops)
    assert r["step_seconds"] == pytest.approx(2.0 / iterations)  # 1.0-2.0 and 3.0-4.0
    assert r["tokens_per_s"] == pytest.approx(rows / 2.0)  # = decode-only throughput
    assert r["pct_of_bandwidth"] is None


# ---------------------------------------------------------------------- scripts end to end

TINY = ["--model", "random:tiny", "--no-warmup", "--no-progress", "--block-size", "16"]


def _load(path):
    with open(path) as f:
        return json.load(f)


def _positive(x):
    return x is not None and math.isfinite(x) and x > 0


def test_frozen_from_freezes_the_heap_for_the_timed_runs_only():
    """Runs before `first` (compiling, warming up) see the heap as it was; the rest a frozen one,
    even if something froze objects before; after the loop, and after a run that raised, nothing
    is frozen."""
    from bench.common import frozen_from

    gc.unfreeze()
    seen = [(run, gc.get_freeze_count() > 0) for run in frozen_from(2, 5)]
    assert seen == [(0, False), (1, False), (2, True), (3, True), (4, True)]
    assert gc.get_freeze_count() == 0
    gc.freeze()  # a Python that froze what its start made
    assert [gc.get_freeze_count() > 0 for _ in frozen_from(0, 2)] == [True, True]
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError):
        for run in frozen_from(1, 3):
            if run == 1:
                raise RuntimeError("a timed run failed")
    assert gc.get_freeze_count() == 0


def test_gc_pauses_counts_the_collections_inside_only():
    from bench.common import gc_pauses

    callbacks = list(gc.callbacks)
    with gc_pauses() as pauses:
        gc.collect()
        gc.collect(0)
    gc.collect()
    assert [p.generation for p in pauses] == [2, 0]
    assert all(0 <= p.thread_seconds <= p.seconds + 0.01 < 10 and p.collected >= 0 for p in pauses)
    assert gc.callbacks == callbacks


def test_streaming_end_to_end(tmp_path, monkeypatch):
    from bench import benchmark_streaming, common

    path = tmp_path / "s.json"
    gc.freeze()  # as a Python that freezes what its start made: the runs freeze all the same
    freezes = []
    monkeypatch.setattr(
        common, "freeze_heap", lambda: freezes.append(1) or (gc.collect(), gc.freeze())
    )
    assert (
        benchmark_streaming.main(
            [
                *TINY,
                "--num-requests",
                "4",
                "--max-new-tokens",
                "6",
                "--max-batch-size",
                "4",
                "--prompt-repeats",
                "1,3",
                "--no-stop-on-eos",
                "--warmup-runs",
                "1",
                "--repeat-runs",
                "2",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    data = _load(path)
    assert data["benchmark"] == "streaming" and len(data["runs"]) == 2
    assert len(data["warmup_runs"]) == 1
    for run in data["runs"]:
        s = run["summary"]
        assert s["num_requests"] == 4 and s["num_finished"] == 4
        assert s["completion_tokens"] == 24  # EOS off: exactly 6 each
        assert s["prompt_tokens"] == 1 + 3 + 1 + 3  # "Hello" and "Hello Hello Hello"
        assert _positive(s["throughput_tok_s"])
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(s[key]) >= {"p50", "p95", "p99"} and s[key]["n"] > 0
        assert len(run["requests"]["ttft_ms"]) == 4
        assert run["requests"]["completion_tokens"] == [6] * 4
        roof = s["roofline"]  # several prompt lengths: from the traces
        assert roof["decode_steps"] >= 5 and 0 < roof["mean_batch"] <= 4
        assert _positive(roof["achieved_gbs"]) and _positive(roof["flops"])
        assert roof["pct_of_bandwidth"] is None  # CPU, no --bandwidth-gbs: not measured
        assert roof["tokens_per_s"] == pytest.approx(s["decode_throughput_tok_s"])
    assert _positive(data["summary"]["throughput_tok_s"]["mean"])
    assert _positive(data["summary"]["roofline.achieved_gbs"]["mean"])
    assert data["environment"]["backend"] == "cpu"
    for run in data["runs"]:
        gcs = run["summary"]["gc_pause_ms"]
        assert gcs["count"] >= 0 and 0 <= gcs["max"] <= gcs["total"]
        assert gcs["max_generation"] in (0, 1, 2) and gcs["max_collected"] >= 0
        assert 0 <= gcs["max_thread_ms"] <= gcs["max"] + 10
    # Frozen for the timed runs, unfrozen after: an engine the caller drops stays collectable.
    assert freezes == [1]
    assert gc.get_freeze_count() == 0


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_streaming_schedule_pretok_unique_decode_steps(tmp_path):
    from bench import benchmark_streaming

    path = tmp_path / "s.json"
    assert (
        benchmark_streaming.main(
            [
                *TINY,
                "--num-requests",
                "3",
                "--max-new-tokens",
                "5",
                "--submit-interval-ms",
                "20",
                "--pretok",
                "--unique-prompts",
                "--decode-steps",
                "2",
                "--no-stop-on-eos",
                "--temperature",
                "0.8",
                "--top-k",
                "20",
                "--top-p",
                "0.9",
                "--no-prefix-cache",
                "--warmup-runs",
                "0",
                "--repeat-runs",
                "1",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    data = _load(path)
    s = data["runs"][0]["summary"]
    assert s["completion_tokens"] == 15 and s["num_finished"] == 3
    assert data["args"]["decode_steps"] == 2 and data["args"]["pretok"]
    # each request was due 20 ms after the one before: submit times are the schedule
    assert s["duration_s"] > 0.04


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_scheduler_offline_and_online(tmp_path):
    from bench import benchmark_scheduler

    path = tmp_path / "off.json"
    assert (
        benchmark_scheduler.main(
            [
                *TINY,
                "--num-requests",
                "3",
                "--input-len",
                "5",
                "--max-new-tokens",
                "4",
                "--max-batch-size",
                "4",
                "--no-stop-on-eos",
                "--warmup-runs",
                "1",
                "--repeat-runs",
                "1",
                "--bandwidth-gbs",
                "100",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    data = _load(path)
    s = data["runs"][0]["summary"]
    assert data["mode"] == "offline"
    assert s["prompt_tokens"] == 15 and s["completion_tokens"] == 12
    assert _positive(s["throughput_tok_s"]) and _positive(s["decode_throughput_tok_s"])
    roof = s["roofline"]
    assert roof["decode_steps"] == 3 and roof["mean_context"] == 7
    assert _positive(roof["achieved_gbs"]) and _positive(roof["pct_of_bandwidth"])

    path = tmp_path / "on.json"
    assert (
        benchmark_scheduler.main(
            [
                *TINY,
                "--mode",
                "online",
                "--request-rate",
                "100",
                "--num-requests",
                "3",
                "--max-new-tokens",
                "3",
                "--no-stop-on-eos",
                "--warmup-runs",
                "0",
                "--repeat-runs",
                "1",
                "--prompt",
                "Hello there",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    s = _load(path)["runs"][0]["summary"]
    assert s["completion_tokens"] == 9 and s["prompt_tokens"] == 6
    # Online runs get the roofline too, from their traces: decode tokens 2 and 3 of each
    # 2-token prompt attend 3 and 4 tokens, whatever the arrivals made of the batches.
    roof = s["roofline"]
    assert roof["mean_context"] == pytest.approx(3.5) and 1 <= roof["mean_batch"] <= 3


def test_poisson_offsets():
    from bench.benchmark_scheduler import poisson_offsets

    off = poisson_offsets(50, 10.0, seed=1)
    assert off[0] == 0 and all(b >= a for a, b in zip(off[:-1], off[1:], strict=True))
    assert off == poisson_offsets(50, 10.0, seed=1)
    assert poisson_offsets(3, float("inf"), 0) == [0.0, 0.0, 0.0]


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_compare_hf_end_to_end(tmp_path):
    """HF in its subprocess (dynamic cache only) beside rosejax, tiny model, on CPU."""
    from bench import compare_hf

    path = tmp_path / "c.json"
    assert (
        compare_hf.main(
            [
                *TINY,
                "--batch-sizes",
                "1,2",
                "--max-new-tokens",
                "4",
                "--skip-hf-static",
                "--warmup-runs",
                "1",
                "--repeat-runs",
                "1",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    data = _load(path)
    assert [r["batch_size"] for r in data["table"]] == [1, 2]
    hf = data["hf"]["results"]
    assert [(r["mode"], r["batch_size"]) for r in hf] == [("dynamic", 1), ("dynamic", 2)]
    assert all("error" not in r and _positive(r["throughput_tok_s"]) for r in hf)
    for row, b in zip(data["rosejax"]["results"], (1, 2), strict=True):
        assert row["completion_tokens"] == [4 * b]
        assert _positive(row["throughput_tok_s"])
        assert _positive(row["decode_gbs"]) and _positive(row["decode_gflop_per_step"])
        assert row["decode_pct_of_bandwidth"] is None  # CPU, no --bandwidth-gbs
    for t in data["table"]:
        assert _positive(t["ratio_vs_dynamic"]) and t["hf_static_tok_s"] is None


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_profile_decode_kernel_tiles(tmp_path, monkeypatch):
    """--kernel and --kernel-tile build the engine's KernelConfig (tiles checked against the
    keyword parameters of the functions that get them; no module is patched), and the script
    runs end to end on CPU."""
    from bench import profile_decode as pd
    from rosejax import KernelConfig

    for bad in (
        "linear.block_n",  # no value
        "linear.bogus=2",  # no such keyword
        "conv.num_warps=2",  # no such op
        "linear.block_n=x",  # not an int
        "attention.block_rows=2",  # layer_norm's, not attention's
        "linear.activation=1",  # the layer passes it itself
        "layer_norm.eps=1",
        "attention.interpret=1",
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            kernel_tile(bad)
    assert kernel_tile("attention.num_stages=1") == ("attention", "num_stages", 1)
    for bad_args in (["--kernel", "linear=cuda"], ["--kernel", "linear_max_rows=x"]):
        with pytest.raises(SystemExit):
            pd.main(bad_args)
    engines = []  # every engine the script made
    make = pd.make_engine

    def spy(*args, **kwargs):
        engines.append(make(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(pd, "make_engine", spy)
    frozen = []  # whether the heap was frozen during each run
    timed_run = pd.timed_run

    def spy_run(*args, **kwargs):
        frozen.append(gc.get_freeze_count() > 0)
        return timed_run(*args, **kwargs)

    monkeypatch.setattr(pd, "timed_run", spy_run)
    gc.unfreeze()
    path = tmp_path / "p.json"
    pd.main(
        [
            "--model",
            "random:tiny",
            "--batch",
            "2",
            "--new-tokens",
            "4",
            "--decode-steps",
            "2",
            "--timed-runs",
            "1",
            "--kernel",
            "linear_max_rows=8",
            "--kernel-tile",
            "linear.num_warps=2",
            "--kernel-tile",
            "layer_norm.block_rows=2",
            "--json",
            str(path),
        ]
    )
    tiles = (("linear", "num_warps", 2), ("layer_norm", "block_rows", 2))
    (engine,) = engines
    assert engine.kernels == KernelConfig.for_backend(linear_max_rows=8, tiles=tiles)
    assert engine.engine_config.kernels is engine.kernels
    assert engine.kernels.tile_kwargs("linear") == {"num_warps": 2}
    assert engine.kernels.tile_kwargs("layer_norm") == {"block_rows": 2}
    data = _load(path)
    assert data["kernel_tiles"] == ["linear.num_warps=2", "layer_norm.block_rows=2"]
    assert data["kernel_settings"] == ["linear_max_rows=8"]
    assert data["kernels"] == json.loads(json.dumps(dataclasses.asdict(engine.kernels)))
    (row,) = data["rows"]
    assert row["decode_steps"] == 2 and row["decode_ms_per_step"] > 0
    # the compiling run as it was, the timed one with the heap frozen, unfrozen after
    assert frozen == [False, True] and gc.get_freeze_count() == 0


def test_compare_variants_stops_before_memory_runs_out(monkeypatch):
    """Every variant's engine is held at once: once the last one built leaves no room for one
    more of its size, the script stops with the figures and the way out, before building it."""
    from bench import compare_variants as cv

    assert cv.room_for_another(50, 25) and not cv.room_for_another(50, 24)
    gib = 2**30
    readings = iter([40 * gib, 10 * gib])  # the first engine takes 30 of 40 free
    monkeypatch.setattr(cv, "free_memory_bytes", lambda: next(readings))
    built = []
    monkeypatch.setattr(cv, "build", lambda config, args, rng: built.append(config) or (None, 0))
    with pytest.raises(SystemExit):
        cv.main(["a:", "b:", "--model", "random:tiny"])
    assert len(built) == 1


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_compare_variants(tmp_path, monkeypatch):
    """Each variant's engine is built from its own EngineConfig (KernelConfig fields, tiles,
    engine fields), nothing in the environment or the modules changed; the timed runs are
    interleaved and the first variant is the baseline."""
    from bench import compare_variants as cv
    from bench import profile_decode as pd
    from rosejax import EngineConfig, KernelConfig

    for bad in (
        "nocolon",
        ":x=1",
        "a:linear.bogus=2",
        "a:NOEQUALS",
        "a:ROSEJAX_FUSED_KV_APPEND=0",  # environment variables are no settings any more
        "a:bogus_field=1",
        "a:min_decode_batch=x",
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            cv.variant(bad)
    for bad_args in (
        ["a:", "a:"],
        ["a:", "--runs", "0"],
        ["a:", "--new-tokens", "1"],
        ["a:attention=cuda"],  # values are checked before any engine is built
        ["a:fused_kv_append=maybe"],
        ["a:min_decode_batch=0"],
    ):
        with pytest.raises(SystemExit):
            cv.main(bad_args)
    env = {k: v for k, v in os.environ.items() if k.startswith("ROSEJAX_")}
    built = []  # the engine of each variant, in the order they were made
    build = cv.build

    def spy(config, args, rng):
        engine, compiles = build(config, args, rng)
        assert engine.engine_config is config
        built.append(engine)
        return engine, compiles

    monkeypatch.setattr(cv, "build", spy)
    tags = []  # each run's tag, in the order the runs happened
    draws = []  # each run's sampling fields
    timed_run = pd.timed_run

    frozen = []  # whether the heap was frozen during each run

    def spy_run(engine, batch, prompt_len, new_tokens, rng, tag, **sampling):
        tags.append(tag)
        draws.append(sampling)
        frozen.append(gc.get_freeze_count() > 0)
        return timed_run(engine, batch, prompt_len, new_tokens, rng, tag, **sampling)

    gc.unfreeze()

    monkeypatch.setattr(pd, "timed_run", spy_run)
    path = tmp_path / "v.json"
    data = cv.main(
        [
            "base:",
            "both:fused_kv_append=off,linear.num_warps=2,linear_max_rows=32,min_decode_batch=2,"
            "block_size=8",
            "--model",
            "random:tiny",
            "--batch",
            "2",
            "--new-tokens",
            "4",
            "--decode-steps",
            "2",
            "--runs",
            "2",
            "--temperature",
            "0.7",
            "--top-k",
            "5",
            "--json",
            str(path),
        ]
    )
    base_engine, both_engine = built
    # every run, warm-ups too, draws as the flags say
    assert draws == [dict(temperature=0.7, top_k=5, top_p=1.0)] * 6
    assert base_engine.kernels == KernelConfig.for_backend()
    assert both_engine.kernels == KernelConfig.for_backend(
        fused_kv_append=False, linear_max_rows=32, tiles=(("linear", "num_warps", 2),)
    )
    assert base_engine.engine_config.min_decode_batch == EngineConfig("m").min_decode_batch
    assert both_engine.engine_config.min_decode_batch == 2
    assert both_engine.decode_buckets[0] == 2  # the 1-row program is gone
    # a variant's block size overrides the script's --block-size
    assert base_engine.engine_config.block_size == EngineConfig.block_size  # --block-size default
    assert both_engine.engine_config.block_size == 8
    assert tags == ["warm-up", "warm-up", "base-0", "both-0", "base-1", "both-1"]
    # the timed runs with the heap frozen (no full collection in them), unfrozen after
    assert frozen == [False, False, True, True, True, True] and gc.get_freeze_count() == 0
    assert {k: v for k, v in os.environ.items() if k.startswith("ROSEJAX_")} == env
    assert _load(path) == json.loads(json.dumps(data))
    assert data["sampling"] == dict(temperature=0.7, top_k=5, top_p=1.0)
    base, both = _load(path)["rows"]
    assert (base["name"], both["name"]) == ("base", "both")
    assert both["settings"] == [
        "fused_kv_append=off",
        "linear.num_warps=2",
        "linear_max_rows=32",
        "min_decode_batch=2",
        "block_size=8",
    ]
    assert (
        both["engine_fields"] == {"min_decode_batch": 2, "block_size": 8}
        and base["engine_fields"] == {}
    )
    assert both["kernels"]["fused_kv_append"] is False and both["kernels"]["linear_max_rows"] == 32
    assert both["kernels"]["tiles"] == [["linear", "num_warps", 2]]
    assert base["kernels"] == json.loads(json.dumps(dataclasses.asdict(base_engine.kernels)))
    assert base["vs_baseline"] == 1.0 and _positive(both["vs_baseline"])
    for row in data["rows"]:
        assert len(row["runs"]) == 2 and all(_positive(x) for x in row["runs"])
        assert not row["recompiled"]


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    from bench import common

    common.plot_distributions(
        str(tmp_path / "d.png"), {"run0": {"ttft_ms": [1.0, 2.0, 5.0], "itl_ms": [0.0, 1.0]}}, "t"
    )
    common.plot_throughput(
        str(tmp_path / "t.png"), [1, 16], {"a": [10.0, 100.0], "b": [None, 5]}, "t"
    )
    assert (tmp_path / "d.png").stat().st_size > 1000 and (tmp_path / "t.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "script,flags",
    [
        (
            "benchmark_streaming",
            [
                "--prompt-repeats",
                "--unique-prompts",
                "--pretok",
                "--submit-interval-ms",
                "--no-stop-on-eos",
                "--decode-steps",
                "--hf-model-id",
                "--warmup-runs",
                "--repeat-runs",
                "--plot",
            ],
        ),
        ("benchmark_scheduler", ["--mode", "--request-rate", "--input-len", "--json"]),
        ("compare_hf", ["--batch-sizes", "--skip-hf-static", "--hf-in-process", "--plot"]),
        (
            "profile_decode",
            ["--kernel", "--kernel-tile", "--trace-dir", "--decode-steps", "--timed-runs"],
        ),
        ("compare_variants", ["--runs", "--batch", "--decode-steps", "--json"]),
        ("profile_burst", ["--variant", "--rounds", "--bursts", "--trace-dir", "--json"]),
        ("benchmark_data_parallel", ["--data-parallel-size", "--only", "--repeat-runs", "--json"]),
        ("benchmark_parallel", ["--out-dir", "--tp", "--tpot-model", "--skip-processes"]),
        ("benchmark_startup", ["--checkout", "--runs", "--untimed-runs", "--json"]),
        ("benchmark_api_cost", ["--checkout", "--runs", "--rounds", "--window", "--json"]),
        ("benchmark_long_context", ["--context-len", "--output-len", "--peak-tflops"]),
        ("step_timeline", ["--gap-ms", "--last", "--start"]),
        ("check_engine_parity", ["--family", "--kernel", "--kernel-tile", "--decode-steps"]),
    ],
)
@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_help_as_a_file(script, flags):
    """`python bench/<script>.py --help` works from anywhere and names every flag."""
    out = subprocess.run(
        [sys.executable, f"bench/{script}.py", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=str(_repo()),
    )
    for flag in flags:
        assert flag in out.stdout


@pytest.mark.slow  # three engine processes: ~15 s of CPU
def test_profile_burst_variants(tmp_path):
    """Each variant in a process of its own, with its environment and engine flags; its first
    step's phases nest as the engine calls them, and a variant of other weights is caught by
    the token check; a burst in two groups (two prefills) gives the same tokens."""
    from bench.profile_burst import main

    out, dump = tmp_path / "burst.json", tmp_path / "dump"
    argv = ["--model", "random:tiny", "--max-batch-size", "6", "--num-prompts", "5"]
    argv += ["--input-len", "7", "--bursts", "2", "--rounds", "1", "--json", str(out)]
    argv += ["--variant", "a=", "--variant", f"b=XLA_FLAGS=--xla_dump_to={dump} --decode-steps 4"]
    assert main([*argv, "--variant", "c=--seed 7", "--variant", "d=--groups 2"]) == 1  # c's
    res = json.loads(out.read_text())["variants"]
    assert res["a"]["requests_differing"] == res["b"]["requests_differing"] == 0
    assert res["d"]["requests_differing"] == 0
    assert res["c"]["requests_differing"] > 0
    assert res["b"]["env"] == {"XLA_FLAGS": f"--xla_dump_to={dump}"} and any(dump.iterdir())
    for v in res.values():
        (run,) = v["runs"]
        assert len(run["phases"]) == 2
        for ph in run["phases"]:
            assert ph["first_tokens"] == 5 and ph["add"] > 0
            assert 0 < ph["prefill_call"] <= ph["admit"] <= ph["step"]
            assert 0 < ph["decode_call"] <= ph["step"] and ph["wait"] <= ph["harvest"] <= ph["step"]
            assert 0 < ph["ttft"] <= ph["burst"]


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_benchmark_long_context_end_to_end(tmp_path):
    """One run of a 100-token prompt: its TTFT and decode against floors from the given peaks."""
    from bench.benchmark_long_context import main, prefill_flops

    path = tmp_path / "long.json"
    argv = ["--model", "random:tiny", "--context-len", "100", "--output-len", "9", "--no-warmup"]
    argv += ["--warmup-runs", "0", "--repeat-runs", "1", "--no-progress", "--json", str(path)]
    assert main([*argv, "--peak-tflops", "2", "--bandwidth-gbs", "50"]) == 0
    data = _load(path)
    (run,) = data["runs"]
    assert run["requests"]["completion_tokens"] == [9] and run["requests"]["prompt_tokens"] == [100]
    floors = data["floors"]
    assert floors["ttft_floor_ms"] == pytest.approx(prefill_flops(PRESETS["tiny"], 100) / 2e9)
    step = m.decode_step_bytes(PRESETS["tiny"], 1, 100 + 9 / 2, dtype_bytes=4)["total"]
    assert floors["decode_floor_ms"] == pytest.approx(step / 50e9 * 1e3)


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_benchmark_startup_end_to_end(tmp_path):
    """Two starts of a tiny server: each one's phases, read off its log, come in order and
    before /health answers 200, which it timed."""
    path = tmp_path / "start.json"
    server = ["--model", "random:tiny", "--no-warmup", "--max-batch-size", "2"]
    subprocess.run(
        [sys.executable, "-m", "bench.benchmark_startup", "--runs", "2", "--untimed-runs", "0"]
        + ["--json", str(path), "--", *server, "--block-size", "16"],
        check=True,
        capture_output=True,
        cwd=str(_repo()),
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=600,
    )
    data = _load(path)
    assert data["server_args"][:2] == ["--model", "random:tiny"]
    (runs,) = data["runs"].values()
    assert len(runs) == 2
    for phases in runs:
        order = ["loading", "loaded", "kv_cache", "health_200"]
        assert [phases[name] for name in order] == sorted(phases[n] for n in order), phases
        assert 0 < phases["listening"] <= phases["health_200"] < 600


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_benchmark_api_cost_end_to_end(tmp_path):
    """A round of 4 streamed requests through the app and a stub engine process: every half
    took CPU, and a checkout's streams match themselves."""
    from bench.benchmark_api_cost import main

    path = tmp_path / "cost.json"
    argv = ["--runs", "1", "--rounds", "2", "--num-requests", "4", "--output-len", "10"]
    assert main([*argv, "--window", "4", "--window-ms", "1", "--json", str(path)]) == 0
    data = _load(path)
    (summary,) = data["summary"].values()
    assert summary["same_stream"] and summary["request_us"] > 0 and summary["output_us"] > 0
    ((run,),) = data["runs"].values()
    assert len(run["request_us"]) == 2
    # the first token alone, then windows of 4: 1 + 4 + 4 + 1 tokens, a usage chunk, [DONE]
    events = [e for e in run["stream"].split("\n\n") if e]
    assert len(events) == 6 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: ") :])["usage"]["completion_tokens"] == 10


def _repo():
    import pathlib

    return pathlib.Path(__file__).resolve().parents[1]


def test_kernel_bench_loops_are_cuda_graphs(monkeypatch):
    """The kernel microbenches set rosejax's process XLA flags before jax starts: their timed
    `while` loops run in command buffers (CUDA graphs), as the engine's windows do."""
    from bench.common import add_kernel_bench_args, parse_kernel_bench_args

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    monkeypatch.setattr(sys, "argv", ["bench", "--iters", "3"])
    p = argparse.ArgumentParser()
    add_kernel_bench_args(p)
    assert parse_kernel_bench_args(p).iters == 3
    flags = os.environ["XLA_FLAGS"].split()
    assert flags[0] == "--xla_dump_to=/tmp/x"  # the user's flags kept
    (buffers,) = [f for f in flags if f.startswith("--xla_gpu_enable_command_buffer=")]
    assert "WHILE" in buffers.split("=")[1].split(",")


@pytest.mark.parametrize("iters", [7, 45])  # below and past LOOP_UNROLL, with a remainder
def test_time_in_loop_calls_fn_iters_times_on_its_operands(iters):
    """time_in_loop chains `iters` calls a loop (warm-up and each repeat), unrolled or not, and
    hands the operands in as traced arguments of the loop, not as constants."""
    import jax
    import jax.numpy as jnp

    from bench.common import time_in_loop

    calls, traced = [], []

    def fn(y, a):
        traced.append(isinstance(a, jax.core.Tracer))
        jax.debug.callback(lambda: calls.append(1))
        return y + a

    us = time_in_loop(fn, jnp.zeros(3), jnp.ones(3), iters=iters, repeats=2)
    jax.effects_barrier()
    assert _positive(us)
    assert len(calls) == iters * 3  # warm-up + 2 repeats
    assert traced and all(traced)


def test_loop_times_times_every_call_once_a_round():
    """loop_times runs each call's loop once untimed, then times them in rounds, every call once
    a round in the order given (not each call's repeats in a row), each on its own operands; a
    time a loop a round."""
    import jax
    import jax.numpy as jnp

    from bench.common import loop_times

    order = []

    def tagged(tag):
        def fn(y, a):
            jax.debug.callback(lambda: order.append(tag), ordered=True)
            return y + a

        return fn

    x = jnp.zeros(2)
    calls = [(tagged(t), x, (jnp.full(2, float(t)),)) for t in (1, 2, 3)]
    times = loop_times(calls, iters=2, repeats=4)
    jax.effects_barrier()
    assert len(times) == 3 and all(len(t) == 4 and all(map(_positive, t)) for t in times)
    assert order == [t for _ in range(5) for t in (1, 2, 3) for _ in range(2)]


def _quick_rows(tmp_path, script: str, *extra: str) -> list[dict]:
    """bench/{script}.py --quick (interpret mode) with `extra` flags, its JSON's rows."""
    path = tmp_path / "k.json"
    subprocess.run(
        [sys.executable, f"bench/{script}.py", "--quick", "--json", str(path), *extra],
        check=True,
        capture_output=True,
    )
    data = _load(path)
    assert data["device"]
    return data["rows"]


@pytest.mark.parametrize("script", ["bench_attention", "bench_layer_norm"])
@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_kernel_microbench_quick(tmp_path, script):
    """The kernel microbenches run end to end (interpret mode) and every kernel agrees with its
    XLA reference."""
    rows = _quick_rows(tmp_path, script)
    assert len(rows) >= 3
    for row in rows:
        assert _positive(row["us"]) and _positive(row["gbs"])
        assert row["max_err"] < 1e-2


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_pdl_probe_quick(tmp_path):
    """The PDL probe's chain of Mosaic GPU kernels runs in jax's Mosaic GPU interpreter (without
    griddepcontrol, which it cannot run) and gives what the same adds give in XLA."""
    rows = _quick_rows(tmp_path, "probe_pdl")
    assert [r["variant"] for r in rows] == ["plain"]
    assert _positive(rows[0]["us"]) and rows[0]["vs_plain"] == 1.0 and rows[0]["max_err"] == 0


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_persistent_probe_quick(tmp_path):
    """The persistent-kernel probe's harness in interpret mode: its kernel-an-op Mosaic GPU chain
    gives numpy's sums exactly, and the Triton linear chain numpy's matmuls within bf16 rounding
    (its persistent kernels need a GPU's global semaphores)."""
    rows = _quick_rows(tmp_path, "probe_persistent")
    assert [r["variant"] for r in rows] == ["kernels", "triton"]
    assert all(_positive(r["us"]) for r in rows)
    assert rows[0]["max_err"] == 0 and rows[1]["max_err"] < 2**-7


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
@pytest.mark.parametrize("model,rows", [("qwen3-0.6b", 1), ("gpt2", 3)])
def test_decoder_step_bench_quick(tmp_path, model, rows):
    """The one-kernel step's bench harness on the CPU, its XLA reference in the kernel's place:
    every step timed (the kernel's module and a copy of it loaded from a file as a variant, with
    a keyword argument; a broken copy, whose step raises, dropped while the others run), and
    the reference's logits near the bf16 model's (float32 residual against the model's bf16 one)
    with the same argmax in every row; a Llama-family preset at one row, GPT-2 at three."""
    source = (_repo() / "pallas_kernels/decoder_step.py").read_text()
    variant, broken = tmp_path / "decoder_step_copy.py", tmp_path / "decoder_step_broken.py"
    variant.write_text(source)
    reference = "def decoder_step_reference("
    broken.write_text(
        source.replace(reference, "def _unused(", 1)
        + (f"\n\n{reference}*args, **kwargs):\n    raise ValueError('broken')\n")
    )
    args = ("--model", model, "--rows", str(rows), "--variant", f"copy={variant},stages=3")
    args += ("--variant", f"broken={broken}")
    rows = _quick_rows(tmp_path, "bench_decoder_step", *args)
    assert [(r["context"], r["variant"]) for r in rows] == [
        (c, v) for c in (20, 70) for v in ("model", "kernel", "copy")
    ]
    assert all(_positive(r["ms"]) for r in rows)
    assert all(r["ms"] == r["runs_ms"][0] and r["spread"] == 0 for r in rows)  # --quick: 1 run
    assert all(r["logits_rel_diff"] < 3e-2 and r["argmax_same"] for r in rows)
    for model, kernel, copy in zip(rows[::3], rows[1::3], rows[2::3], strict=True):
        assert model["logits_rel_diff"] == 0 and 0 < kernel["logits_rel_diff"]
        assert copy["logits_rel_diff"] == kernel["logits_rel_diff"]


def test_decoder_step_bench_reads_ptxas_report_from_native_output():
    """`--ptxas`: what native code writes to fds 1 and 2 inside the block is captured (and no
    longer printed after it), and the report's registers and spills are the most of its kernels."""
    from bench.bench_decoder_step import native_output, ptxas_usage

    rng = np.random.default_rng()
    regs, stores, loads = (int(n) for n in rng.integers(1, 256, size=3))
    kernels = [
        "ptxas info    : Compiling entry function 'a_kernel' for 'sm_90a'",
        f"    {stores} bytes stack frame, {stores} bytes spill stores, {loads} bytes spill loads",
        f"ptxas info    : Used {regs} registers, used 2 barriers, 1 bytes smem",
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
        f"ptxas info    : Used {regs - 1} registers, used 1 barriers",
    ]
    with native_output() as text:
        os.write(1, ("\n".join(kernels[:3]) + "\n").encode())
        os.write(2, ("\n".join(kernels[3:]) + "\n").encode())
    assert all(line in text[0] for line in kernels)
    assert ptxas_usage(text[0]) == dict(registers=regs, spill_stores=stores, spill_loads=loads)
    assert ptxas_usage("ptxas info    : 0 bytes gmem") == {}


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_decoder_step_bench_lowers_each_version(tmp_path):
    """`--lower` builds the kernel and each variant for sm90 on the CPU (Mosaic GPU's own
    lowering, not the interpreter): a copy builds, a copy with a layout Mosaic GPU cannot make
    fails with its reason, and neither stops the other."""
    source = (_repo() / "pallas_kernels/decoder_step.py").read_text()
    layout = "WG_STRIDED((TILE_K,), 2)"
    assert layout in source
    copy, bad = tmp_path / "ds_copy.py", tmp_path / "ds_bad.py"
    copy.write_text(source)
    bad.write_text(source.replace(layout, "WG_STRIDED((TILE_K,), 3)"))
    args = ("--lower", "--rows", "2", "--variant", f"bad={bad}", "--variant", f"copy={copy}")
    rows = _quick_rows(tmp_path, "bench_decoder_step", *args)
    assert [(r["variant"], r["rows"], r["lowered"]) for r in rows] == [
        ("kernel", 2, True),
        ("bad", 2, False),
        ("copy", 2, True),
    ]
    assert "WGStridedFragLayout" in rows[1]["error"] and not rows[0]["error"]


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_all_reduce_probe_psum_on_two_host_devices(tmp_path):
    """The all-reduce probe's harness (mesh, chained loop, check against the host's sum) on two
    CPU devices, through `psum` (its one-shot kernel needs GPUs)."""
    rows = _quick_rows(tmp_path, "probe_all_reduce")
    assert [(r["dtype"], r["rows"]) for r in rows] == [
        ("bfloat16", 1),
        ("bfloat16", 3),
        ("float32", 1),
        ("float32", 3),
    ]
    for r in rows:  # float32 adds two values exactly; bfloat16 rounds the sum once
        assert _positive(r["us"]) and r["max_rel_err"] <= (2**-8 if r["dtype"] == "bfloat16" else 0)


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_sampling_microbench_quick(tmp_path):
    """bench_sampling runs every case end to end beside its argmax baseline, one row each."""
    rows = _quick_rows(tmp_path, "bench_sampling")
    assert [r["case"] for r in rows] == list(SAMPLING_CASES)
    assert all(_positive(r["us"]) for r in rows)
    assert rows[0]["over_argmax_us"] == 0
    assert all(r["over_argmax_us"] == r["us"] - rows[0]["us"] for r in rows)


def test_parallel_parity_reports_a_failing_pair_and_runs_the_rest(monkeypatch, tmp_path):
    """A (model, dtype) pair whose engine fails is reported with its error, the other pairs
    still run and are compared, and the script's exit status says one failed."""
    from bench import benchmark_parallel as bp

    def greedy(args, model, tp, dtype, prompts):
        if dtype == "float32" and tp > 1:
            raise RuntimeError("RESOURCE_EXHAUSTED: Shared memory size limit exceeded")
        return [[len(p), tp if dtype == "bfloat16" else 0] for p in prompts], 0.0

    monkeypatch.setattr(bp, "_greedy_tokens", greedy)
    args = bp.build_parser().parse_args(
        ["--out-dir", "x", "--parity-models", "random:tiny", "--parity-prompts", "3"]
        + ["--parity-dtypes", "float32,float16,bfloat16"]
    )
    results = bp.check_parity(args)
    assert [r["dtype"] for r in results] == ["float32", "float16", "bfloat16"]
    assert "RESOURCE_EXHAUSTED" in results[0]["error"] and "equal_requests" not in results[0]
    assert results[1]["equal_requests"] == 3 and "error" not in results[1]
    assert results[2]["equal_requests"] == 0  # TP=2's tokens differ from TP=1's there
    argv = ["--out-dir", str(tmp_path), "--skip-processes", "--skip-tpot"]
    assert bp.main([*argv, "--parity-models", "random:tiny", "--parity-dtypes", "float32"]) == 1
    saved = json.loads((tmp_path / "benchmark_parallel.json").read_text())
    assert "error" in saved["parity"][0]
    assert bp.main([*argv, "--parity-models", "random:tiny", "--parity-dtypes", "float16"]) == 0


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
@pytest.mark.parametrize("family", ["gpt2", "qwen3", "llama"])
def test_engine_parity_check_passes_for_each_family(family, capsys):
    """bench/check_engine_parity.py serves random prompts of a small random model of each family
    and finds the engine's greedy tokens equal to HF's (it returns 1 and names the requests
    that differ otherwise)."""
    from bench import check_engine_parity

    args = ["--family", family, "--num-prompts", "3", "--max-tokens", "5", "--decode-steps", "2"]
    assert check_engine_parity.main(args) == 0
    assert "0/3 requests differ from HF" in capsys.readouterr().out


def _decoder_trace(layers: int, programs: int, no_o_proj: int) -> dict:
    """A profile as Mosaic GPU's profiler writes one (`ts` in thousands of cycles), built by hand:
    layer l from 100 l; program c's ranges of each link one unit each, c units late (its waits
    but the q/k/v one too, which every program ends at once); program `no_o_proj` takes no o_proj
    tile, the last program no attention item; then the head: a wait c units late, its norm and
    two tiles a program."""
    events = []

    def span(c, name, start, end, inner=()):
        events.append(dict(name=name, ph="B", ts=start, pid=1, tid=c + 1))
        for i, part in enumerate(inner):
            span(c, part, start + i, start + i + 1)
        events.append(dict(name=name, ph="E", ts=end, pid=1, tid=c + 1))

    def run(c, at, inputs, norm=False, wait_late=True):  # a phase run
        span(c, "phase_wait", at, at + 1 + (c if wait_late else 0))
        t = at + 1 + c
        if norm:
            span(c, "rms_norm", t, t + 1)
            t += 1
        for name in (inputs, "weights_wait", "tile"):
            span(c, name, t, t + 1)
            t += 1
        span(c, "store_signal", t, t + 1, ("signal",))

    for lay in range(layers):
        b = 100 * lay
        for c in range(programs):
            run(c, b, "norm_inputs", norm=True, wait_late=False)
            if c < programs - 1:
                span(c, "attention", b + 10 + c, b + 15 + c, ("attention_wait", "attention_inputs"))
            if c != no_o_proj:
                run(c, b + 20, "merge_inputs")
            run(c, b + 30, "norm_inputs", norm=True)
            run(c, b + 40, "mlp_inputs")
    for c in range(programs):
        at = 100 * layers
        span(c, "phase_wait", at, at + 1 + c)
        span(c, "rms_norm", at + 1 + c, at + 2 + c)
        for i, name in enumerate(("head_inputs", "weights_wait", "tile") * 2):
            span(c, name, at + 2 + c + i, at + 3 + c + i)
    return {"displayTimeUnit": "ns", "traceEvents": events}


def test_decoder_trace_spans_wake_ups_and_time_a_program(tmp_path):
    """The one-kernel step's profile reader: each run of a program labelled with its phase and
    layer (a program without o_proj tiles runs gate/up right after q/k/v), every link's span
    and wake-up and the layer's period as the hand-built trace has them, at the clock given,
    and the same with one program's clock off and drifting."""
    from bench import decoder_trace

    trace = _decoder_trace(layers=3, programs=3, no_o_proj=2)
    s = decoder_trace.summarize(trace, clock_mhz=1000.0)  # a unit of `ts` is then 1 µs
    assert (s["programs"], s["layers"], s["layer_period_us"]) == (3, 3, 100.0)
    # q/k/v: tiles from 2 to 5 + 2 + 1; attention from 10 to 15 + 1; o_proj (programs 0, 1)
    # from 21 to 25 + 1; gate/up from 32 to 36 + 2; down from 41 to 45 + 2.
    spans = {k: v["span_us"] for k, v in s["phases"].items()}
    wakes = {k: v["wake_us"] for k, v in s["phases"].items()}
    # The head: its first tile at 302, its last range's end 308 + 2; the last down ends at 247.
    assert spans == {"qkv": 6, "attention": 6, "o_proj": 5, "gate_up": 6, "down": 6, "head": 8}
    assert wakes == {
        "qkv": 1 + 100 - 47,
        "attention": 11 - 8,
        "o_proj": 21 - 16,
        "gate_up": 31 - 26,
        "down": 41 - 38,
        "head": 301 - 247,
    }
    assert s["phases"]["head"]["after_down_us"] == 310 - 247
    assert s["us_a_program_head"] == {
        "phase_wait": 2,
        "rms_norm": 1,
        "head_inputs": 2,
        "weights_wait": 2,
        "tile": 2,
    }
    per = s["us_a_program_a_layer"]  # the head's ranges apart
    assert per["tile"] == pytest.approx(11 / 3) and per["rms_norm"] == 2
    # Each run's signal fills its store_signal range: nothing of that left as its own.
    assert per["signal"] == pytest.approx(11 / 3) and per["store_signal"] == 0
    assert per["attention"] == pytest.approx(2 * (5 - 2) / 3)  # its wait and inputs taken out
    assert per["phase_wait"] == pytest.approx((4 + 7 + 7) / 3)  # program 2: no o_proj
    # A program's counter off by a constant and drifting by layer: lined up again.
    drifted = json.loads(json.dumps(trace))
    for e in drifted["traceEvents"]:
        if e["tid"] == 2:
            e["ts"] += 7.25 + 0.5 * (e["ts"] // 100)
    again = decoder_trace.summarize(drifted, clock_mhz=1000.0)
    assert again["phases"] == s["phases"] and again["layer_period_us"] == 100.0
    # At twice the clock every time halves.
    assert decoder_trace.summarize(trace, 2000.0)["layer_period_us"] == 50.0
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    png = tmp_path / "layer.png"
    out = subprocess.run(
        [
            sys.executable,
            "bench/decoder_trace.py",
            str(path),
            "--clock-mhz",
            "1000",
            "--plot",
            str(png),
        ],
        cwd=_repo(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "a layer every 100.00 µs" in out and png.stat().st_size > 0


def test_decoder_trace_gaps_and_critical_path():
    """Between ranges: a q/k/v run's signal to its program's attention item, 4 units every time;
    the item to its o_proj wait, 5 - c for programs 0 and 1 (median 4.5). Each link's last
    program in layer 1, from the layer's q/k/v wait end (101): program 2's q/k/v ends at 108,
    program 1's item at 116 and o_proj at 126, program 2's gate/up at 138 and down at 147; an
    item's ranges kept apart from its program's q/k/v run."""
    from bench import decoder_trace

    trace = _decoder_trace(layers=3, programs=3, no_o_proj=2)
    s = decoder_trace.summarize(trace, clock_mhz=1000.0)
    assert s["gaps_us"]["store_signal -> attention"] == 4
    assert s["gaps_us"]["attention -> phase_wait"] == 4.5
    assert s["gaps_us"]["tile -> store_signal"] == 0
    links = decoder_trace.critical_path(trace, 1, clock_mhz=1000.0)
    ends = {x["link"]: (x["program"], x["end_us"]) for x in links}
    assert ends == {
        "qkv": (2, 7),
        "attention": (1, 15),
        "o_proj": (1, 25),
        "gate_up": (2, 37),
        "down": (2, 46),
    }
    item = next(x for x in links if x["link"] == "attention")["ranges"]
    assert [r[0] for r in item] == ["attention", "attention_wait", "attention_inputs"]
    qkv = next(x for x in links if x["link"] == "qkv")["ranges"]
    assert not any(r[0].startswith("attention") for r in qkv)


def test_decoder_trace_reads_the_kernels_range_names():
    """Each range name the trace reader keys on is a named range of the kernel (a range renamed
    on one side alone would drop its phase from every profile without an error)."""
    import inspect

    from bench import decoder_trace
    from pallas_kernels import decoder_step

    source = inspect.getsource(decoder_step)
    names = [*decoder_trace.INPUTS, "norm_inputs", "phase_wait", "rms_norm", "store_signal"]
    names += ["attention", "attention_wait", "signal"]
    for name in names:
        assert f'named_scope("{name}")' in source, name


def test_decoder_trace_from_the_profilers_raw_buffer():
    """The profiler's raw words (start ns, SM, words used, then (tag, 32-bit cycle counter)
    pairs) read back as events: names by their ids, ends by the tag's top bit, cycles from the
    trace's first stamp across the counter's wrap, the start in cycles at the clock given."""
    from bench import decoder_trace

    names = {"tile": 0, "phase_wait": 1}
    end, words = 1 << 31, 3 + 8 + 2  # two unused words at the end
    near_wrap = 2**32 - 500
    rows = [
        [1000, 7, 8, 1, near_wrap, 1 | end, near_wrap + 300, 0, 200, 0 | end, 900, 0, 0],
        [1002, 9, 4, 0, 50, 0 | end, 80, 0, 0, 0, 0, 0, 0],
    ]
    buffer = np.asarray(rows, np.uint32).reshape(-1)
    trace = decoder_trace.trace_from_buffer(buffer, names, words, clock_mhz=2000.0)
    got = [(e["tid"], e["pid"], e["name"], e["ph"], e["ts"]) for e in trace["traceEvents"]]
    # ts in thousands of cycles: 1,000 ns at 2 GHz is 2,000 cycles
    assert got == [
        (1, 8, "phase_wait", "B", 2.0),
        (1, 8, "phase_wait", "E", 2.3),
        (1, 8, "tile", "B", 2.7),  # 200 after the wrap: 500 + 200 cycles from the first stamp
        (1, 8, "tile", "E", 3.4),
        (2, 10, "tile", "B", 2.004),
        (2, 10, "tile", "E", 2.034),
    ]
    rs = decoder_trace.ranges(trace)
    assert [r[0] for r in rs[0]] == ["phase_wait", "tile"] and len(rs[1]) == 1
