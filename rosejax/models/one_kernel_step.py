"""The one-kernel decode step (`pallas_kernels.decoder_step`) inside a model family's forward:
the params' key of its weights, packing them, what keeps it from running, and one row's layers
through it over the engine's paged cache. A family brings its `DecoderShape`, its layers as the
kernel takes them (`DecoderLayer`s), its embedding (and RoPE angles), and its final norm and
head."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.decoder_step import (
    DecoderLayer,
    DecoderShape,
    decoder_step,
    decoder_step_lowering_problem,
    decoder_step_problems,
    pack_decoder_weights,
)
from rosejax.layers.attention import ForwardMetadata
from rosejax.layers.kv_cache import KVCache
from rosejax.settings import KernelConfig

DECODER_STEP = "decoder_step"  # the params' key of the one-kernel step's weights


def with_decoder_step(
    params: dict, shape: DecoderShape, layers_of: Callable[[dict], list[DecoderLayer]]
) -> dict:
    """params and, under DECODER_STEP, the one-kernel decode step's weights (a tiled copy of the
    layers' matmuls: `pack_decoder_weights` of `layers_of(params)`, the family's mapping)."""
    weights = jax.jit(lambda p: pack_decoder_weights(layers_of(p), shape))(params)
    return {**params, DECODER_STEP: weights}


def one_kernel_step_problems(
    shape: DecoderShape, dtype, block_size: int, kernels: KernelConfig, device: jax.Device
) -> list[str]:
    """Why the step cannot run a model of `shape` on `kernels.decoder_step_programs` programs
    of `device` (empty: it can); compiled, whether Mosaic GPU can build it (its shared
    memory)."""
    programs = kernels.decoder_step_programs
    problems = decoder_step_problems(
        shape, dtype, block_size, programs=programs, interpret=kernels.interpret, device=device
    )
    if not problems and not kernels.interpret:
        lowering = decoder_step_lowering_problem(shape, dtype, block_size, programs=programs)
        problems += [lowering] if lowering else []
    return problems


def takes_one_kernel_step(
    params: dict, kernels: KernelConfig, tokens: jax.Array, logit_indices
) -> bool:
    """Whether a forward runs the step: its weights packed, its programs set, one row's decode."""
    return (
        DECODER_STEP in params
        and bool(kernels.decoder_step_programs)
        and tokens.shape == (1, 1)
        and logit_indices is None
    )


def without_decoder_step(params: dict) -> dict:
    """params as the per-op layers take them."""
    return {k: v for k, v in params.items() if k != DECODER_STEP}


def row_of(meta: ForwardMetadata) -> tuple[jax.Array, jax.Array]:
    """The row's length with the step's token [1] and its block table [MB]; a dead row (length
    0) writes position 0 of the scratch block, as `cache_slots` sends it."""
    live = meta.seq_lens > 0  # [1]
    return jnp.where(live, meta.seq_lens, 1), jnp.where(live, meta.block_tables[0], 0)


def run_layers(
    params: dict,
    shape: DecoderShape,
    h: jax.Array,  # float32 [E]: the token's embedding
    rope: jax.Array,  # float32 [2, D/2]: cos, sin of its position (zeros without RoPE)
    meta: ForwardMetadata,
    cache: KVCache,
    kernels: KernelConfig,
) -> tuple[jax.Array, KVCache]:
    """h after every layer (float32 [E]) and the cache with the token's K/V appended."""
    seq_len, table = row_of(meta)
    h, k, v = decoder_step(
        params[DECODER_STEP],
        h,
        rope,
        table,
        seq_len,
        cache.k,
        cache.v,
        shape=shape,
        programs=kernels.decoder_step_programs,
        interpret=kernels.interpret,
    )
    return h, cache.replace(k=k, v=v)
