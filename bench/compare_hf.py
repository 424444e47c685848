"""rosejax beside HF transformers (PyTorch) on the same workloads, the same device, the same run.

Workload per batch size B (--batch-sizes): B requests of --input-len random token ids (the same
ids on both sides), exactly --max-new-tokens new tokens each (EOS off: rosejax ignore_eos, HF
min_new_tokens = max_new_tokens), greedy, all submitted at once.

HF runs `model.generate` twice per batch size: with the default dynamic cache, and with
`cache_implementation="static"`, for which transformers (>= 4.48, 5.x) compiles the decode
forward itself on CUDA (`torch.compile`, mode "reduce-overhead", i.e. CUDA graphs; here with
`CompileConfig(dynamic=False)` so each batch size gets its own static graph). The first
--warmup-runs generate calls per (mode, B) are not timed (they compile); HF's time is the whole
generate call (prefill + decode), tokens/s = B x new tokens / that time. On a CPU torch compiles
nothing there (transformers compiles only on accelerators), so the static row is an uncompiled
static cache. rosejax's figures are the engine's end-to-end throughput (first submit to last
token, prefill included: the one to set beside HF's) and its decode-only throughput.

Weights: random of the same shape on both sides (`--model random:gpt2`: rosejax's random
init, and HF's `GPT2LMHeadModel(GPT2Config(...))` under `torch.manual_seed(--seed)`;
`random:qwen3-0.6b`, `random:llama-3.2-1b`: `AutoModelForCausalLM.from_config` of the preset's
config.json fields), or both load the same checkpoint directory. The weights differ, the work does
not (EOS is off). Llama-style presets have long contexts (40,960 and 131,072 positions): give
`--max-model-len` (e.g. 2048) or the engine compiles prefills of the whole context.

Memory: JAX preallocates 75% of the GPU when its backend starts, and torch's caching allocator
keeps what it took. So HF runs first, in a subprocess of this script (started with
JAX_PLATFORMS=cpu, so it never touches the GPU through JAX), and its memory is freed when it
exits; only then does this process start JAX for rosejax, whose KV cache gets an explicit
--kv-cache-tokens (default: max batch x (input + new tokens)). --hf-in-process runs both in
one process instead: then set XLA_PYTHON_CLIENT_PREALLOCATE=false (or
XLA_PYTHON_CLIENT_MEM_FRACTION) so JAX leaves torch room.

    python bench/compare_hf.py --batch-sizes 1,16,64,256 --max-new-tokens 256 \
        --json out/compare.json --plot out/compare.png
    python bench/compare_hf.py --model random:qwen3-0.6b --max-model-len 2048 --dtype bfloat16 \
        --batch-sizes 1,16,64,256 --max-new-tokens 256     # Qwen3-0.6B's shape
    python bench/compare_hf.py --model random:tiny --batch-sizes 1,2 --max-new-tokens 4 \
        --skip-hf-static --no-warmup                          # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: make `bench` and `rosejax` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from bench import common  # noqa: E402
from bench.benchmark_scheduler import random_prompts  # noqa: E402
from rosejax.engine_args import add_logprobs_arg  # noqa: E402
from rosejax.sampling import SamplingParams  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = common.new_parser(__doc__)
    common.add_engine_args(p, max_batch_size=0)
    p.add_argument(
        "--batch-sizes",
        type=common.ints,
        default=[1, 16, 64, 256],
        metavar="B1,B2,...",
        help="batch sizes (requests per workload); each gets an engine of that max "
        "batch size unless --max-batch-size is set (its default 0 = B)",
    )
    p.add_argument("--input-len", type=int, default=8, help="prompt tokens (random ids)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per request")
    p.add_argument(
        "--ignore-eos",
        "--no-stop-on-eos",
        action="store_true",
        help="accepted for symmetry with the other scripts: EOS is always off here, "
        "and decoding greedy, as in the HF runs",
    )
    p.add_argument("--skip-hf", action="store_true", help="run rosejax only")
    add_logprobs_arg(p)  # rosejax's side only: what asking for logprobs costs
    p.add_argument(
        "--skip-hf-static",
        action="store_true",
        help="skip HF's static cache + torch.compile (slow to compile)",
    )
    p.add_argument("--skip-hf-dynamic", action="store_true", help="skip HF's dynamic cache")
    p.add_argument("--skip-rosejax", action="store_true", help="run HF only")
    p.add_argument(
        "--hf-in-process",
        action="store_true",
        help="run HF in this process (see the memory note above), not a subprocess",
    )
    p.add_argument("--hf-device", default=None, help="torch device; default: cuda if available")
    p.add_argument("--hf-worker-out", default=None, help=argparse.SUPPRESS)
    common.add_run_args(p, warmup_runs=1, repeat_runs=3)
    return p


# ------------------------------------------------------------------------------------- HF


def _hf_model(args: argparse.Namespace, torch_dtype):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2LMHeadModel
    from transformers import GPT2Config as HFConfig

    if args.model.startswith("random:"):
        from rosejax.models import preset

        c = preset(args.model.removeprefix("random:"))
        torch.manual_seed(args.seed)
        if hasattr(c, "to_hf_dict"):  # the Llama-style family: Qwen3, Llama, ...
            d = c.to_hf_dict()
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d))
            return model.to(dtype=torch_dtype).eval()
        config = HFConfig(
            vocab_size=c.vocab_size,
            n_positions=c.n_positions,
            n_embd=c.n_embd,
            n_layer=c.n_layer,
            n_head=c.n_head,
            n_inner=c.n_inner,
            layer_norm_epsilon=c.layer_norm_epsilon,
            bos_token_id=c.bos_token_id,
            eos_token_id=c.eos_token_id,
        )
        model = GPT2LMHeadModel(config)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model)
    return model.to(dtype=torch_dtype).eval()


def run_hf(args: argparse.Namespace) -> dict:
    """Time HF generate per (cache mode, batch size); errors are recorded, not raised."""
    import torch
    import transformers
    from transformers import CompileConfig

    device = args.hf_device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype == "auto":
        torch_dtype = torch.float16 if device.startswith("cuda") else torch.float32
    else:
        torch_dtype = getattr(torch, args.dtype)
    # Each batch size compiles its own graph; the default limit (8) could fall back to eager.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    model = _hf_model(args, torch_dtype).to(device)
    vocab, eos = model.config.vocab_size, model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos if eos is not None else 0  # a pad id
    prompts = random_prompts(max(args.batch_sizes), args.input_len, vocab, args.seed)
    n_new = args.max_new_tokens
    out: dict = {
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else device,
            "dtype": str(torch_dtype).removeprefix("torch."),
        },
        "results": [],
    }
    modes = [
        m_
        for m_, skip in (("dynamic", args.skip_hf_dynamic), ("static", args.skip_hf_static))
        if not skip
    ]

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for mode in modes:
        for b in args.batch_sizes:
            ids = torch.tensor(prompts[:b], dtype=torch.long, device=device)  # [B, T]
            kw = dict(
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                pad_token_id=eos,
            )
            if mode == "static":
                kw.update(
                    cache_implementation="static", compile_config=CompileConfig(dynamic=False)
                )
            row: dict = {"mode": mode, "batch_size": b, "warmup_seconds": [], "seconds": []}
            try:
                with torch.inference_mode():
                    for i in range(args.warmup_runs + args.repeat_runs):
                        sync()
                        t0 = time.perf_counter()
                        gen = model.generate(ids, **kw)
                        sync()
                        dt = time.perf_counter() - t0
                        if gen.shape != (b, args.input_len + n_new):
                            raise RuntimeError(f"generate returned shape {tuple(gen.shape)}")
                        row["warmup_seconds" if i < args.warmup_runs else "seconds"].append(dt)
                med = statistics.median(row["seconds"])
                row.update(
                    median_seconds=med,
                    throughput_tok_s=b * n_new / med,
                    ms_per_token=med / n_new * 1e3,
                    compiled=hasattr(model, "_compiled_call"),
                )
                print(
                    f"HF {mode:<7} B={b:<4} {row['throughput_tok_s']:12,.0f} tok/s  "
                    f"{row['ms_per_token']:8.2f} ms/step  (warm-up "
                    f"{sum(row['warmup_seconds']):.1f} s, compiled={row['compiled']})",
                    file=sys.stderr,
                    flush=True,
                )
            except Exception as e:  # record and go on: one failing mode must not lose the rest
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                print(f"HF {mode} B={b} failed: {row['error'][:300]}", file=sys.stderr)
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            out["results"].append(row)
    return out


def run_hf_subprocess(args: argparse.Namespace, argv: list[str]) -> dict:
    """run_hf in a child process, so torch's GPU memory is gone before JAX starts."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "hf.json")
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--hf-worker-out", path]
        rc = subprocess.run(cmd, env=env).returncode
        if rc != 0 or not os.path.exists(path):
            return {"error": f"HF worker exited with {rc}", "results": []}
        with open(path) as f:
            return json.load(f)


