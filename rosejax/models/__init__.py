"""Model families by Hugging Face `model_type`: each a config class, a key map from HF tensors to
its params pytree, and a pure forward over the paged KV cache. The engine sees only this registry.

A family's config exposes what the engine and the cache need whatever the architecture:
`num_layers`, `num_kv_heads`, `head_dim`, `max_model_len`, `vocab_size`, `eos_token_id` (an id
or a tuple of them: `eos_token_ids` reads either).

| model_type | family | module |
| --- | --- | --- |
| gpt2 | GPT-2 | `rosejax.models.gpt2` |
| llama, qwen3, qwen2, mistral | Llama-style (RMSNorm, GQA, RoPE, SwiGLU) | `rosejax.models.llama` |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pallas_kernels.decoder_step import STAGES, DecoderHead, DecoderLayer, DecoderShape
from rosejax.models.gpt2 import config as gpt2_config
from rosejax.models.gpt2 import model as gpt2_model
from rosejax.models.gpt2 import weights as gpt2_weights
from rosejax.models.llama import config as llama_config
from rosejax.models.llama import model as llama_model
from rosejax.models.llama import weights as llama_weights
from rosejax.models.one_kernel_step import one_kernel_step_problems
from rosejax.settings import DEFAULT_GPU_MIN_DECODE_BATCH


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    config_from_hf: Callable[[dict[str, Any]], Any]  # config.json's dict -> the family's config
    presets: dict[str, Any]  # shapes for `random:<name>`
    skip_tensor: Callable[[str], bool]  # checkpoint tensors that are not weights
    params_from_tensors: Callable[..., dict]  # (config, {HF name: array}, dtype) -> params
    random_params: Callable[..., dict]  # (config, seed, dtype) -> params
    # (params, config, tokens, cache, meta, logit_indices, *, kernels, tp)
    forward: Callable[..., Any]
    shard_layout: Callable[[Any], Any]  # config -> its params' `ShardLayout` (tensor parallel)
    # The smallest decode program on a GPU: smaller batches pad to it (`min_decode_batch`).
    gpu_min_decode_batch: int
    # config -> the sizes of its one-kernel decode step (`KernelConfig.decoder_step_programs`,
    # `rosejax.models.one_kernel_step`); None: the family has no such step. (params, config) ->
    # its layers, and its final norm and head, as that step's kernel takes them
    # (`pallas_kernels.decoder_step.DecoderLayer`, `DecoderHead`).
    decoder_shape: Callable[[Any], DecoderShape] | None = None
    decoder_layers: Callable[..., list[DecoderLayer]] | None = None
    decoder_head: Callable[..., DecoderHead] | None = None
    # (params, config, token, position) -> that step's h before the layers and its RoPE angles.
    one_kernel_inputs: Callable[..., tuple] | None = None


_LLAMA = ModelFamily(
    config_from_hf=llama_config.LlamaConfig.from_hf_dict,
    presets=llama_config.PRESETS,
    skip_tensor=llama_weights.skip_tensor,
    params_from_tensors=llama_weights.params_from_tensors,
    random_params=llama_weights.random_params,
    forward=llama_model.forward,
    shard_layout=llama_model.shard_layout,
    # Each batch its own bucket: the split-K decode attention sizes its splits from the rows a
    # program holds (one 32k-token row: 2.87 ms/step in a 1-row program, 13.6 padded to 16; H100).
    gpu_min_decode_batch=1,
    decoder_shape=llama_model.decoder_shape,
    decoder_layers=llama_model.decoder_layers,
    decoder_head=llama_model.decoder_head,
    one_kernel_inputs=llama_model.one_kernel_inputs,
)

FAMILIES: dict[str, ModelFamily] = {
    "gpt2": ModelFamily(
        config_from_hf=gpt2_config.GPT2Config.from_hf_dict,
        presets=gpt2_config.PRESETS,
        skip_tensor=gpt2_weights.skip_tensor,
        params_from_tensors=gpt2_weights.params_from_tensors,
        random_params=gpt2_weights.random_params,
        forward=gpt2_model.forward,
        shard_layout=gpt2_model.shard_layout,
        gpu_min_decode_batch=DEFAULT_GPU_MIN_DECODE_BATCH,
        decoder_shape=gpt2_model.decoder_shape,
        decoder_layers=gpt2_model.decoder_layers,
        decoder_head=gpt2_model.decoder_head,
        one_kernel_inputs=gpt2_model.one_kernel_inputs,
    ),
    **{model_type: _LLAMA for model_type in llama_config.MODEL_TYPES},
}
SUPPORTED_MODEL_TYPES = ", ".join(FAMILIES)  # for messages and --help


def family(model_type: str) -> ModelFamily:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not supported; rosejax serves {SUPPORTED_MODEL_TYPES}"
        ) from None


def family_of(config: Any) -> ModelFamily:
    return family(config.model_type)


def preset(name: str) -> Any:
    """The config of `random:<name>`, searched over every family's presets."""
    for fam in FAMILIES.values():
        if name in fam.presets:
            return fam.presets[name]
    known = ", ".join(dict.fromkeys(n for fam in FAMILIES.values() for n in fam.presets))
    raise ValueError(f"unknown preset {name!r}; known: {known}")


