"""Greedy parity of the engine against HF transformers on many random prompts (any backend).

Builds a random GPT-2 with `save_pretrained`, serves N random prompts through `LLM` with the given
batch and decode-window settings, and counts requests whose tokens differ from HF's greedy
`generate` (run on the CPU, fp32). For chasing device-only mismatches under different switches.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import jax
import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rosejax import LLM, SamplingParams


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-prompts", type=int, default=24, help="random prompts to serve")
    p.add_argument("--max-batch-size", type=int, default=4, help="engine max batch")
    p.add_argument("--decode-steps", default="4", help="engine decode window ('auto' or an int)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per request")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="engine KV budget")
    p.add_argument("--seed", type=int, default=0, help="prompt and weight seed")
    args = p.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")  # no TF32: compare in fp32
    torch.manual_seed(args.seed)
    hf = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=1000, n_positions=128, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3
        )
    ).eval()
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, 1000, rng.integers(1, 40)).tolist() for _ in range(args.num_prompts)]
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
