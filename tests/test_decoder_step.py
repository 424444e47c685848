"""The one-kernel decode step of the Llama family (`pallas_kernels.decoder_step`): its XLA reference
against the model's own decode step (CPU, fp32, checkpoints written by transformers), and on a GPU
the persistent kernel against that reference (bf16, poisoned caches, every element compared).
jax's Mosaic GPU interpreter has no global semaphores, so the kernel itself runs on a GPU only."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.common import random_hf_model
from pallas_kernels.decoder_step import (
    DecoderShape,
    decoder_step,
    decoder_step_reference,
    pack_decoder_weights,
)
from pallas_kernels.rms_norm import rms_norm_reference
from rosejax.layers.attention import ForwardMetadata
from rosejax.layers.kv_cache import init_kv_cache
from rosejax.layers.rotary import rope_cos_sin
from rosejax.models import family_of, preset
from rosejax.models.llama.model import inv_freq
from rosejax.models.loader import load_checkpoint

BLOCK_SIZE = 8
# The kernel's tiles want hidden, intermediate and heads x head_dim in multiples of 256.
SHAPES = {
    "qwen3-g2-hd64-tied": (
        "qwen3",
        dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
        | dict(head_dim=64, tie_word_embeddings=True),
    ),
    "llama-g4-hd128-untied": (
        "llama",
        dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=1)
        | dict(head_dim=128, tie_word_embeddings=False),
    ),
}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoint(request, tmp_path_factory):
    model_type, kwargs = SHAPES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = random_hf_model(
        model_type,
        seed=3,
        initializer_range=0.1,
        vocab_size=300,
        num_hidden_layers=2,
        max_position_embeddings=160,
        **kwargs,
    )
    model.save_pretrained(path)
    return load_checkpoint(str(path), "float32")


def step_inputs(config, params, cached: int, rng):
    """A prompt of `cached` tokens prefilled by the model, then the step's token: (the model's
    logits and caches after the step, the reference's inputs)."""
    forward = jax.jit(family_of(config).forward, static_argnums=1)
    pages = -(-config.max_model_len // BLOCK_SIZE)
    table = jnp.asarray(1 + rng.permutation(pages), jnp.int32)  # pages out of order
    cache = init_kv_cache(config, pages + 1, BLOCK_SIZE, jnp.float32)
    tokens = rng.integers(0, config.vocab_size, cached + 1).astype(np.int32)

    def run(start, n, cache):
        meta = ForwardMetadata(
            positions=jnp.arange(start, start + n, dtype=jnp.int32)[None],
            seq_lens=jnp.asarray([start + n], jnp.int32),
            block_tables=table[None],
        )
        return forward(params, config, jnp.asarray(tokens[None, start : start + n]), cache, meta)

    if cached:
        _, cache = run(0, cached, cache)
    before = cache
    logits, after = run(cached, 1, cache)
    cos, sin = rope_cos_sin(jnp.asarray(cached), inv_freq(config))
    h0 = params["embed_tokens"]["embedding"][tokens[cached]].astype(jnp.float32)
    inputs = (h0, jnp.stack([cos, sin]), table, jnp.asarray([cached + 1], jnp.int32))
    return logits[0, 0], after, inputs, before


def head_logits(config, params, h):
    """The model's final norm and LM head over h [E]."""
    x = rms_norm_reference(h[None], params["norm"]["scale"], eps=config.rms_norm_eps)
    if config.tie_word_embeddings:
        w = params["embed_tokens"]["embedding"].T
    else:
        w = params["lm_head"]["kernel"]
    return (x @ w)[0, : config.vocab_size]


@pytest.mark.parametrize("cached", [0, 9, 77, 150])
def test_reference_matches_model(checkpoint, cached):
    """Logits and caches after one step: the reference (float32 residual, fp32 weights: no
    rounding) against the model's forward of one token, across 64-token tiles and pages."""
    config, params = checkpoint
    shape = DecoderShape.of(config)
    logits, after, inputs, before = step_inputs(config, params, cached, np.random.default_rng(7))
    h, ks, vs = decoder_step_reference(params, shape, *inputs, before.k, before.v)
    assert rel_err(head_logits(config, params, h), logits) <= 1e-5
    for got, want in zip(ks + vs, after.k + after.v, strict=True):
        assert rel_err(got, want) <= 1e-5


def test_pack_decoder_weights_tiles(checkpoint):
    """Tile k * N/64 + b of a matmul is W[k*256 : (k+1)*256, b*64 : (b+1)*64] transposed, in each
    layer's q/k/v, o_proj, gate/up, down order."""
    config, params = checkpoint
    shape = DecoderShape.of(config)
    tiles = np.asarray(pack_decoder_weights(params, shape)["tiles"])
    per_layer, rng = sum(shape.phase_tiles()), np.random.default_rng(0)
    layer = params["layers_1"]
    kernels = [
        layer["self_attn"]["qkv_proj"]["kernel"],
        layer["self_attn"]["o_proj"]["kernel"],
        layer["mlp"]["gate_up_proj"]["kernel"],
        layer["mlp"]["down_proj"]["kernel"],
    ]
    start = per_layer
    for w, n in zip(kernels, shape.phase_tiles(), strict=True):
        w = np.asarray(w)
        blocks = w.shape[1] // 64
        for i in rng.choice(n, 3, replace=False):
            k, b = divmod(int(i), blocks)
            want = w[k * 256 : (k + 1) * 256, b * 64 : (b + 1) * 64].T
            np.testing.assert_array_equal(tiles[start + i], want)
        start += n
    assert start == 2 * per_layer == len(tiles)


def test_decoder_step_rejects_bad_shapes(checkpoint):
    config, params = checkpoint
    shape = DecoderShape.of(config)
    weights = pack_decoder_weights(params, shape)
    cache = init_kv_cache(config, 4, BLOCK_SIZE, jnp.float32)
    args = (weights, jnp.zeros(shape.hidden), jnp.zeros((2, shape.head_dim // 2)))
    args += (jnp.zeros(2, jnp.int32), jnp.ones(1, jnp.int32), cache.k, cache.v)
    with pytest.raises(ValueError, match="bf16 or fp16"):  # fp32 weights
        decoder_step(*args, shape=shape, programs=2, splits=1, stages=2)
    with pytest.raises(NotImplementedError, match="needs a GPU"):
        decoder_step(*args, shape=shape, programs=2, splits=1, stages=2, interpret=True)


# On a GPU: Qwen3-0.6B's widths (16 query / 8 KV heads of 128, 3,072 MLP units), 3 layers.
GPU = jax.default_backend() == "gpu"


@pytest.mark.skipif(not GPU, reason="the persistent kernel's grid barrier needs a GPU")
@pytest.mark.parametrize(
    "programs,splits,stages,cached",
    [(128, 8, 4, 0), (128, 8, 4, 200), (132, 16, 3, 63), (37, 4, 2, 64), (96, 12, 6, 1000)],
)
def test_decoder_step_matches_reference(programs, splits, stages, cached):
    config = dataclasses.replace(preset("qwen3-0.6b"), num_hidden_layers=3)
    shape = DecoderShape.of(config)
    programs = min(programs, jax.devices()[0].core_count)
    rng = np.random.default_rng(cached)
    params = family_of(config).random_params(config, seed=cached, dtype=jnp.bfloat16)
    weights = pack_decoder_weights(params, shape)
    block_size, pages = 16, 80
    table = jnp.asarray(1 + rng.permutation(pages), jnp.int32)
    cache_shape = (shape.kv_heads, pages + 1, block_size, shape.head_dim)
    # Poisoned caches: random everywhere; only the step's slot may change.
    ks = [jnp.asarray(rng.normal(size=cache_shape), jnp.bfloat16) for _ in range(3)]
    vs = [jnp.asarray(rng.normal(size=cache_shape), jnp.bfloat16) for _ in range(3)]
    cos, sin = rope_cos_sin(jnp.asarray(cached), inv_freq(config))
    h0 = jnp.asarray(rng.normal(size=shape.hidden), jnp.float32)
    inputs = (h0, jnp.stack([cos, sin]), table, jnp.asarray([cached + 1], jnp.int32))
    want = decoder_step_reference(params, shape, *inputs, ks, vs)
    got = decoder_step(
        weights, *inputs, ks, vs, shape=shape, programs=programs, splits=splits, stages=stages
    )
    assert rel_err(got[0], want[0]) <= 2e-2
    page, offset = int(table[cached // block_size]), cached % block_size
    for g, w, before in zip(got[1] + got[2], want[1] + want[2], ks + vs, strict=True):
        g, w, before = (np.asarray(a, np.float32) for a in (g, w, before))
        written = np.zeros(g.shape, bool)
        written[:, page, offset] = True
        np.testing.assert_array_equal(g[~written], before[~written])
        assert rel_err(g[written], w[written]) <= 2e-2
