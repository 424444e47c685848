"""vLLM's sampling parameters through the engine on CPU (fp32, random-weight checkpoints):
logprobs and prompt logprobs against transformers' log_softmax, n sequences sharing their
prompt's blocks, penalties, logit_bias and min_tokens against references written from their
definitions, and plain requests untouched by the ones that use them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rosejax import LLM, SamplingParams
from rosejax.engine.request import Logprob
from tests.conftest import HF_SHAPES, make_hf_checkpoint
from tests.test_llama_family import BLOCK_SIZE as BLOCK
from tests.test_llama_family import SHAPES, make_checkpoint, make_llm

SHAPE = HF_SHAPES["hd16"]  # vocab 1000, context 128
EOS = 7  # inside the vocabulary, so min_tokens has an EOS to hold off


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("sampling-params-ckpt")
    model = make_hf_checkpoint(path, seed=3, eos_token_id=EOS, bos_token_id=EOS, **SHAPE)
    return str(path), model


@pytest.fixture(scope="module")
def llm(checkpoint):
    """One engine for the module's tests (compiling is most of their time): decode windows
    always 4 rows wide, so each test's batches of 4 share programs; prompts longer than 16
    tokens are prefilled in chunks."""
    return make_llm(checkpoint[0], prefill_chunk_tokens=16, min_decode_batch=4)


def assert_clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks - 1
    engine.allocator.check_invariants()


def random_prompts(n: int, lo: int = 2, hi: int = 30) -> list[list[int]]:
    rng = np.random.default_rng()
    return [rng.integers(8, SHAPE["vocab_size"], rng.integers(lo, hi)).tolist() for _ in range(n)]


def hf_log_softmax(model, ids: list[int]) -> np.ndarray:
    """[len(ids), V]: transformers' log_softmax of the logits at every position."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def check_logprob_dict(entry: dict[int, Logprob], token: int, ref: np.ndarray, top: int) -> None:
    """One token's dict against the reference row: its own logprob and rank (tokens at least
    as likely), and the top ones in order with ranks 1..top (near-ties either way), each logprob
    within 1e-4."""
    assert isinstance(entry[token], Logprob) and list(entry)[0] == token
    assert abs(entry[token].logprob - ref[token]) < 1e-4
    # Its rank counts the tokens at least as likely; ones within the logprob tolerance of it
    # may fall either side (the engine's logits are not HF's to the last bit).
    surely_above = int(np.sum(ref > ref[token] + 1e-4))
    assert surely_above + 1 <= entry[token].rank <= int(np.sum(ref >= ref[token] - 1e-4))
    # The top ones, rank r holding a token as likely as the reference's r-th (within the same
    # tolerance: two near-tied tokens may swap places, as a random prompt once made them).
    tops = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= top)
    assert [r for r, _ in tops] == list(range(1, top + 1)), tops
    for (r, t), want in zip(tops, np.sort(ref)[::-1][:top], strict=True):
        assert abs(ref[t] - want) < 1e-4, (r, t, ref[t], want)
        assert abs(entry[t].logprob - ref[t]) < 1e-4
    assert set(entry) == {token, *(t for _, t in tops)}


def check_prompt_logprobs(model, prompt: list[int], out, top: int) -> None:
    ref = hf_log_softmax(model, prompt)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        check_logprob_dict(out.prompt_logprobs[i], prompt[i], ref[i - 1], top)


def test_logprobs_and_prompt_logprobs_match_hf(checkpoint, llm):
    """One batch, decoded together: every prompt position's logprob and top N equal HF's
    log_softmax, and so do the greedy tokens' (over the prompt and what was generated), with
    their ranks; the cumulative logprob is their sum; logprobs=0 gives the token alone."""
    _, model = checkpoint
    prompts = random_prompts(4, hi=16)
    params = [
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, **kw)
        for kw in (
            dict(logprobs=5, prompt_logprobs=5),
            dict(logprobs=0),
            dict(prompt_logprobs=2),
            dict(logprobs=3, prompt_logprobs=0),
        )
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        completion = out.outputs[0]
        ref = hf_log_softmax(model, prompt + completion.token_ids)[len(prompt) - 1 : -1]
        assert completion.token_ids == ref.argmax(1).tolist()  # greedy, as HF would pick
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            check_prompt_logprobs(model, prompt, out, p.prompt_logprobs)
        if p.logprobs is None:
            assert completion.logprobs is None and completion.cumulative_logprob is None
            continue
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        for token, entry, row in zip(completion.token_ids, completion.logprobs, ref, strict=True):
            check_logprob_dict(entry, token, row, p.logprobs)
        total = sum(
            e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs, strict=True)
        )
        assert math.isclose(completion.cumulative_logprob, total, rel_tol=1e-6)
    assert outs[1].outputs[0].logprobs[0].keys() == {outs[1].token_ids[0]}
    decode = llm.engine.tokenizer.decode
    for entry in outs[0].outputs[0].logprobs:
        assert all(lp.decoded_token == decode([t]) for t, lp in entry.items())
    assert_clean(llm)


