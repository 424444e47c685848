"""One suite for every implementation of the paged KV append (tokamax style).

IMPLEMENTATIONS: the three Pallas kernels, the dispatcher with the kernels switched on and off,
and the XLA reference. CASES: one list of shapes and dtypes, importable by the bench
(`bench/bench_kv_append.py --quick`). Every case draws fresh random data, fills the caches with
random poison far from the new values, and checks bit for bit against a numpy oracle: every
written slot equals its source row and every other slot is unchanged.

Kernels run interpreted on a CPU backend and compiled on a GPU (interpret=None);
ROSEJAX_TEST_INTERPRET=1 / 0 forces one or the other. tests/conftest.py defaults JAX_PLATFORMS
to cpu, so on a GPU machine run the compiled kernels with

    JAX_PLATFORMS=cuda ROSEJAX_TEST_INTERPRET=0 python -m pytest -q tests/test_kv_append.py
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The package exports the function kv_append, which shadows the submodule's attribute name.
kva = importlib.import_module("pallas_kernels.kv_append")


@dataclasses.dataclass(frozen=True)
class KVAppendShape:
    num_heads: int
    num_blocks: int
    block_size: int
    head_dim: int
    batch: int
    dtype: str

    @property
    def id(self) -> str:
        return (
            f"H{self.num_heads}_NB{self.num_blocks}_BS{self.block_size}_D{self.head_dim}"
            f"_B{self.batch}_{self.dtype}"
        )


# Small on purpose: interpret mode runs the grid one program at a time. Every dtype, B=1,
# B not a power of two, H=12 (GPT-2), H not a multiple of the head tile (5), D in {64, 32, 16}.
CASES = [
    KVAppendShape(12, 6, 8, 64, 1, "float32"),
    KVAppendShape(12, 8, 4, 64, 7, "float16"),
    KVAppendShape(12, 9, 16, 32, 5, "bfloat16"),
    KVAppendShape(5, 10, 4, 16, 7, "float32"),
    KVAppendShape(16, 12, 8, 16, 8, "bfloat16"),
    KVAppendShape(4, 5, 2, 32, 3, "float16"),
]

FORMS = ("generic", "identity", "full")  # batch_idx given / row i is source i / shared pos


def _interpret() -> bool | None:
    raw = os.environ.get("ROSEJAX_TEST_INTERPRET")
    return None if raw is None else raw not in ("0", "false", "")


def _auto_interpret() -> bool:
    forced = _interpret()
    return jax.default_backend() == "cpu" if forced is None else forced


def test_forced_compiled_mode_has_a_gpu():
    """ROSEJAX_TEST_INTERPRET=0 on a CPU backend would silently test nothing compiled."""
    if _interpret() is False:
        assert jax.default_backend() != "cpu", "set JAX_PLATFORMS=cuda to test compiled kernels"


# ---------------------------------------------------------------------------------------------
# Implementations: every one takes the dispatcher's signature. `forms` says which input forms it
# accepts; the suite runs each implementation on those forms only.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    fn: Callable
    forms: tuple[str, ...]
    options: tuple[tuple[str, object], ...] = ()  # keyword arguments of every call


def _generic(kc, vc, kn, vn, block_idx, pos, batch_idx=None, **kw):
    if batch_idx is None:
        batch_idx = jnp.arange(kn.shape[0], dtype=jnp.int32)
    return kva.kv_append_generic(
        kc, vc, kn, vn, batch_idx, block_idx, pos, interpret=_auto_interpret(), **kw
    )


def _identity(kc, vc, kn, vn, block_idx, pos, batch_idx=None, **kw):
    assert batch_idx is None
    return kva.kv_append_identity_pos(
        kc, vc, kn, vn, block_idx, pos, interpret=_auto_interpret(), **kw
    )


def _full(kc, vc, kn, vn, block_idx, pos, batch_idx=None, **kw):
    assert batch_idx is None
    return kva.kv_append_full_batch(
        kc, vc, kn, vn, block_idx, pos, interpret=_auto_interpret(), **kw
    )


def _dispatch(kc, vc, kn, vn, block_idx, pos, batch_idx=None, **kw):
    return kva.kv_append(kc, vc, kn, vn, block_idx, pos, batch_idx, interpret=_interpret(), **kw)


IMPLEMENTATIONS = [
    # Each kernel on its own form; the generic one also on a whole in-order batch.
    Impl("generic", _generic, ("generic", "identity")),
    Impl("identity_pos", _identity, ("identity",)),
    Impl("full_batch", _full, ("full",)),
    Impl("dispatch_on", _dispatch, FORMS, (("use_kernels", True), ("min_batch", 1))),
    Impl("dispatch_off", _dispatch, FORMS, (("use_kernels", False),)),
    Impl("reference", kva.kv_append_reference, FORMS),
]


# ---------------------------------------------------------------------------------------------
# Data and oracle.
# ---------------------------------------------------------------------------------------------


def make_inputs(shape: KVAppendShape, form: str, rng: np.random.Generator) -> dict:
    """Random caches (poison), new rows and duplicate-free targets, as numpy arrays."""
    h, nb, bs, d, b = (
        shape.num_heads,
        shape.num_blocks,
        shape.block_size,
        shape.head_dim,
        shape.batch,
    )
    dtype = jnp.dtype(shape.dtype)
    cache_shape = (h, nb, bs, d)
    # Poison far from the N(0, 1) new values, different in every slot.
    k_cache = (1000.0 + 100.0 * rng.random(cache_shape)).astype(dtype)
    v_cache = (-1000.0 - 100.0 * rng.random(cache_shape)).astype(dtype)
    k_new = rng.standard_normal((b, h, d)).astype(dtype)
    v_new = rng.standard_normal((b, h, d)).astype(dtype)
    if form == "generic":
        rows = max(b - 1, 1)  # a strict subset when it can be, in random order
        batch_idx = rng.choice(b, size=rows, replace=False).astype(np.int32)
    else:
        rows, batch_idx = b, None
    if form == "full":
        block_idx = rng.choice(nb, size=rows, replace=False).astype(np.int32)
        pos = np.int32(rng.integers(bs))
    else:
        slots = rng.choice(nb * bs, size=rows, replace=False)
        block_idx = (slots // bs).astype(np.int32)
        pos = (slots % bs).astype(np.int32)
    return dict(
        k_cache=k_cache,
        v_cache=v_cache,
        k_new=k_new,
        v_new=v_new,
        block_idx=block_idx,
        pos=pos,
        batch_idx=batch_idx,
    )


def oracle(inputs: dict) -> tuple[np.ndarray, np.ndarray]:
    """Plain numpy loop over rows: the meaning of the op, independent of the code under test."""
    k, v = inputs["k_cache"].copy(), inputs["v_cache"].copy()
    block_idx, pos, batch_idx = inputs["block_idx"], inputs["pos"], inputs["batch_idx"]
    for i in range(block_idx.shape[0]):
        src = i if batch_idx is None else batch_idx[i]
        p = pos if np.ndim(pos) == 0 else pos[i]
        k[:, block_idx[i], p, :] = inputs["k_new"][src]
        v[:, block_idx[i], p, :] = inputs["v_new"][src]
    return k, v


def _to_device(inputs: dict) -> dict:
    # Fresh device buffers: the ops donate the caches.
    return {key: None if x is None else jnp.asarray(x) for key, x in inputs.items()}


def _run(impl: Impl, inputs: dict, **kw):
    x = _to_device(inputs)
    return impl.fn(
        x["k_cache"],
        x["v_cache"],
        x["k_new"],
        x["v_new"],
        x["block_idx"],
        x["pos"],
        x["batch_idx"],
        **dict(impl.options),
        **kw,
    )


def _assert_bits_equal(actual, expected, what: str) -> None:
    actual = np.asarray(actual)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    same = actual.view(np.uint8).reshape(actual.shape + (-1,)) == expected.view(np.uint8).reshape(
        expected.shape + (-1,)
    )
    bad = np.argwhere(~same.all(-1))
    assert bad.size == 0, f"{what}: {len(bad)} slots differ, first at {bad[:3].tolist()}"


# ---------------------------------------------------------------------------------------------
# The suite.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", CASES, ids=lambda s: s.id)
@pytest.mark.parametrize(
    "impl,form",
    [(i, f) for i in IMPLEMENTATIONS for f in FORMS if f in i.forms],
    ids=lambda x: x.name if isinstance(x, Impl) else x,
)
def test_append_matches_oracle(impl: Impl, shape: KVAppendShape, form: str):
    rng = np.random.default_rng()
    inputs = make_inputs(shape, form, rng)
    k_expected, v_expected = oracle(inputs)
    k_out, v_out = _run(impl, inputs)
    _assert_bits_equal(k_out, k_expected, "k_cache")
    _assert_bits_equal(v_out, v_expected, "v_cache")


@pytest.mark.parametrize(
    "impl,form",
    [(i, f) for i in IMPLEMENTATIONS for f in FORMS if f in i.forms],
    ids=lambda x: x.name if isinstance(x, Impl) else x,
)
def test_append_from_fused_qkv(impl: Impl, form: str):
    """The model's call: k_new = v_new = the fused [B, 3H, D] projection, heads at H and 2H."""
    rng = np.random.default_rng()
    shape = CASES[1]
    inputs = make_inputs(shape, form, rng)
    k_expected, v_expected = oracle(inputs)
    q = rng.standard_normal(inputs["k_new"].shape).astype(inputs["k_new"].dtype)
    fused = np.concatenate([q, inputs["k_new"], inputs["v_new"]], axis=1)  # [B, 3H, D]
    h = shape.num_heads
    k_out, v_out = _run(
        impl, inputs | {"k_new": fused, "v_new": fused}, new_head_offsets=(h, 2 * h)
    )
    _assert_bits_equal(k_out, k_expected, "k_cache")
    _assert_bits_equal(v_out, v_expected, "v_cache")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=lambda i: i.name)
