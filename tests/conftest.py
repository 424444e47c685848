"""Shared fixtures: random-weight GPT-2 checkpoints written by transformers' `save_pretrained`."""

from __future__ import annotations

import functools
import gc
import itertools
import os
import time

import jax
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU compiling quickly (before jax starts its backend; subprocesses inherit it): the
# suite's programs are small and run a few times each, so compiling them is most of the time.
# LLVM at -O0 about halves what the engine tests spend on it; XLA's older fusion emitters
# instead of its MLIR ones halve it again (an engine's 12 programs from an empty cache: 14.1 ->
# 7.6 s). No fast-math either way: sampled tokens and kernel outputs came out bit for bit the
# same at -O0 and the default. An XLA_FLAGS that names a flag keeps its own value. What -O0
# slows: the sampler's radix selects, which a top_p over a flat row (random weights) runs, take
# ~90 ms a step at 8 x 50,257 (6x -O1's), so tests that sample beside other work give top_p a
# top_k (the candidates' path) or sample greedily.
_xla_flags = os.environ.get("XLA_FLAGS", "")
_cpu_flags = ["xla_backend_optimization_level=0"]
# jax 0.11.2's XLA (the GPU machines') aborts on the older emitters' flag, printing nothing.
if tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 11):
    _cpu_flags.append("xla_cpu_use_fusion_emitters=false")
if os.environ["JAX_PLATFORMS"] == "cpu":
    for _flag in _cpu_flags:
        if _flag.split("=")[0] not in _xla_flags:
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}".strip()
# One OpenMP thread for torch (the HF references; read when torch is imported, after this): its
# pool's threads spin, and on a 2-core machine with anything else busy, HF's greedy generate
# of 24 tokens on these tiny models took 0.5-0.9 s with two threads, 0.02 s with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# On a CPU engines decode at least 4 rows wide (its default is 1; a GPU's 16 stays): widths 1 and
# 2 would be programs of their own in every engine to compile (tests/test_engine.py from an empty
# cache: 168 -> 146 s). Tests of the widths themselves pass min_decode_batch.
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ.setdefault("ROSEJAX_MIN_DECODE_BATCH", "4")

# On a GPU, pytest-xdist's workers share the card: each gets an equal share of its memory (jax
# would preallocate 75% of it in every process), and engines size their KV caches from that.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if os.environ["JAX_PLATFORMS"] != "cpu" and _workers > 1:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / _workers:.3f}")


# XLA:CPU maps three memory regions for every kernel of a program it loads, and jax keeps the
# programs of every shape a worker compiled: a worker passed 64k maps in a run, and at Linux's
# vm.max_map_count (65,530) the next program XLA loads segfaults (it did, reading jax's persistent
# cache). Past three quarters of that, a test's end drops jax's compiled programs; engines still
# in use load theirs again from the persistent cache (at half, the suite took 4% longer). The
# count is read at most once a second of tests: reading 40k maps takes ~50 ms, and programs come
# slower than that adds maps (an engine's, all from the cache: 6.8k maps in 7.9 s).
_MAPS = "/proc/self/maps"
_MAPS_LIMIT = 49_152
_MAPS_EVERY = 1.0  # seconds
_maps_read_at = [0.0]


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    yield
    now = time.monotonic()
    if now - _maps_read_at[0] < _MAPS_EVERY or not os.path.exists(_MAPS):
        return
    _maps_read_at[0] = now
    with open(_MAPS) as f:
        if f.read().count("\n") > _MAPS_LIMIT:
            gc.collect()
            jax.clear_caches()
            gc.collect()


# Pallas kernels under test: compiled on a GPU, interpreted on a CPU or when asked to.
INTERPRET = jax.default_backend() == "cpu" or os.environ.get("ROSEJAX_TEST_INTERPRET") == "1"

# Shapes the parity tests run: head dim 16 (not 64), a context filled to n_positions, an odd vocab.
HF_SHAPES = {
    "hd16": dict(vocab_size=1000, n_positions=128, n_embd=64, n_layer=2, n_head=4),
    "hd64-short-ctx": dict(vocab_size=512, n_positions=48, n_embd=128, n_layer=2, n_head=2),
    "odd-vocab": dict(vocab_size=997, n_positions=96, n_embd=96, n_layer=3, n_head=3),
}
# A wide initializer makes greedy outputs vary; a model that repeats one token proves little.
INIT_RANGE = 0.3


