"""bench/benchmark_serving.py: its arithmetic by hand, then whole runs against an in-process
server (uvicorn in a thread, as tests/test_server.py) with Poisson and all-at-once arrivals, a
jsonl dataset, the --in-process comparison and --launch; each run's JSON is checked against
figures computed here from its own per-request records."""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np
import pytest

from bench import benchmark_serving as bs
from bench import compare_servers as cs
from bench.serving.flags import build_parser, percentile_list, request_rate, slo
from bench.serving.http_client import Clients, _StreamReader
from bench.serving.launch import LaunchedServer, server_argv
from bench.serving.records import Record, even_counts, summarize, token_itls
from bench.serving.report import format_table
from bench.serving.workload import Sample, arrival_offsets, random_dataset, uniform_lengths
from rosejax import LLM
from rosejax.engine_args import engine_kwargs
from rosejax.serve import cli as serve_cli
from rosejax.serve import create_app
from tests.test_server import ServerThread

# One small engine for every run: prompts of 4-7 tokens stay in one prefill length bucket, a
# fixed decode window and at most 4 rows keep the decode programs few: little is compiled.
ENGINE_FLAGS = [
    "--model",
    "random:tiny",
    "--max-batch-size",
    "4",
    "--block-size",
    "16",
    "--kv-cache-tokens",
    "512",
    "--no-warmup",
    "--decode-steps",
    "4",
    "--seed",
    "3",
]
WORKLOAD = ["--input-len", "6", "--output-len", "6", "--range-ratio", "0.4", "--num-prompts", "6"]
QUIET = ["--no-progress", "--warmup-runs", "0"]

# ------------------------------------------------------------------------------ arithmetic


def test_even_counts_and_token_itls():
    assert even_counts(8, 3) == [1, 3, 4] and sum(even_counts(10, 4)) == 10
    assert even_counts(5, 1) == [5] and even_counts(1, 2) == [1, 0] and even_counts(0, 0) == []
    # events at 1.0 (2 tokens), 1.4 (4 tokens), 1.5 (none), 2.1 (1 token)
    itl = token_itls([1.0, 1.4, 1.5, 2.1], [2, 4, 0, 1])
    assert itl == pytest.approx([0.0, 0.1, 0.1, 0.1, 0.1, 0.7])
    assert len(itl) == 2 + 4 + 1 - 1 and token_itls([], []) == []


