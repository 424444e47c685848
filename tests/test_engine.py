"""The engine end to end on CPU: greedy parity with HF generate under every scheduling situation,
sampling, stops, bad input, aborts, and the allocator left clean."""

from __future__ import annotations

import bisect
import dataclasses
import functools
import gc
import itertools
import json
import time

import numpy as np
import pytest

from rosejax import LLM, KernelConfig, LLMEngine, SamplingParams
from rosejax.engine.serving import engine_snapshot
from rosejax.tokenizer import packaged_gpt2_tokenizer_path
from tests.conftest import (
    HF_SHAPES,
    INTERPRET,
    assert_matches_hf_greedy,
    hf_greedy_cached,
    make_hf_checkpoint,
)

SHAPE = HF_SHAPES["hd16"]
# The module's engines are shared by settings (`shared_llm`): one pytest-xdist worker compiles each.
pytestmark = pytest.mark.xdist_group("engine")

TOK = packaged_gpt2_tokenizer_path()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine-ckpt")
    model = make_hf_checkpoint(path, seed=7, **SHAPE)
    return str(path), model


def make_llm(checkpoint, **kw) -> LLM:
    # fp32 everywhere: "auto" would pick fp16 on a GPU, which HF's fp32 greedy path outdrifts.
    kw = {
        "tokenizer": TOK,
        "block_size": 8,
        "max_batch_size": 4,
        "warmup": False,
        "dtype": "float32",
    } | kw
    return LLM(checkpoint[0], **kw)


@pytest.fixture(scope="module")
def _llms(checkpoint):
    return {}


@pytest.fixture
def shared_llm(checkpoint, _llms):
    """`shared_llm(**kw)`: the module's LLM built as `make_llm(checkpoint, **kw)`, made on first
    use and shared with the other tests that ask for the same settings (building an engine and
    compiling its programs is most of a CPU test's time). For tests that only check what comes
    out and measure counters as differences; each is handed an engine with nothing queued."""

    def get(**kw) -> LLM:
        key = tuple(sorted(kw.items()))
        if key not in _llms:
            _llms[key] = make_llm(checkpoint, **kw)
        return _llms[key]

    yield get
    for llm in _llms.values():  # a failed test must not leave its requests to the next one
        engine = llm.engine
        for request in [*engine.scheduler.running, *engine.scheduler.waiting]:
            engine.abort_request(request.request_id)


def assert_clean(engine: LLMEngine) -> None:
    """Every block back on the free list, nothing queued."""
    assert not engine.has_unfinished_requests()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks - 1
    engine.allocator.check_invariants()


def random_prompts(n: int, lo: int = 1, hi: int = 40, seed=None) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, SHAPE["vocab_size"], rng.integers(lo, hi)).tolist() for _ in range(n)]


GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def check_greedy(checkpoint, outputs, prompts, n=24):
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_matches_hf_greedy(checkpoint[1], prompt, out.token_ids, n)
        assert out.finish_reason == "length"


def test_batch_of_different_lengths_matches_hf(checkpoint, shared_llm):
    llm = shared_llm()
    prompts = random_prompts(4)
    check_greedy(checkpoint, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)
    assert_clean(llm.engine)


def test_step_log_accounts_for_every_step(checkpoint, tmp_path):
    """With a step log each step writes one JSON line: the tokens the lines hand out are every
    generated token, the prompt tokens they prefill every prompt's, each window's rows fit its
    width, the requests move waiting -> running -> done, and the viewer splits them into bursts
    where the engine idled."""
    import os

    from bench import step_timeline

    path = tmp_path / "steps.jsonl"
    llm = make_llm(checkpoint, max_batch_size=3, decode_steps=3, step_log=str(path))
    prompts = random_prompts(5)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    check_greedy(checkpoint, outs, prompts)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines and all(s["pid"] == os.getpid() and s["replica"] == 0 for s in lines)
    assert sum(s["tokens"] for s in lines) == sum(len(o.outputs[0].token_ids) for o in outs)
    assert sum(s["prefill_tokens"] for s in lines) == sum(len(p) for p in prompts)
    assert lines[0]["waiting"] == [5, 2] and lines[0]["running"] == [0, 3]
    assert lines[-1]["waiting"][1] == 0 and lines[-1]["running"][1] == 0
    for s in lines:
        assert s["ms"] >= s["dispatch_ms"] >= 0 and s["wait_ms"] >= 0 and s["harvest_ms"] >= 0
        if s["window"] is not None:
            steps, rows, width = s["window"]
            assert 1 <= steps <= 3 and 1 <= rows <= width
    time.sleep(0.2)
    llm.generate(random_prompts(2), GREEDY, use_tqdm=False)
    steps = step_timeline.read_steps([str(path)])[os.getpid(), 0]
    split = step_timeline.bursts(steps, gap_ms=100)
    assert len(split) == 2 and sum(map(len, split)) == len(steps) > len(lines)
    with pytest.raises(ValueError, match="--step-log"):
        make_llm(checkpoint, step_log=str(tmp_path / "no-such-dir" / "steps.jsonl"))
    prefills = sum(1 for s in split[0] if s["prefill_tokens"])
    assert prefills >= 2 and f"{prefills} with a prefill" in step_timeline.format_burst(
        split[0], None
    )


