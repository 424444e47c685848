"""Sampling: greedy, filters against a numpy reference, per-request determinism, frequencies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rosejax import sampling
from rosejax.sampling import (
    FILTER_CANDIDATES,
    RADIX_FALLBACK_ROWS,
    SamplingParams,
    Scaled,
    _order_key,
    _select,
    sample,
)

# The filters' parts compiled whole: op by op, these tests took about twice as long.
_candidate_cutoffs = jax.jit(sampling._candidate_cutoffs)
_draw = jax.jit(sampling._draw)
_draw_among_candidates = jax.jit(sampling._draw_among_candidates, static_argnums=2)
_filter_cutoffs = jax.jit(sampling._filter_cutoffs)
_radix_cutoffs = jax.jit(sampling._radix_cutoffs)

# One shape for (almost) every call: each new shape costs a ~2 s compile on CPU.
B, V = 256, 64
seeds_st = st.integers(0, 2**32 - 1)
few = settings(max_examples=6, deadline=None)


def run(logits, temperature, top_k, top_p, seed, step) -> np.ndarray:
    n = len(logits)
    arrs = (
        jnp.asarray(logits, jnp.float32),
        jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (n,)),
        jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (n,)),
        jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (n,)),
        jnp.broadcast_to(jnp.asarray(np.asarray(seed, np.int64) % 2**32, jnp.uint32), (n,)),
        jnp.broadcast_to(jnp.asarray(step, jnp.int32), (n,)),
    )
    return np.asarray(sample(*arrs))


def allowed_reference(logits: np.ndarray, t: float, k: int, p: float, tol=1e-4) -> np.ndarray:
    """HF-style top-k then top-p in float64, a hair loose (tol) so f32 rounding can't fail it."""
    s = logits.astype(np.float32).astype(np.float64) / np.float64(np.float32(t))
    vals = np.sort(s)[::-1]
    cut = vals[k - 1] if 0 < k < len(s) else -np.inf
    if p >= 1 and cut == -np.inf:
        return np.ones(len(s), bool)
    if p < 1:
        kept = vals[vals >= cut]
        probs = np.exp(kept - kept.max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        n_keep = max(int(np.sum(before < p + tol)), 1)
        cut = max(cut, kept[n_keep - 1])
    return s >= cut - tol * max(1.0, abs(cut))


def random_params(rng, n):
    t = rng.uniform(0.3, 2.0, n)
    k = rng.choice([0, 1, 2, 5, 8, 11, 50, V - 1, V, V + 10], n)
    p = np.where(rng.random(n) < 0.4, 1.0, rng.uniform(0.05, 1.0, n))
    return t, k, p


@few
@given(seed=seeds_st)
def test_greedy_is_first_argmax(seed):
    rng = np.random.default_rng(seed)
    logits = rng.integers(-3, 3, (B, V)).astype(np.float32)  # many ties
    t, k, p = random_params(rng, B)
    greedy = rng.random(B) < 0.5
    t[greedy] = 0.0
    out = run(logits, t, k, p, rng.integers(0, 2**32, B), rng.integers(0, 1000, B))
    np.testing.assert_array_equal(out[greedy], np.argmax(logits, axis=1)[greedy])
    all_greedy = run(logits, 0.0, k, p, 0, 0)
    np.testing.assert_array_equal(all_greedy, np.argmax(logits, axis=1))


def test_order_key_and_select_exact():
    """The radix select finds, per row, the largest T with sum(w[key >= T]) >= target, exactly."""
    rng = np.random.default_rng()
    x = rng.standard_normal((B, V)).astype(np.float32) * rng.choice([1e-30, 1.0, 1e30], (B, 1))
    x[:, :8] = rng.choice([0.0, -0.0, np.inf, -np.inf, 1.0, -1.0], (B, 8))  # specials and ties
    key = np.asarray(_order_key(jnp.asarray(x)))
    xs = np.take_along_axis(x, np.argsort(key, axis=1, kind="stable"), axis=1)
    assert (xs[:, 1:] >= xs[:, :-1]).all()  # sorting by key sorts the floats
    w = rng.integers(0, 4, (B, V)).astype(np.float32)  # integer weights: sums are exact in f32
    target = rng.integers(1, V, B) + 0.5
    got = np.asarray(_select(jnp.asarray(key), jnp.asarray(w), jnp.asarray(target, jnp.float32)))
    for b in range(B):
        ks = np.unique(key[b])[::-1]  # distinct keys, descending
        mass = np.array([w[b][key[b] >= t].sum() for t in ks])
        ok = ks[mass >= target[b]]
        assert got[b] == (ok[0] if len(ok) else 0), b


def _nucleus_between_masses(row: np.ndarray, k: int, rng) -> float:
    """A top_p halfway between two masses a cutoff can keep in the row's top-k set (float64),
    so f32 sums in any order agree on the cutoff."""
    v = np.sort(row.astype(np.float64))[::-1]
    v = v[v >= v[k - 1]] if k else v
    probs = np.exp(v - v.max())
    probs /= probs.sum()
    masses = [0.0] + [probs[v >= x].sum() for x in np.unique(v)[::-1][:8]]  # the 8 largest
    i = rng.integers(0, len(masses) - 1)
    return float((masses[i] + masses[i + 1]) / 2)


def test_candidate_cutoffs_equal_the_radix_ones_where_complete():
    """The filters' cutoffs from each row's largest values equal the radix selects' over the
    whole row wherever the rows say their kept set lies inside the candidates, and the rows
    whose kept set cannot (top_k past the candidates, ties of the k-th value past them, a
    nucleus of a flat row, a nucleus ending on the last candidate with a tie past it) say so."""
    rng = np.random.default_rng()
    b, v, c = 240, 1000, FILTER_CANDIDATES
    x = rng.standard_normal((b, v)) * 2
    k, p = np.zeros(b, int), np.ones(b)
    case = np.arange(b) % 9
    for r in range(b):
        if case[r] in (1, 2):  # top_k within the candidates, without and with a nucleus
            k[r] = rng.integers(1, c + 1)
        if case[r] == 3:  # a peaked row: a nucleus alone closes among its largest values
            x[r, rng.choice(v, 12, replace=False)] += 12
        if case[r] == 4:  # a flat row: the largest 64 of 1000 hold ~15% of the mass
            x[r] = rng.standard_normal(v) * 0.1
            p[r] = 0.9
        if case[r] == 5:  # top_k past the candidates
            k[r] = rng.integers(c + 1, v)
        if case[r] == 6:  # the k-th value tied with ~140 others
            x[r] = rng.integers(-3, 4, v)
            k[r] = rng.integers(1, 10)
        if case[r] == 7:  # top_p < 1 with ties of the k-th value inside the candidates
            x[r, :40] = np.round(x[r, :40]) + 10
            k[r] = rng.integers(1, 40)
        if case[r] in (2, 3, 7):
            p[r] = _nucleus_between_masses(x[r], k[r], rng)
        if case[r] == 8:  # a nucleus alone ending on the last candidate, tied with the next value
            x[r] = -20.0
            x[r, rng.choice(v, c + 1, replace=False)] = [10.0] * (c - 1) + [5.0, 5.0]
            p[r] = 0.99985  # past the 63 tens' mass (~0.99979), short of the first 5's (~0.99989)
    x = x.astype(np.float32)
    args = (jnp.asarray(x), jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32))
    row_lse = jax.nn.logsumexp(args[0], axis=1)
    scaled = Scaled(args[0], jnp.ones(b))
    cut, complete = (np.asarray(a) for a in _candidate_cutoffs(scaled, *args[1:], row_lse)[:2])
    radix = np.asarray(_radix_cutoffs(jnp.asarray(_order_key(args[0])), *args))
    np.testing.assert_array_equal(complete, ~np.isin(case, [4, 5, 6, 8]))
    np.testing.assert_array_equal(cut[complete], radix[complete])
    assert (cut[case == 0] == 0).all() and (radix[case != 0] > 0).all()


