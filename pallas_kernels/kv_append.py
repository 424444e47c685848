"""Paged KV-cache append: write each decode token's K/V into its cache slot.

Per layer the cache is k_cache, v_cache: [H, num_blocks, block_size, D] (the layout of
jax's `pallas.ops.gpu.paged_attention`). For every row i of the batch:

    k_cache[:, block_idx[i], pos_i, :] = k_new[src_i, :, :]      (same for v)

with src_i = batch_idx[i] (generic) or i (identity-pos, full-batch), and pos_i = pos[i]
(generic, identity-pos) or one scalar pos shared by every row (full-batch). Targets are
duplicate-free except in the reserved scratch block 0, whose contents nobody reads.

`new_head_offsets=(ok, ov)` reads heads ok..ok+H-1 of k_new and ov..ov+H-1 of v_new instead: a
model passes its fused q/k/v projection [B, 3H, D] as both with (H, 2H), and no slice of it is
copied out first (XLA would make that copy a kernel of its own every layer).

One Pallas kernel (Triton on GPU, `interpret=True` on CPU), compiled per variant (generic,
identity_pos, full_batch: `INDEX_ARGS`), updates the caches in place through
`input_output_aliases`; the caller donates the caches (a jitted step with `donate_argnums`), so
no call copies them. Each variant has its op (`kv_append_generic`, `kv_append_identity_pos`,
`kv_append_full_batch`). `kv_append` is the one dispatch function: it picks a variant, or the
XLA scatter (`kv_append_reference`) when the kernels are switched off (`use_kernels=False`), the
batch is small (`min_batch`), or the head dim is not a power of two, which the Triton lowering
cannot tile.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    filter_triton_deprecation,
    is_power_of_2,
    next_power_of_2,
)

# Tuned defaults: the card each was tuned on and why, in a line (figures: docs/performance-log.md,
# section "KV append kernels"; re-measure on other cards).
DEFAULT_MIN_BATCH = 1  # H200: kernels beat the XLA scatter at every B, B=1 too (1.3 vs 3.8 us)
DEFAULT_BLOCK_B = 8  # H200, fp16 H=12 D=64: at or near the best of 24 tiles at B=256 and 2048
DEFAULT_NUM_WARPS = 4  # H200, same sweep: 16 elements a thread; a 16 x 16 tile at 1 warp spills
DEFAULT_NUM_STAGES = 1  # not tuned: the kernel has no loop for Triton to pipeline
# default_block_h(H): 4 for H=12  (H200, same sweep: the 4 of that 8 x 4 tile; divides H, no waste)


def default_block_h(num_heads: int) -> int:
    """Heads per program: a power of two (Triton needs power-of-two tiles).

    A power-of-two divisor of H of at least 4 tiles H with no waste (12 -> 4, 20 -> 4,
    16 -> 16); otherwise one tile of next_power_of_2(H) covers all heads, the extra lanes
    clamped onto the last head (25 -> 32).
    """
    low_bit = num_heads & -num_heads  # largest power-of-two divisor
    if low_bit >= 4:
        return min(low_bit, 16)
    return next_power_of_2(num_heads)


# ----------------------------------------------------------------------------------------------
# The kernel. Grid: (row tiles of block_b rows, head tiles of block_h heads). Every program moves a
# [block_b, block_h, D] tile of K and one of V. Rows past the batch and heads past H are
# *clamped* onto the last row / head instead of masked: they write the same value to the same
# slot again, which is harmless, needs no predicate, and stays deterministic in interpret mode
# (where a masked store of an out-of-range index would scatter stale data over a real slot).
# ----------------------------------------------------------------------------------------------

# The variants, each with the int32 index arrays its op takes (after the caches and new rows), in
# order. generic reads row i's source row from batch_idx (any subset of rows, any order);
# identity_pos and full_batch take the whole batch in order (source row i). full_batch's pos is
# one scalar for every row, the others' a position per row.
INDEX_ARGS = {
    "generic": ("batch_idx", "block_idx", "pos"),
    "identity_pos": ("block_idx", "pos"),
    "full_batch": ("block_idx", "pos"),
}


def kv_append_kernel(
    k_new_ref,  # [B, H', D], heads head_offsets[0] + [0, H) read
    v_new_ref,  # [B, H', D], heads head_offsets[1] + [0, H) read
    *refs,  # the variant's INDEX_ARGS ([B'] each; full_batch's pos [1]), then the caches
    variant: str,
    block_b: int,
    block_h: int,
    head_offsets: tuple[int, int],
):
    """The one kernel of the three variants: row i's source row is batch_idx[i] (generic) or i,
    its position pos[i], or pos[0] for every row (full_batch). The caches come twice, as inputs
    aliased to the outputs (never read) and as outputs [H, NB, BS, D]."""
    *index_refs, _, _, k_cache_ref, v_cache_ref = refs
    index = dict(zip(INDEX_ARGS[variant], index_refs, strict=True))
    rows = pl.program_id(0) * block_b + jnp.arange(block_b, dtype=jnp.int32)
    rows = jnp.minimum(rows, index["block_idx"].shape[0] - 1)  # [block_b]
    heads = pl.program_id(1) * block_h + jnp.arange(block_h, dtype=jnp.int32)
    heads = jnp.minimum(heads, k_cache_ref.shape[0] - 1)  # [block_h]
    src = index["batch_idx"][rows] if variant == "generic" else rows  # [block_b]
    blocks = index["block_idx"][rows]  # [block_b]
    if variant == "full_batch":
        positions = jnp.broadcast_to(index["pos"][0], (block_b,))
    else:
        positions = index["pos"][rows]  # [block_b]
    src, heads = src[:, None], heads[None, :]  # [block_b, 1], [1, block_h]
    blocks, positions = blocks[:, None], positions[:, None]  # [block_b, 1]
    # Both loads before both stores: all the bytes of the tile are in flight at once.
    k = k_new_ref[src, heads + head_offsets[0], :]  # [block_b, block_h, D]
    v = v_new_ref[src, heads + head_offsets[1], :]  # [block_b, block_h, D]
    k_cache_ref[heads, blocks, positions, :] = k
    v_cache_ref[heads, blocks, positions, :] = v


# ----------------------------------------------------------------------------------------------
# Checks (static: shapes and dtypes are known at trace time).
# ----------------------------------------------------------------------------------------------


def _check_int32_vector(name: str, x: Any, length: int | None) -> int:
    if x.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype}")
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D [B'], got shape {x.shape}")
    if length is not None and x.shape[0] != length:
        raise ValueError(f"{name} must have length {length}, got shape {x.shape}")
    return x.shape[0]


def _check_caches(k_cache, v_cache, k_new, v_new, head_offsets: tuple[int, int]) -> None:
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must be [H, num_blocks, block_size, D], got {k_cache.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {v_cache.shape} != k_cache shape {k_cache.shape}")
    if k_new.ndim != 3:
        raise ValueError(f"k_new must be [B, H, D], got {k_new.shape}")
    if v_new.ndim != 3 or v_new.shape[0] != k_new.shape[0]:
        raise ValueError(f"v_new shape {v_new.shape} does not match k_new shape {k_new.shape}")
    num_heads, _, _, head_dim = k_cache.shape
    for name, x, offset in (("k_new", k_new, head_offsets[0]), ("v_new", v_new, head_offsets[1])):
        if offset < 0 or x.shape[1] < offset + num_heads or x.shape[2] != head_dim:
            raise ValueError(
                f"{name} [B, H', D] = {x.shape} has no heads {offset}..{offset + num_heads - 1} "
                f"of D={head_dim} for the cache's H={num_heads}"
            )
    for name, x in (("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        if x.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {x.dtype} != k_cache dtype {k_cache.dtype}")


def _check_kernel_params(head_dim: int, block_b: int, block_h: int) -> None:
    # Triton lowers only power-of-two tiles; the tile is [block_b, block_h, D].
    if not is_power_of_2(head_dim):
        raise ValueError(
            f"the Pallas kv_append kernels need a power-of-two head dim, got D={head_dim}; "
            "kv_append() routes such caches to the XLA path"
        )
    if not is_power_of_2(block_b):
        raise ValueError(f"block_b must be a power of two, got {block_b}")
    if not is_power_of_2(block_h):
        raise ValueError(f"block_h must be a power of two, got {block_h}")


def _check_scalar_pos(pos: Any) -> None:
    if pos.dtype != jnp.int32:
        raise ValueError(f"pos must be int32, got {pos.dtype}")
    if pos.shape != ():
        raise ValueError(f"full-batch pos must be an int32 scalar (shape ()), got {pos.shape}")


def _check_indices(k_new, block_idx, pos, batch_idx, *, scalar_pos: bool) -> int:
    """The index arrays of any form -> the number of rows appended, B'. block_idx is [B] when
    batch_idx is None (row i is source i), else [B'] like batch_idx; pos is [B'] or, with
    scalar_pos, an int32 scalar."""
    if batch_idx is None:
        n = _check_int32_vector("block_idx", block_idx, k_new.shape[0])
    else:
        n = _check_int32_vector("block_idx", block_idx, None)
        _check_int32_vector("batch_idx", batch_idx, n)
    if scalar_pos:
        _check_scalar_pos(pos)
    else:
        _check_int32_vector("pos", pos, n)
    return n


# ----------------------------------------------------------------------------------------------
# The launcher, and the three ops made from it.
# ----------------------------------------------------------------------------------------------


def _kv_append_pallas(
    variant: str,
    k_cache: jax.Array,
    v_cache: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    *,
    block_idx: jax.Array,
    pos: jax.Array,
    batch_idx: jax.Array | None = None,
    block_b: int | None = None,
    block_h: int | None = None,
    new_head_offsets: tuple[int, int] = (0, 0),
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Checks, then the kernel of `variant` over the caches, in place (input_output_aliases)."""
    _check_caches(k_cache, v_cache, k_new, v_new, new_head_offsets)
    scalar_pos = variant == "full_batch"
    num_rows = _check_indices(k_new, block_idx, pos, batch_idx, scalar_pos=scalar_pos)
    num_heads, _, _, head_dim = k_cache.shape
    if num_rows == 0:
        return k_cache, v_cache
    if block_h is None:
        block_h = default_block_h(num_heads)
    if block_b is None:
        block_b = DEFAULT_BLOCK_B
    # A tile larger than the batch only duplicates clamped rows.
    block_b = min(block_b, next_power_of_2(num_rows))
    block_h = min(block_h, next_power_of_2(num_heads))
    _check_kernel_params(head_dim, block_b, block_h)
    if not interpret:
        filter_triton_deprecation()
    arrays = {"batch_idx": batch_idx, "block_idx": block_idx}
    arrays["pos"] = pos.reshape(1) if scalar_pos else pos
    index_arrays = [arrays[name] for name in INDEX_ARGS[variant]]
    cache_shape = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    num_inputs = 2 + len(index_arrays)
    kernel = functools.partial(
        kv_append_kernel,
        variant=variant,
        block_b=block_b,
        block_h=block_h,
        head_offsets=new_head_offsets,
    )
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_rows, block_b), pl.cdiv(num_heads, block_h)),
        out_shape=(cache_shape, cache_shape),
        # The caches are inputs num_inputs, num_inputs + 1: written in place.
        input_output_aliases={num_inputs: 0, num_inputs + 1: 1},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"kv_append_{variant}_bb{block_b}_bh{block_h}_w{num_warps}",
    )(k_new, v_new, *index_arrays, k_cache, v_cache)


