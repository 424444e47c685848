"""The engine's and the sampling command-line flags, shared by `rosejax.generate`, `rosejax.serve`
and `bench/`."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from rosejax.engine.decode_window import AUTO_FULL_STEPS
from rosejax.settings import KERNEL_OPS, KERNEL_SWITCHES, EngineConfig, KernelConfig


def parse_decode_steps(text: str) -> int | str:
    """argparse type of --decode-steps: 'auto' or a positive int."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an int >= 1, got {text!r}")
    return int(text)


DECODE_STEPS_HELP = (
    f"decode steps per device call (multi-step decode): an int, or 'auto' ({AUTO_FULL_STEPS} "
    "while the batch is full, --open-decode-steps while it has free slots, cut short while "
    "requests wait for a slot); default: auto"
)


def kernel_setting(text: str) -> tuple[str, str]:
    """argparse type of --kernel: FIELD=VALUE for a field of `KernelConfig`."""
    name, sep, value = text.partition("=")
    fields = {f.name for f in dataclasses.fields(KernelConfig)} - {"tiles", "interpret"}
    if not sep or name not in fields:
        raise argparse.ArgumentTypeError(
            f"expected FIELD=VALUE with FIELD one of {', '.join(sorted(fields))}, got {text!r}"
        )
    return name, value


def kernel_tile(text: str) -> tuple[str, str, int]:
    """argparse type of --kernel-tile: OP.PARAM=INT."""
    key, sep, value = text.partition("=")
    op, dot, param = key.partition(".")
    if not (sep and dot and param and op in KERNEL_OPS and value.lstrip("-").isdigit()):
        raise argparse.ArgumentTypeError(
            f"expected OP.PARAM=INT with OP one of {', '.join(KERNEL_OPS)}, got {text!r}"
        )
    try:
        KernelConfig(tiles=((op, param, int(value)),))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return op, param, int(value)


def kernel_overrides(
    settings: list[tuple[str, str]], tiles: list[tuple[str, str, int]]
) -> tuple[tuple[str, Any], ...]:
    """--kernel and --kernel-tile as `EngineConfig.kernel_overrides` (checked, jax not started:
    the engine applies them to its backend's defaults where it runs)."""
    if not settings and not tiles:
        return ()
    overrides: dict[str, Any] = {}
    for name, value in settings:
        if name in KERNEL_OPS:
            overrides[name] = value
        elif name in KERNEL_SWITCHES:
            if value.lower() not in ("on", "off", "true", "false", "1", "0"):
                raise ValueError(f"--kernel {name} takes on or off, got {value!r}")
            overrides[name] = value.lower() in ("on", "true", "1")
        else:
            word = "auto" if name == "decoder_step_programs" else "none"  # the field's None
            if value.lower() == word:
                overrides[name] = None
            elif value.lstrip("-").isdigit():
                overrides[name] = int(value)
            else:
                raise ValueError(f"--kernel {name} takes an int or {word}, got {value!r}")
    overrides["tiles"] = tuple(tiles)
    KernelConfig.for_backend("cpu", **overrides)  # ValueError now, not in an engine process
    return tuple(overrides.items())


