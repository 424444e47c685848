"""GPT-2's HF tensors -> params pytree (an explicit key map), and random init.

The params pytree mirrors the Flax model in `rosejax.models.gpt2.model`:

    {"wte": {"embedding": [V_pad, E]}, "wpe": {"embedding": [P, E]},
     "h_0": {"ln_1": {"scale", "bias"},
             "attn": {"c_attn": {"kernel": [E, 3E], "bias"}, "c_proj": {"kernel": [E, E], "bias"}},
             "ln_2": {...}, "mlp": {"c_fc": {"kernel": [E, F], ...}, "c_proj": {"kernel": [F, E], ...}}},
     ..., "ln_f": {"scale", "bias"}}

HF's GPT-2 uses Conv1D, whose weight is already [in, out]: it maps to a Dense kernel untransposed.
wte gets zero rows up to `config.padded_vocab_size` (V_pad); the model drops their logits.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from rosejax.models import random_init
from rosejax.models.checkpoint import check_tensors
from rosejax.models.gpt2.config import GPT2Config

# Buffers that hub checkpoints carry beside the weights (the causal mask), and the LM head, which
# GPT-2 ties to wte.
_IGNORED = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$|^lm_head\.weight$")


def skip_tensor(name: str) -> bool:
    """Tensors of a checkpoint that are not weights of the model (read neither from disk)."""
    return bool(_IGNORED.match(name.removeprefix("transformer.")))


def param_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """The explicit key map: HF tensor name (hub naming, no `transformer.` prefix) -> shape."""
    e, f = config.n_embd, config.mlp_dim
    shapes = {"wte.weight": (config.vocab_size, e), "wpe.weight": (config.n_positions, e)}
    for i in range(config.n_layer):
        p = f"h.{i}."
        shapes |= {
            p + "ln_1.weight": (e,),
            p + "ln_1.bias": (e,),
            p + "attn.c_attn.weight": (e, 3 * e),
            p + "attn.c_attn.bias": (3 * e,),
            p + "attn.c_proj.weight": (e, e),
            p + "attn.c_proj.bias": (e,),
            p + "ln_2.weight": (e,),
            p + "ln_2.bias": (e,),
            p + "mlp.c_fc.weight": (e, f),
            p + "mlp.c_fc.bias": (f,),
            p + "mlp.c_proj.weight": (f, e),
            p + "mlp.c_proj.bias": (e,),
        }
    return shapes | {"ln_f.weight": (e,), "ln_f.bias": (e,)}


def _param_path(hf_name: str) -> tuple[str, ...]:
    """`h.3.attn.c_attn.weight` -> ("h_3", "attn", "c_attn", "kernel")."""
    parts = hf_name.split(".")
    if parts[0] == "h":
        parts = [f"h_{parts[1]}", *parts[2:]]
    leaf = parts[-1]
    module = parts[-2]
    if module in ("wte", "wpe"):
        return (module, "embedding")
    if module.startswith("ln"):
        return (*parts[:-1], "scale" if leaf == "weight" else "bias")
    return (*parts[:-1], "kernel" if leaf == "weight" else "bias")


def params_from_tensors(
    config: GPT2Config, tensors: dict[str, np.ndarray | jax.Array], dtype: str | jnp.dtype
) -> dict:
    """Build the params pytree from HF-named tensors (either naming), checking names and shapes."""
    named = {}
    for name, value in tensors.items():
        if not skip_tensor(name):
            named[name.removeprefix("transformer.")] = value
    expected = param_shapes(config)
    check_tensors(named, expected, "GPT-2")
    params: dict = {}
    for name, shape in expected.items():
        value = named[name]
        node = params
        *parents, leaf = _param_path(name)
        for key in parents:
            node = node.setdefault(key, {})
        value = jnp.asarray(value, dtype=dtype)
        if name == "wte.weight":  # cast first: no padded float32 copy on the device
            value = jnp.pad(value, ((0, config.padded_vocab_size - shape[0]), (0, 0)))
        node[leaf] = value
    return params


def _is_scale(name: str) -> bool:
    """A layer norm's scale (`h.0.ln_1.weight`, `ln_f.weight`)."""
    return name.endswith(".weight") and name.split(".")[-2].startswith("ln_")


# GPT-2's initialisation (normal(0, initializer_range), unit LN), drawn on the device, for
# benchmarks and tests: random_params(config, seed=0, dtype="float32") -> params.
random_params = functools.partial(
    random_init.random_params,
    shapes=param_shapes,
    from_tensors=params_from_tensors,
    is_scale=_is_scale,
)