def test_streamed_logprobs_are_the_final_ones_as_they_grew(checkpoint, llm):
    """Stepped by hand: each output's logprobs hold one dict per token so far (the new ones
    last, for the new tokens), and stay what they were while later windows extend the
    request's: every one is a prefix of the final logprobs."""
    engine = llm.engine
    params = SamplingParams(max_tokens=9, temperature=0, logprobs=2, prompt_logprobs=1)
    prompts = random_prompts(2, hi=16)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"stream-{i}", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    finals = {o.request_id: o for o in outputs if o.finished}
    assert len(finals) == 2
    for out in outputs:
        c, final = out.outputs[0], finals[out.request_id].outputs[0]
        assert (
            len(c.logprobs) == len(c.token_ids)
            and c.token_ids == final.token_ids[: len(c.token_ids)]
        )
        new = c.logprobs[len(c.token_ids) - len(c.new_token_ids) :]
        assert all(t in entry for t, entry in zip(c.new_token_ids, new, strict=True))
        assert c.logprobs == final.logprobs[: len(c.logprobs)]
    for i, prompt in enumerate(prompts):
        final = finals[f"stream-{i}"]
        assert len(final.prompt_logprobs) == len(prompt) and final.prompt_logprobs[0] is None
        assert [next(iter(d)) for d in final.prompt_logprobs[1:]] == prompt[1:]
    assert_clean(llm)


@pytest.mark.slow
def test_prompt_logprobs_chunked_and_past_the_prefix_cache(checkpoint, llm):
    """A prompt prefilled in chunks, and one whose blocks are already in the prefix cache
    (which it must not use: cached positions have no logits), give HF's prompt logprobs."""
    _, model = checkpoint
    long, short = random_prompts(1, lo=40, hi=41)[0], random_prompts(1, lo=10, hi=11)[0]
    cached = short + random_prompts(1, lo=20, hi=21)[0]
    llm.generate([cached], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    hits = llm.engine.allocator.prefix_hit_tokens
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=5, ignore_eos=True)
    outs = llm.generate([long, cached], params, use_tqdm=False)
    assert llm.engine.allocator.prefix_hit_tokens == hits
    for prompt, out in zip([long, cached], outs, strict=True):
        check_prompt_logprobs(model, prompt, out, 5)
    assert_clean(llm)


@pytest.mark.parametrize(
    "prefix_caching", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["cache", "no-cache"]
)
def test_n_sequences_share_the_prompt_and_reproduce(checkpoint, llm, prefix_caching):
    """n=4 with a seed: the four sequences hold the same blocks for the prompt's full blocks
    (through the prefix cache, or through the first sequence's table with it off), each gets
    its own seed (seed + i, so sequence i equals an n=1 request with that seed), a second run
    gives the same four, and they are not all equal. Streamed pieces add up per sequence."""
    if not prefix_caching:
        llm = make_llm(checkpoint[0], enable_prefix_caching=False, min_decode_batch=4)
    engine = llm.engine
    prompt = random_prompts(1, lo=13, hi=14)[0]  # a full block of 8, then 5 tokens
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, n=4, ignore_eos=True)
    engine.add_request("n4", prompt, params)
    group = engine._requests["n4"]
    outputs = engine.step()  # admits and prefills all four
    tables = [s.table.blocks for s in group.sequences]
    assert all(t[0] == tables[0][0] for t in tables) and engine.allocator._ref[tables[0][0]] == 4
    assert len({t[1] for t in tables}) == 4  # the partly filled last block: one each
    while engine.has_unfinished_requests():
        outputs += engine.step()
    streamed = ["", "", "", ""]
    for out in outputs:
        for c in out.outputs:
            streamed[c.index] += c.new_text
    final = outputs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert not any(o.finished for o in outputs[:-1])
    tokens = [c.token_ids for c in final.outputs]
    assert streamed == [c.text for c in final.outputs]
    assert final.token_ids == tokens[0] and final.text == final.outputs[0].text
    assert len({tuple(t) for t in tokens}) > 1
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == tokens
    singles = [
        SamplingParams(max_tokens=10, temperature=1.0, seed=1234 + i, ignore_eos=True)
        for i in range(4)
    ]
    assert [o.token_ids for o in llm.generate([prompt] * 4, singles, use_tqdm=False)] == tokens
    assert_clean(llm)