def add_engine_args(
    p: argparse.ArgumentParser,
    *,
    model_default: str = "gpt2",
    model_aliases: tuple[str, ...] = (),
    max_batch_size: int = 64,
) -> None:
    """Flags for every `EngineConfig` field but the seed (whose meaning differs per program)."""
    p.add_argument(
        "--model",
        *model_aliases,
        dest="model",
        default=model_default,
        help="hub id (gpt2, Qwen/Qwen3-0.6B, ...), local save_pretrained directory, or "
        "random:<preset> for random weights of a preset shape (random:gpt2, "
        "random:gpt2-xl, random:tiny, random:qwen3-0.6b, random:llama-3.2-1b, "
        "random:llama-3.1-8b); "
        "default: %(default)s" + ("".join(f"; {a} is an alias" for a in model_aliases)),
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory or hub id, for a checkpoint without tokenizer files "
        "(random:* models use the packaged GPT-2 tokenizer)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV cache dtype; auto = float16 on GPU, float32 on CPU",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=max_batch_size,
        help="most requests decoded together; default: %(default)s",
    )
    p.add_argument(
        "--prefill-max-batch-size",
        type=int,
        default=None,
        help="most requests prefilled together; default: --max-batch-size",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=4096,
        help="prompt tokens per prefill step at most; default: %(default)s",
    )
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=None,
        help="prefill prompts longer than this a chunk at a time, between decode windows, so "
        "running requests keep streaming; default: --max-prefill-tokens; --max-model-len or "
        "more: every prompt in one prefill",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the longest context served (prompt + output), if less than the model's; "
        "Llama-style models only. Default: the model's",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=EngineConfig.block_size,
        help="tokens per KV cache block; default: %(default)s",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="KV cache size in tokens; default: half the free GPU memory "
        "(CPU: max batch x context)",
    )
    p.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=None,
        help="KV cache size as a fraction of free accelerator memory (instead of "
        "--kv-cache-tokens)",
    )
    p.add_argument(
        "--decode-steps", type=parse_decode_steps, default="auto", help=DECODE_STEPS_HELP
    )
    p.add_argument(
        "--open-decode-steps",
        type=int,
        default=EngineConfig.open_decode_steps,
        help="under --decode-steps auto: the window while the batch has free slots (a request "
        "arriving then waits about this many steps to be admitted) and the shortest window "
        "while requests wait for a slot; shorter admits sooner, longer spends less host time "
        "per token; default: %(default)s",
    )
    p.add_argument(
        "--max-decode-window-ms",
        type=float,
        default=EngineConfig.max_decode_window_ms,
        metavar="MS",
        help="under --decode-steps auto: cut a window to the steps that fit MS at the last "
        "window's time a step (at least one), so a stream's tokens come at least about that "
        "often (a window's tokens reach the host together: 32 steps of a long context can leave "
        "a stream silent for 100 ms); 0 = no bound; default: %(default)s",
    )
    p.add_argument(
        "--decode-steps-per-trip",
        type=int,
        default=EngineConfig.decode_steps_per_trip,
        help="decode steps a trip round the window's loop runs: each trip costs a few µs of "
        "its own on a GPU (2: GPT-2 at one row 1.2%% faster on an H200), but its steps are "
        "compiled that many times (a sampled decode program's compile about doubles); "
        "default: %(default)s",
    )
    p.add_argument(
        "--no-prefill-overlap",
        action="store_true",
        help="a step that prefills decodes nothing, for A/B timings (by default the running "
        "requests' decode window goes out right behind each prefill, before its first tokens "
        "are read back)",
    )
    p.add_argument(
        "--step-log",
        default=None,
        metavar="FILE",
        help="append a JSON line per engine step to FILE (when it started and ended, the "
        "requests waiting and running, prompt tokens prefilled, the decode window dispatched, "
        "host time dispatching and waiting for the device); `python bench/step_timeline.py "
        "FILE` prints it; default: none",
    )
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="turn off prefix caching (sharing KV blocks of equal prompt prefixes)",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="compile buckets on first use instead of all at start (always so on a CPU)",
    )
    p.add_argument(
        "--min-decode-batch",
        type=int,
        default=None,
        help="the smallest compiled decode batch (smaller ones pad to it); default: "
        "$ROSEJAX_MIN_DECODE_BATCH, else 16 on a GPU, 1 on a CPU",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas, replica i on device i (devices i*N to (i+1)*N - 1 with "
        "--tensor-parallel-size N), each with its own KV cache; requests go to the least loaded "
        "one, or to the one holding their prompt's prefix; default: %(default)s",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over this many devices (tensor parallelism: heads, MLP units, "
        "vocabulary and KV cache): the first N (of every process, with --num-processes); "
        "default: %(default)s",
    )
    add_kernel_args(p)
    p.add_argument(
        "--compilation-cache-dir",
        default=None,
        help="jax's persistent compilation cache directory; default: "
        "$ROSEJAX_COMPILATION_CACHE_DIR or ~/.cache/rosejax/jax",
    )


def add_kernel_args(p: argparse.ArgumentParser) -> None:
    """--kernel and --kernel-tile: `EngineConfig.kernel_overrides` (`kernel_overrides`)."""
    p.add_argument(
        "--kernel",
        type=kernel_setting,
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a kernel-config setting (repeatable): attention, prefill_attention, kv_append, "
        "layer_norm, rms_norm, linear = "
        "pallas | xla; " + ", ".join(KERNEL_SWITCHES) + " = on | off; "
        "kv_append_min_batch, linear_max_rows, cublas_min_batch, xla_split_k_min_rows = an int "
        "(the last two also none); decoder_step_programs = the programs of the one-kernel decode "
        "step at one row (GPT-2 and Llama family on one Hopper GPU; at most its SMs; 0: off; "
        "auto, the default: its SMs where --max-batch-size is 1 and the kernel runs the model); "
        "decoder_step_rows = the most rows a decode program runs that step for (1-16, default "
        "1; its shared memory bounds them). "
        "Default: every Pallas "
        "kernel on a GPU, XLA on a CPU, then $ROSEJAX_* switches",
    )
    p.add_argument(
        "--kernel-tile",
        type=kernel_tile,
        action="append",
        default=[],
        metavar="OP.PARAM=INT",
        help="a keyword argument for one op's kernel (repeatable), e.g. linear.num_warps=2 or "
        "attention.num_stages=1; OP is one of " + ", ".join(KERNEL_OPS),
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`EngineConfig` fields from the flags of `add_engine_args` (model and seed aside)."""
    kwargs = dict(
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        prefill_max_batch_size=args.prefill_max_batch_size,
        max_prefill_tokens=args.max_prefill_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        decode_steps=args.decode_steps,
        open_decode_steps=args.open_decode_steps,
        max_decode_window_ms=args.max_decode_window_ms,
        decode_steps_per_trip=args.decode_steps_per_trip,
        prefill_overlap=not args.no_prefill_overlap,
        step_log=args.step_log,
        enable_prefix_caching=not args.no_prefix_cache,
        warmup=False if args.no_warmup else None,
        kernel_overrides=kernel_overrides(args.kernel, args.kernel_tile),
        data_parallel_size=args.data_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    if args.min_decode_batch is not None:
        kwargs["min_decode_batch"] = args.min_decode_batch
    if args.compilation_cache_dir is not None:
        kwargs["compilation_cache_dir"] = args.compilation_cache_dir
    return kwargs


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """--distributed-coordinator-address, --num-processes, --process-id: one engine over several
    processes (`jax.distributed`); `distributed_kwargs` reads them."""
    p.add_argument(
        "--distributed-coordinator-address",
        default=None,
        metavar="HOST:PORT",
        help="run as one of --num-processes processes (jax.distributed): process 0 listens "
        "here, every process connects; each runs the same requests and process 0 prints",
    )
    p.add_argument(
        "--num-processes",
        type=int,
        default=1,
        help="processes in all (one per GPU); default: %(default)s",
    )
    p.add_argument(
        "--process-id",
        type=int,
        default=0,
        help="this process's id, 0 to --num-processes - 1; default: %(default)s",
    )


def distributed_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`EngineConfig` fields from the flags of `add_distributed_args`."""
    return dict(
        distributed_coordinator_address=args.distributed_coordinator_address,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )


def add_sampling_args(p: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    """--max-new-tokens, the draw's flags (`add_draw_args`), --ignore-eos (alias
    --no-stop-on-eos) and --logprobs: one request's SamplingParams; see `sampling_params`."""
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=max_new_tokens,
        help="tokens to generate per prompt at most (exactly, with --ignore-eos); "
        "default: %(default)s",
    )
    add_draw_args(p)
    p.add_argument(
        "--ignore-eos",
        "--no-stop-on-eos",
        dest="ignore_eos",
        action="store_true",
        help="keep generating past the end-of-text token",
    )
    add_logprobs_arg(p)


def add_draw_args(p: argparse.ArgumentParser) -> None:
    """--temperature, --top-k and --top-p: how a request draws its tokens (`draw_fields`)."""
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature, 0 = greedy; default: %(default)s",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="keep the k most likely tokens, 0 = off; default: %(default)s",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling mass in (0, 1], 1 = off; default: %(default)s",
    )


def draw_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams fields of `add_draw_args`' flags."""
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def add_logprobs_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="ask for each generated token's logprob and its N (0-20) most likely alternatives "
        "(the model's raw distribution); default: %(default)s",
    )


def sampling_params(args: argparse.Namespace, **extra: Any):
    """SamplingParams from `add_sampling_args` flags; `extra` adds fields (seed, stop)."""
    from rosejax.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_new_tokens,
        **draw_fields(args),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        **extra,
    )
