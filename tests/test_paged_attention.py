"""Paged decode attention (and its fused K/V append): the Pallas kernels, the XLA references and
the engine's chunked XLA path against a numpy oracle; the chunked XLA paths (decode and prefill)
against the references on caches poisoned with NaN wherever a row has no keys."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_append,
    paged_decode_attention_append_reference,
    paged_decode_attention_reference,
)
from pallas_kernels.paged_prefill_attention import paged_prefill_attention_reference
from rosejax.layers.attention import (
    cache_slots,
    causal_attention_xla,
    decode_attention,
    default_decode_splits,
    long_row_decode_splits,
    paged_attention_xla,
    paged_decode_attention_xla,
    prefill_attention,
)
from rosejax.settings import KernelConfig
from tests.conftest import INTERPRET, pairwise

# pallas: at these pages of 8 and 16, tiles of 8 and 4 pages (64 rows); one_page: the tile of
# the default pages of 64.
IMPLS = {
    "pallas": functools.partial(paged_decode_attention, interpret=INTERPRET),
    "pallas_one_page": functools.partial(
        paged_decode_attention, pages_per_tile=1, interpret=INTERPRET
    ),
    "pallas_prefetch": functools.partial(
        paged_decode_attention, prefetch_table=True, interpret=INTERPRET
    ),
    "reference": jax.jit(paged_decode_attention_reference),
    "xla": jax.jit(paged_decode_attention_xla),
}
APPEND_IMPLS = {
    "pallas": functools.partial(paged_decode_attention_append, interpret=INTERPRET),
    "pallas_one_page": functools.partial(
        paged_decode_attention_append, pages_per_tile=1, interpret=INTERPRET
    ),
    "pallas_prefetch": functools.partial(
        paged_decode_attention_append, prefetch_table=True, interpret=INTERPRET
    ),
    "reference": jax.jit(paged_decode_attention_append_reference, donate_argnums=(1, 2)),
}
# (B, H, D, block_size, blocks per row): GPT-2's heads, a head dim other than 64, B = 1, odd B.
# The oracle tests run each implementation on every shape and in every dtype, and every shape in
# every dtype: 9 cases of the product's 27.
SHAPES = [(5, 12, 64, 16, 4), (1, 4, 32, 8, 6), (3, 2, 16, 8, 3)]
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 3e-3}
POISON = 7.0  # finite: garbage in unused slots must be masked out, not just be NaN-free


def make_case(rng, b, h, d, bs, mb, dtype):
    num_blocks = 1 + b * mb + 3
    k = rng.normal(size=(h, num_blocks, bs, d)).astype(np.float32)
    v = rng.normal(size=(h, num_blocks, bs, d)).astype(np.float32)
    tables = (1 + rng.permutation(num_blocks - 1)[: b * mb]).reshape(b, mb).astype(np.int32)
    lengths = rng.integers(1, mb * bs + 1, b).astype(np.int32)
    lengths[0] = mb * bs  # one row with its table full
    # Poison every slot a row does not own or has not filled yet.
    owned = np.zeros((num_blocks, bs), bool)
    for row in range(b):
        for pos in range(lengths[row]):
            owned[tables[row, pos // bs], pos % bs] = True
    k[:, ~owned] = POISON
    v[:, ~owned] = POISON
    q = rng.normal(size=(b, h, d)).astype(np.float32)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), jnp.asarray(tables), jnp.asarray(lengths)


def oracle(q, k, v, tables, lengths):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, h, d = q.shape
    bs = k.shape[2]
    out = np.zeros_like(q)
    for row in range(b):
        n = int(lengths[row])
        idx = [(tables[row, p // bs], p % bs) for p in range(n)]
        keys = np.stack([k[:, blk, off] for blk, off in idx], axis=1)  # [H, n, D]
        vals = np.stack([v[:, blk, off] for blk, off in idx], axis=1)
        s = np.einsum("hd,hnd->hn", q[row], keys) / np.sqrt(d)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[row] = np.einsum("hn,hnd->hd", p / p.sum(axis=1, keepdims=True), vals)
    return out


@pytest.mark.parametrize(
    "impl,shape,dtype", pairwise(impl=list(IMPLS), shape=SHAPES, dtype=list(TOL))
)
def test_matches_oracle(impl, shape, dtype):
    rng = np.random.default_rng()
    q, k, v, tables, lengths = make_case(rng, *shape, dtype)
    out = IMPLS[impl](q, k, v, tables, lengths)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = oracle(q, k, v, np.asarray(tables), np.asarray(lengths))
    err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
    assert err <= TOL[dtype]


@pytest.mark.parametrize("impl", IMPLS)
def test_queries_from_fused_qkv(impl):
    """The model's call: q is the fused [B, 3H, D] projection; only its first H heads count."""
    rng = np.random.default_rng()
    q, k, v, tables, lengths = make_case(rng, 5, 12, 64, 16, 4, "float32")
    kv_noise = jnp.asarray(rng.normal(size=(5, 24, 64)), jnp.float32) * 100
    out = IMPLS[impl](jnp.concatenate([q, kv_noise], axis=1), k, v, tables, lengths)
    assert out.shape == q.shape
    ref = oracle(q, k, v, np.asarray(tables), np.asarray(lengths))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_padded_rows_give_zeros(impl):
    rng = np.random.default_rng()
    q, k, v, tables, lengths = make_case(rng, 3, 4, 32, 8, 2, "float32")
    lengths = lengths.at[1].set(0)
    out = np.asarray(IMPLS[impl](q, k, v, tables, lengths))
    assert np.all(np.isfinite(out)) and np.all(out[1] == 0)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: {**a, "q": a["q"][0]}, "need q"),
        (lambda a: {**a, "block_tables": a["block_tables"].astype(jnp.int16)}, "block_tables"),
        (lambda a: {**a, "lengths": a["lengths"][:-1]}, "lengths"),
        (lambda a: {**a, "q": a["q"][:, :, :16]}, "do not cover"),
        (lambda a: {**a, "q": a["q"][:, :3]}, "do not cover"),
    ],
)
def test_bad_shapes_raise(change, match):
    rng = np.random.default_rng()
    q, k, v, tables, lengths = make_case(rng, 2, 4, 32, 8, 2, "float32")
    args = dict(q=q, k_cache=k, v_cache=v, block_tables=tables, lengths=lengths)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**change(args), interpret=INTERPRET)