def test_more_requests_than_batch_and_multi_step_decode(checkpoint, shared_llm):
    llm = shared_llm(max_batch_size=3, decode_steps=7)
    prompts = random_prompts(7)
    check_greedy(checkpoint, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)
    assert_clean(llm.engine)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_multi_step_windows_equal_single_steps(checkpoint, shared_llm, temperature):
    """K decode steps per device call give exactly what one step per call gives."""
    prompts = random_prompts(5)
    params = SamplingParams(max_tokens=20, temperature=temperature, seed=11)
    outs = {
        k: [
            o.token_ids
            for o in shared_llm(decode_steps=k, max_batch_size=3).generate(
                prompts, params, use_tqdm=False
            )
        ]
        for k in (1, 7)
    }
    assert outs[1] == outs[7]


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
@pytest.mark.parametrize("steps_per_trip", [2, 3])
def test_steps_per_trip_equal_one_step_a_trip(checkpoint, shared_llm, steps_per_trip):
    """A decode loop that runs several steps a trip gives what one step a trip gives: windows
    of 7 steps end with steps that fill no trip (run one a trip), and rows stop inside a trip on
    their token budget or a stop token; greedy, seeded samples, and logprobs with a penalty (the
    extras program)."""
    prompts = random_prompts(6)
    params = [
        SamplingParams(max_tokens=5, temperature=0.0),
        SamplingParams(max_tokens=20, temperature=0.9, seed=11),
        SamplingParams(max_tokens=16, temperature=0.8, seed=5, stop_token_ids=[7, 11, 13, 17]),
        SamplingParams(max_tokens=9, seed=3, repetition_penalty=1.3, logprobs=2),
        SamplingParams(max_tokens=2, temperature=0.0),
        SamplingParams(max_tokens=12, temperature=1.0, seed=2, top_k=5),
    ]
    outs = {
        n: [
            (o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].finish_reason)
            for o in shared_llm(decode_steps=7, decode_steps_per_trip=n, max_batch_size=4).generate(
                prompts, params, use_tqdm=False
            )
        ]
        for n in (1, steps_per_trip)
    }
    assert outs[steps_per_trip] == outs[1]
    assert [len(t) for t, _, _ in outs[1]][::4] == [5, 2]  # (and the budgets were reached)
    assert_clean(
        shared_llm(decode_steps=7, decode_steps_per_trip=steps_per_trip, max_batch_size=4).engine
    )


@pytest.mark.parametrize("first_finish, open_steps", [(9, 8), (3, 8), (3, 2), (5, 4)])
def test_auto_window_length(checkpoint, first_finish, open_steps, monkeypatch):
    """'auto': open_decode_steps while slots are free, long windows when full, cut to the first
    finish while requests wait for a slot, but never below the open-slot window (a window of a
    step or two costs every row its fixed overhead)."""
    engine = make_llm(checkpoint, max_batch_size=2, open_decode_steps=open_steps).engine
    windows = []
    decode = engine.runner.decode
    monkeypatch.setattr(
        engine.runner, "decode", lambda b, k, *a: windows.append(k) or decode(b, k, *a)
    )
    for i, n in enumerate((20, first_finish, 30)):
        engine.add_request(
            f"r{i}", random_prompts(1)[0], SamplingParams(max_tokens=n, temperature=0)
        )
    running = engine.scheduler.running
    assert engine._window(running) == open_steps  # nothing admitted yet: slots free
    engine.step()  # admits r0 and r1 and dispatches their first window; r2 waits for a slot
    assert len(running) == 2 and engine.scheduler.waiting
    # r1 may finish after `first_finish` tokens: its slot is refilled then.
    assert windows == [max(first_finish, open_steps)]
    engine.abort_request("r2")
    assert engine._window(running) == engine.decode_steps == 32  # full, nobody waiting
    while engine.has_unfinished_requests():
        engine.step()
    assert_clean(engine)


