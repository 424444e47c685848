"""`python -m rosejax.generate`: generate text from a Hugging Face checkpoint on the command
line."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from rosejax.engine_args import (
    add_distributed_args,
    add_engine_args,
    add_sampling_args,
    distributed_kwargs,
    engine_kwargs,
    sampling_params,
)
from rosejax.models import SUPPORTED_MODEL_TYPES
from rosejax.settings import initialize_distributed


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rosejax.generate",
        description="Generate text with rosejax from a Hugging Face checkpoint (model_type "
        f"{SUPPORTED_MODEL_TYPES}).",
    )
    add_engine_args(p)
    add_distributed_args(p)
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
    add_sampling_args(p, max_new_tokens=64)
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
        "--stream",
        action="store_true",
        help="print text as it is generated; with several prompts, generated together, each "
        "piece is labelled [N] (the prompt's number, from 0) and each prompt is echoed when "
        "its first piece arrives",
    )
    return p


def _read_prompt_file(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """Its non-empty lines; a file that cannot be read is a usage error, not a traceback."""
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    except UnicodeDecodeError as e:
        parser.error(f"--prompt-file {path}: not UTF-8 text ({e})")
    except OSError as e:
        parser.error(f"--prompt-file {path}: {e.strerror or e}")


def _silent(*args, **kwargs) -> None:
    pass


def _print_logprobs(echo, label: str, out) -> None:
    """One line per generated token: its text, logprob and rank, then the alternatives."""
    for token, entry in zip(out.token_ids, out.outputs[0].logprobs, strict=True):
        own = entry[token]
        others = ", ".join(
            f"{lp.decoded_token!r} {lp.logprob:.3f}" for t, lp in entry.items() if t != token
        )
        tail = f" | {others}" if others else ""
        echo(f"{label}{own.decoded_token!r} {own.logprob:.3f} (rank {own.rank}){tail}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # What loading and compiling are doing, on stderr (the text goes to stdout).
    logging.basicConfig(level=logging.WARNING, format="[%(name)s] %(message)s")
    logging.getLogger("rosejax").setLevel(logging.INFO)
    prompts = list(args.prompt or [])
    if args.prompt_file:
        prompts += _read_prompt_file(parser, args.prompt_file)
    if not prompts:
        parser.error("give at least one --prompt or a --prompt-file")
    try:
        # Before anything starts jax's backend (--kernel flags do, in engine_kwargs).
        distributed = distributed_kwargs(args)
        initialize_distributed(
            args.distributed_coordinator_address, args.num_processes, args.process_id
        )
        params = sampling_params(args, seed=args.seed, stop=args.stop)
        from rosejax.llm import LLM

        llm = LLM(args.model, **engine_kwargs(args), **distributed)
        # Every process of a distributed run generates the same text: process 0 prints it.
        echo = print if args.process_id == 0 else _silent
        start = time.perf_counter()
        first_token_at = None
        tokens = 0
        if args.stream:
            # Several prompts decode together, so their pieces interleave: each run of one
            # prompt's pieces starts a line "[N] " (N: its number, from 0); its first echoes it.
            ids = [str(i) for i in range(len(prompts))]
            current, seen = None, set()
            finals = {}
            for out in llm.generate_stream(prompts, params, request_ids=ids):
                if out.finished:
                    finals[int(out.request_id)] = out
                first_token_at = first_token_at or time.perf_counter()
                tokens += len(out.new_token_ids)
                i = int(out.request_id)
                if i != current and (out.new_text or out.finished):
                    head = "" if current is None else "\n"
                    head += f"[{i}] " if len(prompts) > 1 else ""
                    echo(head + ("" if i in seen else prompts[i]), end="")
                    current = i
                    seen.add(i)
                echo(out.new_text, end="", flush=True)
            echo()
            if params.logprobs is not None:
                for i in sorted(finals):
                    _print_logprobs(echo, f"[{i}] " if len(prompts) > 1 else "", finals[i])
        else:
            for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
                echo(f"{prompt}{out.text}\n[finish: {out.finish_reason}]")
                if params.logprobs is not None:
                    _print_logprobs(echo, "", out)
                tokens += len(out.token_ids)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    ttft = f"{(first_token_at - start) * 1e3:.1f} ms" if first_token_at else "n/a (not streamed)"
    echo(
        f"[rosejax] {tokens} tokens in {elapsed:.2f} s, {tokens / elapsed:.1f} tok/s, "
        f"TTFT {ttft}, compile {llm.engine.compile_seconds:.1f} s "
        f"({llm.engine.num_compiles} programs)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
