"""The OpenAI-compatible server, driven with the official `openai` client and raw httpx.

One in-process server (uvicorn in a thread, the engine on a thread of its own: the server's
`--no-engine-process`) serves most tests. Its engine is the engine of an `LLM` that first
computed every expected output with `LLM.generate`, so both share one set of compiled programs
(compiles dominate the CPU time). The command line, overload (429) and signals run `python -m
rosejax.serve` in a subprocess (engine processes, the default, but for the SIGINT test) whose KV
cache has the same shape, so it reuses those programs from jax's persistent compilation cache.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from rosejax import LLM, SamplingParams
from rosejax.serve import create_app

# The module's tests share one served engine: one pytest-xdist worker builds it, not each.
pytestmark = pytest.mark.xdist_group("server")

MODEL, NAME = "random:tiny", "tiny"
# Fresh weights and prompts every run; failures print the seed, ROSEJAX_TEST_SEED replays it.
SEED = int(os.environ.get("ROSEJAX_TEST_SEED", random.randrange(2**31)))
# Small batch and block: few programs to compile; prompts stay under 16 tokens (one bucket).
ENGINE = dict(seed=SEED, warmup=False, max_batch_size=8, block_size=16, kv_cache_tokens=1024)
# With --max-batch-size 2 this gives the same number of KV blocks (tokens/16 + batch), hence the
# same cache shape, so the subprocess finds the programs in the persistent compilation cache.
CLI_ARGS = ["--block-size", "16", "--kv-cache-tokens", "1120", "--max-batch-size", "2"]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
WORDS = "the a of cat dog runs quickly over lazy river mountain blue green light time".split()
GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.9, top_p=0.9, top_k=50, seed=1234)

_rng = random.Random(SEED)


def _text(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(2, 8)))


def _ids(rng: random.Random) -> list[int]:
    return [rng.randrange(50257) for _ in range(rng.randint(1, 12))]


CONCURRENT = [(_text(_rng) if i % 2 else _ids(_rng), _rng.randint(1, 20)) for i in range(64)]
CASES = {  # name -> (prompts, sampling kwargs); each prompt gets its own expected output
    "text": ([_text(_rng)], dict(max_tokens=12, **GREEDY)),
    "multi": ([_text(_rng), _ids(_rng)], dict(max_tokens=10, **GREEDY)),
    "sampled": ([_text(_rng)], dict(max_tokens=10, **SAMPLED)),
    "chat": (None, dict(max_tokens=8, **GREEDY)),  # prompt: the rendered chat template
}
CHAT = [{"role": "user", "content": _text(_rng)}]


class ServerThread:
    """uvicorn serving `app` from a thread, on a free port bound before it starts."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture(scope="module")
def served():
    """(base url, expected outputs by case name, the 64 expected concurrent outputs)."""
    llm = LLM(MODEL, **ENGINE)
    tok = llm.engine.tokenizer
    tok.chat_template = TEMPLATE
    prompts = dict(
        CASES,
        chat=(
            [tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)],
            CASES["chat"][1],
        ),
    )
    expected = {
        name: llm.generate(p, SamplingParams(**kw), use_tqdm=False)
        for name, (p, kw) in prompts.items()
    }
    concurrent = llm.generate(
        [p for p, _ in CONCURRENT],
        [SamplingParams(max_tokens=n, **GREEDY) for _, n in CONCURRENT],
        use_tqdm=False,
    )
    with ServerThread(create_app(llm.engine, served_model_name=NAME)) as server:
        yield server.url, expected, concurrent


@pytest.fixture
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0, timeout=60)