_STATIC = ["block_b", "block_h", "new_head_offsets", "num_warps", "num_stages", "interpret"]
_TILE_PARAMS = ("block_b", "block_h", "num_warps", "num_stages")  # what kv_append passes on
_ARGS_DOC = """

    Args:
      k_cache, v_cache: [H, num_blocks, block_size, D], donated and updated in place.
      k_new, v_new: [B, H, D], same dtype as the caches ([B, H', D] with new_head_offsets: the H
        heads start at new_head_offsets[0] in k_new, new_head_offsets[1] in v_new).
      block_b: rows per program (power of two); block_h: heads per program (power of two,
        default from H); num_warps, num_stages: Triton launch parameters; interpret: run the
        kernel in Pallas interpret mode (a CPU backend needs it).
    Returns:
      (k_cache, v_cache), the same buffers.
    Raises:
      ValueError: on shapes, dtypes or tiles the kernel cannot take (a head dim that is not a
        power of two among them).
    """


def _variant_op(variant: str, summary: str):
    """The public op of `variant`: jitted, the caches donated, with the signature
    (k_cache, v_cache, k_new, v_new, <its INDEX_ARGS>, *, <the tile parameters>)."""
    params = inspect.signature(_kv_append_pallas).parameters
    array = inspect.Parameter.POSITIONAL_OR_KEYWORD
    signature = inspect.Signature(
        [params[name] for name in ("k_cache", "v_cache", "k_new", "v_new")]
        + [inspect.Parameter(name, array, annotation="jax.Array") for name in INDEX_ARGS[variant]]
        + [params[name] for name in _STATIC],
        return_annotation=inspect.signature(_kv_append_pallas).return_annotation,
    )

    def op(*args, **kwargs):
        return _kv_append_pallas(variant, **signature.bind(*args, **kwargs).arguments)

    op.__name__ = op.__qualname__ = f"kv_append_{variant}"
    op.__doc__ = summary + _ARGS_DOC
    op.__signature__ = signature
    return jax.jit(op, static_argnames=_STATIC, donate_argnums=(0, 1))


