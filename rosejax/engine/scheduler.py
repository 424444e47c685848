"""Host-only scheduling: who is prefilled, who decodes, who waits, who is preempted.

FIFO admission under the max batch size, a prefill token budget and the free KV blocks; requests
join and leave between steps. The budget counts the tokens the device computes: a prefill batch
is padded to a bucket of rows and of tokens (`prefill_cost`), so admission and the programs
compiled at warm-up agree on which batch shapes exist. When a running request cannot get a slot
for its next token, the newest running request is preempted: its blocks are freed and it goes
back to the head of the queue, to be recomputed (prompt + what it generated so far) when there
is room again.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

from rosejax.engine.block_manager import BlockAllocator
from rosejax.engine.request import Request, RequestStatus


@dataclasses.dataclass
class PrefillPlan:
    requests: list[Request]
    num_cached: list[int]  # leading tokens of each request whose KV the prefix cache holds


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        max_batch_size: int,
        max_prefill_tokens: int,
        max_prefill_batch: int,
        prefill_cost: Callable[[int, int], int],
    ):
        """`prefill_cost(rows, longest)`: tokens the device computes for a prefill of `rows`
        requests whose longest uncached suffix is `longest`. One request is always admissible."""
        self.allocator = allocator
        self.prefill_cost = prefill_cost
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_prefill_batch = max_prefill_batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def prefill_fits(self, rows: int, longest: int) -> bool:
        """Whether a prefill of `rows` requests whose longest uncached suffix is `longest` tokens
        is within the budget; a single request always is."""
        return rows == 1 or self.prefill_cost(rows, longest) <= self.max_prefill_tokens

    def admit(self) -> PrefillPlan | None:
        """Newly admitted requests (FIFO) to prefill, or None if none fits now."""
        admitted: list[Request] = []
        cached: list[int] = []
        longest = 0
        # Slots left (every running request holds one), and one prefill's row limit.
        rows = min(self.max_batch_size - len(self.running), self.max_prefill_batch)
        allocator, waiting = self.allocator, self.waiting
        while waiting and len(admitted) < rows:
            request = waiting[0]
            tokens = request.all_token_ids()
            plan = allocator.probe(tokens)
            grown = max(longest, len(tokens) - plan.num_cached)
            if not self.prefill_fits(len(admitted) + 1, grown) or not allocator.fits(plan):
                break
            request.table, num_cached = allocator.allocate(tokens, plan)
            longest = grown
            request.status = RequestStatus.RUNNING
            admitted.append(waiting.popleft())
            cached.append(num_cached)
        if not admitted:
            return None
        self.running.extend(admitted)
        return PrefillPlan(admitted, cached)

    def reserve(self, requests: list[Request], steps: int) -> list[Request]:
        """Room for `r.inflight + steps` more tokens (what is in flight plus the next window) for
        each of `requests`, preempting the newest running requests until everyone left fits.
        Returns the preempted, whose device slots the engine must release."""
        preempted: list[Request] = []
        for request in requests:
            while request.status == RequestStatus.RUNNING:
                # Never beyond what the request may still generate (its context included).
                room = max(1, min(request.inflight + steps, request.remaining))
                if self.allocator.can_append(request.table, room):
                    cow_src, _ = self.allocator.reserve(request.table, room)
                    # Copy-on-write needs a block shared by two live tables, i.e. a `fork`,
                    # which the engine never does; forking would need kv_cache.copy_blocks here.
                    if cow_src >= 0:
                        raise RuntimeError("copy-on-write during decode: the engine does not fork")
                    break
                preempted.append(self.running[-1])
                self._preempt(self.running[-1])
        return preempted

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.allocator.free(request.table)
        request.table = None
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)  # first in line for the next admission
        self.num_preemptions += 1

    def finish(self, request: Request) -> None:
        """Release a finished or aborted request's blocks at once."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self.allocator.free(request.table)
            request.table = None
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