def make_append_case(rng, shape, dtype, padded_rows=(), lengths=None, shared_first_block=()):
    """make_case plus each row's new token: qkv [B, 3H, D] whose K/V must land at position
    lengths[b] - 1, whose slot holds a stale (finite) value before the call; rows in
    `padded_rows` get length 0. `lengths` replaces the random lengths; each (a, b) of
    `shared_first_block` gives row b row a's first block (a full prefix both read). Returns the
    inputs and the caches the call must leave (numpy, bit for bit)."""
    q, k, v, tables, random_lengths = make_case(rng, *shape, dtype)
    lengths = random_lengths if lengths is None else jnp.asarray(lengths, jnp.int32)
    lengths = lengths.at[np.asarray(padded_rows, int)].set(0)
    for a, b in shared_first_block:
        tables = tables.at[b, 0].set(tables[a, 0])
    b, h, d = q.shape
    bs = k.shape[2]
    kv_new = jnp.asarray(rng.normal(size=(b, 2 * h, d)), dtype)
    qkv = jnp.concatenate([q, kv_new], axis=1)
    want_k, want_v = np.array(k), np.array(v)
    for row in range(b):
        n = int(lengths[row])
        blk, off = (int(tables[row, (n - 1) // bs]), (n - 1) % bs) if n else (0, 0)
        want_k[:, blk, off] = np.asarray(kv_new[row, :h])
        want_v[:, blk, off] = np.asarray(kv_new[row, h:])
    return (qkv, k, v, tables, lengths), (want_k, want_v)


@pytest.mark.parametrize(
    "impl,shape,dtype", pairwise(impl=list(APPEND_IMPLS), shape=SHAPES, dtype=list(TOL))
)
def test_append_then_attend(impl, shape, dtype):
    """The new K/V land in their slots and nowhere else (poisoned slots stay as they were), and
    the output attends over them, not over the slot's stale value."""
    rng = np.random.default_rng()
    (qkv, k, v, tables, lengths), (want_k, want_v) = make_append_case(rng, shape, dtype)
    out, k_out, v_out = APPEND_IMPLS[impl](qkv, k, v, tables, lengths)
    np.testing.assert_array_equal(np.asarray(k_out), want_k)
    np.testing.assert_array_equal(np.asarray(v_out), want_v)
    h = want_k.shape[0]
    assert out.shape == (qkv.shape[0], h, qkv.shape[2]) and out.dtype == qkv.dtype
    ref = oracle(qkv[:, :h], want_k, want_v, np.asarray(tables), np.asarray(lengths))
    err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
    assert err <= TOL[dtype]


@pytest.mark.parametrize("impl", APPEND_IMPLS)
def test_append_padded_rows_write_scratch(impl):
    """A padded row (length 0) gives zeros and writes only scratch block 0, slot 0."""
    rng = np.random.default_rng()
    (qkv, k, v, tables, lengths), (want_k, want_v) = make_append_case(
        rng, (3, 4, 32, 8, 2), "float32", padded_rows=[1]
    )
    out, k_out, v_out = APPEND_IMPLS[impl](qkv, k, v, tables, lengths)
    out = np.asarray(out)
    assert np.all(np.isfinite(out)) and np.all(out[1] == 0)
    np.testing.assert_array_equal(np.asarray(k_out), want_k)
    np.testing.assert_array_equal(np.asarray(v_out), want_v)


@pytest.mark.parametrize("impl", APPEND_IMPLS)
def test_append_edge_rows(impl):
    """Rows chosen, not drawn: a first token (nothing cached, no page to read), a token opening a
    fresh page, a full table, two padded rows, and two rows reading one shared full block while
    writing their own slots. Every row's output is checked against the oracle."""
    rng = np.random.default_rng()
    bs = 8
    (qkv, k, v, tables, lengths), (want_k, want_v) = make_append_case(
        rng,
        (6, 4, 32, bs, 3),
        "float32",
        lengths=[1, bs + 1, 3 * bs, 0, 0, 2 * bs + 3],
        shared_first_block=[(2, 5)],
    )
    out, k_out, v_out = APPEND_IMPLS[impl](qkv, k, v, tables, lengths)
    h = want_k.shape[0]
    for got, want, first_head in ((k_out, want_k, h), (v_out, want_v, 2 * h)):
        got = np.array(got)
        # Both padded rows write scratch slot (block 0, offset 0), in no set order on a GPU: each
        # head's slot must hold one of their values, and every other element the expected one.
        for head in range(h):
            assert any(
                np.array_equal(got[head, 0, 0], np.asarray(qkv[row, first_head + head]))
                for row in (3, 4)
            )
        got[:, 0, 0] = want[:, 0, 0]
        np.testing.assert_array_equal(got, want)
    out = np.asarray(out)
    assert np.all(out[3:5] == 0)
    real = [0, 1, 2, 5]
    ref = oracle(qkv[real, :h], want_k, want_v, np.asarray(tables)[real], np.asarray(lengths)[real])
    np.testing.assert_allclose(out[real], ref, rtol=1e-4, atol=1e-5)


def test_append_needs_the_caches_dtype():
    rng = np.random.default_rng()
    (qkv, k, v, tables, lengths), _ = make_append_case(rng, (2, 4, 32, 8, 2), "float16")
    with pytest.raises(ValueError, match="share a dtype"):
        paged_decode_attention_append(
            qkv.astype(jnp.float32), k, v, tables, lengths, interpret=INTERPRET
        )


@pytest.mark.parametrize(
    "change", [lambda a: a[:, :8], lambda a: jnp.concatenate([a, a], 1)], ids=["2H", "6H"]
)
def test_append_needs_exactly_3h_heads(change):
    """q/k/v are found at heads 0, H and 2H: any other head count is a caller's mistake."""
    rng = np.random.default_rng()
    (qkv, k, v, tables, lengths), _ = make_append_case(rng, (2, 4, 32, 8, 2), "float32")
    with pytest.raises(ValueError, match="need 3H heads"):
        paged_decode_attention_append(change(qkv), k, v, tables, lengths, interpret=INTERPRET)


def make_prefill_case(rng, cached, new, h=4, d=16, bs=8, mb=5):
    """Rows with `cached[b]` tokens already in the cache and `new[b]` tokens in this chunk (padded
    to T = max(new)); the chunk's K/V are in the cache too, as the model writes them first."""
    b, t = len(cached), max(new)
    num_blocks = 1 + b * mb
    k_cache = np.full((h, num_blocks, bs, d), POISON, np.float32)
    v_cache = np.full((h, num_blocks, bs, d), POISON, np.float32)
    tables = (1 + rng.permutation(num_blocks - 1)).reshape(b, mb).astype(np.int32)
    positions = np.tile(np.arange(t, dtype=np.int32), (b, 1)) + np.asarray(cached)[:, None]
    k_new = rng.normal(size=(b, t, h, d)).astype(np.float32)
    v_new = rng.normal(size=(b, t, h, d)).astype(np.float32)
    for row in range(b):
        for pos in range(cached[row] + new[row]):
            blk, off = tables[row, pos // bs], pos % bs
            if pos < cached[row]:
                k_cache[:, blk, off], v_cache[:, blk, off] = rng.normal(size=(2, h, d))
            else:
                k_cache[:, blk, off] = k_new[row, pos - cached[row]]
                v_cache[:, blk, off] = v_new[row, pos - cached[row]]
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    return q, k_new, v_new, k_cache, v_cache, tables, positions


@pytest.mark.parametrize("cached", [[0, 0, 0], [0, 13, 5]], ids=["fresh", "prefix"])
def test_prefill_attention_matches_oracle(cached):
    rng = np.random.default_rng()
    new = [int(n) for n in rng.integers(1, 12, len(cached))]
    q, k, v, k_cache, v_cache, tables, positions = make_prefill_case(rng, cached, new)
    fresh = not any(cached)
    seq_lens = np.asarray(cached, np.int32) + np.asarray(new, np.int32)
    out = np.asarray(
        jax.jit(prefill_attention)(q, k, v, k_cache, v_cache, tables, positions, fresh, seq_lens)
    )
    for row, (c, n) in enumerate(zip(cached, new, strict=True)):
        for t in range(n):  # a query at position c + t sees keys 0..c + t
            got = out[row, t][None]  # [1, H, D]
            want = oracle(
                q[row, t][None], k_cache, v_cache, tables[row][None], np.array([c + t + 1])
            )
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    if not any(cached):  # the gather-free path on its own, on every real query
        dense = np.asarray(causal_attention_xla(q, k, v, positions))
        for row, n in enumerate(new):
            np.testing.assert_allclose(dense[row, :n], out[row, :n], rtol=1e-5, atol=1e-6)


# ------------------------------------- the chunked XLA paths: only the pages that hold keys count

# Every axis's first value is the hardest: GQA, an odd head dim and block size, several chunks.
LIVE_AXES = dict(
    group=[2, 4, 1],
    d=[80, 128, 64],
    bs=[5, 16],
    pages_per_chunk={"chunk4": 4, "default": None, "chunk1": 1},
    poison={"nan": np.nan, "huge": 1e30},
)


def slow_after_first(cases: list) -> list:
    """`pairwise` cases with all but the first under `-m slow`: the first (every axis's first
    value) keeps the default run to seconds."""
    slow = [pytest.param(*c.values, id=c.id, marks=pytest.mark.slow) for c in cases[1:]]
    return cases[:1] + slow


def make_live_case(rng, seq_lens, t, h, hq, d, bs, mb, poison):
    """Caches whose slots below each row's seq_lens hold random K/V and every other slot (a row's
    last page past its length, its unfilled pages, scratch block 0) `poison`, and the same caches
    with zeros there, for the references (which read every page); each row its own pages in
    random order, and queries q [B, t, Hq, D]."""
    b = len(seq_lens)
    num_blocks = 1 + b * mb
    tables = (1 + rng.permutation(num_blocks - 1)).reshape(b, mb).astype(np.int32)
    k, v = np.full((2, h, num_blocks, bs, d), poison, np.float32)
    clean_k, clean_v = np.zeros((2, h, num_blocks, bs, d), np.float32)
    for row, n in enumerate(seq_lens):
        for pos in range(n):
            blk, off = tables[row, pos // bs], pos % bs
            k[:, blk, off] = clean_k[:, blk, off] = rng.normal(size=(h, d))
            v[:, blk, off] = clean_v[:, blk, off] = rng.normal(size=(h, d))
    q = rng.normal(size=(b, t, hq, d)).astype(np.float32)
    return q, (k, v), (clean_k, clean_v), tables


@pytest.mark.parametrize(
    "b,group,d,bs,pages_per_chunk,poison", slow_after_first(pairwise(b=[8, 3, 1], **LIVE_AXES))
)
def test_xla_decode_reads_only_live_keys(b, group, d, bs, pages_per_chunk, poison):
    """The engine's XLA decode attention on caches poisoned wherever a row has no key (NaN or
    1e30) equals the gathering reference on clean caches. Rows: one token, a full table, a padded
    row (length 0: zeros), a block boundary and one past it, two blocks, random lengths."""
    rng = np.random.default_rng()
    h, mb = 2, 6
    edges = [1, mb * bs, 0, bs, bs + 1, 2 * bs, *rng.integers(1, mb * bs + 1, 2)]
    lengths = np.asarray(edges[:b], np.int32)
    hq = h * group
    q, poisoned, clean, tables = make_live_case(rng, lengths, 1, h, hq, d, bs, mb, poison)
    # The model's call: the fused projection, its K/V heads after the queries (noise here).
    qkv = np.concatenate([q[:, 0], rng.normal(size=(b, 2 * h, d)).astype(np.float32)], axis=1)
    attend = jax.jit(
        functools.partial(
            paged_decode_attention_xla, num_q_heads=hq, pages_per_chunk=pages_per_chunk
        )
    )
    out = np.asarray(attend(qkv, *poisoned, tables, lengths))
    want = paged_decode_attention_reference(qkv, *clean, tables, lengths, num_q_heads=hq)
    assert out.shape == (b, hq, d) and np.all(np.isfinite(out))
    np.testing.assert_allclose(out, np.asarray(want), rtol=1e-5, atol=1e-5)
    assert np.all(out[lengths == 0] == 0)


@pytest.mark.parametrize(
    "group,d,bs,pages_per_chunk,poison", slow_after_first(pairwise(**LIVE_AXES))
)
def test_xla_prefill_reads_only_live_keys(group, d, bs, pages_per_chunk, poison):
    """Prefill chunks continuing cached prefixes (a block's worth, one token, an odd count, a
    chunk that fills the table), a fresh row and a padded row (seq_lens 0), all padded to T as
    the engine pads them (padding tokens' positions run on past the row's length), on poisoned
    caches: equal to the gathering reference on clean caches, every token."""
    rng = np.random.default_rng()
    h, mb, t = 2, 6, 7
    cached = np.asarray([bs, 1, 2 * bs + 3, mb * bs - t, 0, 0], np.int32)
    new = np.asarray([t, 3, 5, t, 4, 0], np.int32)
    seq_lens = cached + new
    positions = cached[:, None] + np.arange(t, dtype=np.int32)[None, :]  # [B, T]
    q, poisoned, clean, tables = make_live_case(rng, seq_lens, t, h, h * group, d, bs, mb, poison)
    attend = jax.jit(functools.partial(paged_attention_xla, pages_per_chunk=pages_per_chunk))
    out = np.asarray(attend(q, *poisoned, tables, positions, seq_lens))
    want = paged_prefill_attention_reference(q, *clean, tables, positions, seq_lens)
    assert out.shape == q.shape and np.all(np.isfinite(out))
    np.testing.assert_allclose(out, np.asarray(want), rtol=1e-5, atol=1e-5)
    assert np.all(out[-1] == 0)


@pytest.mark.parametrize(
    "kernels",
    [KernelConfig(), KernelConfig(attention="pallas", interpret=True)],
    ids=["xla", "pallas-untiled"],
)
def test_decode_attention_xla_path(kernels):
    """The model's decode call (append the step's K/V, then attend) where XLA serves it: asked
    for, or a cache the Pallas kernel does not tile (head dim 96, block size 12). Caches and
    output equal the append reference's."""
    rng = np.random.default_rng()
    b, h, group, d, bs, mb = 4, 2, 2, 96, 12, 3
    hq = h * group
    _, k, v, tables, lengths = make_case(rng, b, h, d, bs, mb, "float32")
    lengths = lengths.at[2].set(0)  # a padded row: writes scratch block 0, gives zeros
    qkv = jnp.asarray(rng.normal(size=(b, hq + 2 * h, d)), jnp.float32)
    # A padded row's position is any past its length (0 here), as the engine's dead rows have.
    block, offset = cache_slots(tables, jnp.maximum(lengths - 1, 0)[:, None], lengths, bs)
    want = paged_decode_attention_append_reference(qkv, k, v, tables, lengths, num_q_heads=hq)
    got = jax.jit(decode_attention, static_argnames=["kernels", "num_q_heads"])(
        qkv, k, v, tables, lengths, block[:, 0], offset[:, 0], kernels, num_q_heads=hq
    )
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got[0])[2] == 0)


@pytest.mark.parametrize(
    "batch,kv_heads,max_pages,block_size,matrix_units,want",
    [
        (1, 8, 640, 64, True, 33),  # Qwen3-0.6B B=1 at 40,960 tokens: 8 x 33 programs ~ 2 a SM
        (1, 8, 16, 64, True, 4),  # ... at 1,024 tokens: 4 splits of 256
        (1, 8, 32, 64, True, 8),  # a 2,048-token table: 8 splits of 256 tokens at most
        (8, 8, 640, 64, True, 5),  # 64 programs: 5 give 2 a SM
        (16, 8, 640, 64, True, 3),  # 128 programs: 3 (Qwen3's and Llama's 16-row programs)
        (17, 8, 640, 64, True, 1),  # 136 matrix-unit programs fill 132 SMs
        (256, 8, 640, 64, True, 1),  # B=256
        (16, 12, 16, 64, False, 4),  # GPT-2's 16-row program at 1,024 tokens: 4 runs of 256
        (1, 12, 64, 16, False, 4),  # ... a 1-row one at block size 16
        (21, 12, 16, 64, False, 4),  # 252 vector-path programs: under 2 a SM
        (22, 12, 16, 64, False, 1),  # 264: 2 a SM
        (1, 8, 7, 64, True, 1),  # 448 tokens: one run of 256 and a part
        (1, 8, 8, 64, True, 2),  # 512 tokens: two runs
    ],
)
def test_default_decode_splits(batch, kv_heads, max_pages, block_size, matrix_units, want):
    assert default_decode_splits(batch, kv_heads, max_pages, block_size, matrix_units) == want


@pytest.mark.parametrize(
    "batch, kv_heads, max_pages, block_size, matrix_units, want",
    [
        (128, 8, 640, 64, True, 16),  # Qwen3-0.6B, 128 rows: 16 x 1,024 programs
        (256, 8, 640, 64, True, 8),  # 256 rows: 8
        (16, 8, 640, 64, True, 40),  # 16 rows: runs of 1,024 tokens of the 40,960 table
        (1, 8, 640, 64, True, 40),  # 1 row: finer than the default 33
        (1, 8, 16, 64, True, 4),  # a 1,024-token table: the default's 4 runs of 256
        (256, 12, 16, 64, False, 1),  # GPT-2's 256 rows: one run of its 1,024 tokens
    ],
)
def test_long_row_decode_splits(batch, kv_heads, max_pages, block_size, matrix_units, want):
    args = (batch, kv_heads, max_pages, block_size, matrix_units)
    assert long_row_decode_splits(*args) == want
    assert long_row_decode_splits(*args) >= default_decode_splits(*args)


def test_decode_attention_splits_long_tables():
    """The model's decode call through the Pallas kernel on a table long enough for the layer to
    split it (2,048 tokens a row at 2 rows x 2 KV heads): equal to the append reference."""
    rng = np.random.default_rng()
    b, h, group, d, bs, mb = 2, 2, 2, 32, 16, 128
    assert default_decode_splits(b, h, mb, bs, matrix_units=True) > 1
    hq = h * group
    _, k, v, tables, lengths = make_case(rng, b, h, d, bs, mb, "float32")
    lengths = jnp.asarray([rng.integers(1, 40 * bs), 3], jnp.int32)
    qkv = jnp.asarray(rng.normal(size=(b, hq + 2 * h, d)), jnp.float32)
    block, offset = cache_slots(tables, (lengths - 1)[:, None], lengths, bs)
    want = paged_decode_attention_append_reference(qkv, k, v, tables, lengths, num_q_heads=hq)
    kernels = KernelConfig(attention="pallas", interpret=True)
    got = jax.jit(decode_attention, static_argnames=["kernels", "num_q_heads"])(
        qkv, k, v, tables, lengths, block[:, 0], offset[:, 0], kernels, num_q_heads=hq
    )
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
