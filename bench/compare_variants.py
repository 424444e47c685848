"""Decode step time of engine variants measured in one process, the first variant the baseline.

Separate processes on one GPU have differed by up to 9% in decode step time (the same B=1
program gave 0.351 and 0.383 ms/step in two processes on an H100; docs/performance-log.md,
"Noise"), more than most kernel changes are worth, while runs inside one process agree to about
0.5%. So each variant here gets its own engine, compiled under its settings, and the timed runs go
round-robin (A B C A B C ...), so a drift of the card hits every variant alike.

A variant is NAME:SETTING,SETTING,... where a SETTING is a `KernelConfig` field (FIELD=VALUE, as
the engine's --kernel: fused_kv_append=off, attention=xla, linear_max_rows=32), a kernel tile
(OP.PARAM=INT, as profile_decode.py's --kernel-tile: layer_norm.num_warps=2) or an
`EngineConfig` field (FIELD=VALUE: min_decode_batch=1). NAME: alone is the defaults. Each
variant's engine is built from its own EngineConfig; nothing else in the process changes. All
the engines are held at once: once the last one built leaves no room on the first device for
one more of its size, the script stops (fewer variants, or a larger
XLA_PYTHON_CLIENT_MEM_FRACTION), rather than retry allocations until its time runs out.

    python bench/compare_variants.py --batch 1 base: unfused:fused_kv_append=off \\
        ln2:layer_norm.num_warps=2 mdb1:min_decode_batch=1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from typing import Any

if __package__ in (None, ""):  # run as a file: make `bench` and `rosejax` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import profile_decode as pd  # noqa: E402
from bench.common import configure_process, frozen_heap  # noqa: E402
from rosejax import EngineConfig, KernelConfig, LLMEngine  # noqa: E402
from rosejax.engine_args import (  # noqa: E402
    draw_fields,
    kernel_overrides,
    kernel_setting,
    kernel_tile,
)
from rosejax.layers.kv_cache import free_memory_bytes  # noqa: E402

KERNEL_FIELDS = {f.name for f in dataclasses.fields(KernelConfig)} - {"tiles", "interpret"}
# EngineConfig fields a variant may set (the model is the script's; kernels are the settings).
ENGINE_FIELDS = {
    f.name: f for f in dataclasses.fields(EngineConfig) if f.name not in ("model", "kernels")
}
_BOOLS = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}


def engine_value(field: dataclasses.Field, text: str) -> Any:
    """An EngineConfig field's value from text, by its annotation ('int | None', 'bool', ...)."""
    kinds = str(field.type).replace(" ", "").split("|")
    low = text.lower()
    if "None" in kinds and low == "none":
        return None
    if "bool" in kinds and low in _BOOLS:
        return _BOOLS[low]
    if "int" in kinds and text.lstrip("-").isdigit():
        return int(text)
    if "float" in kinds:
        try:
            return float(text)
        except ValueError:
            pass
    if "str" in kinds:
        return text
    raise argparse.ArgumentTypeError(f"{field.name} takes {field.type}, got {text!r}")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    settings: tuple[str, ...]  # as given, for the report
    kernel_settings: tuple[tuple[str, str], ...] = ()  # (KernelConfig field, value)
    tiles: tuple[tuple[str, str, int], ...] = ()  # (op, param, value)
    engine_fields: tuple[tuple[str, Any], ...] = ()  # (EngineConfig field, value)


def variant(text: str) -> Variant:
    """'NAME:FIELD=V,OP.PARAM=N,...' -> Variant (tiles checked as --kernel-tile's)."""
    name, sep, rest = text.partition(":")
    if not name or not sep:
        raise argparse.ArgumentTypeError(f"expected NAME:SETTING,..., got {text!r}")
    settings = tuple(filter(None, rest.split(",")))
    kernel_settings, tiles, fields = [], [], {}
    for setting in settings:
        key, eq, value = setting.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(
                f"expected FIELD=VALUE or OP.PARAM=INT, got {setting!r}"
            )
        if "." in key:
            tiles.append(kernel_tile(setting))
        elif key in KERNEL_FIELDS:
            kernel_settings.append(kernel_setting(setting))
        elif key in ENGINE_FIELDS:
            fields[key] = engine_value(ENGINE_FIELDS[key], value)
        else:
            raise argparse.ArgumentTypeError(
                f"{key!r} is neither a KernelConfig field ({', '.join(sorted(KERNEL_FIELDS))}) "
                f"nor an EngineConfig field ({', '.join(sorted(ENGINE_FIELDS))})"
            )
    return Variant(name, settings, tuple(kernel_settings), tuple(tiles), tuple(fields.items()))