@pytest.mark.parametrize("b, wide", [(64, 3), (64, RADIX_FALLBACK_ROWS + 5), (16, 2)])
def test_rows_outside_their_candidates_take_the_radix_cutoff(b, wide):
    """A batch of rows whose kept set lies inside their candidates (top_k <= 64, or a peaked
    nucleus) and `wide` flat rows whose nucleus does not: every row's cutoff equals the radix
    selects' over the whole batch, whether the flat rows run them alone (a few in a large
    batch) or the batch does (many, or a small batch)."""
    rng = np.random.default_rng()
    v = 1000
    x = rng.standard_normal((b, v)) * 2
    k = np.where(rng.random(b) < 0.5, rng.integers(1, FILTER_CANDIDATES + 1, b), 0)
    p = np.ones(b)
    flat = set(rng.choice(b, wide, replace=False).tolist())
    for r in range(b):
        if r in flat:  # the largest 64 of 1000 hold ~15% of the mass
            x[r], k[r], p[r] = rng.standard_normal(v) * 0.1, 0, 0.9
            continue
        if k[r] == 0:
            x[r, rng.choice(v, 12, replace=False)] += 12
        p[r] = _nucleus_between_masses(x[r], k[r], rng)
    scaled = jnp.asarray(x.astype(np.float32))
    args = (_order_key(scaled), scaled, jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32))
    unscaled = Scaled(scaled, jnp.ones(b))
    _, complete, _, _ = _candidate_cutoffs(unscaled, *args[2:], jax.nn.logsumexp(scaled, axis=1))
    assert set(np.flatnonzero(~np.asarray(complete)).tolist()) == flat
    cutoffs = _filter_cutoffs(unscaled, *args[2:])
    np.testing.assert_array_equal(np.asarray(cutoffs.cut), np.asarray(_radix_cutoffs(*args)))
    assert not np.asarray(cutoffs.inside).any()  # drawn over the whole rows


