"""The one-kernel decode step (`pallas_kernels.decoder_step`) inside a model family's forward:
the params' key of its weights, packing them, what keeps it from running, and one row's step
through it over the engine's paged cache. A family brings its `DecoderShape`, its layers as the
kernel takes them (`DecoderLayer`s), its embedding (and RoPE angles), and its final norm and
head."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def one_row_step(
    params: dict,
    config: Any,
    tokens: jax.Array,  # [1, 1] int32
    cache: KVCache,
    meta: ForwardMetadata,
    kernels: KernelConfig,
    shape: DecoderShape,
    inputs: Callable[..., tuple[jax.Array, jax.Array]],
    final_logits: Callable[..., jax.Array],
) -> tuple[jax.Array, KVCache]:
    """A decode step of one row: the family's `inputs` (h before the layers, float32 [E], and
    RoPE's cos, sin [2, D/2]), every layer in `decoder_step` (the residual stream in float32),
    then its `final_logits` (final norm and head, XLA) -> (logits [1, 1, V], cache). A dead row
    (length 0) writes position 0 of the scratch block, as `cache_slots` sends it."""
    live = meta.seq_lens > 0  # [1]
    seq_len = jnp.where(live, meta.seq_lens, 1)
    table = jnp.where(live, meta.block_tables[0], 0)  # [MB]
    h, rope = inputs(params, config, tokens[0, 0], seq_len[0] - 1)
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
    return final_logits(params, config, h)[:, None], cache.replace(k=k, v=v)
