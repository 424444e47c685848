"""A decode step at one row: a model's whole decoder (a Llama-family or GPT-2 preset's shape) in one
persistent Mosaic GPU kernel
(`pallas_kernels.decoder_step`) against the model's own step (`forward` of one token with the
engine's kernels: the small-batch Pallas linears, the decode attention with its fused q/k norm,
RoPE and append), in one process.

Both steps embed the token, run every layer over the same paged cache (random contents: the
work per token is the same), apply the final norm and LM head and take the argmax, which feeds
the next call (bench.common.loop_times, the caches carried). Per context length: ms a step (the
median of `--repeats` loops, taken in rounds that time every version once in turn, so a drift of
the GPU's clock or heat reaches them alike; the runs' range beside it), the ratio, the weights' GB/s
and the logits' relative difference (and whether the argmax agrees).
`--variant NAME=FILE` adds another version of the kernel's module (a copy of
pallas_kernels/decoder_step.py, e.g. an older commit's or a change under trial) to the same
process, timed and checked the same way: variants of one kernel differ by a few percent, less than
separate processes do; `NAME=FILE,KEY=INT,...` calls it with those keyword arguments (the
kernel's own module with other settings: `st3=pallas_kernels/decoder_step.py,stages=3`); a variant
that fails to build or run is reported and dropped, the others still timed.
`--rows R` decodes R rows a step (each its own pages, all at the context length), the kernel against
the model's step of R rows. `--quick` (CPU smoke): tiny sizes, the XLA reference
(`decoder_step_reference`) in each kernel's place (the kernel runs in jax's Mosaic GPU interpreter
only at one program, which times nothing; the tests run it there).

    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/bench_decoder_step.py --context 16,136,1024
    git show REV:pallas_kernels/decoder_step.py > /tmp/ds_rev.py
    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/bench_decoder_step.py --context 16,1024 \\
        --variant rev=/tmp/ds_rev.py --layers 8

`--lower` only builds each version for sm90 (Mosaic GPU's lowering runs on the CPU: a variant's
layouts, shared memory and shapes are checked before device time is spent) and reports what fails:

    PYTHONPATH=. python bench/bench_decoder_step.py --lower --layers 2 --rows 4 --programs 132 \\
        --variant rev=/tmp/ds_rev.py

`--ptxas` reports each version's registers a thread and spilled bytes (ptxas's report, which
Mosaic GPU prints while it compiles, with MOSAIC_GPU_DUMP_PTXAS set): the kernel runs 128 threads
a program near the 255-register cap, and a change that lengthens what a thread holds can spill
into the weight tiles' loop and lose more than it saves. With `--lower` it needs no GPU: each
version is compiled for a compile-only H100 (jax's CUDA plugin installed, as for
`bench/step_kernels.py`: `pip install "jax[cuda12]"` in a virtual environment made with
`--system-site-packages`, run under JAX_PLATFORMS=cpu; this jax's Mosaic GPU and ptxas, not the
device image's):

    JAX_PLATFORMS=cpu VENV/bin/python bench/bench_decoder_step.py --lower --ptxas --layers 2 \\
        --programs 132 --variant rev=/tmp/ds_rev.py

`--profile DIR` then runs the kernel (pallas_kernels', not the variants') once more per context
under Mosaic GPU's profiler (2 weight stages, to leave its SMEM room) and reads its trace
(`bench/decoder_trace.py`): where each program's time goes and how long each phase of a layer
holds the step up, with a PNG of one layer's ranges, under DIR/ctxN/ (its file is written from
a host callback, so JAX_PLATFORMS must list cpu beside cuda):

    PYTHONPATH=. JAX_PLATFORMS=cuda,cpu python bench/bench_decoder_step.py --context 16,1024 \\
        --profile /tmp/ds_profile
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

if __package__ in (None, ""):  # run as a file: make `bench` and `pallas_kernels` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels.decoder_step  # noqa: E402
from bench import decoder_trace  # noqa: E402
from bench.common import (  # noqa: E402
    add_kernel_bench_args,
    ints,
    loop_times,
    parse_kernel_bench_args,
    report_kernel_bench,
)
from bench.step_kernels import compile_only_device, placed  # noqa: E402
from pallas_kernels.decoder_step import decoder_head_reference  # noqa: E402
from rosejax.layers.attention import ForwardMetadata  # noqa: E402
from rosejax.layers.kv_cache import KVCache  # noqa: E402
from rosejax.models import family_of, preset  # noqa: E402
from rosejax.settings import KernelConfig  # noqa: E402

BLOCK_SIZE = 16


def decode_meta(tables, context) -> ForwardMetadata:
    """The rows' decode step (tables [R, pages]), each at length `context` (an int32 scalar; its
    last token the one fed)."""
    rows = tables.shape[0]
    return ForwardMetadata(
        positions=jnp.full((rows, 1), context - 1, jnp.int32),
        seq_lens=jnp.full((rows,), context, jnp.int32),
        block_tables=tables,
    )


def model_step(config, kernels):
    """The model's decode step: (tokens [R, 1], k caches, v caches), params, tables, context ->
    the next carry. The context length is an operand: every length runs one program."""
    forward = family_of(config).forward

    def step(carry, params, tables, context):
        token, ks, vs = carry
        meta = decode_meta(tables, context)
        logits, cache = forward(params, config, token, KVCache(k=ks, v=vs), meta, kernels=kernels)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], cache.k, cache.v

    return step


def kernel_step(config, run):
    """The one-kernel step: `run(weights, params, h, rope, tables, seq_lens, ks, vs)` is the
    decoder and head (the kernel, or its reference) -> (logits [R, V_pad], ks, vs); the rest as
    `model_step`. `step.logits`: the same step's logits [R, V] and caches."""

    def logits(carry, weights, params, tables, context):
        token, ks, vs = carry
        inputs = family_of(config).one_kernel_inputs
        h, rope = jax.vmap(lambda t: inputs(params, config, t, context - 1))(token[:, 0])
        seq_lens = jnp.full((tables.shape[0],), context, jnp.int32)
        out, ks, vs = run(weights, params, h, rope, tables, seq_lens, ks, vs)
        return out[:, : config.vocab_size], ks, vs

    def step(*args):
        out, ks, vs = logits(*args)
        return jnp.argmax(out, axis=-1).astype(jnp.int32)[:, None], ks, vs

    step.logits = logits
    return step