def test_window_time_bound_keeps_the_tokens(checkpoint, shared_llm, monkeypatch):
    """max_decode_window_ms cuts "auto" windows to what fits it at the last window's time a
    step: at a bound no step fits, every window after the first read-back is one step long, and
    the tokens are those of uncut windows (HF's greedy ones; seeded sampling the same)."""
    llm = make_llm(checkpoint, max_decode_window_ms=1e-6)
    engine = llm.engine
    windows = []
    decode = engine.runner.decode
    monkeypatch.setattr(
        engine.runner, "decode", lambda b, k, *a: windows.append(k) or decode(b, k, *a)
    )
    prompts = random_prompts(3)  # a slot free: windows of open_decode_steps until cut
    check_greedy(checkpoint, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)
    # Read back one window behind: the first two are dispatched before any was read back.
    assert windows[:2] == [engine.windows.open] * 2 and set(windows[2:]) == {1}, windows
    assert engine.windows.step_seconds > 0
    sampled = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=s) for s in range(3)]
    want = shared_llm().generate(prompts, sampled, use_tqdm=False)
    got = llm.generate(prompts, sampled, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert_clean(engine)


def test_small_cache_forces_waiting_and_preemption(checkpoint):
    # 12 usable blocks of 8 tokens; each request grows to ~40-60 tokens (5-8 blocks).
    llm = make_llm(checkpoint, kv_cache_tokens=13 * 8, max_batch_size=4)
    prompts = random_prompts(5, lo=16, hi=36)
    check_greedy(checkpoint, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_clean(llm.engine)


def test_requests_added_mid_decode(checkpoint, shared_llm):
    # Short windows: 12 per request; 8 slots (the decode-width test's engine), 4 needed.
    engine = shared_llm(max_batch_size=8, decode_steps=2).engine
    prompts = random_prompts(4)
    done = {}
    engine.add_request("r0", prompts[0], GREEDY)
    engine.add_request("r1", prompts[1], GREEDY)
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 3:
            engine.add_request("r2", prompts[2], GREEDY)
        if steps == 9:
            engine.add_request("r3", prompts[3], GREEDY)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    check_greedy(checkpoint, [done[f"r{i}"] for i in range(4)], prompts)
    assert_clean(engine)


def run_waves(engine, waves: dict, aborts: dict, monkeypatch) -> tuple[dict, list]:
    """Step `engine`, adding waves[i] ({id: (prompt, params)}) before step i and aborting the
    ids aborts[i] right after it. Returns the final outputs by id and each step's events:
    ("prefill", rows that end their prompt, requests running then), ("decode",) and ("read",
    program kind)."""
    events: list[list[tuple]] = []
    prefill, decode, harvest = engine.runner.prefill, engine.runner.decode, engine._harvest

    def log(*event):
        events[-1].append(event)

    def logged_prefill(batch):  # with the rows that end their prompt, and the requests running
        ends = int(np.sum(batch["slots"] < engine.runner.num_slots))
        log("prefill", ends, len(engine.scheduler.running))
        return prefill(batch)

    monkeypatch.setattr(engine.runner, "prefill", logged_prefill)
    monkeypatch.setattr(engine.runner, "decode", lambda *a: log("decode") or decode(*a))
    monkeypatch.setattr(engine, "_harvest", lambda kind, *a: log("read", kind) or harvest(kind, *a))
    finals = {}
    while engine.has_unfinished_requests() or len(events) <= max(waves):
        for rid, (prompt, params) in waves.get(len(events), {}).items():
            engine.add_request(rid, prompt, params)
        events.append([])
        for out in engine.step():
            assert out.request_id not in finals
            if out.finished:
                finals[out.request_id] = out
        assert len(engine._pending) <= 1  # the host reads all but the newest program back
        for rid in aborts.get(len(events) - 1, ()):
            engine.abort_request(rid)
    return finals, events


@pytest.mark.parametrize(
    "extras", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "extras"]
)
def test_prefill_and_its_window_go_out_back_to_back(checkpoint, shared_llm, monkeypatch, extras):
    """Requests arrive in waves between steps: one whose first token is a stop id, one with
    max_tokens=1, one aborted right after its admission, prompts prefilled in chunks, one that
    hits the prefix cache, n=2 (and with `extras` one with a penalty, logprobs and prompt
    logprobs). Every step that prefills while requests run dispatches their decode window
    right behind the prefill, before reading anything back (with that off, such a step decodes
    nothing); both ways give HF's greedy tokens and the same seeded samples (and logprobs)."""
    engine = shared_llm(max_batch_size=8, decode_steps=3, prefill_chunk_tokens=16).engine
    greedy = functools.partial(SamplingParams, temperature=0.0)
    a, c, f = random_prompts(3, lo=20, hi=21)
    first = hf_greedy_cached(checkpoint[1], tuple(c), 1)[0]
    f = a[:16] + f[:5]  # a's first two blocks, in the prefix cache once a's first chunk ran
    waves = {
        0: {
            "a": (a, greedy(max_tokens=12)),
            "b": ([4, 5, 6], SamplingParams(max_tokens=12, seed=5)),
        },
        2: {
            "c": (c, greedy(max_tokens=12, stop_token_ids=[first])),
            "d": (random_prompts(1)[0], greedy(max_tokens=1)),
            "e": (random_prompts(1)[0], greedy(max_tokens=20)),
        },
        3: {"f": (f, greedy(max_tokens=12)), "g": (random_prompts(1, 40, 41)[0], greedy())},
        5: {"h": ([7, 8], SamplingParams(max_tokens=8, seed=9, n=2, top_k=30))},
        8: {"i": (random_prompts(1)[0], greedy(max_tokens=12))},
    }
    if extras:
        extra = SamplingParams(seed=3, repetition_penalty=1.3, logprobs=2, prompt_logprobs=1)
        waves[3]["j"] = (a[:18], extra)
    prompts = {rid: p for wave in waves.values() for rid, p in wave.items()}
    runs = {}
    for overlap in (True, False):  # the prefix cache then holds every prompt: run it second
        monkeypatch.setattr(engine, "prefill_overlap", overlap)
        hits = engine.allocator.prefix_hit_tokens
        runs[overlap] = run_waves(engine, waves, {2: ["e"]}, monkeypatch)
        assert_clean(engine)
        if overlap:
            assert engine.allocator.prefix_hit_tokens - hits >= 16
    for overlap, (finals, events) in runs.items():
        assert sorted(finals) == sorted(set(prompts) - {"e"})
        for rid in "acdfgi":
            n = len(finals[rid].token_ids)
            assert_matches_hf_greedy(checkpoint[1], prompts[rid][0], finals[rid].token_ids, n)
        assert finals["c"].token_ids == [first] and finals["c"].finish_reason == "stop"
        assert len(finals["d"].token_ids) == 1 and finals["d"].finish_reason == "length"
        assert [len(finals[r].token_ids) for r in "afgi"] == [12, 12, 16, 12]
        # Steps that prefilled first tokens while requests were running.
        prefilling = [e for e in events if e and e[0][0] == "prefill" and min(e[0][1:]) > 0]
        assert prefilling
        for step in prefilling:
            # Dispatches first, then reads (oldest first); a decode right behind the prefill.
            kinds = [e[0] for e in step]
            assert kinds == sorted(kinds, key=lambda k: k == "read")
            assert (kinds[:2] == ["prefill", "decode"]) == overlap, step
    on, off = (
        {r: [(c.token_ids, c.text) for c in o.outputs] for r, o in runs[x][0].items()}
        for x in (True, False)
    )
    assert on == off
    if extras:
        j = [runs[x][0]["j"] for x in (True, False)]
        assert len(j[0].outputs[0].logprobs) == 16 and len(j[0].prompt_logprobs) == 18
        on, off = (list(o.outputs[0].logprobs) + list(o.prompt_logprobs[1:]) for o in j)
        for got, want in zip(on, off, strict=True):
            assert got.keys() == want.keys()
            assert [v.logprob for v in got.values()] == pytest.approx(
                [v.logprob for v in want.values()], abs=1e-5
            )


def test_prefix_caching_same_outputs_fewer_prefill_tokens(checkpoint, shared_llm):
    rng = np.random.default_rng()
    shared = rng.integers(0, SHAPE["vocab_size"], 33).tolist()  # 4 full blocks of 8 + 1
    prompts = [shared + rng.integers(0, SHAPE["vocab_size"], int(n)).tolist() for n in (3, 9, 1)]
    results = {}
    for on in (True, False):
        llm = shared_llm(enable_prefix_caching=on, max_batch_size=1)
        computed = llm.engine.prefill_tokens_computed
        results[on] = (
            llm.generate(prompts, GREEDY, use_tqdm=False),
            llm.engine.prefill_tokens_computed - computed,
        )
        assert_clean(llm.engine)
    check_greedy(checkpoint, results[True][0], prompts)
    assert [o.token_ids for o in results[True][0]] == [o.token_ids for o in results[False][0]]
    assert results[False][1] == sum(len(p) for p in prompts)
    assert results[True][1] <= results[False][1] - 2 * 32


def test_blocks_filled_by_decode_serve_the_next_turn(checkpoint, shared_llm):
    # A chat's second turn repeats the first turn's prompt and output: the blocks that decode
    # filled (here all three: the prompt is shorter than a block) must be found by their hashes.
    llm = shared_llm(enable_prefix_caching=True, max_batch_size=1)
    prompt = random_prompts(1, 5, 6)[0]
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]  # 5 + 24 tokens, 28 in the cache
    turn2 = prompt + first.token_ids + random_prompts(1, 3, 4)[0]
    hits = llm.engine.allocator.prefix_hit_tokens
    second = llm.generate([turn2], GREEDY, use_tqdm=False)[0]
    assert llm.engine.allocator.prefix_hit_tokens - hits == 3 * 8
    assert_matches_hf_greedy(checkpoint[1], turn2, second.token_ids, 24)
    assert_clean(llm.engine)