def metrics(url: str, per_replica: bool = False) -> dict[str, float]:
    """Every sample of /metrics, keyed by name plus sorted labels (parsing checks the format);
    the engine's samples summed over replicas unless `per_replica`."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            kept = {k: v for k, v in s.labels.items() if per_replica or k != "replica"}
            labels = ",".join(f"{k}={v}" for k, v in sorted(kept.items()))
            key = s.name + (f"{{{labels}}}" if labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        busy = m["rosejax_requests_running"] + m["rosejax_requests_waiting"]
        if (busy == 0 and m["rosejax_kv_blocks_used"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def oai(kw: dict) -> dict:
    """Sampling kwargs for the openai client: top_k is an extra field, sent in extra_body."""
    kw = dict(kw)
    extra = {"top_k": kw.pop("top_k")} if "top_k" in kw else {}
    return {**kw, "extra_body": extra} if extra else kw


def check_choice(text: str, finish: str, ref, where: str) -> None:
    assert (text, finish) == (ref.text, ref.finish_reason), f"{where}, seed {SEED}"


def stream_texts(chunks) -> tuple[dict[int, str], dict[int, str], object]:
    texts, finish, usage = {}, {}, None
    for c in chunks:
        usage = c.usage or usage
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    return texts, finish, usage


@pytest.mark.parametrize("case", ["text", "multi", "sampled"])
def test_completions_equal_llm_generate(served, client, case):
    prompts, kw = CASES[case]
    refs = served[1][case]
    prompt = prompts[0] if len(prompts) == 1 else prompts
    kw = oai(kw)
    resp = client.completions.create(model=NAME, prompt=prompt, **kw)
    assert [c.index for c in resp.choices] == list(range(len(refs)))
    for c, ref in zip(resp.choices, refs, strict=True):
        check_choice(c.text, c.finish_reason, ref, f"{case} choice {c.index}")
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert resp.usage.completion_tokens == sum(len(r.token_ids) for r in refs)

    chunks = list(
        client.completions.create(
            model=NAME, prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    texts, finish, usage = stream_texts(chunks)
    for i, ref in enumerate(refs):
        check_choice(texts[i], finish[i], ref, f"{case} streamed choice {i}")
    assert chunks[-1].choices == [] and usage.completion_tokens == resp.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_cuts_the_text(served, client):
    ref = served[1]["text"][0]
    if len(ref.text) < 4:
        pytest.skip(f"greedy text too short to cut: {ref.text!r} (seed {SEED})")
    stop = ref.text[1:4]
    resp = client.completions.create(
        model=NAME, prompt=CASES["text"][0][0], stop=[stop], **CASES["text"][1]
    )
    choice = resp.choices[0]
    assert (choice.text, choice.finish_reason) == (ref.text[: ref.text.find(stop)], "stop")


def test_chat_completions_with_a_template(served, client):
    ref = served[1]["chat"][0]
    resp = client.chat.completions.create(model=NAME, messages=CHAT, **CASES["chat"][1])
    msg = resp.choices[0].message
    assert msg.role == "assistant"
    check_choice(msg.content, resp.choices[0].finish_reason, ref, "chat")
    assert resp.usage.completion_tokens == len(ref.token_ids)
    chunks = list(
        client.chat.completions.create(model=NAME, messages=CHAT, stream=True, **CASES["chat"][1])
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    check_choice(text, chunks[-1].choices[0].finish_reason, ref, "chat streamed")


def test_64_concurrent_streams_with_bad_and_vanishing_clients(served):
    """Every stream gets its own right output while bad requests and cut-off clients come and
    go around it; once idle, no request runs and every KV block is free."""
    url, _, expected = served

    async def one(c: openai.AsyncOpenAI, prompt, max_tokens: int, ref) -> None:
        stream = await c.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
        )
        texts, finish, usage = stream_texts([chunk async for chunk in stream])
        check_choice(texts.get(0, ""), finish[0], ref, f"concurrent {prompt!r}")
        assert usage.completion_tokens == len(ref.token_ids)

    async def bad(h: httpx.AsyncClient, body: bytes) -> None:
        r = await h.post(url + "/v1/completions", content=body)
        assert r.status_code == 400, r.text

    async def vanishing(h: httpx.AsyncClient) -> None:
        body = {"prompt": "the cat", "max_tokens": 100, "ignore_eos": True, "stream": True}
        async with h.stream("POST", url + "/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                break  # leave after the first line: the server must abort the request

    async def main() -> None:
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        async with httpx.AsyncClient(timeout=60) as h:
            jobs = [one(c, p, n, ref) for (p, n), ref in zip(CONCURRENT, expected, strict=True)]
            jobs += [bad(h, b'{"prompt": [1, 2') for _ in range(4)]
            jobs += [vanishing(h) for _ in range(4)]
            random.Random(SEED).shuffle(jobs)
            await asyncio.gather(*jobs)
        await c.close()

    asyncio.run(main())
    m = wait_idle(url)
    assert m["rosejax_kv_blocks_used"] == 0 and m["rosejax_requests_running"] == 0


def test_client_cut_off_mid_stream_is_aborted_and_frees_blocks(served):
    url = served[0]
    before = metrics(url).get("rosejax_requests_finished_total{reason=abort}", 0)
    body = {"prompt": [7, 8, 9], "max_tokens": 120, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=url, timeout=30) as h:
        for _ in range(3):
            with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                lines = (line for line in r.iter_lines() if line.startswith("data: "))
                for _ in range(3):
                    next(lines)
        with pytest.raises(httpx.ReadTimeout):  # a non-streamed client that gives up
            h.post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.01))
    m = wait_idle(url)
    assert m["rosejax_kv_blocks_used"] == 0, m
    assert m["rosejax_requests_running"] == m["rosejax_requests_waiting"] == 0
    assert m["rosejax_requests_finished_total{reason=abort}"] >= before + 1


BAD = [  # (body, param the error must name, or None)
    (b"{not json", None),
    (b"[1, 2]", None),
    (b"", None),
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", 5]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [50257]}, "prompt"),
    ({"prompt": [1] * 129}, "prompt"),
    ({"prompt": "the " * 200}, "prompt"),
    ({"prompt": [1] * 128}, "prompt"),  # the whole context: no room for a token, as vLLM
    ({"prompt": [1] * 120, "max_tokens": 9}, "max_tokens"),  # 129 > 128: vLLM's 400, no clamp
    ({"prompt": [1] * 120}, "max_tokens"),  # the default 16 counts too
    ({"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": "hi", "seed": "x"}, "seed"),
    ({"prompt": "hi", "stop": [1]}, "stop"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "hi", "model": "gpt-4"}, "model"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_get_400_and_the_server_keeps_answering(served, client, body, param):
    url = served[0]
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + "/v1/completions", timeout=30, **kw)
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    ok = client.completions.create(model=NAME, prompt="the cat", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_context_limits_answer_in_vllms_words(served, client):
    """A prompt and max_tokens past the context: vLLM's 400s in its words (clients read the
    numbers out of them); a request that fits to the context's last token is served whole, and
    a chat that names no limit runs to the context's end."""
    rng = random.Random(SEED)
    n = rng.randint(8, 120)
    prompt, room = [rng.randrange(50257) for _ in range(n)], 128 - n
    chat_n = httpx.post(served[0] + "/tokenize", json={"messages": CHAT}).json()["count"]
    whole = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=room, temperature=0, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == room
    for create, kw in (
        (client.completions.create, {"prompt": prompt, "max_tokens": room + 1}),
        (client.chat.completions.create, {"messages": CHAT, "max_completion_tokens": 10**6}),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            create(model=NAME, **kw)
        asked = kw.get("max_tokens", kw.get("max_completion_tokens"))
        n_in = n if "prompt" in kw else chat_n
        assert e.value.body["param"] == "max_tokens"
        assert e.value.body["message"] == (
            f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's maximum "
            f"context length is 128 tokens and your request has {n_in} input tokens ({asked} > "
            f"128 - {n_in})."
        )
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=(prompt * 16)[:128], max_tokens=1)
    assert e.value.body["message"] == (
        "This model's maximum context length is 128 tokens. However, your request has 128 input "
        "tokens. Please reduce the length of the input messages."
    )
    chat = client.chat.completions.create(
        model=NAME, messages=CHAT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].finish_reason == "length"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (chat_n, 128 - chat_n)


