"""The server with its engine in a child process (`--engine-process`, the default): the same
texts as the engine answers in process (greedy and seeded sampled, whole and streamed); n > 1,
logprobs, prompt logprobs with echo and chat logprobs answered with the same JSON as the
engine-thread path (`--no-engine-process`); every `RequestOutput` of the engine rebuilt equal
from the rows a child sends; bad requests refused in the API process with a 4xx, a client gone
freeing its request's KV blocks in the child, a child killed mid-request failing its requests
with a 500 and /health with a 503, and no child left once the server stops. The command line
(signals) runs in a subprocess, behind `@pytest.mark.slow`; data parallel replicas in processes
are in tests/data_parallel_checks.py.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import pickle
import queue
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from rosejax import LLM, SamplingParams
from rosejax.engine.output_rows import RowReader, RowWriter
from rosejax.engine.request import RequestMetrics, RequestOutput
from rosejax.engine.serving import take_commands
from rosejax.serve import create_app
from rosejax.serve.engine_process import EngineProcesses
from rosejax.serve.server import ServerThread
from rosejax.settings import EngineConfig
from rosejax.tokenizer import TokenTexts
from tests.test_server import SEED, TEMPLATE, metrics, start_cli, stop_cli, wait_idle

# The module's tests share one served engine: one pytest-xdist worker builds it, not each.
pytestmark = pytest.mark.xdist_group("engine_process")

MODEL = "random:tiny"
ENGINE = dict(seed=SEED, warmup=False, max_batch_size=8, block_size=16, kv_cache_tokens=1024)
WORDS = "the a of cat dog runs quickly over lazy river mountain blue green light time".split()
_rng = random.Random(SEED)
PROMPTS = [" ".join(_rng.choices(WORDS, k=_rng.randint(2, 8))) for _ in range(4)]
PROMPTS.append([_rng.randrange(50257) for _ in range(_rng.randint(1, 12))])
GREEDY = dict(max_tokens=12, temperature=0.0)
SAMPLED = dict(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=_rng.randrange(2**31))
# n = 2 with echo and logprobs (the prompt's logprobs, as lm-eval's loglikelihood sends):
# the module's engine records its outputs step by step (with a stop id that ends one sequence
# at its first token, found then), and both servers answer it with no compile more.
RECORDED = dict(
    prompt=[PROMPTS[1], PROMPTS[4]], n=2, echo=True, logprobs=2, ignore_eos=True, **SAMPLED
)
RECORDED["max_tokens"] = 4
# More requests both paths must answer alike: each compiles programs of its own, so slow.
FEATURES = [
    pytest.param(
        "/v1/completions",
        dict(prompt=PROMPTS[:2], n=2, logprobs=3, stop=["es"], **SAMPLED),
        id="n-logprobs-stop",
    ),
    pytest.param(
        "/v1/completions",
        dict(prompt=[PROMPTS[2], PROMPTS[4]], echo=True, logprobs=1, max_tokens=3, temperature=0),
        id="echo-logprobs-greedy",
    ),
    pytest.param(
        "/v1/completions",
        dict(prompt=PROMPTS[3], echo=True, logprobs=1, max_tokens=0),
        id="echo-only",
    ),
    pytest.param(
        "/v1/chat/completions",
        dict(
            messages=[{"role": "user", "content": PROMPTS[0]}],
            n=2,
            logprobs=True,
            top_logprobs=2,
            **SAMPLED,
        ),
        id="chat-n-logprobs",
    ),
]


def record_steps(engine, requests: dict) -> list[list]:
    """Every step's `RequestOutput`s of `requests` (id -> (prompt, SamplingParams))."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    return steps


def stop_id_ending_one_sequence(requests: list[list[list[int]]]) -> int:
    """A token id that, as a stop id, ends a request's first sequence at its first token (the
    prefill's step) while a sibling goes on, and no request at its first token: from each
    request's sequences' tokens generated without it (seeded: they come again up to a stop)."""
    for first, *_ in requests:  # (its own request's clause: a sibling begins otherwise)
        t = first[0]
        if all(any(ts[0] != t for ts in seqs) for seqs in requests):
            return t
    raise AssertionError(f"seed {SEED}: every request's sequences begin alike: {requests}")