def test_arrivals_lengths_and_flag_types():
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    a = arrival_offsets(4000, 50.0, 1.0, 7)
    assert a == arrival_offsets(4000, 50.0, 1.0, 7) and a[0] == 0.0
    gaps = np.diff(a)
    assert (gaps > 0).all() and np.mean(gaps) == pytest.approx(1 / 50, rel=0.06)
    assert np.std(gaps) == pytest.approx(1 / 50, rel=0.1)  # exponential: std = mean
    even = np.diff(arrival_offsets(4000, 50.0, 16.0, 7))  # gamma shape 16: std = mean / 4
    assert np.mean(even) == pytest.approx(1 / 50, rel=0.05) and np.std(even) < 0.4 / 50
    lens = uniform_lengths(10, 0.5, 2000, np.random.default_rng(0))
    assert min(lens) == 5 and max(lens) == 15
    assert uniform_lengths(7, 0.0, 5, np.random.default_rng(0)) == [7] * 5
    assert percentile_list("99,90") == [50.0, 90.0, 99.0]
    assert slo("tpot:2.5") == ("tpot", 2.5)
    for bad in ("x:1", "ttft", "ttft:-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            slo(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        request_rate("0")
    assert request_rate("inf") == math.inf


def test_launch_passes_the_engine_flags_through():
    extra = ["--kernel", "attention=xla", "--kernel-tile", "linear.num_warps=2"]
    extra += ["--decode-steps", "4", "--no-prefix-cache", "--dtype", "float32"]
    extra += ["--no-prefill-overlap"]
    args = build_parser(bs.__doc__).parse_args([*ENGINE_FLAGS, *extra])
    served = serve_cli.build_parser().parse_args(server_argv(args))
    assert engine_kwargs(served) == engine_kwargs(args)
    assert engine_kwargs(served)["prefill_overlap"] is False
    assert (served.model, served.seed) == ("random:tiny", 3)


def _record(i, sent, events, tokens, end, counts=None):
    return Record(i, tokens, sent, 4, sent, events, counts, tokens, end)


def test_summarize_by_hand():
    recs = [
        _record(0, 0.0, [0.1, 0.3], 5, 0.35),  # ttft 100, tpot 62.5, e2el 350 ms
        _record(1, 0.1, [0.3, 0.4, 0.5], 3, 0.5, [1, 1, 1]),  # ttft 200, tpot 100, e2el 400
        _record(2, 0.2, [0.25], 1, 0.3),  # one token: ttft 50, tpot None (0 for goodput)
        Record(3, 4, 0.0, error="HTTP 500: boom"),
    ]
    s = summarize(recs, 0.5, [50.0, 90.0], {"ttft": 150.0, "tpot": 80.0})
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (3, 1, 9)
    assert s["total_input_tokens"] == 12 and s["output_throughput"] == pytest.approx(18.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0) and s["ttft_ms"]["max"] == pytest.approx(200)
    assert s["tpot_ms"]["n"] == 2 and s["tpot_ms"]["mean"] == pytest.approx(81.25)
    # record 0: counts [1, 4] -> 4 x 50 ms; record 1: 2 x 100 ms
    assert s["itl_ms"]["n"] == 6 and s["itl_ms"]["mean"] == pytest.approx(200 / 3)
    assert s["event_gap_ms"]["n"] == 3 and s["tokens_per_event"] == pytest.approx(9 / 6)
    assert s["goodput"]["good_requests"] == 2  # record 1 misses both SLOs
    assert s["goodput"]["request_goodput"] == pytest.approx(4.0)
    assert s["errors"] == ["HTTP 500: boom"] and s["itl_token_counts"] == "even_spread"
    table = format_table({"HTTP": s, "in-process": s}, [50.0, 90.0])
    assert "Median TTFT (ms):" in table and "P90 ITL (ms):" in table and "1.000" in table


def test_a_client_meant_to_leave_counts_as_completed_when_its_stream_ends_first():
    left = _record(0, 0.0, [0.1, 0.2, 0.3], 3, None)
    left.disconnect_after = 3
    short = _record(1, 0.0, [0.1, 0.2], 4, 0.25)  # its 4 tokens came in 2 events: never left
    short.disconnect_after = 3
    s = summarize([left, short], 0.5, [50.0], {})
    assert (s["completed"], s["disconnected"], s["failed"]) == (1, 1, 0)
    assert s["total_output_tokens"] == 4  # the completed one; a client that left has no usage


def test_stream_reader_with_continuous_usage():
    """Every chunk that brings tokens is an event, with text or without (a character's first
    bytes); one that brings none (the finish alone) is not."""
    rec = Record(0, 4, 0.0, sent_s=0.0)
    reader = _StreamReader(rec)

    def chunk(text, total):
        usage = {"prompt_tokens": 3, "completion_tokens": total}
        return ("data: " + json.dumps({"choices": [{"text": text}], "usage": usage})).encode()

    lines = [chunk("a", 1), chunk("", 2), chunk("bc", 4), chunk("", 4), b"", b"data: [DONE]"]
    for t, line in enumerate(lines):
        reader.line(line, 0.1 * (t + 1))
    reader.finish()
    assert rec.event_s == pytest.approx([0.1, 0.2, 0.3]) and rec.event_tokens == [1, 1, 2]
    assert rec.output_tokens == 4 and rec.error is None  # no final usage: the streamed count
    cut = Record(1, 4, 0.0, sent_s=0.0)
    reader = _StreamReader(cut)
    reader.line(b'data: {"choices": [{"text": "x"}]}', 0.1)
    reader.finish()
    assert not cut.ok and "DONE" in cut.error
    silent = Record(2, 4, 0.0, sent_s=0.0)
    reader = _StreamReader(silent)
    reader.line(b'data: {"choices": [], "usage": {"completion_tokens": 0}}', 0.1)
    reader.line(b"data: [DONE]", 0.2)
    reader.finish()
    assert not silent.ok and silent.error == "nothing streamed"


# -------------------------------------------------------------------------- whole runs


@pytest.fixture(scope="module")
def server():
    args = build_parser(bs.__doc__).parse_args(ENGINE_FLAGS)
    llm = LLM(args.model, seed=args.seed, **engine_kwargs(args))
    with ServerThread(create_app(llm.engine, served_model_name="tiny")) as s:
        yield s.url


def run(tmp_path, *argv: str) -> dict:
    out = tmp_path / "out.json"
    assert bs.main([*argv, *QUIET, "--json", str(out), "--save-detailed"]) == 0
    return json.loads(out.read_text())


def check_run(res: dict, side: str, n: int, percentiles=(50, 90, 99)) -> list[dict]:
    """The JSON's figures of one side against the same figures computed from its records."""
    recs, s = res["requests"][side], res["results"][side]
    assert len(recs) == n and s["completed"] == n and s["failed"] == 0
    assert s["output_len_mismatches"] == 0
    assert [r["output_tokens"] for r in recs] == [r["expected_output_len"] for r in recs]
    assert s["total_output_tokens"] == sum(r["output_tokens"] for r in recs)
    assert s["total_input_tokens"] == sum(r["prompt_len"] for r in recs)
    end = max(r["end_s"] for r in recs)
    assert s["duration_s"] == pytest.approx(end, abs=0.05)
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])
    ttft, tpot, e2el, itl, good = [], [], [], [], 0
    slos = s.get("goodput", {}).get("slo_ms", {})
    for r in recs:
        ev = r["event_s"]
        assert r["scheduled_s"] <= r["sent_s"] + 1e-6 and r["sent_s"] <= ev[0] <= r["end_s"]
        assert ev == sorted(ev)
        ttft.append(ev[0] - r["sent_s"])
        e2el.append(r["end_s"] - r["sent_s"])
        k = r["output_tokens"]
        if k > 1:
            tpot.append((e2el[-1] - ttft[-1]) / (k - 1))
        mine = {"ttft": ttft[-1], "tpot": tpot[-1] if k > 1 else 0.0, "e2el": e2el[-1]}
        good += all(mine[name] * 1e3 <= ms for name, ms in slos.items())
        counts = r["event_tokens"]
        if counts is None:  # HTTP: one token first, the rest spread evenly over the events
            edges = (np.arange(len(ev)) * (k - 1)) // (len(ev) - 1)
            counts = [1, *np.diff(edges).tolist()]
        assert sum(counts) == k
        itl += [g / c for g, c in zip(np.diff(ev), counts[1:], strict=True) for _ in range(c)]
    for name, values in [("ttft_ms", ttft), ("tpot_ms", tpot), ("e2el_ms", e2el), ("itl_ms", itl)]:
        got = s[name]
        assert got["n"] == len(values)
        want = np.percentile(np.asarray(values) * 1e3, percentiles)
        assert [got[f"p{p}"] for p in percentiles] == pytest.approx(want), name
        assert got["mean"] == pytest.approx(np.mean(values) * 1e3)
        stats = [got[f"p{p}"] for p in percentiles] + [got["max"]]
        assert stats == sorted(stats), name
    if slos:
        assert s["goodput"]["good_requests"] == good
        assert s["goodput"]["request_goodput"] == pytest.approx(good / s["duration_s"])
    return recs


