"""Decode step time of engine variants measured in one process, the first variant the baseline.

Separate processes on one GPU have differed by up to 9% in decode step time (the same B=1
program gave 0.351 and 0.383 ms/step in two processes on an H100; docs/performance-log.md,
"Noise"), more than most kernel changes are worth, while runs inside one process agree to about
0.5%. So each variant here gets its own engine, compiled under its settings, and the timed runs go
round-robin (A B C A B C ...), so a drift of the card hits every variant alike.

A variant is NAME:SETTING,SETTING,... where a SETTING is an environment variable the model reads
when it is traced (ENV=VALUE, e.g. ROSEJAX_FUSED_KV_APPEND=0) or a kernel keyword
(OP.PARAM=N, as profile_decode.py's --kernel-option). NAME: alone is the defaults.

    python bench/compare_variants.py --batch 1 base: unfused:ROSEJAX_FUSED_KV_APPEND=0 \\
        ln2:layer_norm.num_warps=2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

if __package__ in (None, ""):  # run as a file: make `bench` and `rosejax` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import profile_decode as pd  # noqa: E402
from rosejax import LLMEngine  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    env: dict[str, str]
    kernel_options: list[tuple[str, str, int]]


def variant(text: str) -> Variant:
    """'NAME:ENV=V,OP.PARAM=N,...' -> Variant (kernel options checked as --kernel-option's)."""
    name, sep, settings = text.partition(":")
    if not name or not sep:
        raise argparse.ArgumentTypeError(f"expected NAME:SETTING,..., got {text!r}")
    env, options = {}, []
    for setting in filter(None, settings.split(",")):
        key, eq, value = setting.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"expected ENV=VALUE or OP.PARAM=N, got {setting!r}")
        if "." in key:
            options.append(pd.kernel_option(setting))
        else:
            env[key] = value
    return Variant(name, env, options)


def build(v: Variant, args: argparse.Namespace, rng: np.random.Generator) -> tuple[LLMEngine, int]:
    """An engine compiled under v's settings (they are undone once its warm-up run has traced
    every program the timed runs use) -> (engine, its compile count after warm-up)."""
    bound = {
        (module, attr): getattr(module, attr)
        for targets in pd.KERNELS.values()
        for module, attr in targets
    }
    old_env = {key: os.environ.get(key) for key in v.env}
    try:
        os.environ.update(v.env)
        pd.apply_kernel_options(v.kernel_options)
        engine = pd.make_engine(
            args.model,
            args.batch,
            args.prompt_len,
            args.new_tokens,
            args.block_size,
            args.decode_steps,
        )
        pd.timed_run(engine, args.batch, args.prompt_len, args.new_tokens, rng, "warm-up")
    finally:
        for (module, attr), kernel in bound.items():
            setattr(module, attr, kernel)
        for key, value in old_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return engine, engine.num_compiles


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
    p.add_argument("--model", default="random:gpt2", help="model to load (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="concurrent requests (default: 1)")
    p.add_argument("--prompt-len", type=int, default=8, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per request")
    p.add_argument("--decode-steps", type=int, default=32, help="decode steps per device call")
    p.add_argument("--block-size", type=int, default=64, help="KV block size")
    p.add_argument("--runs", type=int, default=5, help="timed runs of each variant, interleaved")
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args(argv)
    names = [v.name for v in args.variants]
    if len(set(names)) != len(names):
        p.error(f"variant names must differ, got {names}")
    if args.new_tokens < 2 or args.runs < 1:
        p.error("need --new-tokens >= 2 (a decode step) and --runs >= 1")
    rng = np.random.default_rng(0)
    engines = {v.name: build(v, args, rng) for v in args.variants}
    ms = {name: [] for name in engines}  # ms per decode step of each timed run
    for run in range(args.runs):
        for name, (engine, _) in engines.items():
            decode_s, _, _ = pd.timed_run(
                engine, args.batch, args.prompt_len, args.new_tokens, rng, f"{name}-{run}"
            )
            ms[name].append(decode_s / (args.new_tokens - 1) * 1e3)
    median = {name: statistics.median(xs) for name, xs in ms.items()}
    rows = [
        dict(
            name=var.name,
            settings=[f"{k}={v}" for k, v in var.env.items()]
            + [f"{op}.{param}={n}" for op, param, n in var.kernel_options],
            ms_per_step=median[var.name],
            runs=[round(x, 4) for x in ms[var.name]],
            vs_baseline=median[var.name] / median[names[0]],
            recompiled=engines[var.name][0].num_compiles != engines[var.name][1],
        )
        for var in args.variants
    ]
    print(
        f"\ncard: {jax.devices()[0].device_kind}, jax {jax.__version__}, batch {args.batch}, "
        f"{args.runs} interleaved runs each"
    )
    print(f"{'variant':>14} {'ms/step':>8} {'x base':>7}  ms/step of each run")
    for r in rows:
        note = "  RECOMPILED in timed runs" if r["recompiled"] else ""
        print(
            f"{r['name']:>14} {r['ms_per_step']:>8.4f} {r['vs_baseline']:>7.3f}  "
            + " ".join(f"{x:.3f}" for x in r["runs"])
            + note
        )
    result = dict(rows=rows, batch=args.batch, device=jax.devices()[0].device_kind)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
