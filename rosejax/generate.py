"""`python -m rosejax.generate`: generate text from a GPT-2 checkpoint on the command line."""

from __future__ import annotations

import argparse
import sys
import time

from rosejax.engine import DECODE_STEPS_HELP, parse_decode_steps
from rosejax.sampling import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rosejax.generate",
        description="Generate text with rosejax from a Hugging Face GPT-2 checkpoint.",
    )
    p.add_argument(
        "--model",
        default="gpt2",
        help="hub id (gpt2, gpt2-medium, ...), local save_pretrained directory, or "
        "random:<preset> for random weights of a GPT-2 shape (random:gpt2, "
        "random:gpt2-xl, random:tiny); default: %(default)s",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory or hub id, for a checkpoint without tokenizer files "
        "(random:* models use the packaged GPT-2 tokenizer)",
    )
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="a prompt; repeat the flag for several prompts, batched together",
    )
    p.add_argument(
        "--prompt-file",
        default=None,
        help="a file with one prompt per line (added after any --prompt)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="tokens to generate per prompt at most; default: %(default)s",
    )
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
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed (the same seed gives the same text); default: random",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        help="a stop string, not included in the output; repeatable",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past the end-of-text token"
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="print text as it is generated (prompts one after another)",
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
        default=64,
        help="most requests decoded together; default: %(default)s",
    )
    p.add_argument(
        "--block-size", type=int, default=64, help="tokens per KV cache block; default: %(default)s"
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="KV cache size in tokens; default: half the free GPU memory "
        "(CPU: max batch x context)",
    )
    p.add_argument(
        "--decode-steps",
        type=parse_decode_steps,
        default="auto",
        help=DECODE_STEPS_HELP,
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
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prompts = list(args.prompt or [])
    if args.prompt_file:
        with open(args.prompt_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        parser.error("give at least one --prompt or a --prompt-file")
    try:
        params = SamplingParams(
            max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
        )  # fmt: skip
        from rosejax.llm import LLM

        llm = LLM(
            args.model, tokenizer=args.tokenizer, dtype=args.dtype,
            max_batch_size=args.max_batch_size, block_size=args.block_size,
            kv_cache_tokens=args.kv_cache_tokens, decode_steps=args.decode_steps,
            enable_prefix_caching=not args.no_prefix_cache, warmup=False if args.no_warmup else None,
        )  # fmt: skip
        start = time.perf_counter()
        first_token_at = None
        tokens = 0
        if args.stream:
            current = None
            for out in llm.generate_stream(prompts, params):
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                if out.request_id != current and out.new_text:
                    current = out.request_id
                    print(f"\n[{out.request_id}] ", end="")
                print(out.new_text, end="", flush=True)
                tokens += len(out.new_token_ids)
            print()
        else:
            for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
                print(f"{prompt}{out.text}\n[finish: {out.finish_reason}]")
                tokens += len(out.token_ids)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    ttft = f"{(first_token_at - start) * 1e3:.1f} ms" if first_token_at else "n/a (not streamed)"
    print(
        f"[rosejax] {tokens} tokens in {elapsed:.2f} s, {tokens / elapsed:.1f} tok/s, "
        f"TTFT {ttft}, compile {llm.engine.compile_seconds:.1f} s "
        f"({llm.engine.num_compiles} programs)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