def test_a_draw_among_the_candidates_is_the_draw_over_the_row():
    """Rows whose kept tokens all lie among their 64 largest (top_k <= 48, a peaked nucleus) are
    drawn from those alone: the same token as the Gumbel-max over the whole row with the same
    keys, and `sample` gives each such row the same token beside a row that sends the batch to
    the radix selects and the whole-row draw (top_k past the candidates). bf16 logits, as
    models give them, with their ties, each row at its own temperature."""
    rng = np.random.default_rng()
    b, v = 32, 1000
    x = (rng.standard_normal((b, v)) * 2).astype(jnp.bfloat16)
    t = rng.uniform(0.3, 2.0, b).astype(np.float32)
    # k <= 48: the k-th value's bf16 ties would have to run 16 values deep to leave the 64
    k = np.where(np.arange(b) % 2 == 0, rng.integers(1, 49, b), 0)
    p = np.ones(b)
    for r in range(b):
        if k[r] == 0:
            x[r, rng.choice(v, 12, replace=False)] += 12
        if r % 4 != 0:  # below 1 in float32 even where the peaks hold nearly all the mass
            p[r] = min(_nucleus_between_masses(x[r].astype(np.float32) / t[r], k[r], rng), 0.999)
    logits, t = jnp.asarray(x), jnp.asarray(t)
    scaled, k, p = Scaled(logits, t), jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32)
    cutoffs = _filter_cutoffs(scaled, k, p)
    assert np.asarray(cutoffs.inside).all()
    keys = jnp.asarray(rng.integers(0, 2**32, (b, 2)), jnp.uint32)
    among = np.asarray(_draw_among_candidates(cutoffs, keys, v))
    np.testing.assert_array_equal(among, np.asarray(_draw(scaled, cutoffs.cut, keys)))
    chosen = jax.jit(Scaled.values)(scaled)[jnp.arange(b), among]  # the device's division
    assert np.asarray(_order_key(chosen) >= cutoffs.cut).all()

    seeds, steps = rng.integers(0, 2**32, b), rng.integers(0, 10**6, b)
    greedy = np.arange(b) % 8 == 3
    t = jnp.where(jnp.asarray(greedy), 0.0, t)
    alone = np.asarray(sample(logits, t, k, p, jnp.asarray(seeds, jnp.uint32), steps))
    k_wide = k.at[0].set(200)  # row 0 leaves its candidates: every row is drawn whole
    beside = np.asarray(sample(logits, t, k_wide, p, jnp.asarray(seeds, jnp.uint32), steps))
    np.testing.assert_array_equal(beside[1:], alone[1:])
    first_max = np.argmax(x.astype(np.float32), axis=1)
    np.testing.assert_array_equal(alone[greedy], first_max[greedy])


