"""jax's persistent compilation cache, made safe for processes that share it.

jax (0.10 and 0.11) writes a cache entry straight to the path its readers look at, with no lock
unless eviction is on. A process that reads an entry while another is still writing it (two
engine processes, an API server and its engine, pytest-xdist workers compiling the same program)
gets a torn executable, and XLA segfaulted deserializing one. `write_entries_whole` makes each
entry appear whole: written to a file of its own, then renamed over the entry's path (atomic on
POSIX), so a reader sees no entry or all of it.
"""

from __future__ import annotations

import os

from jax._src import lru_cache

_write_in_place = lru_cache.LRUCache.put


def _put_whole(self: lru_cache.LRUCache, key: str, value: bytes) -> None:
    """`LRUCache.put`, through a file of this process's renamed into place."""
    if self.eviction_enabled or not key:  # with eviction jax locks its reads and writes
        _write_in_place(self, key, value)
        return
    entry = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
    if entry.exists():
        return
    partial = self.path / f"{key}.{os.getpid()}.partial"
    partial.write_bytes(value)
    partial.replace(entry)


def write_entries_whole() -> None:
    """From now on this process writes jax's cache entries whole (idempotent)."""
    lru_cache.LRUCache.put = _put_whole
