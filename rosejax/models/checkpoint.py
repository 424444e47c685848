"""What every family checks of a checkpoint before building its params: the tensors its config
needs, by Hugging Face name, and their shapes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check_tensors(
    named: Mapping[str, Any],  # HF name -> array (anything with a shape)
    expected: Mapping[str, tuple[int, ...]],  # HF name -> shape, from the config
    model: str,  # how the errors name the config: "GPT-2", "qwen3", ...
) -> None:
    """ValueError naming the first tensor missing, unexpected or of another shape."""
    missing = [n for n in expected if n not in named]
    if missing:
        raise ValueError(f"checkpoint is missing tensor {missing[0]!r} ({len(missing)} missing)")
    unexpected = [n for n in named if n not in expected]
    if unexpected:
        raise ValueError(
            f"checkpoint has unexpected tensor {unexpected[0]!r} for this {model} config"
        )
    for name, shape in expected.items():
        if tuple(named[name].shape) != shape:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(named[name].shape)}, expected {shape} "
                "from the config"
            )
