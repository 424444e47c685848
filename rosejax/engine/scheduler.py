"""Host-only scheduling: who is prefilled, who decodes, who waits, who is preempted.

FIFO admission under the max batch size, a prefill token budget and the free KV blocks; requests
join and leave between steps. The budget counts the tokens the device computes: a prefill batch
is padded to a bucket of rows and of tokens (`prefill_cost`), so admission and the programs
compiled at warm-up agree on which batch shapes exist. When a running request cannot get a slot
for its next token, the newest running request is preempted: its blocks are freed and it goes
back to the head of the queue, to be recomputed (prompt + what it generated so far) when there
is room again.

A request that wants its prompt's logprobs needs logits at every prompt position: it skips the
prefix cache (as in vLLM), its prefill batch is held to `max_logits_tokens` padded tokens, and
its prompt is prefilled in chunks of at most `logits_chunk` tokens. The n sequences of one
request share the KV blocks of their prompt: through the prefix cache, or, with it off, through
a running sibling's table; a sequence waits while a sibling is still being prefilled in chunks.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

from rosejax.engine.block_manager import BlockAllocator, PromptPlan
from rosejax.engine.request import Request, RequestStatus


@dataclasses.dataclass
class PrefillPlan:
    requests: list[Request]
    num_cached: list[int]  # leading tokens of each request whose KV is in the cache already
    # Tokens each row computes in this prefill, and whether that ends its prompt (False: a chunk
    # of a prompt prefilled in chunks, which samples nothing yet). Default: the whole rest.
    num_tokens: list[int] = dataclasses.field(default_factory=list)
    final: list[bool] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_tokens:
            self.num_tokens = [
                r.num_tokens - c for r, c in zip(self.requests, self.num_cached, strict=True)
            ]
        if not self.final:
            self.final = [True] * len(self.requests)


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        max_batch_size: int,
        max_prefill_tokens: int,
        max_prefill_batch: int,
        prefill_cost: Callable[[int, int], int],
        prefill_chunk: int | None = None,
        max_logits_tokens: int | None = None,
        logits_chunk: int | None = None,
    ):
        """`prefill_cost(rows, longest)`: tokens the device computes for a prefill of `rows`
        requests whose longest uncached suffix is `longest`. One request is always admissible.
        `prefill_chunk`: a prompt whose uncached part is longer is prefilled that many tokens
        at a time, one such prompt at once (`prefilling`), between decode windows.
        `max_logits_tokens`, `logits_chunk`: the same two limits for prefills that compute the
        prompt's logprobs (default: max_prefill_tokens and prefill_chunk)."""
        self.allocator = allocator
        self.prefill_cost = prefill_cost
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_prefill_batch = max_prefill_batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefill_chunk = prefill_chunk
        self.max_logits_tokens = max_logits_tokens or max_prefill_tokens
        chunks = [c for c in (prefill_chunk, logits_chunk) if c is not None]
        self.logits_chunk = min(chunks) if chunks else None
        # The prompt being prefilled in chunks: it holds all its blocks and a decode slot's
        # place (not a slot yet), is not in `running` and is never preempted.
        self.prefilling: Request | None = None
        self._prefilling_hashes: list[int] = []  # its blocks' prefix hashes, entered as written

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def prefill_fits(self, rows: int, longest: int, logits: bool = False) -> bool:
        """Whether a prefill of `rows` requests whose longest uncached suffix is `longest` tokens
        is within the budget (`logits`: one that computes prompt logprobs); a single request
        always is."""
        budget = self.max_logits_tokens if logits else self.max_prefill_tokens
        return rows == 1 or self.prefill_cost(rows, longest) <= budget

    def _chunk(self, request: Request) -> int | None:
        """How many tokens at a time a long prompt of this request is prefilled; None: whole."""
        if request.prompt_logprobs_needed:
            return self.logits_chunk
        return self.prefill_chunk

    def _probe(self, request: Request, tokens: list[int]) -> PromptPlan | None:
        """Its allocation plan; None while it must wait for a sibling's chunked prefill."""
        if request.prompt_logprobs_needed:
            return self.allocator.probe(tokens, use_cache=False)
        # By its group, not by a look at its n siblings: n admissions would cost n^2 in all.
        if self.prefilling is not None and self.prefilling.group is request.group:
            return None  # its prompt's blocks are not all written yet: share them once they are
        if not self.allocator.enable_prefix_caching:  # else the cache finds the sibling's blocks
            prompt = len(request.prompt_token_ids)
            for s in request.group.sequences:
                if s is not request and s.status == RequestStatus.RUNNING:
                    n = min(prompt, len(tokens) - 1) // self.allocator.block_size
                    return self.allocator.probe(tokens, shared=s.table.blocks[:n])
        return self.allocator.probe(tokens)

    def admit(self) -> PrefillPlan | None:
        """The next chunk of the prompt being prefilled in chunks, if any, then newly admitted
        requests (FIFO) to prefill; None if there is nothing to prefill now."""
        admitted: list[Request] = []
        cached: list[int] = []
        sizes: list[int] = []
        final: list[bool] = []
        longest = 0
        # Slots left (every running request holds one, the prompt in chunks has one's place),
        # and one prefill's row limit.
        slots = self.max_batch_size - len(self.running) - (self.prefilling is not None)
        max_rows = self.max_prefill_batch
        logits = False  # whether this prefill computes prompt logprobs
        if self.prefilling is not None:
            request = self.prefilling
            logits = request.prompt_logprobs_needed
            start = request.num_computed
            n = min(self._chunk(request), request.num_tokens - start)
            self._next_chunk(request, start, n)
            admitted.append(request)
            cached.append(start)
            sizes.append(n)
            final.append(start + n == request.num_tokens)
            longest = n
            if final[-1]:
                self.running.append(request)
        allocator, waiting = self.allocator, self.waiting
        while waiting and len(admitted) < max_rows and slots > 0:
            request = waiting[0]
            tokens = request.all_token_ids()
            plan = self._probe(request, tokens)
            if plan is None:
                break
            suffix = len(tokens) - plan.num_cached
            chunk = self._chunk(request)
            chunked = chunk is not None and suffix > chunk
            if chunked and self.prefilling is not None:
                break  # one prompt in chunks at a time; FIFO: the rest wait behind it
            n = chunk if chunked else suffix
            grown = max(longest, n)
            with_logits = logits or request.prompt_logprobs_needed
            fits = self.prefill_fits(len(admitted) + 1, grown, with_logits)
            if not fits or not allocator.fits(plan):
                break
            logits = with_logits
            upto = plan.num_cached + n if chunked else None
            request.table, num_cached = allocator.allocate(tokens, plan, register_upto=upto)
            longest = grown
            request.status = RequestStatus.RUNNING
            admitted.append(waiting.popleft())
            cached.append(num_cached)
            sizes.append(n)
            final.append(not chunked)
            slots -= 1
            if chunked:
                self.prefilling = request
                self._prefilling_hashes = plan.hashes
                request.num_computed = num_cached + n
            else:
                self.running.append(request)
        if not admitted:
            return None
        return PrefillPlan(admitted, cached, sizes, final)

    def _next_chunk(self, request: Request, start: int, n: int) -> None:
        """Dispatching tokens start..start+n of the prompt in chunks: its blocks they fill are
        written before any later prefill reads them, so they enter the prefix cache now."""
        bs = self.allocator.block_size
        self.allocator.register_prompt_blocks(
            request.table, self._prefilling_hashes, start // bs, (start + n) // bs
        )
        request.num_computed = start + n
        if start + n == request.num_tokens:
            self.prefilling = None
            self._prefilling_hashes = []

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
        if request is self.prefilling:
            self.prefilling = None
            self._prefilling_hashes = []
            self.allocator.free(request.table)
            request.table = None
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self.allocator.free(request.table)
            request.table = None
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
