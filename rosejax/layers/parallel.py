"""Tensor parallelism, Megatron-style, over a one-axis device mesh ("tp"): which part of each param
a shard holds, and the collectives of a forward that runs per shard.

The whole model forward runs per shard under `shard_map` (`tensor_parallel_forward`, used by the
model runner), so every Pallas kernel sees one shard's arrays as it would a small model's:

- column-parallel: the q/k/v projection (this shard's query and KV heads) and the MLP's up/gate
  (or fc) projection (its part of the hidden units); their biases split the same way.
- row-parallel: the attention output and MLP down projections take this shard's part of their
  input; their float32 partial sums are all-reduced (`Linear(reduce_axis=...)`: one psum per
  attention block and one per MLP), and the replicated bias and residual are added after it.
- vocabulary-parallel: the embedding table's rows (a token's row lives on one shard; the others
  read zeros and one psum fills it in) and the LM head's columns (its logits all-gathered).
- the KV cache pages split by KV heads, with the heads of the q/k/v projection.
- norms, positions, RoPE and everything the host sends (block tables, positions) replicated.

A fused projection ([q | k | v], [gate | up]) is stored shard-major once sharded: shard i's
columns are [q_i | k_i | v_i], so its slice is the fused layout over its own heads and the
model reads it unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

TP_AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """What a forward running on one shard needs to know: how many shards, along which mesh axis.
    Hashable: a model's modules take it as an attribute. size 1: no collectives at all."""

    size: int = 1
    axis: str = TP_AXIS

    @property
    def reduce_axis(self) -> str | None:
        """The axis row-parallel layers all-reduce over; None when there is one shard."""
        return self.axis if self.size > 1 else None

    def local(self, n: int) -> int:
        """This shard's share of n heads, hidden units or vocabulary rows."""
        return n // self.size


NO_TP = TensorParallel()


def embed(table: nn.Embed, tokens: jax.Array, tp: TensorParallel) -> jax.Array:
    """Vocabulary-parallel lookup [B, T] -> [B, T, E]: `table` holds this shard's rows; a token on
    another shard's rows reads zeros here and the psum adds its one nonzero row (exact)."""
    if tp.size == 1:
        return table(tokens)
    rows = table.num_embeddings
    local = tokens - jax.lax.axis_index(tp.axis) * rows
    mine = (local >= 0) & (local < rows)
    x = table(jnp.clip(local, 0, rows - 1))
    return jax.lax.psum(jnp.where(mine[..., None], x, jnp.zeros_like(x)), tp.axis)


def gather_vocab(logits: jax.Array, tp: TensorParallel) -> jax.Array:
    """This shard's logit columns [..., V/N] -> every column [..., V], in shard order."""
    if tp.size == 1:
        return logits
    return jax.lax.all_gather(logits, tp.axis, axis=logits.ndim - 1, tiled=True)


# ------------------------------------------------------------------------------- the params


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How a family's params split, by module name (the dict holding "kernel", "bias" or
    "embedding"); other modules are replicated."""

    # Column-parallel modules -> widths of the blocks of their output ((q, k, v) or (gate, up));
    # each block is split over the shards and stored shard-major.
    column: dict[str, tuple[int, ...]]
    # Row-parallel modules and embedding tables: the kernel's (table's) rows split; a bias is
    # replicated (added once, after the all-reduce).
    row: tuple[str, ...]
    # What the shard count must divide, by name for the error: {"attention heads": 12, ...}.
    divisible: dict[str, int]

    def check(self, size: int) -> None:
        for what, n in self.divisible.items():
            if n % size:
                raise ValueError(
                    f"--tensor-parallel-size {size} does not divide the model's {n} {what}: "
                    "pick a divisor of it"
                )


def _shard_major(x: jax.Array, blocks: tuple[int, ...], n: int) -> jax.Array:
    """Columns [b0 | b1 | ...] -> [b0_0 | b1_0 | ... | b0_1 | b1_1 | ...]: block j's i-th n-th part
    goes to shard i."""
    if sum(blocks) != x.shape[-1]:
        raise ValueError(f"column blocks {blocks} do not add up to the {x.shape[-1]} columns")
    if len(blocks) == 1:
        return x
    parts = jnp.split(x, np.cumsum(blocks)[:-1].tolist(), axis=-1)
    pieces = [jnp.split(p, n, axis=-1) for p in parts]
    return jnp.concatenate([piece[i] for i in range(n) for piece in pieces], axis=-1)


def place(x: Any, sharding: NamedSharding) -> jax.Array:
    """`x` (the same value in every process) as a global array of `sharding`: each process puts
    only the shards of its own devices (what works across processes, where device_put to
    another process's device cannot)."""
    return jax.make_array_from_callback(np.shape(x), sharding, lambda index: x[index])


def shard_params(params: dict, layout: ShardLayout, mesh: Mesh) -> dict:
    """The params pytree as global arrays split over `mesh` by `layout`."""
    n = mesh.shape[TP_AXIS]

    def spec(module: str, leaf: str, x: jax.Array) -> tuple[jax.Array, P]:
        if module in layout.column:
            return _shard_major(x, layout.column[module], n), P(*[None] * (x.ndim - 1), TP_AXIS)
        if module in layout.row and leaf != "bias":
            return x, P(TP_AXIS)
        return x, P()

    def walk(node: dict, module: str) -> dict:
        out = {}
        for key, value in node.items():
            if isinstance(value, dict):
                out[key] = walk(value, key)
            else:
                x, s = spec(module, key, value)
                out[key] = place(x, NamedSharding(mesh, s))
        return out

    return walk(params, "")


def tensor_parallel_devices(size: int) -> tuple[jax.Device, ...]:
    """An engine's default devices: the first local one, or for tensor parallelism the first
    `size` (of every process, after `jax.distributed.initialize`); a clear error naming the flag
    when there are fewer."""
    if size == 1:
        return tuple(jax.local_devices()[:1])
    devices = jax.devices()
    if size > len(devices):
        raise ValueError(
            f"--tensor-parallel-size {size} needs {size} devices; {len(devices)} "
            f"{devices[0].platform} device(s) are present"
        )
    return tuple(devices[:size])


def tensor_parallel_mesh(devices: tuple[jax.Device, ...]) -> Mesh:
    """`devices` as the mesh axis "tp"."""
    return Mesh(np.array(devices), (TP_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def _shard_map(f: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    """`jax.shard_map` where jax has it, else the experimental one. Unchecked: pallas_call has no
    rule for which mesh axes its outputs vary over."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map

    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def tensor_parallel_forward(forward: Callable, mesh: Mesh, params: dict, cache: Any) -> Callable:
    """A family's `forward` (same signature) run per shard under shard_map: params and cache as
    they are sharded (their arrays' specs), tokens and metadata replicated, logits replicated."""
    tp = TensorParallel(mesh.shape[TP_AXIS])
    param_specs = jax.tree.map(lambda a: a.sharding.spec, params)
    cache_specs = jax.tree.map(lambda a: a.sharding.spec, cache)

    def sharded(params, config, tokens, cache, meta, logit_indices=None, *, kernels):
        def shard(params, tokens, cache, meta, logit_indices):
            return forward(
                params, config, tokens, cache, meta, logit_indices, kernels=kernels, tp=tp
            )

        return _shard_map(
            shard,
            mesh,
            in_specs=(param_specs, P(), cache_specs, P(), P()),
            out_specs=(P(), cache_specs),
        )(params, tokens, cache, meta, logit_indices)

    return sharded
