"""The server's OpenAI and vLLM surface beyond plain generation (issue 20): /tokenize,
/detokenize and /tokenizer_info against the tokenizer itself; echo; the prompt forms; the new
sampling fields parsed and mapped to SamplingParams' keyword arguments; and the logprobs bodies
(completions' and chat's shapes, echo, streamed pieces) built from hand-made Logprob data
checked against a log-softmax computed here.

One in-process server, with test_server.py's engine shape (its programs come from jax's
persistent compilation cache).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import types

import httpx
import numpy as np
import pytest
from transformers import AutoTokenizer

from rosejax import LLM
from rosejax.engine.request import CompletionOutput, Logprob
from rosejax.sampling import SamplingParams
from rosejax.serve import create_app
from rosejax.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    _exact,
    parse,
)
from rosejax.serve.responses import Formatter, _Sent, chat_logprobs, completion_logprobs
from rosejax.serve.server import ServerThread
from rosejax.tokenizer import packaged_gpt2_tokenizer_path

MODEL, NAME = "random:tiny", "tiny"
SEED = int(os.environ.get("ROSEJAX_TEST_SEED", random.randrange(2**31)))
ENGINE = dict(seed=SEED, warmup=False, max_batch_size=8, block_size=16, kv_cache_tokens=1024)
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
WORDS = (
    "the a of cat dog runs quickly over lazy river mountain blue green light time é 東京".split()
)
rng = random.Random(SEED)


def text(k: int | None = None) -> str:
    return " ".join(rng.choices(WORDS, k=k or rng.randint(2, 8)))


def ids(k: int | None = None) -> list[int]:
    return [rng.randrange(50257) for _ in range(k or rng.randint(1, 12))]


@pytest.fixture(scope="module")
def served():
    """(base url, the engine, an independently loaded copy of its tokenizer)."""
    llm = LLM(MODEL, **ENGINE)
    llm.engine.tokenizer.chat_template = TEMPLATE
    reference = AutoTokenizer.from_pretrained(packaged_gpt2_tokenizer_path())
    with ServerThread(create_app(llm.engine, served_model_name=NAME)) as server:
        yield server.url, llm.engine, reference


def post(url: str, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == status, (r.status_code, r.text, f"seed {SEED}")
    return r.json()


# ------------------------------------------------------------------- tokenize and detokenize


def test_tokenize_detokenize_and_tokenizer_info_agree_with_the_tokenizer(served):
    url, engine, tok = served
    context = engine.config.max_model_len
    for _ in range(4):
        prompt = text()
        got = post(url, "/tokenize", {"model": NAME, "prompt": prompt})
        assert got["tokens"] == tok.encode(prompt), prompt
        assert got["count"] == len(got["tokens"]) and got["max_model_len"] == context
        assert got["token_strs"] is None
        strs = post(url, "/tokenize", {"prompt": prompt, "return_token_strs": True})
        assert strs["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])
        tokens = ids()
        assert post(url, "/detokenize", {"tokens": tokens}) == {"prompt": tok.decode(tokens)}
    assert post(url, "/tokenize", {"prompt": ""})["tokens"] == []
    assert post(url, "/detokenize", {"tokens": []}) == {"prompt": ""}
    # a chat, through the template, with and without the generation prompt
    tok.chat_template = TEMPLATE
    messages = [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
    for add in (True, False):
        body = {"messages": messages, "add_generation_prompt": add}
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        want = tok.encode(rendered, add_special_tokens=False)
        assert post(url, "/tokenize", body)["tokens"] == want
        # no tools, as a chat request may say: the same tokens
        assert post(url, "/tokenize", body | {"tools": []})["tokens"] == want
    info = httpx.get(url + "/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == tok.eos_token == "<|endoftext|>"
    assert info["tokenizer_class"] and info["chat_template"] == TEMPLATE
    models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    assert [m["max_model_len"] for m in models] == [context]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
        ("/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
        ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model"),
        ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "tools": [{}]}, "tools"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [50257]}, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, "tokens.0"),
        ("/detokenize", {"tokens": [1.5]}, "tokens.0"),
    ],
)
def test_tokenizer_endpoints_answer_bad_input_with_4xx(served, path, body, param):
    url = served[0]
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["error"]["param"] == param
    assert post(url, "/tokenize", {"prompt": "still serving"})["count"] == 2


def test_integral_floats_are_the_ints_the_schema_says_they_are(served):
    """JSON Schema's "integer" admits 2.0, so /openapi.json does: such a request is the one with
    ints (as vLLM takes it), token ids included, while 1.5, "2" and true stay 400s."""
    url = served[0]
    prompt = ids()
    floats = [float(t) for t in prompt]
    sampled = dict(temperature=1.0, max_tokens=4, n=2, logprobs=1, seed=random.randrange(2**31))
    want = completion(url, prompt=prompt, **sampled)
    got = completion(url, prompt=floats, best_of=1.0, **{k: float(v) for k, v in sampled.items()})
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
    assert [c["logprobs"] for c in got["choices"]] == [c["logprobs"] for c in want["choices"]]
    assert got["usage"] == want["usage"]
    detokenized = post(url, "/detokenize", {"tokens": prompt})
    assert post(url, "/detokenize", {"tokens": floats}) == detokenized
    for field, value in (("max_tokens", 1.5), ("n", "2"), ("prompt", [*floats, 0.5])):
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, field: value}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "best_of": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text


# ------------------------------------------------------------------------- echo, prompt forms


def completion(url: str, **body) -> dict:
    return post(url, "/v1/completions", {"temperature": 0, "ignore_eos": True, **body})


def test_echo_puts_the_prompt_before_the_completion(served):
    url, _, tok = served
    prompt_text, prompt_ids = text(), ids()
    for prompt, echoed in ((prompt_text, prompt_text), (prompt_ids, tok.decode(prompt_ids))):
        plain = completion(url, prompt=prompt, max_tokens=5)["choices"][0]
        echo = completion(url, prompt=prompt, max_tokens=5, echo=True)
        assert echo["choices"][0]["text"] == echoed + plain["text"]
        assert echo["usage"]["completion_tokens"] == 5
        alone = completion(url, prompt=prompt, max_tokens=0, echo=True)
        assert [c["text"] for c in alone["choices"]] == [echoed]
        assert alone["choices"][0]["finish_reason"] == "length"
        assert alone["usage"]["completion_tokens"] == 0
        streamed = httpx.post(
            url + "/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": 5,
                "temperature": 0,
                "ignore_eos": True,
                "echo": True,
                "stream": True,
            },
            timeout=60,
        )
        pieces = [
            json.loads(line[6:])["choices"][0]["text"]
            for line in streamed.text.splitlines()
            if line.startswith("data: {")
        ]
        assert "".join(pieces) == echoed + plain["text"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_every_prompt_form_is_its_own_choice(served):
    url = served[0]
    prompts = [ids(), text(), ids()]
    singles = [completion(url, prompt=p, max_tokens=4)["choices"][0]["text"] for p in prompts]
    many = completion(url, prompt=prompts, max_tokens=4)["choices"]
    assert [c["index"] for c in many] == [0, 1, 2]
    assert [c["text"] for c in many] == singles
    only_ids = completion(url, prompt=[prompts[0], prompts[2]], max_tokens=4)["choices"]
    assert [c["text"] for c in only_ids] == [singles[0], singles[2]]


def test_chat_max_completion_tokens_is_max_tokens(served):
    url = served[0]
    base = {"messages": [{"role": "user", "content": text()}], "temperature": 0, "ignore_eos": True}
    for body, n in (
        ({"max_completion_tokens": 3}, 3),
        ({"max_tokens": 9, "max_completion_tokens": 2}, 2),
    ):
        got = post(url, "/v1/chat/completions", {**base, **body})
        assert (
            got["usage"]["completion_tokens"] == n
            and got["choices"][0]["finish_reason"] == "length"
        )


# ----------------------------------------------------------------- the new sampling fields


def parsed(model, **body):
    """A request as the server parses it once the engine takes every field (nothing refused)."""
    return parse(dict(body), model)


def test_new_fields_map_to_sampling_params_kwargs():
    bias = {str(rng.randrange(50257)): rng.uniform(-100, 100) for _ in range(3)}
    k = rng.randint(0, 20)
    req = parsed(
        CompletionRequest,
        prompt="a",
        max_tokens=7,
        n=3,
        logprobs=k,
        echo=True,
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.3,
        logit_bias=bias,
        min_tokens=2,
        min_p=0.05,
    )
    assert req.sampling_kwargs() == dict(
        max_tokens=7,
        min_p=0.05,
        repetition_penalty=1.3,
        seed=None,
        stop=None,
        stop_token_ids=None,
        ignore_eos=False,
        n=3,
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        logit_bias={int(key): value for key, value in bias.items()},
        min_tokens=2,
        logprobs=k,
        prompt_logprobs=k,
    )
    assert req.choices_per_prompt == 3
    # logprobs without echo: none of the prompt's; echo with max_tokens 0: one token, dropped
    assert (
        "prompt_logprobs" not in parsed(CompletionRequest, prompt="a", logprobs=0).sampling_kwargs()
    )
    alone = parsed(CompletionRequest, prompt="a", echo=True, max_tokens=0)
    assert alone.echo_only and alone.sampling_kwargs()["max_tokens"] == 1
    # chat: logprobs is a bool, top_logprobs the count
    chat = dict(messages=[{"role": "user", "content": "a"}])
    assert (
        parsed(ChatRequest, **chat, logprobs=True, top_logprobs=k).sampling_kwargs()["logprobs"]
        == k
    )
    assert parsed(ChatRequest, **chat, logprobs=True).sampling_kwargs()["logprobs"] == 0
    assert "logprobs" not in parsed(ChatRequest, **chat, logprobs=False).sampling_kwargs()
    # neutral or absent fields stay out, so SamplingParams' defaults hold
    assert set(parsed(CompletionRequest, prompt="a").sampling_kwargs()) == {
        "max_tokens",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
    }


@pytest.mark.parametrize("model", [CompletionRequest, ChatRequest])
def test_fields_left_out_take_the_generation_config_defaults(model):
    """vLLM's --generation-config: each sampling field a request leaves out takes the model's
    default; one it sends (0 and -1 included) is its own."""
    body = (
        dict(prompt="a")
        if model is CompletionRequest
        else dict(messages=[{"role": "user", "content": "a"}])
    )
    defaults = dict(
        temperature=rng.uniform(0.1, 2),
        top_k=rng.randint(1, 100),
        top_p=rng.uniform(0.1, 1),
        min_p=rng.uniform(0, 1),
        repetition_penalty=rng.uniform(0.5, 2),
    )
    params = parsed(model, **body).sampling_params(defaults)
    assert {k: getattr(params, k) for k in defaults} == defaults
    sent = dict(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    for name, value in sent.items():
        own = parsed(model, **body, **{name: value}).sampling_params(defaults)
        assert getattr(own, name) == (0 if name == "top_k" else value)
        others = {k: getattr(own, k) for k in defaults if k != name}
        assert others == {k: v for k, v in defaults.items() if k != name}
    assert parsed(model, **body).sampling_params() == SamplingParams(
        max_tokens=params.max_tokens, ignore_eos=False
    )


def test_requests_asking_the_same_share_one_sampling_params():
    """Requests with the same sampling fields get one SamplingParams, equal to one made from
    their kwargs; any field that differs (in value, or in JSON type alone) gets its own, and
    an invalid one is refused every time."""
    fields = dict(
        max_tokens=rng.randint(1, 99),
        temperature=rng.choice([0.0, 0.7]),
        stop=rng.choice([None, "x", ["a", "b"]]),
        stop_token_ids=rng.choice([None, [1, 2]]),
        logit_bias=rng.choice([None, {"3": 1.5}]),
        seed=rng.choice([None, 5]),
    )
    first, again = (parsed(CompletionRequest, prompt="a", **fields) for _ in range(2))
    params = first.sampling_params()
    assert again.sampling_params() is params
    assert params == SamplingParams(**first.sampling_kwargs())
    for other in (
        dict(max_tokens=fields["max_tokens"] + 1),
        dict(stop=["a", "c"]),
        dict(stop_token_ids=[1, 3]),
        dict(logit_bias={"3": 2.5}),
        dict(seed=6),
        dict(top_p=0.5),
    ):
        req = parsed(CompletionRequest, prompt="a", **{**fields, **other})
        got = req.sampling_params()
        assert got is not params and got == SamplingParams(**req.sampling_kwargs()), other
    # the same values as SamplingParams takes them, but not as JSON sent them: not one entry
    assert len({_exact(v) for v in (1, 1.0, True)}) == 3
    assert _exact([1, {"a": 1}]) != _exact([1, {"a": True}]) != _exact([1.0, {"a": 1}])
    too_many = parsed(CompletionRequest, prompt="a", logit_bias={str(i): 1.0 for i in range(300)})
    for _ in range(2):  # SamplingParams' own check, not the request's
        with pytest.raises(APIError) as e:
            too_many.sampling_params()
        assert e.value.param == "logit_bias" and "300 entries" in e.value.message


CHAT = dict(messages=[{"role": "user", "content": "a"}])


@pytest.mark.parametrize(
    "model, body, param",
    [
        (CompletionRequest, dict(logprobs=21), "logprobs"),
        (CompletionRequest, dict(logprobs=-1), "logprobs"),
        (CompletionRequest, dict(logprobs=True), "logprobs"),
        (CompletionRequest, dict(echo=1), "echo"),
        (CompletionRequest, dict(n=0), "n"),
        (CompletionRequest, dict(presence_penalty=2.5), "presence_penalty"),
        (CompletionRequest, dict(frequency_penalty=-3), "frequency_penalty"),
        (CompletionRequest, dict(repetition_penalty=0), "repetition_penalty"),
        (CompletionRequest, dict(logit_bias={"x": 1}), "logit_bias"),
        (CompletionRequest, dict(logit_bias={"-1": 1}), "logit_bias"),
        (CompletionRequest, dict(logit_bias={"5": 101}), "logit_bias"),
        (CompletionRequest, dict(logit_bias={"5": "1"}), "logit_bias"),
        (CompletionRequest, dict(logit_bias={"9" * 5000: 1}), "logit_bias"),
        (CompletionRequest, dict(min_tokens=-1), "min_tokens"),
        (CompletionRequest, dict(min_tokens=9, max_tokens=8), "min_tokens"),
        (CompletionRequest, dict(min_p=1.5), "min_p"),
        (CompletionRequest, dict(max_tokens=0), "max_tokens"),
        (ChatRequest, dict(logprobs=1), "logprobs"),
        (ChatRequest, dict(top_logprobs=2), "top_logprobs"),
        (ChatRequest, dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (ChatRequest, dict(max_completion_tokens=0), "max_completion_tokens"),
    ],
)
def test_new_fields_out_of_range_are_400_naming_the_field(model, body, param):
    body = {**(CHAT if model is ChatRequest else {"prompt": "a"}), **body}
    with pytest.raises(APIError) as e:
        parsed(model, **body)
    assert e.value.status == 400 and e.value.param == param


# ------------------------------------------------------------------------- logprobs bodies


VOCAB = 12
# Two ids share a text, as byte fragments of a multi-byte character do.
TEXTS = [f"t{i}" for i in range(VOCAB - 2)] + ["\ufffd", "\ufffd"]


def decode(token_id: int) -> str:
    return TEXTS[token_id]


def steps_for(logits: np.ndarray, chosen: list[int], k: int) -> list[dict]:
    """The engine's per-token dicts, from [T, V] logits: the k most likely tokens and the chosen
    one, each with its log-softmax and 1-based rank; decoded_token left to the server for some."""
    lsm = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    order = np.argsort(-lsm, axis=1)
    out = []
    for t, token in enumerate(chosen):
        ranks = {int(i): r + 1 for r, i in enumerate(order[t])}
        keep = {int(i) for i in order[t, :k]} | {token}
        out.append(
            {i: Logprob(float(lsm[t, i]), ranks[i], decode(i) if i % 2 else None) for i in keep}
        )
    return out, lsm, order


def test_completion_logprobs_shape_and_values():
    np_rng = np.random.default_rng(SEED)
    T, k = 7, int(np_rng.integers(0, 5))
    logits = np_rng.normal(size=(T, VOCAB)) * 3
    logits[0, 0] = -np.inf  # a token the filters ruled out: -9999, not -inf, in JSON
    chosen = [int(x) for x in np_rng.integers(0, VOCAB, size=T)]
    chosen[0] = 0
    steps, lsm, order = steps_for(logits, chosen, k)
    got = completion_logprobs(chosen, steps, k, decode, offset=3)
    assert got["tokens"] == [TEXTS[i] for i in chosen]
    assert got["token_logprobs"][0] == -9999.0
    np.testing.assert_allclose(
        got["token_logprobs"][1:], [lsm[t, i] for t, i in enumerate(chosen)][1:]
    )
    for t, i in enumerate(chosen):
        want: dict[str, float] = {}
        for j in [*order[t, :k], i]:
            want[TEXTS[j]] = max(want.get(TEXTS[j], -9999.0), max(float(lsm[t, j]), -9999.0))
        assert got["top_logprobs"][t] == pytest.approx(want)
    lengths = [len(TEXTS[i]) for i in chosen]
    assert got["text_offset"] == [3 + sum(lengths[:t]) for t in range(T)]


def test_chat_logprobs_shape_and_values():
    np_rng = np.random.default_rng(SEED + 1)
    T, k = 5, int(np_rng.integers(1, 6))
    logits = np_rng.normal(size=(T, VOCAB)) * 3
    chosen = [int(x) for x in np_rng.integers(0, VOCAB, size=T)]
    steps, lsm, order = steps_for(logits, chosen, k)
    content = chat_logprobs(chosen, steps, k, decode)["content"]
    assert [c["token"] for c in content] == [TEXTS[i] for i in chosen]
    for t, (c, i) in enumerate(zip(content, chosen, strict=True)):
        assert c["logprob"] == pytest.approx(lsm[t, i]) and c["bytes"] == list(TEXTS[i].encode())
        top = c["top_logprobs"]
        assert [e["token"] for e in top] == [TEXTS[j] for j in order[t, :k]]
        assert [e["logprob"] for e in top] == pytest.approx(list(lsm[t, order[t, :k]]))
        assert all(e["bytes"] == list(e["token"].encode()) for e in top)


def hand_output(prompt, prompt_steps, token_ids, steps, finish_reason="length"):
    """One prompt's output as the formatter reads it: one choice, finished unless
    `finish_reason` is None."""
    text = "".join(decode(i) for i in token_ids)
    choice = CompletionOutput(0, text, token_ids, None, steps, finish_reason)
    return types.SimpleNamespace(
        prompt_token_ids=prompt,
        prompt_logprobs=prompt_steps,
        outputs=[choice],
        text=text,
        finish_reason=finish_reason,
    )


def test_echo_with_logprobs_puts_the_prompts_first_and_streams_the_same():
    np_rng = np.random.default_rng(SEED + 2)
    P, G, k = 4, 3, 2
    prompt = [int(x) for x in np_rng.integers(0, VOCAB - 2, size=P)]
    gen = [int(x) for x in np_rng.integers(0, VOCAB - 2, size=G)]
    all_steps, lsm, _ = steps_for(np_rng.normal(size=(P + G, VOCAB)), prompt + gen, k)
    prompt_steps = [None, *all_steps[1:P]]  # nothing predicts the first prompt token
    out = hand_output(prompt, prompt_steps, gen, all_steps[P:])
    echo = "".join(decode(i) for i in prompt)
    fmt = Formatter("cmpl-x", NAME, chat=False, logprobs=k, decode=decode, echo=[echo])
    choice = fmt.response([out])["choices"][0]
    assert choice["text"] == echo + out.text
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(
        lp["token_logprobs"][1:], [lsm[t, i] for t, i in enumerate(prompt + gen)][1:], rtol=1e-6
    )
    for tok, off in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert choice["text"][off : off + len(tok)] == tok
    # streamed: the first piece holds the prompt; the pieces add up to the body above
    sent: dict = {}
    pieces = []
    for g in range(1, G + 1):
        finish = None if g < G else "length"
        partial = hand_output(prompt, prompt_steps, gen[:g], all_steps[P : P + g], finish)
        pieces += [json.loads(chunk)["choices"][0] for chunk in fmt.chunks(0, partial, sent)]
    assert "".join(p["text"] for p in pieces) == choice["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert sum((p["logprobs"][key] for p in pieces), []) == lp[key]
    assert isinstance(sent[0], _Sent) and sent[0].finished


@pytest.mark.parametrize("chat", [False, True])
def test_every_output_with_new_tokens_streams_a_chunk_with_text_or_without(chat):
    """An output whose new tokens add no text (a character's first bytes) still streams a
    chunk, its text "" and its tokens' logprobs with it, as vLLM streams; an output that adds
    nothing streams none."""
    rng = np.random.default_rng(SEED + 3)
    G, k = 8, 2
    gen = [int(x) for x in rng.integers(0, VOCAB - 2, size=G)]
    steps, _, _ = steps_for(rng.normal(size=(G, VOCAB)), gen, k)
    textless = set(rng.choice(G, size=4, replace=False).tolist())
    texts = ["" if j in textless else decode(t) for j, t in enumerate(gen)]
    ends = sorted({1, G, *rng.choice(np.arange(1, G), size=4).tolist()})
    schedule = [e for e in ends[:-1] for _ in range(2)] + [G]  # each output but the last twice
    fmt = Formatter("cmpl-x", NAME, chat=chat, logprobs=k, decode=decode)
    sent: dict = {}
    got = []  # (text, tokens) of each chunk
    for g in schedule:
        finish = "length" if g == G else None
        choice = CompletionOutput(0, "".join(texts[:g]), gen[:g], None, steps[:g], finish)
        out = types.SimpleNamespace(prompt_token_ids=[1], prompt_logprobs=None, outputs=[choice])
        for chunk in fmt.chunks(0, out, sent):
            c = json.loads(chunk)["choices"][0]
            if chat:
                tokens = [e["token"] for e in c["logprobs"]["content"]]
                got.append((c["delta"].get("content", ""), tokens))
            else:
                got.append((c["text"], c["logprobs"]["tokens"]))
    want = [
        ("".join(texts[a:b]), [decode(t) for t in gen[a:b]])
        for a, b in itertools.pairwise([0, *ends])
    ]
    assert got == want, f"seed {SEED}"


def _random_text(rng: random.Random) -> str:
    """Text with what JSON escapes or keeps as is: quotes, backslashes, control characters,
    non-ASCII and non-BMP characters; sometimes empty."""
    alphabet = ['"', "\\", "\n", "\t", "\x00", "\x1f", "\x7f", "é", "€", "\u2028", "😀", "a", " "]
    return "".join(rng.choice(alphabet) for _ in range(rng.choice([0, 1, 5, 40])))


def test_chunks_are_json_dumps_of_openai_chunks():
    """A streamed chunk's JSON, written field by field, is json.dumps(ensure_ascii=False) of
    the OpenAI chunk it stands for, built here from OpenAI's definition."""
    rng = random.Random(SEED)
    for _ in range(300):
        chat, role = rng.random() < 0.5, rng.random() < 0.3
        fmt = Formatter(f"cmpl-{_random_text(rng)}", _random_text(rng) or "m", chat=chat)
        index, text = rng.randrange(100), _random_text(rng)
        finish = rng.choice([None, "stop", "length"])
        logprobs = rng.choice([None, {"tokens": [text], "token_logprobs": [-rng.random()]}])
        usage = rng.choice([None, "null", {"prompt_tokens": 3, "completion_tokens": 4}])
        if chat:
            delta = {"role": "assistant", "content": text} if role else {}
            if text and not role:
                delta = {"content": text}
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text}
        choice.update(logprobs=logprobs, finish_reason=finish)
        want = {
            "id": fmt.id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": fmt.created,
            "model": fmt.model,
            "choices": [choice],
        }
        field = ""
        if usage is not None:
            want["usage"] = None if usage == "null" else usage
            field = f', "usage": {json.dumps(want["usage"])}'
        got = fmt.chunk(index, text, finish, role=role and chat, logprobs=logprobs, usage=field)
        assert got == json.dumps(want, ensure_ascii=False), f"seed {SEED}"