def test_poisson_run_against_its_records(server, tmp_path):
    res = run(
        tmp_path,
        "--base-url",
        server,
        *WORKLOAD,
        "--request-rate",
        "30",
        "--seed",
        "5",
        "--goodput",
        "ttft:40",
        "tpot:20",
        "e2el:300",
        "--client-processes",  # requests 0, 2, 4 in one, 1, 3, 5 in the other, on one clock
        "2",
        "--client-nice",
        "1",
    )
    recs = check_run(res, "http", 6)
    assert res["config"]["model"] == "tiny" and res["results"]["http"]["goodput"]["slo_ms"] == {
        "ttft": 40.0,
        "tpot": 20.0,
        "e2el": 300.0,
    }
    assert [r["scheduled_s"] for r in recs] == pytest.approx(arrival_offsets(6, 30.0, 1.0, 5))
    # The engine's counters over the timed run: 6 short prompts in 1-6 prefills, none preempted.
    assert 1 <= res["results"]["http"]["prefill_steps"] <= 6
    assert res["results"]["http"]["preemptions"] == 0
    # and the server's TTFT in its parts: each >= 0, within the server's TTFT, which is within
    # the clients' (theirs adds the way in and out of the sockets)
    http = res["results"]["http"]
    parts = [http[k] for k in ("dispatch_ms", "queue_ms", "prefill_ms")]
    assert min(parts) >= 0 and sum(parts) <= http["server_ttft_ms"] <= http["ttft_ms"]["mean"]
    assert http["back_ms"] == pytest.approx(http["server_ttft_ms"] - sum(parts))
    args = build_parser(bs.__doc__).parse_args([*WORKLOAD, "--seed", "5"])
    want = [len(s.prompt) for s in random_dataset(args, 5)]
    assert [r["prompt_len"] for r in recs] == want  # the server's usage agrees