def test_n_beyond_the_batch_streams_every_sequence_as_n_singles(llm):
    """n=10 on a batch of 4 runs in waves, so most steps change a few of the ten: every step's
    output holds all ten, each the whole sequence so far with only that step's new tokens and
    text (the pieces add up to it), no earlier output changes later, and the final ones equal
    n=1 requests with seed + i."""
    n, seed = 10, 4321
    prompt = random_prompts(1, lo=5, hi=6)[0]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed, n=n, logprobs=1)
    outputs, seen = [], []
    tokens: list[list[int]] = [[] for _ in range(n)]
    texts = [""] * n
    for out in llm.generate_stream([prompt], params):
        assert [c.index for c in out.outputs] == list(range(n))
        for c in out.outputs:
            tokens[c.index] += c.new_token_ids
            texts[c.index] += c.new_text
            assert (c.token_ids, c.text) == (tokens[c.index], texts[c.index])
            assert len(c.logprobs) == len(c.token_ids)
        assert out.finished == all(c.finished() for c in out.outputs)
        outputs.append(out)
        seen.append([(list(c.token_ids), c.text, c.new_text) for c in out.outputs])
    assert [[(c.token_ids, c.text, c.new_text) for c in o.outputs] for o in outputs] == seen
    # Waves: some steps changed only part of the ten, and some sequence ended before the rest.
    assert any(0 < sum(bool(c.new_token_ids) for c in o.outputs) < n for o in outputs)
    assert any(c.finished() for c in outputs[-2].outputs)
    final = outputs[-1]
    assert final.finished and not any(o.finished for o in outputs[:-1])
    singles = [
        SamplingParams(max_tokens=6, temperature=1.0, seed=seed + i, logprobs=1) for i in range(n)
    ]
    want = llm.generate([prompt] * n, singles, use_tqdm=False)
    for c, w in zip(final.outputs, want, strict=True):
        assert (c.token_ids, c.text, c.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert c.cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-4)
    assert_clean(llm)


def reference_greedy(
    model, prompt: list[int], n: int, params: SamplingParams, stop_ids
) -> list[int]:
    """Greedy decoding with vLLM's processors written from their definitions, on HF's logits
    (float64): logit_bias; -inf on the stop ids while fewer than min_tokens are generated; then
    repetition over prompt and output tokens, frequency x count and presence over the output."""
    out: list[int] = []
    for step in range(n):
        with torch.no_grad():
            x = model(torch.tensor([prompt + out])).logits[0, -1].double().numpy()
        for t, v in (params.logit_bias or {}).items():
            x[t] += v
        if step < params.min_tokens:
            x[list(stop_ids)] = -np.inf
        rep = params.repetition_penalty
        for t in set(prompt) | set(out):
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        for t in set(out):
            x[t] -= params.frequency_penalty * out.count(t) + params.presence_penalty
        out.append(int(np.argmax(x)))
        if out[-1] in stop_ids and step >= params.min_tokens:
            break
    return out


def test_penalties_bias_and_min_tokens_match_reference(checkpoint, llm):
    """Greedy outputs under penalties, logit_bias and min_tokens equal the reference decoding:
    -100 keeps a token out; min_tokens holds EOS and the stop ids off, so an EOS or stop id
    forced by +100 comes right after them (and right away without min_tokens)."""
    _, model = checkpoint
    stop_id = 456
    batches = [
        [
            dict(presence_penalty=0.4, frequency_penalty=0.9, repetition_penalty=1.3),
            dict(presence_penalty=-0.5, frequency_penalty=-0.3, repetition_penalty=0.7),
            dict(presence_penalty=1.5, logit_bias={EOS: 100}, min_tokens=6),
            dict(repetition_penalty=1.8, logit_bias={5: -100}),
        ],
        [
            dict(frequency_penalty=0.7),
            dict(stop_token_ids=[stop_id], logit_bias={stop_id: 100, 3: -100}, min_tokens=3),
            dict(),
            dict(logit_bias={EOS: 100}),
        ],
    ]
    for batch in batches:
        prompts = random_prompts(4, hi=16)
        params = [SamplingParams(max_tokens=12, temperature=0, **kw) for kw in batch]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, p, out in zip(prompts, params, outs, strict=True):
            stops = {EOS, *(p.stop_token_ids or ())}
            assert out.token_ids == reference_greedy(model, prompt, 12, p, stops), p
    assert len(outs[1].token_ids) == 4 and outs[1].token_ids[-1] == stop_id
    assert outs[1].finish_reason == "stop" and outs[3].token_ids == [EOS]
    assert_clean(llm)