def variant_shape(module, shape):
    """`shape` as `module`'s own DecoderShape class; a field an older module lacks must hold its
    default (a GPT-2 shape cannot run on a module from before GPT-2), but for `vocab` (a module
    from before the head was in the kernel: the bench runs its head in XLA)."""
    fields = {f.name for f in dataclasses.fields(module.DecoderShape)}
    lacking = [
        f.name
        for f in dataclasses.fields(shape)
        if f.name not in fields and f.name != "vocab" and getattr(shape, f.name) != f.default
    ]
    if lacking:
        raise SystemExit(f"{module.__name__} has no DecoderShape field {', '.join(lacking)}")
    return module.DecoderShape(**{k: getattr(shape, k) for k in fields})


def kernel_module(spec: str) -> tuple[str, object, dict]:
    """`NAME=FILE[,KEY=INT...]` -> (NAME, FILE imported as a module of its own, the keyword
    arguments its `decoder_step` takes beside the bench's)."""
    name, sep, rest = spec.partition("=")
    path, *options = rest.split(",")
    if not sep or not name or not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"expected NAME=FILE of an existing file, got {spec!r}")
    try:
        keywords = {k: int(v) for k, v in (option.split("=") for option in options)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KEY=INT options, got {spec!r}") from None
    module_spec = importlib.util.spec_from_file_location(f"decoder_step_{name}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # dataclasses look their module up by name
    module_spec.loader.exec_module(module)
    return name, module, keywords


@contextlib.contextmanager
def native_output():
    """What native code writes to fds 1 and 2 inside the block (ptxas's report from Mosaic GPU's
    compiler), as a list holding its text once the block ends."""
    text = []
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile("w+") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield text
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)
            f.seek(0)
            text.append(f.read())


def ptxas_usage(report: str) -> dict:
    """Registers a thread and spilled bytes from ptxas's report (the most of any kernel in it);
    empty if it has none."""
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if not registers:
        return {}
    return dict(
        registers=max(registers),
        spill_stores=max((int(a) for a, _ in spills), default=0),
        spill_loads=max((int(b) for _, b in spills), default=0),
    )


def sm_clock_mhz() -> float:
    """The GPU's top SM clock (nvidia-smi), which a busy H100 or H200 holds (1,980 MHz); its
    current clock reads 345 MHz while idle. 1,980 where nvidia-smi fails."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
        )
        return float(out.stdout.split()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return 1980.0


def profile(step, operands: tuple, out_dir: str) -> None:
    """Run `step(*operands)` (a step whose kernel has the profiler on) once; print and write
    what the profiler's raw buffer says (trace.json uncorrected, summary.json, timeline.png;
    the profiler's own file, *-trace.json, beside them)."""
    from jax.experimental.mosaic.gpu import profiler

    os.makedirs(out_dir, exist_ok=True)
    raw, dump = [], profiler.ProfilerSpec.dump

    def keep_raw(spec, buffer, f, grid, block):  # the buffer as it came, then jax's file
        raw.append((np.asarray(buffer), dict(spec.interned_names), spec.entries_per_warpgroup))
        return dump(spec, buffer, f, grid=grid, block=block)

    profiler.ProfilerSpec.dump = keep_raw
    try:
        jax.block_until_ready(jax.jit(step)(*operands))
        jax.effects_barrier()  # the profiler writes from a host callback
    finally:
        profiler.ProfilerSpec.dump = dump
    clock = sm_clock_mhz()
    ((buffer, names, words),) = raw
    trace = decoder_trace.trace_from_buffer(buffer, names, words, clock)
    with open(os.path.join(out_dir, "trace.json"), "w") as f:
        json.dump(trace, f)
    summary = decoder_trace.summarize(trace, clock)
    decoder_trace.print_summary(summary)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot = os.path.join(out_dir, "timeline.png")
    decoder_trace.plot_layer(trace, summary["layers"] // 2, plot, clock)


def lower_for_gpu(modules: list, config, programs: int, args) -> None:
    """Each version of the kernel built for sm90 by Mosaic GPU's lowering (no GPU needed: a
    variant's layouts, shared memory and shapes checked before device time is spent), at the
    bench's rows, longest context and settings; a version that fails says why. With --ptxas,
    compiled for a compile-only H100 too (jax's CUDA plugin, no GPU): its registers and spills."""
    full_shape, pages = family_of(config).decoder_shape(config), -(-max(args.context) // BLOCK_SIZE)
    device = None  # --ptxas: a compile-only H100
    if args.ptxas:
        device = compile_only_device("h100")
    rows = []
    for name, module, keywords in modules:
        shape = variant_shape(module, full_shape)
        operands = module.decoder_step_arg_shapes(
            shape, jnp.bfloat16, BLOCK_SIZE, pages, rows=args.rows
        )
        settings = dict(programs=programs, splits=args.splits, stages=args.stages)
        step = functools.partial(module.decoder_step, shape=shape, **settings | keywords)
        usage = {}
        try:
            if device is None:
                jax.jit(step).trace(*operands).lower(lowering_platforms=("cuda",))
            else:
                with native_output() as text:
                    jax.jit(step).lower(*placed(operands, device)).compile()
                usage = ptxas_usage(text[0])
            error = ""
        except Exception as e:  # what the variant's author needs to read: its last line
            error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[-1]}"
        rows.append(dict(variant=name, rows=args.rows, lowered=not error, error=error, **usage))
        built = f"lowered {usage}" if usage else "lowered"
        print(f"{name:10s} rows {args.rows:2d} {built if not error else error}", flush=True)
    report_kernel_bench(args.json, rows, args=vars(args), programs=programs)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="qwen3-0.6b", help="a Llama-family or GPT-2 preset's shape")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the preset's")
    p.add_argument(
        "--rows", type=int, default=1, help="rows a step, each at the context length (1-16)"
    )
    p.add_argument("--context", type=ints, default=[16, 136, 1024], help="comma list of lengths")
    p.add_argument("--programs", type=int, default=None, help="kernel programs (default: SMs)")
    p.add_argument(
        "--splits", type=int, default=None, help="attention splits of a KV head (default: fit)"
    )
    p.add_argument(
        "--stages", type=int, default=None, help="weight tiles in flight a program (default: fit)"
    )
    p.add_argument("--unroll", type=int, default=2, help="steps a loop trip (every variant)")
    p.add_argument(
        "--variant",
        type=kernel_module,
        action="append",
        default=[],
        metavar="NAME=FILE[,KEY=INT...]",
        help="another version of pallas_kernels/decoder_step.py to time beside it, with keyword"
        " arguments of its decoder_step, e.g. st3=pallas_kernels/decoder_step.py,stages=3"
        " (repeatable)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="then profile the kernel once a context into DIR (see above; needs a GPU)",
    )
    p.add_argument(
        "--ptxas",
        action="store_true",
        help="report each version's registers a thread and spilled bytes (ptxas's report, as it"
        " compiles; with --lower, compiled for a compile-only H100: jax's CUDA plugin, no GPU)",
    )
    p.add_argument(
        "--lower",
        action="store_true",
        help="only build each version of the kernel for sm90 (no GPU needed) at these sizes and"
        " report what fails to build",
    )
    add_kernel_bench_args(p)
    args = parse_kernel_bench_args(p)
    if args.profile:
        if args.quick:
            p.error("--profile profiles the kernel on a GPU; --quick runs its reference")
        try:
            jax.devices("cpu")
        except RuntimeError:
            p.error("--profile: the profiler writes from a host callback: JAX_PLATFORMS=cuda,cpu")
    if args.ptxas:
        if args.quick:
            p.error("--ptxas reads the GPU compiler's report: not with --quick")
        os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"  # read by Mosaic GPU's compiler, in C++
    config = preset(args.model)
    if args.quick:  # the reference on the CPU, at widths the kernel's tiles take
        narrow = dict(vocab_size=512, n_embd=256, n_head=4, n_inner=512)
        if config.model_type != "gpt2":
            narrow = dict(vocab_size=512, hidden_size=256, intermediate_size=512)
            narrow |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64)
        config = dataclasses.replace(config, **narrow)
        args.layers, args.context, args.iters, args.repeats = 2, [20, 70], 2, 1
    if args.layers:
        config = config.with_num_layers(args.layers)
    programs = args.programs or getattr(jax.devices()[0], "core_count", 128)
    modules = [("kernel", pallas_kernels.decoder_step, {}), *args.variant]
    if args.lower:
        lower_for_gpu(modules, config, programs, args)
        return
    kernels = KernelConfig.for_backend()
    params = family_of(config).random_params(config, seed=0, dtype=jnp.bfloat16)

    def kernel_run(module, keywords: dict, profile_dir: str = ""):
        """(weights packed by `module`, its step's decoder and head) for `kernel_step`; with
        `profile_dir`, the decoder under the profiler (2 stages unless --stages)."""
        family, full_shape = family_of(config), family_of(config).decoder_shape(config)
        shape = variant_shape(module, full_shape)
        # Modules from before rows take one row's inputs; from before the head was in the kernel
        # they return h; from before `DecoderLayer`, their packing and reference took the params.
        has_head, has_layers = hasattr(module, "DecoderHead"), hasattr(module, "DecoderLayer")
        has_rows = hasattr(module, "MAX_ROWS")
        if not has_rows and args.rows > 1:
            raise SystemExit(f"{module.__name__} runs one row a step, not --rows {args.rows}")

        def layers(params):
            return family.decoder_layers(params, config) if has_layers else params

        def head(params):
            return family.decoder_head(params, config)

        def run(weights, params, h, rope, tables, seq_lens, ks, vs):
            row_inputs = (h, rope, tables, seq_lens)
            if not has_rows:
                row_inputs = (h[0], rope[0], tables[0], seq_lens)
            inputs = (*row_inputs, ks, vs)
            if args.quick:
                parts = (layers(params), head(params)) if has_head else (layers(params),)
                out = module.decoder_step_reference(*parts, shape, *inputs)
            else:
                settings = dict(programs=programs, splits=args.splits)
                settings["stages"] = args.stages or (2 if profile_dir else None)
                settings |= {"profile_dir": profile_dir} if profile_dir else {}
                out = module.decoder_step(weights, *inputs, shape=shape, **settings | keywords)
            if has_head:
                return out[0] if has_rows else out[0][None], *out[2:]
            h, ks, vs = out
            return decoder_head_reference(head(params), full_shape, h)[None], ks, vs

        weights = module.pack_decoder_weights(layers(params), shape)
        return (weights | module.head_weights(head(params)) if has_head else weights), run

    # One cache and a block table a row for the longest context (each row's pages its own): the
    # lengths differ only in an operand.
    rng, rows = np.random.default_rng(0), []
    pages = -(-max(args.context) // BLOCK_SIZE)
    tables = jnp.asarray(
        1 + rng.permutation(args.rows * pages).reshape(args.rows, pages), jnp.int32
    )
    cache_shape = (config.num_kv_heads, args.rows * pages + 1, BLOCK_SIZE, config.head_dim)
    layers = range(config.num_layers)
    ks = [jnp.asarray(rng.normal(size=cache_shape), jnp.bfloat16) for _ in layers]
    vs = [jnp.asarray(rng.normal(size=cache_shape), jnp.bfloat16) for _ in layers]
    token = jnp.asarray(rng.integers(config.vocab_size, size=(args.rows, 1)), jnp.int32)
    steps = {"model": (model_step(config, kernels), (params,))}
    for name, module, keywords in modules:
        weights, run = kernel_run(module, keywords)
        steps[name] = (kernel_step(config, run), (weights, params))
    packed = steps["kernel"][1][0]  # every version streams the same weights: layers and head
    weight_bytes = sum(packed[k].size * packed[k].dtype.itemsize for k in ("tiles", "head"))

    # One step's logits of each, from the same cache: the model's forward, each kernel's head.
    @jax.jit
    def model_logits(params, ks, vs, context):
        meta = decode_meta(tables, context)
        cache = KVCache(k=ks, v=vs)
        logits, _ = family_of(config).forward(params, config, token, cache, meta, kernels=kernels)
        return logits[:, -1]

    def logits_of(step):  # jitted once a step: the context is an operand
        return jax.jit(lambda ops, ks, vs, ctx: step.logits((token, ks, vs), *ops, tables, ctx)[0])

    kernel_logits = {name: logits_of(step) for name, (step, _) in steps.items() if name != "model"}
    usage = {}  # each version's ptxas report, from its first compile (--ptxas)

    for context in args.context:
        ctx = jnp.int32(context)
        want = np.asarray(model_logits(params, ks, vs, ctx), np.float32)
        checks = {}  # each version's logits against the model's: (relative difference, argmax same)
        for name in list(steps):
            try:
                if name == "model":
                    got = want
                else:  # its first call compiles it: ptxas's report, with --ptxas
                    report = args.ptxas and name not in usage
                    with native_output() if report else contextlib.nullcontext([""]) as text:
                        got = kernel_logits[name](steps[name][1], ks, vs, ctx)
                        got = np.asarray(got, np.float32)
                    if report:
                        usage[name] = ptxas_usage(text[0])
                        print(f"ptxas {name:10s} {usage[name] or 'no report'}", flush=True)
            except Exception as e:  # a variant under trial that does not build: the rest run
                if name in ("model", "kernel"):
                    raise
                print(f"variant {name} dropped: {type(e).__name__}: {e}", flush=True)
                del steps[name]
                continue
            diff = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            same = bool(np.array_equal(np.argmax(got, axis=-1), np.argmax(want, axis=-1)))
            checks[name] = diff, same
        os.environ.pop("MOSAIC_GPU_DUMP_PTXAS", None)  # reported: the timed loops' compiles quiet
        calls = [(step, (token, ks, vs), (*ops, tables, ctx)) for step, ops in steps.values()]
        times = loop_times(calls, iters=args.iters, repeats=args.repeats, unroll=args.unroll)
        base = None
        for name, runs in zip(steps, times, strict=True):
            us, (diff, same) = float(np.median(runs)), checks[name]
            base = base or us
            row = dict(
                context=context,
                variant=name,
                ms=us / 1e3,
                runs_ms=[t / 1e3 for t in runs],
                spread=(max(runs) - min(runs)) / us,
                vs_model=us / base,
                weights_gbs=weight_bytes / us / 1e3,
                logits_rel_diff=diff,
                argmax_same=same,
                **usage.get(name, {}),
            )
            rows.append(row)
            print(
                f"context {context:6d} {name:10s} {us / 1e3:7.4f} ms/step "
                f"(range {row['spread']:5.1%}) {us / base:6.3f}x model "
                f"weights {row['weights_gbs']:7.1f} GB/s  logits rel diff {diff:.2e} "
                f"argmax {'same' if same else 'DIFFERS'}",
                flush=True,
            )
    report_kernel_bench(args.json, rows, args=vars(args), programs=programs)
    for context in args.context if args.profile else ():
        out_dir = os.path.join(args.profile, f"ctx{context}")
        print(f"profile at context {context} ({out_dir}):", flush=True)
        weights, run = kernel_run(pallas_kernels.decoder_step, {}, out_dir)
        operands = ((token, ks, vs), weights, params, tables, jnp.int32(context))
        profile(kernel_step(config, run).logits, operands, out_dir)


if __name__ == "__main__":
    main()
