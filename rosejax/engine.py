"""LLMEngine: jitted prefill and decode over the paged KV cache, continuous batching.

The verbs are JetStream's and vLLM's: `add_request`, `step`, `abort_request`. Every device call is
one compiled program per static shape (batch bucket, length bucket): prefill runs the forward over
padded prompts and samples their first token; decode runs `decode_steps` forward+sample steps in a
`lax.fori_loop`, feeding each step's tokens back on the device. The KV cache is donated to both, so
no step copies it. The host only decides who runs next (`rosejax.scheduler`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rosejax.config import GPT2Config
from rosejax.kv_cache import BlockAllocator, init_kv_cache, num_blocks_for
from rosejax.model import ForwardMetadata, forward
from rosejax.request import Request, RequestOutput
from rosejax.sampling import SamplingParams, sample
from rosejax.scheduler import DecodePlan, PrefillPlan, Scheduler
from rosejax.tokenizer import IncrementalDetokenizer, load_tokenizer
from rosejax.weights import load_model, resolve_dtype


def _buckets(limit: int, start: int = 1) -> list[int]:
    """Powers of two from `start` below `limit`, then `limit` itself."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


def _bucket(n: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= n)


def enable_compilation_cache(directory: str | None) -> None:
    """jax's persistent compilation cache, so a second start skips compiling."""
    directory = directory or os.environ.get(
        "ROSEJAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/rosejax/jax")
    )
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class LLMEngine:
    def __init__(
        self,
        model: str,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_batch_size: int = 64,
        block_size: int = 64,
        kv_cache_tokens: int | None = None,
        kv_cache_memory_fraction: float | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        max_prefill_tokens: int = 4096,
        prefill_max_batch_size: int | None = None,
        decode_steps: int = 1,
        compilation_cache_dir: str | None = None,
        warmup: bool = True,
    ):
        if max_batch_size < 1 or block_size < 1 or decode_steps < 1:
            raise ValueError("max_batch_size, block_size and decode_steps must be >= 1")
        if dtype == "auto":
            dtype = "float32" if jax.default_backend() == "cpu" else "float16"
        self.dtype = resolve_dtype(dtype)
        self.config, self.params = load_model(model, self.dtype, seed)
        self.tokenizer = load_tokenizer(model, tokenizer)
        cfg: GPT2Config = self.config
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.decode_steps = decode_steps
        self.max_blocks_per_seq = -(-cfg.n_positions // block_size)
        if kv_cache_tokens is None and kv_cache_memory_fraction is None:
            if jax.default_backend() == "cpu":
                kv_cache_tokens = max_batch_size * cfg.n_positions
            else:
                kv_cache_memory_fraction = 0.5
        num_blocks = num_blocks_for(
            cfg, block_size, self.dtype, kv_cache_tokens=kv_cache_tokens,
            memory_fraction=kv_cache_memory_fraction, max_num_seqs=max_batch_size,
        )  # fmt: skip
        self.cache = init_kv_cache(cfg, num_blocks, block_size, self.dtype)
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
        prefill_batch = min(prefill_max_batch_size or max_batch_size, max_batch_size)
        self.scheduler = Scheduler(
            self.allocator, max_batch_size, max(max_prefill_tokens, cfg.n_positions),
            prefill_batch, cfg.n_positions,
        )  # fmt: skip
        self.decode_buckets = _buckets(max_batch_size)
        self.prefill_batch_buckets = _buckets(prefill_batch)
        self.prefill_len_buckets = _buckets(cfg.n_positions, start=min(16, cfg.n_positions))
        self.seed = seed
        self._requests: dict[str, Request] = {}
        self._arrivals = 0
        self.num_compiles = 0  # traces of the step functions; flat after warm-up
        self.compile_seconds = 0.0
        self.prefill_tokens_computed = 0
        enable_compilation_cache(compilation_cache_dir)
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=(1,))
        self._sample_first = jax.jit(self._sample, static_argnames="greedy")
        self._decode = jax.jit(
            self._decode_fn, donate_argnums=(1,), static_argnames=("greedy", "num_steps")
        )
        if warmup:
            self.warmup()

    # ------------------------------------------------------------------ compiled device programs

    def _prefill_fn(self, params, cache, tokens, positions, seq_lens, tables, last):
        """The forward over padded prompts -> logits of each row's last token [B, V], cache.
        Sampling is a separate small program, so prefill buckets compile once, not per variant."""
        self.num_compiles += 1  # runs only while tracing
        meta = ForwardMetadata(positions=positions, seq_lens=seq_lens, block_tables=tables)
        return forward(params, self.config, tokens, cache, meta, last)

    def _decode_fn(
        self,
        params,
        cache,
        tokens,
        positions,
        seq_lens,
        tables,
        sampling,
        *,
        greedy: bool,
        num_steps: int,
    ):
        """`num_steps` decode steps; returns the sampled tokens [num_steps, B] and the cache."""
        self.num_compiles += 1
        temperature, top_k, top_p, seeds, steps, limit = sampling

        def body(k, carry):
            cache, tok, out = carry
            live = (seq_lens > 0) & (steps + k < limit)  # rows out of budget write to scratch
            pos = positions + k
            meta = ForwardMetadata(pos[:, None], jnp.where(live, pos + 1, 0), tables)
            logits, cache = forward(params, self.config, tok[:, None], cache, meta)
            nxt = self._sample(logits[:, 0], (temperature, top_k, top_p, seeds, steps + k), greedy)
            return cache, nxt, out.at[k].set(nxt)

        out = jnp.zeros((num_steps, tokens.shape[0]), jnp.int32)
        cache, _, out = jax.lax.fori_loop(0, num_steps, body, (cache, tokens, out))
        return out, cache

    def _sample(self, logits, sampling, greedy: bool):
        self.num_compiles += 1
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        temperature, top_k, top_p, seeds, steps = sampling[:5]
        return sample(logits, temperature, top_k, top_p, seeds, steps)

    def warmup(self) -> float:
        """Compile every bucket once (padded rows only write the scratch block); seconds taken."""
        start = time.perf_counter()
        for b in self.prefill_batch_buckets:
            for t in self.prefill_len_buckets:
                if b * t <= self.scheduler.max_prefill_tokens or b == 1:
                    self._run_prefill([], [], b, t)
            self._sample_first(
                jnp.zeros((b, self.config.vocab_size)), self._sampling_arrays([], b, False)[0],
                greedy=False,
            )  # fmt: skip
        for b in self.decode_buckets:
            for greedy in (True, False):
                self._run_decode([], b, greedy)
        self.compile_seconds += time.perf_counter() - start
        return time.perf_counter() - start

    # ------------------------------------------------------------------------- host <-> device

    def _sampling_arrays(self, requests: Sequence[Request], b: int, extra: bool):
        n = len(requests)
        temperature = np.zeros(b, np.float32)
        top_k = np.zeros(b, np.int32)
        top_p = np.ones(b, np.float32)
        seeds = np.zeros(b, np.uint32)
        steps = np.zeros(b, np.int32)
        limit = np.zeros(b, np.int32)
        for i, r in enumerate(requests):
            p = r.params
            temperature[i], top_k[i], top_p[i] = p.temperature, p.top_k, p.top_p
            seeds[i], steps[i] = r.seed, len(r.output_token_ids)
            limit[i] = min(p.max_tokens, self.config.n_positions - r.num_tokens + steps[i])
        greedy = n == 0 or not temperature[:n].any()
        arrays = (temperature, top_k, top_p, seeds, steps) + ((limit,) if extra else ())
        return tuple(jnp.asarray(a) for a in arrays), greedy

    def _tables(self, requests: Sequence[Request], b: int) -> np.ndarray:
        tables = np.zeros((b, self.max_blocks_per_seq), np.int32)
        for i, r in enumerate(requests):
            blocks = r.table.blocks
            tables[i, : len(blocks)] = blocks
        return tables

    def _run_prefill(self, requests: Sequence[Request], cached: Sequence[int], b: int, t: int):
        tokens = np.zeros((b, t), np.int32)
        positions = np.tile(np.arange(t, dtype=np.int32), (b, 1))
        seq_lens = np.zeros(b, np.int32)
        last = np.zeros(b, np.int32)
        for i, (r, c) in enumerate(zip(requests, cached, strict=True)):
            ids = r.all_token_ids()[c:]
            tokens[i, : len(ids)] = ids
            positions[i] += c
            seq_lens[i] = c + len(ids)
            last[i] = len(ids) - 1
        sampling, greedy = self._sampling_arrays(requests, b, extra=False)
        logits, self.cache = self._prefill(
            self.params, self.cache, tokens, positions, seq_lens, self._tables(requests, b), last
        )
        return self._sample_first(logits, sampling, greedy=greedy)

    def _run_decode(self, requests: Sequence[Request], b: int, greedy: bool | None = None):
        tokens = np.zeros(b, np.int32)
        positions = np.zeros(b, np.int32)
        seq_lens = np.zeros(b, np.int32)
        for i, r in enumerate(requests):
            tokens[i] = r.last_token
            positions[i] = r.num_tokens - 1
            seq_lens[i] = r.num_tokens
        sampling, all_greedy = self._sampling_arrays(requests, b, extra=True)
        greedy = all_greedy if greedy is None else greedy
        out, self.cache = self._decode(
            self.params, self.cache, tokens, positions, seq_lens, self._tables(requests, b),
            sampling, greedy=greedy, num_steps=self.decode_steps,
        )  # fmt: skip
        return out

    # ------------------------------------------------------------------------------ public API

    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request. Bad input raises ValueError and leaves the engine as it was."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        n_pos = self.config.n_positions
        if len(ids) > n_pos:
            raise ValueError(f"prompt has {len(ids)} tokens, more than the context ({n_pos})")
        if any(t < 0 or t >= self.config.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        need = -(-min(len(ids) + params.max_tokens, n_pos) // self.block_size)
        if need > self.allocator.num_blocks - 1:
            raise ValueError(
                f"the KV cache ({self.allocator.num_blocks - 1} blocks of {self.block_size}) "
                f"cannot hold this request ({need} blocks); raise kv_cache_tokens"
            )
        seed = params.seed if params.seed is not None else hash((self.seed, self._arrivals))
        request = Request(
            request_id, ids, params, seed & 0xFFFFFFFF, IncrementalDetokenizer(self.tokenizer),
            self.config.eos_token_id, self._arrivals,
        )  # fmt: skip
        self._arrivals += 1
        self._requests[request_id] = request
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one prefill or one decode window; return an output for every request it advanced."""
        plan = self.scheduler.schedule(self.decode_steps)
        if plan is None:
            return []
        b = len(plan.requests)
        if isinstance(plan, PrefillPlan):
            t = max(r.num_tokens - c for r, c in zip(plan.requests, plan.num_cached, strict=True))
            self.prefill_tokens_computed += sum(
                r.num_tokens - c for r, c in zip(plan.requests, plan.num_cached, strict=True)
            )
            out = self._run_prefill(
                plan.requests, plan.num_cached, _bucket(b, self.prefill_batch_buckets),
                _bucket(t, self.prefill_len_buckets),
            )[None]  # fmt: skip
        else:
            out = self._run_decode(plan.requests, _bucket(b, self.decode_buckets))
        return self._record(plan, np.asarray(out))

    def _record(self, plan: PrefillPlan | DecodePlan, out: np.ndarray) -> list[RequestOutput]:
        """Feed the sampled tokens [K, B] to their requests, in order, until each finishes."""
        outputs = []
        max_context = self.config.n_positions
        is_decode = isinstance(plan, DecodePlan)
        for i, request in enumerate(plan.requests):
            for k in range(out.shape[0]):
                if is_decode:  # the token fed at step k now has its KV in the cache
                    self.allocator.append(request.table, request.last_token)
                request.add_token(int(out[k, i]), max_context)
                if request.finished:
                    break
            outputs.append(request.take_output())
            if request.finished:
                self.scheduler.finish(request)
                del self._requests[request.request_id]
        return outputs


class LLM:
    """The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str, **engine_args):
        self.engine = LLMEngine(model, **engine_args)

    def _submit(self, prompts, sampling_params) -> list[str]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        base = self.engine._arrivals
        ids = [f"gen-{base + i}" for i in range(len(prompts))]
        added = []
        try:
            for rid, prompt, params in zip(ids, prompts, sampling_params, strict=True):
                self.engine.add_request(rid, prompt, params)
                added.append(rid)
        except ValueError:
            for rid in added:  # all or nothing: a bad prompt leaves nothing queued
                self.engine.abort_request(rid)
            raise
        return ids

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one finished output per prompt, in order."""
        ids = self._submit(prompts, sampling_params)
        final: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(ids), desc="requests", unit="req")
        for output in self._run(ids):
            if output.finished:
                final[output.request_id] = output
                if progress is not None:
                    progress.update(1)
        if progress is not None:
            progress.close()
        return [final[i] for i in ids]

    def generate_stream(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ):
        """Yield each request's new text and token ids as they are produced."""
        yield from self._run(self._submit(prompts, sampling_params))

    def _run(self, ids: list[str]):
        pending = set(ids)
        try:
            while pending:
                for output in self.engine.step():
                    if output.request_id in pending:
                        if output.finished:
                            pending.discard(output.request_id)
                        yield output
        finally:  # a consumer that stops early must not leave requests holding blocks
            for rid in pending:
                self.engine.abort_request(rid)


__all__ = ["LLM", "LLMEngine", "SamplingParams"]
