"""Sampling inside the jitted decode step, and the host-side SamplingParams users pass in.

Every per-request value (temperature, top_k, top_p, seed, step) is a [B] array and nothing is
static but the shapes, so new values never recompile.

Semantics (HF's warpers, in HF's order): temperature == 0 is greedy (argmax, ties to the lowest
id); otherwise logits / temperature, then top-k (keep tokens >= the k-th largest; 0 = off), then
top-p over the renormalised top-k set (keep the smallest prefix of the sorted tokens whose mass
reaches top_p, the top token always; 1.0 = off), then a Gumbel-max draw over the kept tokens
(ties to the lowest id) with key fold_in(key(seed), step); a 64-bit seed travels as its two
32-bit words [hi, lo], the key data jax.random.key makes of it (a seed below 2**32 is [0,
seed]). Both filters keep tokens tied with the last kept one, so the kept set never depends on
sort order.

How the draw runs: a token's Gumbel noise is one threefry hash of (the row's key, its id)
(`_gumbel`), so rows whose kept tokens all lie among their candidates are drawn from those alone,
to the same token as a draw over the whole row. The candidates are each row's FILTER_CANDIDATES
(64) largest values (`find_top_k`: sorts of small arrays only), and the cutoffs come from them
when every filtering row's kept set lies inside them: top_k <= 64 (with or without top_p), or a
nucleus alone that the 64 hold (a peaked distribution). Else each filter finds its cutoff with an
exact radix select over the whole row (`_select`, 8 fused passes over [B, V]), for the rows
outside their candidates alone where a large batch has few of them, and the draw runs over whole
rows. A batch that doesn't use a filter pays for neither. The passes over [B, V] stay few: none
writes a float32 copy of logits / temperature or of min_p's cut (`Scaled` keeps the factors and
min_p's floor, and each pass computes the values it reads), the greedy argmax reads the logits in
their own dtype, and a branch stays a branch (`_cond`). Figures: `docs/performance-log.md`, "Seed workloads".

Before the filters, vLLM's order: the logits processors on the raw logits (`process_logits`:
logit_bias and min_tokens as sparse per-row adds, then the repetition, frequency and presence
penalties from each row's token counts), then temperature, min_p, top-k, top-p, the draw.
Greedy rows take the argmax of the processed logits. Every feature is a per-row value that
leaves a row unchanged when neutral, behind a `lax.cond` on the batch, so a batch that asks for
none of it runs what it ran before. Logprobs (`token_logprobs`) are those of the raw logits,
the model's own distribution (vLLM's default), whatever the processors and filters did.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p


def seed_words(seeds: int | np.ndarray) -> np.ndarray:  # u32[..., 2]
    """64-bit seeds (an int of any sign, taken mod 2**64, or a uint64 array) as threefry key
    data [hi, lo], made on the host: for a seed in [0, 2**32) `jax.random.key(seed)`'s."""
    s = np.asarray(seeds % 2**64 if isinstance(seeds, int) else seeds, np.uint64)
    return np.stack([s >> np.uint64(32), s & np.uint64(0xFFFFFFFF)], axis=-1).astype(np.uint32)


