"""The Llama-style decoder in Flax, as a pure function of a params pytree and a paged KV cache.

Pre-norm blocks with RMSNorm, grouped-query attention with RoPE (optionally Qwen3's per-head
q/k RMSNorm before it), SwiGLU MLP (down(silu(gate x) * up x)), tied or untied LM head. As in
GPT-2's model, one forward serves prefill (T tokens per row) and decode (T = 1): the q, k and v
projections are one matmul (`qkv_proj`, fused at load) and gate/up another (`gate_up_proj`); the
kernels read q, k and v out of the fused [N, Hq + 2H, D] projection after RoPE, K/V are written to
the cache (or by the decode attention kernel itself, which then also takes q and k before their
q/k norm and RoPE and applies both: `KernelConfig.fused_qk_rope`) and attended over the pages.
The gate/up projection's Pallas kernel computes silu(gate) * up itself (`KernelConfig.fused_swiglu`).

Under tensor parallelism (`tp`, inside `shard_map`: `rosejax.layers.parallel`) the same code runs
on one shard's params: its query and KV heads and their cache, its part of the MLP's hidden units
and of the vocabulary.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pallas_kernels.decoder_step import DecoderHead, DecoderLayer, DecoderShape
from pallas_kernels.qk_norm_rope import apply_rotary
from rosejax.layers.attention import (
    ForwardMetadata,
    append_kv,
    cache_writes,
    decode_attention,
    decode_kernel_appends,
    prefill_attention,
)
from rosejax.layers.kv_cache import KVCache
from rosejax.layers.linear import Linear, select_tokens
from rosejax.layers.parallel import NO_TP, ShardLayout, TensorParallel, embed, gather_vocab
from rosejax.layers.rms_norm import RMSNorm
from rosejax.layers.rotary import rope_cos_sin, rope_inv_freq
from rosejax.models.llama.config import LlamaConfig
from rosejax.models.one_kernel_step import (
    kernel_decode_step,
    takes_one_kernel_step,
    without_decoder_step,
)
from rosejax.settings import XLA_KERNELS, KernelConfig


def inv_freq(config: LlamaConfig):
    return rope_inv_freq(
        config.head_dim,
        config.rope_theta,
        config.rope_type,
        factor=config.rope_factor,
        low_freq_factor=config.rope_low_freq_factor,
        high_freq_factor=config.rope_high_freq_factor,
        original_max_position_embeddings=config.rope_original_max_position_embeddings,
    )


class Attention(nn.Module):
    config: LlamaConfig
    kernels: KernelConfig
    tp: TensorParallel

    @nn.compact
    def __call__(
        self, x, residual, k_cache, v_cache, meta, write_block, write_offset, fresh, cos, sin
    ):
        """residual + attention over x (the normed residual) -> [B, T, E] or its `PendingSum`,
        the caches. cos, sin: float32 [B*T, D/2], each token's RoPE angles."""
        cfg = self.config
        b, t, e = x.shape
        hq, h = self.tp.local(cfg.num_attention_heads), self.tp.local(cfg.num_kv_heads)
        d = cfg.head_dim
        qkv = Linear(
            (hq + 2 * h) * d, kernels=self.kernels, use_bias=cfg.qkv_bias, name="qkv_proj"
        )(x)
        qkv = qkv.reshape(b * t, hq + 2 * h, d)
        write_block, write_offset = write_block.reshape(-1), write_offset.reshape(-1)
        q_norm = RMSNorm(cfg.rms_norm_eps, self.kernels, name="q_norm") if cfg.qk_norm else None
        k_norm = RMSNorm(cfg.rms_norm_eps, self.kernels, name="k_norm") if cfg.qk_norm else None
        if t == 1 and self.kernels.fused_qk_rope and decode_kernel_appends(self.kernels, k_cache):
            # The decode kernel normalizes and rotates q and k as it reads them.
            norms = (q_norm.scale(d), k_norm.scale(d)) if cfg.qk_norm else None
            fused, prologue = qkv, dict(rope=(cos, sin), qk_norm=norms, eps=cfg.rms_norm_eps)
        else:
            q, k, v = qkv[:, :hq], qkv[:, hq : hq + h], qkv[:, hq + h :]
            if cfg.qk_norm:  # Qwen3: RMSNorm over each head's dims, before RoPE
                _, q = q_norm(q)
                _, k = k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            fused = jnp.concatenate([q, k, v], axis=1)  # [B*T, Hq + 2H, D], what kernels read
            prologue = {}
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
                num_q_heads=hq,
                **prologue,
            )
        else:  # q, k and v rotated above: prefill never fuses them
            k_cache, v_cache = append_kv(
                fused, k_cache, v_cache, write_block, write_offset, self.kernels, num_q_heads=hq
            )
            out = prefill_attention(
                q.reshape(b, t, hq, d),
                k.reshape(b, t, h, d),
                v.reshape(b, t, h, d),
                k_cache,
                v_cache,
                meta.block_tables,
                meta.positions,
                fresh,
                meta.seq_lens,
                self.kernels,
            )
        y = Linear(
            e,
            kernels=self.kernels,
            use_bias=cfg.o_bias,
            reduce_axis=self.tp.reduce_axis,
            name="o_proj",
        )(out.reshape(b, t, hq * d), residual, defer=True)
        return y, k_cache, v_cache


