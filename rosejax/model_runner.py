"""The device side of the engine: the compiled prefill and decode programs and the state they carry.

Each running request owns a *slot*: one row of `SlotState`, which lives on the device. A prefill
writes its rows' KV, samples their first token and fills their slots; a decode window runs up to
`max_decode_steps` forward+sample steps in a `lax.while_loop`, feeding each step's tokens back and
advancing positions on the device, and stops rows on EOS, stop ids or their token budget there.
The host sends only changes: new block-table entries and the slots it wants stopped. KV cache and
slot state are donated to every program, so nothing is copied between steps.

Under tensor parallelism (a `mesh`) params and cache come sharded, the forward runs per shard
under shard_map (`rosejax.layers.parallel`), and everything else, slot state and sampling
included, is replicated: every device (and process) computes the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rosejax.layers.attention import ForwardMetadata
from rosejax.layers.kv_cache import KVCache
from rosejax.layers.parallel import place, replicated, tensor_parallel_forward
from rosejax.models import family_of
from rosejax.sampling import sample
from rosejax.settings import KernelConfig

NUM_STOP_IDS = 4  # stop ids checked on the device per row; the host checks any beyond these


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
    seed: jax.Array  # u32[S, 2]: each row's 64-bit seed as [hi, lo]
    stop_ids: jax.Array  # i32[S, NUM_STOP_IDS], -1 = none
    block_tables: jax.Array  # i32[S, MB]


def empty_slot_state(num_slots: int, max_blocks: int) -> SlotState:
    # Every field its own buffer: the state is donated, and a buffer may be donated only once.
    def z():
        return jnp.zeros((num_slots,), jnp.int32)

    return SlotState(
        tokens=z(),
        positions=z(),
        alive=jnp.zeros((num_slots,), bool),
        steps=z(),
        limit=z(),
        temperature=jnp.zeros((num_slots,), jnp.float32),
        top_k=z(),
        top_p=jnp.ones((num_slots,), jnp.float32),
        seed=jnp.zeros((num_slots, 2), jnp.uint32),
        stop_ids=jnp.full((num_slots, NUM_STOP_IDS), -1, jnp.int32),
        block_tables=jnp.zeros((num_slots, max_blocks), jnp.int32),
    )


def _stopped(tokens, stop_ids, steps, limit):
    return jnp.any(tokens[:, None] == stop_ids, axis=1) | (steps >= limit)


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
        max_table_updates: int,
        kernels: KernelConfig,
        placement: jax.Device | Mesh,
    ):
        """`placement`: the device that holds params, KV cache and slot state, or a tensor
        parallel mesh on which `params` and `cache` come sharded (the slot state replicated)."""
        self.config = config
        self.forward = family_of(config).forward
        # Where each program's outputs live (tokens, cache, state) under tensor parallelism: as
        # its inputs, so the donated cache and state are updated in place.
        self._out_shardings: dict = {}
        if isinstance(placement, Mesh):
            self.forward = tensor_parallel_forward(self.forward, placement, params, cache)
            same = replicated(placement)
            self._out_shardings = dict(
                out_shardings=(same, jax.tree.map(lambda a: a.sharding, cache), same)
            )
        # Which kernels run: a static argument of every program, so a new value compiles anew.
        self.kernels = kernels
        self.num_slots = num_slots
        self.max_decode_steps = max_decode_steps
        self.max_table_updates = max_table_updates
        self.max_blocks = -(-config.max_model_len // cache.block_size)
        state = empty_slot_state(num_slots, self.max_blocks)
        if isinstance(placement, Mesh):
            state = jax.tree.map(lambda a: place(np.asarray(a), replicated(placement)), state)
            self.params, self.cache, self.state = params, cache, state
        else:
            # Committed to the device (no copy where they are made there already): a program
            # runs where its committed inputs live, so the host's numpy inputs follow them.
            self.params, self.cache, self.state = jax.device_put((params, cache, state), placement)
        self.num_compiles = 0  # traces of the programs below; flat after warm-up
        self.compile_seconds = 0.0
        self._prefill = jax.jit(
            self._prefill_fn,
            donate_argnums=(1, 2),
            static_argnames=("kernels",),
            **self._out_shardings,
        )
        # One jitted window per batch bucket and kernel config, made on first use: each one's
        # XLA options (its GEMM library) are settled then, not looked up every window.
        self._decode_programs: dict[tuple[int, KernelConfig], Callable] = {}
        # Executables compiled ahead on another thread (`compile_prefill`, `compile_decode`),
        # by their static arguments; a call finds its shape here or compiles through jit.
        self._compiled: dict[tuple, Any] = {}

    # ------------------------------------------------------------------------------ programs

    def _prefill_fn(self, params, cache, state, batch, *, kernels: KernelConfig):
        """Forward over padded prompts, first token of each row, and the rows' slots filled in.
        Padded rows have slot index S, which the scatters drop."""
        self.num_compiles += 1  # runs only while tracing
        meta = ForwardMetadata(batch["positions"], batch["seq_lens"], batch["tables"])
        logits, cache = self.forward(
            params, self.config, batch["tokens"], cache, meta, batch["last"], kernels=kernels
        )
        first = sample(
            logits,
            batch["temperature"],
            batch["top_k"],
            batch["top_p"],
            batch["seed"],
            batch["steps"],
        )  # [Bp]
        steps = batch["steps"] + 1
        alive = ~_stopped(first, batch["stop_ids"], steps, batch["limit"])
        rows = dict(
            tokens=first,
            positions=batch["seq_lens"],
            alive=alive,
            steps=steps,
            limit=batch["limit"],
            temperature=batch["temperature"],
            top_k=batch["top_k"],
            top_p=batch["top_p"],
            seed=batch["seed"],
            stop_ids=batch["stop_ids"],
            block_tables=batch["tables"],
        )
        slots = batch["slots"]
        state = state.replace(
            **{k: getattr(state, k).at[slots].set(v, mode="drop") for k, v in rows.items()}
        )
        return first, cache, state

    def _decode_fn(
        self,
        params,
        cache,
        state,
        kill,
        upd_slot,
        upd_index,
        upd_block,
        move_src,
        move_dst,
        n_steps,
        *,
        batch: int,
        greedy: bool,
        kernels: KernelConfig,
    ):
        """Up to `n_steps` decode steps over slots [0, batch). Returns tokens [K, batch] (-1 where a
        row produced nothing), the cache and the state."""
        self.num_compiles += 1
        state = state.replace(alive=state.alive & ~kill)
        # Compaction: whole rows move down to free slots (sources and destinations disjoint),
        # then the sources stop; padded moves (index S) are dropped.
        src = jnp.minimum(move_src, self.num_slots - 1)
        state = jax.tree.map(lambda a: a.at[move_dst].set(a[src], mode="drop"), state)
        state = state.replace(alive=state.alive.at[move_src].set(False, mode="drop"))
        tables = state.block_tables.at[upd_slot, upd_index].set(upd_block, mode="drop")
        state = state.replace(block_tables=tables)
        rows = jax.tree.map(lambda a: a[:batch], state)
        out = jnp.full((self.max_decode_steps, batch), -1, jnp.int32)

        def cond(carry):
            k, _, r, _ = carry
            return (k < n_steps) & jnp.any(r.alive)

        def body(carry):
            k, cache, r, out = carry
            seq_lens = jnp.where(r.alive, r.positions + 1, 0)  # dead rows write to scratch
            meta = ForwardMetadata(r.positions[:, None], seq_lens, r.block_tables)
            logits, cache = self.forward(
                params, self.config, r.tokens[:, None], cache, meta, kernels=kernels
            )
            logits = logits[:, 0]  # [B, V]
            if greedy:
                nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            else:
                # Rows without a request sample greedily: their stale filters cost nothing.
                temperature = jnp.where(r.alive, r.temperature, 0.0)
                nxt = sample(logits, temperature, r.top_k, r.top_p, r.seed, r.steps)
            live = r.alive
            steps = r.steps + live
            r = r.replace(
                tokens=jnp.where(live, nxt, r.tokens),
                positions=r.positions + live,
                steps=steps,
                alive=live & ~_stopped(nxt, r.stop_ids, steps, r.limit),
            )
            return k + 1, cache, r, out.at[k].set(jnp.where(live, nxt, -1))

        _, cache, rows, out = jax.lax.while_loop(cond, body, (0, cache, rows, out))
        # Only these fields change inside the loop; the rest of the state is as it came in.
        changed = ("tokens", "positions", "alive", "steps")
        state = state.replace(
            **{f: getattr(state, f).at[:batch].set(getattr(rows, f)) for f in changed}
        )
        return out, cache, state

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

    def _compile_ahead(self, key: tuple, program, args: tuple, **static) -> None:
        """Lower and compile `program` for the shapes of `args`, without running it: safe on a
        thread other than the one running programs (only shapes are read of the live arrays)."""
        if key in self._compiled:
            return
        start = time.perf_counter()
        specs = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(
                np.shape(a), a.dtype, sharding=getattr(a, "sharding", None)
            ),
            args,
        )
        self._compiled[key] = program.lower(*specs, **static).compile()
        self.compile_seconds += time.perf_counter() - start

    def _prefill_args(self, batch: dict[str, np.ndarray]) -> tuple:
        return self.params, self.cache, self.state, batch

    def prefill(self, batch: dict[str, np.ndarray]) -> jax.Array:
        key = ("prefill", batch["tokens"].shape, self.kernels)
        args = self._prefill_args(batch)
        first, self.cache, self.state = self._run(key, self._prefill, args, kernels=self.kernels)
        return first

    def compile_prefill(self, batch: dict[str, np.ndarray]) -> None:
        """Compile ahead the prefill program of `batch`'s shapes (see `_compile_ahead`)."""
        key = ("prefill", batch["tokens"].shape, self.kernels)
        self._compile_ahead(key, self._prefill, self._prefill_args(batch), kernels=self.kernels)

    def decode(
        self,
        batch: int,
        n_steps: int,
        greedy: bool,
        kill: np.ndarray,
        updates: list[tuple[int, int, int]],
        moves: list[tuple[int, int]] = (),
    ) -> jax.Array:
        """Dispatch a decode window (asynchronously); `updates` are (slot, index, block) entries
        of the block tables that changed since the last window (slots after the moves), `moves`
        (src, dst) rows of the slot state to move first."""
        u = np.full((3, self.max_table_updates), self.num_slots, np.int32)
        if updates:
            u[:, : len(updates)] = np.asarray(updates, np.int32).T
        m = np.full((2, self.num_slots), self.num_slots, np.int32)
        if moves:
            m[:, : len(moves)] = np.asarray(moves, np.int32).T
        args = (self.params, self.cache, self.state, kill, *u, *m, np.int32(n_steps))
        static = dict(batch=batch, greedy=greedy, kernels=self.kernels)
        key = ("decode", batch, greedy, self.kernels)
        out, self.cache, self.state = self._run(key, self._decode_program(batch), args, **static)
        return out

    def compile_decode(self, batch: int, greedy: bool) -> None:
        """Compile ahead the decode window of `batch` rows (see `_compile_ahead`)."""
        kill = np.zeros(self.num_slots, bool)
        u = np.zeros((3, self.max_table_updates), np.int32)
        m = np.zeros((2, self.num_slots), np.int32)
        args = (self.params, self.cache, self.state, kill, *u, *m, np.int32(0))
        static = dict(batch=batch, greedy=greedy, kernels=self.kernels)
        key = ("decode", batch, greedy, self.kernels)
        self._compile_ahead(key, self._decode_program(batch), args, **static)

    def _decode_program(self, batch: int) -> Callable:
        key = (batch, self.kernels)
        program = self._decode_programs.get(key)
        if program is None:
            program = self._decode_programs[key] = jax.jit(
                self._decode_fn,
                donate_argnums=(1, 2),
                static_argnames=("batch", "greedy", "kernels"),
                compiler_options=self.kernels.decode_compiler_options(batch) or None,
                **self._out_shardings,
            )
        return program
