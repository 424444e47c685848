"""A decoder's whole decode step at one row or a few (up to MAX_ROWS; Qwen3, Llama 3, Qwen2, GPT-2)
in one persistent Mosaic GPU kernel: every layer's RMSNorms (GPT-2: LayerNorms), q/k/v, q/k norm and
RoPE, the K/V append, paged attention, output projection, gate/up, SwiGLU (GPT-2: up and GELU) and
down projection, with the residual stream in float32; a projection's bias, where it has one, is
added by the tiles of its first K range (each column block's, once); then the final norm and the LM
head's logits.

Why: at one row a step is ~7 small kernels a layer, each paying a launch, ramp and drain on top of
its bytes; the Triton matmuls reach 25-50% of copy bandwidth (docs/performance-log.md). Here one
program a SM stays for the whole step. Every program streams its share of all layers' weights
through one ring of TMA copies that never waits for activations (weights do not depend on them),
so the next phase's weights arrive while the programs wait for the previous phase's outputs.

Work: a layer's four matmuls (q/k/v, o_proj, gate/up, down) are cut into tiles of W^T, 64 output
columns x 256 of K (packed once, `pack_decoder_weights`), dealt round-robin to the programs
(`decoder_schedule`: tile r of a layer to program r mod P). A tile's program multiplies it by each
row's 256 inputs on the CUDA cores (its bytes read once, its work once a row): q/k/v and gate/up
partials go to buffers that the attention and the down tiles' MLP input sum, o_proj and down
partials are added into the residual stream by TMA reduce-adds. Attention is R x H x `splits` items
(a row, a KV head, a range of 64-token tiles of the row's pages; the current token and its append go
to the last split), each storing its unnormalised output and each query head's softmax max and sum
for the o_proj tiles to merge; a tile's scores and P x V are WGMMAs with the KV head's query heads
as the rows of a 64-row operand. So a layer has five dependent phases (q/k/v, attention, o_proj,
gate/up, down), each spread over every program; a program runs a layer as four loops over its own
tiles of each phase (`phase_bounds`: code of one kind a loop, no phase tests a tile), its attention
items between q/k/v and o_proj. The inputs of a tile or item from other programs (q/k/v, attention
and gate/up partials, h) are loaded by the threads themselves once the wait ends. (Slices of the
MLP taken whole by one program, gate/up summed in its SMEM, saved the wait before down but left the
MLP's weights to the 48 programs of Qwen3-0.6B's 48 slices: slower on an H100.)
The head's tiles are boxes of its rows [V, E] as they are (a tied head is the embedding: no
copy), its column blocks dealt round-robin, each with its K ranges in turn, so a program sums
its own logits; their weights stream through the same ring behind the last layer's.

Order: one global semaphore counts signals; a phase's tiles wait until every tile of the phases
before it in the layer (and all earlier layers) is stored: a program signals once it has stored
its last tile of a phase (its tiles of a phase are consecutive), an attention item once it has
stored its output. Programs take tiles in order and all are resident (one a SM), so the waits
cannot deadlock: by induction, a phase's first signal comes after its wait saw every signal of
the phases before it, so a count that reaches a phase's target holds exactly those signals.

Rounding follows the bf16 model where it rounds (`decoder_step_reference`): the normed input,
q/k/v, q/k norm and RoPE, the attention output and the SwiGLU product (or GELU) in the weights'
dtype; the residual stream stays float32 (the XLA model rounds it at each add).

`interpret=True` runs the kernel in jax's Mosaic GPU interpreter (how the CPU tests run it), which
runs programs one after another and has no global semaphores, layouts or TMA reductions: there
it takes one program, which needs no waits, and `_KernelOps` swaps those three for plain ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa

from pallas_kernels.qk_norm_rope import apply_rotary

try:
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams as _InterpretGPUParams
except ImportError:  # jax < 0.11 has it, unexported
    from jax._src.pallas.mosaic_gpu.interpret.params import (
        InterpretGPUParams as _InterpretGPUParams,
    )

TILE_N = 64  # output columns of a weight tile (rows of W^T: a WGMMA layout's rows)
TILE_K = 256  # its K range (the widest side of a TMA box)
TOKENS = 64  # KV positions an attention tile reads
FLOAT = jnp.float32
NEG_INF = float("-inf")
QKV, O_PROJ, GATE_UP, DOWN = range(4)  # a layer's phases of weight tiles, in order

WGMMA = plgpu.Layout.WGMMA
RING_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # bf16 tiles
COL = WGMMA.reduce(0)  # a vector along a [64, N] tile's columns
ROW = WGMMA.reduce(1)  # a vector along its rows


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """A decoder's sizes and parts, Llama-style or GPT-2 (hashable: the kernel's static
    argument)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    qk_norm: bool
    vocab: int  # the LM head's rows (the vocabulary, padded to a multiple of 64)
    # GPT-2's decoder: LayerNorm (centred, with a shift) for RMSNorm, a bias on every projection,
    # down(gelu_tanh(up x)) for down(silu(gate x) * up x), learned positions for RoPE.
    layer_norm: bool = False
    biases: bool = False
    gelu: bool = False
    rope: bool = True

    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def group(self) -> int:  # the query heads of a KV head
        return self.heads // self.kv_heads

    @property
    def norm_rows(self) -> int:  # a norm's parameters: its scale, and LayerNorm's shift
        return 2 if self.layer_norm else 1

    @property
    def up_width(self) -> int:  # the MLP's first projection: gate and up, or up alone
        return self.intermediate * (1 if self.gelu else 2)

    def phase_blocks(self) -> tuple[int, int, int, int]:
        """Column blocks (of TILE_N) of each phase's output."""
        e = self.hidden // TILE_N
        return self.qkv_width // TILE_N, e, self.up_width // TILE_N, e

    def phase_tiles(self) -> tuple[int, int, int, int]:
        """Weight tiles a layer, by phase: its K ranges of 256 x its column blocks."""
        ks = (self.hidden, self.heads * self.head_dim, self.hidden, self.intermediate)
        return tuple(k // TILE_K * n for k, n in zip(ks, self.phase_blocks(), strict=True))

    def phase_starts(self) -> tuple[int, ...]:
        """Where each phase's tiles start in a layer's, then the layer's count (`phase_tiles`
        summed in order)."""
        return tuple(int(x) for x in np.cumsum((0, *self.phase_tiles())))

    @property
    def head_blocks(self) -> int:  # column blocks (of TILE_N) of the LM head's logits
        return self.vocab // TILE_N


def _gelu_tanh(x: jax.Array) -> jax.Array:
    """GPT-2's gelu_new (the tanh approximation), in float32."""
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def _w_tiles(kernel: jax.Array) -> jax.Array:  # [K, N] -> [K/256 * N/64, 64, 256]
    """A Dense kernel's W^T tiles, K-range-major (tile k * N/64 + b: columns b, K range k)."""
    k, n = kernel.shape
    t = kernel.reshape(k // TILE_K, TILE_K, n // TILE_N, TILE_N)
    return t.transpose(0, 2, 3, 1).reshape(-1, TILE_N, TILE_K)


class DecoderHead(NamedTuple):
    """A model's final norm and LM head as the kernel and its reference take them (a model family
    maps its params to these: `ModelFamily.decoder_head`)."""

    norm: jax.Array  # float32 [2 (scale, shift), E]; RMSNorm: shift 0
    rows: jax.Array  # [V, E]: logit v is row v's dot with the normed h (a tied head: the embedding)


class DecoderLayer(NamedTuple):
    """A layer's parts as the kernel's packing and its reference take them (a model family maps
    its params to these: `ModelFamily.decoder_layers`)."""

    # q/k/v, o_proj, gate/up (or up alone), down: (kernel [K, N], bias [N] or None) each
    dense: tuple
    norms: jax.Array  # float32 [2 (input, post-attention), 2 (scale, shift), E]; RMSNorm: shift 0
    qk_norms: jax.Array  # float32 [2, D]: q_norm's and k_norm's scales (ones without them)


def _bias(dense: tuple, shape: DecoderShape) -> jax.Array | None:
    """A projection's bias: its own, zeros where a model with biases has none there (Qwen2's
    o_proj and MLP), None without biases."""
    kernel, bias = dense
    if not shape.biases:
        return None
    return jnp.zeros(kernel.shape[1], FLOAT) if bias is None else bias


def _bias_tiles(bias: jax.Array, k_ranges: int) -> jax.Array:  # [N] -> [K/256 * N/64, 64]
    """A bias a tile, as `_w_tiles` orders them: K range 0's tiles add it, the others zeros."""
    first = bias.astype(FLOAT).reshape(1, -1, TILE_N)
    return jnp.concatenate([first, jnp.zeros((k_ranges - 1, *first.shape[1:]), FLOAT)]).reshape(
        -1, TILE_N
    )


def pack_decoder_weights(layers: Sequence[DecoderLayer], shape: DecoderShape) -> dict:
    """A model's layers -> the kernel's weights: "tiles" [L * T, 64, 256]
    (each layer's q/k/v, o_proj, gate/up (or up) and down W^T tiles, in the weights' dtype),
    "norms" float32 [L, 2, 2, E] (input and post-attention norms' scales and shifts, zeros for
    RMSNorm), "qk_norms" float32 [L, 2, D] (q_norm, k_norm; ones without them); with biases,
    "biases" float32 [L * T, 64] (each tile's bias for its columns, on its K range 0's tiles)."""
    dense = [d for layer in layers for d in layer.dense]
    packed = {
        "tiles": jnp.concatenate([_w_tiles(kernel) for kernel, _ in dense]),
        "norms": jnp.stack([layer.norms for layer in layers]),
        "qk_norms": jnp.stack([layer.qk_norms for layer in layers]),
    }
    if shape.biases:
        packed["biases"] = jnp.concatenate(
            [_bias_tiles(_bias(d, shape), d[0].shape[0] // TILE_K) for d in dense]
        )
    return packed


def head_weights(head: DecoderHead) -> dict:
    """The kernel's weights of the final norm and LM head: "final_norm" float32 [2, E], "head"
    [V, E] (the rows as given: a tied head stays the embedding, no copy outside a jit)."""
    return {"final_norm": head.norm, "head": head.rows}


class _ItemScratch(NamedTuple):
    """The attention items' SMEM, held through the layers."""

    qkn_s: object  # [2, D] float32: q_norm, k_norm
    kv_out_s: object  # (k_s, v_s) [64, D]: a tile's pages; then tile_s [64, D + 8]: the output
    q_s: object  # [64, D]: the query tile
    rows_s: object  # [head_rows, D] float32: q heads, k, v normed and rotated
    stats_s: object  # [2, 64] float32: each row's max and sum
    cur_s: object  # [2, D]: the step's K and V rows, to append
    copy_bars: object  # the q/k norms' scales
    page_bars: object  # a tile's pages, K and V each


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which program takes which of a layer's weight tiles (the same every layer), as the kernel
    deals them (`_dealt`): what the checks and tests reason about."""

    tiles: np.ndarray  # int32 [P, T]: program c's tiles in the order it takes them, then -1s
    runs: tuple[int, ...]  # programs with a tile in each phase (each signals once)

    @property
    def counts(self) -> np.ndarray:  # int32 [P]: how many tiles each program takes
        return (self.tiles >= 0).sum(axis=1).astype(np.int32)

    # The one semaphore's count: a program signals once it has stored its run of a phase's
    # tiles (they are consecutive), an attention item once it has stored its output.

    def targets(self, items: int) -> tuple[int, ...]:
        """The signals a layer's phase waits for within its layer: every earlier phase's, the
        attention items' (which come right after q/k/v) from o_proj on."""
        done = np.cumsum((0, *self.runs[:-1])) + items * (np.arange(len(self.runs)) > 0)
        return tuple(int(x) for x in done)

    def signals_a_layer(self, items: int) -> int:
        return sum(self.runs) + items


def _dealt(s, c, programs: int):
    """The tile of a layer that program c takes s-th (ints, or traced in the kernel)."""
    return s * programs + c


def _taken(c, programs: int, per_layer: int):
    """How many of a layer's `per_layer` tiles program c takes."""
    return (per_layer - c + programs - 1) // programs


def phase_bounds(shape: DecoderShape, c, programs: int) -> list:
    """Program c's tiles of phase p in a layer are its s-th (`_dealt`) for s in [bounds[p],
    bounds[p + 1]); bounds[4] is its tiles a layer (ints, or traced in the kernel)."""
    return [_taken(c, programs, start) for start in shape.phase_starts()]


@functools.cache
def decoder_schedule(shape: DecoderShape, programs: int) -> Schedule:
    """A layer's tiles round-robin (`_dealt`: tile r to program r mod P, as the kernel takes
    them), so a program's tiles of a phase are consecutive and every phase is spread over all
    the programs it has tiles for."""
    starts = shape.phase_starts()
    counts = [_taken(c, programs, starts[-1]) for c in range(programs)]
    tiles = np.full((programs, max(counts)), -1, np.int32)
    for c, count in enumerate(counts):
        tiles[c, :count] = [_dealt(s, c, programs) for s in range(count)]
    phase = np.searchsorted(starts[1:], tiles, side="right")
    runs = tuple(int(np.any((phase == p) & (tiles >= 0), axis=1).sum()) for p in range(4))
    return Schedule(tiles, runs)


def _on_index(i, count: int, fn, first: int = 0) -> None:
    """fn(j) for the static j equal to the traced i in [first, first + count): a binary tree of
    branches, log2(count) deep. A chain of count branches, at every cache copy, made the
    kernel's code and its jumps grow with the layers."""
    if count == 1:
        fn(first)
        return
    mid = first + count // 2
    lax.cond(
        i < mid,
        lambda: _on_index(i, mid - first, fn, first),
        lambda: _on_index(i, first + count - mid, fn, mid),
    )


def _heads_layouts(half: int):
    """The layout of [rows, half] arrays (a half of D of some heads' vectors) that puts each row on
    a warp (rows 4 apart on the same one) and its columns over the warp's lanes, half / 32 a lane,
    so a row's sums are a warp's shuffles and RoPE's pairs (column j of both halves) share a
    thread; and the layout of [half] vectors that broadcast along its rows."""
    by_warp = mgpu_fa.TiledLayout(
        mgpu_fa.Tiling(((4, half), (half // 32,))), warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1
    )

    def pallas(layout):
        return plgpu.Layout.TILED(
            layout.tiling, layout.warp_dims, layout.lane_dims, layout.vector_dim
        )

    return pallas(by_warp), pallas(by_warp.reduce((0,)))


@dataclasses.dataclass(frozen=True)
class _KernelOps:
    """The operations that differ between a GPU and jax's Mosaic GPU interpreter (one program,
    no layouts, no global semaphores, no TMA reductions)."""

    interpret: bool

    def load(self, ref, layout=COL, optimized: bool = False):
        """ref's value in `layout` (the interpreter has none); `optimized`: an error if Mosaic
        GPU has no vectorized, bank-conflict-free way to load it."""
        if self.interpret:
            return ref[...]
        return plgpu.load(ref, (), layout=layout, optimized=optimized)

    def full(self, shape: tuple, value: float, layout=ROW):
        x = jnp.full(shape, value, FLOAT)
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def iota(self, shape: tuple, layout=ROW):  # int32: each element's index along axis 0
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, 0)
        return plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)

    def matmul(self, a, b, *, transpose_b: bool = False):
        """a @ b (or b^T), float32: a WGMMA on the matrix units; a an SMEM Ref or a value in
        WGMMA, b an SMEM Ref (the interpreter of jax 0.10 takes no transposed operand)."""
        if self.interpret:
            b = b[...].T if transpose_b else b[...]
            a = a[...] if hasattr(a, "at") else a
            return jnp.dot(a, b, preferred_element_type=FLOAT)

        def run(acc_ref):
            plgpu.wgmma(acc_ref, a, b.transpose((1, 0)) if transpose_b else b)
            return acc_ref[...]

        n = b.shape[0] if transpose_b else b.shape[1]
        return pl.run_scoped(run, plgpu.ACC((a.shape[0], n), FLOAT))

    def union(self, *groups):
        """Scratch whose groups share SMEM (the interpreter's are apart)."""
        return groups if self.interpret else plgpu.RefUnion(*groups)

    def cast(self, x, layout):
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def semaphore(self):
        return None if self.interpret else pl.get_global(plgpu.SemaphoreType.REGULAR)

    def signal(self, sem) -> None:
        """One more count, under a named range of its own: its release is a fence (profiles)."""
        if not self.interpret:
            with jax.named_scope("signal"):
                plgpu.semaphore_signal(sem, 1, memory_scope="gpu")

    def wait_count(self, sem, target) -> None:
        """Wait until `sem` counts `target` signals; then a proxy fence: this thread's acquire
        (generic proxy) before its TMA (async proxy) reads of what other programs stored. The
        interpreter's one program stored it all itself."""
        if self.interpret:
            return
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import llvm

        plgpu.semaphore_wait(sem, target, decrement=False, memory_scope="gpu")

        @plgpu.inline_mgpu()
        def fence(_ctx):
            asm = "fence.proxy.async.global;"
            llvm.inline_asm(ir.Type.parse("!llvm.void"), [], asm, "", has_side_effects=True)

        fence()

    def add_to_gmem(self, src, dst) -> None:
        """dst += src (SMEM into GMEM): a TMA reduce-add, or in the interpreter's one program
        (no other writer) once its earlier stores land, a read, add and write."""
        if self.interpret:
            plgpu.wait_smem_to_gmem(0)
            dst[...] = dst[...] + src[...]
        else:
            plgpu.copy_smem_to_gmem(src, dst, reduction_op="add")


def item_table(
    block_tables: jax.Array,  # int32 [R, pages]
    seq_lens: jax.Array,  # int32 [R]
    *,
    block_size: int,
    kv_heads: int,
    splits: int,
    programs: int,
) -> jax.Array:
    """int32 [P, ceil(items / P), C]: attention item j * P + c's scalars at [c, j] (program c's
    j-th item): its row's position (the cache holds [0, pos)), its 64-token tiles [first, last),
    the page of the step's slot, then its first tile's pages (clamped past the table); C padded
    to 32, 128 bytes a row (Mosaic GPU's TMA copies move a multiple of 128 bytes). Built once a
    step before the kernel: an item reads them from SMEM, not through a chain of GMEM reads (the
    row's length, then its pages) before its wait in every layer."""
    rows, width = block_tables.shape
    items = rows * kv_heads * splits
    row, split = jnp.arange(items) // (kv_heads * splits), jnp.arange(items) % splits
    pos = jnp.maximum(seq_lens[row] - 1, 0)  # a dead row (length 0): its own token alone
    tiles = (pos + TOKENS - 1) // TOKENS
    per_split = (tiles + splits - 1) // splits
    first = jnp.minimum(split * per_split, tiles)
    last = jnp.minimum(first + per_split, tiles)
    table = block_tables[row]  # [items, pages]
    at = jnp.clip(
        first[:, None] * (TOKENS // block_size) + jnp.arange(TOKENS // block_size), 0, width - 1
    )
    # A dead row writes position 0 of block 0 (scratch): its table may hold freed blocks.
    slot_page = jnp.where(seq_lens[row] > 0, table[jnp.arange(items), pos // block_size], 0)
    cols = jnp.concatenate(
        [jnp.stack([pos, first, last, slot_page], axis=1), jnp.take_along_axis(table, at, axis=1)],
        axis=1,
    )
    own = -(-items // programs)
    cols = jnp.pad(cols, ((0, own * programs - items), (0, -cols.shape[1] % 32)))
    return cols.reshape(own, programs, -1).transpose(1, 0, 2)


def _chunks(src, dst):
    """(src, dst) cut along the last dim into TMA boxes of at most TILE_K."""
    n = src.shape[-1]
    if n <= TILE_K:
        return [(src, dst)]
    lead = (slice(None),) * (len(src.shape) - 1)
    return [
        (src.at[(*lead, pl.ds(i, TILE_K))], dst.at[(*lead, pl.ds(i, TILE_K))])
        for i in range(0, n, TILE_K)
    ]


def _start_copies(srcs_and_dsts, barriers, first: int = 0) -> int:
    """TMA copies GMEM -> SMEM, each box on its own barrier from `first` on; the boxes' count."""
    boxes = [box for pair in srcs_and_dsts for box in _chunks(*pair)]
    for i, (src, dst) in enumerate(boxes):
        plgpu.copy_gmem_to_smem(src, dst, barriers.at[first + i])
    return len(boxes)


def _wait_copies(barriers, first: int, count: int) -> None:
    for i in range(first, first + count):
        plgpu.barrier_wait(barriers.at[i])


def decoder_step_kernel(
    *refs,
    shape: DecoderShape,
    dtype,
    block_size: int,
    programs: int,
    splits: int,
    stages: int,
    rows: int,
    interpret: bool,
):
    """One program's share of the step. Refs: tiles, norms, qk_norms, (biases,) final_norm, head,
    (rope [R, 2, D/2] where the model has RoPE,) block_tables [R, pages], the items' scalars
    (`item_table`); h [R, E] float32, the L K and L V caches [H, blocks, block_size, D] (all three
    updated in place); the buffers between phases (q/k/v and gate/up partials, attention
    partials) and the logits [R, V]; scratch."""
    lay, e, hq, h_kv, d = shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim
    f, group, half = shape.intermediate, shape.group, shape.head_dim // 2
    starts, blocks = shape.phase_starts(), shape.phase_blocks()
    per_layer_tiles, items = starts[-1], rows * h_kv * splits
    schedule = decoder_schedule(shape, programs)
    targets, per_layer = schedule.targets(items), schedule.signals_a_layer(items)
    kt_e = e // TILE_K
    pages_per_tile = TOKENS // block_size
    head_rows = -(-(group + 2) // 4) * 4  # an item's q heads, k and v, a row a warp
    heads_layout, heads_col = _heads_layouts(half)

    tiles_ref, norms_ref, qk_norms_ref, *refs = refs
    biases_ref = refs.pop(0) if shape.biases else None
    final_norm_ref, head_ref, *refs = refs
    rope_ref = refs.pop(0) if shape.rope else None
    table_ref, items_ref, h_ref = refs[:3]
    k_refs, v_refs, rest = refs[3 : 3 + lay], refs[3 + lay : 3 + 2 * lay], refs[3 + 2 * lay :]
    qkv_ref, gu_ref, acc_ref, m_ref, l_ref, logits_ref = rest[:6]
    ring, ring_bar, h_smem, norm_smem, x_smem, o_smem, *rest = rest[6:]
    rope_smem = rest.pop(0) if shape.rope else None
    items_s, bars, *bias_ring = rest

    c = lax.axis_index("program")
    ops = _KernelOps(interpret)
    sem = ops.semaphore()
    bounds = phase_bounds(shape, c, programs)  # its tiles of each phase of a layer
    own = bounds[-1]  # its tiles a layer
    # The head's column blocks are dealt round-robin too, each taken with all its K ranges in
    # turn: the program sums its logits itself, no partials.
    head_tiles = _taken(c, programs, shape.head_blocks) * kt_e

    def head_tile(j):  # the program's j-th tile of the head: (its column block, its K range)
        return _dealt(j // kt_e, c, programs), j % kt_e

    # The ring's next fetch: (layer, s) of a layer's tile, (L, j) of the head's j-th; carried,
    # so no tile divides by the program's tile count.
    def fetch(at, slot):
        layer, s = at

        @pl.when(layer < lay)
        def _():
            tile = layer * per_layer_tiles + _dealt(s, c, programs)
            plgpu.copy_gmem_to_smem(tiles_ref.at[tile], ring.at[slot], ring_bar.at[slot])
            if shape.biases:  # the tile's bias beside it, on a barrier of its own
                bias_s, bias_bar = bias_ring
                plgpu.copy_gmem_to_smem(biases_ref.at[tile], bias_s.at[slot], bias_bar.at[slot])

        @pl.when((layer >= lay) & (s < head_tiles))
        def _():  # a box of the head's rows as they are: [64 of V, 256 of E], W^T's tile
            b, k = head_tile(s)
            box = head_ref.at[pl.ds(b * TILE_N, TILE_N), pl.ds(k * TILE_K, TILE_K)]
            plgpu.copy_gmem_to_smem(box, ring.at[slot], ring_bar.at[slot])

    def advance(at):
        layer, s = at
        wrap = (layer < lay) & (s + 1 >= own)
        return jnp.where(wrap, layer + 1, layer), jnp.where(wrap, 0, s + 1)

    # The first weight tiles' copies go out before the row inputs' wait.
    copies = [(rope_ref, rope_smem)] if shape.rope else []
    row_inputs = _start_copies([*copies, (items_ref.at[c], items_s)], bars)
    fetch_at = (jnp.where(own == 0, lay, 0), jnp.int32(0))
    for i in range(stages):
        fetch(fetch_at, i)
        fetch_at = advance(fetch_at)
    _wait_copies(bars, 0, row_inputs)

    def bf16(x):  # the weights' dtype's rounding, in float32
        return x.astype(dtype).astype(FLOAT)

    # A tile's 256 inputs are computed in the default (strided) layout, 2 a thread, then stored
    # for the matmul to load in COL, whose vectors every thread holds 64 of: elementwise work
    # there (the merge's exps, the norm) cost 32x the instructions and spilled registers.

    # 128 threads each 4 (2 where hidden is an odd multiple of 256) of h's elements a vector.
    h_layout = plgpu.Layout.WG_STRIDED((e,), math.gcd(4, e // 128))
    norm_rows = shape.norm_rows

    def normalize_h():
        """h normalized into SMEM once a run of a norm's tiles (its scale and shift's copy waited
        for too): h / rms(h), rounded as the model does, or LayerNorm's (h - mean) / std, whose
        one rounding comes with the scale and shift. The threads load h themselves: no TMA copy
        and barrier on the critical path."""
        # Every row's load issued before the first reduction: their latencies overlap (a
        # reduction's barrier kept each later row's load behind it).
        hs = [ops.load(h_ref.at[row], h_layout) for row in range(rows)]  # R x [E]
        _wait_copies(bars, 0, norm_rows * kt_e)
        for row, hh in enumerate(hs):
            if shape.layer_norm:
                hh = hh - jnp.sum(hh) / e
                h_smem[row] = hh * lax.rsqrt(jnp.sum(hh * hh) / e + shape.eps)
            else:
                h_smem[row] = bf16(hh * lax.rsqrt(jnp.sum(hh * hh) / e + shape.eps))
        plgpu.commit_smem()  # written by every thread before any reads another's part

    def start_norm(norm):  # a norm's scale (and shift) [2, E] copied into norm_smem
        _start_copies([(norm.at[i], norm_smem.at[i]) for i in range(norm_rows)], bars)

    def norm_input(k):
        """The tile's 256 inputs of the norm of h (h normalized, the layer's scale and shift in
        SMEM)."""
        cols = pl.ds(k * TILE_K, TILE_K)
        shift = norm_smem[1, cols] if shape.layer_norm else 0.0
        for row in range(rows):
            x_smem[row] = bf16(h_smem[row, cols] * norm_smem[0, cols] + shift)

    # The threads load the other programs' partials themselves, a row's loads all issued before
    # its sums: no TMA copy and barrier on the critical path, as normalize_h's h.
    part_layout = plgpu.Layout.WG_STRIDED((TILE_K,), 2)

    def merged_attention(k):
        """The tile's 256 attention outputs (of 256 / D query heads), merged over the splits."""
        cols = pl.ds(k * TILE_K, TILE_K)
        spanned = max(1, TILE_K // d)  # the query heads of the tile's columns
        head_of = ops.iota((TILE_K,), part_layout) // d  # [256]: a column's head among them

        def by_column(ref, i, row):  # [256]: split i's statistic of each column's query head
            heads = [k * spanned + j for j in range(spanned)]
            stats = [ref[i, row, qh // group, qh % group] for qh in heads]
            by_col = ops.full((TILE_K,), 0.0, part_layout) + stats[0]
            for j in range(1, spanned):
                by_col = jnp.where(head_of == j, stats[j], by_col)
            return by_col

        for row in range(rows):
            accs = [ops.load(acc_ref.at[i, row, cols], part_layout) for i in range(splits)]
            ms, sums = ([by_column(ref, i, row) for i in range(splits)] for ref in (m_ref, l_ref))
            top = functools.reduce(jnp.maximum, ms)
            ws = [jnp.exp(m - top) for m in ms]
            total = sum(x * w for x, w in zip(sums, ws, strict=True))
            o = sum(acc * w for acc, w in zip(accs, ws, strict=True))
            x_smem[row] = bf16(o / total)

    def mlp_input(k):
        """The tile's 256 inputs of silu(gate) * up, or of gelu_tanh(up), summed from the first
        projection's partials."""
        for row in range(rows):
            first, *up = [
                [
                    ops.load(gu_ref.at[j, row, pl.ds(i * f + k * TILE_K, TILE_K)], part_layout)
                    for j in range(kt_e)
                ]
                for i in range(1 if shape.gelu else 2)
            ]
            first, up = bf16(sum(first)), [bf16(sum(u)) for u in up]
            if shape.gelu:  # first: up
                x_smem[row] = bf16(_gelu_tanh(first))
            else:  # first: gate
                x_smem[row] = bf16(bf16(first / (1.0 + jnp.exp(-first))) * up[0])

    def on_layer(layer, copy):  # copy(k_ref, v_ref) with the layer's caches (a Ref pair a layer)
        _on_index(layer, lay, lambda i: copy(k_refs[i], v_refs[i]))

    def cached_pages(pos, i):  # the pages of 64-token tile i that hold cached tokens
        return jnp.clip((pos - i * TOKENS + block_size - 1) // block_size, 0, pages_per_tile)

    def item_scalars(item):  # [C]: the item's row of `item_table`, in SMEM
        return items_s.at[(item - c) // programs]

    def item_place(item):  # (row, KV head, split) of an attention item, as `item_table` deals them
        row, head_split = item // (h_kv * splits), item % (h_kv * splits)
        return row, head_split // splits, head_split % splits

    def start_tile(layer, item, i, pages, scratch: _ItemScratch):
        """Tile i of the item's cached pages (`pages`: a Ref of them) copied into its k_s, v_s
        (page j into rows j * block_size...)."""
        (_, head, _), pos = item_place(item), item_scalars(item)[0]
        (k_s, v_s), _ = scratch.kv_out_s
        page_bars = scratch.page_bars

        def copy(k_ref, v_ref):
            @pl.loop(0, cached_pages(pos, i))  # a loop, not unrolled: one copy site a layer
            def _(j):
                slots = pl.ds(j * block_size, block_size)
                for ref, dst, bar in ((k_ref, k_s, 2 * j), (v_ref, v_s, 2 * j + 1)):
                    plgpu.copy_gmem_to_smem(
                        ref.at[head, pages[j]], dst.at[slots], page_bars.at[bar]
                    )

        on_layer(layer, copy)

    def start_first_tile(layer, item, scratch: _ItemScratch):
        """The item's first tile's pages copied in, if it has a tile: they depend on no phase of
        the step."""
        scalars = item_scalars(item)
        first_pages = scalars.at[pl.ds(4, pages_per_tile)]
        start = functools.partial(start_tile, layer, item, scalars[1], first_pages, scratch)
        pl.when(scalars[1] < scalars[2])(start)

    def attention(layer, item, ready, scratch: _ItemScratch):
        """Item (row, head, split) of the layer, once `sem` counts `ready` (q/k/v stored): the
        row's query heads of the KV head over its range of 64-token tiles (the last split also the
        step's own token, which it appends to the cache). The program's first item's first tile
        was started with the layer."""
        row, head, split = item_place(item)
        scalars = item_scalars(item)
        pos, first, last = scalars[0], scalars[1], scalars[2]
        table = table_ref.at[row]

        def wait_tile(i, page_bars):
            @pl.loop(0, cached_pages(pos, i))
            def _(j):
                plgpu.barrier_wait(page_bars.at[2 * j])
                plgpu.barrier_wait(page_bars.at[2 * j + 1])

        qkn_s, kv_out_s, q_s, rows_s, stats_s, cur_s, copy_bars, page_bars = scratch
        (k_s, v_s), tile_s = kv_out_s  # the pages' tiles, then the output tile in their place
        pl.when(item != c)(lambda: start_first_tile(layer, item, scratch))

        def pages_in(i):  # tile i's pages landed, its rows past the context zeroed in V
            wait_tile(i, page_bars)

            @pl.when((i + 1) * TOKENS > pos)
            def _():  # the tile's rows past the context: stale or never written (NaN bits)
                rows = (i * TOKENS + ops.iota((TOKENS, d), WGMMA)) < pos
                v_s[...] = jnp.where(rows, ops.load(v_s, WGMMA), 0).astype(dtype)
                plgpu.commit_smem()

        # The first tile's pages, in flight since the layer began, in before the wait.
        with jax.named_scope("attention_pages"):
            pl.when(first < last)(lambda: pages_in(first))
        # Where the item's vectors start in q/k/v's partials: its query heads, k and v.
        starts = [(head * group + g) * d for g in range(group)]
        starts += [(hq + head) * d, (hq + h_kv + head) * d]
        scales = _start_copies([(qk_norms_ref.at[layer], qkn_s)], copy_bars)
        with jax.named_scope("attention_wait"):
            ops.wait_count(sem, ready)
        # The threads load the partials themselves (every load issued before the sums), a
        # half of each vector in every warp: no TMA copy and barrier on the critical path.
        with jax.named_scope("attention_inputs"):
            parts = [
                [
                    [
                        ops.load(qkv_ref.at[j, row, pl.ds(start + p * half, half)], heads_col)
                        for j in range(kt_e)
                    ]
                    for start in starts
                ]
                for p in (0, 1)
            ]
            _wait_copies(copy_bars, 0, scales)

        # Rows q_0..q_{G-1}, k, v (then padding) in halves of D, a row a warp: the partials'
        # sums, the norms' sums and RoPE's pairs (column j of both halves) stay in a thread
        # or its warp.
        def by_row(vec):  # [half] -> [head_rows, half], the same in every row
            return ops.cast(lax.broadcast_in_dim(vec, (head_rows, half), [1]), heads_layout)

        with jax.named_scope("attention_rope"):
            kind = ops.iota((head_rows, half), heads_layout)  # q heads, k, v (then v again)
            sums = []
            for vectors in parts:  # a half: [head_rows, half], vector r's sum in row r
                x = by_row(sum(vectors[0]))
                for r, partials in enumerate(vectors[1:], 1):
                    x = jnp.where(kind >= r, by_row(sum(partials)), x)
                sums.append(bf16(x))
            xs = sums
            if shape.qk_norm:
                sq = sum(jnp.sum(x * x, axis=1) for x in xs)
                inv = lax.rsqrt(sq / d + shape.eps)
                inv = ops.cast(lax.broadcast_in_dim(inv, (head_rows, half), [0]), heads_layout)
                xs = [
                    bf16(
                        bf16(x * inv)
                        * jnp.where(
                            kind < group,
                            by_row(ops.load(qkn_s.at[0, pl.ds(p * half, half)], heads_col)),
                            by_row(ops.load(qkn_s.at[1, pl.ds(p * half, half)], heads_col)),
                        )
                    )
                    for p, x in enumerate(xs)
                ]
            roped = xs
            if shape.rope:
                cos = by_row(ops.load(rope_smem.at[row, 0], heads_col))
                sin = by_row(ops.load(rope_smem.at[row, 1], heads_col))
                x1, x2 = xs
                roped = (bf16(x1 * cos - x2 * sin), bf16(x2 * cos + x1 * sin))
            for p, (x, y) in enumerate(zip(sums, roped, strict=True)):
                y = jnp.where(kind == group + 1, x, y)  # v: neither normed nor rotated
                rows_s[:, pl.ds(p * half, half)] = y
            plgpu.commit_smem()
        scale = 1.0 / math.sqrt(d)
        # The group's query heads as rows 0..G-1 of a 64-row WGMMA operand (the rest zero):
        # scores and P x V on the matrix units, and the softmax's reductions run along rows,
        # within a thread's quad (with tokens along rows, every tile summed across warps).
        with jax.named_scope("attention_q_tile"):
            ids = ops.iota((TOKENS, d), WGMMA)
            q_pad = ops.full((TOKENS, d), 0.0, WGMMA)
            for g in range(group):
                q_row = lax.broadcast_in_dim(ops.load(rows_s.at[g]), (TOKENS, d), [1])
                q_pad = jnp.where(ids == g, q_row, q_pad)
            q_s[...] = q_pad.astype(dtype)
            k_cur = lax.broadcast_in_dim(ops.load(rows_s.at[group]), (TOKENS, d), [1])
            s_cur = (q_pad * k_cur).sum(axis=1) * scale  # [64]: each head's own token's score
            plgpu.commit_smem()
        state = (  # a row's max and sum [64], its P x V [64, D]
            ops.full((TOKENS,), NEG_INF),
            ops.full((TOKENS,), 0.0),
            ops.full((TOKENS, d), 0.0, WGMMA),
        )

        def tile(i, state):
            m, l_sum, acc = state
            pages = table.at[pl.ds(i * pages_per_tile, pages_per_tile)]

            @pl.when(i != first)  # the first tile's pages are in and masked before the wait
            def _():
                start_tile(layer, item, i, pages, scratch)
                pages_in(i)

            valid = i * TOKENS + ops.iota((TOKENS,), COL) < pos

            s = ops.matmul(q_s, k_s, transpose_b=True)  # [64 (heads), 64 (tokens)]
            cols = lax.broadcast_in_dim(valid, (TOKENS, TOKENS), [1])
            s = jnp.where(cols, s * scale, NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_sum = l_sum * alpha + p.sum(axis=1)
            pv = ops.matmul(p.astype(dtype), v_s)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
            plgpu.commit_smem()  # every thread's reads done before the next tile's copies
            return m_new, l_sum, acc

        with jax.named_scope("attention_tiles"):
            m, l_sum, acc = lax.fori_loop(first, last, tile, state)
        # The last split adds the step's own token to its rows, on the tile as it is (split 0
        # has the most cached tiles at short contexts).
        with jax.named_scope("attention_merge"):
            # [64]: a select's operands alike
            owner = (ops.iota((TOKENS,)) >= 0) & (split == splits - 1)
            m_new = jnp.where(owner, jnp.maximum(m, s_cur), m)
            alpha = jnp.where(owner, jnp.exp(m - m_new), 1.0)
            p = jnp.where(owner, jnp.exp(s_cur - m_new), 0.0)
            v_cur = lax.broadcast_in_dim(ops.load(rows_s.at[group + 1]), (TOKENS, d), [1])
            tile_s[:, :d] = (
                acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                + lax.broadcast_in_dim(p, acc.shape, [0]) * v_cur
            )
            stats_s[0] = m_new
            stats_s[1] = l_sum * alpha + p
            plgpu.commit_smem()
        # What o_proj's merge reads: each head's P x V row, and its max and sum.
        for g in range(group):
            cols = pl.ds((head * group + g) * d, d)
            plgpu.copy_smem_to_gmem(tile_s.at[g, :d], acc_ref.at[split, row, cols])
        for i, dst in enumerate((m_ref, l_ref)):
            stats = stats_s.at[i, pl.ds(0, dst.shape[-1])]  # the group's, then padding
            plgpu.copy_smem_to_gmem(stats, dst.at[split, row, head])

        @pl.when(split == splits - 1)
        def _():
            at = (head, scalars[3], pos % block_size)
            cur = rows_s.at[pl.ds(group, 2)]  # the step's K and V rows
            cur_s[...] = ops.load(cur, plgpu.Layout.WG_STRIDED((2, d), 1)).astype(dtype)
            plgpu.commit_smem()

            def append(*refs):  # the step's K and V rows into its slot
                for r, ref in enumerate(refs):
                    plgpu.copy_smem_to_gmem(cur_s.at[r], ref.at[at])

            on_layer(layer, append)

        with jax.named_scope("attention_store"):  # its outputs and the append land
            plgpu.wait_smem_to_gmem(0)

    def wait_weights(slot):
        with jax.named_scope("weights_wait"):
            plgpu.barrier_wait(ring_bar.at[slot])

    def tile_product(slot):
        """The ring slot's weight tile times each row of x_smem: R float32 [64]; first, the
        store 2 tiles back has read `out` (whatever the caller writes next)."""
        x = ops.load(x_smem.at[0])
        w = ops.load(ring.at[slot], WGMMA, optimized=True).astype(FLOAT)
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        ys = []
        for row in range(rows):  # one row's inputs in registers at a time (64 a thread)
            x = ops.load(x_smem.at[row]) if row else x
            ys.append((w * lax.broadcast_in_dim(x, (TILE_N, TILE_K), [1])).sum(axis=1))
        return ys

    def weight_tile(phase, layer, s, carry):
        """This program's s-th tile of the layer (of `phase`): its inputs times the ring's
        slot, stored; the next fetch started. carry: (tiles taken, the next fetch)."""
        t, fetch_at = carry
        q = _dealt(s, c, programs) - starts[phase]
        k, b = q // blocks[phase], q % blocks[phase]  # the tile's K range and column block
        cols = pl.ds(b * TILE_N, TILE_N)
        # Each kind of input under a name of its own: what tells a profile's tiles apart.
        if phase in (QKV, GATE_UP):
            with jax.named_scope("norm_inputs"):
                norm_input(k)
        elif phase == O_PROJ:
            with jax.named_scope("merge_inputs"):
                merged_attention(k)
        else:
            with jax.named_scope("mlp_inputs"):
                mlp_input(k)
        plgpu.commit_smem()  # a tile's inputs written by every thread before any reads them
        slot = t % stages
        out = o_smem.at[t % 2]  # double-buffered: a store in flight while the next tile runs
        wait_weights(slot)
        with jax.named_scope("tile"):
            ys = tile_product(slot)
            if shape.biases:
                bias_s, bias_bar = bias_ring
                plgpu.barrier_wait(bias_bar.at[slot])
                bias = ops.load(bias_s.at[slot], ROW)
                ys = [y + bias for y in ys]
            for row, y in enumerate(ys):
                out[row] = y
            plgpu.commit_smem()  # the slot read and `out` written by every thread
        if phase == QKV:
            plgpu.copy_smem_to_gmem(out, qkv_ref.at[k, :, cols])
        elif phase == GATE_UP:
            plgpu.copy_smem_to_gmem(out, gu_ref.at[k, :, cols])
        else:
            ops.add_to_gmem(out, h_ref.at[:, cols])

        @pl.when(s == bounds[phase + 1] - 1)
        def _():  # the end of this program's run of the phase: its stores done, then counted
            with jax.named_scope("store_signal"):
                plgpu.wait_smem_to_gmem(0)
                ops.signal(sem)

        # After the signal: a release waits for this thread's TMA loads in flight, too.
        fetch(fetch_at, slot)
        return t + 1, advance(fetch_at)

    def phase_start(phase, layer, base):
        """Before a run of the phase's tiles: its wait, and a norm phase's norm of h."""
        norm = phase in (QKV, GATE_UP)
        if norm:  # the norm's scale does not depend on other programs: its copy starts first
            start_norm(norms_ref.at[layer, phase // 2])
        with jax.named_scope("phase_wait"):
            ops.wait_count(sem, base + targets[phase])
        if norm:
            with jax.named_scope("rms_norm"):
                normalize_h()

    def layer_step(scratch: _ItemScratch, layer, carry):
        """The layer's four phases, each this program's run of its tiles after its wait; its
        attention items between q/k/v and o_proj (its first item's first pages copied in from
        the start)."""
        base = layer * per_layer
        pl.when(c < items)(lambda: start_first_tile(layer, c, scratch))
        for phase in range(4):
            if phase == O_PROJ:  # this program's attention items (c, c + P, ...)

                @pl.loop(c, items, step=programs)
                def _(item):
                    ready = base + schedule.runs[QKV]
                    with jax.named_scope("attention"):
                        attention(layer, item, ready, scratch)
                        ops.signal(sem)

            start = functools.partial(phase_start, phase, layer, base)
            pl.when(bounds[phase] < bounds[phase + 1])(start)
            tile = functools.partial(weight_tile, phase, layer)
            carry = lax.fori_loop(bounds[phase], bounds[phase + 1], tile, carry)
        return carry

    def head_step(j, carry):
        """The head's j-th tile of this program: once every layer's last signal is counted, h
        under the final norm (as a layer's norm), its K range's 256 inputs times the tile,
        summed over the column block's K ranges in `accs` (R [64]) and stored after the last."""
        accs, t, fetch_at = carry
        b, k = head_tile(j)

        @pl.when(j == 0)
        def _():
            start_norm(final_norm_ref)
            with jax.named_scope("phase_wait"):
                ops.wait_count(sem, lay * per_layer)
            with jax.named_scope("rms_norm"):
                normalize_h()

        with jax.named_scope("head_inputs"):
            norm_input(k)
        plgpu.commit_smem()
        slot = t % stages
        wait_weights(slot)
        with jax.named_scope("tile"):
            rest = (ops.iota((TILE_N,)) >= 0) & (k > 0)  # [64]: a select's operands alike
            ys = tile_product(slot)
            ys = [y + jnp.where(rest, acc, 0.0) for y, acc in zip(ys, accs, strict=True)]
            plgpu.commit_smem()  # the slot read by every thread

        @pl.when(k == kt_e - 1)
        def _():
            out = o_smem.at[(j // kt_e) % 2]
            for row, y in enumerate(ys):
                out[row] = y
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out, logits_ref.at[:, pl.ds(b * TILE_N, TILE_N)])

        fetch(fetch_at, slot)
        return ys, t + 1, advance(fetch_at)

    def layers(*scratch):  # the attention items' SMEM, held through the layers' phases
        step = functools.partial(layer_step, _ItemScratch(*scratch))
        return lax.fori_loop(0, lay, step, (jnp.int32(0), fetch_at))

    t, fetch_at = pl.run_scoped(  # in `_ItemScratch`'s order
        layers,
        plgpu.SMEM((2, d), FLOAT),
        ops.union(
            (
                plgpu.SMEM((TOKENS, d), dtype, transforms=RING_TRANSFORMS),
                plgpu.SMEM((TOKENS, d), dtype, transforms=RING_TRANSFORMS),
            ),
            # tile_s's rows 8 floats apart past D: a WGMMA row store 512 bytes a row apart hits
            # 8 rows on the same banks
            plgpu.SMEM((TOKENS, d + 8), FLOAT),
        ),
        plgpu.SMEM((TOKENS, d), dtype, transforms=RING_TRANSFORMS),
        plgpu.SMEM((head_rows, d), FLOAT),
        plgpu.SMEM((2, TOKENS), FLOAT),
        plgpu.SMEM((2, d), dtype),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=2 * pages_per_tile),
    )
    zeros = [ops.full((TILE_N,), 0.0) for _ in range(rows)]
    lax.fori_loop(0, head_tiles, head_step, (zeros, t, fetch_at))
    plgpu.wait_smem_to_gmem(0)


_STATIC = ("shape", "programs", "splits", "stages", "interpret", "profile_dir")


def profile_ranges(shape: DecoderShape, programs: int, splits: int, rows: int) -> int:
    """The most named ranges a program records in a step (its profile's size): a layer's tiles
    (their inputs, weights' wait, the tile), its phases (wait, norm, stores and signal, the signal)
    and its attention items (the item, its eight parts and its signal); the head's tiles, its
    wait and norm."""
    tiles = int(decoder_schedule(shape, programs).counts.max())
    items = -(-rows * shape.kv_heads * splits // programs)
    head_tiles = _taken(0, programs, shape.head_blocks) * (shape.hidden // TILE_K)
    return shape.layers * (3 * tiles + 4 * 4 + 10 * items) + 3 * head_tiles + 2


MAX_ROWS = 16  # rows a step: each tile's product, inputs and buffers grow with them
STAGES = (4, 3, 2)  # weight tiles in flight a program that `decoder_step` tries, the most first


def default_splits(shape: DecoderShape, programs: int, rows: int = 1) -> int:
    """Attention items a row and KV head: what fits the programs, at most 8."""
    return max(1, min(8, programs // (rows * shape.kv_heads)))


def decoder_step_problems(
    shape: DecoderShape,
    dtype,
    block_size: int,
    *,
    programs: int,
    splits: int | None = None,
    stages: int = STAGES[0],
    rows: int = 1,
    interpret: bool = False,
    profile_dir: str = "",
    device: jax.Device | None = None,
) -> list[str]:
    """Why the kernel cannot run `rows` rows of a model of `shape` with `dtype` weights and caches
    of `block_size` tokens a page on `device` (default: jax's first; empty: it can)."""
    d, e, f = shape.head_dim, shape.hidden, shape.intermediate
    splits = default_splits(shape, programs, rows) if splits is None else splits
    problems = []
    if not 1 <= rows <= MAX_ROWS:
        problems.append(f"rows must be 1 to {MAX_ROWS}, got {rows}")
    if e % TILE_K or f % TILE_K or (shape.heads * d) % TILE_K or shape.qkv_width % TILE_N:
        problems.append(
            f"hidden, intermediate and heads x head_dim must be multiples of {TILE_K}"
            f" (got {e}, {f}, {shape.heads * d})"
        )
    if shape.vocab % TILE_N or shape.vocab < TILE_N:
        problems.append(f"the LM head's rows must be a multiple of {TILE_N}, got {shape.vocab}")
    if d % 64 or TILE_K % d or shape.heads % shape.kv_heads:  # 64: a WGMMA operand's tile
        problems.append("head_dim must be 64, 128 or 256, heads a multiple of kv_heads")
    if TOKENS % block_size or block_size % 8:
        problems.append(f"the cache's block_size must be 8, 16, 32 or 64, got {block_size}")
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        problems.append(f"weights and caches must be bf16 or fp16, got {jnp.dtype(dtype).name}")
    if min(programs, splits, stages) < 1:
        problems.append(f"programs, splits, stages must be >= 1, got {programs, splits, stages}")
    if interpret and programs != 1:  # the interpreter runs programs one after another
        problems.append(f"the interpreter runs one program (programs=1), got {programs}")
    if interpret and profile_dir:
        problems.append("the interpreter has no profiler: profile_dir needs a GPU")
    device = jax.devices()[0] if device is None else device
    capability = getattr(device, "compute_capability", None)
    if not interpret and capability is not None and not str(capability).startswith("9."):
        problems.append(f"a Hopper GPU (WGMMA: compute capability 9.x) is needed, got {capability}")
    sms = getattr(device, "core_count", None)
    if sms is not None and programs > sms:  # programs wait for each other: all must be resident
        problems.append(f"programs ({programs}) must not exceed the GPU's {sms} SMs")
    return problems


def decoder_step_arg_shapes(
    shape: DecoderShape, dtype, block_size: int, pages: int, rows: int = 1
) -> tuple:
    """`decoder_step`'s positional arguments as ShapeDtypeStructs (`rows` rows of `pages` pages,
    caches of `rows` x `pages` + 1 blocks): what lowering it for a GPU takes, with no GPU and no
    arrays."""
    d, f32 = shape.head_dim, jnp.float32
    tiles = shape.layers * sum(shape.phase_tiles())
    weights = {
        "tiles": jax.ShapeDtypeStruct((tiles, TILE_N, TILE_K), dtype),
        "norms": jax.ShapeDtypeStruct((shape.layers, 2, 2, shape.hidden), f32),
        "qk_norms": jax.ShapeDtypeStruct((shape.layers, 2, d), f32),
    }
    if shape.biases:
        weights["biases"] = jax.ShapeDtypeStruct((tiles, TILE_N), f32)
    weights["final_norm"] = jax.ShapeDtypeStruct((2, shape.hidden), f32)
    weights["head"] = jax.ShapeDtypeStruct((shape.vocab, shape.hidden), dtype)
    caches = [jax.ShapeDtypeStruct((shape.kv_heads, rows * pages + 1, block_size, d), dtype)]
    caches *= shape.layers
    return (
        weights,
        jax.ShapeDtypeStruct((rows, shape.hidden), f32),  # h
        jax.ShapeDtypeStruct((rows, 2, d // 2), f32),  # rope
        jax.ShapeDtypeStruct((rows, pages), jnp.int32),  # block_tables
        jax.ShapeDtypeStruct((rows,), jnp.int32),  # seq_lens
        caches,
        caches,
    )


@functools.cache
def decoder_step_lowering_problem(
    shape: DecoderShape,
    dtype,
    block_size: int,
    *,
    programs: int,
    splits: int | None = None,
    stages: int | None = None,
    rows: int = 1,
) -> str | None:
    """Why Mosaic GPU cannot build the kernel for these sizes (shared memory most often), or
    None: its own answer, from lowering one layer for a GPU, which needs none (a step's shared
    memory does not grow with its layers); `stages` None: at `default_stages`, as
    `decoder_step`'s default (the same cached lowerings). Seconds: for an engine's start, not a
    step."""
    if stages is None:
        stages = default_stages(
            shape, dtype, block_size, programs=programs, splits=splits, rows=rows
        )
    one = dataclasses.replace(shape, layers=1)
    args = decoder_step_arg_shapes(one, dtype, block_size, pages=1, rows=rows)
    step = functools.partial(
        decoder_step, shape=one, programs=programs, splits=splits, stages=stages
    )
    try:
        jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",))
    except (ValueError, NotImplementedError) as e:
        return f"Mosaic GPU cannot build it: {str(e).splitlines()[-1]}"
    return None


def default_stages(
    shape: DecoderShape,
    dtype,
    block_size: int,
    *,
    programs: int,
    splits: int | None = None,
    rows: int = 1,
) -> int:
    """The most weight stages of STAGES that Mosaic GPU builds the kernel with at these sizes
    (rows, hidden and head_dim take shared memory beside the ring); the fewest where none does
    (its lowering's error then says why)."""
    for stages in STAGES:
        problem = decoder_step_lowering_problem(
            shape, dtype, block_size, programs=programs, splits=splits, stages=stages, rows=rows
        )
        if problem is None:
            return stages
    return STAGES[-1]


def check_decoder_step(
    shape: DecoderShape,
    weights: dict,
    row_inputs: tuple,
    k_caches,
    *,
    programs,
    splits,
    stages,
    interpret,
    profile_dir,
) -> None:
    """ValueError unless the kernel can run these sizes (`row_inputs`: h, rope, block_tables,
    seq_lens, their rows h's)."""
    tiles, head, rows = weights["tiles"], weights["head"], row_inputs[0].shape[0]
    problems = decoder_step_problems(
        shape,
        tiles.dtype,
        k_caches[0].shape[2],
        programs=programs,
        splits=splits,
        stages=stages,
        rows=rows,
        interpret=interpret,
        profile_dir=profile_dir,
    )
    per_layer = sum(shape.phase_tiles())
    if tiles.shape != (shape.layers * per_layer, TILE_N, TILE_K):
        problems.append(f"tiles must be {(shape.layers * per_layer, TILE_N, TILE_K)}")
    if head.shape != (shape.vocab, shape.hidden) or head.dtype != tiles.dtype:
        problems.append(f"head must be {tiles.dtype} {(shape.vocab, shape.hidden)}")
    if k_caches[0].dtype != tiles.dtype:
        problems.append(f"caches must be of the weights' dtype {tiles.dtype}")
    h, rope, block_tables, seq_lens = (x.shape for x in row_inputs)
    if (h, rope, block_tables[:1], seq_lens) != (
        (rows, shape.hidden),
        (rows, 2, shape.head_dim // 2),
        (rows,),
        (rows,),
    ) or len(block_tables) != 2:
        problems.append(
            f"h, rope, block_tables, seq_lens must be [R, {shape.hidden}], [R, 2,"
            f" {shape.head_dim // 2}], [R, pages], [R], got {h, rope, block_tables, seq_lens}"
        )
    if len(k_caches) != shape.layers:
        problems.append(f"{shape.layers} layers of caches expected, got {len(k_caches)}")
    if problems:
        raise ValueError("decoder_step: " + "; ".join(problems))


@functools.partial(jax.jit, static_argnames=_STATIC)
def decoder_step(
    weights: dict,  # pack_decoder_weights | head_weights
    h: jax.Array,  # float32 [R, E]: each row's token's embedding
    rope: jax.Array,  # float32 [R, 2, D/2]: cos, sin of its position (not passed without RoPE)
    block_tables: jax.Array,  # int32 [R, pages]: each row's pages
    seq_lens: jax.Array,  # int32 [R]: each row's length with the step's token; 0: a dead row
    k_caches: list,  # L x [H, blocks, block_size, D]
    v_caches: list,  # L x [H, blocks, block_size, D]
    *,
    shape: DecoderShape,
    programs: int = 128,
    splits: int | None = None,
    stages: int | None = None,
    interpret: bool = False,
    profile_dir: str = "",
) -> tuple[jax.Array, jax.Array, list, list]:
    """R rows' decode step (R <= MAX_ROWS): their tokens' logits (float32 [R, V]: the final norm
    and LM head after every layer), h after every layer (float32 [R, E]) and the caches with
    the tokens' K/V appended (each row's slot its own). A dead row (length 0) attends to its own
    token alone and writes position 0 of block 0 (a scratch block): its pages are never read.
    `programs` must not exceed the GPU's SMs (all must be resident: they wait for each other).
    `splits` (attention items a row and KV head, dealt round-robin to the programs) defaults to
    what fits the programs, at most 8; `stages` (weight tiles in flight a program, 32 KiB of SMEM
    each) to the most of 4, 3, 2 that fits beside the rest (`default_stages`: 5 exceeds an
    H100's 227 KiB at Qwen3-0.6B's sizes; more rows, hidden or head_dim take more).
    `interpret=True` runs jax's Mosaic GPU interpreter, programs=1.
    `profile_dir`: Mosaic GPU's profiler writes there a trace of each program's named ranges (a
    JSON file a compiled call; `bench/decoder_trace.py` reads it); it takes
    4 x `profile_ranges` words of SMEM a program, which 2 stages leave room for."""
    tiles, rows = weights["tiles"], h.shape[0]
    if stages is None:  # (before splits resolve: the lowering the engine's check cached)
        stages = (
            STAGES[0]
            if interpret
            else default_stages(
                shape,
                tiles.dtype,
                k_caches[0].shape[2],
                programs=programs,
                splits=splits,
                rows=rows,
            )
        )
    splits = default_splits(shape, programs, rows) if splits is None else splits
    check_decoder_step(
        shape,
        weights,
        (h, rope, block_tables, seq_lens),
        k_caches,
        programs=programs,
        splits=splits,
        stages=stages,
        interpret=interpret,
        profile_dir=profile_dir,
    )
    lay, e, d = shape.layers, shape.hidden, shape.head_dim
    dtype, caches = tiles.dtype, [*k_caches, *v_caches]
    kt_e, q = e // TILE_K, shape.heads * d
    # Attention's softmax max (and sum) of each query head, a KV head's group padded to a 16-byte
    # TMA box.
    stats = jax.ShapeDtypeStruct((splits, rows, shape.kv_heads, -(-shape.group // 4) * 4), FLOAT)
    buffers = [
        jax.ShapeDtypeStruct((kt_e, rows, shape.qkv_width), FLOAT),
        jax.ShapeDtypeStruct((kt_e, rows, shape.up_width), FLOAT),
        jax.ShapeDtypeStruct((splits, rows, q), FLOAT),  # attention's P x V rows
        stats,
        stats,
        jax.ShapeDtypeStruct((rows, shape.vocab), FLOAT),  # the logits
    ]
    body = functools.partial(
        decoder_step_kernel,
        shape=shape,
        dtype=dtype,
        block_size=k_caches[0].shape[2],
        programs=programs,
        splits=splits,
        stages=stages,
        rows=rows,
        interpret=interpret,
    )
    items = item_table(
        block_tables,
        seq_lens,
        block_size=k_caches[0].shape[2],
        kv_heads=shape.kv_heads,
        splits=splits,
        programs=programs,
    )
    scratch = [
        # Tiled and swizzled as WGMMA operands are: a thread's loads of a tile in that layout
        # do not collide in SMEM banks (unswizzled rows 512 bytes apart all hit one bank).
        plgpu.SMEM((stages, TILE_N, TILE_K), dtype, transforms=RING_TRANSFORMS),
        plgpu.Barrier(num_barriers=stages),
        plgpu.SMEM((rows, e), FLOAT),  # h_smem
        plgpu.SMEM((shape.norm_rows, e), FLOAT),  # a norm's scale (and shift)
        plgpu.SMEM((rows, TILE_K), FLOAT),  # x_smem: a tile's inputs
        plgpu.SMEM((2, rows, TILE_N), FLOAT),  # o_smem: its outputs, double-buffered
    ]
    if shape.rope:  # where it always was: RoPE models' SMEM layout (a TMA target) as compiled
        scratch.append(plgpu.SMEM((rows, 2, d // 2), FLOAT))  # rope_smem
    scratch += [
        plgpu.SMEM(items.shape[1:], jnp.int32),  # items_s: the program's items' scalars
        plgpu.Barrier(num_barriers=max(2, shape.norm_rows * kt_e)),  # a norm's boxes (rope's: 2)
    ]
    if shape.biases:  # bias_ring: each weight tile's bias, on its own barriers
        scratch += [plgpu.SMEM((stages, TILE_N), FLOAT), plgpu.Barrier(num_barriers=stages)]
    # pl.kernel rather than plgpu.kernel: its operands may be Refs (h and the caches, written in
    # place under run_state below), which plgpu.kernel's batching wrapper does not pass through.
    kernel = pl.kernel(
        lambda *refs: pl.run_scoped(functools.partial(body, *refs), *scratch),
        out_type=buffers,
        mesh=plgpu.Mesh(grid=(programs,), grid_names=("program",)),
        compiler_params=plgpu.CompilerParams(
            # Each array's layout as written here (what the CPU's lowering checks), on every jax.
            lowering_semantics=plgpu.LoweringSemantics.Lane,
            # Its size in ranges; one more for the trace's header (3 words).
            profile_space=profile_ranges(shape, programs, splits, rows) + 1 if profile_dir else 0,
            profile_dir=profile_dir,
        ),
        interpret=_InterpretGPUParams() if interpret else False,
    )
    inputs = (tiles, weights["norms"], weights["qk_norms"])
    inputs += (weights["biases"],) if shape.biases else ()
    inputs += (weights["final_norm"], weights["head"])
    # Without RoPE nothing reads it, and XLA drops the unread operand's computation.
    inputs += (rope,) if shape.rope else ()
    inputs += (block_tables, items)

    def in_place(refs):  # the kernel writes h and the caches where they are
        h_ref, caches, logits_ref = refs
        logits_ref[...] = kernel(*inputs, h_ref, *caches)[-1]  # (XLA drops the zeros' fill)

    logits = jnp.zeros((rows, shape.vocab), FLOAT)
    h, caches, logits = pl.run_state(in_place)((h, caches, logits))
    return logits, h, caches[:lay], caches[lay:]


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype) -> jax.Array:
    """x / rms(x) along the last axis rounded to `dtype`, then times the scale, rounded."""
    x = (x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)).astype(dtype)
    return (x * scale).astype(dtype)


def _stream_norm(shape: DecoderShape, x: jax.Array, norm: jax.Array, dtype) -> jax.Array:
    """A norm of the float32 residual stream [E] (norm: float32 [2 (scale, shift), E]) in
    `dtype`, as the kernel rounds it."""
    scale, shift = norm
    if not shape.layer_norm:
        return _rms_norm(x, scale, shape.eps, dtype)  # its shift is zero
    x = x - jnp.mean(x)
    return (x * lax.rsqrt(jnp.mean(x * x) + shape.eps) * scale + shift).astype(dtype)


def decoder_head_reference(head: DecoderHead, shape: DecoderShape, h: jax.Array) -> jax.Array:
    """The logits (float32 [V]) of the residual stream h (float32 [E]) under the final norm."""
    x = _stream_norm(shape, h, head.norm, head.rows.dtype)
    return jnp.dot(head.rows, x, preferred_element_type=FLOAT)


def decoder_step_reference(
    layers: Sequence[DecoderLayer],
    head: DecoderHead,
    shape: DecoderShape,
    h: jax.Array,  # float32 [R, E]
    rope: jax.Array,  # float32 [R, 2, D/2]
    block_tables: jax.Array,  # int32 [R, pages]
    seq_lens: jax.Array,  # int32 [R]
    k_caches: list,
    v_caches: list,
) -> tuple[jax.Array, jax.Array, list, list]:
    """Plain XLA over the model's own weights (its `DecoderLayer`s and `DecoderHead`), with the
    kernel's rounding: the residual stream in float32, everything the model rounds rounded to the
    weights' dtype. (logits [R, V], h [R, E], k_caches, v_caches) as `decoder_step`: row after
    row (each reads and writes only its own pages)."""
    logits, hs = [], []
    for row in range(h.shape[0]):
        row_inputs = (h[row], rope[row], block_tables[row], seq_lens[row])
        out, h_row, k_caches, v_caches = _row_reference(
            layers, head, shape, *row_inputs, k_caches, v_caches
        )
        logits.append(out)
        hs.append(h_row)
    return jnp.stack(logits), jnp.stack(hs), k_caches, v_caches


def _row_reference(
    layers: Sequence[DecoderLayer],
    head: DecoderHead,
    shape: DecoderShape,
    h: jax.Array,  # float32 [E]
    rope: jax.Array,  # float32 [2, D/2]
    block_table: jax.Array,  # int32 [pages]
    seq_len: jax.Array,  # int32 []
    k_caches: list,
    v_caches: list,
) -> tuple[jax.Array, jax.Array, list, list]:
    """One row of `decoder_step_reference`: (logits [V], h [E], k_caches, v_caches)."""
    d, hq, h_kv = shape.head_dim, shape.heads, shape.kv_heads
    block_size = k_caches[0].shape[2]
    block_table = jnp.where(seq_len > 0, block_table, 0)  # a dead row's: block 0 (scratch)
    pos = jnp.maximum(seq_len - 1, 0)
    page, offset = block_table[pos // block_size], pos % block_size
    cos, sin = rope[:1], rope[1:]
    positions = jnp.arange(block_table.shape[0] * block_size)
    k_caches, v_caches = list(k_caches), list(v_caches)
    dtype = layers[0].dense[0][0].dtype

    def rms_norm(x, scale):
        return _rms_norm(x, scale, shape.eps, dtype)

    def input_norm(x, norm):  # a layer's norm of the residual stream
        return _stream_norm(shape, x, norm, dtype)

    def dense(x, part):  # float32 x @ W (+ b)
        kernel, bias = part
        y = jnp.dot(x.astype(dtype), kernel, preferred_element_type=FLOAT)
        return y if bias is None else y + bias.astype(FLOAT)

    for i, layer in enumerate(layers):
        qkv_p, o_p, up_p, down_p = layer.dense
        qkv = dense(input_norm(h, layer.norms[0]), qkv_p).astype(dtype).reshape(hq + 2 * h_kv, d)
        q, k, v = qkv[:hq], qkv[hq : hq + h_kv], qkv[hq + h_kv :]
        if shape.qk_norm:
            q, k = rms_norm(q, layer.qk_norms[0]), rms_norm(k, layer.qk_norms[1])
        if shape.rope:
            q, k = apply_rotary(q[None], cos, sin)[0], apply_rotary(k[None], cos, sin)[0]
        k_caches[i] = k_caches[i].at[:, page, offset].set(k)
        v_caches[i] = v_caches[i].at[:, page, offset].set(v)
        keys = k_caches[i][:, block_table].reshape(h_kv, -1, d).astype(FLOAT)  # [H, P*bs, D]
        vals = v_caches[i][:, block_table].reshape(h_kv, -1, d).astype(FLOAT)
        # Slots past the row's token hold anything (another sequence's, or NaN): not read.
        vals = jnp.where((positions <= pos)[:, None], vals, 0.0)
        qg = q.reshape(h_kv, hq // h_kv, d).astype(FLOAT)
        scores = jnp.einsum("hgd,htd->hgt", qg, keys) / math.sqrt(d)
        scores = jnp.where(positions <= pos, scores, NEG_INF)
        out = jnp.einsum("hgt,htd->hgd", jax.nn.softmax(scores, axis=-1), vals)
        h = h + dense(out.reshape(-1), o_p)
        up = dense(input_norm(h, layer.norms[1]), up_p).astype(dtype).astype(FLOAT)
        if shape.gelu:
            x = _gelu_tanh(up)
        else:
            g, u = jnp.split(up, 2)
            x = jax.nn.silu(g).astype(dtype) * u
        h = h + dense(x, down_p)
    return decoder_head_reference(head, shape, h), h, k_caches, v_caches