def test_client_nice_runs_even_one_client_in_a_process_of_that_niceness():
    args = build_parser(bs.__doc__).parse_args(
        [*WORKLOAD, "--client-processes", "1", "--client-nice", "3"]
    )
    with Clients(args, "http://127.0.0.1:1", "tiny", "httpx") as clients:
        assert clients.pool is not None
        assert clients.pool.submit(os.nice, 0).result() == os.nice(0) + 3
    with pytest.raises(SystemExit):
        build_parser(bs.__doc__).parse_args([*WORKLOAD, "--client-nice", "20"])


def _have(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


@pytest.mark.parametrize(
    "client",
    [
        "httpx",
        pytest.param(
            "aiohttp", marks=pytest.mark.skipif(not _have("aiohttp"), reason="no aiohttp")
        ),
    ],
)
def test_all_at_once_jsonl_with_a_concurrency_cap(server, tmp_path, client):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "the quick brown fox", "output_len": 5},
        {"prompt": [11, 22, 33, 44, 55]},
        {"prompt": "over the lazy river", "output_len": 3},
        {"prompt": [7, 8, 9], "output_len": 4},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    res = run(
        tmp_path,
        "--base-url",
        server,
        "--dataset",
        "jsonl",
        "--dataset-path",
        str(path),
        "--output-len",
        "6",
        "--max-concurrency",
        "2",
        "--percentiles",
        "90",
        "--client",
        client,
        "--client-processes",  # one request in flight each
        "2",
    )
    assert res["config"]["client"].startswith(client)
    recs = check_run(res, "http", 4, percentiles=(50, 90))
    assert [r["expected_output_len"] for r in recs] == [5, 6, 3, 4]
    assert all(r["scheduled_s"] == 0 for r in recs)
    for r in recs:  # never more than 2 in flight
        busy = sum(o["sent_s"] <= r["sent_s"] < o["end_s"] for o in recs)
        assert busy <= 2


def test_requests_past_their_timeout_fail_and_the_run_says_so(server, tmp_path, capsys):
    out = tmp_path / "out.json"
    argv = ["--base-url", server, *WORKLOAD, *QUIET, "--request-timeout", "0.001"]
    assert bs.main([*argv, "--json", str(out)]) == 1  # nothing completed
    s = json.loads(out.read_text())["results"]["http"]
    assert (s["completed"], s["failed"]) == (0, 6) and s["ttft_ms"]["p50"] is None
    assert s["errors"] == ["timed out after 0.001 s"] and "timed out" in capsys.readouterr().out


