"""Pallas kernels for rosejax (Triton-lowered on GPU, interpreted on CPU)."""

from pallas_kernels.kv_append import (
    kv_append,
    kv_append_full_batch,
    kv_append_generic,
    kv_append_identity_pos,
    kv_append_reference,
    select_kv_append_variant,
)

__all__ = [
    "kv_append",
    "kv_append_full_batch",
    "kv_append_generic",
    "kv_append_identity_pos",
    "kv_append_reference",
    "select_kv_append_variant",
]
