"""The host's block manager: hands out KV-cache blocks (free list, reference counts,
copy-on-write of a shared partial block, prefix hashes). Host only: the pages live in
`rosejax.layers.kv_cache`.

Block 0 is scratch: padded rows write there, so it is never handed out.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable, Sequence

SCRATCH_BLOCK = 0
_ROOT = -1  # parent hash of a sequence's first block
_NO_HASH = -1  # _block_hash entry of a block that is not in the prefix cache


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class NoFreeBlocksError(RuntimeError):
    """Not enough free blocks; the allocator's state is unchanged."""


class BlockTable:
    """One sequence's blocks. `num_tokens` counts tokens recorded; blocks may hold reserved room."""

    __slots__ = ("blocks", "num_tokens", "last_hash", "partial")

    def __init__(self, blocks: list[int], num_tokens: int, last_hash: int, partial: list[int]):
        self.blocks = blocks
        self.num_tokens = num_tokens  # -1 once freed
        self.last_hash = last_hash  # chained hash of the last full block (_ROOT if none)
        self.partial = partial  # token ids of the partial block (prefix caching only)

    def __repr__(self) -> str:
        return f"BlockTable(blocks={self.blocks}, num_tokens={self.num_tokens})"


@dataclasses.dataclass(frozen=True)
class PromptPlan:
    """`BlockAllocator.probe`'s answer for one prompt."""

    tokens: list[int]
    hashes: list[int]  # chained hashes of its full blocks
    hits: list[int]  # cached blocks of its leading full blocks
    num_cached: int  # leading tokens whose KV those blocks hold
    need: int  # free blocks allocating it takes


