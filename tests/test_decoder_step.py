"""The one-kernel decode step (`pallas_kernels.decoder_step`; Llama family, Qwen2, GPT-2): its XLA
reference against the model's own decode step (CPU, fp32, checkpoints written by transformers),
and the kernel against that reference (bf16, poisoned caches, every element compared): on the
CPU in jax's Mosaic GPU interpreter at one program (which needs no grid waits; it ignores
layouts, so the CPU also lowers the kernel for a GPU at several shapes), on a GPU compiled at
many."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.common import random_hf_model
from pallas_kernels.decoder_step import (
    DOWN,
    GATE_UP,
    O_PROJ,
    QKV,
    DecoderShape,
    decoder_schedule,
    decoder_step,
    decoder_step_arg_shapes,
    decoder_step_lowering_problem,
    decoder_step_reference,
    default_stages,
    item_table,
    pack_decoder_weights,
    phase_bounds,
)
from rosejax import LLM, SamplingParams
from rosejax.layers.attention import ForwardMetadata
from rosejax.layers.kv_cache import init_kv_cache
from rosejax.models import family, family_of, one_kernel_step_programs, preset
from rosejax.models import one_kernel_step as one_kernel_step_module
from rosejax.models.loader import load_checkpoint
from rosejax.models.one_kernel_step import DECODER_STEP, with_decoder_step
from rosejax.settings import XLA_KERNELS, KernelConfig
from rosejax.tokenizer import packaged_gpt2_tokenizer_path
from tests.conftest import assert_matches_hf_greedy

BLOCK_SIZE = 8
# The kernel's tiles want hidden, intermediate and heads x head_dim in multiples of 256.
SHAPES = {
    "qwen3-g2-hd64-tied": (
        "qwen3",
        dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
        | dict(head_dim=64, tie_word_embeddings=True),
    ),
    "llama-g4-hd128-untied": (
        "llama",
        dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=1)
        | dict(head_dim=128, tie_word_embeddings=False),
    ),
    "qwen2-g2-hd64-bias": (  # q/k/v biases
        "qwen2",
        dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
        | dict(head_dim=64),
    ),
    "gpt2-mha-hd64": ("gpt2", dict(hidden_size=256, num_attention_heads=4, n_inner=512)),
}


# Wider, for the kernel alone: q/k/v, o_proj and gate/up over two K ranges of 256, down three.
GPT2_E512 = ("gpt2", dict(n_embd=512, n_head=8, n_layer=2, n_inner=1024))  # MHA, head_dim 64
E512 = (
    "llama",
    dict(hidden_size=512, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2)
    | dict(head_dim=128),
)
# Llama 3.2 1B's widths with 8 query / 2 KV heads of 256: its attention's SMEM leaves room for 2
# weight stages only.
LLAMA_HD256 = dataclasses.replace(
    preset("llama-3.2-1b"), head_dim=256, num_attention_heads=8, num_key_value_heads=2
)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=list(SHAPES))
def hf_checkpoint(request, tmp_path_factory):
    """(checkpoint dir, the HF model) for each shape."""
    model_type, kwargs = SHAPES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = random_hf_model(
        model_type,
        seed=3,
        initializer_range=0.1,
        vocab_size=300,
        num_hidden_layers=2,
        max_position_embeddings=160,
        **kwargs,
    )
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoint):
    """(config, fp32 params) of each shape."""
    return load_checkpoint(hf_checkpoint[0], "float32")


def step_inputs(config, params, cached: int, rng):
    """A prompt of `cached` tokens prefilled by the model, then the step's token: (the model's
    logits and caches after the step, the reference's inputs)."""
    forward = jax.jit(family_of(config).forward, static_argnums=1)
    pages = -(-config.max_model_len // BLOCK_SIZE)
    table = jnp.asarray(1 + rng.permutation(pages), jnp.int32)  # pages out of order
    cache = init_kv_cache(config, pages + 1, BLOCK_SIZE, jnp.float32)
    tokens = rng.integers(0, config.vocab_size, cached + 1).astype(np.int32)

    def run(start, n, cache):
        meta = ForwardMetadata(
            positions=jnp.arange(start, start + n, dtype=jnp.int32)[None],
            seq_lens=jnp.asarray([start + n], jnp.int32),
            block_tables=table[None],
        )
        return forward(params, config, jnp.asarray(tokens[None, start : start + n]), cache, meta)

    if cached:
        _, cache = run(0, cached, cache)
    before = cache
    logits, after = run(cached, 1, cache)
    h, rope = family_of(config).one_kernel_inputs(params, config, tokens[cached], cached)
    inputs = (h[None], rope[None], table[None], jnp.asarray([cached + 1], jnp.int32))  # 1 row
    return logits[0, 0], after, inputs, before


@pytest.mark.parametrize("cached", [0, pytest.param(9, marks=pytest.mark.slow), 77, 150])
def test_reference_matches_model(checkpoint, cached):
    """Logits and caches after one step: the reference (float32 residual, fp32 weights: no
    rounding) against the model's forward of one token, across 64-token tiles and pages."""
    config, params = checkpoint
    shape = shape_of(config)
    logits, after, inputs, before = step_inputs(config, params, cached, np.random.default_rng(7))
    parts = (layers_of(config, params), head_of(config, params), shape)
    reference = jax.jit(decoder_step_reference, static_argnums=2)  # one program, not an op's each
    got, _, ks, vs = reference(*parts, *inputs, before.k, before.v)
    assert got.shape == (1, shape.vocab) and shape.vocab % 64 == 0
    assert rel_err(got[0, : config.vocab_size], logits) <= 1e-5
    for got, want in zip(ks + vs, after.k + after.v, strict=True):
        assert rel_err(got, want) <= 1e-5


def test_pack_decoder_weights_tiles(checkpoint):
    """Layer 1's tiles, for q/k/v, o_proj, gate/up and down in turn: tile k * N/64 + b of a
    matmul is W[k*256 : (k+1)*256, b*64 : (b+1)*64] transposed."""
    config, params = checkpoint
    shape = shape_of(config)
    packed = pack_decoder_weights(layers_of(config, params), shape)
    tiles = np.asarray(packed["tiles"])
    per_layer, rng = sum(shape.phase_tiles()), np.random.default_rng(0)
    if config.model_type == "gpt2":
        attn, mlp = params["h_1"]["attn"], params["h_1"]["mlp"]
        denses = (attn["c_attn"], attn["c_proj"], mlp["c_fc"], mlp["c_proj"])
    else:
        attn, mlp = params["layers_1"]["self_attn"], params["layers_1"]["mlp"]
        denses = (attn["qkv_proj"], attn["o_proj"], mlp["gate_up_proj"], mlp["down_proj"])
    start = per_layer
    for dense, n in zip(denses, shape.phase_tiles(), strict=True):
        w = np.asarray(dense["kernel"])
        blocks = w.shape[1] // 64
        assert n == w.shape[0] // 256 * blocks
        for i in rng.choice(n, 3, replace=False):
            k, b = divmod(int(i), blocks)
            want = w[k * 256 : (k + 1) * 256, b * 64 : (b + 1) * 64].T
            np.testing.assert_array_equal(tiles[start + i], want)
            if shape.biases:  # K range 0's tiles carry the bias of their columns (or zeros)
                bias = dense.get("bias", np.zeros(w.shape[1]))[b * 64 : (b + 1) * 64]
                bias = bias if k == 0 else np.zeros(64)
                np.testing.assert_array_equal(packed["biases"][start + i], bias)
        start += n
    assert start == 2 * per_layer == len(tiles)


def schedule_events(shape, programs: int, splits: int, layers: int) -> list[list[tuple]]:
    """Each program's waits and signals over `layers` layers, as the kernel makes them from
    `decoder_schedule` and `phase_bounds`: ("wait", count, what it then reads), ("signal", what
    it stored)."""
    schedule = decoder_schedule(shape, programs)
    items = shape.kv_heads * splits
    targets, per_layer = schedule.targets(items), schedule.signals_a_layer(items)
    events = []
    for c in range(programs):
        bounds = phase_bounds(shape, c, programs)
        mine = []
        for layer in range(layers):
            base = layer * per_layer
            for phase in range(4):
                if phase == O_PROJ:  # the program's attention items, after its q/k/v run
                    for _ in range(c, items, programs):
                        mine += [("wait", base + schedule.runs[QKV], (layer, "items"))]
                        mine += [("signal", (layer, "items"))]
                if bounds[phase] < bounds[phase + 1]:
                    mine.append(("wait", base + targets[phase], (layer, phase)))
                    mine.append(("signal", (layer, phase)))
        events.append(mine)
    return events


@pytest.mark.parametrize(
    "block_size,kv_heads,splits,programs", [(16, 8, 4, 132), (64, 2, 3, 5), (32, 1, 1, 4)]
)
def test_item_table_holds_each_items_scalars(block_size, kv_heads, splits, programs):
    """Item j * P + c's row at [c, j]: its row's position, its tiles [first, last) of an even
    split of the row's 64-token tiles, the page of the step's slot and its first tile's pages
    (clamped to the table's last column); the padding past the items and columns is zero."""
    rng = np.random.default_rng(block_size + programs)
    rows, width = 3, 256 // block_size
    seq_lens = rng.integers(1, 257, rows).astype(np.int32)
    seq_lens[0] = 1  # a row with an empty cache
    tables = rng.integers(0, 1000, (rows, width)).astype(np.int32)
    got = np.asarray(
        item_table(
            jnp.asarray(tables),
            jnp.asarray(seq_lens),
            block_size=block_size,
            kv_heads=kv_heads,
            splits=splits,
            programs=programs,
        )
    )
    items, per_tile = rows * kv_heads * splits, 64 // block_size
    assert got.shape == (programs, -(-items // programs), 32)
    want = np.zeros_like(got)
    for item in range(items):
        row, split = item // (kv_heads * splits), item % splits
        pos = int(seq_lens[row]) - 1
        tiles = -(-pos // 64)
        per_split = -(-tiles // splits)
        first = min(split * per_split, tiles)
        last = min(first + per_split, tiles)
        pages = [tables[row, min(first * per_tile + j, width - 1)] for j in range(per_tile)]
        scalars = [pos, first, last, tables[row, pos // block_size], *pages]
        want[item % programs, item // programs, : len(scalars)] = scalars
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "preset_name,programs",
    [("qwen3-0.6b", 132), ("qwen3-0.6b", 128), ("qwen3-0.6b", 37), ("llama-3.2-1b", 132)],
)
def test_decoder_schedule_orders_every_phase(preset_name, programs):
    """Every tile of a layer taken once, each phase's by min(programs, its tiles) programs;
    and the programs' waits and signals played out together (one step of whichever program
    can move): none is left waiting, and each wait ends only once every producer of what
    follows has signalled (the previous layer for q/k/v, q/k/v for the attention items, the
    items for o_proj, then each phase for the next)."""
    shape = shape_of(preset(preset_name).with_num_layers(3))
    schedule = decoder_schedule(shape, programs)
    taken = schedule.tiles[schedule.tiles >= 0]
    assert sorted(taken.tolist()) == list(range(sum(shape.phase_tiles())))
    assert schedule.runs == tuple(min(programs, n) for n in shape.phase_tiles())
    starts = shape.phase_starts()
    for c in range(programs):  # the kernel's runs of a phase: exactly its tiles of the phase
        bounds = phase_bounds(shape, c, programs)
        mine = schedule.tiles[c, : schedule.counts[c]]
        assert bounds[-1] == schedule.counts[c]
        for p in range(4):
            run = mine[bounds[p] : bounds[p + 1]]
            assert ((starts[p] <= run) & (run < starts[p + 1])).all()
            assert len(run) == ((starts[p] <= mine) & (mine < starts[p + 1])).sum()
    splits = min(8, programs // shape.kv_heads)
    items = shape.kv_heads * splits
    events = schedule_events(shape, programs, splits, layers=3)
    producers = {QKV: None, "items": QKV, O_PROJ: "items", GATE_UP: O_PROJ, DOWN: GATE_UP}
    expected = {QKV: schedule.runs[QKV], "items": items, O_PROJ: schedule.runs[O_PROJ]}
    expected |= {GATE_UP: schedule.runs[GATE_UP], DOWN: schedule.runs[DOWN]}
    signalled, count, at = {}, 0, [0] * programs
    while any(a < len(e) for a, e in zip(at, events, strict=True)):
        moved = False
        for c, mine in enumerate(events):
            while at[c] < len(mine):
                kind, *what = mine[at[c]]
                if kind == "wait":
                    target, (layer, phase) = what
                    if count < target:
                        break
                    if phase == QKV:  # the whole previous layer
                        done = [signalled.get((layer - 1, p), 0) for p in expected]
                        assert layer == 0 or done == list(expected.values())
                    else:
                        producer = producers[phase]
                        assert signalled.get((layer, producer), 0) == expected[producer]
                else:
                    signalled[what[0]] = signalled.get(what[0], 0) + 1
                    count += 1
                at[c] += 1
                moved = True
        assert moved, "the programs wait for each other"
    assert count == 3 * schedule.signals_a_layer(items)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,hidden,dtype,gpt2,rows",
    [
        (4, 2, 64, 16, 256, jnp.bfloat16, False, 1),
        (8, 2, 128, 8, 512, jnp.float16, False, 1),
        pytest.param(12, 2, 64, 32, 768, jnp.bfloat16, False, 1, marks=pytest.mark.slow),
        pytest.param(8, 1, 128, 64, 512, jnp.bfloat16, False, 1, marks=pytest.mark.slow),
        (2, 2, 256, 16, 256, jnp.float16, False, 1),
        (12, 12, 64, 16, 768, jnp.float16, True, 1),  # GPT-2 small's layer
        (8, 2, 128, 16, 512, jnp.bfloat16, False, 4),
        pytest.param(12, 12, 64, 16, 768, jnp.float16, True, 8, marks=pytest.mark.slow),
    ],
)
def test_decoder_step_lowers_for_a_gpu(
    heads, kv_heads, head_dim, block_size, hidden, dtype, gpt2, rows
):
    """The compiled kernel's every array layout, shared-memory alias and copy is checked as jax
    lowers it for a GPU, which needs none: head_dim 64, 128 and 256, groups of 1 to 8 query
    heads (4 or 8 rows a head layout), pages of 8 to 64 tokens, hidden 256 to 768 (h's layout
    takes 2 or 4 elements a vector), GPT-2's LayerNorm, biases and GELU without RoPE, and 4 or 8
    rows a step."""
    shape = DecoderShape(
        layers=2,
        hidden=hidden,
        intermediate=512,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        eps=1e-6,
        qk_norm=not gpt2,
        layer_norm=gpt2,
        biases=gpt2,
        gelu=gpt2,
        rope=not gpt2,
        vocab=384,
    )
    args = decoder_step_arg_shapes(shape, dtype, block_size, pages=6, rows=rows)

    def step(*args):
        return decoder_step(*args, shape=shape, programs=16, splits=3, stages=2)

    text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1


def test_decoder_step_rejects_what_it_cannot_run(checkpoint):
    config, params = checkpoint
    shape = shape_of(config)
    weights = step_weights(config, params)
    cache = init_kv_cache(config, 4, BLOCK_SIZE, jnp.float32)
    args = (weights, jnp.zeros((1, shape.hidden)), jnp.zeros((1, 2, shape.head_dim // 2)))
    args += (jnp.zeros((1, 2), jnp.int32), jnp.ones(1, jnp.int32), cache.k, cache.v)
    with pytest.raises(ValueError, match="bf16 or fp16"):  # fp32 weights
        decoder_step(*args, shape=shape, programs=2, splits=1, stages=2)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), (weights, cache.k, cache.v))
    if shape.biases:
        bf16[0]["biases"] = weights["biases"]  # float32, as packed
    args = (bf16[0], *args[1:5], bf16[1], bf16[2])
    with pytest.raises(ValueError, match="one program"):  # the interpreter runs them in turn
        decoder_step(*args, shape=shape, programs=2, splits=1, stages=2, interpret=True)
    with pytest.raises(ValueError, match="no profiler"):
        decoder_step(*args, shape=shape, programs=1, splits=1, interpret=True, profile_dir="/tmp")
    narrow = dataclasses.replace(shape, head_dim=32)  # narrower than a WGMMA operand's tile
    with pytest.raises(ValueError, match="head_dim must be 64, 128 or 256"):
        decoder_step(*args, shape=narrow, programs=1, splits=1, stages=2, interpret=True)
    unpadded = dataclasses.replace(shape, vocab=config.vocab_size)  # 300 rows: no 64-row blocks
    with pytest.raises(ValueError, match="head's rows must be a multiple of 64"):
        decoder_step(*args, shape=unpadded, programs=1, splits=1, stages=2, interpret=True)
    two_h = (args[0], jnp.zeros((2, shape.hidden)), *args[2:])  # 2 rows of h, 1 of the rest
    with pytest.raises(ValueError, match="h, rope, block_tables, seq_lens must be"):
        decoder_step(*two_h, shape=shape, programs=1, splits=1, stages=2, interpret=True)
    many = [jnp.repeat(x, 17, axis=0) for x in args[1:5]]
    with pytest.raises(ValueError, match="rows must be 1 to 16"):
        decoder_step(args[0], *many, *args[5:], shape=shape, programs=1, splits=1, interpret=True)


GPU = jax.default_backend() == "gpu"


@pytest.fixture
def mosaic_gpu_interpreter(monkeypatch):
    """jax's Mosaic GPU interpreter as jax 0.11 has it: before 0.11 it took a `pl.kernel`'s
    operands, which carry no memory space, for scratch to allocate; 0.11 takes them for GMEM,
    as the compiler does."""
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    monkeypatch.setattr(
        gpu_callbacks,
        "is_gmem_memory_space",
        lambda space: space is None or space == gpu_core.MemorySpace.GMEM,
    )


def shape_of(config) -> DecoderShape:
    return family_of(config).decoder_shape(config)


def layers_of(config, params) -> list:
    return family_of(config).decoder_layers(params, config)


def head_of(config, params):
    return family_of(config).decoder_head(params, config)


def with_step_weights(config, params) -> dict:
    return with_decoder_step(
        params, shape_of(config), lambda p: layers_of(config, p), lambda p: head_of(config, p)
    )


def step_weights(config, params) -> dict:
    """The kernel's weights: the layers packed, the final norm and the head."""
    return with_step_weights(config, params)[DECODER_STEP]


def wide_params(config, seed: int, rng) -> dict:
    """bf16 random params whose every part moves h: weights 5x the init (std 0.1), norm scales
    random around 1."""

    def widen(path, x):
        if path[-1].key == "scale":
            return jnp.asarray(1 + 0.5 * rng.normal(size=x.shape), jnp.bfloat16)
        if path[-1].key == "bias":  # GPT-2's (zeros at init)
            return jnp.asarray(0.1 * rng.normal(size=x.shape), jnp.bfloat16)
        return (x * 5).astype(jnp.bfloat16)

    params = family_of(config).random_params(config, seed=seed, dtype=jnp.float32)
    return jax.tree_util.tree_map_with_path(widen, params)


def check_kernel_against_reference(
    config, *, programs, splits, stages, cached, block_size, pages, interpret=False
):
    """The kernel against `decoder_step_reference` (bf16 random params) on caches poisoned with
    random values (NaN past each row's token, in its pages: slots the step must not read), for a
    row of each length in `cached` (its tokens in the cache; each row's pages its own, out of
    order; -1: a dead row, length 0, every page of its table NaN, its K/V to block 0's first
    slot): what the layers add to each row's h, every 64-logit block of the head's, each row's
    K/V slot of every layer, and every other cache element kept."""
    shape, rows = shape_of(config), len(cached)
    rng = np.random.default_rng(sum(cached))
    params = wide_params(config, sum(cached), rng)
    weights = step_weights(config, params)
    tables = jnp.asarray(1 + rng.permutation(rows * pages).reshape(rows, pages), jnp.int32)
    cache_shape = (shape.kv_heads, rows * pages + 1, block_size, shape.head_dim)
    layers = range(shape.layers)
    ks, vs = ([rng.normal(size=cache_shape) for _ in layers] for _ in "kv")
    for table, n in zip(np.asarray(tables), cached, strict=True):
        stale = np.arange(n + 1, pages * block_size)  # past the row's token: NaN, never read
        for cache in ks + vs:
            cache[:, table[stale // block_size], stale % block_size] = np.nan
    ks, vs = ([jnp.asarray(c, jnp.bfloat16) for c in caches] for caches in (ks, vs))
    inputs = family_of(config).one_kernel_inputs
    rope = jnp.stack([inputs(params, config, 0, max(n, 0))[1] for n in cached])
    h0 = jnp.asarray(rng.normal(size=(rows, shape.hidden)), jnp.float32)
    inputs = (h0, rope, tables, jnp.asarray(cached, jnp.int32) + 1)
    parts = (layers_of(config, params), head_of(config, params), shape)
    want = decoder_step_reference(*parts, *inputs, ks, vs)
    got = decoder_step(
        weights,
        *inputs,
        ks,
        vs,
        shape=shape,
        programs=programs,
        splits=splits,
        stages=stages,
        interpret=interpret,
    )
    for row in range(rows):
        assert rel_err(got[1][row] - h0[row], want[1][row] - h0[row]) <= 2e-2
    # Block by block (a block the head's tiles missed holds whatever the buffer held), against
    # the blocks' RMS norm where a block is small (the padded rows' logits are zeros). 3%: the
    # bf16 roundings of three layers reach 2.2% in a block of Qwen3-0.6B's 2,374 a row (on an
    # H100, the kernel at one row as at four); a missed or misplaced block is off by ~100%.
    blocks = [np.asarray(x, np.float32).reshape(-1, 64) for x in (got[0], want[0])]
    typical = np.linalg.norm(blocks[1]) / np.sqrt(len(blocks[1]))
    for g, w in zip(*blocks, strict=True):
        assert np.linalg.norm(g - w) <= 3e-2 * max(np.linalg.norm(w), typical)
    for g, w, before in zip(got[2] + got[3], want[2] + want[3], ks + vs, strict=True):
        g, w, before = (np.asarray(a, np.float32) for a in (g, w, before))
        written = np.zeros(g.shape, bool)
        for table, n in zip(np.asarray(tables), cached, strict=True):
            written[:, table[n // block_size] if n >= 0 else 0, max(n, 0) % block_size] = True
        np.testing.assert_array_equal(g[~written], before[~written])
        assert rel_err(g[written], w[written]) <= 2e-2


@pytest.mark.skipif(GPU, reason="compiled on a GPU: test_decoder_step_matches_reference")
@pytest.mark.parametrize(
    "name,splits,stages,cached",
    [
        pytest.param("qwen3-g2-hd64-tied", 1, 1, (0,), marks=pytest.mark.slow),
        pytest.param("qwen3-g2-hd64-tied", 3, 3, (77,), marks=pytest.mark.slow),
        ("llama-g4-hd128-untied", 2, 2, (150,)),
        pytest.param("llama-g4-hd128-untied", 1, 4, (9,), marks=pytest.mark.slow),
        pytest.param("llama-g2-hd128-e512", 2, 3, (70,), marks=pytest.mark.slow),
        ("gpt2-hd64-e512", 2, 2, (70,)),
        pytest.param("qwen2-g2-hd64-bias", 2, 1, (33,), marks=pytest.mark.slow),
        pytest.param("gpt2-hd64-e512", 1, 3, (5,), marks=pytest.mark.slow),
        ("qwen3-g2-hd64-tied", 2, 2, (70, 3, -1, 130)),  # rows of other lengths, a dead one
        pytest.param("gpt2-hd64-e512", 1, 3, (20, 90), marks=pytest.mark.slow),
        ("gpt2-hd64-e512", 4, 2, (5,)),  # splits 1 and 2 have no tile
        pytest.param("qwen3-g2-hd64-tied", 4, 2, (70, 3, 130), marks=pytest.mark.slow),
    ],
)
def test_decoder_step_interpreted_matches_reference(
    mosaic_gpu_interpreter, name, splits, stages, cached
):
    """One program does every tile and attention item in turn (2 layers; splits that leave
    items empty, a ring of 1-4 tiles, contexts across 64-token tiles and 8-token pages; hidden
    512: two K ranges and two ranges of down's outputs; 2 and 3 rows a step)."""
    extra = {"llama-g2-hd128-e512": E512, "gpt2-hd64-e512": GPT2_E512}
    model_type, kwargs = {**SHAPES, **extra}[name]
    hf = dict(model_type=model_type, num_hidden_layers=2, vocab_size=300, **kwargs)
    config = family(model_type).config_from_hf(hf)
    check_kernel_against_reference(
        config,
        programs=1,
        splits=splits,
        stages=stages,
        cached=cached,
        block_size=BLOCK_SIZE,
        pages=24,
        interpret=True,
    )


SETTINGS = [
    (128, 8, 4, (0,)),
    (128, 8, 4, (200,)),
    (132, 16, 3, (63,)),
    (37, 4, 2, (64,)),
    (96, 12, 4, (1000,)),
    (132, None, 3, (100, 7, -1, 300, 40)),  # -1: a dead row
    (132, None, 2, (5, 64, 65, 1, 900, 17, 128, 33)),
]


@pytest.mark.skipif(not GPU, reason="the persistent kernel's grid waits need a GPU")
@pytest.mark.parametrize(
    "model,programs,splits,stages,cached",
    [(model, *settings) for model in ("qwen3-0.6b", "gpt2") for settings in SETTINGS]
    + [
        (m, 132, None, None, (100,))
        for m in ("gpt2-medium", "gpt2-large", "llama-3.2-1b", "llama-3.1-8b")
    ],
)
def test_decoder_step_matches_reference(model, programs, splits, stages, cached):
    """Qwen3-0.6B's widths (16 query / 8 KV heads of 128, 3,072 MLP units) and GPT-2's (12
    heads of 64, biases, LayerNorm, GELU) under several settings, one row and 4 or 8 rows of
    other lengths, and at the engine's defaults the other widths its auto runs the step for
    (GPT-2 medium and large: hidden 1,024 and 1,280; Llama 3.2 1B: 32 / 8 heads of 64; Llama 3.1
    8B: hidden 4,096, 14,336 MLP units), 3 layers."""
    config = preset(model)
    config = config.with_num_layers(3)
    programs = min(programs, getattr(jax.devices()[0], "core_count", 128))
    check_kernel_against_reference(
        config,
        programs=programs,
        splits=splits,
        stages=stages,
        cached=cached,
        block_size=16,
        pages=80,
    )


def test_forward_without_the_kernel_ignores_its_weights(checkpoint):
    """Params carrying the one-kernel step's weights run the layer path unchanged when
    `decoder_step_programs` is 0 (the CPU's default): the same logits and caches."""
    config, params = checkpoint
    packed = with_step_weights(config, params)
    assert DECODER_STEP in packed and DECODER_STEP not in params
    rng = np.random.default_rng(1)
    _, after, _, before = step_inputs(config, params, 12, rng)
    meta = ForwardMetadata(
        positions=jnp.asarray([[12]], jnp.int32),
        seq_lens=jnp.asarray([13], jnp.int32),
        block_tables=jnp.asarray(1 + np.arange(20), jnp.int32)[None],
    )
    token = jnp.asarray([[5]], jnp.int32)
    forward = jax.jit(family_of(config).forward, static_argnums=1)
    want, want_cache = forward(params, config, token, before, meta)
    got, got_cache = forward(packed, config, token, before, meta)
    np.testing.assert_array_equal(got, want)
    for g, w in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v, strict=True):
        np.testing.assert_array_equal(g, w)


def test_one_kernel_step_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="hidden, intermediate and heads x head_dim"):
        LLM("random:tiny", kernel_overrides=(("decoder_step_programs", 8),), warmup=False)


H100_LIKE = types.SimpleNamespace(platform="gpu", core_count=132, compute_capability="9.0")
SIX_SMS = types.SimpleNamespace(platform="gpu", core_count=6, compute_capability="9.0")
AUTO, EIGHT = KernelConfig(), KernelConfig(decoder_step_programs=8)


def step_programs(config=None, dtype=jnp.bfloat16, kernels=AUTO, **engine) -> int:
    """`one_kernel_step_programs` for a one-row engine of Qwen3-0.6B (or `config`) on an
    H100-like device (132 SMs, sm90), auto, unless the arguments say otherwise."""
    engine = {"block_size": 16, "max_batch_size": 1, "device": H100_LIKE} | engine
    config = config or preset("qwen3-0.6b")
    return one_kernel_step_programs(config, dtype, kernels, **engine)


def test_one_kernel_step_programs_auto_and_set():
    """Auto (None): a Hopper GPU's SMs for a one-row engine of a model the kernel runs, else off;
    a count that is set runs or is a ValueError that says why (checks that need no lowering
    but Qwen3-0.6B's one)."""
    assert AUTO.decoder_step_programs is None
    assert step_programs() == 132
    assert step_programs(max_batch_size=2) == 0  # rows a step: the per-op kernels' batch
    assert step_programs(device=types.SimpleNamespace(platform="cpu")) == 0
    assert step_programs(device=None) == 0  # tensor parallel
    assert step_programs(config=preset("gpt2-xl")) == 0  # hidden 1,600: not in 256-wide tiles
    assert step_programs(config=preset("llama-3.1-8b")) == 0  # runs, no faster: set only
    assert step_programs(dtype=jnp.float32) == 0
    assert step_programs(block_size=128) == 0
    assert step_programs(kernels=KernelConfig(decoder_step_programs=0)) == 0
    with pytest.raises(ValueError, match="must not exceed the GPU's 6 SMs"):
        step_programs(kernels=EIGHT, device=SIX_SMS)
    ampere = types.SimpleNamespace(platform="gpu", core_count=132, compute_capability="8.0")
    assert step_programs(device=ampere) == 0
    with pytest.raises(ValueError, match="a Hopper GPU"):
        step_programs(kernels=EIGHT, device=ampere)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        step_programs(kernels=EIGHT, dtype=jnp.float32)
    with pytest.raises(ValueError, match="models on one device"):
        step_programs(kernels=EIGHT, device=None)


@pytest.mark.slow  # a lowering for a GPU each, seconds apiece on the CPU
def test_one_kernel_step_programs_follow_what_builds():
    """Auto runs the kernel for every family and width (up to AUTO_MAX_HIDDEN) it builds at 4
    weight stages, a set count wherever it builds at all; rows a step take shared memory beside
    the stages."""
    assert step_programs(dtype=jnp.float16) == 132
    assert step_programs(config=preset("gpt2")) == 132
    qwen2 = dataclasses.replace(preset("qwen3-0.6b"), qkv_bias=True)  # Qwen2's biases
    assert step_programs(config=qwen2) == 132
    assert step_programs(kernels=EIGHT, max_batch_size=64) == 8
    assert step_programs(kernels=EIGHT, config=preset("gpt2")) == 8
    assert step_programs(device=SIX_SMS) == 6
    assert step_programs(kernels=EIGHT, config=preset("llama-3.1-8b")) == 8  # set: it builds
    # Heads of 256: 4 weight stages beside their attention exceed an SM's SMEM (Mosaic GPU's
    # check): not auto; set, it runs at 2 (`default_stages`).
    assert step_programs(config=LLAMA_HD256) == 0
    assert step_programs(kernels=EIGHT, config=LLAMA_HD256) == 8
    # Rows a step: 8 of GPT-2 small fit an SM's shared memory beside 4 weight stages, 16 of
    # Llama 3.1 8B do not beside any.
    rows = dataclasses.replace(EIGHT, decoder_step_rows=8)
    assert step_programs(kernels=rows, config=preset("gpt2"), max_batch_size=8) == 8
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        sixteen = dataclasses.replace(EIGHT, decoder_step_rows=16)
        step_programs(kernels=sixteen, config=preset("llama-3.1-8b"))


@pytest.mark.parametrize(
    "name,rows,stages",
    [
        ("qwen3-0.6b", 1, 4),
        pytest.param("qwen3-0.6b", 8, 3, marks=pytest.mark.slow),
        pytest.param("llama-3.1-8b", 1, 4, marks=pytest.mark.slow),
        pytest.param("llama-hd256", 1, 2, marks=pytest.mark.slow),
    ],
)
def test_default_stages_are_the_most_that_build(name, rows, stages):
    """The kernel's default weight stages: the most that Mosaic GPU builds (lowered for a GPU on
    the CPU), one more does not."""
    shape = shape_of(LLAMA_HD256 if name == "llama-hd256" else preset(name))
    assert default_stages(shape, jnp.bfloat16, 16, programs=132, rows=rows) == stages
    more = dict(programs=132, stages=stages + 1, rows=rows)
    assert decoder_step_lowering_problem(shape, jnp.bfloat16, 16, **more) is not None
    fit = dict(programs=132, stages=stages, rows=rows)
    assert decoder_step_lowering_problem(shape, jnp.bfloat16, 16, **fit) is None


@(pytest.mark.slow if not GPU else (lambda test: test))  # interpreted, a step takes a second
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_engine_one_kernel_step_matches_hf(
    hf_checkpoint, mosaic_gpu_interpreter, monkeypatch, dtype
):
    """The engine at one row with the one-kernel step (bf16 or fp16, a GPU's default) gives HF's
    greedy tokens (fp32) up to a near-tie at that precision: on a GPU compiled at 8 programs, on
    the CPU in the interpreter at one (fewer tokens: a step there takes a second). The step is
    what runs: its program traces the kernel, and a lone row has a bucket of its own even where
    the smallest decode program takes 2 rows."""
    path, hf = hf_checkpoint
    programs, extra = (8, ()) if GPU else (1, (("interpret", True),))
    traced = []

    def spy(*args, **kwargs):
        traced.append(kwargs["programs"])
        return decoder_step(*args, **kwargs)

    monkeypatch.setattr(one_kernel_step_module, "decoder_step", spy)
    llm = LLM(
        path,
        tokenizer=packaged_gpt2_tokenizer_path(),
        dtype=dtype,
        block_size=16,
        max_batch_size=1,
        min_decode_batch=2,  # GPT-2's default on a GPU is 16
        kernel_overrides=(("decoder_step_programs", programs), *extra),
        warmup=False,
    )
    assert llm.engine.decode_buckets[0] == 1
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 300, n).tolist() for n in ((1, 7, 70) if GPU else (7, 70))]
    new = 12 if GPU else 4
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for prompt in prompts:  # one at a time: each decodes as a lone row
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        assert_matches_hf_greedy(hf, prompt, out.token_ids, new, rtol=3e-2)
    assert traced and set(traced) == {programs}


@(pytest.mark.slow if not GPU else (lambda test: test))  # interpreted, a step takes seconds
def test_engine_one_kernel_step_rows_match_hf(hf_checkpoint, mosaic_gpu_interpreter, monkeypatch):
    """Three prompts of other lengths decoded together by the one-kernel step at up to 4 rows
    (their program 4 rows wide, one row dead) give HF's greedy tokens each."""
    path, hf = hf_checkpoint
    programs, extra = (8, ()) if GPU else (1, (("interpret", True),))
    rows = []

    def spy(*args, **kwargs):
        rows.append(args[1].shape[0])
        return decoder_step(*args, **kwargs)

    monkeypatch.setattr(one_kernel_step_module, "decoder_step", spy)
    llm = LLM(
        path,
        tokenizer=packaged_gpt2_tokenizer_path(),
        dtype="bfloat16",
        block_size=16,
        max_batch_size=4,
        min_decode_batch=4,
        kernel_overrides=(("decoder_step_programs", programs), ("decoder_step_rows", 4), *extra),
        warmup=False,
    )
    assert llm.engine.decode_buckets[:3] == [1, 2, 4]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 300, n).tolist() for n in (9, 70, 30)]
    new = 8 if GPU else 3
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_hf_greedy(hf, prompt, out.token_ids, new, rtol=3e-2)
    assert 4 in rows


@pytest.mark.parametrize(
    "live",  # a lone dead row: the three rows' dead one, alone (slow)
    [(True,), pytest.param((False,), marks=pytest.mark.slow), (True, False, True)],
)
def test_one_kernel_step_glue_matches_model(checkpoint, monkeypatch, live):
    """The engine's route into the kernel (`kernel_decode_step`: each row's embedding (and
    GPT-2's position), RoPE angles, a dead row's scratch slot, the logits' vocabulary and dtype)
    with the XLA reference (layers, final norm and head) in the kernel's place, one row or three
    of other lengths: the live rows' logits and the caches are the model's; a dead row (length
    0) writes nothing but the scratch block."""
    config, params = checkpoint
    shape = shape_of(config)

    def reference(weights, h, rope, tables, seq_lens, ks, vs, **tiles):
        assert tiles["shape"] == shape and tiles["programs"] == 8
        parts = (layers_of(config, params), head_of(config, params), shape)
        return decoder_step_reference(*parts, h, rope, tables, seq_lens, ks, vs)

    monkeypatch.setattr(one_kernel_step_module, "decoder_step", reference)
    rng, rows, pages = np.random.default_rng(4), len(live), 6
    lengths = np.asarray([20, 13, 37][:rows], np.int32)
    tables = jnp.asarray(1 + rng.permutation(rows * pages).reshape(rows, pages), jnp.int32)
    forward = jax.jit(family_of(config).forward, static_argnums=1, static_argnames="kernels")
    before = init_kv_cache(config, rows * pages + 1, BLOCK_SIZE, jnp.float32)
    for row, n in enumerate(lengths):  # each row's prompt prefilled into its own pages
        meta = ForwardMetadata(
            positions=jnp.arange(n, dtype=jnp.int32)[None],
            seq_lens=jnp.asarray([n], jnp.int32),
            block_tables=tables[row][None],
        )
        prompt = jnp.asarray(rng.integers(0, config.vocab_size, (1, n)), jnp.int32)
        _, before = forward(params, config, prompt, before, meta)
    meta = ForwardMetadata(
        positions=jnp.asarray(lengths)[:, None],
        seq_lens=jnp.asarray(np.where(live, lengths + 1, 0), jnp.int32),
        block_tables=tables,
    )
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (rows, 1)), jnp.int32)
    want, want_cache = forward(params, config, tokens, before, meta)
    kernels = dataclasses.replace(XLA_KERNELS, decoder_step_programs=8, decoder_step_rows=4)
    got, got_cache = forward(
        with_step_weights(config, params), config, tokens, before, meta, kernels=kernels
    )
    assert got.shape == want.shape
    for row in np.flatnonzero(live):
        assert rel_err(got[row], want[row]) <= 1e-5
    written = np.zeros(before.k[0].shape, bool)  # the live rows' slots, past the scratch block
    for table, n in zip(np.asarray(tables)[list(live)], lengths[list(live)], strict=True):
        written[:, table[n // BLOCK_SIZE], n % BLOCK_SIZE] = True
    written = written[:, 1:]
    caches = (got_cache.k + got_cache.v, want_cache.k + want_cache.v, before.k + before.v)
    for g, w, b in zip(*caches, strict=True):
        g, w, b = (np.asarray(x)[:, 1:] for x in (g, w, b))  # block 0 is the scratch block
        np.testing.assert_array_equal(g[~written], b[~written])
        if written.any():
            assert rel_err(g[written], w[written]) <= 1e-5
