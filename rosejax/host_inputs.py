"""A program's host inputs in one transfer: small numpy arrays packed into one int32 buffer.

Each numpy argument of a jitted call is a host-to-device copy of its own, which on a GPU host
costs the calling thread tens of microseconds (docs/performance-log.md, "Host inputs in one
transfer"). So the engine packs a prefill's batch and a decode window's table updates into one
buffer, and the program unpacks it by a static layout (slices and bitcasts).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# What a packed array may be: 4-byte types travel by their bits, bools as 0 / 1.
_PACKABLE = ("int32", "uint32", "float32", "bool")

Layout = tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype) per array


def pack(arrays: Mapping[str, np.ndarray]) -> tuple[np.ndarray, Layout]:
    """`arrays` (int32, uint32, float32, bool; any shape, scalars too) in one flat int32
    buffer, in the mapping's order, and its layout (hashable: a jit static argument)."""
    parts, layout = [], []
    for name, value in arrays.items():
        a = np.asarray(value)
        if a.dtype.name not in _PACKABLE:
            raise ValueError(f"{name}: cannot pack {a.dtype} (only {', '.join(_PACKABLE)})")
        layout.append((name, a.shape, a.dtype.name))
        flat = a.reshape(-1)
        parts.append(flat.astype(np.int32) if a.dtype == bool else flat.view(np.int32))
    buffer = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return buffer, tuple(layout)


def unpack(buffer: jax.Array, layout: Layout) -> dict[str, jax.Array]:
    """`pack`'s arrays back from its buffer (inside a program: slices and bitcasts)."""
    out, offset = {}, 0
    for name, shape, dtype in layout:
        size = int(np.prod(shape, dtype=np.int64))
        part = buffer[offset : offset + size].reshape(shape)  # i32
        offset += size
        if dtype == "bool":
            out[name] = part != 0
        elif dtype == "int32":
            out[name] = part
        else:
            out[name] = lax.bitcast_convert_type(part, jnp.dtype(dtype))
    return out
