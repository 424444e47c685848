"""GPT-2 checkpoints (HF hub id or local directory, safetensors) -> params pytree, and random init.

The params pytree mirrors the Flax model in `rosejax.model`:

    {"wte": {"embedding": [V_pad, E]}, "wpe": {"embedding": [P, E]},
     "h_0": {"ln_1": {"scale", "bias"},
             "attn": {"c_attn": {"kernel": [E, 3E], "bias"}, "c_proj": {"kernel": [E, E], "bias"}},
             "ln_2": {...}, "mlp": {"c_fc": {"kernel": [E, F], ...}, "c_proj": {"kernel": [F, E], ...}}},
     ..., "ln_f": {"scale", "bias"}}

HF's GPT-2 uses Conv1D, whose weight is already [in, out]: it maps to a Dense kernel untransposed.
wte gets zero rows up to `config.padded_vocab_size` (V_pad); the model drops their logits.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from rosejax.config import GPT2Config, preset

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# Buffers that hub checkpoints carry beside the weights (the causal mask), and the LM head, which
# GPT-2 ties to wte.
_IGNORED = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$|^lm_head\.weight$")


def resolve_dtype(dtype: str | jnp.dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        return jnp.dtype(DTYPES[dtype])
    dtype = jnp.dtype(dtype)
    if dtype not in [jnp.dtype(d) for d in DTYPES.values()]:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    return dtype


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
    dtype = resolve_dtype(dtype)
    named = {}
    for name, value in tensors.items():
        bare = name.removeprefix("transformer.")
        if _IGNORED.match(bare):
            continue
        named[bare] = value
    expected = param_shapes(config)
    missing = [n for n in expected if n not in named]
    if missing:
        raise ValueError(f"checkpoint is missing tensor {missing[0]!r} ({len(missing)} missing)")
    unexpected = [n for n in named if n not in expected]
    if unexpected:
        raise ValueError(
            f"checkpoint has unexpected tensor {unexpected[0]!r} for this GPT-2 config"
        )
    params: dict = {}
    for name, shape in expected.items():
        value = named[name]
        if tuple(value.shape) != shape:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(value.shape)}, expected {shape} from the config"
            )
        node = params
        *parents, leaf = _param_path(name)
        for key in parents:
            node = node.setdefault(key, {})
        value = jnp.asarray(value, dtype=dtype)
        if name == "wte.weight":  # cast first: no padded float32 copy on the device
            value = jnp.pad(value, ((0, config.padded_vocab_size - shape[0]), (0, 0)))
        node[leaf] = value
    return params


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


def _iter_tensors(files: list[str], dtype: jnp.dtype) -> Iterator[tuple[str, jax.Array]]:
    """Each tensor cast to `dtype` as it is read, so a float32 checkpoint loaded as fp16 never
    holds the whole float32 copy on the device; buffers (attn.bias) are skipped unread."""
    # The flax framework reads bfloat16 too, which plain numpy cannot.
    for path in files:
        with safe_open(path, framework="flax") as f:
            for name in f.keys():
                if not _IGNORED.match(name.removeprefix("transformer.")):
                    yield name, f.get_tensor(name).astype(dtype)


def resolve_model_dir(model: str) -> str:
    """A local directory as is; otherwise a hub id, fetched (or found in the local HF cache)."""
    if os.path.isdir(model):
        return model
    # Hub ids are `name` or `org/name`; anything else is meant as a local path.
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
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


def load_checkpoint(model_dir: str, dtype: str | jnp.dtype = "float32") -> tuple[GPT2Config, dict]:
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"no config.json in {model_dir!r}")
    config = GPT2Config.from_json_file(config_path)
    dtype = resolve_dtype(dtype)
    tensors = dict(_iter_tensors(_safetensors_files(model_dir), dtype))
    return config, params_from_tensors(config, tensors, dtype)


def random_params(config: GPT2Config, seed: int = 0, dtype: str | jnp.dtype = "float32") -> dict:
    """GPT-2's initialisation (normal(0, initializer_range), unit LN), for benchmarks and tests."""
    dtype = resolve_dtype(dtype)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in param_shapes(config).items():
        if ".ln_" in name or name.startswith("ln_f"):
            value = np.ones(shape) if name.endswith("weight") else np.zeros(shape)
        elif name.endswith("bias"):
            value = np.zeros(shape)
        else:
            value = rng.normal(0.0, config.initializer_range, shape)
        tensors[name] = value.astype(np.float32)
    return params_from_tensors(config, tensors, dtype)


def load_model(
    model: str, dtype: str | jnp.dtype = "float32", seed: int = 0
) -> tuple[GPT2Config, dict]:
    """`random:<preset>` (random weights of a preset shape), a local directory, or a hub id."""
    if model.startswith("random:"):
        config = preset(model.removeprefix("random:"))
        return config, random_params(config, seed, dtype)
    return load_checkpoint(resolve_model_dir(model), dtype)