# Modes send batches down different lax.cond branches: both filters, top-k only, top-p only.
@pytest.mark.parametrize("mode", ["mixed", "top_k", "top_p", "ties"])
@few
@given(seed=seeds_st)
def test_filters_stay_in_allowed_set(mode, seed):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((B, V)) * rng.uniform(0.5, 4.0, (B, 1))).astype(np.float32)
    t, k, p = random_params(rng, B)
    if mode == "top_k":
        k, p = rng.integers(1, V, B), np.ones(B)
    elif mode == "top_p":
        k = np.zeros(B, int)
    elif mode == "ties":  # both filters keep every token tied with the last kept one
        logits = rng.integers(-3, 3, (B, V)).astype(np.float32)
        t = np.ones(B)
    allowed = np.stack([allowed_reference(logits[b], t[b], k[b], p[b]) for b in range(B)])
    seeds = rng.integers(0, 2**32, B)
    for step in range(10):
        out = run(logits, t, k, p, seeds, step)
        assert allowed[np.arange(B), out].all(), np.nonzero(~allowed[np.arange(B), out])


@few
@given(seed=seeds_st)
def test_row_independent_of_batch(seed):
    """A row's token depends on its logits, params, seed and step only: not on its neighbours,
    its position, the batch size, or whether neighbours switch a filter branch on."""
    rng = np.random.default_rng(seed)
    n = 16
    logits = rng.standard_normal((n, V)).astype(np.float32) * 2
    t, k, p = random_params(rng, n)
    seeds, steps = rng.integers(0, 2**32, n), rng.integers(0, 10**6, n)
    zeros = np.zeros(B - n)  # greedy neighbours
    alone = run(
        np.concatenate([logits, np.zeros((B - n, V))]),
        np.concatenate([t, zeros]),
        np.concatenate([k, zeros]),
        np.concatenate([p, zeros + 1]),
        np.concatenate([seeds, zeros]),
        np.concatenate([steps, zeros]),
    )[:n]
    for size, filters in ((B, True), (B, False), (64, True)):
        others = size - n
        ol = rng.standard_normal((others, V)).astype(np.float32)
        ot, ok, op = random_params(rng, others)
        if not filters:
            ok, op = np.zeros(others, int), np.ones(others)
        perm = rng.permutation(size)  # probe i sits at row perm[i]
        inv = np.argsort(perm)
        out = run(
            np.concatenate([logits, ol])[inv],
            np.concatenate([t, ot])[inv],
            np.concatenate([k, ok])[inv],
            np.concatenate([p, op])[inv],
            np.concatenate([seeds, rng.integers(0, 2**32, others)])[inv],
            np.concatenate([steps, rng.integers(0, 99, others)])[inv],
        )
        np.testing.assert_array_equal(out[perm[:n]], alone)


