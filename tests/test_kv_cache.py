"""KV cache pages and the host BlockAllocator: property tests over random verb sequences."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from rosejax.engine.block_manager import SCRATCH_BLOCK, BlockAllocator, NoFreeBlocksError
from rosejax.layers import kv_cache
from rosejax.layers.kv_cache import (
    KVCache,
    copy_blocks,
    init_kv_cache,
    kv_cache_bytes_per_block,
    num_blocks_for,
)
from rosejax.models import preset

VOCAB = 2  # a tiny vocabulary makes equal prefixes, hence prefix-cache hits, common


def _state(alloc: BlockAllocator) -> tuple:
    """Everything allocation may change, to check that a failed call changed nothing."""
    return (
        list(alloc._ref),
        list(alloc._free),
        dict(alloc._cached),
        list(alloc._block_hash),
        alloc.prefix_hits,
        alloc.prefix_hit_tokens,
        alloc.prompt_tokens,
    )


def _table_state(table) -> tuple:
    return list(table.blocks), table.num_tokens, table.last_hash, list(table.partial)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / append / reserve / fork / free against a fake cache whose "KV" at each
    slot is the token id written there: every live sequence must read back exactly its tokens
    through its block table, which catches a wrong prefix hit, a missed copy-on-write or a write
    into a block someone else still reads."""

    @initialize(
        num_blocks=st.integers(2, 24), block_size=st.integers(1, 4), prefix_caching=st.booleans()
    )
    def setup(self, num_blocks, block_size, prefix_caching):
        self.alloc = BlockAllocator(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.bs = block_size
        self.content = [[None] * block_size for _ in range(num_blocks)]
        self.seqs: dict[int, tuple] = {}  # id -> (table, token ids)
        self.reserved: dict[int, int] = {}  # id -> appends left that `reserve` guaranteed
        self.next_id = 0

    def _add(self, table, tokens) -> None:
        self.seqs[self.next_id] = (table, tokens)
        self.reserved[self.next_id] = 0
        self.next_id += 1

    def _write(self, block, off, token) -> None:
        assert block != SCRATCH_BLOCK
        assert self.alloc._ref[block] == 1, "write into a shared block"
        self.content[block][off] = token

    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
    def allocate(self, tokens):
        can, before = self.alloc.can_allocate(tokens), _state(self.alloc)
        try:
            table, cached = self.alloc.allocate(tokens)
        except NoFreeBlocksError:
            assert not can and _state(self.alloc) == before
            return
        assert can
        assert cached % self.bs == 0 and 0 <= cached < len(tokens)
        if not self.alloc.enable_prefix_caching:
            assert cached == 0
        assert len(table.blocks) == -(-len(tokens) // self.bs)
        for i in range(cached):  # a prefix hit must already hold these tokens
            assert self.content[table.blocks[i // self.bs]][i % self.bs] == tokens[i]
        for i in range(cached, len(tokens)):
            self._write(table.blocks[i // self.bs], i % self.bs, tokens[i])
        self._add(table, list(tokens))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, VOCAB - 1))
    def append(self, data, token):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        table, tokens = self.seqs[sid]
        idx = table.num_tokens // self.bs
        shared = idx < len(table.blocks) and self.alloc._ref[table.blocks[idx]] > 1
        old_block = table.blocks[idx] if idx < len(table.blocks) else None
        can, before, tbefore = self.alloc.can_append(table), _state(self.alloc), _table_state(table)
        free_before = self.alloc.num_free_blocks
        try:
            block, off, cow = self.alloc.append(table, token)
        except NoFreeBlocksError:
            assert not can and _state(self.alloc) == before and _table_state(table) == tbefore
            return
        assert can and off == len(tokens) % self.bs and block == table.blocks[idx]
        # Copy-on-write exactly when the slot's block is shared, and then it is partial.
        assert (cow != -1) == shared
        if cow != -1:
            assert cow == old_block and off > 0 and block != cow
            self.content[block] = list(self.content[cow])
        if self.reserved[sid]:
            assert cow == -1 and self.alloc.num_free_blocks == free_before
            self.reserved[sid] -= 1
        self._write(block, off, token)
        tokens.append(token)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(0, 6))
    def reserve(self, data, n):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        table, _ = self.seqs[sid]
        can, before, tbefore = (
            self.alloc.can_append(table, n),
            _state(self.alloc),
            _table_state(table),
        )
        try:
            src, dst = self.alloc.reserve(table, n)
        except NoFreeBlocksError:
            assert not can and _state(self.alloc) == before and _table_state(table) == tbefore
            return
        assert can and len(table.blocks) * self.bs >= table.num_tokens + n
        if src != -1:
            assert dst == table.blocks[table.num_tokens // self.bs] and table.num_tokens % self.bs
            self.content[dst] = list(self.content[src])
        self.reserved[sid] = n

    @precondition(lambda self: any(self.reserved.values()))
    @rule(data=st.data())
    def extend(self, data):
        sid = data.draw(st.sampled_from(sorted(s for s, n in self.reserved.items() if n)))
        table, tokens = self.seqs[sid]
        new = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=self.reserved[sid]))
        start, free_before = table.num_tokens, self.alloc.num_free_blocks
        self.alloc.extend(table, new)
        assert self.alloc.num_free_blocks == free_before  # reserved room: nothing allocated
        for i, token in enumerate(new, start):
            self._write(table.blocks[i // self.bs], i % self.bs, token)
        tokens.extend(new)
        self.reserved[sid] -= len(new)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 6))
    def extend_past_room(self, data, n):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        table, _ = self.seqs[sid]
        if self.alloc._blocks_needed(table, n)[0] == 0:
            return  # there is room (a partial private block, or reserved)
        before, tbefore = _state(self.alloc), _table_state(table)
        with pytest.raises(ValueError, match="no room reserved"):
            self.alloc.extend(table, [0] * n)
        assert _state(self.alloc) == before and _table_state(table) == tbefore

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        table, tokens = self.seqs[sid]
        child = self.alloc.fork(table)
        assert child.blocks == table.blocks[: len(child.blocks)]
        self.reserved[sid] = 0  # the parent's next slot may be shared now
        self._add(child, list(tokens))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        table, _ = self.seqs.pop(sid)
        del self.reserved[sid]
        self.alloc.free(table)
        with pytest.raises(ValueError):
            self.alloc.free(table)

    @invariant()
    def consistent(self):
        tables = [t for t, _ in self.seqs.values()]
        self.alloc.check_invariants(tables)
        assert self.alloc.num_free_blocks + self.alloc.num_used_blocks == self.alloc.num_blocks - 1
        for table, tokens in self.seqs.values():
            assert SCRATCH_BLOCK not in table.blocks and table.num_tokens == len(tokens)
            bs = self.bs
            assert [
                self.content[table.blocks[i // bs]][i % bs] for i in range(len(tokens))
            ] == tokens

    def teardown(self):
        if not hasattr(self, "alloc"):
            return
        for table, _ in self.seqs.values():
            self.alloc.free(table)
        self.alloc.check_invariants([])
        assert self.alloc.num_free_blocks == self.alloc.num_blocks - 1
        assert self.alloc.num_used_blocks == 0


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------------------- allocator, targeted


@given(
    bs=st.integers(1, 8),
    length=st.integers(1, 30),
    prefix_caching=st.booleans(),
    via_reserve=st.booleans(),
)
def test_cow_exactly_when_shared_block_is_partial(bs, length, prefix_caching, via_reserve):
    alloc = BlockAllocator(64, bs, enable_prefix_caching=prefix_caching)
    parent, _ = alloc.allocate([7] * length)
    child = alloc.fork(parent)
    last = parent.blocks[-1]
    partial = length % bs != 0
    if via_reserve:
        src, dst = alloc.reserve(parent, 3)
        assert (src, dst) == ((last, parent.blocks[length // bs]) if partial else (-1, -1))
        assert alloc.append(parent, 1)[2] == -1
    else:
        block, off, cow = alloc.append(parent, 1)
        assert cow == (last if partial else -1) and off == length % bs
        assert block != last
    # The parent let go of the partial block: the child now owns it alone and writes in place.
    block, _, cow = alloc.append(child, 2)
    assert cow == -1 and (block == last) == partial
    alloc.check_invariants([parent, child])


@given(bs=st.integers(1, 4), full=st.integers(1, 4), data=st.data(), prefix_caching=st.booleans())
def test_equal_prefixes_share_blocks_changed_ones_do_not(bs, full, data, prefix_caching):
    extra = data.draw(st.integers(1, bs))  # >= 1 token past the full blocks: all may be cached
    tokens = data.draw(
        st.lists(st.integers(0, 1000), min_size=full * bs + extra, max_size=full * bs + extra)
    )
    change = data.draw(st.none() | st.integers(0, len(tokens) - 1))
    other = list(tokens)
    if change is not None:
        other[change] += 1
    alloc = BlockAllocator(64, bs, enable_prefix_caching=prefix_caching)
    a, cached_a = alloc.allocate(tokens)
    b, cached_b = alloc.allocate(other)
    shared = full if change is None else min(full, change // bs)
    if not prefix_caching:
        shared = 0
    assert cached_a == 0 and cached_b == shared * bs
    assert b.blocks[:shared] == a.blocks[:shared]
    assert not set(b.blocks[shared:]) & set(a.blocks)
    assert alloc.prefix_hits == shared and alloc.prefix_hit_tokens == shared * bs
    assert alloc.prompt_tokens == 2 * len(tokens)
    alloc.check_invariants([a, b])


@given(
    bs=st.integers(1, 8),
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
    windows=st.lists(
        st.tuples(st.lists(st.integers(0, VOCAB - 1), max_size=12), st.integers(0, 4)), max_size=6
    ),
    prefix_caching=st.booleans(),
)
def test_extend_is_append_per_token(bs, prompt, windows, prefix_caching):
    # Two allocators fed the same: one extends by windows, one appends token by token. Each
    # holds two tables of the same prompt, so equal blocks fill twice (the second stays
    # unhashed), and reserves more than the window (the engine reserves what is in flight too).
    allocs = [BlockAllocator(256, bs, prefix_caching) for _ in range(2)]
    tables = [[a.allocate(prompt)[0] for _ in range(2)] for a in allocs]
    for window, extra in windows:
        for a, pair in zip(allocs, tables, strict=True):
            for t in pair:
                a.reserve(t, len(window) + extra)
        for t in tables[0]:
            allocs[0].extend(t, window)
        for t in tables[1]:
            for token in window:
                allocs[1].append(t, token)
        assert _state(allocs[0]) == _state(allocs[1])
        for t0, t1 in zip(tables[0], tables[1], strict=True):
            assert _table_state(t0) == _table_state(t1)


@pytest.mark.parametrize("bs", [1, 2, 5])
def test_last_prompt_token_is_always_recomputed(bs):
    alloc = BlockAllocator(32, bs)
    a, _ = alloc.allocate(list(range(2 * bs)))
    b, cached = alloc.allocate(list(range(2 * bs)))
    assert cached == bs  # not 2 * bs: the engine needs the last token's logits
    assert b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1]
    c, cached = alloc.allocate(list(range(bs)))
    assert cached == 0 and c.blocks[0] != a.blocks[0]


def test_block_filled_by_decode_is_registered():
    alloc = BlockAllocator(8, 2)
    a, _ = alloc.allocate([1])
    alloc.append(a, 2)  # fills block 0 of a
    b, cached = alloc.allocate([1, 2, 5])
    assert cached == 2 and b.blocks[0] == a.blocks[0]


def test_freed_blocks_stay_findable_until_reused():
    alloc = BlockAllocator(1 + 3, 2)
    a, _ = alloc.allocate([1, 2, 5])  # a full block (cached) and a partial one
    c, _ = alloc.allocate([9])
    hashed = a.blocks[0]
    alloc.free(a)
    alloc.free(c)
    # Blocks without a hash are reused first, even those freed after the cached one.
    tmp, _ = alloc.allocate([7, 7, 7])
    assert hashed not in tmp.blocks
    alloc.free(tmp)
    b, cached = alloc.allocate([1, 2, 3])
    assert cached == 2 and b.blocks[0] == hashed
    alloc.free(b)
    big, _ = alloc.allocate([5, 6, 7, 8, 9, 10])  # every block, the cached one too
    assert hashed in big.blocks
    alloc.free(big)
    d, cached = alloc.allocate([1, 2, 3])
    assert cached == 0
    alloc.check_invariants([d])


def test_can_allocate_counts_prefix_hits_and_allocate_is_atomic():
    alloc = BlockAllocator(1 + 4, 2)
    a, _ = alloc.allocate([1, 2, 3, 4, 5])  # 3 blocks, two of them full and cached
    assert alloc.num_free_blocks == 1
    assert alloc.can_allocate([1, 2, 3, 4, 6])  # needs 3 blocks, 2 are hits
    assert not alloc.can_allocate([1, 2, 9, 9, 9])  # needs 3, 1 hit
    before = _state(alloc)
    with pytest.raises(NoFreeBlocksError):
        alloc.allocate([1, 2, 9, 9, 9])
    assert _state(alloc) == before
    b, cached = alloc.allocate([1, 2, 3, 4, 6])
    assert cached == 4 and alloc.num_free_blocks == 0
    alloc.check_invariants([a, b])


def test_append_reserve_fail_atomically():
    alloc = BlockAllocator(1 + 2, 2)
    a, _ = alloc.allocate([1, 2, 3])  # both blocks, the last one partial
    child = alloc.fork(a)
    before, tbefore = _state(alloc), _table_state(a)
    assert not alloc.can_append(a)
    for call in (lambda: alloc.append(a, 4), lambda: alloc.reserve(a, 1)):
        with pytest.raises(NoFreeBlocksError):
            call()  # copy-on-write needs a block
        assert _state(alloc) == before and _table_state(a) == tbefore
    alloc.free(child)
    assert alloc.append(a, 4) == (a.blocks[1], 1, -1)
    with pytest.raises(NoFreeBlocksError):
        alloc.append(a, 5)  # rollover needs a block
    with pytest.raises(NoFreeBlocksError):
        alloc.reserve(a, 1)
    assert alloc.reserve(a, 0) == (-1, -1)


def test_scratch_block_is_never_handed_out():
    alloc = BlockAllocator(9, 4)
    tables = [alloc.allocate([i])[0] for i in range(8)]
    assert not alloc.can_allocate([0]) and alloc.num_free_blocks == 0
    assert sorted(t.blocks[0] for t in tables) == list(range(1, 9))


def test_freed_table_is_dead():
    alloc = BlockAllocator(4, 2)
    a, _ = alloc.allocate([1])
    alloc.free(a)
    for call in (
        alloc.free,
        alloc.fork,
        lambda t: alloc.append(t, 1),
        lambda t: alloc.reserve(t, 1),
    ):
        with pytest.raises(ValueError):
            call(a)


def test_append_updates_in_place():
    alloc = BlockAllocator(16, 4)
    a, _ = alloc.allocate([1, 2])
    blocks, partial = a.blocks, a.partial
    for t in range(20):
        alloc.append(a, t)
    assert a.blocks is blocks and a.partial is partial


@pytest.mark.parametrize("bad", [(1, 4), (4, 0)])
def test_allocator_rejects_nonsense(bad):
    with pytest.raises(ValueError):
        BlockAllocator(*bad)
    with pytest.raises(ValueError):
        BlockAllocator(4, 2).allocate([])


# ---------------------------------------------------------------------------------- device side


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_init_kv_cache_shapes_and_dtypes(dtype):
    config = preset("tiny")
    cache = init_kv_cache(config, 5, 8, dtype)
    assert len(cache.k) == len(cache.v) == config.n_layer
    assert len(jax.tree.leaves(cache)) == 2 * config.n_layer
    for x in cache.k + cache.v:
        assert x.shape == (config.n_head, 5, 8, config.head_dim) and x.dtype == dtype
        assert not np.asarray(x, np.float32).any()
    assert cache.block_size == 8  # the block count is in the shapes above
    nbytes = sum(x.nbytes for x in jax.tree.leaves(cache))
    assert nbytes == 5 * kv_cache_bytes_per_block(config, 8, dtype)
    with pytest.raises(ValueError):
        init_kv_cache(config, 1, 8, dtype)


_copy_blocks_jit = jax.jit(copy_blocks)


@settings(max_examples=15, deadline=None)
@given(num_blocks=st.integers(2, 8), data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_copy_blocks_copies_exactly_the_named_blocks(num_blocks, data, seed):
    dst = data.draw(
        st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=num_blocks, unique=True)
    )
    src = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=len(dst), max_size=len(dst)))
    rng = np.random.default_rng(seed)
    shape = (2, num_blocks, 3, 4)  # [H, NB, BS, D]
    k = [rng.standard_normal(shape, np.float32) for _ in range(2)]
    v = [rng.standard_normal(shape, np.float32) for _ in range(2)]
    cache = KVCache(k=[jnp.asarray(x) for x in k], v=[jnp.asarray(x) for x in v])
    out = _copy_blocks_jit(cache, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))
    for old, new in zip(k + v, out.k + out.v, strict=True):
        want = old.copy()
        want[:, dst] = old[:, src]  # reads see the old cache, even where src and dst overlap
        np.testing.assert_array_equal(np.asarray(new), want)


def test_kv_cache_bytes_per_block_gpt2():
    # 2 (K, V) * 12 layers * 768 (= 12 heads * 64) * 64 tokens * 2 bytes
    assert kv_cache_bytes_per_block(preset("gpt2"), 64, jnp.float16) == 2 * 12 * 768 * 64 * 2


@given(tokens=st.integers(1, 5000), bs=st.integers(1, 128), seqs=st.integers(1, 64), data=st.data())
def test_num_blocks_for_token_budget_fits_any_split(tokens, bs, seqs, data):
    n = num_blocks_for(preset("tiny"), bs, jnp.float16, kv_cache_tokens=tokens, max_num_seqs=seqs)
    assert n == -(-tokens // bs) + seqs  # seqs - 1 partial blocks of slack, + scratch
    cuts = sorted(data.draw(st.lists(st.integers(0, tokens), min_size=seqs - 1, max_size=seqs - 1)))
    parts = np.diff([0, *cuts, tokens])
    assert sum(-(-int(p) // bs) for p in parts) <= n - 1


def test_num_blocks_for_exact_values():
    config = preset("gpt2")
    assert num_blocks_for(config, 64, jnp.float16, kv_cache_tokens=1000) == 16 + 1
    assert num_blocks_for(config, 64, jnp.float16, kv_cache_tokens=1024) == 16 + 1
    assert num_blocks_for(config, 64, jnp.float16, kv_cache_tokens=1024, max_num_seqs=4) == 20


class _FakeDevice:
    def __init__(self, stats, platform="gpu"):
        self.stats = stats
        self.platform = platform

    def memory_stats(self):
        return self.stats

    def __str__(self):
        return "FakeDevice"


def test_num_blocks_for_memory_fraction(monkeypatch):
    config = preset("tiny")
    per_block = kv_cache_bytes_per_block(config, 16, jnp.float32)
    stats = {"bytes_limit": 12 * per_block + 7, "bytes_in_use": 2 * per_block}
    monkeypatch.setattr(jax, "local_devices", lambda: [_FakeDevice(stats)])
    assert num_blocks_for(config, 16, jnp.float32, memory_fraction=1.0) == 10
    assert num_blocks_for(config, 16, jnp.float32, memory_fraction=0.5) == 5
    assert num_blocks_for(config, 16, jnp.float32, memory_fraction=0.5, max_num_seqs=4) == 5
    with pytest.raises(ValueError, match="not enough"):
        num_blocks_for(config, 16, jnp.float32, memory_fraction=0.5, max_num_seqs=5)
    # A CPU (no stats) sizes the cache from the host's available memory; a GPU without stats (its
    # VMM allocator) is told to give the size.
    pages = {"SC_AVPHYS_PAGES": 3 * per_block, "SC_PAGE_SIZE": 4}
    monkeypatch.setattr(kv_cache.os, "sysconf", pages.__getitem__)
    monkeypatch.setattr(jax, "local_devices", lambda: [_FakeDevice(None, "cpu")])
    assert num_blocks_for(config, 16, jnp.float32, memory_fraction=0.5) == 6
    monkeypatch.setattr(jax, "local_devices", lambda: [_FakeDevice(None)])
    with pytest.raises(ValueError, match="--kv-cache-tokens"):
        num_blocks_for(config, 16, jnp.float32, memory_fraction=0.5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"kv_cache_tokens": 100, "memory_fraction": 0.5},
        {"kv_cache_tokens": 0},
        {"memory_fraction": 0.0},
        {"memory_fraction": 1.5},
        {"kv_cache_tokens": 100, "max_num_seqs": 0},
    ],
)
def test_num_blocks_for_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        num_blocks_for(preset("tiny"), 16, jnp.float32, **kwargs)
    with pytest.raises(ValueError):
        num_blocks_for(preset("tiny"), 0, jnp.float32, kv_cache_tokens=100)
