"""GPT-2 in Flax, as a pure function of a params pytree and a paged KV cache.

Linen rather than NNX: a Linen module's `apply(params, ...)` already *is* the pure function the
engine jits, with the params as a plain nested dict that the checkpoint loader builds directly;
NNX would need a `split`/`merge` round trip to get the same thing.

One forward serves prefill (T tokens per row, padded) and decode (T = 1): each layer writes the new
K/V into the cache (the `pallas_kernels.kv_append` dispatcher, or a decode step's attention kernel),
then attends over the pages (see `rosejax.layers.attention`). Exactly GPT-2: learned positions, pre-LN,
tanh GELU, 1/sqrt(head_dim), tied LM head.

Under tensor parallelism (`tp`, inside `shard_map`: `rosejax.layers.parallel`) the same code runs
on one shard's params: its heads of c_attn and the cache, its part of the MLP and of wte.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pallas_kernels.decoder_step import DecoderHead, DecoderLayer, DecoderShape
from rosejax.layers.attention import (
    ForwardMetadata,
    append_kv,
    cache_writes,
    decode_attention,
    prefill_attention,
)
from rosejax.layers.kv_cache import KVCache
from rosejax.layers.layer_norm import LayerNorm
from rosejax.layers.linear import Linear, select_tokens
from rosejax.layers.parallel import NO_TP, ShardLayout, TensorParallel, embed, gather_vocab
from rosejax.models.gpt2.config import GPT2Config
from rosejax.models.one_kernel_step import (
    kernel_decode_step,
    takes_one_kernel_step,
    without_decoder_step,
)
from rosejax.settings import XLA_KERNELS, KernelConfig


class CausalSelfAttention(nn.Module):
    config: GPT2Config
    kernels: KernelConfig
    tp: TensorParallel

    @nn.compact
    def __call__(
        self, x, residual, k_cache, v_cache, meta: ForwardMetadata, write_block, write_offset, fresh
    ):
        """residual + attention over x (the layer-normed residual) -> [B, T, E] or its
        `PendingSum`, the caches."""
        b, t, e = x.shape
        h, d = self.tp.local(self.config.n_head), self.config.head_dim  # this shard's heads
        qkv = Linear(3 * h * d, kernels=self.kernels, name="c_attn")(x)  # [B, T, 3HD]
        # The kernels read q, k and v straight out of the projection (heads 0, H and 2H of
        # [B*T, 3H, D], a free reshape): split copies would be a kernel per layer of their own.
        fused = qkv.reshape(b * t, 3 * h, d)
        write_block, write_offset = write_block.reshape(-1), write_offset.reshape(-1)
        if t == 1:
            out, k_cache, v_cache = decode_attention(
                fused,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                write_block,
                write_offset,
                self.kernels,
            )
        else:
            k_cache, v_cache = append_kv(
                fused, k_cache, v_cache, write_block, write_offset, self.kernels
            )
            q, k, v = (a.reshape(b, t, h, d) for a in jnp.split(qkv, 3, axis=-1))
            out = prefill_attention(
                q, k, v, k_cache, v_cache, meta.block_tables, meta.positions, fresh, meta.seq_lens
            )
        # residual + projection, summed by the next layer norm
        y = Linear(e, kernels=self.kernels, reduce_axis=self.tp.reduce_axis, name="c_proj")(
            out.reshape(b, t, h * d), residual, defer=True
        )
        return y, k_cache, v_cache


class MLP(nn.Module):
    config: GPT2Config
    kernels: KernelConfig
    tp: TensorParallel

    @nn.compact
    def __call__(self, x, residual):
        """residual + MLP(x), or its `PendingSum` (the next layer norm sums it)."""
        f = self.tp.local(self.config.mlp_dim)
        x = Linear(f, "gelu_tanh", self.kernels, name="c_fc")(x)  # gelu_new
        return Linear(
            self.config.n_embd, kernels=self.kernels, reduce_axis=self.tp.reduce_axis, name="c_proj"
        )(x, residual, defer=True)


class Block(nn.Module):
    config: GPT2Config
    kernels: KernelConfig
    tp: TensorParallel

    @nn.compact
    def __call__(self, x, k_cache, v_cache, meta, write_block, write_offset, fresh):
        """x: the residual stream [B, T, E], an array or a `PendingSum`."""
        eps = self.config.layer_norm_epsilon
        x, y = LayerNorm(eps, self.kernels, name="ln_1")(x)
        x, k_cache, v_cache = CausalSelfAttention(self.config, self.kernels, self.tp, name="attn")(
            y, x, k_cache, v_cache, meta, write_block, write_offset, fresh
        )
        x, y = LayerNorm(eps, self.kernels, name="ln_2")(x)
        return MLP(self.config, self.kernels, self.tp, name="mlp")(y, x), k_cache, v_cache


class GPT2(nn.Module):
    config: GPT2Config
    dtype: Any
    kernels: KernelConfig
    tp: TensorParallel

    @nn.compact
    def __call__(self, tokens, cache: KVCache, meta: ForwardMetadata, logit_indices=None):
        cfg = self.config
        rows = self.tp.local(cfg.padded_vocab_size)  # this shard's vocabulary rows
        wte = nn.Embed(rows, cfg.n_embd, dtype=self.dtype, name="wte")
        wpe = nn.Embed(cfg.n_positions, cfg.n_embd, dtype=self.dtype, name="wpe")
        positions = jnp.clip(meta.positions, 0, cfg.n_positions - 1)  # padding may overrun
        x = embed(wte, tokens, self.tp) + wpe(positions)  # [B, T, E]

        write_block, write_offset, fresh = cache_writes(meta, cache.block_size)

        ks, vs = [], []
        for i in range(cfg.n_layer):  # unrolled: each layer's cache stays its own donated buffer
            x, k, v = Block(cfg, self.kernels, self.tp, name=f"h_{i}")(
                x, cache.k[i], cache.v[i], meta, write_block, write_offset, fresh
            )
            ks.append(k)
            vs.append(v)
        if logit_indices is not None:  # only the rows' last real tokens need logits
            x = select_tokens(x, logit_indices)  # [B, E]
        _, x = LayerNorm(cfg.layer_norm_epsilon, self.kernels, name="ln_f")(x)
        # In the model's dtype: an fp16 step writes (and its argmax reads) half the bytes of
        # float32 logits, 26 MB less per step at B=256; the values are the same, since the
        # product is rounded to the model's dtype first either way. Sampling upcasts.
        logits = gather_vocab(wte.attend(x), self.tp)  # [B, (T,) V_pad]
        logits = logits[..., : cfg.vocab_size]  # the padding rows dropped
        return logits, cache.replace(k=ks, v=vs)


def forward(
    params: dict,
    config: GPT2Config,
    tokens: jax.Array,  # [B, T] int32
    cache: KVCache,
    meta: ForwardMetadata,
    logit_indices: jax.Array | None = None,  # [B] int32: return logits of these tokens only
    *,
    kernels: KernelConfig = XLA_KERNELS,
    tp: TensorParallel = NO_TP,
) -> tuple[jax.Array, KVCache]:
    """Run GPT-2 over `tokens`, writing their K/V into `cache`, each op as `kernels` says (XLA by
    default); with `tp`, on one shard's params and cache (inside shard_map). Returns (logits,
    cache): logits are [B, T, V] in the params' dtype, or [B, V] when `logit_indices` is given."""
    if takes_one_kernel_step(params, kernels, tokens, logit_indices):
        parts = (decoder_shape(config), one_kernel_inputs)
        return kernel_decode_step(params, config, tokens, cache, meta, kernels, *parts)
    params = without_decoder_step(params)
    dtype = params["wte"]["embedding"].dtype
    return GPT2(config, dtype, kernels, tp).apply(
        {"params": params}, tokens, cache, meta, logit_indices
    )