class MLP(nn.Module):
    config: LlamaConfig
    kernels: KernelConfig
    tp: TensorParallel

    @nn.compact
    def __call__(self, x, residual):
        """residual + down(silu(gate x) * up x), or its `PendingSum`."""
        cfg = self.config
        f = self.tp.local(cfg.intermediate_size)
        hidden = Linear(
            2 * f,
            activation="swiglu",
            kernels=self.kernels,
            use_bias=cfg.mlp_bias,
            name="gate_up_proj",
        )(x)  # [..., f]
        return Linear(
            cfg.hidden_size,
            kernels=self.kernels,
            use_bias=cfg.mlp_bias,
            reduce_axis=self.tp.reduce_axis,
            name="down_proj",
        )(hidden, residual, defer=True)


class Block(nn.Module):
    config: LlamaConfig
    kernels: KernelConfig
    tp: TensorParallel

    @nn.compact
    def __call__(self, x, k_cache, v_cache, meta, write_block, write_offset, fresh, cos, sin):
        """x: the residual stream [B, T, E], an array or a `PendingSum`."""
        eps = self.config.rms_norm_eps
        x, y = RMSNorm(eps, self.kernels, name="input_layernorm")(x)
        x, k_cache, v_cache = Attention(self.config, self.kernels, self.tp, name="self_attn")(
            y, x, k_cache, v_cache, meta, write_block, write_offset, fresh, cos, sin
        )
        x, y = RMSNorm(eps, self.kernels, name="post_attention_layernorm")(x)
        return MLP(self.config, self.kernels, self.tp, name="mlp")(y, x), k_cache, v_cache


class LlamaModel(nn.Module):
    config: LlamaConfig
    dtype: Any
    kernels: KernelConfig
    tp: TensorParallel

    @nn.compact
    def __call__(self, tokens, cache: KVCache, meta: ForwardMetadata, logit_indices=None):
        cfg = self.config
        rows = self.tp.local(cfg.padded_vocab_size)  # this shard's vocabulary rows
        table = nn.Embed(rows, cfg.hidden_size, dtype=self.dtype, name="embed_tokens")
        x = embed(table, tokens, self.tp)  # [B, T, E]
        write_block, write_offset, fresh = cache_writes(meta, cache.block_size)
        cos, sin = rope_cos_sin(meta.positions.reshape(-1), inv_freq(cfg))  # [B*T, D/2] each

        ks, vs = [], []
        for i in range(cfg.num_hidden_layers):  # unrolled: each layer's cache its own buffer
            x, k, v = Block(cfg, self.kernels, self.tp, name=f"layers_{i}")(
                x, cache.k[i], cache.v[i], meta, write_block, write_offset, fresh, cos, sin
            )
            ks.append(k)
            vs.append(v)
        if logit_indices is not None:  # only the rows' last real tokens need logits
            x = select_tokens(x, logit_indices)  # [B, E]
        _, x = RMSNorm(cfg.rms_norm_eps, self.kernels, name="norm")(x)
        if cfg.tie_word_embeddings:
            logits = table.attend(x)
        else:
            logits = nn.Dense(rows, use_bias=False, dtype=self.dtype, name="lm_head")(x)
        logits = gather_vocab(logits, self.tp)  # [B, (T,) V_pad]
        return logits[..., : cfg.vocab_size], cache.replace(k=ks, v=vs)


