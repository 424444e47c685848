"""GPT-2 configuration: a frozen dataclass, the hub presets, and loading from an HF config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, ClassVar

_GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    model_type: ClassVar[str] = "gpt2"

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # None means 4 * n_embd, as in HF
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    bos_token_id: int = 50256
    eos_token_id: int = 50256
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPT2Config.{name} must be a positive integer, got {value!r}")
        if self.n_inner is not None and (not isinstance(self.n_inner, int) or self.n_inner <= 0):
            raise ValueError(
                f"GPT2Config.n_inner must be a positive integer or None, got {self.n_inner!r}"
            )
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPT2Config.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not self.layer_norm_epsilon > 0:
            raise ValueError(
                f"GPT2Config.layer_norm_epsilon must be positive, got {self.layer_norm_epsilon!r}"
            )
        if self.activation_function not in _GPT2_ACTIVATIONS:
            raise ValueError(
                f"GPT2Config.activation_function must be GPT-2's tanh GELU {_GPT2_ACTIVATIONS}, "
                f"got {self.activation_function!r}"
            )

    # The names every family's config gives the engine and the KV cache.
    @property
    def num_layers(self) -> int:
        return self.n_layer

    def with_num_layers(self, n: int) -> GPT2Config:
        """This config's first `n` layers (benchmarks and tests of a model's widths)."""
        return dataclasses.replace(self, n_layer=n)

    @property
    def num_heads(self) -> int:
        return self.n_head

    @property
    def num_kv_heads(self) -> int:
        return self.n_head

    @property
    def max_model_len(self) -> int:
        return self.n_positions

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_dim(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the params' wte: the vocabulary rounded up to a multiple of 128. With GPT-2's
        50,257 rows, cuBLAS needs an aligned LM head and XLA padded the whole 77 MB matrix again
        inside every decode step; padded once at load, it is not."""
        return -(-self.vocab_size // 128) * 128

    def num_params(self) -> int:
        e, f = self.n_embd, self.mlp_dim
        per_layer = 4 * e + (e * 3 * e + 3 * e) + (e * e + e) + (e * f + f) + (f * e + e)
        return self.vocab_size * e + self.n_positions * e + self.n_layer * per_layer + 2 * e

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> GPT2Config:
        model_type = d.get("model_type", "gpt2")
        if model_type != "gpt2":
            raise ValueError(f"config.json: model_type must be 'gpt2', got {model_type!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in fields}
        # HF writes null for GPT-2's special tokens in some checkpoints; keep GPT-2's defaults then.
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k == "n_inner"})

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> GPT2Config:
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))


PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(),
    "gpt2-medium": GPT2Config(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": GPT2Config(n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": GPT2Config(n_embd=1600, n_layer=48, n_head=25),
    "distilgpt2": GPT2Config(n_layer=6),
    # Small enough for CPU tests, with the real vocab so the GPT-2 tokenizer fits it.
    "tiny": GPT2Config(n_positions=128, n_embd=64, n_layer=2, n_head=4),
}