@pytest.mark.parametrize(
    "field, value",
    [
        ("best_of", 2),
        ("suffix", "x"),
    ],
)
def test_unsupported_fields_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hi", max_tokens=2, extra_body={field: value})
    assert f"'{field}'" in e.value.message and e.value.body["param"] == field
    # the neutral value is not a request for the feature: accepted
    neutral = {
        "best_of": 1,
        "suffix": None,
    }[field]
    client.completions.create(
        model=NAME, prompt="hi", max_tokens=2, temperature=0, extra_body={field: neutral}
    )


def test_extreme_but_valid_values_are_served(client):
    """Values the engine must clamp or wrap, not fail on (a failed step would fail everyone)."""
    for kw in (dict(top_k=10**12), dict(seed=-5), dict(seed=2**64 - 1)):
        resp = client.completions.create(
            model=NAME, prompt="the cat", temperature=1.0, **oai({"max_tokens": 3, **kw})
        )
        assert resp.choices[0].finish_reason in ("stop", "length"), kw
    # vLLM's older "off" for top_k: the same text as leaving it out, at one seed
    texts = [
        client.completions.create(
            model=NAME, prompt="the cat", temperature=1.0, **oai({"max_tokens": 8, "seed": 7, **kw})
        )
        .choices[0]
        .text
        for kw in ({"top_k": -1}, {})
    ]
    assert texts[0] == texts[1]