@pytest.fixture(scope="module")
def served():
    """The engine-process server (url, replicas) and the engine-thread server (thread_url) on
    an `LLM`'s engine, which first computed the expected greedy and sampled outputs of
    PROMPTS and recorded each step's outputs of requests with n > 1 and logprobs (steps)."""
    llm = LLM(MODEL, **ENGINE)
    expected = {
        name: llm.generate(PROMPTS, SamplingParams(**kw), use_tqdm=False)
        for name, kw in (("greedy", GREEDY), ("sampled", SAMPLED))
    }
    # RECORDED's SamplingParams (echo: the prompt's logprobs too); prompt i as request "p{i}".
    kw = {k: v for k, v in RECORDED.items() if k not in ("prompt", "echo")}
    params = SamplingParams(**kw, prompt_logprobs=RECORDED["logprobs"])
    generated = llm.generate(RECORDED["prompt"], params, use_tqdm=False)
    stop = stop_id_ending_one_sequence([[c.token_ids for c in o.outputs] for o in generated])
    params = dataclasses.replace(params, stop_token_ids=[stop])
    requests = {f"p{i}": (p, params) for i, p in enumerate(RECORDED["prompt"])}
    steps = record_steps(llm.engine, requests)
    prompt_ids = {rid: llm.engine.prompt_ids(p) for rid, (p, _) in requests.items()}
    # A second API server (`--api-server-count 2`) on the same child, as another API server
    # process connects: through the pipe ends the first hands it.
    # Its loop gathers arrivals while idle (the default): the texts below must not depend on it.
    config = EngineConfig(model=MODEL, **ENGINE)
    engine = EngineProcesses(config, api_servers=2)
    (links,) = engine.api_server_links()
    second = EngineProcesses(config, links=links)
    for tokenizer in (engine.tokenizer, second.tokenizer, llm.engine.tokenizer):
        tokenizer.chat_template = TEMPLATE
    app = create_app(engine, served_model_name="t")
    second_app = create_app(second, served_model_name="t")
    thread_app = create_app(llm.engine, served_model_name="t")
    with (
        ServerThread(app) as server,
        ServerThread(thread_app) as thread_server,
        ServerThread(second_app) as second_server,
    ):
        yield SimpleNamespace(
            url=server.url,
            engines=app.state.engine.engines,
            second_url=second_server.url,
            second_engines=second_app.state.engine.engines,
            expected=expected,
            thread_url=thread_server.url,
            steps=steps,
            requests=requests,
            recorded={**RECORDED, "stop_token_ids": [stop]},
            prompt_ids=prompt_ids,
            token_texts=llm.engine.token_texts,
        )
    # The lifespan stopped every child: none is left, and each exited when told to or was killed.
    assert multiprocessing.active_children() == []