def eos_token_ids(config: Any) -> tuple[int, ...]:
    """The ids that end a generation: a config's `eos_token_id`, one id, a sequence or None."""
    eos = config.eos_token_id
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)


def with_eos_token_ids(config: Any, ids: tuple[int, ...]) -> Any:
    """`config` whose eos ids are `ids` (a family that keeps one id gets a tuple only if needed)."""
    if not ids or ids == eos_token_ids(config):
        return config
    return dataclasses.replace(config, eos_token_id=ids[0] if len(ids) == 1 else tuple(ids))


def with_context_len(config: Any, n: int) -> Any:
    """`config` serving contexts of at most `n` tokens (the KV cache, block tables and prefill
    buckets follow `max_model_len`)."""
    if n >= config.max_model_len:
        return config
    if not hasattr(config, "with_context_len"):
        raise ValueError(f"max_model_len cannot be lowered for {config.model_type} models")
    return config.with_context_len(n)


# The widest model auto gives the one-kernel step (Llama 3.2 1B's 2,048). At Llama 3.1 8B's 4,096
# it matches its reference on an H100 but takes the per-op step's time (weights dominate): set only.
AUTO_MAX_HIDDEN = 2048


def one_kernel_step_programs(
    config: Any,
    dtype: Any,
    kernels: Any,
    *,
    block_size: int,
    max_batch_size: int,
    device: Any,
) -> int:
    """`kernels.decoder_step_programs` resolved for an engine of this model on `device` (None:
    on several devices). Set, it must run (else a ValueError: what keeps it from running); 0:
    off; None (auto): the GPU's SMs where every decode step is one row (max_batch_size 1), the
    family has the step, its hidden width is one the kernel has run on a GPU (AUTO_MAX_HIDDEN)
    and the kernel runs the model there with 4 weight stages, else 0 (measured on an H100 for
    Qwen3-0.6B and GPT-2: docs/performance-log.md)."""
    programs = kernels.decoder_step_programs
    shape_of = family_of(config).decoder_shape
    if programs is None:
        sms = getattr(device, "core_count", 0)  # a GPU's SMs; a CPU's device has none
        if not sms or device.platform == "cpu" or max_batch_size != 1 or shape_of is None:
            return 0
        auto = dataclasses.replace(kernels, decoder_step_programs=sms)
        shape = shape_of(config)
        if shape.hidden > AUTO_MAX_HIDDEN:
            return 0
        # Auto where 4 weight stages fit: the models timed (fewer stages are not timed).
        problems = one_kernel_step_problems(shape, dtype, block_size, auto, device, STAGES[0])
        return 0 if problems else sms
    if programs:
        if shape_of is None or device is None:
            raise ValueError(
                "decoder_step_programs: the one-kernel decode step runs GPT-2 and Llama-family "
                "models on one device"
            )
        if found := one_kernel_step_problems(shape_of(config), dtype, block_size, kernels, device):
            raise ValueError("decoder_step_programs: " + "; ".join(found))
    return programs