def test_models_health_and_metrics(served, client):
    url = served[0]
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(url + "/health").status_code == 200
    client.completions.create(model=NAME, prompt="the dog", max_tokens=3, temperature=0)
    m = wait_idle(url)
    for name in (
        "rosejax_requests_running",
        "rosejax_requests_waiting",
        "rosejax_kv_blocks_used",
        "rosejax_prefix_cache_hit_blocks_total",
        "rosejax_generation_tokens_total",
        "rosejax_time_to_first_token_seconds_count",
        "rosejax_inter_token_latency_seconds_count",
    ):
        assert name in m, sorted(m)
    assert m["rosejax_generation_tokens_total"] >= 3
    assert m["rosejax_time_to_first_token_seconds_count"] >= 1
    assert m["rosejax_kv_blocks_total"] > 0
    # TTFT's parts (the engine's RequestMetrics beside the server's own times): one of each
    # per request, each >= 0, together within the TTFT
    parts = [f"rosejax_request_{p}_time_seconds" for p in ("dispatch", "queue", "prefill")]
    ttft = "rosejax_time_to_first_token_seconds"
    for name in parts:
        assert m[f"{name}_count"] == m[f"{ttft}_count"] and m[f"{name}_sum"] >= 0, name
    assert sum(m[f"{name}_sum"] for name in parts) <= m[f"{ttft}_sum"]
    # A prompt shorter than a block (no prefix cache hit): one prefill of its tokens.
    prompt = np.random.default_rng().integers(10, 100, 5).tolist()
    client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    after = wait_idle(url)
    for name, grew in (("prefill_steps", 1), ("prefill_tokens", 5), ("preemptions", 0)):
        key = f"rosejax_{name}_total"
        assert after[key] - m[key] == grew, name


# ------------------------------------------------------------------------- the command line


def start_cli(tmp_path, *args: str) -> tuple[subprocess.Popen, str, object]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "server.log", "w+")  # closed by stop_cli
    cmd = [
        sys.executable,
        "-m",
        "rosejax.serve",
        "--model",
        MODEL,
        "--served-model-name",
        NAME,
        "--seed",
        str(SEED),
        "--no-warmup",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--no-access-log",
        *CLI_ARGS,
        *args,
    ]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            pytest.fail(f"server did not come up:\n{log.read()}")
        time.sleep(0.2)


def stop_cli(proc: subprocess.Popen, log, sig: int, send: bool = True) -> None:
    if send:
        proc.send_signal(sig)
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    log.seek(0)
    text = log.read()
    log.close()
    assert rc == 0, f"exit {rc} after {signal.Signals(sig).name}:\n{text}"


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_cli_overload_429_no_chat_template_and_sigterm(tmp_path):
    proc, url, log = start_cli(tmp_path, "--max-waiting", "0")
    try:
        body = {
            "model": NAME,
            "prompt": "the river",
            "max_tokens": 100,
            "ignore_eos": True,
            "temperature": 0,
        }
        with ThreadPoolExecutor(12) as pool:  # 12 at once; 2 fit the batch, 0 may wait
            rs = list(
                pool.map(
                    lambda _: httpx.post(url + "/v1/completions", json=body, timeout=60), range(12)
                )
            )
        codes = sorted(r.status_code for r in rs)
        assert 200 in codes and 429 in codes and set(codes) == {200, 429}, codes
        err = next(r for r in rs if r.status_code == 429).json()["error"]
        assert "overloaded" in err["message"]
        assert all(r.json()["usage"]["completion_tokens"] == 100 for r in rs if r.is_success)

        r = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": CHAT})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == NAME
        m = wait_idle(url)
        assert m["rosejax_kv_blocks_used"] == 0
        assert m["rosejax_requests_rejected_total{reason=overloaded}"] == codes.count(429)
    except BaseException:
        proc.kill()
        raise
    stop_cli(proc, log, signal.SIGTERM)


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_cli_sigint_with_a_stream_open(tmp_path):
    """The default server of one replica: its engine on a thread of the server's process
    (engine processes stop in tests/test_engine_process.py)."""
    proc, url, log = start_cli(tmp_path)
    try:
        body = {"model": NAME, "prompt": "the", "max_tokens": 100, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGINT)  # the stream may finish or be cut; exit is clean
            for _ in lines:
                pass
    except httpx.TransportError:
        pass
    except BaseException:
        proc.kill()
        raise
    stop_cli(proc, log, signal.SIGINT, send=False)
