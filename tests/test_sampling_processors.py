"""The logits processors, min_p and logprobs on the device, against references written from their
definitions (numpy) and HF's own processors, on fresh random logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rosejax.sampling import (
    COUNT_MASK,
    MAX_LOGPROBS,
    PROMPT_BIT,
    Processors,
    Scaled,
    _min_p,
    count_tokens,
    find_top_k,
    process_logits,
    sample,
    token_logprobs,
)

B, V, K = 16, 64, 6  # rows, vocabulary, bias entries per row

process = jax.jit(process_logits)


def random_rows(rng):
    """Per-row processors with every feature in some rows and none in others, and the history
    they stand for: (Processors, prompt token lists, output token lists)."""
    prompts = [rng.integers(0, V, rng.integers(1, 20)).tolist() for _ in range(B)]
    outputs = [rng.integers(0, V // 2, rng.integers(0, 30)).tolist() for _ in range(B)]
    counts = np.zeros((B, V), np.uint16)
    for b in range(B):
        counts[b, prompts[b]] = PROMPT_BIT
        for t in outputs[b]:
            counts[b, t] += 1
    plain = rng.random(B) < 0.3  # rows that ask for nothing: their logits must not change
    presence = np.where(plain, 0, rng.choice([0, -2, 0.7, 2], B)).astype(np.float32)
    frequency = np.where(plain, 0, rng.choice([0, -0.4, 1.3], B)).astype(np.float32)
    repetition = np.where(plain, 1, rng.choice([1, 0.5, 1.7], B)).astype(np.float32)
    has_bias = ~plain & (rng.random(B) < 0.7)
    ids = np.stack([rng.choice(V, K, replace=False) for _ in range(B)]).astype(np.int32)
    values = rng.choice([-100.0, -3.5, 0.25, 100.0, -np.inf], (B, K)).astype(np.float32)
    steps = rng.integers(0, 5, B).astype(np.int32)
    until = rng.choice([0, 3, 2**31 - 1], (B, K)).astype(np.int32)
    procs = Processors(
        jnp.asarray(steps),
        jnp.asarray(has_bias),
        jnp.asarray(ids),
        jnp.asarray(values),
        jnp.asarray(until),
        jnp.asarray(presence),
        jnp.asarray(frequency),
        jnp.asarray(repetition),
        jnp.asarray(counts),
    )
    return procs, prompts, outputs, plain


def reference_process(logits, procs: Processors, prompts, outputs) -> np.ndarray:
    """vLLM's definitions, row by row in float64: bias entries that hold, then repetition over
    prompt and output tokens, then frequency x count and presence for output tokens."""
    out = logits.astype(np.float64).copy()
    p = jax.tree.map(np.asarray, procs)
    for b in range(B):
        if p.has_bias[b]:
            for t, v, u in zip(p.bias_ids[b], p.bias_values[b], p.bias_until[b], strict=True):
                if p.steps[b] < u:
                    out[b, t] += v
        seen = set(prompts[b]) | set(outputs[b])
        for t in seen:
            out[b, t] = (
                out[b, t] / p.repetition[b] if out[b, t] > 0 else out[b, t] * p.repetition[b]
            )
        for t in set(outputs[b]):
            out[b, t] -= p.frequency[b] * outputs[b].count(t) + p.presence[b]
    return out


def test_processors_match_their_definitions():
    rng = np.random.default_rng()
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    logits[:, :4] = 0.0  # zero logits: neither side of the repetition rule
    procs, prompts, outputs, plain = random_rows(rng)
    got = np.asarray(process(jnp.asarray(logits), procs))
    want = reference_process(logits, procs, prompts, outputs)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-4)
    # Rows that ask for nothing come back bit for bit (stale counts and biases are not read).
    np.testing.assert_array_equal(got[plain].view(np.uint32), logits[plain].view(np.uint32))


def test_repetition_matches_hf_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng()
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    history = rng.integers(0, V, (B, 12))
    counts = np.zeros((B, V), np.uint16)
    for b in range(B):
        counts[b, history[b, :5]] = PROMPT_BIT  # a prompt of 5 and an output of 7 tokens
        for t in history[b, 5:]:
            counts[b, t] += 1
    zeros = jnp.zeros(B, jnp.float32)
    procs = Processors(
        jnp.zeros(B, jnp.int32),
        jnp.zeros(B, bool),
        jnp.zeros((B, K), jnp.int32),
        jnp.zeros((B, K), jnp.float32),
        jnp.zeros((B, K), jnp.int32),
        zeros,
        zeros,
        jnp.full(B, 1.3, jnp.float32),
        jnp.asarray(counts),
    )
    got = np.asarray(process(jnp.asarray(logits), procs))
    hf = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(history), torch.tensor(logits))
    np.testing.assert_allclose(got, hf.numpy(), rtol=1e-6)


def test_counts_saturate_and_keep_the_prompt_bit():
    counts = jnp.asarray(
        np.array([[COUNT_MASK - 1, 0], [COUNT_MASK | PROMPT_BIT, 0], [PROMPT_BIT, 0]], np.uint16)
    )
    tokens = jnp.zeros(3, jnp.int32)
    once = count_tokens(counts, tokens, jnp.array([True, True, True]))
    twice = count_tokens(once, tokens, jnp.array([True, True, False]))
    assert np.asarray(twice)[:, 0].tolist() == [COUNT_MASK, COUNT_MASK | PROMPT_BIT, PROMPT_BIT + 1]
    assert np.asarray(twice)[:, 1].tolist() == [0, 0, 0]


def test_min_p_keeps_tokens_against_reference():
    rng = np.random.default_rng()
    scaled = (rng.standard_normal((B, V)) * 2).astype(np.float32)
    min_p = rng.choice([0.0, 0.01, 0.2, 0.9, 1.0], B).astype(np.float32)
    filtered = jax.jit(lambda x, p: _min_p(Scaled(x, jnp.ones(B)), p).values())
    got = np.isfinite(np.asarray(filtered(jnp.asarray(scaled), jnp.asarray(min_p))))
    # vLLM's definition: probs >= min_p * max prob, on softmax probabilities in float64.
    probs = np.exp(scaled - scaled.max(1, keepdims=True).astype(np.float64))
    probs /= probs.sum(1, keepdims=True)
    want = probs >= min_p[:, None] * probs.max(1, keepdims=True)
    close = np.abs(probs - min_p[:, None] * probs.max(1, keepdims=True)) < 1e-6
    assert np.all((got == want) | close)
    assert got[min_p == 0].all() and all(row.sum() >= 1 for row in got)


def test_min_p_draws_only_kept_tokens_and_spares_other_rows():
    # test_sampling's shape (256 x 64), so the draw without min_p is compiled once for both
    rows, draws = 16, 16
    rng = np.random.default_rng()
    logits = np.repeat(rng.standard_normal((rows, V)) * 2, draws, axis=0).astype(np.float32)
    n = rows * draws
    temperature = jnp.full(n, 0.8, jnp.float32)
    top_k, top_p = jnp.zeros(n, jnp.int32), jnp.ones(n, jnp.float32)
    seed, step = jnp.full(n, 3, jnp.uint32), jnp.tile(jnp.arange(draws, dtype=jnp.int32), rows)
    min_p = jnp.asarray(np.repeat(np.arange(rows) % 2 == 0, draws) * 0.5, jnp.float32)
    logits = jnp.asarray(logits)
    kept = np.isfinite(np.asarray(_min_p(Scaled(logits, temperature), min_p).values()))
    drawn = np.asarray(sample(logits, temperature, top_k, top_p, seed, step, min_p))
    alone = np.asarray(sample(logits, temperature, top_k, top_p, seed, step))
    assert kept[np.arange(n), drawn].all()
    assert not kept[np.arange(n), alone].all()  # without min_p, dropped tokens do come up
    # min_p = 0 rows draw exactly what they draw with no min_p at all
    np.testing.assert_array_equal(drawn[min_p == 0], alone[min_p == 0])


@pytest.mark.parametrize(
    "top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.9), (5, 0.8), (V, 0.95)], ids=str
)
def test_min_p_with_filters_draws_as_the_logits_it_leaves(top_k, top_p):
    """min_p, then top_k / top_p (from the candidates, or by the radix selects for top_k past
    them) and the draw: each row's token is the one the same call draws without min_p from
    logits whose dropped tokens are -inf (min_p's test written out in float32)."""
    rng = np.random.default_rng()
    logits = jnp.asarray(rng.standard_normal((B, V)) * 3, jnp.float32)
    temperature = jnp.asarray(rng.uniform(0.3, 1.5, B), jnp.float32)
    min_p = jnp.asarray(rng.choice([0.0, 0.05, 0.3], B), jnp.float32)
    scaled = logits / temperature[:, None]
    kept = jnp.exp(scaled - scaled.max(axis=1, keepdims=True)) >= min_p[:, None]
    left = jnp.where(kept, logits, -jnp.inf)
    rows = (jnp.full(B, top_k, jnp.int32), jnp.full(B, top_p, jnp.float32))
    seed, step = jnp.arange(B, dtype=jnp.uint32), jnp.full(B, 7, jnp.int32)
    got = sample(logits, temperature, *rows, seed, step, min_p)
    want = sample(left, temperature, *rows, seed, step)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.asarray(kept)[np.arange(B), np.asarray(got)].all()


def test_token_logprobs_match_log_softmax():
    """The chosen tokens' logprobs and ranks, and the MAX_LOGPROBS most likely, against torch's
    log_softmax and topk."""
    rng = np.random.default_rng()
    logits = (rng.standard_normal((B, V)) * 4).astype(np.float32)
    logits[0, :3] = logits[0].max() + 1  # a tie at the top
    tokens = rng.integers(0, V, B).astype(np.int32)
    tokens[0] = 1
    got = token_logprobs_jit(jnp.asarray(logits), jnp.asarray(tokens))
    x = torch.tensor(logits)
    ref = torch.log_softmax(x, dim=-1).numpy()
    rows = np.arange(B)
    np.testing.assert_allclose(np.asarray(got.logprob), ref[rows, tokens], atol=1e-5)
    np.testing.assert_array_equal(got.rank, (ref >= ref[rows, tokens][:, None]).sum(1))
    assert got.rank[0] == 3  # tied with two others: vLLM counts every token at least as likely
    ids, values = np.asarray(got.top_ids), np.asarray(got.top_logprobs)
    assert ids.shape == values.shape == (B, MAX_LOGPROBS)
    # Largest first, ties to the lower id (row 0's, and any float32 tie the draw makes: torch's
    # topk orders ties as it likes)
    np.testing.assert_array_equal(ids, np.argsort(-logits, axis=1, kind="stable")[:, :MAX_LOGPROBS])
    np.testing.assert_allclose(values, np.take_along_axis(ref, ids, 1), atol=1e-5)
    assert ids[0, :3].tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    "vocab, sort_max",
    [(1, 1024), (7, 1024), (63, 1024), (64, 1024), (65, 1024), (200, 1024)]
    + [(1000, 1024), (1000, 8), (3000, 40)],
)
def test_find_top_k_matches_a_stable_sort(vocab, sort_max):
    """`find_top_k` against numpy's stable sort: the k largest, largest first, ties to the lower id,
    with many ties (a few distinct values, also across chunks), -inf, and k from 1 to vocab; a
    small `sort_max` narrows the candidates in two or three rounds of chunks."""
    rng = np.random.default_rng()
    x = rng.integers(-3, 4, (B, vocab)).astype(np.float32)
    x[rng.random((B, vocab)) < 0.1] = -np.inf
    x[1] = rng.standard_normal(vocab)  # one row of distinct values
    x[2, : vocab // 2] = -np.inf  # more -inf than some k: the lowest ids among them
    for k in sorted({1, min(vocab, 5), min(vocab, MAX_LOGPROBS), vocab}):
        values, ids = top_k_jit(jnp.asarray(x), k, sort_max=sort_max)
        want = np.argsort(-x, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(np.asarray(ids), want)
        np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(x, want, 1))


top_k_jit = jax.jit(find_top_k, static_argnums=1, static_argnames="sort_max")
token_logprobs_jit = jax.jit(token_logprobs)
