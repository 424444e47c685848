"""The Llama-style family's HF tensors -> params pytree (an explicit key map), and random init.

HF's Linear weights are [out, in]: each is transposed to a Dense kernel [in, out] at load. The q,
k and v projections become one kernel `qkv_proj` [E, (Hq + 2H) D] (and their biases one bias),
gate and up one `gate_up_proj` [E, 2F]: a matmul each instead of three and two. The params:

    {"embed_tokens": {"embedding": [V_pad, E]},
     "layers_0": {"input_layernorm": {"scale"},
                  "self_attn": {"qkv_proj": {"kernel", ("bias")}, "o_proj": {"kernel", ("bias")},
                                ("q_norm": {"scale"}, "k_norm": {"scale"})},
                  "post_attention_layernorm": {"scale"},
                  "mlp": {"gate_up_proj": {"kernel", ("bias")}, "down_proj": {"kernel", ("bias")}}},
     ..., "norm": {"scale"}, ("lm_head": {"kernel": [E, V_pad]})}

The embedding (or an untied LM head) gets zero rows up to `config.padded_vocab_size`.
"""

from __future__ import annotations

import functools
import re

import jax.numpy as jnp

from rosejax.models import random_init
from rosejax.models.checkpoint import check_tensors
from rosejax.models.llama.config import LlamaConfig

# RoPE buffers that older checkpoints carry beside the weights.
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")


def skip_tensor(name: str) -> bool:
    return bool(_IGNORED.search(name))


def param_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, every tensor the config's checkpoint holds."""
    e, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    hq, h = config.num_attention_heads, config.num_kv_heads
    shapes = {"model.embed_tokens.weight": (config.vocab_size, e)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (e,),
            p + "self_attn.q_proj.weight": (hq * d, e),
            p + "self_attn.k_proj.weight": (h * d, e),
            p + "self_attn.v_proj.weight": (h * d, e),
            p + "self_attn.o_proj.weight": (e, hq * d),
            p + "post_attention_layernorm.weight": (e,),
            p + "mlp.gate_proj.weight": (f, e),
            p + "mlp.up_proj.weight": (f, e),
            p + "mlp.down_proj.weight": (e, f),
        }
        if config.qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (hq * d,),
                p + "self_attn.k_proj.bias": (h * d,),
                p + "self_attn.v_proj.bias": (h * d,),
            }
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (e,)
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if config.mlp_bias:
            shapes |= {
                p + "mlp.gate_proj.bias": (f,),
                p + "mlp.up_proj.bias": (f,),
                p + "mlp.down_proj.bias": (e,),
            }
    shapes["model.norm.weight"] = (e,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, e)
    return shapes


def params_from_tensors(config: LlamaConfig, tensors: dict, dtype) -> dict:
    """Build the params pytree from HF-named tensors, checking names and shapes."""
    named = {n: v for n, v in tensors.items() if not skip_tensor(n)}
    if config.tie_word_embeddings:  # a tied checkpoint may carry the tied copy too
        named.pop("lm_head.weight", None)
    check_tensors(named, param_shapes(config), config.model_type)

    def get(name):  # cast first: no float32 copy of a half-precision load on the device
        return jnp.asarray(named.pop(name), dtype=dtype)

    def pad_rows(x):
        return jnp.pad(x, ((0, config.padded_vocab_size - x.shape[0]), (0, 0)))

    params: dict = {"embed_tokens": {"embedding": pad_rows(get("model.embed_tokens.weight"))}}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        attn = {
            "qkv_proj": {
                "kernel": jnp.concatenate([get(a + f"{n}_proj.weight").T for n in "qkv"], axis=1)
            },
            "o_proj": {"kernel": get(a + "o_proj.weight").T},
        }
        if config.qkv_bias:
            attn["qkv_proj"]["bias"] = jnp.concatenate([get(a + f"{n}_proj.bias") for n in "qkv"])
        if config.o_bias:
            attn["o_proj"]["bias"] = get(a + "o_proj.bias")
        if config.qk_norm:
            attn["q_norm"] = {"scale": get(a + "q_norm.weight")}
            attn["k_norm"] = {"scale": get(a + "k_norm.weight")}
        m = p + "mlp."
        mlp = {
            "gate_up_proj": {
                "kernel": jnp.concatenate(
                    [get(m + "gate_proj.weight").T, get(m + "up_proj.weight").T], axis=1
                )
            },
            "down_proj": {"kernel": get(m + "down_proj.weight").T},
        }
        if config.mlp_bias:
            mlp["gate_up_proj"]["bias"] = jnp.concatenate(
                [get(m + "gate_proj.bias"), get(m + "up_proj.bias")]
            )
            mlp["down_proj"]["bias"] = get(m + "down_proj.bias")
        params[f"layers_{i}"] = {
            "input_layernorm": {"scale": get(p + "input_layernorm.weight")},
            "self_attn": attn,
            "post_attention_layernorm": {"scale": get(p + "post_attention_layernorm.weight")},
            "mlp": mlp,
        }
    params["norm"] = {"scale": get("model.norm.weight")}
    if not config.tie_word_embeddings:
        params["lm_head"] = {"kernel": pad_rows(get("lm_head.weight")).T}
    return params


def _is_scale(name: str) -> bool:
    """A norm's scale (input_layernorm, post_attention_layernorm, q_norm, k_norm, norm)."""
    return name.endswith("norm.weight")


# normal(0, initializer_range) weights, unit norms, zero biases (HF's init), drawn on the device
# in `dtype`, for benchmarks and tests: random_params(config, seed=0, dtype="float32") -> params.
random_params = functools.partial(
    random_init.random_params,
    shapes=param_shapes,
    from_tensors=params_from_tensors,
    is_scale=_is_scale,
)
