"""`python -m rosejax.serve --api-server-count 2` in a subprocess: concurrent streamed and whole
completions equal to the engine's own greedy outputs, served by both API server processes (the
engine process counts each one's requests); every scrape, whichever process answers it, reports
the whole server's request counters and histograms, a killed API server's share included; a
client leaving mid-stream frees its KV blocks; an API server killed is logged while the other
serves on; SIGINT to the main process stops the whole tree. The engine process's pipe per API
server is tested in process in tests/test_engine_process.py; the metrics' sums in
tests/test_metrics.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from rosejax import LLM, SamplingParams
from tests.test_engine_process import ENGINE, MODEL, PROMPTS, _children, complete
from tests.test_server import SEED, metrics, start_cli, stop_cli, wait_idle

GREEDY = dict(max_tokens=8, temperature=0.0)
TEXTS = [p for p in PROMPTS if isinstance(p, str)]


def _streamed(url: str, prompt: str) -> tuple[str, int]:
    """The text and completion tokens of a streamed completion."""
    body = {"prompt": prompt, "stream": True, "model": "tiny", **GREEDY}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    chunks = [json.loads(line) for line in lines[:-1]]
    assert chunks[-1]["choices"] == [], chunks[-1]  # the usage chunk
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    return text, chunks[-1]["usage"]["completion_tokens"]


def _whole(url: str, prompt: str) -> tuple[str, int]:
    """The text and completion tokens of a whole completion."""
    r = complete(url, prompt, model="tiny", **GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]


def _check_totals(url: str, requests: int, tokens: int, invalid: int, aborted: int) -> None:
    """Several scrapes, each on a connection of its own (so either process answers): every
    one reports the whole server's totals."""
    for _ in range(8):
        m = metrics(url)
        finished = {k: v for k, v in m.items() if k.startswith("rosejax_requests_finished_total")}
        got = (
            sum(finished.values()),
            m.get("rosejax_requests_finished_total{reason=abort}", 0),
            m["rosejax_time_to_first_token_seconds_count"],
            m["rosejax_request_latency_seconds_count"],  # an aborted request has none
            m["rosejax_generation_tokens_total"],
            m.get("rosejax_requests_rejected_total{reason=invalid}", 0),
        )
        assert got == (requests, aborted, requests, requests - aborted, tokens, invalid), m


def _served_by(url: str) -> list[float]:
    m = metrics(url)
    return [m.get(f"rosejax_api_server_requests_total{{api_server={i}}}", 0) for i in (0, 1)]


def _metrics_dir(pid: int) -> str:
    """The directory whose metrics files process `pid` has mapped (multiprocess mode)."""
    with open(f"/proc/{pid}/maps") as f:
        dirs = {os.path.dirname(line.split()[-1]) for line in f if line.rstrip().endswith(".db")}
    assert len(dirs) == 1, dirs
    return dirs.pop()


def _api_server_pid(port: int, pids: set[int]) -> int:
    """Which of `pids` (the main process's children) holds the listening socket on `port`."""
    inodes = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    holders = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in fds}
        except OSError:  # gone, or an fd closed meanwhile
            continue
        if links & inodes:
            holders.append(pid)
    assert len(holders) == 1, (holders, inodes)
    return holders[0]