def _order_key(x: jax.Array) -> jax.Array:
    """f32 -> u32 with the same order (IEEE bits, negatives flipped), so selection is exact."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _cond(pred: jax.Array, true_fn, false_fn, *operands):
    """`lax.cond` that stays a branch on the GPU: XLA's conditional simplifier turns a two-way
    cond whose branches hold only elementwise ops and reductions into a select of both, so a
    pass over [B, V] behind one ran every step (H200, 256 x 151,936: two such branches were
    ~0.13 ms of a 0.64 ms step of `sample`). An optimization barrier is an op it cannot count
    as cheap."""

    def kept(fn):
        return lambda *args: lax.optimization_barrier(fn(*args))

    return lax.cond(pred, kept(true_fn), kept(false_fn), *operands)


class Scaled(NamedTuple):
    """logits / divisor with the values below `floor` dropped (-inf: min_p's cut), kept as its
    factors so that each pass over it computes the values it reads: a float32 copy of the scaled
    logits costs a write and a read of [B, V] (at 256 x 151,936 from bf16 logits, ~0.1 ms a step
    on an H200)."""

    logits: jax.Array  # [B, V], any float dtype
    divisor: jax.Array  # f32[B], > 0
    floor: jax.Array | None = None  # f32[B]; None: nothing dropped

    def scale(self, raw: jax.Array) -> jax.Array:  # raw [B, N] of each row's logits -> f32
        values = raw.astype(jnp.float32) / self.divisor[:, None]
        if self.floor is None:
            return values
        return jnp.where(values >= self.floor[:, None], values, -jnp.inf)

    def values(self) -> jax.Array:  # f32[B, V]
        return self.scale(self.logits)

    def row_max(self) -> jax.Array:  # f32[B]: exact, since dividing by a positive keeps order
        # (and the floor never drops a row's largest value)
        return jnp.max(self.logits, axis=1).astype(jnp.float32) / self.divisor

    def rows(self, rows: jax.Array) -> Scaled:
        floor = None if self.floor is None else self.floor[rows]
        return Scaled(self.logits[rows], self.divisor[rows], floor)


def _select(key: jax.Array, weight: jax.Array, target: jax.Array) -> jax.Array:
    """Per row, the largest T with sum(weight[key >= T]) >= target: u32[B] (0 if none).

    A radix select: 8 passes over key [B, V] fix 4 bits of T each, trying 16 thresholds at once
    (one fused [B, V] -> [B, 16] reduction), so no sort and no data-dependent shapes.
    """
    digit = jnp.arange(16, dtype=jnp.uint32)  # [16]

    def fix_digit(i, t):  # t: u32[B], its bits above `shift` fixed
        shift = (28 - 4 * i).astype(jnp.uint32)
        cand = t[:, None] | (digit[None, :] << shift)  # [B, 16], increasing
        hit = key[:, :, None] >= cand[:, None, :]  # [B, V, 16], fused into the sum
        mass = jnp.sum(jnp.where(hit, weight[:, :, None], 0.0), axis=1)  # [B, 16], decreasing
        # Digit 0 keeps the invariant mass(t) >= target, so it is the floor.
        best = jnp.maximum(jnp.sum(mass >= target[:, None], axis=1) - 1, 0)
        return t | (best.astype(jnp.uint32) << shift)

    # A loop, not 8 unrolled passes: every decode program holds two or three of these selects,
    # and unrolled they took 0.26 s of each compile on the CPU (0.16 s now); on an H200 the
    # loop costs ~0.07 ms a step where the selects run.
    return lax.fori_loop(0, 8, fix_digit, jnp.zeros(key.shape[:1], jnp.uint32))


# Rows whose top_k is at most this filter from their largest values only (`_candidate_cutoffs`).
FILTER_CANDIDATES = 64
# Up to this many rows whose kept set is not inside their candidates (a wide nucleus) run the
# radix selects alone, in batches of more than twice as many rows; more, and the whole batch does.
RADIX_FALLBACK_ROWS = 16


# Candidate arrays longer than this are narrowed by another round of chunks before they are
# sorted (`find_top_k`).
CANDIDATE_SORT_MAX = 1024


def find_top_k(
    x: jax.Array, k: int, *, sort_max: int = CANDIDATE_SORT_MAX
) -> tuple[jax.Array, jax.Array]:
    """The k largest values of each row of x [B, V] (k <= V), as float32 [B, k], and their ids,
    largest first, ties to the lower id (`lax.top_k`'s order), by sorting small arrays only:
    the k chunks of W columns with the largest maxima (ties to the lower chunk) hold the k
    largest values (a value outside them is beaten by each of their maxima), and so on while
    those candidates number more than `sort_max`. W, a power of two near sqrt(N / k), keeps both
    sorts (N / W maxima, k * W candidates) short. XLA's GPU TopK kernel took 0.3 ms a call at
    256 x 50,257 (k=16) and sorted whole rows for k > 16."""
    values, ids = x, None  # ids None: the column's
    while values.shape[1] > sort_max:
        narrowed = _largest_chunks(values, ids, k)
        if narrowed is None:
            break
        values, ids = narrowed
    values = values.astype(jnp.float32)
    if ids is None:
        ids = lax.broadcasted_iota(jnp.int32, values.shape, 1)
    # (value, id) pairs are distinct: no stable sort needed, and none of its extra operand.
    neg, ids = lax.sort((-values, ids), dimension=1, num_keys=2, is_stable=False)
    return -neg[:, :k], ids[:, :k]


def _largest_chunks(
    x: jax.Array, ids: jax.Array | None, k: int
) -> tuple[jax.Array, jax.Array] | None:
    """The columns of x [B, N] (ids [B, N] increasing along each row, or None: the column's) in
    the k chunks of W with the largest maxima, in column order: values f32[B, k * W] (-inf past
    N) and their ids; None where chunks of W would not narrow the row."""
    b, n = x.shape
    width = 2 ** round(math.log2(math.sqrt(n / k)))
    chunks = -(-n // width)
    if width == 1 or chunks <= k:  # chunks of one column are the row itself
        return None
    padded = jnp.pad(x, ((0, 0), (0, chunks * width - n)), constant_values=-jnp.inf)
    # Float32 keys: XLA sorts bf16 ones with cub's radix sort, a custom call that cost the engine
    # ~70 ms of TTFT a burst and ~0.2 ms a decode step (H200, Qwen3-0.6B, 256 sampled rows).
    maxima = padded.reshape(b, chunks, width).max(axis=2).astype(jnp.float32)  # [B, N / W]
    order = lax.broadcasted_iota(jnp.int32, maxima.shape, 1)
    _, best = lax.sort((-maxima, order), dimension=1, num_keys=2, is_stable=False)
    # The chosen chunks in column order: the next round's chunks keep ties in id order.
    best = jnp.sort(best[:, :k], axis=1)  # [B, k]
    cols = (best[:, :, None] * width + jnp.arange(width, dtype=jnp.int32)).reshape(b, -1)
    inside = cols < n
    at = jnp.minimum(cols, n - 1)
    values = jnp.take_along_axis(x, at, axis=1).astype(jnp.float32)
    values = jnp.where(inside, values, -jnp.inf)
    if ids is not None:  # past N: a padded column, after every real one
        cols = jnp.where(inside, jnp.take_along_axis(ids, at, axis=1), jnp.iinfo(jnp.int32).max)
    return values, cols


def _radix_cutoffs(
    key: jax.Array, scaled: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """u32[B] cutoff on key = _order_key(scaled) [B, V] by radix selects over the whole row, each
    filter behind its own `lax.cond`."""
    zero = jnp.zeros(key.shape[:1], jnp.uint32)
    cut_k = _cond(  # the k-th largest value: the largest T with count(key >= T) >= k
        jnp.any(top_k > 0),
        lambda: jnp.where(
            top_k > 0, _select(key, jnp.ones_like(scaled), top_k.astype(jnp.float32)), zero
        ),
        lambda: zero,
    )

    def nucleus():  # the largest T whose kept mass, renormalised over the top-k set, is >= p
        kept = jnp.where(key >= cut_k[:, None], scaled, -jnp.inf)  # [B, V]
        probs = jnp.exp(kept - jax.nn.logsumexp(kept, axis=1, keepdims=True))  # [B, V]
        return jnp.where(top_p < 1.0, _select(key, probs, top_p), zero)

    cut_p = _cond(jnp.any(top_p < 1.0), nucleus, lambda: zero)
    return jnp.maximum(cut_k, cut_p)


def _candidate_cutoffs(
    scaled: Scaled, top_k: jax.Array, top_p: jax.Array, row_lse: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The same cutoffs from each row's FILTER_CANDIDATES largest values only (`row_lse`: each
    row's logsumexp of `scaled`, [B], read by rows with a nucleus alone) -> (u32[B], bool[B]:
    whether the row's kept set lies inside its candidates, so its cutoff is the radix one, and
    the candidates: values f32[B, C], largest first, and their ids i32[B, C]).
    It does for top_k <= FILTER_CANDIDATES (unless the k-th value's ties run past the
    candidates), and for a nucleus alone when the candidates hold top_p of the mass (short of
    their last value, or ties past them could belong to it)."""
    vocab = scaled.logits.shape[1]
    c = min(FILTER_CANDIDATES, vocab)
    # The largest logits are the largest scaled values (a positive divisor keeps order; ties it
    # makes are counted below, by value).
    raw, ids = find_top_k(scaled.logits, c)  # [B, C], largest first
    vals = scaled.scale(raw)
    k = top_k
    kth = jnp.where(k > 0, vals[jnp.arange(k.shape[0]), jnp.clip(k - 1, 0, c - 1)], -jnp.inf)
    kept = vals >= kth[:, None]  # [B, C]: the top-k set (every candidate without top_k)
    # A value outside the candidates is at most the last of them: only a k-th value that
    # reaches it can have ties outside, and only then is the whole row counted.
    ties_inside = _cond(
        jnp.any((k > 0) & (vals[:, -1] >= kth)),
        lambda: jnp.sum(scaled.values() >= kth[:, None], axis=1) == jnp.sum(kept, axis=1),
        lambda: jnp.ones(k.shape, bool),
    )
    complete_k = (k == 0) | ((k <= c) & ties_inside)
    # Probabilities over the top-k set, or over the whole row without top_k.
    lse = jnp.where(k > 0, jax.nn.logsumexp(jnp.where(kept, vals, -jnp.inf), axis=1), row_lse)
    probs = jnp.where(kept, jnp.exp(vals - lse[:, None]), 0.0)  # [B, C]
    # mass[b, i]: what a cutoff at vals[b, i] keeps (every candidate at least as large)
    at_least = vals[:, None, :] >= vals[:, :, None]  # [B, C, C]
    mass = jnp.sum(jnp.where(at_least, probs[:, None, :], 0.0), axis=2)  # [B, C]
    reached = kept & (mass >= top_p[:, None])
    cut_p = jnp.max(jnp.where(reached, vals, -jnp.inf), axis=1)  # [B]
    # A nucleus alone that ends on the last candidate may have ties past it (a top_k's cut
    # there is the k-th value, whose ties were counted).
    ends_inside = (k > 0) | (cut_p > vals[:, -1]) | (c == vocab)
    complete_p = (top_p >= 1.0) | (jnp.any(reached, axis=1) & ends_inside)
    zero = jnp.zeros(k.shape, jnp.uint32)
    cut = jnp.maximum(
        jnp.where(k > 0, _order_key(kth), zero), jnp.where(top_p < 1.0, _order_key(cut_p), zero)
    )
    return cut, complete_k & complete_p, vals, ids


class Cutoffs(NamedTuple):
    """What the filters keep of each row: tokens whose `_order_key` is >= `cut`; where `inside`,
    a row filters and every token it keeps is among its `values` / `ids` (its largest values,
    zeros where not computed), so a draw over those equals the draw over the row."""

    cut: jax.Array  # u32[B], 0 keeps all
    inside: jax.Array  # bool[B]
    values: jax.Array  # f32[B, C]
    ids: jax.Array  # i32[B, C]


def _filter_cutoffs(scaled: Scaled, top_k: jax.Array, top_p: jax.Array) -> Cutoffs:
    """Each row's cutoff on `_order_key(scaled.values())` [B, V], with its candidates where its
    kept set lies inside them (`Cutoffs`). From the rows' largest values where it does (top_k <=
    FILTER_CANDIDATES: at 256 x 50,257 the radix selects took 0.47 ms for top_k and 0.85 ms for
    top_p, H200), by radix selects over the other rows (over all of them past
    RADIX_FALLBACK_ROWS); a batch without filters pays for neither."""
    b, vocab = scaled.logits.shape
    c = min(FILTER_CANDIDATES, vocab)
    outside = jnp.zeros(b, bool)
    no_candidates = (jnp.zeros((b, c), jnp.float32), jnp.zeros((b, c), jnp.int32))

    def radix():
        x = scaled.values()
        return Cutoffs(_radix_cutoffs(_order_key(x), x, top_k, top_p), outside, *no_candidates)

    # Rows left to the radix selects alone, at most; more, and the whole batch runs them (few
    # rows gain little, and cost a compile).
    alone = RADIX_FALLBACK_ROWS if b > 2 * RADIX_FALLBACK_ROWS else 0

    def filtered(row_lse):
        cut, complete, vals, ids = _candidate_cutoffs(scaled, top_k, top_p, row_lse)
        from_candidates = Cutoffs(cut, complete & ((top_k > 0) | (top_p < 1.0)), vals, ids)

        def few_rows():  # the radix selects over those rows only (padded with row 0)
            rows = jnp.nonzero(~complete, size=RADIX_FALLBACK_ROWS, fill_value=0)[0]  # [R]
            sub = scaled.rows(rows).values()  # [R, V]
            sub = _radix_cutoffs(_order_key(sub), sub, top_k[rows], top_p[rows])
            cuts = cut.at[rows].set(jnp.where(complete[rows], cut[rows], sub))
            return Cutoffs(cuts, outside, *no_candidates)

        left = jnp.sum(~complete)
        if not alone:
            return _cond(left == 0, lambda: from_candidates, radix)
        return _cond(
            left == 0, lambda: from_candidates, lambda: _cond(left <= alone, few_rows, radix)
        )

    def row_stats():  # each row's max and logsumexp (as jax.nn.logsumexp's, sharing the max)
        row_max = scaled.row_max()  # [B]
        shift = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        total = jnp.sum(jnp.exp(scaled.values() - shift[:, None]), axis=1)
        return row_max, shift + jnp.log(total)

    def any_filter():  # a top_k past the candidates goes straight to the radix selects
        # Only a nucleus alone reads the row's logsumexp: two passes over the logits a top_k
        # batch skips.
        alone_p = (top_k == 0) & (top_p < 1.0)
        row_max, row_lse = _cond(jnp.any(alone_p), row_stats, lambda: (jnp.zeros(b), jnp.zeros(b)))
        # A nucleus alone that the candidates cannot hold: their mass is at most
        # FILTER_CANDIDATES times the likeliest token's. More such rows than the radix selects
        # take alone, and the candidates' sorts would be wasted (H200, a step of `sample`: 16
        # flat rows 0.52 ms with them, 0.40 without; 256 flat rows 1.37-1.39, 1.24-1.25).
        flat = alone_p & (FILTER_CANDIDATES * jnp.exp(row_max - row_lse) < top_p)
        straight = jnp.any(top_k > FILTER_CANDIDATES) | (jnp.sum(flat) > alone)
        return _cond(straight, radix, lambda: filtered(row_lse))

    return _cond(
        jnp.any((top_k > 0) | (top_p < 1.0)),
        any_filter,
        lambda: Cutoffs(jnp.zeros(b, jnp.uint32), outside, *no_candidates),
    )


def _gumbel(keys: jax.Array, ids: jax.Array) -> jax.Array:
    """Gumbel noise of each (row, token id): keys u32[B, 2] (each row's threefry key data), ids
    i32[B, N] -> f32[B, N]. One threefry hash of (key, id) an element, so a token's noise is the
    same whichever of its row's tokens are drawn over: a draw over a row's candidates picks what
    the draw over its whole vocabulary picks."""
    k1, k2 = (jnp.broadcast_to(keys[:, i : i + 1], ids.shape) for i in range(2))
    hi, lo = threefry2x32_p.bind(k1, k2, jnp.zeros(ids.shape, jnp.uint32), ids.astype(jnp.uint32))
    # 23 random mantissa bits -> [1, 2) -> [0, 1), kept off 0 (as jax.random.gumbel)
    unit = lax.bitcast_convert_type(((hi ^ lo) >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0
    return -jnp.log(-jnp.log(jnp.maximum(unit, jnp.finfo(jnp.float32).tiny)))


def _scores(values: jax.Array, ids: jax.Array, cut: jax.Array, keys: jax.Array) -> jax.Array:
    """Gumbel-perturbed values [B, N] of the tokens `ids` [B, N] each row keeps
    (`_order_key(values) >= cut`), -inf for the rest: the draw takes the largest."""
    kept = _order_key(values) >= cut[:, None]
    return jnp.where(kept, values + _gumbel(keys, ids), -jnp.inf)


def _draw(scaled: Scaled, cut: jax.Array, keys: jax.Array) -> jax.Array:
    """Gumbel-max over each row's kept tokens -> i32[B]; ties to the lowest id (the first)."""
    ids = lax.broadcasted_iota(jnp.int32, scaled.logits.shape, 1)  # [B, V]
    return jnp.argmax(_scores(scaled.values(), ids, cut, keys), axis=1).astype(jnp.int32)


def _draw_among_candidates(cutoffs: Cutoffs, keys: jax.Array, vocab: int) -> jax.Array:
    """`_draw` over rows whose kept tokens all lie among their candidates, from those alone:
    the same tokens for a hash of FILTER_CANDIDATES ids a row instead of V (at 256 x 151,936 the
    whole-row draw is a pass of hashes, logs and an argmax over 39M logits). The candidates are
    in value order, so a tie goes to the lowest id by a min, not by position."""
    score = _scores(cutoffs.values, cutoffs.ids, cutoffs.cut, keys)  # [B, C]
    best = jnp.max(score, axis=1, keepdims=True)
    return jnp.min(jnp.where(score == best, cutoffs.ids, vocab), axis=1)


MAX_LOGPROBS = 20  # most alternatives a request may ask for beside each token (vLLM's default)
MAX_LOGIT_BIAS = 256  # logit_bias entries per request
FLOAT32_MAX = float(np.finfo(np.float32).max)
# Token counts for the penalties: u16 per (row, token), the output count in the low 15 bits
# (saturating: past 32,767 of one token the frequency penalty stops growing) and whether the
# prompt holds the token in the top bit. Half the bytes of int32 counts (B=256 x V=151,936:
# 78 MB), exact below that count, and one array read per step for all three penalties.
COUNT_MASK = 0x7FFF
PROMPT_BIT = 0x8000
NO_BIAS_UNTIL = 2**31 - 1  # `bias_until` of an entry that always holds (logit_bias)


class Processors(NamedTuple):
    """Each row's logits processors. Neutral values (no bias, penalties 0, 0 and 1) leave its
    logits exactly as they are, so rows without any share a batch with rows that have them."""

    steps: jax.Array  # i32[B]: tokens the row has generated
    has_bias: jax.Array  # bool[B]: whether the row's bias entries mean anything
    bias_ids: jax.Array  # i32[B, K]: token ids, sparse
    bias_values: jax.Array  # f32[B, K]: added to their logits (-inf: banned)
    bias_until: jax.Array  # i32[B, K]: each entry holds while steps < it (min_tokens)
    presence: jax.Array  # f32[B]
    frequency: jax.Array  # f32[B]
    repetition: jax.Array  # f32[B]
    counts: jax.Array  # u16[B, V]: output counts and prompt bits (COUNT_MASK, PROMPT_BIT)

    def active(self) -> jax.Array:
        """bool[B]: rows whose processors may change their logits."""
        return self.has_bias | self.penalized()

    def penalized(self) -> jax.Array:
        """bool[B]: rows with a penalty."""
        return (self.presence != 0) | (self.frequency != 0) | (self.repetition != 1)


def process_logits(logits: jax.Array, p: Processors) -> jax.Array:
    """vLLM's logits processors on raw logits [B, V] -> f32 [B, V]: the sparse biases (logit_bias,
    and min_tokens' -inf on the stop ids while they hold), then the penalties: a token seen in
    the prompt or the output has a positive logit divided by `repetition` and a negative one
    multiplied by it (HF's and vLLM's rule); an output token loses frequency * its count and
    presence once."""
    x = logits.astype(jnp.float32)
    batch, vocab = x.shape
    active = p.has_bias[:, None] & (p.steps[:, None] < p.bias_until)
    ids = jnp.where(active, p.bias_ids, vocab)  # inactive entries dropped: nothing added
    x = x.at[jnp.arange(batch)[:, None], ids].add(p.bias_values, mode="drop")
    counts = p.counts.astype(jnp.int32)
    out = (counts & COUNT_MASK).astype(jnp.float32)  # [B, V]
    rep = jnp.where(counts != 0, p.repetition[:, None], 1.0)
    penalized = jnp.where(x > 0, x / rep, x * rep)
    penalized = penalized - p.frequency[:, None] * out - p.presence[:, None] * (out > 0)
    return jnp.where(p.penalized()[:, None], penalized, x)


def count_tokens(counts: jax.Array, tokens: jax.Array, add: jax.Array) -> jax.Array:
    """counts [B, V] with tokens [B] counted once more as output where `add` [B] (saturating),
    in one scatter that updates the entries in place (rows not counted are dropped)."""

    def bump(c):  # the output count in the low bits, the prompt bit above them kept
        cur = c.astype(jnp.int32)
        return jnp.where((cur & COUNT_MASK) < COUNT_MASK, cur + 1, cur).astype(c.dtype)

    rows = jnp.arange(tokens.shape[0])
    cols = jnp.where(add, tokens, counts.shape[1])  # past the vocabulary: dropped
    return counts.at[rows, cols].apply(bump, mode="drop")


class TokenLogprobs(NamedTuple):
    """Log-probabilities of chosen tokens under the raw logits, with the top alternatives."""

    logprob: jax.Array  # f32[...]: the token's
    rank: jax.Array  # i32[...]: tokens at least as likely, itself included (vLLM's rank)
    top_ids: jax.Array  # i32[..., N]: the N most likely, most likely first
    top_logprobs: jax.Array  # f32[..., N]


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> TokenLogprobs:
    """log_softmax of logits [B, V] (in f32) at tokens [B], their ranks, and each row's
    min(MAX_LOGPROBS, V) most likely: fixed shapes whatever a row asked for (the host keeps what
    each row asked for). No branch on how many were asked: a `lax.switch` between XLA's TopK
    kernel and a whole-row sort kept the decode window from running as one CUDA graph (H200, 256
    rows: 1.74 ms a step against 1.02 now)."""
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=1)  # [B]
    chosen = jnp.take_along_axis(x, tokens[:, None], axis=1)[:, 0]  # [B]
    rank = jnp.sum(x >= chosen[:, None], axis=1, dtype=jnp.int32)
    top_values, top_ids = find_top_k(x, min(MAX_LOGPROBS, x.shape[1]))
    return TokenLogprobs(chosen - lse, rank, top_ids, top_values - lse[:, None])


def empty_logprobs(shape: tuple[int, ...], vocab: int) -> TokenLogprobs:
    """Zeros of `token_logprobs`'s shapes, for `shape` tokens."""
    n = min(MAX_LOGPROBS, vocab)
    return TokenLogprobs(
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape, jnp.int32),
        jnp.zeros((*shape, n), jnp.int32),
        jnp.zeros((*shape, n), jnp.float32),
    )


def _min_p(scaled: Scaled, min_p: jax.Array) -> Scaled:
    """`scaled` without the tokens less likely than min_p times the most likely one (vLLM's
    min_p; 0: none): its floor is the least value the test keeps (the test is monotone in the
    value), so no pass writes the filtered values."""
    values = scaled.values()  # [B, V]
    kept = jnp.exp(values - scaled.row_max()[:, None]) >= min_p[:, None]
    floor = jnp.min(jnp.where(kept, values, jnp.inf), axis=1)  # [B]
    return scaled._replace(floor=jnp.where(min_p > 0, floor, -jnp.inf))


@jax.jit
def sample(
    logits: jax.Array,  # [B, V]
    temperature: jax.Array,  # f32[B]
    top_k: jax.Array,  # i32[B]
    top_p: jax.Array,  # f32[B]
    seed: jax.Array,  # u32[B], or u32[B, 2]: the [hi, lo] words of 64-bit seeds
    step: jax.Array,  # i32[B]: index of the token being generated for this request
    min_p: jax.Array | None = None,  # f32[B], 0 = off
) -> jax.Array:  # i32[B]
    """Next token per row. Row b's randomness depends only on (seed[b], step[b])."""
    vocab = logits.shape[1]
    # In the logits' own dtype: converting to float32 keeps the order (and a copy costs a pass).
    greedy = jnp.argmax(logits, axis=1).astype(jnp.int32)  # first max: HF/torch tie-breaking
    do_sample = temperature > 0

    def sampled():
        scaled = Scaled(logits, jnp.where(do_sample, temperature, 1.0))
        if min_p is not None:
            p_min = jnp.where(do_sample, min_p, 0.0)
            floor = _cond(
                jnp.any(p_min > 0),
                lambda: _min_p(scaled, p_min).floor,
                lambda: jnp.full(p_min.shape, -jnp.inf),
            )
            scaled = scaled._replace(floor=floor)
        # Greedy rows and top_k >= V never filter, so they never make a batch pay for it.
        k = jnp.where(do_sample & (top_k < vocab), top_k, 0)
        p = jnp.where(do_sample, top_p, 1.0)
        cutoffs = _filter_cutoffs(scaled, k, p)

        def row_key(s, n):  # s: a 32-bit seed, or the [hi, lo] key data of a 64-bit one
            impl = "threefry2x32"
            base = (
                jax.random.key(s, impl=impl)
                if s.ndim == 0
                else jax.random.wrap_key_data(s, impl=impl)
            )
            return jax.random.key_data(jax.random.fold_in(base, n))

        keys = jax.vmap(row_key)(seed, step)  # u32[B, 2]
        drawn = _cond(
            jnp.all(cutoffs.inside | ~do_sample),
            lambda: _draw_among_candidates(cutoffs, keys, vocab),
            lambda: _draw(scaled, cutoffs.cut, keys),
        )
        return jnp.where(do_sample, drawn, greedy)

    return _cond(jnp.any(do_sample), sampled, lambda: greedy)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _is_bounded(x, lo: float, hi: float) -> bool:
    return _is_real(x) and lo <= x <= hi


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What a user asks of one request (vLLM-style). Validated on construction: a bad value is a
    ValueError that names its field.

    top_k: 0 keeps every token (so does -1, vLLM's older form of it). top_p: in (0, 1], 1.0 = off.
    temperature: 0 = greedy. seed: an int in [-2**63, 2**64) (a negative one means its 64-bit two's
    complement, as in torch); None = a seed the engine draws from its own seed, one per request.
    stop: strings that end the output (not included in it). stop_token_ids: extra stop ids.
    ignore_eos: keep generating past EOS (for benchmarks).

    n: sequences generated from the prompt; they share its KV blocks, and sequence i samples
    with seed + i (vLLM's rule; seedless, each draws its own). logprobs: None, or 0-20: each
    generated token's logprob and rank, and that many most likely alternatives.
    prompt_logprobs: None, or 0-20: the same for every prompt token after the first, given the
    tokens before it (such a prompt is prefilled without the prefix cache, as in vLLM).
    Logprobs are those of the model's raw distribution: log_softmax of its logits before
    logit_bias, penalties, temperature and the filters (vLLM's default, "raw_logprobs").

    presence_penalty, frequency_penalty in [-2, 2]: subtracted from a token's logit once if it
    is in the output so far, and per occurrence (OpenAI's and vLLM's definitions).
    repetition_penalty > 0, 1 = off: a token in the prompt or the output so far has a positive
    logit divided by it and a negative one multiplied by it (HF's and vLLM's). logit_bias:
    {token id: bias in [-100, 100]} added to those logits (at most 256 entries; ids checked
    against the vocabulary when the request is added). min_tokens: EOS and the stop ids cannot
    be sampled, and stop strings are not looked for, until that many tokens are generated.
    min_p in [0, 1]: drop tokens less likely than min_p times the most likely one (after
    temperature). Order, as vLLM's: logit_bias, min_tokens, penalties, temperature, min_p,
    top_k, top_p.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be a 64-bit int or None, got {self.seed!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and (
            not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop)
        ):
            raise ValueError(f"stop must be a non-empty str or a list of them, got {self.stop!r}")
        ids = self.stop_token_ids
        if ids is not None and (
            not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids)
        ):
            raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {ids!r}")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_bounded(getattr(self, name), -2, 2):
                raise ValueError(f"{name} must be a number in [-2, 2], got {getattr(self, name)!r}")
        rep = self.repetition_penalty
        if not (_is_real(rep) and 0 < rep < math.inf):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {rep!r}"
            )
        bias = self.logit_bias
        if bias is not None and not (
            isinstance(bias, dict)
            and all(_is_int(t) and t >= 0 and _is_bounded(v, -100, 100) for t, v in bias.items())
        ):
            raise ValueError(
                f"logit_bias must map token ids (ints >= 0) to numbers in [-100, 100], got {bias!r}"
            )
        if bias is not None and len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(bias)} entries, at most {MAX_LOGIT_BIAS}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        if not _is_bounded(self.min_p, 0, 1):
            raise ValueError(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        # Normalise so the engine sees one form: floats, lists, plain ints.
        set_ = functools.partial(object.__setattr__, self)
        set_("max_tokens", int(self.max_tokens))
        set_("temperature", float(self.temperature))
        set_("top_k", max(int(self.top_k), 0))
        set_("top_p", float(self.top_p))
        set_("seed", None if self.seed is None else int(self.seed))
        set_("stop", None if stop is None else list(stop))
        set_("stop_token_ids", None if ids is None else [int(i) for i in ids])
        set_("ignore_eos", bool(self.ignore_eos))
        set_("n", int(self.n))
        for name in ("logprobs", "prompt_logprobs"):
            set_(name, None if getattr(self, name) is None else int(getattr(self, name)))
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            set_(name, float(getattr(self, name)))
        # The device holds it in float32: a larger one acts as float32's largest (was inf).
        set_("repetition_penalty", min(self.repetition_penalty, FLOAT32_MAX))
        set_("logit_bias", None if bias is None else {int(t): float(v) for t, v in bias.items()})
        set_("min_tokens", int(self.min_tokens))

    @property
    def has_processors(self) -> bool:
        """Whether any logits processor (bias, min_tokens, penalties) changes this request's
        logits."""
        return bool(self.logit_bias or self.min_tokens or self.has_penalties)

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)