def complete(url: str, prompt, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, **kw}, timeout=60)


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_texts_equal_the_engine_in_process(served, name):
    url, expected = served.url, served.expected
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
    url, engines, expected = served.url, served.engines, served.expected
    cases = [
        ({"prompt": [1, 2, 99999999]}, "prompt"),  # not a token id
        ({"prompt": "the", "stop_token_ids": [50257]}, "stop_token_ids"),
        ({"prompt": [5] * 129}, "prompt"),  # longer than tiny's 128-token context
        ({"prompt": "the", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "the", "n": 0}, "n"),
        ({"prompt": "the", "logprobs": 21}, "logprobs"),
        ({"prompt": "the", "logit_bias": {"50257": 1}}, "logit_bias"),
    ]
    for body, param in cases:
        r = complete(url, **body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    r = complete(url, PROMPTS[0], **GREEDY)
    assert r.json()["choices"][0]["text"] == expected["greedy"][0].text
    assert engines[0].alive


def test_client_gone_mid_stream_frees_its_blocks_in_the_child(served):
    url = served.url
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


def test_rows_rebuild_every_output_of_the_engine(served):
    """Each step's outputs, sent as a child sends them (rows, pickled), come back equal, field
    by field (Logprob dicts included), to the engine's; a row carries only the sequences that
    changed."""
    writer, reader = RowWriter(), RowReader(TokenTexts(served.token_texts.tokenizer))
    for rid, (_, params) in served.requests.items():
        reader.expect(rid, served.prompt_ids[rid], params)
    seen = {rid: 0 for rid in served.requests}
    early_end = False  # a sequence ended while its sibling went on
    for outputs in served.steps:
        rows = pickle.loads(pickle.dumps([writer.row(out) for out in outputs]))
        for out, row in zip(outputs, rows, strict=True):
            assert reader.output(row) == out, out.request_id  # its metrics too
            assert out.metrics.first_token_time is not None
            seen[out.request_id] += 1
            changed = [c.index for c in out.outputs if c.new_token_ids or c.new_text]
            assert [entry[0] for entry in row[1]] == changed, out
            early_end |= not out.finished and out.outputs[0].finish_reason is not None
    assert min(seen.values()) >= 2 and early_end, (seen, f"seed {SEED}")


def test_a_request_that_fails_at_its_first_row_keeps_its_times():
    """An engine output that ends a request with an error before any other row of it: the
    driver's rebuilt output has its error and its engine times, as the engine's has."""
    rng = random.Random()
    times = sorted(rng.uniform(0, 1e4) for _ in range(3))
    failed = RequestOutput("r", [1, 2], [], "", [], "", True, "error", "boom")
    failed.metrics = RequestMetrics(*times)
    writer, reader = RowWriter(), RowReader(None)
    reader.expect("r", [1, 2], SamplingParams())
    out = reader.output(pickle.loads(pickle.dumps(writer.row(failed))))
    assert (out.finish_reason, out.error, out.metrics) == ("error", "boom", failed.metrics)


def _without_ids(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def _streamed(url: str, route: str, body: dict) -> tuple[dict, dict]:
    """A streamed answer folded per choice (texts, logprob lists and contents joined, the
    finish reason), and its usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    choices: dict[int, dict] = {}
    with httpx.stream("POST", url + route, json=body, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    for chunk in map(json.loads, lines[:-2]):
        for c in chunk["choices"]:
            acc = choices.setdefault(c["index"], {"text": "", "logprobs": {}, "finish": None})
            acc["text"] += c.get("text", c.get("delta", {}).get("content", ""))
            for key, values in (c["logprobs"] or {}).items():
                acc["logprobs"].setdefault(key, []).extend(values)
            acc["finish"] = c["finish_reason"] or acc["finish"]
    return choices, json.loads(lines[-2])["usage"]


def assert_same_answers(served, route: str, body: dict) -> None:
    """Both servers answer `body` alike, whole and streamed, with logprobs in every choice."""
    urls = (served.url, served.thread_url)
    got, want = (httpx.post(url + route, json=body, timeout=60) for url in urls)
    assert want.status_code == 200 and got.status_code == 200, (want.text, got.text)
    want = _without_ids(want.json())
    assert all(c["logprobs"] for c in want["choices"]), want  # something to compare
    assert _without_ids(got.json()) == want, f"seed {SEED}"
    assert _streamed(served.url, route, body) == _streamed(served.thread_url, route, body)


def test_n_and_echo_logprobs_answer_as_the_engine_thread_does(served):
    """n = 2, logprobs, the prompt's logprobs (echo), a sequence ending before its sibling:
    the same JSON from both paths for the same seeded request."""
    assert_same_answers(served, "/v1/completions", served.recorded)


@pytest.mark.slow  # each compiles programs of its own, in both processes
@pytest.mark.parametrize(("route", "body"), FEATURES)
def test_features_answer_as_the_engine_thread_does(served, route, body):
    """n > 1 with a stop string, greedy echo, echo alone, chat logprobs: the same JSON from
    both paths for the same seeded request, whole and streamed."""
    assert_same_answers(served, route, body)


def test_two_api_servers_share_the_engine_process(served):
    """Requests through both API servers at once: each gets its own outputs, equal to the
    engine's in process, and the child counts each server's requests apart."""
    before = metrics(served.url)
    urls = [served.url, served.second_url] * 4
    with ThreadPoolExecutor(len(urls)) as pool:
        answers = list(pool.map(lambda u: complete(u, PROMPTS, **GREEDY), urls))
    want = [o.text for o in served.expected["greedy"]]
    for r in answers:
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == want, f"seed {SEED}"
    wait_idle(served.second_url)
    for url in (served.url, served.second_url):  # the engine's count, seen by either server
        m = metrics(url)
        for server in ("0", "1"):
            key = f"rosejax_api_server_requests_total{{api_server={server}}}"
            assert m[key] - before[key] == 4 * len(PROMPTS), (url, server)
    # The per-request counters are each server's own: the second counted its 4 requests only.
    finished = "rosejax_requests_finished_total{reason=length}"
    second = metrics(served.second_url)[finished]
    assert second == 4 * len(PROMPTS), second


def test_api_server_gone_aborts_its_requests_and_the_child_serves_on(served):
    """The second API server's pipe closes mid-request (its process died): the child aborts
    that server's request, freeing its blocks, and serves the first server on."""
    body = dict(max_tokens=120, ignore_eos=True, temperature=0)
    wait_idle(served.url)
    start = time.monotonic()
    assert complete(served.url, "the", **body).status_code == 200
    whole = time.monotonic() - start  # the request run to its end
    result: dict = {}
    asker = threading.Thread(
        target=lambda: result.update(r=complete(served.second_url, "the", **body))
    )
    asker.start()
    deadline = time.monotonic() + 30
    while not served.engines[0].snapshot["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    served.second_engines[0].stop(5)  # closes its end of the pipe
    m = wait_idle(served.url)
    freed = time.monotonic() - start
    assert m["rosejax_kv_blocks_used"] == 0 and m["rosejax_requests_running"] == 0
    assert freed < whole / 2, (freed, whole)  # aborted, not run to its end
    asker.join(30)
    assert result["r"].status_code == 503, result["r"].text
    r = complete(served.url, PROMPTS[0], **GREEDY)
    assert r.json()["choices"][0]["text"] == served.expected["greedy"][0].text
    assert served.engines[0].alive


# Last of the module: it kills the module server's child.
def test_killed_child_fails_its_requests_with_500_and_health_503(served):
    url, engines = served.url, served.engines
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
        kids = _read_children(todo.pop()) - found
        todo += kids
        found |= kids
    return found


def _read_children(pid: int) -> set[int]:
    """The children of each of a process's threads; a thread or the process may end while it
    is read, which leaves its children out."""
    kids = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return kids
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids |= {int(k) for k in f.read().split()}
        except FileNotFoundError:
            continue
    return kids


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


def test_warm_for_serving_warms_the_engines_own_tokenizer():
    """An engine process detokenizes with a tokenizer of its own, which the API servers'
    `warm_tokenizer` does not reach: warming its engine for serving builds the table every
    request's detokenizer reads, which the first request would otherwise wait for, and not the
    chat template's renderer."""
    from rosejax.engine.serving import warm_for_serving
    from rosejax.tokenizer import _TABLES, _byte_table

    engine = LLM(MODEL, **ENGINE).engine
    engine.tokenizer.chat_template = "{{ messages[0]['content'] }}"
    assert engine.tokenizer not in _TABLES
    assert warm_for_serving(engine, False) is False  # on the CPU nothing is left to compile
    assert _TABLES[engine.tokenizer][2] == _byte_table(engine.tokenizer, False)
    # Chats are the API servers' to render: the engine's start imports no transformers for one.
    assert engine.tokenizer._transformers is None


def _feed(inbox: queue.SimpleQueue, gaps: list[float]) -> threading.Thread:
    """Put item i after sleeping gaps[i] seconds, on a thread."""

    def run():
        for i, gap in enumerate(gaps):
            time.sleep(gap)
            inbox.put(i)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("gather", [0.0, 0.25])
def test_take_commands_gathers_a_burst_only_while_its_arrivals_keep_coming(gather):
    """Without gathering only what is queued is taken; with it, items 20 ms apart are taken in
    one call, and one that comes a second after the burst is left for the next."""
    inbox, taken = queue.SimpleQueue(), []
    feeder = _feed(inbox, [0.0] + [0.02] * 5 + [1.0])
    take_commands(inbox, taken.append, wait=2.0, gather=(gather, 10.0) if gather else None)
    assert taken == ([0, 1, 2, 3, 4, 5] if gather else [0])
    feeder.join()
    take_commands(inbox, taken.append, wait=0.0)
    assert taken[-1] == 6 and sorted(taken) == list(range(7))


def test_take_commands_gathers_for_at_most_its_span():
    """Arrivals that never pause are gathered for the span at most, then the loop steps."""
    inbox, taken = queue.SimpleQueue(), []
    feeder = _feed(inbox, [0.0] + [0.01] * 100)  # 1 s of arrivals
    start = time.monotonic()
    take_commands(inbox, taken.append, wait=2.0, gather=(0.05, 0.3))
    elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < 0.3 + 0.4, elapsed
    assert 5 <= len(taken) < 80 and taken == list(range(len(taken)))
    feeder.join()
