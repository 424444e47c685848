"""The Llama-style family's configuration: a frozen dataclass (hashable: the compiled programs
take it as a static argument), the presets, and loading from an HF config.json.

What tells the model types apart, as flags: Qwen3's per-head RMSNorm of q and k (`qk_norm`),
Qwen2's q/k/v biases (`qkv_bias`, not `o_bias`), Llama's `attention_bias` (all four) and
`mlp_bias`, tied or untied embeddings, a head dim that is not hidden / heads, and RoPE with
`rope_theta` and, optionally, Llama 3's frequency rule (`rope_type` "llama3"). transformers 5
writes RoPE under `rope_parameters`; older files write `rope_theta` and `rope_scaling`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

MODEL_TYPES = ("llama", "qwen3", "qwen2", "mistral")
ROPE_TYPES = ("default", "llama3")


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = None  # None: as many as query heads (no GQA); filled in
    head_dim: int = None  # None: hidden_size // num_attention_heads; filled in
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"  # or "llama3", with the four fields below
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q/k/v projections (Qwen2; Llama's and Qwen3's attention_bias)
    o_bias: bool = False  # output projection (Llama's and Qwen3's attention_bias)
    mlp_bias: bool = False  # gate/up/down (Llama's mlp_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of each q and k head, before RoPE
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()  # every id that ends a generation
    initializer_range: float = 0.02
    # The longest context the engine serves, if less than max_position_embeddings (the KV cache,
    # block tables and prefill buckets follow it). None: max_position_embeddings.
    context_len: int | None = None

    def __post_init__(self) -> None:
        # HF leaves these out (or null) when they are derived; fill them, the engine reads them.
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None and self.num_attention_heads > 0:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    "LlamaConfig: give head_dim, hidden_size is not a multiple of heads"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"LlamaConfig.model_type must be one of {MODEL_TYPES}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig: {self.num_attention_heads} query heads are not a multiple of "
                f"{self.num_kv_heads} KV heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: RoPE needs an even head_dim, got {self.head_dim}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"RoPE type {self.rope_type!r} is not supported; rosejax runs {ROPE_TYPES}"
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"LlamaConfig.rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if (
            self.context_len is not None
            and not 0 < self.context_len <= self.max_position_embeddings
        ):
            raise ValueError(
                f"context_len must be in [1, {self.max_position_embeddings}], got {self.context_len}"
            )

    # The names every family's config gives the engine and the KV cache.
    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    def with_num_layers(self, n: int) -> LlamaConfig:
        """This config's first `n` layers (benchmarks and tests of a model's widths)."""
        return dataclasses.replace(self, num_hidden_layers=n)

    @property
    def num_heads(self) -> int:
        return self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def max_model_len(self) -> int:
        return self.context_len or self.max_position_embeddings

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding / columns of the LM head: the vocab rounded up to 128."""
        return -(-self.vocab_size // 128) * 128

    def num_params(self) -> int:
        e, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        hq, hkv = self.num_attention_heads, self.num_kv_heads
        attn = e * (hq + 2 * hkv) * d + hq * d * e + (2 * d if self.qk_norm else 0)
        per_layer = attn + 3 * e * f + 2 * e
        head = 0 if self.tie_word_embeddings else self.vocab_size * e
        return self.vocab_size * e + head + self.num_hidden_layers * per_layer + e

    def with_context_len(self, n: int) -> LlamaConfig:
        return dataclasses.replace(self, context_len=min(n, self.max_position_embeddings))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        model_type = d.get("model_type", "llama")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config.json: model_type must be one of {MODEL_TYPES}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: hidden_act {act!r}; rosejax runs SwiGLU with silu")
        heads = d["num_attention_heads"]
        max_pos = d.get("max_position_embeddings", 2048)
        _refuse_sliding_window(d, model_type, max_pos)
        # RoPE: transformers 5's rope_parameters, or the older rope_theta + rope_scaling.
        rope = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or {}
        rope = {**scaling, **rope}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("config.json: partial rotary embeddings are not supported")
        rope_kwargs = {}
        if rope_type == "llama3":
            rope_kwargs = dict(
                rope_factor=float(rope["factor"]),
                rope_low_freq_factor=float(rope["low_freq_factor"]),
                rope_high_freq_factor=float(rope["high_freq_factor"]),
                rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        attention_bias = bool(d.get("attention_bias", False))
        if model_type == "qwen2":  # Qwen2Attention: q/k/v biased, o not
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = attention_bias
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_type=rope_type,
            **rope_kwargs,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=_eos_ids(d.get("eos_token_id")),
            initializer_range=float(d.get("initializer_range", 0.02)),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json's fields (transformers 5 naming) for the same shape: how benchmarks
        build the HF model beside rosejax's."""
        rope: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "llama3":
            rope |= dict(
                factor=self.rope_factor,
                low_freq_factor=self.rope_low_freq_factor,
                high_freq_factor=self.rope_high_freq_factor,
                original_max_position_embeddings=self.rope_original_max_position_embeddings,
            )
        d = dict(
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_id),
            hidden_act="silu",
        )
        if self.model_type in ("llama", "qwen3"):
            d["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            d["mlp_bias"] = self.mlp_bias
        if self.model_type == "mistral":
            d["sliding_window"] = None
        return d

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> LlamaConfig:
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))


def _refuse_sliding_window(d: dict[str, Any], model_type: str, max_pos: int) -> None:
    """rosejax attends over the whole context: a sliding window that could ever bind is refused
    (a window no shorter than the context never does)."""
    window = d.get("sliding_window")
    layer_types = d.get("layer_types") or ()
    uses = d.get("use_sliding_window", model_type == "mistral")
    binding = window is not None and window < max_pos
    if (uses and binding) or any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"config.json: {model_type} with a sliding window ({window}) is not supported; "
            "rosejax attends over the whole context"
        )


PRESETS: dict[str, LlamaConfig] = {
    # Qwen3-0.6B's shape (HF config.json); eos: config's and generation_config's.
    "qwen3-0.6b": LlamaConfig(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        qk_norm=True,
        bos_token_id=151643,
        eos_token_id=(151645, 151643),
    ),
    # Llama-3.2-1B's shape, llama3 RoPE scaling.
    "llama-3.2-1b": LlamaConfig(
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=5e5,
        rope_type="llama3",
        rope_factor=32.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=(128001, 128008, 128009),
    ),
    # Llama-3.1-8B's shape (HF config.json): the tensor-parallel benchmark's model.
    "llama-3.1-8b": LlamaConfig(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=5e5,
        rope_type="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=(128001, 128008, 128009),
    ),
    # Small enough for CPU tests; the GPT-2 vocab so the packaged tokenizer fits it.
    "tiny-qwen3": LlamaConfig(
        model_type="qwen3",
        vocab_size=50257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        rope_theta=1e6,
        tie_word_embeddings=True,
        qk_norm=True,
        eos_token_id=(50256,),
    ),
    "tiny-llama": LlamaConfig(
        model_type="llama",
        vocab_size=50257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=5e5,
        rope_type="llama3",
        rope_factor=32.0,
        rope_original_max_position_embeddings=32,
        eos_token_id=(50256,),
    ),
}
