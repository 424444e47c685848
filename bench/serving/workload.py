"""The requests: prompts and output lengths from a dataset, warm-up copies, arrival times."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass
class Sample:
    """One request of the workload."""

    prompt: str | list[int]
    output_len: int

    @property
    def prompt_len(self) -> int | None:
        """Prompt tokens if the prompt is token ids (text: the server's usage tells)."""
        return None if isinstance(self.prompt, str) else len(self.prompt)


def uniform_lengths(length: int, ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    """n integers uniform in [floor(length (1 - ratio)), floor(length (1 + ratio))], at least 1."""
    lo, hi = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def random_dataset(args: argparse.Namespace, seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    n = args.num_prompts
    in_lens = uniform_lengths(args.input_len, args.range_ratio, n, rng)
    out_lens = uniform_lengths(args.output_len, args.range_ratio, n, rng)
    return [
        Sample([int(t) for t in rng.integers(0, args.vocab_size - 1, size=k)], o)
        for k, o in zip(in_lens, out_lens, strict=True)
    ]


def jsonl_dataset(path: str, num_prompts: int, output_len: int) -> list[Sample]:
    out: list[Sample] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if len(out) == num_prompts:
                break
            if not line.strip():
                continue
            obj = json.loads(line)
            prompt = obj.get("prompt") if isinstance(obj, dict) else None
            ids = isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
            if not (isinstance(prompt, str) and prompt) and not ids:
                raise SystemExit(f"{path}:{lineno}: 'prompt' must be non-empty text or token ids")
            n = obj.get("output_len", output_len)
            if type(n) is not int or n < 1:
                raise SystemExit(f"{path}:{lineno}: 'output_len' must be an int >= 1")
            out.append(Sample(prompt, n))
    if not out:
        raise SystemExit(f"{path}: no prompts")
    if len(out) < num_prompts:
        print(f"{path}: {len(out)} prompts (fewer than --num-prompts)", file=sys.stderr)
    return out


def warmup_samples(samples: Sequence[Sample], run: int, args: argparse.Namespace) -> list[Sample]:
    """Warm-up run `run`: each sample's lengths with fresh random ids (text: a prefix added)."""
    rng = np.random.default_rng([args.seed, 1000 + run])
    return [
        Sample(f"warm-up {run}-{i}: {s.prompt}", s.output_len)
        if isinstance(s.prompt, str)
        else Sample(
            [int(t) for t in rng.integers(0, args.vocab_size - 1, len(s.prompt))], s.output_len
        )
        for i, s in enumerate(samples)
    ]


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start each request is due: 0 for the first; then gaps drawn from
    gamma(shape = burstiness, scale = 1 / (rate x burstiness)) (burstiness 1: exponential, a
    Poisson process of `rate` per second). rate inf: all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng([seed, 1])
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def workload(args: argparse.Namespace) -> list[Sample]:
    if args.dataset == "jsonl":
        return jsonl_dataset(args.dataset_path, args.num_prompts, args.output_len)
    return random_dataset(args, args.seed)


def timed_workload(
    args: argparse.Namespace,
) -> tuple[list[Sample], list[float], list[list[Sample]]]:
    """The timed run's samples and arrival offsets (the flags'), and each warm-up's samples."""
    samples = workload(args)
    offsets = arrival_offsets(len(samples), args.request_rate, args.burstiness, args.seed)
    return samples, offsets, [warmup_samples(samples, r, args) for r in range(args.warmup_runs)]