def test_output_independent_of_batch(checkpoint, shared_llm):
    prompt = random_prompts(1)[0]
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234)
    # Alone in a one-slot engine; in the crowd, an engine that never saw `prompt` (its prefill
    # must not come from cached blocks).
    alone = shared_llm(enable_prefix_caching=False, max_batch_size=1)
    alone = alone.generate([prompt], sampled, use_tqdm=False)[0]
    crowd = shared_llm().generate(
        random_prompts(2) + [prompt] + random_prompts(3),
        [SamplingParams(max_tokens=20, temperature=1.0)] * 2
        + [sampled]
        + [SamplingParams(max_tokens=12, temperature=0.0)] * 3,
        use_tqdm=False,
    )[2]
    assert alone.token_ids == crowd.token_ids


def test_seed_reproduces_and_temperature_zero_is_greedy(checkpoint, shared_llm):
    llm = shared_llm()
    prompt = random_prompts(1)[0]
    p = SamplingParams(max_tokens=16, temperature=1.2, seed=99)
    a, b = llm.generate([prompt, prompt], p, use_tqdm=False)
    c = llm.generate(
        [prompt], SamplingParams(max_tokens=16, temperature=1.2, seed=100), use_tqdm=False
    )[0]
    assert a.token_ids == b.token_ids != c.token_ids
    # Seeds are 64-bit: 2**32 + 99 is not seed 99; -99 is 2**64 - 99 (two's complement).
    high, neg, wrapped = (
        llm.generate(
            [prompt], SamplingParams(max_tokens=16, temperature=1.2, seed=s), use_tqdm=False
        )[0]
        for s in (2**32 + 99, -99, 2**64 - 99)
    )
    assert high.token_ids != a.token_ids and neg.token_ids == wrapped.token_ids
    g = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0]
    assert_matches_hf_greedy(checkpoint[1], prompt, g.token_ids, 16)
    assert_clean(llm.engine)


def test_stop_token_ids_stop_strings_and_context_limit(checkpoint, shared_llm):
    llm = shared_llm()
    prompt = random_prompts(1, 5, 6)[0]
    full = hf_greedy_cached(checkpoint[1], tuple(prompt), 24)
    stop_id = full[10]
    out = llm.generate(
        [prompt],
        SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0]
    assert out.token_ids == full[: full.index(stop_id) + 1] and out.finish_reason == "stop"
    # A stop string: the text of two middle tokens; nothing from it onwards is returned. Not a
    # pair that splits a character's bytes (its text then is not in the whole text's).
    text = llm.engine.tokenizer.decode(full)
    pairs = (llm.engine.tokenizer.decode(full[i : i + 2]) for i in range(12, len(full) - 1))
    stop = next(p for p in pairs if p.strip() and "\ufffd" not in p and p in text)
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0, stop=[stop]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]
    # The context ends generation with "length".
    long_prompt = random_prompts(1, 120, 121)[0]
    out = llm.generate([long_prompt], SamplingParams(max_tokens=50, temperature=0), use_tqdm=False)[
        0
    ]
    assert len(out.token_ids) == SHAPE["n_positions"] - 120 and out.finish_reason == "length"
    assert_matches_hf_greedy(checkpoint[1], long_prompt, out.token_ids, 8)
    # A prompt that fills the context still gets the token its prefill samples.
    full_prompt = random_prompts(1, SHAPE["n_positions"], SHAPE["n_positions"] + 1)[0]
    out = llm.generate([full_prompt], GREEDY, use_tqdm=False)[0]
    assert_matches_hf_greedy(checkpoint[1], full_prompt, out.token_ids, 1)
    assert out.finish_reason == "length"
    assert_clean(llm.engine)


