"""Model families by Hugging Face `model_type`: each a config class, a key map from HF tensors to
its params pytree, and a pure forward over the paged KV cache. The engine sees only this registry.

A family's config exposes what the engine and the cache need whatever the architecture:
`num_layers`, `num_kv_heads`, `head_dim`, `max_model_len`, `vocab_size`, `eos_token_id`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from rosejax.models.gpt2 import config as gpt2_config
from rosejax.models.gpt2 import model as gpt2_model
from rosejax.models.gpt2 import weights as gpt2_weights


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    config_from_hf: Callable[[dict[str, Any]], Any]  # config.json's dict -> the family's config
    presets: dict[str, Any]  # shapes for `random:<name>`
    skip_tensor: Callable[[str], bool]  # checkpoint tensors that are not weights
    params_from_tensors: Callable[..., dict]  # (config, {HF name: array}, dtype) -> params
    random_params: Callable[..., dict]  # (config, seed, dtype) -> params
    forward: Callable[..., Any]  # (params, config, tokens, cache, meta, logit_indices, *, kernels)


FAMILIES: dict[str, ModelFamily] = {
    "gpt2": ModelFamily(
        config_from_hf=gpt2_config.GPT2Config.from_hf_dict,
        presets=gpt2_config.PRESETS,
        skip_tensor=gpt2_weights.skip_tensor,
        params_from_tensors=gpt2_weights.params_from_tensors,
        random_params=gpt2_weights.random_params,
        forward=gpt2_model.forward,
    ),
}


def family(model_type: str) -> ModelFamily:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not supported; rosejax serves {', '.join(FAMILIES)}"
        ) from None


def family_of(config: Any) -> ModelFamily:
    return family(config.model_type)


def preset(name: str) -> Any:
    """The config of `random:<name>`, searched over every family's presets."""
    for fam in FAMILIES.values():
        if name in fam.presets:
            return fam.presets[name]
    known = ", ".join(n for fam in FAMILIES.values() for n in fam.presets)
    raise ValueError(f"unknown preset {name!r}; known: {known}")