def test_in_process_comparison_and_plots(server, tmp_path):
    res = run(
        tmp_path,
        "--base-url",
        server,
        *ENGINE_FLAGS,
        *WORKLOAD,
        "--max-concurrency",
        "3",
        "--in-process",
        "--plot",
        str(tmp_path / "p.png"),
    )
    http = check_run(res, "http", 6)
    local = check_run(res, "in_process", 6)
    assert [r["prompt_len"] for r in local] == [r["prompt_len"] for r in http]
    assert all(r["event_tokens"] is not None for r in local)
    assert res["results"]["in_process"]["itl_token_counts"] == "exact"
    for recs in (http, local):  # the cap holds on both sides
        assert max(sum(o["sent_s"] <= r["sent_s"] < o["end_s"] for o in recs) for r in recs) <= 3
    cmp, h, i = res["comparison"], res["results"]["http"], res["results"]["in_process"]
    assert cmp["output_throughput_ratio"] == pytest.approx(
        h["output_throughput"] / i["output_throughput"]
    )
    assert cmp["ttft_p50_ratio"] == pytest.approx(h["ttft_ms"]["p50"] / i["ttft_ms"]["p50"])
    assert res["environment"]["backend"] == "cpu"
    assert (tmp_path / "p.png").stat().st_size > 0 and (tmp_path / "p.timeline.png").exists()


@pytest.mark.slow  # a server process starting and compiling: ~6 s of CPU
def test_launch_runs_and_stops_a_server(tmp_path):
    log = tmp_path / "server.log"
    res = run(
        tmp_path,
        "--launch",
        *ENGINE_FLAGS,
        "--num-prompts",
        "2",
        "--input-len",
        "4",
        "--output-len",
        "3",
        "--served-model-name",
        "tiny-launched",
        "--server-log",
        str(log),
    )
    check_run(res, "http", 2)
    assert res["config"]["model"] == "tiny-launched" and res["config"]["launched"]
    assert res["config"]["base_url"].startswith("http://127.0.0.1:")


def test_the_floor_server_streams_each_request_as_a_decode_loop_of_its_tpot(tmp_path):
    """bench/serving/floor_server.py, launched as compare_servers' --floor does: every request
    gets its max_tokens, the first alone and the rest in windows of 32, the last no sooner than
    (max_tokens - 1) x TPOT after the request; the stop it is asked for exits 0."""
    rng = np.random.default_rng()
    tpot_ms, output_len = float(rng.uniform(1.0, 3.0)), int(rng.integers(34, 100))
    launch = build_parser(bs.__doc__).parse_args(["--launch", "--launch-timeout", "60"])
    with LaunchedServer(launch, floor_tpot_ms=tpot_ms) as floor:
        assert floor.cmd[2] == "bench.serving.floor_server"
        workload = ["--input-len", "5", "--output-len", str(output_len), "--num-prompts", "5"]
        res = run(tmp_path, "--base-url", floor.url, *workload, "--client-processes", "1")
        assert floor.stop() == 0
    for r in check_run(res, "http", 5):
        assert len(r["event_s"]) == 1 + math.ceil((output_len - 1) / 32)
        # From the send: the server's clock starts after it, and the first event's delivery may
        # lag the last one's by more than a millisecond on a loaded machine.
        assert r["event_s"][-1] - r["sent_s"] >= (output_len - 1) * tpot_ms / 1e3