def test_append_inside_donating_jit(impl: Impl):
    """The way the engine calls it: inside a jitted step that donates the caches, twice."""
    shape = CASES[1]
    form = impl.forms[0]
    rng = np.random.default_rng()
    first, second = make_inputs(shape, form, rng), make_inputs(shape, form, rng)
    second["k_cache"], second["v_cache"] = oracle(first)
    k_expected, v_expected = oracle(second)

    @jax.jit
    def step(caches, a, b):
        for x in (a, b):
            caches = impl.fn(
                *caches,
                x["k_new"],
                x["v_new"],
                x["block_idx"],
                x["pos"],
                x["batch_idx"],
                **dict(impl.options),
            )
        return caches

    step = jax.jit(step, donate_argnums=(0,))
    a, b = _to_device(first), _to_device(second)
    k_out, v_out = step(
        (a.pop("k_cache"), a.pop("v_cache")),
        a,
        {k: x for k, x in b.items() if k not in ("k_cache", "v_cache")},
    )
    _assert_bits_equal(k_out, k_expected, "k_cache")
    _assert_bits_equal(v_out, v_expected, "v_cache")


# ---------------------------------------------------------------------------------------------
# Bad inputs: every implementation raises ValueError.
# ---------------------------------------------------------------------------------------------


def _bad_inputs(kind: str, form: str) -> dict:
    inputs = make_inputs(KVAppendShape(4, 6, 4, 16, 3, "float32"), form, np.random.default_rng())
    if kind == "new_dtype":
        inputs["k_new"] = inputs["k_new"].astype(np.float16)
        inputs["v_new"] = inputs["v_new"].astype(np.float16)
    elif kind == "v_cache_dtype":
        inputs["v_cache"] = inputs["v_cache"].astype(np.float16)
    elif kind == "cache_rank":
        inputs["k_cache"] = inputs["k_cache"][0]
        inputs["v_cache"] = inputs["v_cache"][0]
    elif kind == "new_rank":
        inputs["k_new"] = inputs["k_new"][0]
        inputs["v_new"] = inputs["v_new"][0]
    elif kind == "heads":
        inputs["k_new"] = inputs["k_new"][:, :2]
        inputs["v_new"] = inputs["v_new"][:, :2]
    elif kind == "head_dim":
        inputs["k_new"] = inputs["k_new"][..., :8]
        inputs["v_new"] = inputs["v_new"][..., :8]
    elif kind == "kv_shape":
        inputs["v_new"] = inputs["v_new"][:2]
    elif kind == "block_idx_dtype":
        inputs["block_idx"] = inputs["block_idx"].astype(np.int16)
    elif kind == "pos_dtype":
        inputs["pos"] = inputs["pos"].astype(np.uint32)
    elif kind == "block_idx_length":
        inputs["block_idx"] = inputs["block_idx"][:-1]
    elif kind == "pos_length":
        if form == "full":
            inputs["pos"] = np.zeros(2, np.int32)  # a vector where the form needs a scalar
        else:
            inputs["pos"] = inputs["pos"][:-1]
    elif kind == "batch_idx_dtype":
        inputs["batch_idx"] = inputs["batch_idx"].astype(np.float32)
    elif kind == "batch_idx_length":
        inputs["batch_idx"] = inputs["batch_idx"][:-1]
    else:
        raise AssertionError(kind)
    return inputs


