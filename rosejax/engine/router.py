"""Which data-parallel replica serves a request: the least loaded one, unless a replica that
recently served the prompt's leading blocks (so likely holds their KV in its prefix cache) is not
much busier. Host bookkeeping only: the callers own each replica's load and hand it in.

A load is tokens in flight: each request counts its prompt plus the most tokens it may generate
(`request_cost`) from the moment it is routed until it ends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from rosejax.engine.block_manager import block_hashes

DEFAULT_IMBALANCE = 0.25  # a prefix holder may carry 25% more load than the least loaded replica


def request_cost(prompt_len: int, max_tokens: int, context: int) -> int:
    """Tokens a request may hold at most: its prompt and new tokens, within the context."""
    return max(prompt_len + 1, min(prompt_len + max_tokens, context))


class Router:
    """Routes prompts (token ids) over `num_replicas` replicas by load and prefix affinity.

    It remembers, for the chained hashes of prompts' full blocks (the prefix cache's keys), the
    replicas each was routed to, the `capacity` most recent hashes in all. A prompt goes to the
    replica holding the most of its leading blocks (the less loaded among equals), unless that
    replica's load exceeds the least loaded one's by more than `imbalance` of it plus the prompt
    tokens the hit would save: then to the least loaded one, which holds that prefix from then
    on too, so a popular prefix spreads over replicas as their loads ask. Not thread-safe: one
    thread routes.
    """

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        *,
        capacity: int = 1 << 16,
        imbalance: float = DEFAULT_IMBALANCE,
    ):
        if num_replicas < 1 or block_size < 1 or capacity < 1 or imbalance < 0:
            raise ValueError(
                "need num_replicas, block_size and capacity >= 1 and imbalance >= 0, got "
                f"{num_replicas}, {block_size}, {capacity}, {imbalance}"
            )
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.capacity = capacity
        self.imbalance = imbalance
        # block hash -> replicas it was routed to; least recently routed first
        self._holders: OrderedDict[int, set[int]] = OrderedDict()

    def prefix_blocks(self, prompt_ids: Sequence[int]) -> list[int]:
        """Hashes of the prompt's blocks a prefix cache can serve (its last token is always
        computed, so a block ending with it is not among them)."""
        usable = (len(prompt_ids) - 1) // self.block_size * self.block_size
        return block_hashes(prompt_ids[:usable], self.block_size)

    def held_blocks(self, hashes: Sequence[int]) -> list[int]:
        """How many of these leading blocks each replica holds, in a row from the first."""
        held = [0] * self.num_replicas
        live = set(range(self.num_replicas))
        for h in hashes:
            live &= self._holders.get(h, set())
            if not live:
                break
            for r in live:
                held[r] += 1
        return held

    def route(self, prompt_ids: Sequence[int], loads: Sequence[int]) -> int:
        """The replica for this prompt given each replica's load; remembers that it holds the
        prompt's leading blocks from now on."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"one load per replica ({self.num_replicas}), got {len(loads)}")
        if self.num_replicas == 1:
            return 0
        least = min(range(self.num_replicas), key=lambda r: loads[r])
        hashes = self.prefix_blocks(prompt_ids)
        held = self.held_blocks(hashes)
        holder = max(range(self.num_replicas), key=lambda r: (held[r], -loads[r]))
        saved = held[holder] * self.block_size
        pick = least
        if saved and loads[holder] <= loads[least] * (1 + self.imbalance) + saved:
            pick = holder
        for h in hashes:
            replicas = self._holders.pop(h, set())
            replicas.add(pick)
            self._holders[h] = replicas
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)
        return pick