@pytest.mark.slow  # a server subprocess, its API server process and its engine process
def test_two_api_servers_serve_alike_free_blocks_and_stop_on_sigint(tmp_path):
    proc, url, log = start_cli(tmp_path, "--api-server-count", "2")
    try:
        llm = LLM(MODEL, **{**ENGINE, "max_batch_size": 2, "kv_cache_tokens": 1120})
        want = {
            p: o.text
            for p, o in zip(
                TEXTS, llm.generate(TEXTS, SamplingParams(**GREEDY), use_tqdm=False), strict=True
            )
        }
        # Many at once, each on a connection of its own: whichever process accepts it serves it.
        jobs = [(f, p) for p in TEXTS for f in (_streamed, _whole)] * 3
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda job: job[0](url, job[1]), jobs))
        assert [text for text, _ in got] == [want[p] for _, p in jobs], f"seed {SEED}"
        tokens = sum(n for _, n in got)
        served = _served_by(url)
        for _ in range(40):  # one process may have won every accept of that burst
            if min(served) > 0:
                break
            text, n = _whole(url, TEXTS[0])
            assert text == want[TEXTS[0]]
            tokens += n
            served = _served_by(url)
        requests = int(sum(served))
        assert min(served) > 0 and requests >= len(jobs), served
        # Refusals, each counted once by whichever process refused it.
        bad = {"model": "tiny", "prompt": "hi", "temperature": -1}
        with ThreadPoolExecutor(6) as pool:
            codes = list(pool.map(lambda _: complete(url, **bad).status_code, range(6)))
        assert codes == [400] * 6, codes
        _check_totals(url, requests, tokens, invalid=6, aborted=0)

        # A client leaving mid-stream: its request is aborted (ends long before it would).
        body = {"prompt": "the river", "max_tokens": 100, "ignore_eos": True, "temperature": 0}
        start = time.monotonic()
        assert complete(url, **body).status_code == 200
        whole = time.monotonic() - start
        with httpx.stream(
            "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
            start = time.monotonic()
        m = wait_idle(url)
        freed = time.monotonic() - start
        assert m["rosejax_kv_blocks_used"] == 0 and m["rosejax_requests_running"] == 0
        assert freed < whole / 2, (freed, whole)

        # An API server process killed: logged, and the main process serves on alone.
        children = _children(proc.pid)
        metrics_dir = _metrics_dir(proc.pid)
        port = int(url.rsplit(":", 1)[1])
        api_server = _api_server_pid(port, children)
        os.kill(api_server, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{api_server}/stat") and time.monotonic() < deadline:
            with open(f"/proc/{api_server}/stat") as f:
                if f.read().split()[2] == "Z":  # ended, not yet reaped
                    break
            time.sleep(0.05)
        for p in TEXTS:
            text, n = _whole(url, p)
            assert text == want[p]
            tokens += n
        assert httpx.get(url + "/health").status_code == 200
        # The killed API server's share still counted, once; the two above besides (100 tokens,
        # and the one aborted after its first tokens: its tokens are the server's to count).
        m = metrics(url)
        cut = m["rosejax_generation_tokens_total"] - tokens - 100
        assert 1 <= cut < 100, (cut, m)
        _check_totals(url, requests + 2 + len(TEXTS), tokens + 100 + cut, invalid=6, aborted=1)
    except BaseException:
        proc.kill()
        raise
    start = time.monotonic()
    stop_cli(proc, log, signal.SIGINT)  # to the main process only: it stops the others
    assert time.monotonic() - start < 10
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in children):
        assert time.monotonic() < deadline, f"left behind: {children}"
        time.sleep(0.1)
    assert not os.path.exists(metrics_dir), metrics_dir  # removed at the stop
    log_text = (tmp_path / "server.log").read_text()
    assert "exited with code -9; the others serve on" in log_text, log_text


@pytest.mark.slow  # a server subprocess with two engine processes and two API servers
def test_two_api_servers_in_front_of_two_replicas(tmp_path, monkeypatch):
    """Data parallelism behind several API servers: every answer is the engine's own, and each
    API server's requests reach both replicas (the engine processes count them)."""
    flags = os.environ.get("XLA_FLAGS", "")
    monkeypatch.setenv("XLA_FLAGS", f"{flags} --xla_force_host_platform_device_count=4")
    proc, url, log = start_cli(tmp_path, "--api-server-count", "2", "--data-parallel-size", "2")
    try:
        llm = LLM(MODEL, **{**ENGINE, "max_batch_size": 2, "kv_cache_tokens": 1120})
        outs = llm.generate(TEXTS, SamplingParams(**GREEDY), use_tqdm=False)
        want = {p: o.text for p, o in zip(TEXTS, outs, strict=True)}
        jobs = [(f, p) for p in TEXTS for f in (_streamed, _whole)] * 4
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda job: job[0](url, job[1]), jobs))
        assert [text for text, _ in got] == [want[p] for _, p in jobs], f"seed {SEED}"
        served = metrics(url, per_replica=True)
        counts = {
            (a, r): served.get(f"rosejax_api_server_requests_total{{api_server={a},replica={r}}}")
            for a in (0, 1)
            for r in (0, 1)
        }
        assert all(c is not None for c in counts.values()), counts
        assert sum(counts.values()) == len(jobs), counts
        for r in (0, 1):  # the router spreads the load over both replicas
            assert counts[(0, r)] + counts[(1, r)] > 0, counts
    except BaseException:
        proc.kill()
        raise
    stop_cli(proc, log, signal.SIGINT)


def test_api_server_count_needs_engine_processes(capsys):
    from rosejax.serve.cli import main

    assert main(["--model", MODEL, "--api-server-count", "2", "--no-engine-process"]) == 2
    assert "drop --no-engine-process" in capsys.readouterr().err
    assert main(["--model", MODEL, "--api-server-count", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("cores", "replicas", "engine_process", "expected"),
    [(16, 1, None, 4), (16, 2, None, 4), (32, 2, None, 8), (64, 1, True, 4), (2, 1, None, 1)]
    + [(32, 2, False, 1)],
)
def test_default_api_server_count_follows_replicas_and_cores(
    monkeypatch, cores, replicas, engine_process, expected
):
    from rosejax.serve import cli

    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert cli.default_api_server_count(replicas, engine_process) == expected


def test_api_servers_start_serving_together(caplog):
    """`ReadyTogether`: a built API server waits until every one is built (no connection then
    meets one still loading); a stop ends the wait, and a peer that never comes is waited for
    only up to the timeout (logged), after which it serves alone."""
    import multiprocessing

    from rosejax.serve.api_servers import ReadyTogether

    ctx = multiprocessing.get_context("spawn")
    together = ReadyTogether(ctx, 3)
    with ThreadPoolExecutor(2) as pool:
        first = [pool.submit(together.arrive_and_wait, lambda: False) for _ in range(2)]
        time.sleep(0.3)
        assert not any(f.done() for f in first)  # two of three built: both still wait
        assert together.arrive_and_wait(lambda: False)
        assert all(f.result(timeout=5) for f in first)

    alone = ReadyTogether(ctx, 2)
    start = time.monotonic()
    assert not alone.arrive_and_wait(lambda: time.monotonic() - start > 0.2)  # a stop came
    assert time.monotonic() - start < 2
    with caplog.at_level("WARNING", logger="rosejax.serve"):
        assert not ReadyTogether(ctx, 2).arrive_and_wait(lambda: False, timeout=0.2)
    assert "1 of 2 API servers ready" in caplog.text
