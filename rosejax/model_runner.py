"""The device side of the engine: the compiled prefill and decode programs and the state they carry.

Each running request owns a *slot*: one row of `SlotState`, which lives on the device. A prefill
writes its rows' KV, samples their first token and fills their slots; a decode window runs up to
`max_decode_steps` forward+sample steps in a `lax.while_loop`, feeding each step's tokens back and
advancing positions on the device, and stops rows on EOS, stop ids or their token budget there.
The host sends only changes: new block-table entries and the slots it wants stopped. KV cache and
slot state are donated to every program, so nothing is copied between steps.

A slot also carries its request's logits processors (`rosejax.sampling.Processors`): sparse
biases (logit_bias, and min_tokens' ban on the stop ids) and penalties with the token counts they
read, one u16 row of the vocabulary per slot, counted on the device as tokens are fed back.
`load_row` writes a row's biases and counts (from the host's token history) before the prefill
that samples its first token. Batches where some row has processors, min_p or logprobs run
other programs ("extras"), which also return the sampled tokens' logprobs (`TokenLogprobs`);
in them each feature is behind a `lax.cond` on the batch, and new values never recompile. A
batch that asks for none runs the plain programs, which read none of these fields. A prefill
whose batch has `prompt_targets` (another program again) returns every prompt token's logprobs.

Under tensor parallelism (a `mesh`) params and cache come sharded, the forward runs per shard
under shard_map (`rosejax.layers.parallel`), and everything else, slot state and sampling
included, is replicated: every device (and process) computes the same tokens.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from rosejax.host_inputs import Layout, pack, unpack
from rosejax.layers.attention import LONG_CHAIN_TOKENS, ForwardMetadata, decode_num_splits
from rosejax.layers.kv_cache import KVCache
from rosejax.layers.parallel import place, replicated, tensor_parallel_forward
from rosejax.models import family_of
from rosejax.sampling import (
    MAX_LOGIT_BIAS,
    Processors,
    TokenLogprobs,
    count_tokens,
    empty_logprobs,
    process_logits,
    sample,
    token_logprobs,
)
from rosejax.settings import KernelConfig

NUM_STOP_IDS = 4  # stop ids checked on the device per row; the host checks any beyond these
MAX_MIN_TOKENS_STOP_IDS = 64  # stop ids min_tokens can hold off (biases of -inf)
NUM_BIAS = MAX_LOGIT_BIAS + MAX_MIN_TOKENS_STOP_IDS  # sparse bias entries per row


@flax.struct.dataclass
class SlotState:
    tokens: jax.Array  # i32[S], the token to feed next
    positions: jax.Array  # i32[S], its position
    alive: jax.Array  # bool[S]
    steps: jax.Array  # i32[S], tokens generated so far
    limit: jax.Array  # i32[S], tokens the row may generate in all
    temperature: jax.Array  # f32[S]
    top_k: jax.Array  # i32[S]
    top_p: jax.Array  # f32[S]
    min_p: jax.Array  # f32[S]
    seed: jax.Array  # u32[S, 2]: each row's 64-bit seed as [hi, lo]
    stop_ids: jax.Array  # i32[S, NUM_STOP_IDS], -1 = none
    block_tables: jax.Array  # i32[S, MB]
    logprobs: jax.Array  # i32[S]: alternatives the row wants beside its tokens' logprobs; -1: none
    presence: jax.Array  # f32[S]
    frequency: jax.Array  # f32[S]
    repetition: jax.Array  # f32[S]
    has_bias: jax.Array  # bool[S]: bias_* hold the row's entries (else stale: ignored)
    bias_ids: jax.Array  # i32[S, NUM_BIAS]
    bias_values: jax.Array  # f32[S, NUM_BIAS]
    bias_until: jax.Array  # i32[S, NUM_BIAS]
    # u16[S, V]: the output counts (all but the token to feed next, counted as it is fed) and
    # prompt bits of rows with penalties; stale in other rows. Never sliced per window.
    counts: jax.Array

    def processors(self, counts: jax.Array) -> Processors:
        return Processors(
            self.steps,
            self.has_bias,
            self.bias_ids,
            self.bias_values,
            self.bias_until,
            self.presence,
            self.frequency,
            self.repetition,
            counts,
        )


SPARSE_FIELDS = ("bias_ids", "bias_values", "bias_until")  # read where has_bias says so
# Per-row fields a prefill sets from its batch (the bias entries and counts come by `load_row`).
PREFILL_ROW_FIELDS = ("limit", "temperature", "top_k", "top_p", "seed", "stop_ids")
# ... and those a batch carries only when some row asks for them, with the value of a row that
# does not (what a prefill without them sets).
EXTRA_ROW_FIELDS = {
    "min_p": 0.0,
    "logprobs": -1,
    "presence": 0.0,
    "frequency": 0.0,
    "repetition": 1.0,
    "has_bias": False,
}


def empty_slot_state(num_slots: int, max_blocks: int, vocab: int) -> SlotState:
    """Every row empty, as numpy arrays: the runner puts them on its device(s) in one transfer,
    where a jnp array per field compiled a program per shape (most of a second on a GPU)."""

    def z(*shape, dtype=np.int32):
        return np.zeros((num_slots, *shape), dtype)

    return SlotState(
        tokens=z(),
        positions=z(),
        alive=z(dtype=bool),
        steps=z(),
        limit=z(),
        temperature=z(dtype=np.float32),
        top_k=z(),
        top_p=np.ones((num_slots,), np.float32),
        min_p=z(dtype=np.float32),
        seed=z(2, dtype=np.uint32),
        stop_ids=np.full((num_slots, NUM_STOP_IDS), -1, np.int32),
        block_tables=z(max_blocks),
        logprobs=np.full((num_slots,), -1, np.int32),
        presence=z(dtype=np.float32),
        frequency=z(dtype=np.float32),
        repetition=np.ones((num_slots,), np.float32),
        has_bias=z(dtype=bool),
        bias_ids=z(NUM_BIAS),
        bias_values=z(NUM_BIAS, dtype=np.float32),
        bias_until=z(NUM_BIAS),
        counts=z(vocab, dtype=np.uint16),
    )


def _stopped(tokens, stop_ids, steps, limit):
    # Column by column, not any() over them: elementwise, so it fuses into the kernel that
    # updates the rows (a reduction would be a kernel of its own every decode step).
    hit = steps >= limit
    for j in range(stop_ids.shape[1]):
        hit = hit | (tokens == stop_ids[:, j])
    return hit


class ModelRunner:
    """Owns params, KV cache and slot state on its device(s), and the programs that advance
    them."""

    def __init__(
        self,
        config: Any,
        params: dict,
        cache: KVCache,
        num_slots: int,
        max_decode_steps: int,
        steps_per_trip: int,
        max_table_updates: int,
        kernels: KernelConfig,
        placement: jax.Device | Mesh,
    ):
        """`placement`: the device that holds params, KV cache and slot state, or a tensor
        parallel mesh on which `params` and `cache` come sharded (the slot state replicated)."""
        self.config = config
        self.forward = family_of(config).forward
        # Where each program's outputs live under tensor parallelism (replicated, the cache's
        # shardings): as its inputs, so the donated cache and state are updated in place.
        self._shardings = None
        if isinstance(placement, Mesh):
            self.forward = tensor_parallel_forward(self.forward, placement, params, cache)
            self._shardings = (replicated(placement), jax.tree.map(lambda a: a.sharding, cache))
        # Which kernels run: a static argument of every program, so a new value compiles anew.
        self.kernels = kernels
        self.num_slots = num_slots
        self.max_decode_steps = max_decode_steps
        self.steps_per_trip = steps_per_trip
        self.max_table_updates = max_table_updates
        self.max_blocks = -(-config.max_model_len // cache.block_size)
        self.tensor_parallel_size = placement.size if isinstance(placement, Mesh) else 1
        # Per decode batch, made on first use: (the context past which a row makes a window run
        # the long-row program, that program's kernels), or None where no row the context holds
        # does (`_long_row_program`).
        self._long_rows: dict[int, tuple[int, KernelConfig] | None] = {}
        state = empty_slot_state(num_slots, self.max_blocks, config.vocab_size)
        if isinstance(placement, Mesh):
            state = jax.tree.map(lambda a: place(a, replicated(placement)), state)
            self.params, self.cache, self.state = params, cache, state
        else:
            # Committed to the device (no copy where they are made there already): a program
            # runs where its committed inputs live, so the host's numpy inputs follow them. Each
            # state field is a buffer of its own: the state is donated, a buffer only once.
            self.params, self.cache, self.state = jax.device_put((params, cache, state), placement)
        self.num_compiles = 0  # traces of the programs below; flat after warm-up
        self.compile_seconds = 0.0
        self._prefill = jax.jit(
            self._prefill_fn,
            donate_argnums=(1, 2),
            static_argnames=("layout", "kernels"),
            **self._out_shardings(3),  # tokens, their logprobs, the prompt's; cache; state
        )
        self._load_row = jax.jit(
            self._load_row_fn, donate_argnums=(0,), **self._out_shardings(0, cache=False)
        )
        # One jitted window per batch bucket and kernel config, made on first use: each one's
        # XLA options (its GEMM library) are settled then, not looked up every window.
        self._decode_programs: dict[tuple[int, KernelConfig], Callable] = {}
        # Executables compiled ahead on another thread (`compile_prefill`, `compile_decode`),
        # by their static arguments; a call finds its shape here or compiles through jit.
        self._compiled: dict[tuple, Any] = {}

    def _out_shardings(self, replicated_first: int, cache: bool = True) -> dict:
        """jit's `out_shardings` under tensor parallelism for a program that returns
        `replicated_first` replicated outputs, then the cache (if `cache`), then the state;
        none without it."""
        if self._shardings is None:
            return {}
        same, cache_shardings = self._shardings
        outs = (same,) * replicated_first + ((cache_shardings,) if cache else ()) + (same,)
        return dict(out_shardings=outs if len(outs) > 1 else same)

    # ------------------------------------------------------------------------------ programs

    def _prefill_fn(self, params, cache, state, packed, *, layout: Layout, kernels: KernelConfig):
        """Forward over padded prompts, first token of each row, and the rows' slots filled in.
        The batch comes packed in one buffer (`rosejax.host_inputs`: one transfer).
        Padded rows have slot index S, which the scatters drop. Two optional parts of the
        batch make other programs: the `EXTRA_ROW_FIELDS` (some row has logits processors,
        min_p or logprobs: the first tokens' logprobs are returned too, else None), and
        `prompt_targets` [Bp, T], the next prompt token at each position, whose logprobs are
        returned too (logits at every position), with MAX_LOGPROBS alternatives (the host keeps
        what each row asked for); else None."""
        self.num_compiles += 1  # runs only while tracing
        batch = unpack(packed, layout)
        meta = ForwardMetadata(batch["positions"], batch["seq_lens"], batch["tables"])
        with_prompt = "prompt_targets" in batch
        logits, cache = self.forward(
            params,
            self.config,
            batch["tokens"],
            cache,
            meta,
            None if with_prompt else batch["last"],
            kernels=kernels,
        )
        if with_prompt:
            every = logits  # [Bp, T, V]
            logits = jnp.take_along_axis(every, batch["last"][:, None, None], axis=1)[:, 0]
        slots = batch["slots"]
        sampling = [batch[k] for k in ("temperature", "top_k", "top_p", "seed", "steps")]
        first_logprobs = prompt_logprobs = None
        if "presence" in batch:
            extras = {k: batch[k] for k in EXTRA_ROW_FIELDS}

            def gather(a):  # the rows' slot state; padded rows and chunks (slot S) read zeros
                return a.at[slots].get(mode="fill", fill_value=0)

            procs = Processors(
                batch["steps"],
                batch["has_bias"],
                *(gather(a) for a in (state.bias_ids, state.bias_values, state.bias_until)),
                batch["presence"],
                batch["frequency"],
                batch["repetition"],
                None,  # the counts: gathered only by the branch that reads them
            )

            def pick(x):
                return sample(x, *sampling, batch["min_p"])

            first = lax.cond(
                jnp.any(procs.active()),
                lambda: pick(process_logits(logits, procs._replace(counts=gather(state.counts)))),
                lambda: pick(logits),
            )  # [Bp]
            first_logprobs = lax.cond(
                jnp.any(batch["logprobs"] >= 0),
                lambda: token_logprobs(logits, first),
                lambda: empty_logprobs(first.shape, logits.shape[-1]),
            )
        else:  # no row asks for any: its slot's extras are neutral
            extras = {k: jnp.full(slots.shape, v) for k, v in EXTRA_ROW_FIELDS.items()}
            first = sample(logits, *sampling)  # [Bp]
        if with_prompt:
            b, t, vocab = every.shape
            targets = batch["prompt_targets"].reshape(-1)
            flat = token_logprobs(every.reshape(b * t, vocab), targets)
            prompt_logprobs = jax.tree.map(lambda a: a.reshape(b, t, *a.shape[1:]), flat)
        steps = batch["steps"] + 1
        alive = ~_stopped(first, batch["stop_ids"], steps, batch["limit"])
        rows = dict(
            tokens=first,
            positions=batch["seq_lens"],
            alive=alive,
            steps=steps,
            block_tables=batch["tables"],
            **{k: batch[k] for k in PREFILL_ROW_FIELDS},
            **extras,
        )
        state = state.replace(
            **{k: getattr(state, k).at[slots].set(v, mode="drop") for k, v in rows.items()}
        )
        return first, first_logprobs, prompt_logprobs, cache, state

    def _load_row_fn(self, state, slot, bias_ids, bias_values, bias_until, count_ids, counts):
        """Slot `slot`'s bias entries [NUM_BIAS] and token counts: `counts` u16[L] of the tokens
        `count_ids` i32[L] (ids >= V are padding), every other token 0."""
        self.num_compiles += 1
        row = jnp.zeros(state.counts.shape[1:], jnp.uint16).at[count_ids].set(counts, mode="drop")
        return state.replace(
            bias_ids=state.bias_ids.at[slot].set(bias_ids),
            bias_values=state.bias_values.at[slot].set(bias_values),
            bias_until=state.bias_until.at[slot].set(bias_until),
            counts=state.counts.at[slot].set(row),
        )

    def _decode_fn(
        self,
        params,
        cache,
        state,
        packed,
        *,
        layout: Layout,
        batch: int,
        greedy: bool,
        extras: bool,
        kernels: KernelConfig,
    ):
        """Up to `n_steps` decode steps over slots [0, batch). Returns tokens [K, batch] (-1 where a
        row produced nothing), their logprobs (`TokenLogprobs` of [K, batch], zeros unless a row
        asks; None unless `extras`), the cache and the state. `extras`: the program has the
        logits processors, min_p and logprobs, each behind a `lax.cond` on the window's rows;
        without, it is the plain program (their slot fields unread, the counts untouched).
        `packed` holds the host's inputs (`decode`'s `_decode_inputs`)."""
        self.num_compiles += 1
        inputs = unpack(packed, layout)
        upd_slot, upd_index, upd_block = inputs["updates"]
        move_src, move_dst = inputs["moves"]
        n_steps = inputs["n_steps"]
        state = state.replace(alive=state.alive & ~inputs["kill"])
        # Compaction: whole rows move down to free slots (sources and destinations disjoint),
        # then the sources stop; padded moves (index S) are dropped.
        src = jnp.minimum(move_src, self.num_slots - 1)

        def move(a):
            return a.at[move_dst].set(a[src], mode="drop")

        # A plain program leaves the bias entries and counts where they are: only rows whose
        # flags (which do move) say so read them, and those rows run the extras programs.
        held = ("counts",) if extras else ("counts", *SPARSE_FIELDS)
        kept = {f: getattr(state, f) for f in held}
        if extras:  # the counts only when something moves: all S rows are 78 MB at V=151,936
            move_any = jnp.any(move_src < self.num_slots)
            kept["counts"] = lax.cond(move_any, move, lambda a: a, kept["counts"])
        state = jax.tree.map(move, state.replace(**dict.fromkeys(held))).replace(**kept)
        state = state.replace(alive=state.alive.at[move_src].set(False, mode="drop"))
        tables = state.block_tables.at[upd_slot, upd_index].set(upd_block, mode="drop")
        state = state.replace(block_tables=tables)
        # The window's rows: the fields its steps read (a plain one none of the extras').
        unread = ("counts",) if extras else ("counts", *SPARSE_FIELDS, *EXTRA_ROW_FIELDS)
        rows = jax.tree.map(lambda a: a[:batch], state.replace(**dict.fromkeys(unread)))
        out = jnp.full((self.max_decode_steps, batch), -1, jnp.int32)
        logprobs = None
        if extras:
            logprobs = empty_logprobs((self.max_decode_steps, batch), self.config.vocab_size)
            # What the window's rows ask for is fixed for the window: decided once, not per step.
            procs_on = jnp.any(rows.alive & rows.processors(None).active())
            logprobs_on = jnp.any(rows.alive & (rows.logprobs >= 0))

        # The loop's condition is computed in its own computation from the carry. A flag the
        # body makes, read from the carry as the condition, ended windows early on an H100
        # (every request, jax 0.11.2; right on the CPU): docs/performance-log.md.
        def runs(steps):  # the loop condition of a trip of `steps` steps
            def cond(carry):
                k, _, _, r, *_ = carry
                return (k + steps <= n_steps) & jnp.any(r.alive)

            return cond

        def lengths(r):  # each row's context with the token it feeds; dead rows write to scratch
            return jnp.where(r.alive, r.positions + 1, 0)

        def step(carry):
            k, seq_lens, cache, r, out, *more = carry
            meta = ForwardMetadata(r.positions[:, None], seq_lens, r.block_tables)
            logits, cache = self.forward(
                params, self.config, r.tokens[:, None], cache, meta, kernels=kernels
            )
            logits = logits[:, 0]  # [B, V]
            live = r.alive

            def pick(x):
                if greedy:
                    return jnp.argmax(x, axis=-1)
                # Rows without a request sample greedily: their stale filters cost nothing.
                temperature = jnp.where(live, r.temperature, 0.0)
                min_p = r.min_p if extras else None
                return sample(x, temperature, r.top_k, r.top_p, r.seed, r.steps, min_p)

            if extras:
                counts, logprobs = more
                procs = r.processors(None)

                # The token fed now joins its row's output counts (rows with penalties: the
                # others' counts are never read). Outside the branch below: a branch's output is
                # copied into the loop's carry every step, and the counts are [S, V] (78 MB at
                # 256 rows of Qwen3's vocabulary).
                counts = count_tokens(counts, r.tokens, live & procs.penalized())

                def processed(x):
                    return pick(process_logits(x, procs._replace(counts=counts[:batch])))

                nxt = lax.cond(procs_on, processed, pick, logits)
                logprobs = lax.cond(
                    logprobs_on,
                    lambda lp: jax.tree.map(
                        lambda a, v: lax.dynamic_update_index_in_dim(a, v, k, 0),
                        lp,
                        token_logprobs(logits, nxt),
                    ),
                    lambda lp: lp,
                    logprobs,
                )
                more = (counts, logprobs)
            else:
                nxt = pick(logits)
            nxt = nxt.astype(jnp.int32)
            steps = r.steps + live
            r = r.replace(
                tokens=jnp.where(live, nxt, r.tokens),
                positions=r.positions + live,
                steps=steps,
                alive=live & ~_stopped(nxt, r.stop_ids, steps, r.limit),
            )
            out = lax.dynamic_update_index_in_dim(out, jnp.where(live, nxt, -1), k, 0)
            return k + 1, lengths(r), cache, r, out, *more

        def trip(carry):
            for _ in range(self.steps_per_trip):
                carry = step(carry)
            return carry

        # The next step's lengths ride in the carry, made in the kernel that updates the rows,
        # not in a kernel of their own; `dynamic_update_index_in_dim` writes row k of the
        # outputs without `.at[k]`'s bounds check (another kernel): k < n_steps <= its rows.
        extra = (state.counts, logprobs) if extras else ()
        carry = (0, lengths(rows), cache, rows, out, *extra)
        # Whole trips while they fit the window, then its last steps one a trip.
        if self.steps_per_trip > 1:
            carry = jax.lax.while_loop(runs(self.steps_per_trip), trip, carry)
        _, _, cache, rows, out, *more = jax.lax.while_loop(runs(1), step, carry)
        if extras:
            counts, logprobs = more
        # Only these fields change inside the loop; the rest of the state is as it came in.
        changed = ("tokens", "positions", "alive", "steps")
        if extras:
            state = state.replace(counts=counts)
        state = state.replace(
            **{f: getattr(state, f).at[:batch].set(getattr(rows, f)) for f in changed}
        )
        return out, logprobs, cache, state

    # ------------------------------------------------------------------------- host calls

    def _call(self, program, *args, **kwargs):
        """Run a program; a call that compiled waits for its result, so `compile_seconds`
        holds compile time (plus that one run) whether it happened at warm-up or lazily."""
        before, start = self.num_compiles, time.perf_counter()
        out = program(*args, **kwargs)
        if self.num_compiles != before:
            jax.block_until_ready(out)
            self.compile_seconds += time.perf_counter() - start
        return out

    def _run(self, key: tuple, program, args: tuple, **static):
        """Run the executable compiled ahead for `key` if there is one, else `program` (jit)."""
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled(*args)
        return self._call(program, *args, **static)

    def _compile_ahead(
        self, key: tuple, program, args: tuple, pool: Executor, **static
    ) -> Callable[[], None]:
        """Lower `program` for the shapes of `args` (only shapes are read of the live arrays:
        safe on a thread other than the one running programs) and compile it without running
        it, on `pool`: XLA compiles, and loads from the persistent cache, without the GIL, so
        the caller may lower the next program meanwhile. Returns what finishes it (waits for the
        executable and keeps it for `key`)."""
        if key in self._compiled:
            return lambda: None
        start = time.perf_counter()
        specs = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(
                np.shape(a), a.dtype, sharding=getattr(a, "sharding", None)
            ),
            args,
        )
        compiling = pool.submit(program.lower(*specs, **static).compile)

        def finish() -> None:
            self._compiled[key] = compiling.result()
            self.compile_seconds += time.perf_counter() - start

        return finish

    def _prefill_call(self, batch: dict[str, np.ndarray]) -> tuple[tuple, tuple, dict]:
        """A prefill's executable key, arguments and static arguments; the batch packed. The
        layout holds the batch's shapes and fields: its optional parts make other programs."""
        packed, layout = pack(batch)
        static = dict(layout=layout, kernels=self.kernels)
        return (
            ("prefill", layout, self.kernels),
            (self.params, self.cache, self.state, packed),
            static,
        )

    def prefill(
        self, batch: dict[str, np.ndarray]
    ) -> tuple[jax.Array, TokenLogprobs | None, TokenLogprobs | None]:
        """Dispatch a prefill -> (first tokens [Bp], their logprobs if the batch has the
        `EXTRA_ROW_FIELDS`, the prompt tokens' logprobs [Bp, T] if it has `prompt_targets`)."""
        key, args, static = self._prefill_call(batch)
        first, logprobs, prompt_logprobs, self.cache, self.state = self._run(
            key, self._prefill, args, **static
        )
        return first, logprobs, prompt_logprobs

    def load_row(
        self,
        slot: int,
        bias: tuple[np.ndarray, np.ndarray, np.ndarray],
        count_ids: np.ndarray,
        counts: np.ndarray,
    ) -> None:
        """Write a slot's bias entries (ids, values, until: [NUM_BIAS] each) and its token counts
        (`counts` u16 of the distinct tokens `count_ids`, at most max_model_len of them) before
        the prefill that samples from it."""
        n = self.config.max_model_len
        ids = np.full(n, self.config.vocab_size, np.int32)  # padding: out of range, dropped
        values = np.zeros(n, np.uint16)
        ids[: len(count_ids)], values[: len(counts)] = count_ids, counts
        self.state = self._call(self._load_row, self.state, np.int32(slot), *bias, ids, values)

    def compile_prefill(self, batch: dict[str, np.ndarray], pool: Executor) -> Callable[[], None]:
        """Compile ahead the prefill program of `batch`'s shapes (see `_compile_ahead`)."""
        key, args, static = self._prefill_call(batch)
        return self._compile_ahead(key, self._prefill, args, pool, **static)

    def decode(
        self,
        batch: int,
        n_steps: int,
        greedy: bool,
        kill: np.ndarray,
        updates: list[tuple[int, int, int]],
        moves: list[tuple[int, int]] = (),
        extras: bool = False,
        long_rows: bool = False,
    ) -> tuple[jax.Array, TokenLogprobs | None]:
        """Dispatch a decode window (asynchronously) -> its tokens [K, batch] and their logprobs
        (None unless `extras`); `updates` are (slot, index, block) entries of the block tables
        that changed since the last window (slots after the moves), `moves` (src, dst) rows of
        the slot state to move first; `extras`: some row has logits processors, min_p or
        logprobs (another program); `long_rows`: a row is longer than `long_row_tokens(batch)`
        (another program)."""
        kernels = self.decode_kernels(batch, long_rows)
        key, args, static = self._decode_call(
            batch, greedy, extras, kill, updates, moves, n_steps, kernels
        )
        program = self._decode_program(batch, kernels)
        out, logprobs, self.cache, self.state = self._run(key, program, args, **static)
        return out, logprobs

    def _decode_splits(self, batch: int, long_rows: bool) -> int | None:
        """The decode attention's splits in a window of `batch` rows (`decode_num_splits`)."""
        c = self.config
        return decode_num_splits(
            self.kernels,
            batch,
            c.num_kv_heads // self.tensor_parallel_size,
            c.num_heads // c.num_kv_heads,
            self.max_blocks,
            self.cache.block_size,
            c.head_dim,
            long_rows,
        )

    def _long_row_program(self, batch: int) -> tuple[int, KernelConfig] | None:
        """For windows of `batch` rows: the context past which a row makes them run the long-row
        program (one run of the default splits would be longer than LONG_CHAIN_TOKENS) and that
        program's kernels (the long-row splits as the attention's tile); None where the two
        split alike or no row the context holds gets that long. Worked out once a batch."""
        if batch not in self._long_rows:
            self._long_rows[batch] = None
            splits = self._decode_splits(batch, long_rows=False)
            finer = self._decode_splits(batch, long_rows=True)
            if splits is not None and finer != splits:
                tokens = splits * LONG_CHAIN_TOKENS
                tiles = (*self.kernels.tiles, ("attention", "num_splits", finer))
                if tokens < self.config.max_model_len:
                    kernels = dataclasses.replace(self.kernels, tiles=tiles)
                    self._long_rows[batch] = tokens, kernels
        return self._long_rows[batch]

    def long_row_tokens(self, batch: int) -> int | None:
        """The context length past which a row makes a decode window of `batch` rows run the
        long-row program (its decode attention split finer), None where no row gets that long."""
        program = self._long_row_program(batch)
        return None if program is None else program[0]

    def decode_kernels(self, batch: int, long_rows: bool) -> KernelConfig:
        """The kernels of a decode window of `batch` rows: with `long_rows` (where
        `long_row_tokens(batch)`), the long-row program's."""
        program = self._long_row_program(batch) if long_rows else None
        return self.kernels if program is None else program[1]

    def _decode_call(
        self,
        batch: int,
        greedy: bool,
        extras: bool,
        kill: np.ndarray,
        updates: list[tuple[int, int, int]],
        moves: list[tuple[int, int]],
        n_steps: int,
        kernels: KernelConfig,
    ) -> tuple[tuple, tuple, dict]:
        """A decode window's executable key, arguments and static arguments: the host's inputs
        in one buffer (padded table updates and moves: index S, dropped)."""
        u = np.full((3, self.max_table_updates), self.num_slots, np.int32)
        if updates:
            u[:, : len(updates)] = np.asarray(updates, np.int32).T
        m = np.full((2, self.num_slots), self.num_slots, np.int32)
        if moves:
            m[:, : len(moves)] = np.asarray(moves, np.int32).T
        inputs = dict(kill=kill, updates=u, moves=m, n_steps=np.int32(n_steps))
        packed, layout = pack(inputs)
        static = dict(layout=layout, batch=batch, greedy=greedy, extras=extras, kernels=kernels)
        key = ("decode", batch, greedy, extras, kernels)
        return key, (self.params, self.cache, self.state, packed), static

    def compile_decode(
        self, batch: int, greedy: bool, extras: bool, pool: Executor, long_rows: bool = False
    ) -> Callable[[], None]:
        """Compile ahead the decode window of `batch` rows (see `_compile_ahead`)."""
        key, program, args, static = self.idle_decode_call(batch, greedy, extras, long_rows)
        return self._compile_ahead(key, program, args, pool, **static)

    def idle_decode_call(
        self, batch: int, greedy: bool, extras: bool, long_rows: bool = False
    ) -> tuple[tuple, Callable, tuple, dict]:
        """The decode window of `batch` rows as compiling ahead builds it, every host input at
        rest (no steps, kills or updates): its executable key, jitted program, arguments and
        static arguments, for lowering (`program.lower(*args, **static)`)."""
        kill = np.zeros(self.num_slots, bool)
        kernels = self.decode_kernels(batch, long_rows)
        key, args, static = self._decode_call(batch, greedy, extras, kill, [], [], 0, kernels)
        return key, self._decode_program(batch, kernels), args, static

    def _decode_program(self, batch: int, kernels: KernelConfig) -> Callable:
        key = (batch, kernels)
        program = self._decode_programs.get(key)
        if program is None:
            program = self._decode_programs[key] = jax.jit(
                self._decode_fn,
                donate_argnums=(1, 2),
                static_argnames=("layout", "batch", "greedy", "extras", "kernels"),
                compiler_options=kernels.decode_compiler_options(batch) or None,
                **self._out_shardings(2),  # tokens, their logprobs; cache; state
            )
        return program