BAD = [
    "new_dtype",
    "v_cache_dtype",
    "cache_rank",
    "new_rank",
    "heads",
    "head_dim",
    "kv_shape",
    "block_idx_dtype",
    "pos_dtype",
    "block_idx_length",
    "pos_length",
    "batch_idx_dtype",
    "batch_idx_length",
]


@pytest.mark.parametrize(
    "impl,kind",
    [
        (i, k)
        for i in IMPLEMENTATIONS
        for k in BAD
        if not k.startswith("batch_idx") or "generic" in i.forms
    ],
    ids=lambda x: x.name if isinstance(x, Impl) else x,
)
def test_bad_inputs_raise(impl: Impl, kind: str):
    form = "generic" if kind.startswith("batch_idx") else impl.forms[-1]
    inputs = _bad_inputs(kind, form)
    with pytest.raises(ValueError):
        _run(impl, inputs)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=lambda i: i.name)
@pytest.mark.parametrize("offsets", [(1, 0), (0, -1)])
def test_head_offsets_past_the_heads_raise(impl: Impl, offsets):
    inputs = make_inputs(
        KVAppendShape(4, 6, 4, 16, 3, "float32"), impl.forms[-1], np.random.default_rng()
    )
    with pytest.raises(ValueError, match="has no heads"):
        _run(impl, inputs, new_head_offsets=offsets)