def test_outputs_carry_when_each_request_arrived_was_scheduled_and_got_its_first_token(
    shared_llm,
):
    """RequestOutput.metrics (vLLM's): arrival <= first prefill <= first token read back, all
    within the generate call, the same in every output of a request: its times are set once,
    though a cache this small preempts requests, which are prefilled again."""
    engine = shared_llm(kv_cache_tokens=13 * 8).engine  # as the preemption test's
    preemptions = engine.scheduler.num_preemptions
    start = time.monotonic()
    streams: dict[str, list] = {}
    for rid, prompt in enumerate(random_prompts(5, lo=16, hi=36)):
        engine.add_request(str(rid), prompt, GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():  # a copy of each: what the output said then
            streams.setdefault(out.request_id, []).append(dataclasses.replace(out.metrics))
    end = time.monotonic()
    assert engine.scheduler.num_preemptions > preemptions
    for times in streams.values():
        m = times[0]
        assert start <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= end
        assert m.time_in_queue == m.first_scheduled_time - m.arrival_time
        assert all(t == m for t in times)


def test_streaming_pieces_add_up(checkpoint, shared_llm):
    llm = shared_llm()
    prompts = random_prompts(3)
    pieces: dict[str, list] = {}
    finals = {}
    for out in llm.generate_stream(prompts, GREEDY):
        pieces.setdefault(out.request_id, []).append(out)
        if out.finished:
            finals[out.request_id] = out
    assert len(finals) == 3
    for rid, outs in pieces.items():
        assert sum((o.new_token_ids for o in outs), []) == finals[rid].token_ids
        assert "".join(o.new_text for o in outs) == finals[rid].text
        assert len(outs) > 1
    assert_clean(llm.engine)


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], GREEDY, "empty"),
        ("", GREEDY, "empty"),
        (list(range(SHAPE["n_positions"] + 1)), GREEDY, "maximum context length is"),
        ([1, 2, 3], {"max_tokens": 0}, "max_tokens"),
        ([1, 2, 3], {"temperature": -0.5}, "temperature"),
        ([1, 2, 3], {"top_p": 0.0}, "top_p"),
        ([1, 2, 3], {"top_p": 1.5}, "top_p"),
        ([1, 2, 3], {"top_k": -2}, "top_k"),
        ([5000], GREEDY, "token ids must be in"),
        (None, GREEDY, "a prompt is a str or a list of token ids"),
        ([1.5, 2], GREEDY, "token ids must be ints"),
        ([True, 2], GREEDY, "token ids must be ints"),
        ("\ud800", GREEDY, "cannot be tokenized"),
        ({"prompt_ids": [1, 2]}, GREEDY, "prompt dict"),
    ],
)
def test_bad_input_is_rejected_and_engine_keeps_serving(
    checkpoint, shared_llm, prompt, params, match
):
    llm = shared_llm()
    good = random_prompts(2)
    with pytest.raises(ValueError, match=match):
        if isinstance(params, dict):
            params = SamplingParams(**params)
        llm.generate(good + [prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # all or nothing
    check_greedy(checkpoint, llm.generate(good, GREEDY, use_tqdm=False), good)
    assert_clean(llm.engine)


def test_vllm_prompt_dicts_and_bad_argument_types(checkpoint, shared_llm):
    """vLLM's {"prompt_token_ids": ...} and {"prompt": ...} are prompts; arguments of the wrong
    type are a ValueError (not a TypeError from deep inside), and the engine serves on."""
    llm = shared_llm()
    good = random_prompts(2)
    text = str(np.random.default_rng().choice(list("abcdefgh")))  # one id inside the vocab
    wrapped = [{"prompt_token_ids": good[0]}, {"prompt": text}, good[1]]
    outs = llm.generate(wrapped, GREEDY, use_tqdm=False)
    plain = llm.generate([good[0], text, good[1]], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    check_greedy(checkpoint, [outs[0], outs[2]], good)
    for prompts, params in ((5, GREEDY), (good, {"max_tokens": 2}), (good, 3), (good, ["x"])):
        with pytest.raises(ValueError):
            llm.generate(prompts, params, use_tqdm=False)
    assert_clean(llm.engine)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing"), warmup=False)


def three_running(shared_llm, max_tokens: int, steps: int) -> LLMEngine:
    """The shared engine (2-step windows) with greedy requests r0, r1, r2 of random prompts,
    `steps` steps into serving them."""
    engine = shared_llm(max_batch_size=8, decode_steps=2).engine
    for i, p in enumerate(random_prompts(3, 10, 30)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0))
    for _ in range(steps):
        engine.step()
    return engine


def test_abort_mid_decode_frees_blocks(checkpoint, shared_llm):
    engine = three_running(shared_llm, max_tokens=40, steps=4)
    used = engine.allocator.num_used_blocks
    assert "r1" in [r.request_id for r in engine.scheduler.running]
    engine.abort_request("r1")
    assert engine.allocator.num_used_blocks < used
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "r1"
    assert_clean(engine)


def test_a_row_the_device_stops_ends_its_request_with_an_error(checkpoint, shared_llm):
    """Should the device stop a row the host still runs (here: its kill flag set behind the
    host's back), that request ends with an error instead of waiting for tokens forever, and
    the others are served to the end."""
    engine = three_running(shared_llm, max_tokens=12, steps=3)
    (victim,) = [r for r in engine.scheduler.running if r.request_id == "r1"]
    engine._kill[victim.slot] = True
    outs = {}
    for _ in range(100):  # bounded: a row that never ends would loop here
        if not engine.has_unfinished_requests():
            break
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    assert sorted(outs) == ["r0", "r1", "r2"]
    assert outs["r1"].finish_reason == "error" and "device stopped" in outs["r1"].error
    assert [len(outs[r].token_ids) for r in ("r0", "r2")] == [12, 12]
    assert_clean(engine)


def test_nothing_recompiles_after_warmup(checkpoint):
    gc.unfreeze()
    try:
        llm = make_llm(checkpoint, max_batch_size=2, warmup=True, decode_steps=2)
        # what the warm-up compiled is out of the collector's view, as a server's
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # the rest of this process's tests collect as before
    compiles = llm.engine.num_compiles
    assert compiles > 0 and llm.engine.compile_seconds > 0
    llm.generate(
        random_prompts(3),
        [
            GREEDY,
            SamplingParams(max_tokens=9, top_k=5, seed=3),
            SamplingParams(max_tokens=5, top_p=0.5),
        ],
        use_tqdm=False,
    )
    llm.generate(random_prompts(2), SamplingParams(max_tokens=7, temperature=0.3), use_tqdm=False)
    assert llm.engine.num_compiles == compiles
    assert_clean(llm.engine)


def test_text_prompts_round_trip(tmp_path):
    """A model whose vocab covers the real tokenizer: text in, text out, tokenizer files found."""
    import shutil

    make_hf_checkpoint(
        tmp_path, seed=3, vocab_size=50257, n_positions=64, n_embd=32, n_layer=1, n_head=2
    )
    for f in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TOK}/{f}", tmp_path / f)
    llm = LLM(str(tmp_path), block_size=16, max_batch_size=2, warmup=False)
    out = llm.generate(
        "Hello, my name is", SamplingParams(max_tokens=8, temperature=0), use_tqdm=False
    )[0]
    assert out.prompt_token_ids == [15496, 11, 616, 1438, 318]
    assert out.text == llm.engine.tokenizer.decode(out.token_ids)


def test_cublas_threshold_keeps_outputs(checkpoint):
    """Decode programs built with and without per-program compiler options give the same greedy
    tokens. On a CPU the option is accepted and ignored, so there this checks the plumbing (an
    unknown option fails the compile); on a GPU it compares cuBLAS with Triton GEMMs."""
    outs = []
    for threshold in (1, 100000):
        llm = make_llm(checkpoint, kernels=KernelConfig(cublas_min_batch=threshold))
        res = llm.generate(
            [[1, 2, 3], [4, 5]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        )
        outs.append([r.token_ids for r in res])
    assert outs[0] == outs[1] and all(len(t) == 6 for t in outs[0])


def test_prefills_run_only_in_warmup_shapes(checkpoint, monkeypatch):
    """Admission counts the padded batch a prefill runs in, so a long prompt next to many short
    ones cannot make a (rows, tokens) bucket that warm-up does not compile: 1 x 70 tokens and
    12 x 2 tokens under a 256-token budget would pad to 16 x 128 if admitted together."""
    llm = make_llm(checkpoint, max_batch_size=16, max_prefill_tokens=256)
    engine = llm.engine
    used = []
    prefill = engine.runner.prefill
    monkeypatch.setattr(
        engine.runner, "prefill", lambda batch: used.append(batch["tokens"].shape) or prefill(batch)
    )
    rng = np.random.default_rng()
    prompts = [rng.integers(1, 1000, 70).tolist()] + [rng.integers(1, 1000, 2).tolist()] * 12
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [3] * len(prompts)
    allowed = set(engine.prefill_shapes())
    assert used and all(s in allowed for s in used), (used, allowed)
    assert_matches_hf_greedy(checkpoint[1], prompts[0], outs[0].token_ids, 3)


def test_auto_window_stops_at_the_context_limit(checkpoint, shared_llm, monkeypatch):
    """With a request waiting for the only slot, the auto window ends where the running request
    must finish: here the context (128) runs out 8 tokens in, long before its max_tokens."""
    llm = shared_llm(enable_prefix_caching=True, max_batch_size=1)
    engine = llm.engine
    windows = []
    decode = engine.runner.decode
    monkeypatch.setattr(
        engine.runner, "decode", lambda b, k, *a: windows.append(k) or decode(b, k, *a)
    )
    rng = np.random.default_rng()
    prompts = [rng.integers(1, 1000, 120).tolist(), [5, 6]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    assert len(outs[0].token_ids) == 8 and outs[0].finish_reason == "length"
    assert len(outs[1].token_ids) == 100
    # The first window is dispatched before the prefill's token is read back: 8 steps, not 32.
    assert windows[0] == 8


def spy_kernels(monkeypatch, module, names: list[str], calls=None) -> list[tuple[str, int]]:
    """Record (kernel, rows of its first argument) of every traced call the model makes through
    `module`'s names into `calls` (a new list if None); the calls themselves run unchanged."""
    calls = [] if calls is None else calls

    def spy(name, kernel):
        def call(x, *args, **kwargs):
            calls.append((name, x.shape[-2] if x.ndim > 1 else x.shape[0]))
            return kernel(x, *args, **kwargs)

        monkeypatch.setattr(module, name, call)

    for name in names:
        spy(name, getattr(module, name))
    return calls


@pytest.mark.parametrize("layer_norm", ["pallas", "xla"])
def test_layer_kernels_match_hf(checkpoint, monkeypatch, layer_norm):
    """The GPU's layer kernels (one-kernel layer norm, matmul with fused bias/GELU/residual, the
    residual projections' partial sums added inside the next layer norm), chosen by the kernel
    config and interpreted here, wired into the whole model: greedy outputs still match HF.
    Decode batches (<= 16 rows) and these short prefills both take the kernels; K is split one
    tile a program, so the partial sums come in several splits. With the layer-norm kernel off,
    XLA adds the partial sums up instead."""
    from rosejax.layers import layer_norm as ln_layer
    from rosejax.layers import linear as linear_layer

    calls = spy_kernels(monkeypatch, linear_layer, ["linear", "linear_partial_sums"])
    spy_kernels(monkeypatch, ln_layer, ["layer_norm", "add_layer_norm"], calls)
    kernels = KernelConfig(
        layer_norm=layer_norm,
        linear="pallas",
        tiles=(("linear", "block_k", 16), ("linear", "max_k_steps", 1)),
        interpret=INTERPRET,
    )
    llm = make_llm(checkpoint, kernels=kernels)
    prompts = random_prompts(3)
    check_greedy(checkpoint, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)
    assert_clean(llm.engine)
    # Every kernel ran, the matmuls only on decode-sized calls (<= 16 rows).
    want = {"linear", "linear_partial_sums"}
    want |= {"layer_norm", "add_layer_norm"} if layer_norm == "pallas" else set()
    assert {name for name, _ in calls} == want
    assert max(rows for name, rows in calls if name.startswith("linear")) <= 16


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_xla_split_k_decode_matches_hf(checkpoint, monkeypatch):
    """Decode steps of `xla_split_k_min_rows` rows or more run the residual projections as two
    partial sums of one XLA GEMM, added inside the next layer norm's kernel: greedy outputs
    still match HF; prefills (and the XLA matmuls' own epilogues) are untouched."""
    from rosejax.layers import layer_norm as ln_layer

    calls = []
    add_layer_norm = ln_layer.add_layer_norm

    def spy(partials, *args, **kwargs):
        calls.append(partials.shape)
        return add_layer_norm(partials, *args, **kwargs)

    monkeypatch.setattr(ln_layer, "add_layer_norm", spy)
    kernels = KernelConfig(layer_norm="pallas", xla_split_k_min_rows=2, interpret=INTERPRET)
    llm = make_llm(checkpoint, kernels=kernels)
    prompts = random_prompts(3)
    check_greedy(checkpoint, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)
    assert_clean(llm.engine)
    # Decode programs of 2+ rows (the 4-row bucket): two per layer, of two splits each.
    assert calls and {shape[0] for shape in calls} == {2} and {shape[1] for shape in calls} >= {4}


@pytest.mark.parametrize("fused", [True, False], ids=["append_fused", "kv_append_dispatcher"])
def test_attention_kernels_match_hf(checkpoint, monkeypatch, fused):
    """The GPU's decode attention, chosen by the kernel config and interpreted here, wired into
    the whole model: greedy outputs still match HF, whether the attention kernel writes each
    step's K/V itself or the kv_append kernels do (`fused_kv_append`). Decode steps only:
    prefill chunks always append through the kv_append dispatcher."""
    from rosejax.layers import attention

    calls = spy_kernels(
        monkeypatch, attention, ["paged_decode_attention", "paged_decode_attention_append"]
    )
    kernels = KernelConfig(attention="pallas", fused_kv_append=fused, interpret=INTERPRET)
    llm = make_llm(checkpoint, kernels=kernels)
    prompts = random_prompts(3)
    check_greedy(checkpoint, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)
    assert_clean(llm.engine)
    want = "paged_decode_attention_append" if fused else "paged_decode_attention"
    assert {name for name, _ in calls} == {want}


def test_changing_kernels_compiles_the_other_program(checkpoint, monkeypatch):
    """The kernel config is part of every program's jit key: the same engine, handed another
    config in the same process, compiles and runs the other program (and gives the same
    tokens), then finds the first one again without compiling."""
    from rosejax.layers import layer_norm as ln_layer

    calls = spy_kernels(monkeypatch, ln_layer, ["layer_norm", "add_layer_norm"])
    # Every run prefills the same shapes; XLA's layer norm first, whatever the backend's default.
    llm = make_llm(checkpoint, enable_prefix_caching=False, kernels=KernelConfig())
    engine = llm.engine
    prompts = random_prompts(2)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    xla = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    compiled = engine.num_compiles
    assert not calls

    engine.runner.kernels = KernelConfig(layer_norm="pallas", interpret=INTERPRET)
    pallas = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert engine.num_compiles > compiled and calls
    assert pallas == xla

    engine.runner.kernels = KernelConfig()
    compiled, traced = engine.num_compiles, len(calls)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == xla
    assert engine.num_compiles == compiled and len(calls) == traced


def test_decode_width_follows_the_running_requests(checkpoint, shared_llm, monkeypatch):
    """Bursts that leave survivors in high slots, in every order of which slots survive: each
    decode window runs at the smallest bucket that holds the running requests, survivors are
    moved down with their state (greedy and seeded-sampled tokens equal HF's / a lone run's),
    and a request arriving afterwards decodes alone at width 1."""
    llm = shared_llm(max_batch_size=8, decode_steps=2, min_decode_batch=1)
    engine = llm.engine
    widths = []  # (program batch, requests running)
    decode = engine.runner.decode
    monkeypatch.setattr(
        engine.runner,
        "decode",
        lambda b, *a: widths.append((b, len(engine.scheduler.running))) or decode(b, *a),
    )
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_k=20, seed=5)
    lone = shared_llm().generate([[7, 8, 9]], sampled, use_tqdm=False)[0].token_ids
    for survivors in itertools.permutations([5, 6, 7], 2):  # two of the high slots survive
        prompts = random_prompts(8, hi=12)
        params = [SamplingParams(max_tokens=2 + i % 3, temperature=0.0) for i in range(8)]
        for slot, n in zip(survivors, (14, 16), strict=True):
            params[slot] = SamplingParams(max_tokens=n, temperature=0.0)
        prompts[survivors[1]], params[survivors[1]] = [7, 8, 9], sampled
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, p, out in zip(prompts, params, outs, strict=True):
            if p is sampled:
                assert out.token_ids == lone
            else:
                assert_matches_hf_greedy(checkpoint[1], prompt, out.token_ids, p.max_tokens)
        assert_clean(engine)
    buckets = engine.decode_buckets
    assert all(b == buckets[bisect.bisect_left(buckets, n)] for b, n in widths), widths
    assert any(n <= 2 for _, n in widths)  # the survivors ran alone, at width <= 2
    widths.clear()
    out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]
    assert_matches_hf_greedy(checkpoint[1], (1, 2, 3), out.token_ids, 24)
    assert {b for b, _ in widths} == {1}


def test_out_of_memory_names_the_flags_to_lower(checkpoint, monkeypatch):
    """A device that runs out of memory while the engine is built gives an error that says which
    settings to lower, not a bare RESOURCE_EXHAUSTED."""
    from rosejax.engine import llm_engine

    def exhausted(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.8GiB")

    monkeypatch.setattr(llm_engine, "init_kv_cache", exhausted)
    with pytest.raises(ValueError, match="kv-cache-memory-fraction.*max-batch-size"):
        make_llm(checkpoint)


def test_cache_size_is_logged(checkpoint, caplog):
    caplog.set_level("INFO", logger="rosejax")
    engine = make_llm(checkpoint, kv_cache_tokens=100).engine
    blocks = engine.allocator.num_blocks - 1
    assert f"KV cache: {blocks} blocks of 8 tokens, {blocks * 8} tokens" in caplog.text


def test_first_programs_compiled_ahead_together_then_the_rest(checkpoint, caplog):
    """A server compiles what a first request needs up front, together, and the rest ahead one
    at a time, without running them (or by warm-up, running them), then runs each once while
    idle: the first three are the smallest prefill and decode (greedy and sampled) programs,
    each program is traced once and logged, and the requests then run on those executables
    (nothing traces again) with HF's greedy tokens."""
    caplog.set_level("INFO", logger="rosejax")
    llm = make_llm(checkpoint, max_batch_size=2, decode_steps=2)
    engine = llm.engine
    programs = engine.warmup_programs()
    assert len(set(programs)) == len(programs)
    first = programs[:3]
    assert first[0] == ("prefill", 1, engine.prefill_len_buckets[0])
    assert first[1:] == [("decode", engine.decode_buckets[0], g) for g in (True, False)]
    engine.compile_ahead(*first, first[0])
    assert engine.num_compiles == 3 and caplog.text.count("ahead in") == 3
    engine.warmup(programs[:5])  # two of them not compiled yet
    assert engine.num_compiles == 5 and " program 2/2 " in caplog.text
    for program in programs:
        engine.compile_ahead(program)
    assert engine.num_compiles == len(programs)
    assert caplog.text.count("ahead in") == len(programs) - 2
    # Then, idle, each program compiled ahead runs once (a first run costs more than the rest),
    # in warm-up's order; the two warm-up ran, no other. Until it has, a server's gauge of
    # programs to compile counts it.
    assert engine.programs_to_run == len(programs) - 2
    assert engine_snapshot(engine, 0)["programs_to_compile"] == len(programs) - 2
    ran, runner = [], engine.runner
    prefill, decode = runner.prefill, runner.decode
    runner.prefill = lambda batch: ran.append(("prefill", *batch["tokens"].shape)) or prefill(batch)
    runner.decode = lambda rows, steps, greedy, *rest: (
        ran.append(("decode", rows, greedy)) or decode(rows, steps, greedy, *rest)
    )
    while engine.run_ahead():
        pass
    del runner.prefill, runner.decode
    assert ran == [p for p in programs if p not in programs[3:5]]
    assert engine_snapshot(engine, 1)["programs_to_compile"] == 1
    prompts = random_prompts(2, lo=9, hi=20)  # a prefill shape past the first one
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_hf_greedy(checkpoint[1], prompt, out.token_ids, 5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, top_k=3), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [5, 5]
    assert engine.num_compiles == len(programs)
