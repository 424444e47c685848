"""The paged KV cache on the device: one K and one V page array per layer (a pytree), and its size.

Layout per layer: k, v [H, num_blocks, block_size, D], the layout jax's Pallas GPU
`paged_attention` reads. Block 0 is scratch: padded rows write there (the host's
`BlockAllocator` never hands it out).
"""

from __future__ import annotations

import os
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@flax.struct.dataclass
class KVCache:
    k: list[jax.Array]  # n_layer x [H, num_blocks, block_size, D]
    v: list[jax.Array]  # n_layer x [H, num_blocks, block_size, D]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[2]


def init_kv_cache(
    config: Any,
    num_blocks: int,
    block_size: int,
    dtype,
    sharding: jax.sharding.Sharding | None = None,
) -> KVCache:
    """Zero-filled pages for every layer; `num_blocks` counts the scratch block. With `sharding`
    (tensor parallelism: split by KV heads), each device allocates only its own shard."""
    if num_blocks < 2 or block_size < 1:
        raise ValueError(
            f"need num_blocks >= 2 (scratch + 1) and block_size >= 1, "
            f"got {num_blocks}, {block_size}"
        )
    shape = (config.num_kv_heads, num_blocks, block_size, config.head_dim)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    k = [zeros() for _ in range(config.num_layers)]
    v = [zeros() for _ in range(config.num_layers)]
    return KVCache(k=k, v=v)


def kv_cache_bytes_per_block(config: Any, block_size: int, dtype, shards: int = 1) -> int:
    """Bytes one block takes across all layers, K and V, on each of `shards` devices that split
    the KV heads."""
    itemsize = np.dtype(dtype).itemsize
    heads = config.num_kv_heads // shards
    return 2 * config.num_layers * heads * block_size * config.head_dim * itemsize


def free_memory_bytes(device: jax.Device | None = None) -> int:
    """Free bytes for the cache: `device`'s (default: the first local device's) allocator pool,
    or, on a CPU (no stats), the host's available memory. An accelerator without stats (XLA's VMM
    allocator, e.g. under `--xla_gpu_command_buffer_update_mode=SKIP_TEMP`) is an error: the
    host's memory says nothing of the device's."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    if device.platform != "cpu":
        raise ValueError(
            f"{device} reports no memory limit to size the KV cache from: give its size with "
            "--kv-cache-tokens"
        )
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_blocks_for(
    config: Any,
    block_size: int,
    dtype,
    *,
    kv_cache_tokens: int | None = None,
    memory_fraction: float | None = None,
    max_num_seqs: int = 1,
    device: jax.Device | None = None,
    shards: int = 1,
) -> int:
    """Total blocks (scratch included) from a token budget or a fraction of free memory.

    A token budget is guaranteed to fit however it is split over `max_num_seqs` sequences: each
    sequence may leave its last block partly empty, so that costs up to max_num_seqs - 1 blocks
    more than ceil(tokens / block_size). A memory budget gives whatever fits, scratch included, and
    must leave at least one block per sequence; the memory is `device`'s (`free_memory_bytes`);
    with `shards` devices splitting the KV heads, each holds 1/shards of a block.
    """
    if block_size < 1 or max_num_seqs < 1:
        raise ValueError(
            f"block_size and max_num_seqs must be >= 1, got {block_size}, {max_num_seqs}"
        )
    if (kv_cache_tokens is None) == (memory_fraction is None):
        raise ValueError("give exactly one of kv_cache_tokens or memory_fraction")
    if kv_cache_tokens is not None:
        if kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be >= 1, got {kv_cache_tokens}")
        return _cdiv(kv_cache_tokens, block_size) + (max_num_seqs - 1) + 1  # + scratch
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    free = free_memory_bytes(device)
    per_block = kv_cache_bytes_per_block(config, block_size, dtype, shards)
    num_blocks = int(free * memory_fraction) // per_block
    if num_blocks - 1 < max_num_seqs:
        raise ValueError(
            f"{memory_fraction} of {free} free bytes holds {num_blocks} blocks of "
            f"{per_block} bytes: not enough for scratch + {max_num_seqs} sequences"
        )
    return num_blocks


def copy_blocks(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """cache[:, dst[i]] = cache[:, src[i]] in every layer (copy-on-write); reads see the old cache.

    src, dst: int32 [N], dst without duplicates. Jit it with donate_argnums=0 to copy in place.
    """
    k = [c.at[:, dst].set(c[:, src]) for c in cache.k]
    v = [c.at[:, dst].set(c[:, src]) for c in cache.v]
    return KVCache(k=k, v=v)