@pytest.mark.parametrize(
    "op", [kva.kv_append_generic, kva.kv_append_identity_pos, kva.kv_append_full_batch]
)
def test_kernels_refuse_non_power_of_two_head_dim(op):
    inputs = _to_device(
        make_inputs(KVAppendShape(4, 6, 4, 24, 2, "float32"), "full", np.random.default_rng())
    )
    args = [inputs["k_cache"], inputs["v_cache"], inputs["k_new"], inputs["v_new"]]
    if op is kva.kv_append_generic:
        args += [jnp.arange(2, dtype=jnp.int32), inputs["block_idx"], jnp.zeros(2, jnp.int32)]
    elif op is kva.kv_append_identity_pos:
        args += [inputs["block_idx"], jnp.zeros(2, jnp.int32)]
    else:
        args += [inputs["block_idx"], inputs["pos"]]
    with pytest.raises(ValueError, match="power-of-two head dim"):
        op(*args, interpret=True)


# ---------------------------------------------------------------------------------------------
# Dispatch.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, rows, head_dim, has_batch_idx, scalar_pos, expected",
    [
        ({}, 256, 64, False, True, "full_batch"),
        ({}, 256, 64, False, False, "identity_pos"),
        ({}, 256, 64, True, False, "generic"),
        ({"use_kernels": False}, 256, 64, False, True, "xla"),
        ({"use_kernels": False}, 256, 64, True, False, "xla"),
        ({"min_batch": 8}, 7, 64, False, False, "xla"),
        ({"min_batch": 8}, 8, 64, False, False, "identity_pos"),
        ({"min_batch": 1}, 1, 64, True, False, "generic"),
        ({"min_batch": 1}, 256, 24, False, False, "xla"),  # D not a power of two
        ({"min_batch": 1}, 256, 80, True, False, "xla"),
    ],
)
def test_select_variant(options, rows, head_dim, has_batch_idx, scalar_pos, expected):
    got = kva.select_kv_append_variant(
        rows, head_dim, has_batch_idx=has_batch_idx, scalar_pos=scalar_pos, **options
    )
    assert got == expected