kv_append_generic = _variant_op(
    "generic",
    "Row batch_idx[i] of k_new/v_new goes to slot (block_idx[i], pos[i]) of every head;\n"
    "    batch_idx, block_idx, pos: int32 [B'] (B' may differ from B).",
)
kv_append_identity_pos = _variant_op(
    "identity_pos",
    "Row i of k_new/v_new goes to slot (block_idx[i], pos[i]); block_idx, pos: int32 [B].",
)
kv_append_full_batch = _variant_op(
    "full_batch",
    "Row i of k_new/v_new goes to slot (block_idx[i], pos); block_idx: int32 [B], pos: an\n"
    "    int32 scalar shared by every row (a decode step where all requests are at the same\n"
    "    length).",
)
_OPS = {
    "generic": kv_append_generic,
    "identity_pos": kv_append_identity_pos,
    "full_batch": kv_append_full_batch,
}


@functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames=["new_head_offsets"])
def kv_append_reference(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    block_idx: jax.Array,
    pos: jax.Array,
    batch_idx: jax.Array | None = None,
    *,
    new_head_offsets: tuple[int, int] = (0, 0),
) -> tuple[jax.Array, jax.Array]:
    """XLA scatter version of all three forms; the dispatcher's XLA path.

    Fast forms: no gather of k_new when batch_idx is None (the batch is whole and in order),
    and a scalar pos is broadcast inside the scatter's index computation.
    """
    _check_caches(k_cache, v_cache, k_new, v_new, new_head_offsets)
    num_heads = k_cache.shape[0]
    k_new = k_new[:, new_head_offsets[0] : new_head_offsets[0] + num_heads]  # [B, H, D]
    v_new = v_new[:, new_head_offsets[1] : new_head_offsets[1] + num_heads]  # [B, H, D]
    _check_indices(k_new, block_idx, pos, batch_idx, scalar_pos=pos.ndim == 0)
    if batch_idx is not None:
        k_new = k_new[batch_idx]  # [B', H, D]
        v_new = v_new[batch_idx]  # [B', H, D]
    # k_cache[:, block_idx, pos] is [H, B', D].
    k_cache = k_cache.at[:, block_idx, pos].set(jnp.swapaxes(k_new, 0, 1))
    v_cache = v_cache.at[:, block_idx, pos].set(jnp.swapaxes(v_new, 0, 1))
    return k_cache, v_cache


