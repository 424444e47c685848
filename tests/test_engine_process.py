"""The server with its engine in a child process (`--engine-process`): the same texts as the
engine answers in process (greedy and seeded sampled, whole and streamed), bad requests refused
in the API process with a 4xx, a client gone freeing its request's KV blocks in the child, a
child killed mid-request failing its requests with a 500 and /health with a 503, and no child
left once the server stops. The command line (signals) runs in a subprocess, behind
`@pytest.mark.slow`; data parallel replicas in processes are in tests/data_parallel_checks.py.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import threading
import time

import httpx
import pytest

from rosejax import LLM, SamplingParams
from rosejax.serve import create_app
from rosejax.serve.engine_process import EngineProcesses
from rosejax.serve.server import ServerThread
from rosejax.settings import EngineConfig
from tests.test_server import SEED, start_cli, stop_cli, wait_idle

MODEL = "random:tiny"
ENGINE = dict(seed=SEED, warmup=False, max_batch_size=8, block_size=16, kv_cache_tokens=1024)
WORDS = "the a of cat dog runs quickly over lazy river mountain blue green light time".split()
_rng = random.Random(SEED)
PROMPTS = [" ".join(_rng.choices(WORDS, k=_rng.randint(2, 8))) for _ in range(4)]
PROMPTS.append([_rng.randrange(50257) for _ in range(_rng.randint(1, 12))])
GREEDY = dict(max_tokens=12, temperature=0.0)
SAMPLED = dict(max_tokens=10, temperature=0.9, top_p=0.9, seed=_rng.randrange(2**31))


@pytest.fixture(scope="module")
def served():
    """(base url, the app's replicas, expected greedy and sampled outputs of PROMPTS)."""
    llm = LLM(MODEL, **ENGINE)
    expected = {
        name: llm.generate(PROMPTS, SamplingParams(**kw), use_tqdm=False)
        for name, kw in (("greedy", GREEDY), ("sampled", SAMPLED))
    }
    app = create_app(EngineProcesses(EngineConfig(model=MODEL, **ENGINE)), served_model_name="t")
    with ServerThread(app) as server:
        yield server.url, app.state.engine.engines, expected
    # The lifespan stopped every child: none is left, and each exited when told to or was killed.
    assert multiprocessing.active_children() == []


def complete(url: str, prompt, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, **kw}, timeout=60)


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_texts_equal_the_engine_in_process(served, name):
    url, _, expected = served
    kw = GREEDY if name == "greedy" else SAMPLED
    r = complete(url, PROMPTS, **kw)
    assert r.status_code == 200, r.text
    got = [(c["text"], c["finish_reason"]) for c in r.json()["choices"]]
    assert got == [(o.text, o.finish_reason) for o in expected[name]], f"seed {SEED}"
    want_tokens = sum(len(o.token_ids) for o in expected[name])
    assert r.json()["usage"]["completion_tokens"] == want_tokens
    # Streamed: the same texts, chunk by chunk.
    texts = [""] * len(PROMPTS)
    body = {"prompt": PROMPTS, "stream": True, **kw}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        for c in json.loads(line)["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [o.text for o in expected[name]], f"seed {SEED}"


def test_bad_requests_are_4xx_and_serving_goes_on(served):
    url, engines, expected = served
    cases = [
        ({"prompt": [1, 2, 99999999]}, "prompt"),  # not a token id
        ({"prompt": "the", "stop_token_ids": [50257]}, "stop_token_ids"),
        ({"prompt": [5] * 129}, "prompt"),  # longer than tiny's 128-token context
        ({"prompt": "the", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "the", "n": 2}, "n"),  # one sequence per request crosses the process yet
        ({"prompt": "the", "logprobs": 1}, "logprobs"),
    ]
    for body, param in cases:
        r = complete(url, **body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    r = complete(url, PROMPTS[0], **GREEDY)
    assert r.json()["choices"][0]["text"] == expected["greedy"][0].text
    assert engines[0].alive


def test_client_gone_mid_stream_frees_its_blocks_in_the_child(served):
    url, _, _ = served
    before = wait_idle(url)
    body = {"prompt": "the river", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        used = httpx.get(url + "/metrics").text
        assert "rosejax_requests_running" in used
    m = wait_idle(url)
    assert m["rosejax_kv_blocks_used"] == 0 and m["rosejax_requests_running"] == 0
    aborts = "rosejax_requests_finished_total{reason=abort}"
    assert m[aborts] == before.get(aborts, 0) + 1
    # Generated far fewer than the 100 tokens asked for: the child stopped it.
    made = m["rosejax_generation_tokens_total"] - before["rosejax_generation_tokens_total"]
    assert 1 <= made < 100, made


# Last of the module: it kills the module server's child.
def test_killed_child_fails_its_requests_with_500_and_health_503(served):
    url, engines, _ = served
    assert httpx.get(url + "/health").status_code == 200
    result: dict = {}

    def long_request() -> None:
        result["r"] = complete(url, "the", max_tokens=120, ignore_eos=True, temperature=0)

    asker = threading.Thread(target=long_request)
    asker.start()
    deadline = time.monotonic() + 30
    while not engines[0].snapshot["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    process = engines[0].child.process
    os.kill(process.pid, signal.SIGKILL)
    asker.join(30)
    r = result["r"]
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "engine_died" and "SIGKILL" in error["message"], error
    assert httpx.get(url + "/health").status_code == 503
    r = complete(url, "the", max_tokens=2)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped", r.text
    assert process.exitcode == -signal.SIGKILL


def _children(pid: int) -> set[int]:
    """Every process below `pid` (Linux /proc)."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in os.listdir(f"/proc/{p}/task"):
            with open(f"/proc/{p}/task/{task}/children") as f:
                kids = {int(k) for k in f.read().split()} - found
            todo += kids
            found |= kids
    return found


@pytest.mark.slow  # a server subprocess and its engine process
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_engine_process_serves_and_stops_its_children(tmp_path, sig):
    proc, url, log = start_cli(tmp_path, "--engine-process")
    try:
        children = _children(proc.pid)
        assert children, "no engine process"
        llm = LLM(MODEL, **{**ENGINE, "max_batch_size": 2, "kv_cache_tokens": 1120})
        want = llm.generate(PROMPTS[0], SamplingParams(**GREEDY), use_tqdm=False)[0].text
        r = complete(url, PROMPTS[0], model="tiny", **GREEDY)
        assert r.json()["choices"][0]["text"] == want, f"seed {SEED}"
        if sig == signal.SIGINT:  # Ctrl-C in a terminal: the whole process group gets it
            for pid in {proc.pid, *children}:
                os.kill(pid, sig)
    except BaseException:
        proc.kill()
        raise
    stop_cli(proc, log, sig, send=sig != signal.SIGINT)
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in children):
        assert time.monotonic() < deadline, f"left behind: {children}"
        time.sleep(0.1)