def test_default_min_batch_gate():
    below = kva.DEFAULT_MIN_BATCH - 1
    if below >= 1:
        assert (
            kva.select_kv_append_variant(below, 64, has_batch_idx=False, scalar_pos=False) == "xla"
        )
    assert (
        kva.select_kv_append_variant(
            kva.DEFAULT_MIN_BATCH, 64, has_batch_idx=False, scalar_pos=False
        )
        == "identity_pos"
    )


@pytest.mark.parametrize("min_batch", ["many", -1, 2.5])
def test_select_variant_bad_min_batch(min_batch):
    with pytest.raises(ValueError):
        kva.select_kv_append_variant(
            4, 64, has_batch_idx=False, scalar_pos=False, min_batch=min_batch
        )


def test_scalar_pos_with_batch_idx_is_refused():
    with pytest.raises(ValueError):
        kva.select_kv_append_variant(4, 64, has_batch_idx=True, scalar_pos=True)


@pytest.mark.parametrize("use_kernels", [True, False])
def test_dispatcher_traces_the_chosen_path(use_kernels):
    """The traced program holds a pallas_call exactly when the kernels are switched on."""
    x = _to_device(make_inputs(CASES[1], "identity", np.random.default_rng()))
    jaxpr = jax.make_jaxpr(
        lambda kc, vc: kva.kv_append(
            kc,
            vc,
            x["k_new"],
            x["v_new"],
            x["block_idx"],
            x["pos"],
            use_kernels=use_kernels,
            min_batch=1,
        )
    )(x["k_cache"], x["v_cache"])
    text = str(jaxpr)
    assert ("pallas_call" in text) == use_kernels
    assert ("scatter" in text) != use_kernels


def test_dispatcher_passes_tiles_to_the_kernel():
    """Tile parameters (`KernelConfig.tiles` for kv_append) reach the kernel's launch; the XLA
    path takes and ignores them; an unknown one is refused."""
    x = _to_device(make_inputs(CASES[1], "identity", np.random.default_rng()))

    def trace(**kw):
        return str(
            jax.make_jaxpr(
                lambda kc, vc: kva.kv_append(
                    kc, vc, x["k_new"], x["v_new"], x["block_idx"], x["pos"], **kw
                )
            )(x["k_cache"], x["v_cache"])
        )

    assert "kv_append_identity_pos_bb2_bh2_w1" in trace(block_b=2, block_h=2, num_warps=1)
    assert "pallas_call" not in trace(use_kernels=False, block_b=2, num_stages=2)
    with pytest.raises(TypeError, match="block_m"):
        trace(block_m=2)


def test_default_block_h_is_power_of_two():
    for heads, expected in [(12, 4), (16, 16), (20, 4), (25, 32), (1, 1), (5, 8), (32, 16)]:
        assert kva.default_block_h(heads) == expected
