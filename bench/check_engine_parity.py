"""Greedy parity of the engine against HF transformers on many random prompts (any backend).

Builds a small random model of a family (GPT-2, Qwen3 or Llama 3) with `save_pretrained`, serves N
random prompts through `LLM` with the given batch, decode-window and kernel settings, and counts
requests whose tokens differ from HF's greedy `generate` (run on the CPU, fp32). For chasing
device-only mismatches under different switches: the CPU tests never run a GPU's command
buffers, so a change to the decode program is checked here on a GPU, e.g.
`python bench/check_engine_parity.py --family qwen3 --kernel fused_swiglu=off`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

if __package__ in (None, ""):  # run as a file: make `bench` and `rosejax` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from bench.common import random_hf_model  # noqa: E402
from rosejax import LLM, SamplingParams  # noqa: E402
from rosejax.engine_args import add_kernel_args, kernel_overrides  # noqa: E402

VOCAB = 1000
# Llama-style shapes the Pallas kernels tile (head_dim 64, powers of two), GQA groups of 2; no
# eos id (`random_hf_model`'s default: the requests run to max_tokens, as HF's side does).
LLAMA_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=128,
    initializer_range=0.3,
)


def random_model(family: str, seed: int) -> torch.nn.Module:
    """A small random HF model of `family`: Qwen3 with a tied head, Llama with an untied one."""
    if family == "gpt2":
        torch.manual_seed(seed)
        config = GPT2Config(
            vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3
        )
        return GPT2LMHeadModel(config).eval()
    return random_hf_model(family, seed, tie_word_embeddings=family == "qwen3", **LLAMA_SHAPE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--family",
        choices=["gpt2", "qwen3", "llama"],
        default="gpt2",
        help="the random model's family (default: %(default)s)",
    )
    p.add_argument("--num-prompts", type=int, default=24, help="random prompts to serve")
    p.add_argument("--max-batch-size", type=int, default=4, help="engine max batch")
    p.add_argument("--decode-steps", default="4", help="engine decode window ('auto' or an int)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per request")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="engine KV budget")
    p.add_argument("--seed", type=int, default=0, help="prompt and weight seed")
    add_kernel_args(p)
    args = p.parse_args(argv)
    try:
        overrides = kernel_overrides(args.kernel, args.kernel_tile)
    except ValueError as e:
        p.error(str(e))
    jax.config.update("jax_default_matmul_precision", "highest")  # no TF32: compare in fp32
    hf = random_model(args.family, args.seed)
    rng = np.random.default_rng(args.seed)
    prompts = [
        rng.integers(0, VOCAB, rng.integers(1, 40)).tolist() for _ in range(args.num_prompts)
    ]
    steps = args.decode_steps if args.decode_steps == "auto" else int(args.decode_steps)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        llm = LLM(
            d,
            tokenizer="rosejax/tokenizer_data",
            block_size=8,
            dtype="float32",
            max_batch_size=args.max_batch_size,
            decode_steps=steps,
            warmup=False,
            kv_cache_tokens=args.kv_cache_tokens,
            kernel_overrides=overrides,
        )
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0), use_tqdm=False
        )
    bad = 0
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt)),
                max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        if out.token_ids != ref:
            bad += 1
            first = next(
                i for i, (a, b) in enumerate(zip(out.token_ids, ref, strict=False)) if a != b
            )
            print(f"mismatch: prompt len {len(prompt)}, first diff at {first}")
    print(
        f"{bad}/{len(prompts)} requests differ from HF "
        f"(preemptions: {llm.engine.scheduler.num_preemptions})"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
