"""A request's host record of its tokens: fed a decode window at a time, against a spec; and
its logprobs (FlatLogprobs) read as the dicts of their definition."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rosejax.engine.request import FlatLogprobs, Logprob, Request
from rosejax.sampling import SamplingParams, TokenLogprobs
from rosejax.tokenizer import IncrementalDetokenizer, load_tokenizer

EOS = 50256
# A few ids, so stop ids are drawn often; ' the', ',', '.', '!', 'Hello', a UTF-8 fragment.
IDS = [262, 11, 13, 0, 15496, 447, EOS]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("random:gpt2")


def _request(tok, params: SamplingParams, prompt_len: int = 3, max_context: int = 64) -> Request:
    return Request(
        "r", [464] * prompt_len, params, 0, IncrementalDetokenizer(tok), EOS, max_context
    )


def _feed(request: Request, tokens: list[int], cuts: list[int]) -> list[int]:
    """Feed `tokens` in windows split at `cuts`, as the engine's harvest does; -> taken per
    window."""
    taken, start = [], 0
    for end in [*sorted(cuts), len(tokens)]:
        if request.finished:
            break
        taken.append(request.add_tokens(tokens[start:end]))
        start = max(start, end)
    return taken


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.sampled_from(IDS), max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    max_tokens=st.integers(1, 30),
    stop_ids=st.lists(st.sampled_from(IDS), max_size=2),
    ignore_eos=st.booleans(),
    prompt_len=st.integers(1, 64),
)
def test_windows_record_the_spec(tok, tokens, cuts, max_tokens, stop_ids, ignore_eos, prompt_len):
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_ids, ignore_eos=ignore_eos)
    request = _request(tok, params, prompt_len)
    taken = _feed(request, tokens, cuts)
    # The spec: tokens up to the first stop id (kept), at most max_tokens and what is left of
    # the context, but at least the one its prefill samples (a prompt may fill the context).
    limit = max(1, min(max_tokens, 64 - prompt_len))
    stops = set(stop_ids) | (set() if ignore_eos else {EOS})
    first_stop = next((i for i, t in enumerate(tokens) if t in stops), None)
    end = len(tokens) if first_stop is None else first_stop + 1
    expected = tokens[: min(end, limit)]
    assert request.output_token_ids == expected and sum(taken) == len(expected)
    if first_stop is not None and first_stop < limit:
        reason = "stop"
    else:
        reason = "length" if len(expected) == limit else None
    assert request.finish_reason == reason
    # Finished: all of its text; running: what is complete so far (a held-back character waits).
    text = tok.decode(expected)
    assert request.text == text if reason else text.startswith(request.text)
    out = request.take_completion()
    assert out.token_ids == expected and out.finished() == (reason is not None)


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.sampled_from(IDS[:5]), max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=5),
    stop=st.sampled_from([[","], ["!"], ["Hello,"], [" the the", "."], ["xyz"]]),
)
def test_stop_strings_end_at_the_token_that_completes_one(tok, tokens, cuts, stop):
    # ASCII tokens only, so the text after each token is decode() of the tokens so far.
    ids, text, reason = tokens, tok.decode(tokens), "length" if len(tokens) == 30 else None
    for j in range(len(tokens)):
        so_far = tok.decode(tokens[: j + 1])
        hits = [i for s in stop if (i := so_far.find(s)) >= 0]
        if hits:
            ids, text, reason = tokens[: j + 1], so_far[: min(hits)], "stop"
            break
    for window_cuts in (cuts, list(range(len(tokens)))):
        request = _request(tok, SamplingParams(max_tokens=30, stop=stop))
        _feed(request, tokens, window_cuts)
        assert request.output_token_ids == ids and request.finish_reason == reason
        # While running, a tail that could grow into a stop string is held back.
        assert request.text == text if reason else text.startswith(request.take_completion().text)


@settings(max_examples=60, deadline=None)
@given(
    windows=st.lists(st.integers(0, 9), max_size=6),
    top=st.integers(0, 4),
    capacity=st.integers(0, 8),
    leading_none=st.booleans(),
    named=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_flat_logprobs_read_as_vllm_dicts(windows, top, capacity, leading_none, named, seed):
    """Fed a window at a time (past its capacity), FlatLogprobs reads as vLLM's list of dicts:
    per token {token: Logprob(its logprob, its rank, its text)}, then the top ones with ranks
    1..top (a token among them takes its place); a snapshot keeps what it held."""
    rng = np.random.default_rng(seed)
    vocab, width = 6, 5  # few ids: the token is often among the top ones
    texts = {i: f"<{i}>" for i in range(vocab)}
    flat = FlatLogprobs(top, texts if named else None, leading_none, capacity)
    want: list = [None] if leading_none else []
    snapshots = []
    for t in windows:
        tokens = rng.integers(0, vocab, t)
        lp = TokenLogprobs(
            rng.normal(size=t).astype(np.float32),
            rng.integers(1, vocab + 1, t).astype(np.int32),
            rng.integers(0, vocab, (t, width)).astype(np.int32),
            rng.normal(size=(t, width)).astype(np.float32),
        )
        flat.extend(tokens, lp)
        for i in range(t):
            token = int(tokens[i])
            entry = {token: Logprob(float(lp.logprob[i]), int(lp.rank[i]), texts[token])}
            for place in range(1, top + 1):
                alt = int(lp.top_ids[i, place - 1])
                entry[alt] = Logprob(float(lp.top_logprobs[i, place - 1]), place, texts[alt])
            if not named:
                entry = {k: Logprob(v.logprob, v.rank, None) for k, v in entry.items()}
            want.append(entry)
        snapshots.append((flat.snapshot(), list(want)))
    assert len(flat) == len(want) and flat == want and list(flat) == want
    for i in range(-len(want), len(want)):
        assert flat[i] == want[i]
        if want[i] is not None:  # the token first, as vLLM's dicts have it
            assert next(iter(flat[i])) == next(iter(want[i]))
    for cut in (slice(1, None), slice(None, -2), slice(None, None, 2), slice(3, 1)):
        assert flat[cut] == want[cut]
    with pytest.raises(IndexError):
        flat[len(want)]
    for snapshot, held in snapshots:
        assert snapshot == held and len(snapshot) == len(held)