def decoder_shape(config: LlamaConfig) -> DecoderShape:
    """The one-kernel decode step's sizes of a Llama-family model (`pallas_kernels.decoder_step`;
    Qwen2's biases included)."""
    return DecoderShape(
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate=config.intermediate_size,
        eps=config.rms_norm_eps,
        qk_norm=config.qk_norm,
        vocab=config.padded_vocab_size,
        biases=config.qkv_bias or config.o_bias or config.mlp_bias,
    )


def decoder_layers(params: dict, config: LlamaConfig) -> list[DecoderLayer]:
    """Each layer's parts as the one-kernel step takes them: q/k/v, o_proj, gate/up and down
    with their biases (Qwen2's q/k/v) or none; the two RMSNorms' scales (no shift); q_norm's and
    k_norm's scales (Qwen3) or ones."""
    layers = []
    for i in range(config.num_hidden_layers):
        layer = params[f"layers_{i}"]
        attn, mlp = layer["self_attn"], layer["mlp"]
        dense = (attn["qkv_proj"], attn["o_proj"], mlp["gate_up_proj"], mlp["down_proj"])
        scales = [layer[n]["scale"] for n in ("input_layernorm", "post_attention_layernorm")]
        qk_norms = jnp.ones((2, config.head_dim), jnp.float32)
        if config.qk_norm:
            qk_norms = jnp.stack([attn["q_norm"]["scale"], attn["k_norm"]["scale"]])
        layers.append(
            DecoderLayer(
                dense=tuple((x["kernel"], x.get("bias")) for x in dense),
                norms=jnp.asarray([[s, jnp.zeros_like(s)] for s in scales], jnp.float32),
                qk_norms=qk_norms.astype(jnp.float32),
            )
        )
    return layers


def one_kernel_inputs(
    params: dict, config: LlamaConfig, token: jax.Array, position: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The step's h before the layers (float32 [E]) and the cos, sin of its position [2, D/2]."""
    cos, sin = rope_cos_sin(jnp.reshape(position, (1,)), inv_freq(config))  # [1, D/2] each
    h = params["embed_tokens"]["embedding"][token].astype(jnp.float32)
    return h, jnp.concatenate([cos, sin])


def decoder_head(params: dict, config: LlamaConfig) -> DecoderHead:
    """The final RMSNorm's scale (no shift) and the head's rows: the embedding itself where
    tied, else lm_head's kernel transposed (a copy)."""
    scale = params["norm"]["scale"]
    norm = jnp.stack([scale, jnp.zeros_like(scale)]).astype(jnp.float32)
    if config.tie_word_embeddings:
        return DecoderHead(norm=norm, rows=params["embed_tokens"]["embedding"])
    return DecoderHead(norm=norm, rows=params["lm_head"]["kernel"].T)


def forward(
    params: dict,
    config: LlamaConfig,
    tokens: jax.Array,  # [B, T] int32
    cache: KVCache,
    meta: ForwardMetadata,
    logit_indices: jax.Array | None = None,  # [B] int32: return logits of these tokens only
    *,
    kernels: KernelConfig = XLA_KERNELS,
    tp: TensorParallel = NO_TP,
) -> tuple[jax.Array, KVCache]:
    """Run the model over `tokens`, writing their K/V into `cache`, each op as `kernels` says;
    with `tp`, on one shard's params and cache (inside shard_map). Returns (logits [B, T, V] in
    the params' dtype, or [B, V] with `logit_indices`, cache)."""
    if takes_one_kernel_step(params, kernels, tokens, logit_indices):
        parts = (decoder_shape(config), one_kernel_inputs)
        return kernel_decode_step(params, config, tokens, cache, meta, kernels, *parts)
    params = without_decoder_step(params)
    dtype = params["embed_tokens"]["embedding"].dtype
    return LlamaModel(config, dtype, kernels, tp).apply(
        {"params": params}, tokens, cache, meta, logit_indices
    )


def shard_layout(config: LlamaConfig) -> ShardLayout:
    """How tensor parallelism splits the family's params (`rosejax.layers.parallel`)."""
    hq, h, d = config.num_attention_heads, config.num_kv_heads, config.head_dim
    f, v = config.intermediate_size, config.padded_vocab_size
    return ShardLayout(
        column={"qkv_proj": (hq * d, h * d, h * d), "gate_up_proj": (f, f), "lm_head": (v,)},
        row=("o_proj", "down_proj", "embed_tokens"),
        divisible={
            "attention heads (num_attention_heads)": hq,
            "KV heads (num_key_value_heads)": h,
            "MLP hidden units (intermediate_size)": f,
            "vocabulary rows (padded to 128)": v,
        },
    )
