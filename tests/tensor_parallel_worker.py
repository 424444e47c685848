"""Runs in a subprocess of tests/test_tensor_parallel.py, whose environment gives XLA four host
devices (`--xla_force_host_platform_device_count=4`) before jax starts: engines at several
tensor-parallel sizes, their tokens and the errors of bad configurations written as JSON.

    python -m tests.tensor_parallel_worker SPEC.json

SPEC: {"models": {name: checkpoint dir}, "prompts": [[ids]], "full": bool, "cases": [CASE],
"out": results path}. A CASE is NAME:TP:PATH[:DP] with PATH "xla" (every op in XLA) or "kernels"
(the GPU path's Pallas kernels, interpreted) and DP data-parallel replicas (default 1); its result
is a list of token lists, or the ValueError's message.
"""

from __future__ import annotations

import json
import sys

import jax

from rosejax import LLM, KernelConfig, SamplingParams
from rosejax.tokenizer import packaged_gpt2_tokenizer_path

# What the GPU runs (interpreted here): every Pallas kernel, decode attention writing the K/V.
KERNELS = KernelConfig.for_backend("gpu", interpret=True)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)


def generate(
    path: str, tp: int, dp: int, kernels: KernelConfig, prompts, full: bool
) -> list[list[int]]:
    """Every request's tokens: the prompts greedily in one batch; with `full` then the first
    prompt sampled (seeded) beside prompts that continue cached prefixes (the paged prefill)."""
    llm = LLM(
        path,
        tokenizer=packaged_gpt2_tokenizer_path(),
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        kernels=kernels,
        dtype="float32",
        block_size=16,  # the prefill kernel's smallest tile
        max_batch_size=4,
        min_decode_batch=4,  # one decode program
        decode_steps=4,
        warmup=False,
    )
    outs = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    if full:
        again = [prompts[0], prompts[1] + [3, 4], prompts[2] + outs[2][:3]]
        more = llm.generate(again, [SAMPLED, GREEDY, GREEDY], use_tqdm=False)
        outs += [o.token_ids for o in more]
    return outs


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    jax.config.update("jax_default_matmul_precision", "highest")
    results = {}
    for case in spec["cases"]:
        name, tp, what, *dp = case.split(":")
        kernels = KERNELS if what == "kernels" else KernelConfig()
        try:
            path = spec["models"][name]
            sizes = int(tp), int(dp[0]) if dp else 1
            results[case] = generate(path, *sizes, kernels, spec["prompts"], spec["full"])
        except ValueError as e:
            results[case] = str(e)
    with open(spec["out"], "w") as f:
        json.dump({"devices": jax.device_count(), "results": results}, f)


if __name__ == "__main__":
    main(sys.argv[1])