def shard_layout(config: GPT2Config) -> ShardLayout:
    """How tensor parallelism splits GPT-2's params (`rosejax.layers.parallel`)."""
    e = config.n_embd
    return ShardLayout(
        column={"c_attn": (e, e, e), "c_fc": (config.mlp_dim,)},
        row=("c_proj", "wte"),
        divisible={
            "attention heads (n_head)": config.n_head,
            "MLP hidden units (n_inner)": config.mlp_dim,
            "vocabulary rows (padded to 128)": config.padded_vocab_size,
        },
    )


def decoder_shape(config: GPT2Config) -> DecoderShape:
    """The one-kernel decode step's sizes of a GPT-2 model (`pallas_kernels.decoder_step`)."""
    return DecoderShape(
        layers=config.n_layer,
        hidden=config.n_embd,
        heads=config.n_head,
        kv_heads=config.n_head,
        head_dim=config.head_dim,
        intermediate=config.mlp_dim,
        eps=config.layer_norm_epsilon,
        qk_norm=False,
        vocab=config.padded_vocab_size,
        layer_norm=True,
        biases=True,
        gelu=True,
        rope=False,
    )


def decoder_layers(params: dict, config: GPT2Config) -> list[DecoderLayer]:
    """Each block's parts as the one-kernel step takes them: c_attn, c_proj, c_fc, mlp's c_proj
    with their biases; ln_1's and ln_2's scales and shifts; no q/k norms."""
    layers = []
    for i in range(config.n_layer):
        block = params[f"h_{i}"]
        attn, mlp = block["attn"], block["mlp"]
        dense = (attn["c_attn"], attn["c_proj"], mlp["c_fc"], mlp["c_proj"])
        norms = [[block[n]["scale"], block[n]["bias"]] for n in ("ln_1", "ln_2")]
        layers.append(
            DecoderLayer(
                dense=tuple((x["kernel"], x["bias"]) for x in dense),
                norms=jnp.asarray(norms, jnp.float32),
                qk_norms=jnp.ones((2, config.head_dim), jnp.float32),
            )
        )
    return layers


def one_kernel_inputs(
    params: dict, config: GPT2Config, token: jax.Array, position: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The step's h before the layers (float32 [E]: the token's and its position's embeddings,
    summed in the params' dtype as the model does) and zeros for RoPE's cos, sin [2, D/2]."""
    position = jnp.clip(position, 0, config.n_positions - 1)
    h = params["wte"]["embedding"][token] + params["wpe"]["embedding"][position]
    return h.astype(jnp.float32), jnp.zeros((2, config.head_dim // 2), jnp.float32)


def decoder_head(params: dict, config: GPT2Config) -> DecoderHead:
    """ln_f's scale and shift, and the tied head's rows (wte's embedding itself)."""
    ln_f = params["ln_f"]
    norm = jnp.stack([ln_f["scale"], ln_f["bias"]]).astype(jnp.float32)
    return DecoderHead(norm=norm, rows=params["wte"]["embedding"])