# -------------------------------------------------------------------------------- rosejax


def run_rosejax(args: argparse.Namespace) -> dict:
    max_b = max(args.batch_sizes)
    if args.kv_cache_tokens is None:  # explicit, so the engine never sizes from free memory
        args.kv_cache_tokens = max_b * (args.input_len + args.max_new_tokens)
    engine, head = common.start(
        args, "compare_hf", label="rosejax", max_batch_size=args.max_batch_size or max_b
    )
    params = SamplingParams(
        max_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True, logprobs=args.logprobs
    )
    prompts = random_prompts(max_b, args.input_len, engine.config.vocab_size, args.seed)
    out: dict = {
        "environment": head["environment"],
        "build_seconds": head["engine"]["build_seconds"],
        "results": [],
    }

    for b in args.batch_sizes:
        rep = common.run_repeated(
            engine, args, lambda run, b=b: prompts[:b], params, tag_prefix=f"B{b}-", report=False
        )
        runs = [r["summary"] for r in rep["runs"]]
        agg = rep["summary"]
        row = {
            "batch_size": b,
            "throughput_tok_s": agg["throughput_tok_s"]["median"],
            "decode_throughput_tok_s": agg.get("decode_throughput_tok_s", {}).get("median"),
            "ttft_ms_p50": agg.get("ttft_ms.p50", {}).get("median"),
            "tpot_ms_p50": agg.get("tpot_ms.p50", {}).get("median"),
            "decode_step_ms": (
                agg["roofline.step_seconds"]["median"] * 1e3
                if "roofline.step_seconds" in agg
                else None
            ),
            "decode_gbs": agg.get("roofline.achieved_gbs", {}).get("median"),
            "decode_pct_of_bandwidth": agg.get("roofline.pct_of_bandwidth", {}).get("median"),
            "decode_gflop_per_step": (
                agg["roofline.flops"]["median"] / 1e9 if "roofline.flops" in agg else None
            ),
            "completion_tokens": [r["completion_tokens"] for r in runs],
            "compiles_in_timed_runs": sum(r["new_compiles"] for r in runs),
            "runs": runs,
        }
        pct = row["decode_pct_of_bandwidth"]
        print(
            f"rosejax B={b:<4} {row['throughput_tok_s']:12,.0f} tok/s end to end, "
            f"{row['decode_throughput_tok_s'] or 0:12,.0f} decode-only, TPOT p50 "
            f"{row['tpot_ms_p50'] or 0:.2f} ms; decode {row['decode_gbs'] or 0:,.0f} GB/s"
            + (f" ({pct:.0f}% of {args.bandwidth_gbs:,.0f})" if pct is not None else "")
            + f", {row['decode_gflop_per_step'] or 0:.1f} GFLOP/step",
            file=sys.stderr,
            flush=True,
        )
        out["results"].append(row)
    return out


