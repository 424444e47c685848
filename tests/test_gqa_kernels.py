"""Grouped-query decode attention (Hq query heads over H KV heads), with the q/k RMSNorm and RoPE
of its fused-append kernel, and RMSNorm: every implementation (the Pallas kernels, interpreted on
a CPU, and the XLA references; the engine's chunked XLA prefill attention too) against numpy
oracles, at head dims 64 and 128."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention
from pallas_kernels import paged_prefill_attention as prefill_module
from pallas_kernels.linear import linear, linear_partial_sums_reference
from pallas_kernels.paged_attention import (
    default_heads_per_program,
    paged_decode_attention,
    paged_decode_attention_append,
    paged_decode_attention_append_reference,
    paged_decode_attention_reference,
    uses_matrix_units,
)
from pallas_kernels.paged_prefill_attention import (
    default_block_q,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)
from pallas_kernels.qk_norm_rope import qk_norm_rope_reference as _qk_norm_rope_reference
from pallas_kernels.rms_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    default_block_rows,
    rms_norm,
    rms_norm_reference,
)
from rosejax.layers.attention import paged_attention_xla
from rosejax.layers.rotary import rope_cos_sin, rope_inv_freq
from tests.conftest import INTERPRET, every_case, pairwise
from tests.test_paged_attention import TOL, make_case, make_live_case, oracle


def every_head(kernel, pages: int = 1):
    """`kernel` with one program for all of a row's KV heads (`heads_per_program` H) where the
    group runs on the matrix units (its pages of 16 keys up), one head a program elsewhere;
    `pages` pages of them a tile."""

    def call(qkv, k_cache, *args, num_q_heads, **kwargs):
        h, _, bs, d = k_cache.shape
        hp = h if uses_matrix_units(num_q_heads // h, bs, d, 1) else 1
        return kernel(
            qkv,
            k_cache,
            *args,
            num_q_heads=num_q_heads,
            heads_per_program=hp,
            pages_per_tile=pages,
            matrix_min_group=1,
            interpret=INTERPRET,
            **kwargs,
        )

    return call


def kernel_variants(kernel) -> dict:
    """`kernel` at its defaults, and forced onto vector arithmetic (matrix_min_group 0) or the
    matrix units (1: every group, pages of 16 keys up), there with every KV head in one program.
    Tiles: pages of 8 and 16 make 64-row tiles of 8 and 4 pages by default (past the end of every
    table here); one page a tile (the default at pages of 64), and two with every head."""
    interpreted = functools.partial(kernel, interpret=INTERPRET)
    return {
        "pallas": interpreted,
        "pallas_vector": functools.partial(interpreted, matrix_min_group=0),
        "pallas_matrix": functools.partial(interpreted, matrix_min_group=1),
        "pallas_every_head": every_head(kernel),
        "pallas_one_page": functools.partial(interpreted, pages_per_tile=1),
        "pallas_vector_one_page": functools.partial(
            interpreted, matrix_min_group=0, pages_per_tile=1
        ),
        "pallas_every_head_pages": every_head(kernel, pages=2),
    }


IMPLS = kernel_variants(paged_decode_attention) | {
    "pallas_prefetch": functools.partial(
        paged_decode_attention, prefetch_table=True, interpret=INTERPRET
    ),
    "reference": jax.jit(paged_decode_attention_reference, static_argnames="num_q_heads"),
}
APPEND_IMPLS = kernel_variants(paged_decode_attention_append) | {
    "reference": jax.jit(
        paged_decode_attention_append_reference,
        donate_argnums=(1, 2),
        static_argnames=("num_q_heads", "eps"),
    ),
}
# (B, H, group, D, block_size, blocks per row): Qwen3-0.6B's group 2 at D 128, Llama-3.2-1B's 4
# at D 64, one query head for all (group 8) on pages too small for the matrix units, B = 1, and
# 4 KV heads of 8 queries each (every head in one program: 32 query rows).
SHAPES = [(3, 2, 2, 128, 16, 3), (2, 2, 4, 64, 16, 2), (1, 1, 8, 64, 8, 2), (2, 4, 8, 64, 16, 2)]


def gqa_oracle(q, k, v, tables, lengths, group):
    """Each KV head repeated for its group, then the multi-head oracle."""
    k, v = (np.repeat(np.asarray(x, np.float64), group, axis=0) for x in (k, v))
    return oracle(q, k, v, tables, lengths)


def make_gqa_case(rng, b, h, group, d, bs, mb, dtype):
    _, k, v, tables, lengths = make_case(rng, b, h, d, bs, mb, dtype)
    q = jnp.asarray(rng.normal(size=(b, h * group, d)), dtype)
    return q, k, v, tables, lengths


def check_gqa_decode(impl, shape, dtype):
    rng = np.random.default_rng()
    q, k, v, tables, lengths = make_gqa_case(rng, *shape, dtype)
    hq = q.shape[1]
    # The model's call: q heads first in the fused projection, K/V heads after them (noise here).
    noise = jnp.asarray(rng.normal(size=(q.shape[0], 2 * k.shape[0], q.shape[2])) * 100, dtype)
    out = IMPLS[impl](jnp.concatenate([q, noise], axis=1), k, v, tables, lengths, num_q_heads=hq)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = gqa_oracle(q, k, v, np.asarray(tables), np.asarray(lengths), shape[2])
    err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
    assert err <= TOL[dtype]


DECODE_AXES = dict(impl=list(IMPLS), shape=SHAPES, dtype=["float32", "bfloat16"])


@pytest.mark.parametrize("impl,shape,dtype", pairwise(**DECODE_AXES))
def test_gqa_decode_matches_oracle(impl, shape, dtype):
    """Every implementation at every shape and dtype, each pair once. Every case: below."""
    check_gqa_decode(impl, shape, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("impl,shape,dtype", every_case(**DECODE_AXES))
def test_gqa_decode_matches_oracle_every_case(impl, shape, dtype):
    check_gqa_decode(impl, shape, dtype)


@pytest.mark.parametrize("impl", APPEND_IMPLS)
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_gqa_append_then_attend(impl, shape):
    """The new K/V (heads Hq.. of the fused projection) land in their slot, the output attends
    over them; a padded row gives zeros and writes scratch."""
    rng = np.random.default_rng()
    q, k, v, tables, lengths = make_gqa_case(rng, *shape, "float32")
    b, hq, d = q.shape
    h, bs = k.shape[0], k.shape[2]
    lengths = lengths.at[b - 1].set(0) if b > 2 else lengths
    kv_new = jnp.asarray(rng.normal(size=(b, 2 * h, d)), jnp.float32)
    qkv = jnp.concatenate([q, kv_new], axis=1)
    want_k, want_v = np.array(k), np.array(v)
    for row in range(b):
        n = int(lengths[row])
        blk, off = (int(tables[row, (n - 1) // bs]), (n - 1) % bs) if n else (0, 0)
        want_k[:, blk, off] = np.asarray(kv_new[row, :h])
        want_v[:, blk, off] = np.asarray(kv_new[row, h:])
    out, k_out, v_out = APPEND_IMPLS[impl](qkv, k, v, tables, lengths, num_q_heads=hq)
    np.testing.assert_array_equal(np.asarray(k_out), want_k)
    np.testing.assert_array_equal(np.asarray(v_out), want_v)
    real = np.asarray(lengths) > 0
    ref = gqa_oracle(
        q[real], want_k, want_v, np.asarray(tables)[real], np.asarray(lengths)[real], hq // h
    )
    out = np.asarray(out)
    np.testing.assert_allclose(out[real], ref, rtol=1e-4, atol=1e-5)
    assert np.all(out[~real] == 0)


def test_gqa_heads_checked():
    rng = np.random.default_rng()
    q, k, v, tables, lengths = make_gqa_case(rng, 2, 2, 2, 64, 8, 2, "float32")
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention(q, k, v, tables, lengths, num_q_heads=3, interpret=INTERPRET)
    with pytest.raises(ValueError, match="Hq \\+ 2H"):
        paged_decode_attention_append(q, k, v, tables, lengths, num_q_heads=4, interpret=INTERPRET)


# ------------------------------------------------------- q/k RMSNorm and RoPE in the append kernel

qk_norm_rope_reference = jax.jit(_qk_norm_rope_reference, static_argnames=("num_q_heads", "eps"))
ROPE_IMPLS = APPEND_IMPLS  # the same kernels, given rope (and the q/k norm)
# (B, H, group, D, block_size, blocks per row): Qwen3-0.6B's group 2 at D 128, Llama-3.2-1B's 4 at
# D 64, multi-head (group 1) at D 128.
ROPE_SHAPES = [(3, 2, 2, 128, 16, 3), (2, 2, 4, 64, 16, 2), (3, 2, 1, 128, 8, 2)]
ROPE_TOL = {"float32": 1e-5, "bfloat16": 2e-2}
EPS = 1e-6


def rope_case(rng, b, h, group, d, bs, mb, dtype, qk_norm: bool):
    """A decode step's fused projection before its norm and rotation, the caches with the new
    tokens' slots poisoned with NaN (read, they would spoil the row), cos/sin of random
    positions, and the norm's scales (None without qk_norm). The last row of 3 is padded."""
    q, k, v, tables, lengths = make_gqa_case(rng, b, h, group, d, bs, mb, dtype)
    k, v, lengths = np.array(k), np.array(v), np.array(lengths)
    if b > 2:
        lengths[b - 1] = 0
    for row, n in enumerate(lengths):
        if n:
            k[:, tables[row, (n - 1) // bs], (n - 1) % bs] = np.nan
            v[:, tables[row, (n - 1) // bs], (n - 1) % bs] = np.nan
    k, v, lengths = jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths)
    kv_new = jnp.asarray(rng.normal(size=(b, 2 * h, d)) * 3, dtype)
    qkv = jnp.concatenate([q * 3, kv_new], axis=1)  # [B, Hq + 2H, D]
    positions = jnp.asarray(rng.integers(0, 4096, b), jnp.int32)
    rope = rope_cos_sin(positions, rope_inv_freq(d, 1e6))
    norms = None
    if qk_norm:
        norms = tuple(jnp.asarray(rng.normal(1.0, 0.3, d), dtype) for _ in range(2))
    return qkv, k, v, tables, lengths, rope, norms


def norm_rope_oracle(x, cos, sin, scale, eps):
    """x [N, H, D] -> RMSNorm (if scale is given) then rotate-half RoPE, in float64."""
    x = np.asarray(x, np.float64)
    if scale is not None:
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(scale, float)
    half = x.shape[-1] // 2
    c, s = np.asarray(cos, np.float64)[:, None], np.asarray(sin, np.float64)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


@pytest.mark.parametrize("dtype", list(ROPE_TOL))
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "rope_only"])
def test_qk_norm_rope_reference_matches_oracle(qk_norm, dtype):
    """The XLA path (the model's, and the kernel's reference) against the definition."""
    rng = np.random.default_rng()
    qkv, *_, rope, norms = rope_case(rng, 3, 2, 2, 128, 8, 3, dtype, qk_norm)
    out = qk_norm_rope_reference(qkv, rope, norms, num_q_heads=4, eps=EPS)
    assert out.shape == qkv.shape and out.dtype == qkv.dtype
    scales = (None, None) if norms is None else norms
    for heads, scale in ((slice(0, 4), scales[0]), (slice(4, 6), scales[1])):
        want = norm_rope_oracle(qkv[:, heads], *rope, scale, EPS)
        np.testing.assert_allclose(
            np.asarray(out[:, heads], np.float64), want, rtol=ROPE_TOL[dtype], atol=ROPE_TOL[dtype]
        )
    np.testing.assert_array_equal(np.asarray(out[:, 6:]), np.asarray(qkv[:, 6:]))  # v as it was


def check_rope_append(impl, shape, qk_norm, dtype):
    rng = np.random.default_rng()
    qkv, k, v, tables, lengths, rope, norms = rope_case(rng, *shape, dtype, qk_norm)
    hq = shape[1] * shape[2]
    h, bs = k.shape[0], k.shape[2]
    # What the kernel must write and attend with: the XLA path's q/k. The same float32 ops and
    # roundings: bit for bit where they are computed alike (on a CPU, no norm); the norm's
    # rsqrt may differ in its last bit (XLA:CPU's vectorized one against its scalar one, a
    # GPU's), which may move a rounding by one step of the dtype.
    rotated = qk_norm_rope_reference(qkv, rope, norms, num_q_heads=hq, eps=EPS)
    want_k, want_v = np.array(k), np.array(v)
    for row in range(qkv.shape[0]):
        n = int(lengths[row])
        blk, off = (int(tables[row, (n - 1) // bs]), (n - 1) % bs) if n else (0, 0)
        want_k[:, blk, off] = np.asarray(rotated[row, hq : hq + h])
        want_v[:, blk, off] = np.asarray(rotated[row, hq + h :])
    out, k_out, v_out = ROPE_IMPLS[impl](
        qkv, k, v, tables, lengths, rope, norms, num_q_heads=hq, eps=EPS
    )
    assert out.shape == (qkv.shape[0], hq, qkv.shape[2]) and out.dtype == qkv.dtype
    exact = not qk_norm and (INTERPRET or impl == "reference")
    new_k = np.abs(np.asarray(rotated[:, hq : hq + h], np.float64))
    step = 0.0 if exact else 2 * float(jnp.finfo(dtype).eps) * float(np.max(new_k))
    np.testing.assert_allclose(np.asarray(k_out, np.float64), want_k, rtol=0, atol=step)
    np.testing.assert_array_equal(np.asarray(v_out), want_v)
    real = np.asarray(lengths) > 0
    ref = gqa_oracle(
        rotated[real, :hq], want_k, want_v, np.asarray(tables)[real], lengths[real], shape[2]
    )
    out = np.asarray(out, np.float64)
    assert np.linalg.norm(out[real] - ref) / np.linalg.norm(ref) <= ROPE_TOL[dtype]
    assert np.all(out[~real] == 0)


@pytest.mark.parametrize(
    "impl,shape,qk_norm,dtype",
    pairwise(
        impl=list(ROPE_IMPLS), shape=ROPE_SHAPES[:2], qk_norm=[True, False], dtype=list(ROPE_TOL)
    ),
)
def test_append_normalizes_and_rotates(impl, shape, qk_norm, dtype):
    """q and k normalized (Qwen3) and rotated in the kernel, as the XLA path does before it: the
    new K/V land in their slots (poisoned first), the output attends over them, a padded row
    gives zeros and writes scratch. Every case of the product (group 1 too): below."""
    check_rope_append(impl, shape, qk_norm, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(ROPE_TOL))
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "rope_only"])
@pytest.mark.parametrize("shape", ROPE_SHAPES)
@pytest.mark.parametrize("impl", ROPE_IMPLS)
def test_append_normalizes_and_rotates_every_case(impl, shape, qk_norm, dtype):
    check_rope_append(impl, shape, qk_norm, dtype)


def test_rope_args_checked():
    rng = np.random.default_rng()
    qkv, k, v, tables, lengths, rope, norms = rope_case(rng, 2, 2, 2, 64, 8, 2, "float32", True)
    with pytest.raises(ValueError, match="qk_norm needs rope"):
        paged_decode_attention_append(
            qkv, k, v, tables, lengths, None, norms, num_q_heads=4, interpret=INTERPRET
        )
    with pytest.raises(ValueError, match="rope must be float32"):
        half_rope = tuple(a[:, :16] for a in rope)
        paged_decode_attention_append(
            qkv, k, v, tables, lengths, half_rope, norms, num_q_heads=4, interpret=INTERPRET
        )
    with pytest.raises(ValueError, match="scales must be"):
        short = tuple(s[:32] for s in norms)
        paged_decode_attention_append(
            qkv, k, v, tables, lengths, rope, short, num_q_heads=4, interpret=INTERPRET
        )


# --------------------------------------------- split-K: several programs per (row, KV head)

SPLIT_VARIANTS = ["plain", "append", "rope", "qk_norm_rope"]


def split_case(rng, variant, group, d, bs, dtype):
    """Rows of very different lengths (one token, a page boundary, a full table, a padded row,
    one past a boundary) on caches poisoned with NaN wherever a row has no key (and, to append,
    in each new token's slot); the clean caches and the call's arguments (rope: cos/sin, norm
    scales) for the reference."""
    h, mb = 2, 5
    lengths = np.asarray([1, bs, mb * bs, 0, bs + 1], np.int32)
    b, hq = len(lengths), h * group
    q, (k, v), clean, tables = make_live_case(rng, lengths, 1, h, hq, d, bs, mb, np.nan)
    qkv = np.concatenate([q[:, 0] * 3, rng.normal(size=(b, 2 * h, d)) * 3], axis=1)
    if variant != "plain":
        for row, n in enumerate(lengths):
            if n:
                k[:, tables[row, (n - 1) // bs], (n - 1) % bs] = np.nan
                v[:, tables[row, (n - 1) // bs], (n - 1) % bs] = np.nan
    extra = ()
    if variant in ("rope", "qk_norm_rope"):
        rope = rope_cos_sin(jnp.asarray(rng.integers(0, 4096, b), jnp.int32), rope_inv_freq(d, 1e6))
        norms = None
        if variant == "qk_norm_rope":
            norms = tuple(jnp.asarray(rng.normal(1.0, 0.3, d), dtype) for _ in range(2))
        extra = (rope, norms)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(qkv), (cast(k), cast(v)), tuple(map(cast, clean)), tables, lengths, extra


def split_call(variant, qkv, caches, tables, lengths, extra, hq, num_splits, heads=1, pages=1):
    """The kernel of `variant` with `num_splits`, on copies of the caches (it donates them);
    heads "every": all of a row's KV heads in one program where the matrix units run; `pages`
    pages a tile."""
    caches = tuple(jnp.array(c, copy=True) for c in caches)
    args = (qkv, *caches, tables, lengths)
    kernel = paged_decode_attention
    if variant != "plain":
        args += extra
        kernel = functools.partial(paged_decode_attention_append, eps=EPS)
    if heads == "every":
        out = every_head(kernel, pages)(*args, num_q_heads=hq, num_splits=num_splits)
    else:
        out = kernel(
            *args,
            num_q_heads=hq,
            num_splits=num_splits,
            pages_per_tile=pages,
            interpret=INTERPRET,
        )
    return (out, *caches) if variant == "plain" else out


def check_split(num_splits, variant, group, d, bs, dtype, heads=1, pages=1):
    rng = np.random.default_rng()
    qkv, caches, clean, tables, lengths, extra = split_case(rng, variant, group, d, bs, dtype)
    h, bs = caches[0].shape[0], caches[0].shape[2]
    hq = h * group
    out, k_out, v_out = split_call(
        variant, qkv, caches, tables, lengths, extra, hq, num_splits, heads, pages
    )
    if variant == "plain":
        want = paged_decode_attention_reference(qkv, *clean, tables, lengths, num_q_heads=hq)
        want_caches = caches
    else:
        want, *ref_caches = paged_decode_attention_append_reference(
            qkv, *clean, tables, lengths, *extra, num_q_heads=hq, eps=EPS
        )
        # Each row's new K/V in its slot (the padded row's in scratch slot 0), once; every other
        # slot as it was, NaN included.
        want_caches = tuple(np.array(c) for c in caches)
        for row, n in enumerate(lengths):
            blk, off = (tables[row, (n - 1) // bs], (n - 1) % bs) if n else (0, 0)
            for w, r in zip(want_caches, ref_caches, strict=True):
                w[:, blk, off] = np.asarray(r[:, blk, off])
    # The norm's rsqrt may differ in its last bit from XLA's, and RoPE's products may round
    # apart in the two programs (XLA:CPU's older fusion emitters, the tests' setting, did in one
    # case): a rounding step of the new K.
    step = 2 * float(jnp.finfo(dtype).eps) * float(np.nanmax(np.abs(np.asarray(qkv, float))))
    atol = step if variant in ("rope", "qk_norm_rope") else 0
    for got, w in zip((k_out, v_out), want_caches, strict=True):
        np.testing.assert_allclose(np.asarray(got, float), np.asarray(w, float), rtol=0, atol=atol)
    out = np.asarray(out, np.float64)
    assert out.shape == (len(lengths), hq, d) and np.all(np.isfinite(out))
    assert np.all(out[lengths == 0] == 0)
    if dtype == "float32":  # the same sums in another order: float32 rounding apart
        np.testing.assert_allclose(out, np.asarray(want, np.float64), rtol=1e-5, atol=1e-5)
        return
    # bf16: the one-pass kernel's output, to a rounding step of the dtype. On the matrix units
    # each split rounds its softmax weights to bf16 against its own max: each weight within a
    # step, so the output within a step of the largest value.
    one, *_ = split_call(variant, qkv, caches, tables, lengths, extra, hq, 1, heads, pages)
    one = np.asarray(one, np.float64)
    eps = float(jnp.finfo(dtype).eps)
    atol = 1e-5
    if uses_matrix_units(group, bs, d):
        atol = eps * max(float(np.max(np.abs(clean[1]))), float(np.max(np.abs(qkv))))
    np.testing.assert_allclose(out, one, rtol=eps, atol=atol)


SPLIT_AXES = dict(
    num_splits=[3, 4, 2, 1],
    variant=SPLIT_VARIANTS,
    group_d=[(4, 64), (1, 128), (2, 128), (2, 64)],
    block_size=[16, 8],  # groups of 2 and 4 on the matrix units at 16 (the default), not at 8
    dtype=["float32", "bfloat16"],
    heads=[1, "every"],  # KV heads a program: "every" where the matrix units run
    pages=[1, 2, 4],  # pages a tile: the 5-page tables end inside a tile of 2 or 4
)
# Splits 2, 3 (an uneven division) and 4, every group size and head dim, plain, fused append and
# fused q/k norm + RoPE, float32 and bf16, a program per head or per row, tiles of 1, 2 and 4
# pages, in a few seconds; one split is the suites above.
SPLIT_CASES = [
    (3, "plain", (4, 64), 16, "float32", "every", 2),
    (4, "append", (1, 128), 8, "float32", 1, 4),
    (2, "qk_norm_rope", (2, 128), 16, "bfloat16", 1, 1),
    (3, "qk_norm_rope", (2, 128), 16, "float32", "every", 1),
    (2, "rope", (2, 64), 16, "bfloat16", 1, 2),
]
SPLIT_PARAMS = "num_splits,variant,group_d,block_size,dtype,heads,pages"


@pytest.mark.parametrize(SPLIT_PARAMS, SPLIT_CASES)
def test_split_decode(num_splits, variant, group_d, block_size, dtype, heads, pages):
    """The split kernels (plain, fused append, fused q/k norm and RoPE) against the references:
    rows from one token to a full table and a padded row in one batch, caches poisoned with NaN
    wherever no key is, the new K/V written once into their slots. Every pair: below."""
    check_split(num_splits, variant, *group_d, block_size, dtype, heads, pages)


@pytest.mark.slow
@pytest.mark.parametrize(SPLIT_PARAMS, pairwise(**SPLIT_AXES))
def test_split_decode_pairwise(num_splits, variant, group_d, block_size, dtype, heads, pages):
    check_split(num_splits, variant, *group_d, block_size, dtype, heads, pages)


def test_num_splits_checked():
    rng = np.random.default_rng()
    q, k, v, tables, lengths = make_gqa_case(rng, 2, 2, 2, 64, 8, 2, "float32")
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, k, v, tables, lengths, num_splits=0, interpret=INTERPRET)


@pytest.mark.parametrize(
    "batch,num_heads,block_size,head_dim,itemsize,matrix_units,want",
    [
        (256, 8, 64, 128, 2, True, 2),  # Qwen3-0.6B's 256-row step: two heads a program
        (512, 8, 32, 64, 2, True, 2),
        (256, 8, 16, 128, 2, True, 4),  # 16-token pages: four heads fill 64 rows
        (256, 2, 16, 128, 2, True, 2),  # ... halved to the heads there are
        (256, 8, 16, 256, 4, True, 2),  # ... and to 32 KiB of K (float32, head dim 256)
        (128, 8, 64, 128, 2, True, 1),  # fewer rows: a program a head
        (256, 8, 64, 128, 4, True, 1),  # float32: a [128, 128] tile of K past 32 KiB
        (256, 8, 128, 128, 2, True, 1),  # so are 128-token pages
        (256, 1, 64, 128, 2, True, 1),  # one KV head
        (256, 12, 64, 64, 2, False, 1),  # vector arithmetic (GPT-2)
    ],
)
def test_default_heads_per_program(
    batch, num_heads, block_size, head_dim, itemsize, matrix_units, want
):
    got = default_heads_per_program(batch, num_heads, block_size, head_dim, itemsize, matrix_units)
    assert got == want


@pytest.mark.parametrize(
    "batch,hp,block_size,want",
    [
        (32, 1, 16, 4),  # 64 rows of one head's pages
        (1, 1, 8, 8),
        (32, 1, 64, 1),  # the default pages: unchanged
        (128, 2, 16, 2),
        (256, 1, 16, 1),  # many rows: a page a tile (GPT-2's vector path)
        (256, 4, 16, 1),
    ],
)
def test_default_decode_pages_per_tile(batch, hp, block_size, want):
    assert paged_attention.default_pages_per_tile(batch, hp, block_size) == want


@pytest.mark.parametrize(
    "hp,matrix_min_group,block_size,match",
    [
        (3, 1, 16, "power of two dividing"),
        (4, 1, 16, "power of two dividing"),  # the cache has 2 KV heads
        (2, 0, 16, "needs the matrix units"),
        (2, 1, 8, "needs the matrix units"),  # pages too small for Triton's dots
    ],
)
def test_heads_per_program_checked(hp, matrix_min_group, block_size, match):
    rng = np.random.default_rng()
    q, k, v, tables, lengths = make_gqa_case(rng, 2, 2, 2, 64, block_size, 2, "float32")
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(
            q,
            k,
            v,
            tables,
            lengths,
            num_q_heads=4,
            heads_per_program=hp,
            matrix_min_group=matrix_min_group,
            interpret=INTERPRET,
        )


# ------------------------------------------------------------------------------------ RMSNorm

NORM_IMPLS = {
    "pallas": functools.partial(rms_norm, interpret=INTERPRET),
    "pallas_rows4": functools.partial(rms_norm, block_rows=4, interpret=INTERPRET),
    "reference": jax.jit(rms_norm_reference, static_argnames="eps"),
}
ADD_NORM_IMPLS = {
    "pallas": functools.partial(add_rms_norm, interpret=INTERPRET),
    "pallas_rows4": functools.partial(add_rms_norm, block_rows=4, interpret=INTERPRET),
    "reference": jax.jit(add_rms_norm_reference, static_argnames="eps"),
}
NORM_TOL = {"float32": 1e-6, "bfloat16": 1e-2, "float16": 2e-3}


def rms_oracle(x, scale, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(scale, np.float64)


@pytest.mark.parametrize("impl", NORM_IMPLS)
@pytest.mark.parametrize("shape", [(5, 64), (3, 128), (7, 96)])  # head dims, an odd width
@pytest.mark.parametrize("dtype", NORM_TOL)
def test_rms_norm_matches_oracle(impl, shape, dtype):
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=shape) * 3, dtype)
    scale = jnp.asarray(rng.normal(1.0, 0.3, shape[1]), dtype)
    out = NORM_IMPLS[impl](x, scale, eps=1e-6)
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = rms_oracle(x, scale, 1e-6)
    err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
    assert err <= NORM_TOL[dtype]


@pytest.mark.parametrize("impl", ADD_NORM_IMPLS)
@pytest.mark.parametrize("splits,with_bias", [(1, True), (3, True), (3, False)])
def test_add_rms_norm_matches_oracle(impl, splits, with_bias):
    """h = residual + the linear's partial sums + its bias (if any), and rms_norm(h)."""
    rng = np.random.default_rng()
    m, k, n = 5, 48, 96  # rows4: a full tile and one of a single row
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(k, n)) / np.sqrt(k), jnp.float32)
    chunks = np.array_split(np.arange(k), splits)
    partials = jnp.concatenate([linear_partial_sums_reference(x[:, c], w[c]) for c in chunks])
    bias = jnp.asarray(rng.normal(size=n), jnp.float32) if with_bias else None
    residual = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)
    scale = jnp.asarray(rng.normal(1.0, 0.3, n), jnp.float32)
    h, y = ADD_NORM_IMPLS[impl](partials, bias, residual, scale, eps=1e-5)
    want_h = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + residual
    want_h += 0 if bias is None else np.asarray(bias)
    np.testing.assert_allclose(np.asarray(h), want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(y), rms_oracle(want_h, scale, 1e-5), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "n,e,want",
    [
        (1, 1024, 1),  # a decode step of one row
        (256, 1024, 1),  # Qwen3-0.6B's B=256 norms: 256 programs already
        (1024, 1024, 4),
        (6144, 128, 16),  # q/k norms of B=256 (16 + 8 heads): 24 rows a program at most
        (600, 96, 2),  # an odd width, tiled as 128
        (4096, 8192, 1),  # rows too wide to stack
    ],
)
def test_default_block_rows(n, e, want):
    assert default_block_rows(n, e) == want


# ---------------------------------------------------------------------- paged prefill attention

PREFILL_IMPLS = {
    "pallas": functools.partial(paged_prefill_attention, block_q=16, interpret=INTERPRET),
    # One tile a chunk (the default rows a program cover these chunks).
    "pallas_default": functools.partial(paged_prefill_attention, interpret=INTERPRET),
    # Key tiles of 2 and 4 pages: with 6 pages a row, 4 leaves a last tile past the table.
    "pallas_pp2": functools.partial(
        paged_prefill_attention, block_q=16, pages_per_tile=2, interpret=INTERPRET
    ),
    "pallas_pp4": functools.partial(
        paged_prefill_attention, block_q=16, pages_per_tile=4, interpret=INTERPRET
    ),
    "reference": jax.jit(paged_prefill_attention_reference),
    "xla": jax.jit(paged_attention_xla),
}


def check_paged_prefill(impl, h, group, d, cached):
    """Rows continuing cached prefixes (or not) with chunks of different lengths, padded to T;
    a padded row (seq_lens 0) gives zeros. Real tokens checked against the oracle. Chunks of up
    to 40 tokens give 16-row tiles pages they see whole and pages they see in part."""
    rng = np.random.default_rng()
    bs, mb = 16, 6
    new = [int(n) for n in rng.integers(1, 41, len(cached))]
    b, t = len(cached) + 1, max(new)  # + a padded row
    num_blocks = 1 + b * mb
    k = rng.normal(size=(h, num_blocks, bs, d)).astype(np.float32)
    v = rng.normal(size=(h, num_blocks, bs, d)).astype(np.float32)
    tables = (1 + rng.permutation(num_blocks - 1)).reshape(b, mb).astype(np.int32)
    positions = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    positions[: len(cached)] += np.asarray(cached, np.int32)[:, None]
    seq_lens = np.asarray([c + n for c, n in zip(cached, new, strict=True)] + [0], np.int32)
    # Slots past each row's length hold poison the kernels must not load: NaN (the references
    # read every page of a table and mask scores, so theirs is finite); scratch block 0, where a
    # masked table entry points, is in no table: NaN for all.
    poison = np.nan if impl.startswith("pallas") else 7.0
    k[:, 0], v[:, 0] = np.nan, np.nan
    for row in range(b):
        for pos in range(int(seq_lens[row]), mb * bs):
            k[:, tables[row, pos // bs], pos % bs] = poison
            v[:, tables[row, pos // bs], pos % bs] = poison
    q = rng.normal(size=(b, t, h * group, d)).astype(np.float32)
    out = np.asarray(
        PREFILL_IMPLS[impl](
            *map(jnp.asarray, (q, k, v, tables, positions, seq_lens)),
        )
    )
    assert out.shape == q.shape and np.all(np.isfinite(out)) and np.all(out[-1] == 0)
    for row, (c, n) in enumerate(zip(cached, new, strict=True)):
        for i in range(n):
            want = gqa_oracle(q[row, i][None], k, v, tables[row][None], [c + i + 1], group)
            np.testing.assert_allclose(out[row, i][None], want, rtol=1e-4, atol=1e-5)


PREFILL_AXES = dict(
    impl=list(PREFILL_IMPLS),
    hgd={"2-2-64": (2, 2, 64), "1-4-128": (1, 4, 128)},  # KV heads, group, head dim
    cached={"fresh": [0, 0], "prefix": [0, 37, 5]},
)


@pytest.mark.parametrize("impl,hgd,cached", pairwise(**PREFILL_AXES))
def test_paged_prefill_matches_oracle(impl, hgd, cached):
    """Each implementation with each head layout and each kind of prefix, each pair once.
    Every case: below."""
    check_paged_prefill(impl, *hgd, cached)


@pytest.mark.slow
@pytest.mark.parametrize("impl,hgd,cached", every_case(**PREFILL_AXES))
def test_paged_prefill_matches_oracle_every_case(impl, hgd, cached):
    check_paged_prefill(impl, *hgd, cached)


@pytest.mark.parametrize("t,want", [(1, 16), (8, 16), (17, 32), (100, 128), (4096, 128)])
def test_default_block_q(t, want):
    assert default_block_q(t) == want


@pytest.mark.parametrize("bs,want", [(16, 4), (32, 2), (64, 1), (128, 1)])
def test_default_prefill_pages_per_tile(bs, want):
    assert prefill_module.default_pages_per_tile(bs) == want


@pytest.mark.parametrize("pp", [3, 0])
def test_pages_per_tile_must_be_power_of_two(pp):
    q = jnp.zeros((1, 16, 2, 16), jnp.float32)
    cache = jnp.zeros((1, 3, 16, 16), jnp.float32)
    tables, positions = jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 16), jnp.int32)
    lengths = jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="pages_per_tile must be a power of two"):
        paged_prefill_attention(q, cache, cache, tables, positions, lengths, pages_per_tile=pp)
    with pytest.raises(ValueError, match="pages_per_tile must be a power of two"):
        paged_decode_attention(q[:, 0], cache, cache, tables, lengths, pages_per_tile=pp)


# ------------------------------------------------------------------------- Triton lowering


def test_fused_decode_kernels_lower_to_triton():
    """The kernels a Qwen3-0.6B decode step fuses (the attention with q/k norm and RoPE, split or
    not, on the matrix units or not, the gate/up projection with SwiGLU, RMSNorm several rows a
    program) and its prefill attention lower to Triton for a GPU, here too: the Pallas-to-Triton
    lowering rejects what Triton cannot tile (shapes not powers of two, unsupported ops) before
    any GPU is needed."""
    b, h, group, d, bs = 16, 8, 2, 128, 64
    dt = jnp.bfloat16
    qkv = jnp.zeros((b, h * (group + 2), d), dt)
    cache = jnp.zeros((h, 9, bs, d), dt)
    tables, lengths = jnp.zeros((b, 8), jnp.int32), jnp.ones((b,), jnp.int32)
    small, tables_16 = jnp.zeros((h, 33, 16, d), dt), jnp.zeros((b, 32), jnp.int32)  # pages of 16
    prefill_q, positions = jnp.zeros((2, 300, h * group, d), dt), jnp.zeros((2, 300), jnp.int32)
    rope = (jnp.zeros((b, d // 2), jnp.float32),) * 2
    calls = {
        "attention": (
            lambda *a: paged_decode_attention_append(*a, num_q_heads=h * group),
            (qkv, cache, cache, tables, lengths, rope, (jnp.ones(d, dt),) * 2),
        ),
        "attention_vector": (
            lambda *a: paged_decode_attention_append(*a, num_q_heads=h * group, matrix_min_group=0),
            (qkv, cache, cache, tables, lengths, rope, (jnp.ones(d, dt),) * 2),
        ),
        # A program for every KV head of a row: one [8 x 64, 128] tile a page, 16 query rows.
        "attention_every_head": (
            lambda *a: paged_decode_attention_append(
                *a, num_q_heads=h * group, heads_per_program=h
            ),
            (qkv, cache, cache, tables, lengths, rope, (jnp.ones(d, dt),) * 2),
        ),
        # Pages of 16, four a tile (the default there), on the matrix units and off them (the
        # table prefetched: its entries selected in registers), and with every head.
        "attention_pages": (
            lambda *a: paged_decode_attention_append(*a, num_q_heads=h * group),
            (qkv, small, small, tables_16, lengths, rope, (jnp.ones(d, dt),) * 2),
        ),
        "attention_vector_pages": (
            lambda *a: paged_decode_attention_append(
                *a, num_q_heads=h * group, matrix_min_group=0, prefetch_table=True
            ),
            (qkv, small, small, tables_16, lengths, rope, (jnp.ones(d, dt),) * 2),
        ),
        "attention_every_head_pages": (
            lambda *a: paged_decode_attention_append(
                *a, num_q_heads=h * group, heads_per_program=h, pages_per_tile=2
            ),
            (qkv, small, small, tables_16, lengths, rope, (jnp.ones(d, dt),) * 2),
        ),
        # Split-K (and its merge kernel), fused and plain: an uneven split count.
        "attention_split": (
            lambda *a: paged_decode_attention_append(*a, num_q_heads=h * group, num_splits=3),
            (qkv, cache, cache, tables, lengths, rope, (jnp.ones(d, dt),) * 2),
        ),
        "attention_split_plain": (
            lambda *a: paged_decode_attention(*a, num_q_heads=h * group, num_splits=3),
            (qkv, cache, cache, tables, lengths),
        ),
        "swiglu": (
            lambda x, w, b: linear(x, w, b, activation="swiglu"),
            (jnp.zeros((16, 1024), dt), jnp.zeros((1024, 2 * 3072), dt), jnp.zeros(6144, dt)),
        ),
        "rms_norm": (rms_norm, (jnp.zeros((6144, d), dt), jnp.ones(d, dt))),
        "prefill_attention": (
            paged_prefill_attention,
            (prefill_q, cache, cache, tables[:2], positions, lengths[:2]),
        ),
        # Pages of 16, four a key tile: the [4 x 16, 128] tile's pointers built from the table.
        "prefill_attention_pp4": (
            lambda *a: paged_prefill_attention(*a, pages_per_tile=4),
            (prefill_q, small, small, tables_16[:2], positions, lengths[:2]),
        ),
    }
    for name, (fn, args) in calls.items():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        kernels = 2 if name.startswith("attention_split") else 1  # the split's merge too
        assert text.count("__gpu$xla.gpu.triton") == kernels, name
