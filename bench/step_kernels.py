"""The kernels of one decode step, without a GPU: the engine's decode window compiled for an H100
or H200 through jax's compile-only CUDA topology, its optimized HLO read for the window's loop,
and every kernel a trip of it launches listed by kind (Pallas kernels by name, XLA fusions,
library calls) beside the loop condition's.

At one row a decode step is latency-bound: every kernel costs a few microseconds whatever it
reads, so the count says where a step can shrink before a GPU measures it. Needs jax's CUDA
plugin (`pip install "jax[cuda12]"`, best in a virtual environment of its own made with
`--system-site-packages`: with the plugin jax looks for a GPU at every start; no GPU or driver
needed; run it with `JAX_PLATFORMS=cpu`); `--target cpu` compiles for this machine's CPU instead
(what the tests run). XLA tunes GEMMs only on a device: a compile-only build takes its
default for each, one kernel where cuBLAS runs (256 rows) but, for XLA's Triton GEMMs (the
17-128-row buckets), often a split-K config with a reduction kernel after it (and the epilogue's
add apart) that a device's autotuning may not pick: count those buckets' GEMMs as one each.

    JAX_PLATFORMS=cpu python bench/step_kernels.py --model random:gpt2 --batch 16
    JAX_PLATFORMS=cpu python bench/step_kernels.py --model random:qwen3-0.6b --max-model-len 2048 --batch 256 \\
        --dtype bfloat16 --target h200 --hlo-out /tmp/q256.hlo

The engine here holds 16 rows, so its decode runs the per-op kernels even at `--batch 1`; an
engine of one row on an H100 runs the one-kernel step instead (`decoder_step_programs` auto: the
GPU's SMs). To count that step's trip, name its programs:

    JAX_PLATFORMS=cpu python bench/step_kernels.py --model random:gpt2 --batch 1 \\
        --kernel decoder_step_programs=132
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402

from bench.common import configure_process, write_json  # noqa: E402
from rosejax import EngineConfig, KernelConfig, LLMEngine  # noqa: E402
from rosejax.engine_args import add_kernel_args, kernel_overrides  # noqa: E402

# The GPUs' target descriptions (XLA's GpuTargetConfigProto as text) for compile-only builds.
_GPU_INFO = """
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: 9
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
runtime_version {{
  major: 12
  minor: 8
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 7
}}
device_description_str: "{name}"
"""
TARGETS = {
    "h100": _GPU_INFO.format(
        bandwidth=3352320000000, memory=84929347584, name="NVIDIA H100 80GB HBM3"
    ),
    "h200": _GPU_INFO.format(bandwidth=4800000000000, memory=150754820096, name="NVIDIA H200"),
}

# An instruction of an optimized HLO module that launches work: `%name = shape opcode(...)`.
_LAUNCH = re.compile(
    r"^\s*(?:ROOT )?%(?P<name>\S+) = (?P<shape>.+?) "
    r"(?P<op>fusion|custom-call|while|conditional|copy|sort|all-reduce|all-gather)\("
)


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str  # the instruction's
    op: str  # fusion, custom-call, while, ...
    label: str  # what it is: a Pallas kernel's name, a fusion's kind, a custom call's target
    shape: str  # its output's


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """An optimized HLO module's text -> each computation's instruction lines by name, and the
    entry computation's name."""
    comps: dict[str, list[str]] = {}
    lines, entry = None, ""
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
        if head:
            lines = comps[head.group(2)] = []
            entry = head.group(2) if head.group(1) else entry
        elif line.startswith("}"):
            lines = None
        elif lines is not None:
            lines.append(line)
    return comps, entry


def kernels(lines: list[str]) -> list[Kernel]:
    """The instructions of a computation that launch work, in order."""
    out = []
    for line in lines:
        m = _LAUNCH.match(line)
        if m is None:
            continue
        label = m.group("op")
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if target and "triton" in target.group(1):
            # A Pallas kernel: its name is the op name's last part before /pallas_call.
            named = re.search(r'op_name="[^"]*/([^/"]+)/pallas_call"', line)
            label = f"pallas {named.group(1) if named else '?'}"
        elif target:
            label = f"custom-call {target.group(1)}"
        elif m.group("op") == "fusion":
            kind = re.search(r"kind=(\w+)", line)
            label = f"fusion {m.group('name').rstrip('.0123456789')}"
            label += f" ({kind.group(1)})" if kind else ""
        out.append(Kernel(m.group("name"), m.group("op"), label, m.group("shape")[:60]))
    return out


