"""The one-kernel decode step (`pallas_kernels.decoder_step`) inside a model family's forward:
the params' key of its weights, packing them, what keeps it from running, and one row's step
through it over the engine's paged cache. A family brings its `DecoderShape`, its layers, final
norm and head as the kernel takes them (`DecoderLayer`s, `DecoderHead`), and its embedding (and
RoPE angles)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.decoder_step import (
    DecoderHead,
    DecoderLayer,
    DecoderShape,
    decoder_step,
    decoder_step_lowering_problem,
    decoder_step_problems,
    head_weights,
    pack_decoder_weights,
)
from rosejax.layers.attention import ForwardMetadata
from rosejax.layers.kv_cache import KVCache
from rosejax.settings import KernelConfig

DECODER_STEP = "decoder_step"  # the params' key of the one-kernel step's weights


def with_decoder_step(
    params: dict,
    shape: DecoderShape,
    layers_of: Callable[[dict], list[DecoderLayer]],
    head_of: Callable[[dict], DecoderHead],
) -> dict:
    """params and, under DECODER_STEP, the one-kernel decode step's weights: a tiled copy of the
    layers' matmuls (`pack_decoder_weights` of `layers_of(params)`, the family's mapping), the
    final norm and the head's rows (`head_of(params)`, outside a jit: a tied head is the
    embedding itself, not a copy)."""
    weights = jax.jit(lambda p: pack_decoder_weights(layers_of(p), shape))(params)
    return {**params, DECODER_STEP: weights | head_weights(head_of(params))}


def one_kernel_step_problems(
    shape: DecoderShape,
    dtype,
    block_size: int,
    kernels: KernelConfig,
    device: jax.Device,
    stages: int | None = None,
) -> list[str]:
    """Why the step cannot run a model of `shape` on `kernels.decoder_step_programs` programs
    of `device` at up to `kernels.decoder_step_rows` rows (empty: it can); compiled, whether
    Mosaic GPU can build it (its shared memory) with `stages` weight stages (None: any)."""
    programs, rows = kernels.decoder_step_programs, kernels.decoder_step_rows
    problems = decoder_step_problems(
        shape,
        dtype,
        block_size,
        programs=programs,
        rows=rows,
        interpret=kernels.interpret,
        device=device,
    )
    if not problems and not kernels.interpret:
        lowering = decoder_step_lowering_problem(
            shape, dtype, block_size, programs=programs, stages=stages, rows=rows
        )
        problems += [lowering] if lowering else []
    return problems


def decoder_step_buckets(kernels: KernelConfig) -> list[int]:
    """The decode widths that take the one-kernel step unpadded: 1, 2, 4, ... up to
    `kernels.decoder_step_rows`, and that."""
    rows = kernels.decoder_step_rows
    return sorted({2**i for i in range(rows.bit_length()) if 2**i < rows} | {rows})


def takes_one_kernel_step(
    params: dict, kernels: KernelConfig, tokens: jax.Array, logit_indices
) -> bool:
    """Whether a forward runs the step: its weights packed, its programs set, a decode of at
    most `kernels.decoder_step_rows` rows."""
    return (
        DECODER_STEP in params
        and bool(kernels.decoder_step_programs)
        and tokens.shape[1] == 1
        and tokens.shape[0] <= kernels.decoder_step_rows
        and logit_indices is None
    )


def without_decoder_step(params: dict) -> dict:
    """params as the per-op layers take them."""
    return {k: v for k, v in params.items() if k != DECODER_STEP}


def kernel_decode_step(
    params: dict,
    config: Any,
    tokens: jax.Array,  # [R, 1] int32
    cache: KVCache,
    meta: ForwardMetadata,
    kernels: KernelConfig,
    shape: DecoderShape,
    inputs: Callable[..., tuple[jax.Array, jax.Array]],
) -> tuple[jax.Array, KVCache]:
    """A decode step of R rows: the family's `inputs` of each (h before the layers, float32 [E],
    and RoPE's cos, sin [2, D/2]), then every layer, the final norm and the head in
    `decoder_step` (the residual stream in float32) -> (logits [R, 1, V] in the head's dtype,
    cache). A dead row (length 0) goes to `decoder_step` as it is, which writes its K/V to
    position 0 of the scratch block, as `cache_slots` sends it."""
    positions = jnp.maximum(meta.seq_lens - 1, 0)  # [R]
    h, rope = jax.vmap(lambda token, position: inputs(params, config, token, position))(
        tokens[:, 0], positions
    )
    weights = params[DECODER_STEP]
    logits, _, k, v = decoder_step(
        weights,
        h,
        rope,
        meta.block_tables,
        meta.seq_lens,
        cache.k,
        cache.v,
        shape=shape,
        programs=kernels.decoder_step_programs,
        interpret=kernels.interpret,
    )
    logits = logits[:, : config.vocab_size].astype(weights["head"].dtype)
    return logits[:, None], cache.replace(k=k, v=v)