# ----------------------------------------------------------------------------------- main


def _hf_tok_s(hf: dict, mode: str, b: int) -> float | None:
    for r in hf.get("results", []):
        if r["mode"] == mode and r["batch_size"] == b:
            return r.get("throughput_tok_s")
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.hf_worker_out:  # the child: HF only, then exit (frees its GPU memory)
        common.write_json(args.hf_worker_out, run_hf(args))
        return 0
    hf: dict = {"results": [], "skipped": True}
    if not args.skip_hf:
        hf = run_hf(args) if args.hf_in_process else run_hf_subprocess(args, argv)
    rose = {"results": []} if args.skip_rosejax else run_rosejax(args)
    table = []
    for b in args.batch_sizes:
        r = next((x for x in rose["results"] if x["batch_size"] == b), {})
        dyn, sta = _hf_tok_s(hf, "dynamic", b), _hf_tok_s(hf, "static", b)
        ours = r.get("throughput_tok_s")
        table.append(
            {
                "batch_size": b,
                "rosejax_tok_s": ours,
                "rosejax_decode_tok_s": r.get("decode_throughput_tok_s"),
                "rosejax_tpot_ms_p50": r.get("tpot_ms_p50"),
                "hf_dynamic_tok_s": dyn,
                "hf_static_tok_s": sta,
                "ratio_vs_dynamic": ours / dyn if ours and dyn else None,
                "ratio_vs_static": ours / sta if ours and sta else None,
            }
        )
    _print_table(table, args)
    result = {
        "benchmark": "compare_hf",
        "args": vars(args),
        "environment": common.environment(),
        "rosejax": rose,
        "hf": hf,
        "table": table,
    }
    common.write_json(args.json, result)
    if args.plot:
        common.plot_throughput(
            args.plot,
            args.batch_sizes,
            {
                "rosejax (end to end)": [t["rosejax_tok_s"] for t in table],
                "rosejax (decode only)": [t["rosejax_decode_tok_s"] for t in table],
                "HF dynamic cache": [t["hf_dynamic_tok_s"] for t in table],
                "HF static cache + torch.compile": [t["hf_static_tok_s"] for t in table],
            },
            f"{args.model}, {args.input_len}-token prompts, {args.max_new_tokens} new, "
            f"{rose.get('environment', {}).get('device', '')}",
        )
    return 0


def _print_table(table: list[dict], args: argparse.Namespace) -> None:
    def f(v, fmt=",.0f"):
        return "-" if v is None else format(v, fmt)

    print(
        f"{args.input_len}-token prompts, {args.max_new_tokens} new tokens, greedy, EOS off; "
        "tokens/s (rosejax end to end / decode only; HF whole generate)"
    )
    print(
        f"{'B':>5} {'rosejax':>10} {'rj decode':>10} {'rj TPOT ms':>10} {'HF dyn':>10} "
        f"{'HF static':>10} {'x dyn':>7} {'x static':>8}"
    )
    for t in table:
        print(
            f"{t['batch_size']:>5} {f(t['rosejax_tok_s']):>10} "
            f"{f(t['rosejax_decode_tok_s']):>10} {f(t['rosejax_tpot_ms_p50'], '.2f'):>10} "
            f"{f(t['hf_dynamic_tok_s']):>10} {f(t['hf_static_tok_s']):>10} "
            f"{f(t['ratio_vs_dynamic'], '.1f'):>7} {f(t['ratio_vs_static'], '.1f'):>8}"
        )


if __name__ == "__main__":
    sys.exit(main())