def window_loops(hlo: str) -> list[dict]:
    """The `while` loops of the module's entry computation (a window's: loops a backend makes
    of single ops inside them are left out), each as its body's and its condition's kernels."""
    comps, entry = computations(hlo)
    loops = []
    for line in comps[entry]:
        if " while(" not in line:
            continue
        body = re.search(r"body=%([^,\s]+)", line).group(1)
        cond = re.search(r"condition=%([^,\s]+)", line).group(1)
        loops.append(
            {
                "body": [dataclasses.asdict(k) for k in kernels(comps[body])],
                "condition": [dataclasses.asdict(k) for k in kernels(comps[cond])],
            }
        )
    return loops


def decode_hlo(engine, batch: int, greedy: bool, extras: bool, device=None) -> str:
    """The optimized HLO of `engine`'s decode window of `batch` rows, compiled for `device`
    (a compile-only device; None: jax's default) from its arguments' shapes."""
    _, program, args, static = engine.runner.idle_decode_call(batch, greedy, extras)
    if device is not None:
        args = placed(args, device)
    return program.lower(*args, **static).compile().as_text()


def placed(tree, device):
    """tree's arrays (or ShapeDtypeStructs) as ShapeDtypeStructs on `device` (a compile-only
    one): what `lower(...).compile()` builds for it."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sharding), tree
    )


def compile_only_device(target: str):
    """A compile-only device of `target` ("h100", "h200"); needs jax's CUDA plugin."""
    topology = topologies.get_topology_desc(
        "step_kernels", "cuda", target_config=TARGETS[target], topology="1x1x1"
    )
    return topology.devices[0]


def summary(loop: dict) -> dict:
    """A loop's kernels a trip, counted by label, and the totals."""
    body = collections.Counter(k["label"] for k in loop["body"])
    return {
        "kernels_per_trip": len(loop["body"]) + len(loop["condition"]),
        "pallas": sum(n for label, n in body.items() if label.startswith("pallas")),
        "other": sum(n for label, n in body.items() if not label.startswith("pallas")),
        "in_condition": len(loop["condition"]),
        "by_label": dict(body.most_common()),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="random:gpt2", help="model to load (default: %(default)s)")
    p.add_argument("--batch", type=int, default=16, help="the decode program's rows (a bucket)")
    p.add_argument("--max-model-len", type=int, default=None, help="cap on the model's context")
    p.add_argument("--dtype", default="float16", help="weights' dtype (default: %(default)s)")
    p.add_argument(
        "--sampled", action="store_true", help="the sampling program (default: the greedy one)"
    )
    p.add_argument(
        "--extras",
        action="store_true",
        help="the program with logits processors, min_p and logprobs",
    )
    p.add_argument(
        "--target",
        choices=[*TARGETS, "cpu"],
        default="h100",
        help="what to compile for: a GPU (compile-only) or this machine's CPU",
    )
    add_kernel_args(p)  # a variant's kernels, counted beside the defaults' in another run
    p.add_argument("--hlo-out", default=None, help="write the optimized HLO here")
    p.add_argument("--json", default=None, help="write the kernels and counts here")
    args = p.parse_args(argv)
    try:
        overrides = dict(kernel_overrides(args.kernel, args.kernel_tile))
    except ValueError as e:
        p.error(str(e))

    configure_process()  # rosejax's XLA flags, before the backends start
    device = None if args.target == "cpu" else compile_only_device(args.target)
    rows = max(args.batch, 16)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_batch_size=rows,
        max_model_len=args.max_model_len,
        kv_cache_tokens=rows * 32,  # its size does not change the kernels
        warmup=False,
        compilation_cache_dir=None,  # a compile-only executable cannot be cached
        min_decode_batch=min(16, args.batch),
        # the GPU's kernels (Pallas) unless compiling for this CPU
        kernels=KernelConfig.for_backend("cpu" if device is None else "gpu", **overrides),
    )
    engine = LLMEngine(config)
    hlo = decode_hlo(engine, args.batch, not args.sampled, args.extras, device)
    if args.hlo_out:
        with open(args.hlo_out, "w") as f:
            f.write(hlo)
    loops = window_loops(hlo)
    result = {
        "model": args.model,
        "batch": args.batch,
        "target": args.target,
        "greedy": not args.sampled,
        "extras": args.extras,
        "kernel_settings": [f"{name}={value}" for name, value in args.kernel],
        "kernel_tiles": [f"{op}.{param}={n}" for op, param, n in args.kernel_tile],
        "loops": [dict(summary(loop), **loop) for loop in loops],
    }
    for i, loop in enumerate(result["loops"]):
        print(
            f"loop {i}: {loop['kernels_per_trip']} kernels a trip = {loop['pallas']} Pallas + "
            f"{loop['other']} other in the body + {loop['in_condition']} in the condition"
        )
        for label, n in loop["by_label"].items():
            print(f"  {n:4d}  {label}")
        for k in loop["condition"]:
            print(f"     condition: {k['label']}  {k['shape']}")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