def test_min_tokens_past_int32_holds_stops_off_to_the_context_end(checkpoint, llm):
    """min_tokens (and max_tokens) of 3e9 hold EOS off until the context is full, even with
    EOS forced by +100, beside rows it must not touch: the device's int32 step counts took it
    once as an overflow that failed every request in the step."""
    _, model = checkpoint
    huge = 3 * 10**9
    prompts = random_prompts(4, hi=16)
    params = [
        SamplingParams(max_tokens=huge, min_tokens=huge, temperature=0, logit_bias={EOS: 100}),
        SamplingParams(max_tokens=8, temperature=0, logit_bias={EOS: 100}),
        SamplingParams(max_tokens=8, temperature=0),
        SamplingParams(max_tokens=8, temperature=0, min_tokens=3, logit_bias={EOS: 100}),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    room = SHAPE["n_positions"] - len(prompts[0])
    assert len(outs[0].token_ids) == room and outs[0].finish_reason == "length"
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        n = min(p.max_tokens, SHAPE["n_positions"] - len(prompt))
        assert out.token_ids == reference_greedy(model, prompt, n, p, {EOS}), p
    assert outs[1].token_ids == [EOS] and outs[3].token_ids[3] == EOS
    assert_clean(llm)


@pytest.mark.slow
def test_penalties_survive_preemption(checkpoint):
    """A cache too small for everyone preempts requests; recomputed, their counts come back
    from the host's history (prompt and output so far), so outputs still equal the reference."""
    _, model = checkpoint
    # 12 usable blocks of 8 tokens; each request grows to 40-60 tokens (5-8 blocks).
    tight = make_llm(checkpoint[0], kv_cache_tokens=13 * BLOCK)
    prompts = random_prompts(5, lo=16, hi=36)
    params = SamplingParams(
        max_tokens=24,
        temperature=0,
        ignore_eos=True,
        presence_penalty=0.6,
        frequency_penalty=0.4,
        repetition_penalty=1.2,
    )
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference_greedy(model, prompt, 24, params, ())
    assert_clean(tight)


def test_plain_requests_untouched_by_others(checkpoint, llm):
    """Plain greedy and seeded sampled requests give exactly what they give alone, in a batch
    whose other rows use every feature (and so run the programs that have them); +100 forces
    its token even when sampling, and min_p keeps a sampled row to its likely tokens."""
    prompts = random_prompts(4, hi=16)
    plain = [
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=3, ignore_eos=True),
    ]
    alone = [o.token_ids for o in llm.generate(prompts, plain * 2, use_tqdm=False)[:2]]
    forced = 123
    fancy = [
        SamplingParams(
            max_tokens=8,
            temperature=0.8,
            seed=4,
            min_p=0.3,
            logprobs=3,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            min_tokens=2,
        ),
        SamplingParams(max_tokens=8, temperature=1.0, seed=5, logit_bias={forced: 100}),
    ]
    mixed = llm.generate(prompts[:2] + prompts[2:], plain + fancy, use_tqdm=False)
    assert [o.token_ids for o in mixed[:2]] == alone
    assert mixed[3].token_ids == [forced] * 8
    c = mixed[2].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 8
    # min_p 0.3 on the processed logits keeps (at temperature 0.8) what the raw logprobs and
    # the penalties can move, so only a loose check: no very unlikely token.
    assert all(d[t].logprob > -8 for t, d in zip(c.token_ids, c.logprobs, strict=True))
    assert_clean(llm)


def test_bad_values_are_rejected_and_leave_nothing(llm):
    engine = llm.engine
    vocab = engine.config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("bad", [1, 2], SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="min_tokens"):
        engine.add_request(
            "bad", [1, 2], SamplingParams(min_tokens=1, stop_token_ids=list(range(100)))
        )
    assert "bad" not in engine._requests
    assert_clean(llm)


@pytest.mark.slow
def test_prompt_and_sampled_logprobs_match_hf_qwen3(tmp_path_factory):
    """The same parity for a Llama-style model (Qwen3's q/k norms, grouped queries)."""
    model_type, kwargs = SHAPES["qwen3-g2-hd64-tied"]
    path = tmp_path_factory.mktemp("qwen3-logprobs")
    model = make_checkpoint(path, model_type, seed=11, **kwargs)
    qwen = make_llm(str(path))
    prompts = [p[:20] for p in random_prompts(3, lo=3, hi=30)]
    prompts = [[t % kwargs["vocab_size"] for t in p] for p in prompts]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=4, prompt_logprobs=4)
    for prompt, out in zip(prompts, qwen.generate(prompts, params, use_tqdm=False), strict=True):
        check_prompt_logprobs(model, prompt, out, 4)
        completion = out.outputs[0]
        ref = hf_log_softmax(model, prompt + completion.token_ids)[len(prompt) - 1 : -1]
        for token, entry, row in zip(completion.token_ids, completion.logprobs, ref, strict=True):
            check_logprob_dict(entry, token, row, 4)
    assert_clean(qwen)