def test_seeds_and_steps_vary_draws():
    logits = np.zeros((B, V), np.float32)  # uniform: every token equally likely
    by_seed = run(logits, 1.0, 0, 1.0, np.arange(B), 7)
    by_step = run(logits, 1.0, 0, 1.0, 7, np.arange(B))
    assert len(set(by_seed)) > V // 2 and len(set(by_step)) > V // 2
    np.testing.assert_array_equal(run(logits, 1.0, 0, 1.0, np.arange(B), 7), by_seed)
    # Rows 0-127: seed 1 at steps 0..127; rows 128-255: seed 2 at the same steps.
    two = run(logits, 1.0, 0, 1.0, np.repeat([1, 2], B // 2), np.tile(np.arange(B // 2), 2))
    assert np.mean(two[: B // 2] == two[B // 2 :]) < 0.2


@pytest.mark.parametrize(
    "t, k, p, v",
    [
        (1.0, 0, 1.0, 8),
        (0.7, 0, 1.0, 8),
        (1.0, 3, 1.0, 8),
        (1.3, 0, 0.6, 8),
        (1.0, 4, 0.8, 8),
        # Wide kept sets (many tokens survive the filters).
        (1.0, 12, 1.0, 16),
        (2.0, 0, 0.95, 16),
        (1.0, 14, 0.97, 16),
    ],
)
def test_frequencies_match_softmax(t, k, p, v):
    steps = 16  # B * steps = 4096 draws over the first v tokens; the rest are -inf
    rng = np.random.default_rng()
    logits = rng.standard_normal(v).astype(np.float32) * (0.5 if v > 8 else 1.0)
    keep = allowed_reference(logits, t, k, p, tol=0.0)
    probs = np.where(keep, np.exp(logits / t - (logits / t).max()), 0.0)
    probs /= probs.sum()
    padded = np.tile(np.concatenate([logits, np.full(V - v, -np.inf, np.float32)]), (B, 1))
    seeds = rng.integers(0, 2**32, B)
    out = np.concatenate([run(padded, t, k, p, seeds, s) for s in range(steps)])
    counts = np.bincount(out, minlength=V)
    assert counts[v:].sum() == 0 and counts[:v][~keep].sum() == 0
    expected = len(out) * probs[keep]
    chi2 = float(np.sum((counts[:v][keep] - expected) ** 2 / expected))
    df = int(keep.sum()) - 1
    assert chi2 < df + 10 * np.sqrt(2 * df) + 10, (chi2, counts, expected)  # p-value < 1e-6


def test_new_values_do_not_recompile():
    """Per-row values are arrays, not static arguments: changing them compiles nothing."""
    rng = np.random.default_rng()
    logits = jnp.asarray(rng.standard_normal((B, V)), jnp.float32)

    def draw(temperature, top_k, top_p, seed, step):
        rows = [
            jnp.full(B, x, d)
            for x, d in zip(
                (temperature, top_k, top_p, seed, step),
                (jnp.float32, jnp.int32, jnp.float32, jnp.uint32, jnp.int32),
                strict=True,
            )
        ]
        out = sample(logits, *rows)
        assert out.shape == (B,) and out.dtype == jnp.int32
        return out

    draw(0.5, 3, 1.0, 5, 0)
    compiled = sample._cache_size()
    draw(0.0, 0, 1.0, 0, 1)
    draw(1.0, 0, 0.3, 2**32 - 1, 1)  # the largest uint32 seed (what seed=-1 maps to)
    assert sample._cache_size() == compiled  # new values, same shapes: no new compile


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"max_tokens": 2.0},
        {"max_tokens": True},
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": "1"},
        {"top_k": -2},
        {"top_k": 2.5},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": None},
        {"seed": 1.5},
        {"stop": 3},
        {"stop": [""]},
        {"stop": ["a", 1]},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": 5},
        {"ignore_eos": "yes"},
        {"n": 0},
        {"n": 1.0},
        {"logprobs": 21},
        {"logprobs": -1},
        {"prompt_logprobs": 2.0},
        {"presence_penalty": 2.5},
        {"frequency_penalty": float("nan")},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("inf")},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {3: 101.0}},
        {"logit_bias": {"3": 1.0}},
        {"logit_bias": [1, 2]},
        {"logit_bias": dict.fromkeys(range(300), 1.0)},
        {"min_tokens": -1},
        {"min_tokens": 17},  # more than max_tokens (16)
        {"min_p": 1.5},
        {"min_p": None},
    ],
)
def test_params_validation(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_params_normalised():
    sp = SamplingParams(max_tokens=np.int64(5), temperature=0, top_k=0, top_p=1, stop="\n")
    assert sp.stop == ["\n"] and isinstance(sp.temperature, float) and type(sp.max_tokens) is int
    sp = SamplingParams(stop=("a", "b"), stop_token_ids=(1, np.int32(2)), seed=0)
    assert sp.stop == ["a", "b"] and sp.stop_token_ids == [1, 2] and sp.seed == 0
    sp = SamplingParams(logit_bias={np.int64(3): np.float32(2.5)}, presence_penalty=1, min_p=0)
    assert sp.logit_bias == {3: 2.5} and type(next(iter(sp.logit_bias))) is int
    assert type(sp.presence_penalty) is float and type(sp.min_p) is float
    assert SamplingParams(top_k=-1, seed=3) == SamplingParams(top_k=0, seed=3)  # vLLM's "off"
    # past float32 (the device's): its largest, not an overflow to inf
    assert np.float32(SamplingParams(repetition_penalty=1e300).repetition_penalty) < np.inf