def config_of(v: Variant, args: argparse.Namespace) -> EngineConfig:
    """v's EngineConfig: the script's engine (`profile_decode.engine_config`) with v's
    KernelConfig (the backend's defaults, then v's fields and tiles) and v's engine fields.
    ValueError if a value is bad. Starts jax's backend."""
    kernels = KernelConfig.for_backend(
        **dict(kernel_overrides(list(v.kernel_settings), list(v.tiles)))
    )
    shape = (args.model, args.batch, args.prompt_len, args.new_tokens, args.block_size)
    return pd.engine_config(*shape, args.decode_steps, kernels, **dict(v.engine_fields))


def build(
    config: EngineConfig, args: argparse.Namespace, rng: np.random.Generator
) -> tuple[LLMEngine, int]:
    """The engine of `config`, after a warm-up run that traces every program the timed runs use
    -> (engine, its compile count after warm-up)."""
    engine = LLMEngine(config)
    pd.timed_run(
        engine, args.batch, args.prompt_len, args.new_tokens, rng, "warm-up", **draw_fields(args)
    )
    return engine, engine.num_compiles


def room_for_another(free_before: int, free_after: int) -> bool:
    """Whether the memory left free after the last engine was built (`free_memory_bytes`, before
    and after it) holds one more engine of that one's size."""
    return free_before - free_after <= free_after


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "variants",
        nargs="+",
        type=variant,
        metavar="NAME:SETTINGS",
        help="a variant; the first is the baseline the others are compared with",
    )
    pd.add_workload_args(p, batch=1)
    p.add_argument("--decode-steps", type=int, default=32, help="decode steps per device call")
    p.add_argument("--runs", type=int, default=5, help="timed runs of each variant, interleaved")
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args(argv)
    names = [v.name for v in args.variants]
    if len(set(names)) != len(names):
        p.error(f"variant names must differ, got {names}")
    if args.new_tokens < 2 or args.runs < 1:
        p.error("need --new-tokens >= 2 (a decode step) and --runs >= 1")
    configure_process()  # before the backend starts: XLA flags set later are ignored
    configs = {}
    for v in args.variants:  # every value checked before the first engine compiles
        try:
            configs[v.name] = config_of(v, args)
        except ValueError as e:
            p.error(f"variant {v.name}: {e}")
    rng = np.random.default_rng(0)
    engines = {}
    for i, (name, config) in enumerate(configs.items()):
        before = free_memory_bytes()
        engines[name] = build(config, args, rng)
        after = free_memory_bytes()
        if i + 1 < len(configs) and not room_for_another(before, after):
            # Every engine is held at once: fail now, not after the allocator's retries.
            p.error(
                f"{name!r} took {(before - after) / 2**30:.1f} GiB and left "
                f"{after / 2**30:.1f} free on {jax.devices()[0]}: one more like it would not fit. "
                "Compare fewer variants in one process, or raise XLA_PYTHON_CLIENT_MEM_FRACTION "
                "(jax's default 0.75)"
            )
    draw = draw_fields(args)
    ms = {name: [] for name in engines}  # ms per decode step of each timed run
    with frozen_heap():  # no full collection inside a timed run
        for run in range(args.runs):
            for name, (engine, _) in engines.items():
                decode_s, _, _ = pd.timed_run(
                    engine,
                    args.batch,
                    args.prompt_len,
                    args.new_tokens,
                    rng,
                    f"{name}-{run}",
                    **draw,
                )
                ms[name].append(decode_s / (args.new_tokens - 1) * 1e3)
    median = {name: statistics.median(xs) for name, xs in ms.items()}
    rows = [
        dict(
            name=var.name,
            settings=list(var.settings),
            kernels=dataclasses.asdict(engines[var.name][0].kernels),
            engine_fields=dict(var.engine_fields),
            ms_per_step=median[var.name],
            runs=[round(x, 4) for x in ms[var.name]],
            vs_baseline=median[var.name] / median[names[0]],
            recompiled=engines[var.name][0].num_compiles != engines[var.name][1],
        )
        for var in args.variants
    ]
    print(
        f"\ncard: {jax.devices()[0].device_kind}, jax {jax.__version__}, batch {args.batch}, "
        f"{args.runs} interleaved runs each, sampling {draw}"
    )
    print(f"{'variant':>14} {'ms/step':>8} {'x base':>7}  ms/step of each run")
    for r in rows:
        note = "  RECOMPILED in timed runs" if r["recompiled"] else ""
        print(
            f"{r['name']:>14} {r['ms_per_step']:>8.4f} {r['vs_baseline']:>7.3f}  "
            + " ".join(f"{x:.3f}" for x in r["runs"])
            + note
        )
    result = dict(
        rows=rows,
        batch=args.batch,
        sampling=draw,
        device=jax.devices()[0].device_kind,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
