"""Checkpoints -> (config, params): a hub id or local directory of safetensors (one file or
shards), or `random:<preset>`; the family comes from config.json's `model_type`."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from safetensors import safe_open

from rosejax.models import eos_token_ids, family, preset, with_eos_token_ids
from rosejax.sampling import SamplingParams

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype: str | jnp.dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        return jnp.dtype(DTYPES[dtype])
    dtype = jnp.dtype(dtype)
    if dtype not in [jnp.dtype(d) for d in DTYPES.values()]:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    return dtype


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise ValueError(
        f"no model.safetensors (or model.safetensors.index.json) in {model_dir!r}; "
        "rosejax loads safetensors checkpoints only"
    )


def _iter_tensors(
    files: list[str], dtype: jnp.dtype, skip: Callable[[str], bool]
) -> Iterator[tuple[str, jax.Array]]:
    """Each tensor cast to `dtype` as it is read, so a float32 checkpoint loaded as fp16 never
    holds the whole float32 copy on the device; buffers (attn.bias) are skipped unread."""
    # The flax framework reads bfloat16 too, which plain numpy cannot.
    for path in files:
        with safe_open(path, framework="flax") as f:
            for name in f.keys():
                if not skip(name):
                    yield name, f.get_tensor(name).astype(dtype)


def _is_hub_id(model: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else is meant as a local path."""
    return not (model.startswith((".", "/", "~")) or model.count("/") > 1)


def resolve_model_dir(model: str) -> str:
    """A local directory as is; otherwise a hub id, fetched (or found in the local HF cache)."""
    if os.path.isdir(model):
        return model
    if not _is_hub_id(model):
        raise ValueError(f"model path {model!r} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt"])
    except Exception as e:  # offline, unknown repo, auth: all end the same way for the user
        raise ValueError(
            f"cannot load model {model!r}: it is not a local directory and the Hugging Face hub "
            f"gave {type(e).__name__}. Pass a local checkpoint directory (config.json + "
            "model.safetensors), or 'random:gpt2' (random weights of a preset shape) with "
            "--tokenizer for a tokenizer directory."
        ) from e


def read_generation_config(source: str) -> dict[str, Any] | None:
    """A checkpoint's generation_config.json: `source` a local directory, or a hub id (that file
    alone fetched); None where there is none (or the hub cannot be reached)."""
    path = os.path.join(source, "generation_config.json")
    if not os.path.isdir(source) and _is_hub_id(source):
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(source, "generation_config.json")
        except Exception:  # offline, unknown repo, no such file: no defaults from it
            return None
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def load_checkpoint(model_dir: str, dtype: str | jnp.dtype = "float32") -> tuple[Any, dict]:
    """A `save_pretrained` directory (config.json + safetensors) -> (config, params)."""
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"no config.json in {model_dir!r}")
    with open(config_path) as f:
        hf = json.load(f)
    fam = family(hf.get("model_type", "gpt2"))
    config = fam.config_from_hf(hf)
    # generation_config.json's eos ids (often a list: Llama 3's <|eot_id|>, Qwen3's
    # <|endoftext|>) stop generations too, after config.json's.
    generation = read_generation_config(model_dir)
    if generation is not None:
        more = generation.get("eos_token_id")
        more = () if more is None else (more,) if isinstance(more, int) else tuple(more)
        ids = eos_token_ids(config)
        config = with_eos_token_ids(config, ids + tuple(i for i in more if i not in ids))
    dtype = resolve_dtype(dtype)
    tensors = dict(_iter_tensors(_safetensors_files(model_dir), dtype, fam.skip_tensor))
    return config, fam.params_from_tensors(config, tensors, dtype)


# The fields of a checkpoint's generation config that become its requests' defaults (vLLM's).
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def sampling_defaults(model: str, generation_config: str = "auto") -> dict[str, Any]:
    """vLLM's `--generation-config`: the SamplingParams fields a request leaves out take these
    values. "auto": the SAMPLING_DEFAULT_FIELDS the model's generation_config.json sets (Qwen3:
    temperature 0.6, top_k 20, top_p 0.95; none for a model without one, or random:<preset>);
    "vllm": none; else a directory holding a generation_config.json. ValueError if that
    directory has none or a value is out of range."""
    if generation_config == "vllm" or (generation_config == "auto" and model.startswith("random:")):
        return {}
    source = model if generation_config == "auto" else generation_config
    generation = read_generation_config(source)
    if generation is None:
        if generation_config == "auto":
            return {}
        raise ValueError(f"--generation-config {source!r}: no generation_config.json there")
    defaults = {k: generation[k] for k in SAMPLING_DEFAULT_FIELDS if generation.get(k) is not None}
    SamplingParams(**defaults)  # ValueError now, not at every request
    return defaults


def load_model(model: str, dtype: str | jnp.dtype = "float32", seed: int = 0) -> tuple[Any, dict]:
    """`random:<preset>` (random weights of a preset shape), a local directory, or a hub id."""
    if model.startswith("random:"):
        config = preset(model.removeprefix("random:"))
        return config, family(config.model_type).random_params(config, seed, resolve_dtype(dtype))
    return load_checkpoint(resolve_model_dir(model), dtype)