# ----------------------------------------------------------------------------------------------
# Dispatch.
# ----------------------------------------------------------------------------------------------


def select_kv_append_variant(
    num_rows: int,
    head_dim: int,
    *,
    has_batch_idx: bool,
    scalar_pos: bool,
    use_kernels: bool = True,
    min_batch: int = DEFAULT_MIN_BATCH,
) -> str:
    """Which implementation kv_append runs: 'xla', 'full_batch', 'identity_pos' or 'generic'.

    Host-side, from static facts only: the XLA scatter when the kernels are not wanted
    (`use_kernels`), for fewer than `min_batch` rows (an int >= 0; 0 or 1: no gate), or for a
    head dim Triton cannot tile.
    """
    if scalar_pos and has_batch_idx:
        raise ValueError("a scalar pos needs batch_idx=None (full-batch form)")
    if not isinstance(min_batch, int) or min_batch < 0:
        raise ValueError(f"min_batch must be an int >= 0, got {min_batch!r}")
    if not use_kernels or num_rows < min_batch or not is_power_of_2(head_dim):
        return "xla"
    if not has_batch_idx:
        return "full_batch" if scalar_pos else "identity_pos"
    return "generic"


def kv_append(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    block_idx: jax.Array,
    pos: jax.Array | int,
    batch_idx: jax.Array | None = None,
    *,
    new_head_offsets: tuple[int, int] = (0, 0),
    use_kernels: bool = True,
    min_batch: int = DEFAULT_MIN_BATCH,
    interpret: bool | None = None,
    **tiles: int,
) -> tuple[jax.Array, jax.Array]:
    """Append one token's K/V per row into a paged cache layer; see the module docstring.

    k_cache, v_cache: [H, NB, BS, D] (donate them in the calling jit); k_new, v_new: [B, H, D];
    block_idx: int32 [B']; pos: int32 [B'] or int32 scalar (full-batch, needs batch_idx=None);
    batch_idx: None (row i is source i, B' = B) or int32 [B'].
    new_head_offsets: where the H heads start in k_new / v_new (module docstring).
    use_kernels, min_batch: when the kernels run at all (`select_kv_append_variant`).
    interpret=None interprets the kernels on a CPU backend and compiles them elsewhere.
    tiles: the kernel's block_b, block_h, num_warps, num_stages (unused by the XLA scatter).
    """
    unknown = set(tiles) - set(_TILE_PARAMS)
    if unknown:
        raise TypeError(f"kv_append() got unknown tile parameters {sorted(unknown)}")
    variant = select_kv_append_variant(
        block_idx.shape[0],
        k_cache.shape[-1],
        has_batch_idx=batch_idx is not None,
        scalar_pos=pos.ndim == 0,
        use_kernels=use_kernels,
        min_batch=min_batch,
    )
    if variant == "xla":
        return kv_append_reference(
            k_cache,
            v_cache,
            k_new,
            v_new,
            block_idx,
            pos,
            batch_idx,
            new_head_offsets=new_head_offsets,
        )
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    arrays = {"batch_idx": batch_idx, "block_idx": block_idx, "pos": pos}
    return _OPS[variant](
        k_cache,
        v_cache,
        k_new,
        v_new,
        *[arrays[name] for name in INDEX_ARGS[variant]],
        new_head_offsets=new_head_offsets,
        interpret=interpret,
        **tiles,
    )