def make_hf_checkpoint(path, seed: int = 0, **config_kwargs):
    """Write a random GPT-2 with `save_pretrained` into `path`; return the torch model (fp32)."""
    import torch
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    config = HFConfig(initializer_range=INIT_RANGE, **config_kwargs)
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt, n: int) -> list[int]:
    """HF's greedy continuation of `prompt` by exactly `n` tokens. The mask is explicit: without
    one, HF treats every pad id inside a prompt as padding."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt)]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


hf_greedy_cached = functools.cache(hf_greedy)  # prompts as tuples: several tests reuse them
# A greedy path may part from HF's where two logits are this close (relative to the largest):
# float32 sums in another order can swap them. A random prompt once did, at token 16 of 32.
TIE_RTOL = 1e-4


def assert_matches_hf_greedy(model, prompt, got: list[int], n: int, rtol: float = TIE_RTOL) -> None:
    """`got` is HF's greedy continuation of `prompt` by `n` tokens, up to a near-tie: where the
    two first part, HF's logits for its token and for ours must be within `rtol` of its largest
    |logit|; past that point the paths differ and are not compared."""
    import torch

    want = hf_greedy_cached(model, tuple(prompt), n)
    if got == want:
        return
    assert len(got) == n, f"{len(got)} tokens, not {n}: {got}"
    i = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([[*prompt, *want[:i]]])).logits[0, -1]  # [V]
    gap = float(logits[want[i]] - logits[got[i]])
    assert gap <= rtol * float(logits.abs().max()), (
        f"token {i}: {got[i]} where HF's greedy gives {want[i]}, whose logit is {gap:.3g} higher"
    )


@pytest.fixture(scope="session", params=list(HF_SHAPES))
def hf_checkpoint(request, tmp_path_factory):
    """(checkpoint dir, HF torch model) for each parity shape."""
    path = tmp_path_factory.mktemp(request.param)
    model = make_hf_checkpoint(path, seed=len(request.param), **HF_SHAPES[request.param])
    return str(path), model


def _case_id(value) -> str:
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return str(value)


def _axis_values(axes: dict) -> list:
    """Each axis's (id, value) pairs: a dict's items, or a list's values with ids made of them."""
    return [
        list(v.items()) if isinstance(v, dict) else [(_case_id(x), x) for x in v]
        for v in axes.values()
    ]


def every_case(**axes) -> list:
    """Every parameter set of the product of `axes` (as `pairwise` takes them), with the ids
    `pairwise` gives: the slow suite's whole matrix beside a quick suite's pairs."""
    return [
        pytest.param(*(value for _, value in case), id="-".join(i for i, _ in case))
        for case in itertools.product(*_axis_values(axes))
    ]


def pairwise(**axes) -> list:
    """Parameter sets for `pytest.mark.parametrize(",".join(axes), pairwise(...))` that cover
    every pair of values of any two axes (each axis: a list of values, or a dict id -> value),
    instead of the full product: a kernel's paths (its tile variants, the shapes that hit its
    edges, epilogues, dtypes) each meet every value of every other axis at least once, in a
    few dozen cases where the product has hundreds. Greedy and deterministic: each next case is
    one of the product that covers the most pairs not covered yet, ties going to the values
    used least so far (so the axes a pair leaves free still vary)."""
    names = list(axes)
    values = _axis_values(axes)
    pairs = list(itertools.combinations(range(len(names)), 2))
    uncovered = {
        (i, a, j, b) for i, j in pairs for a in range(len(values[i])) for b in range(len(values[j]))
    }
    product = list(itertools.product(*(range(len(v)) for v in values)))
    used = [[0] * len(v) for v in values]
    cases = []
    while uncovered:
        best = max(
            product,
            key=lambda c: (
                sum((i, c[i], j, c[j]) in uncovered for i, j in pairs),
                -sum(used[n][k] for n, k in enumerate(c)),
            ),
        )
        uncovered -= {(i, best[i], j, best[j]) for i, j in pairs}
        for n, k in enumerate(best):
            used[n][k] += 1
        cases.append(
            pytest.param(
                *(values[n][k][1] for n, k in enumerate(best)),
                id="-".join(values[n][k][0] for n, k in enumerate(best)),
            )
        )
    return cases


# Parity with the fp32 reference needs true fp32 matmuls; GPUs default to TF32 for them. The
# processes tests start (engine processes, server subprocesses) read it from the environment:
# so they compute as this one does, and find its programs in jax's compilation cache.
jax.config.update("jax_default_matmul_precision", "highest")
os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