def test_compare_servers_variants_and_their_order():
    a, b, c = (cs.variant(t) for t in ("a=", "b=--open-decode-steps 4", "c=--x=1 --y"))
    assert (b.name, b.flags, c.flags) == ("b", "--open-decode-steps 4", "--x=1 --y")
    assert a.env == b.env == c.env == {}
    d = cs.variant("d=XLA_FLAGS='--f=1 --g=2' A_1= --x=1 B=2")  # only leading words are env
    assert (d.env, d.flags) == ({"XLA_FLAGS": "--f=1 --g=2", "A_1": ""}, "--x=1 B=2")
    for bad in ("noequals", "=flags", "two words=x", "e=A='unclosed"):
        with pytest.raises(argparse.ArgumentTypeError):
            cs.variant(bad)
    order = cs.run_order([a, b, c], 3)
    assert [(r, v.name) for r, v in order] == [
        (0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"), (2, "a"), (2, "b"), (2, "c"),
    ]  # fmt: skip


def test_compare_servers_gives_every_side_one_kv_budget():
    rng = np.random.default_rng()
    samples = [Sample([1] * int(rng.integers(1, 50)), int(rng.integers(1, 50))) for _ in range(9)]
    longest = max(len(s.prompt) + s.output_len for s in samples)
    args = argparse.Namespace(kv_cache_tokens=None, kv_cache_memory_fraction=None, max_batch_size=4)
    assert cs.shared_kv_tokens(args, samples) == 2 * 4 * longest  # 4 of the 9 at once
    args.max_batch_size = 64
    assert cs.shared_kv_tokens(args, samples) == 2 * 9 * longest
    given = argparse.Namespace(**vars(args) | {"kv_cache_tokens": 777})
    assert cs.shared_kv_tokens(given, samples) == 777
    fraction = argparse.Namespace(**vars(args) | {"kv_cache_memory_fraction": 0.5})
    assert cs.shared_kv_tokens(fraction, samples) is None  # the servers size it from that
    assert cs.shared_kv_tokens(args, [*samples, Sample("text", 8)]) is None


@pytest.mark.slow  # two server processes starting and compiling: ~10 s of CPU
def test_compare_servers_runs_each_variant_each_round(tmp_path):
    out = tmp_path / "cmp.json"
    argv = [*ENGINE_FLAGS, *WORKLOAD, *QUIET, "--rounds", "2", "--in-process"]
    argv += ["--variant", "plain=", "--json", str(out)]
    dump = tmp_path / "dump"  # where that server's XLA writes what it compiles, if it has the env
    argv += ["--variant", f"open2=XLA_FLAGS='--xla_dump_to={dump}' --open-decode-steps 2"]
    assert cs.main([*argv, "--floor", "1"]) == 0
    res = json.loads(out.read_text())
    floor = res["variants"]["floor"]
    assert floor["server_cmd"][2] == "bench.serving.floor_server"
    assert len(floor["runs"]) == 2 and all(s["completed"] == 6 for s in floor["runs"])
    with pytest.raises(SystemExit):  # a variant of that name beside --floor
        cs.main([*argv, "--variant", "floor=", "--floor", "1"])
    plain, open2 = res["variants"]["plain"], res["variants"]["open2"]
    assert plain["server_cmd"][-2:] == ["--max-waiting", "-1"]  # --server-args's default
    assert open2["server_cmd"][-2:] == ["--open-decode-steps", "2"]
    assert open2["env"] == {"XLA_FLAGS": f"--xla_dump_to={dump}"} and plain["env"] == {}
    assert any(dump.iterdir())
    for v in (plain, open2):
        assert len(v["runs"]) == 2 and all(s["completed"] == 6 for s in v["runs"])
        tps = sorted(s["output_throughput"] for s in v["runs"])
        assert v["median"]["output_throughput"] == pytest.approx((tps[0] + tps[1]) / 2)
        assert v["median"]["ttft_p50"] > 0 and v["start_seconds"] > 0
    local = res["in_process"]
    assert len(local["runs"]) == 2 and all(s["completed"] == 6 for s in local["runs"])
    tps = sorted(s["output_throughput"] for s in local["runs"])
    assert local["median"]["output_throughput"] == pytest.approx((tps[0] + tps[1]) / 2)