def _chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    # Python's hash is fast and deterministic for ints, but not collision-resistant: swap in
    # hashlib here before sharing a cache between mutually untrusted users.
    return hash((parent, tokens))


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of `tokens`: the keys of the prefix cache (a
    replica router keys its prefix affinity by them too)."""
    h, out = _ROOT, []
    for i in range(len(tokens) // block_size):
        h = _chain_hash(h, tuple(tokens[i * block_size : (i + 1) * block_size]))
        out.append(h)
    return out


class BlockAllocator:
    """Free list, reference counts and prefix cache over blocks 1..num_blocks-1. Host only.

    Freed blocks that carry a prefix hash stay findable until reused (least recently freed first;
    blocks without a hash are reused before any hashed one). Prompt blocks are registered at
    `allocate`, before their KV is written: a step must write all its rows' KV before any row's
    attention reads the cache, as writing then attending per layer does.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 2 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._block_hash = [_NO_HASH] * num_blocks
        self._cached: dict[int, int] = {}  # chained hash -> block
        # Insertion-ordered free set: O(1) pop from the front, removal of a revived cached block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.prefix_hits = 0  # blocks served from the prefix cache
        self.prefix_hit_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.prompt_tokens = 0  # prompt tokens allocated, for the hit rate

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    # -- allocation ------------------------------------------------------------------------------

    def _match(self, tokens: list[int], hashes: list[int]) -> list[int]:
        """Cached blocks for the leading full blocks, leaving the last token to compute."""
        hits = []
        for h in hashes[: (len(tokens) - 1) // self.block_size]:
            b = self._cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def probe(self, token_ids: Sequence[int]) -> PromptPlan:
        """What `allocate` would do for this prompt now: its cached prefix, the free blocks it
        needs, and the work `allocate(token_ids, plan)` can reuse if nothing is allocated or
        freed between."""
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise ValueError("cannot allocate an empty prompt")
        hashes = block_hashes(tokens, self.block_size) if self.enable_prefix_caching else []
        hits = self._match(tokens, hashes)
        # Revived hits (refcount 0) come out of the free list as well as fresh blocks.
        need = _cdiv(len(tokens), self.block_size) - sum(self._ref[b] > 0 for b in hits)
        return PromptPlan(tokens, hashes, hits, len(hits) * self.block_size, need)

    def fits(self, plan: PromptPlan) -> bool:
        """Whether `allocate(..., plan)` finds enough free blocks now."""
        return plan.need <= len(self._free)

    def can_allocate(self, token_ids: Sequence[int]) -> bool:
        return self.fits(self.probe(token_ids))

    def allocate(
        self,
        token_ids: Sequence[int],
        plan: PromptPlan | None = None,
        register_upto: int | None = None,
    ) -> tuple[BlockTable, int]:
        """Blocks for a prompt -> (table, number of leading tokens whose KV is already cached).
        `plan`: this prompt's `probe`, taken with no allocation or free since (saves hashing
        the prompt again). `register_upto`: enter only the full blocks of the first that many
        tokens in the prefix cache (a prompt prefilled in chunks: the rest are entered by
        `register_prompt_blocks` as the chunks that write them are dispatched)."""
        plan = plan or self.probe(token_ids)
        tokens, hashes, hits = plan.tokens, plan.hashes, plan.hits
        if not self.fits(plan):
            raise NoFreeBlocksError(
                f"prompt of {len(tokens)} tokens needs {plan.need} free "
                f"blocks, {len(self._free)} left"
            )
        for b in hits:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        num_new = _cdiv(len(tokens), self.block_size) - len(hits)
        blocks = hits + [self._take() for _ in range(num_new)]
        upto = len(hashes) if register_upto is None else register_upto // self.block_size
        for i in range(len(hits), min(len(hashes), upto)):
            self._register(blocks[i], hashes[i])
        bs, num_full = self.block_size, len(tokens) // self.block_size
        partial = tokens[num_full * bs :] if self.enable_prefix_caching else []
        table = BlockTable(blocks, len(tokens), hashes[-1] if hashes else _ROOT, partial)
        self.prefix_hits += len(hits)
        self.prefix_hit_tokens += len(hits) * bs
        self.prompt_tokens += len(tokens)
        return table, plan.num_cached

    def register_prompt_blocks(self, table: BlockTable, hashes: list[int], start: int, stop: int):
        """Enter the prompt's full blocks start..stop-1 (`hashes`: the prompt's `probe` hashes)
        in the prefix cache: their KV is written by now (in program order)."""
        for i in range(start, min(stop, len(hashes))):
            self._register(table.blocks[i], hashes[i])

    def _take(self) -> int:
        """A free block, its old prefix hash dropped (the block is about to be overwritten)."""
        b, _ = self._free.popitem(last=False)
        h = self._block_hash[b]
        if h != _NO_HASH:
            del self._cached[h]
            self._block_hash[b] = _NO_HASH
        self._ref[b] = 1
        return b

    def _register(self, block: int, h: int) -> None:
        # A block whose content is already cached elsewhere stays unhashed (reused first).
        if h not in self._cached:
            self._cached[h] = block
            self._block_hash[block] = h

    # -- growth ----------------------------------------------------------------------------------

    def _blocks_needed(self, table: BlockTable, n: int) -> tuple[int, bool]:
        """(free blocks needed for n more tokens, whether the next slot's block needs a COW)."""
        if table.num_tokens < 0:
            raise ValueError("table was freed")
        idx = table.num_tokens // self.block_size
        cow = n > 0 and idx < len(table.blocks) and self._ref[table.blocks[idx]] > 1
        grow = max(0, _cdiv(table.num_tokens + n, self.block_size) - len(table.blocks))
        return grow + cow, cow

    def can_append(self, table: BlockTable, n: int = 1) -> bool:
        """Whether room for n more tokens (append n times, or reserve(table, n)) fits now."""
        return self._blocks_needed(table, n)[0] <= len(self._free)

    def reserve(self, table: BlockTable, n: int) -> tuple[int, int]:
        """Ensure room for n more tokens, so the next n `append`s never allocate or copy.

        Returns (cow_src, cow_dst): the caller must copy block cow_src into cow_dst before
        writing, or (-1, -1) when no copy-on-write happened. A later `fork` undoes the guarantee.
        """
        need, cow = self._blocks_needed(table, n)
        if need > len(self._free):
            raise NoFreeBlocksError(
                f"{n} more tokens need {need} free blocks, {len(self._free)} left"
            )
        src = dst = -1
        if cow:
            idx = table.num_tokens // self.block_size
            src, dst = table.blocks[idx], self._take()
            self._ref[src] -= 1
            table.blocks[idx] = dst
        for _ in range(need - cow):
            table.blocks.append(self._take())
        return src, dst

    def append(self, table: BlockTable, token_id: int) -> tuple[int, int, int]:
        """Record one more token -> (block, offset, cow_src) of its slot.

        cow_src is -1, or the shared partial block the slot's new private block must first be
        copied from. Allocates only on rollover or copy-on-write (never after `reserve`).
        """
        n = table.num_tokens
        if n < 0:
            raise ValueError("table was freed")
        idx, off = divmod(n, self.block_size)
        cow_src = -1
        if idx == len(table.blocks):  # rollover: the last block is full
            if not self._free:
                raise NoFreeBlocksError("no free block for rollover")
            table.blocks.append(self._take())
        elif self._ref[table.blocks[idx]] > 1:  # shared partial block: copy on write
            if not self._free:
                raise NoFreeBlocksError("no free block for copy-on-write")
            cow_src = table.blocks[idx]
            self._ref[cow_src] -= 1
            table.blocks[idx] = self._take()
        self._record(table, [token_id])
        return table.blocks[idx], off, cow_src

    def extend(self, table: BlockTable, token_ids: Sequence[int]) -> None:
        """`append` each of token_ids into room `reserve` made (so nothing allocates or copies),
        the prefix-cache bookkeeping done once per block: a decode window's harvest records
        K tokens for each of up to hundreds of requests. Without that room it is the caller's
        bug, not a full cache: ValueError, and nothing changes."""
        if self._blocks_needed(table, len(token_ids))[0]:
            raise ValueError(f"no room reserved for {len(token_ids)} more tokens")
        self._record(table, token_ids)

    def _record(self, table: BlockTable, token_ids: Sequence[int]) -> None:
        """Count tokens whose slots exist; with prefix caching, every block they fill gets its
        chained hash and becomes findable."""
        start, table.num_tokens = table.num_tokens, table.num_tokens + len(token_ids)
        if not self.enable_prefix_caching:
            return
        bs, done = self.block_size, 0
        while done < len(token_ids):
            take = min(bs - len(table.partial), len(token_ids) - done)
            table.partial.extend(token_ids[done : done + take])
            done += take
            if len(table.partial) == bs:
                table.last_hash = _chain_hash(table.last_hash, tuple(table.partial))
                table.partial.clear()
                self._register(table.blocks[(start + done - 1) // bs], table.last_hash)

    # -- sharing and release ---------------------------------------------------------------------

    def fork(self, table: BlockTable) -> BlockTable:
        """A child sharing every block that holds tokens (not blocks merely reserved)."""
        if table.num_tokens < 0:
            raise ValueError("table was freed")
        blocks = table.blocks[: _cdiv(table.num_tokens, self.block_size)]
        for b in blocks:
            self._ref[b] += 1
        return BlockTable(blocks, table.num_tokens, table.last_hash, list(table.partial))

    def free(self, table: BlockTable) -> None:
        """Drop the table's references; a block at refcount 0 returns to the free list."""
        if table.num_tokens < 0:
            raise ValueError("table was already freed")
        # Tail blocks first, so they are evicted before the prefixes others are likelier to share.
        for b in reversed(table.blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if self._block_hash[b] == _NO_HASH:
                    self._free.move_to_end(b, last=False)
        table.blocks = []
        table.num_tokens = -1
        table.partial.clear()

    def check_invariants(self, tables: Iterable[BlockTable] | None = None) -> None:
        """Assert the bookkeeping is consistent, and matches `tables` (all live ones) if given."""
        assert self._ref[SCRATCH_BLOCK] == 0 and SCRATCH_BLOCK not in self._free
        assert self._block_hash[SCRATCH_BLOCK] == _NO_HASH
        assert len(set(self._free)) == len(self._free)
        for b in range(1, self.num_blocks):
            assert self._ref[b] >= 0, (b, self._ref[b])
            assert (self._ref[b] == 0) == (b in self._free), (b, self._ref[b])
        for h, b in self._cached.items():
            assert self._block_hash[b] == h, (h, b)
        assert sum(h != _NO_HASH for h in self._block_hash) == len(self._cached)
        if tables is None:
            return
        counts = [0] * self.num_blocks
        for t in tables:
            assert t.num_tokens >= 0 and len(t.blocks) * self.block_size >= t.num_tokens, t
            if self.enable_prefix_caching:
                assert len(t.partial) == t.num_tokens % self.block_size, t
            for b in t.blocks:
                counts[b] += 1
        assert counts == self._ref, (counts, self._ref)
