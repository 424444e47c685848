"""Checkpoint loading: both HF namings, errors that name the tensor or field, random init."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rosejax.models.gpt2.config import PRESETS, GPT2Config
from rosejax.models.gpt2.weights import param_shapes, random_params
from rosejax.models.loader import load_checkpoint, load_model
from rosejax.sampling import seed_words
from tests.conftest import make_hf_checkpoint

SHAPE = dict(vocab_size=301, n_positions=32, n_embd=48, n_layer=2, n_head=3)


@pytest.fixture
def saved(tmp_path):
    make_hf_checkpoint(
        tmp_path / "saved", seed=int(np.random.default_rng().integers(1 << 16)), **SHAPE
    )
    return tmp_path / "saved"


def rewrite(src, dst, edit):
    """Copy a checkpoint dir, passing its tensors through `edit(dict) -> dict`."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    save_file(edit(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def to_hub_naming(tensors):
    """What hub GPT-2 files look like: no `transformer.` prefix, causal-mask buffers, no lm_head."""
    out = {k.removeprefix("transformer."): v for k, v in tensors.items() if k != "lm_head.weight"}
    p = SHAPE["n_positions"]
    for i in range(SHAPE["n_layer"]):
        out[f"h.{i}.attn.bias"] = np.tril(np.ones((p, p), np.uint8))[None, None]
        out[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    return out


def test_saved_names_have_prefix(saved):
    names = load_file(str(saved / "model.safetensors"))
    assert any(n.startswith("transformer.h.0.") for n in names)


def test_hub_naming_loads_identical_params(saved, tmp_path):
    hub = rewrite(saved, tmp_path / "hub", to_hub_naming)
    _, a = load_checkpoint(str(saved))
    _, b = load_checkpoint(str(hub))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Conv1D weights are [in, out]: they go in untransposed.
    raw = load_file(str(saved / "model.safetensors"))
    np.testing.assert_array_equal(
        np.asarray(a["h_1"]["attn"]["c_attn"]["kernel"]), raw["transformer.h.1.attn.c_attn.weight"]
    )
    # wte: the checkpoint's rows, then zero rows up to the padded vocabulary.
    wte, v = np.asarray(a["wte"]["embedding"]), SHAPE["vocab_size"]
    assert (
        wte.shape == (GPT2Config(**SHAPE).padded_vocab_size, SHAPE["n_embd"]) and wte.shape[0] > v
    )
    np.testing.assert_array_equal(wte[:v], raw["transformer.wte.weight"])
    assert not wte[v:].any()


def test_missing_tensor_is_named(saved, tmp_path):
    bad = rewrite(
        saved, tmp_path / "bad", lambda t: {k: v for k, v in t.items() if "h.1.ln_2.bias" not in k}
    )
    with pytest.raises(ValueError, match=r"missing tensor 'h\.1\.ln_2\.bias'"):
        load_checkpoint(str(bad))


def test_wrong_shape_is_named(saved, tmp_path):
    def shrink(t):
        t["transformer.h.0.mlp.c_fc.weight"] = t["transformer.h.0.mlp.c_fc.weight"][:, :-1]
        return t

    bad = rewrite(saved, tmp_path / "bad", shrink)
    with pytest.raises(ValueError, match=r"'h\.0\.mlp\.c_fc\.weight' has shape"):
        load_checkpoint(str(bad))


def test_unexpected_tensor_is_named(saved, tmp_path):
    def extra(t):
        t["transformer.h.0.attn.extra.weight"] = t["transformer.h.0.ln_1.weight"]
        return t

    bad = rewrite(saved, tmp_path / "bad", extra)
    with pytest.raises(ValueError, match=r"unexpected tensor 'h\.0\.attn\.extra\.weight'"):
        load_checkpoint(str(bad))


def test_bad_config_names_the_field(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["n_head"] = 5  # 48 % 5 != 0
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="n_embd .* divisible by n_head"):
        load_checkpoint(str(saved))


@pytest.mark.parametrize(
    "field,value,pattern",
    [
        ("n_layer", 0, "n_layer must be a positive"),
        ("vocab_size", -3, "vocab_size must be a positive"),
        ("activation_function", "relu", "activation_function"),
        ("layer_norm_epsilon", 0.0, "layer_norm_epsilon"),
    ],
)
def test_config_invariants(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        GPT2Config(**{field: value})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtypes(saved, dtype):
    _, params = load_checkpoint(str(saved), dtype)
    assert {leaf.dtype.name for leaf in jax.tree.leaves(params)} == {dtype}


def test_unknown_paths_and_dtypes(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model("random:tiny", dtype="int8")
    with pytest.raises(ValueError, match="unknown preset"):
        load_model("random:gpt3")


def test_presets_match_hub_shapes():
    assert PRESETS["gpt2"].num_params() == 124_439_808
    assert PRESETS["gpt2-medium"].num_params() == 354_823_168
    assert PRESETS["gpt2-xl"].head_dim == 64 and PRESETS["gpt2-xl"].n_head == 25
    assert PRESETS["gpt2"].padded_vocab_size == 50304


def test_random_params_cover_every_tensor():
    config = PRESETS["tiny"]
    params = random_params(config, seed=1)
    padding = (config.padded_vocab_size - config.vocab_size) * config.n_embd  # zero wte rows
    assert sum(x.size for x in jax.tree.leaves(params)) == config.num_params() + padding
    assert len(jax.tree.leaves(params)) == len(param_shapes(config))


def test_random_params_are_hf_init_drawn_on_the_device_per_seed():
    """normal(0, initializer_range) matrices, unit LN scales, zero biases and padding rows; the
    same seed the same weights, another seed others; made on the default device."""
    config = PRESETS["tiny"]
    seed = int(np.random.default_rng().integers(1 << 30))
    device = jax.devices()[-1]
    with jax.default_device(device):
        params = random_params(config, seed=seed)
    assert {x.devices().pop() for x in jax.tree.leaves(params)} == {device}
    again = random_params(config, seed=seed)
    other = random_params(config, seed=seed + 1)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.dtype == np.float32
    layer = params["h_0"]
    for ln in ("ln_1", "ln_2"):
        np.testing.assert_array_equal(np.asarray(layer[ln]["scale"]), 1.0)
        np.testing.assert_array_equal(np.asarray(layer[ln]["bias"]), 0.0)
    np.testing.assert_array_equal(np.asarray(layer["mlp"]["c_fc"]["bias"]), 0.0)
    wte = np.asarray(params["wte"]["embedding"])
    np.testing.assert_array_equal(wte[config.vocab_size :], 0.0)
    drawn = np.concatenate(
        [wte[: config.vocab_size].ravel(), np.asarray(layer["attn"]["c_attn"]["kernel"]).ravel()]
    )
    assert abs(drawn.mean()) < 0.1 * config.initializer_range
    assert abs(drawn.std() / config.initializer_range - 1) < 0.05
    kernel = np.asarray(layer["attn"]["c_attn"]["kernel"])
    assert not np.array_equal(kernel, np.asarray(other["h_0"]["attn"]["c_attn"]["kernel"]))
    assert not np.array_equal(kernel, np.asarray(params["h_1"]["attn"]["c_attn"]["kernel"]))


def test_random_key_words_are_jax_keys():
    """The host-made key of a seed is `jax.random.key(seed)` in [0, 2**32), and 64-bit seeds
    beyond it keep their high bits."""
    for seed in (0, 1, int(np.random.default_rng().integers(2**32))):
        key = jax.random.key_data(jax.random.key(seed))
        np.testing.assert_array_equal(seed_words(seed), np.asarray(key))
    assert seed_words(2**40 + 3).tolist() == [2**8, 3]


def test_local_dir_from_hf_config(saved):
    config, _ = load_model(str(saved))
    assert config.n_embd == SHAPE["n_embd"] and config.vocab_size == SHAPE["vocab_size"]
    assert os.path.exists(saved / "config.json")
