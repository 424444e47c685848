"""LLMEngine: continuous batching over the paged KV cache, with the host one window ahead.

The verbs are JetStream's and vLLM's: `add_request`, `step`, `abort_request`. A `step` admits
waiting requests (one prefill program), reserves KV blocks for the next decode window and
dispatches it right behind the prefill (the new rows decode from the first tokens the prefill
left in their slots), and only then reads back the *previous* window's tokens and the prefill's:
the device never waits for the host's bookkeeping. The device stops rows itself (EOS, stop ids, token budget); the host
stops them for what only it can see (stop strings) and tells the device at the next window.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rosejax.engine.block_manager import BlockAllocator
from rosejax.engine.decode_window import DecodeWindows
from rosejax.engine.request import (
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
    SequenceGroup,
)
from rosejax.engine.request_checks import check_request, checked_prompt_ids
from rosejax.engine.scheduler import Scheduler
from rosejax.engine.step_log import StepLog
from rosejax.layers.kv_cache import init_kv_cache, kv_cache_bytes_per_block, num_blocks_for
from rosejax.layers.parallel import (
    TP_AXIS,
    shard_params,
    tensor_parallel_devices,
    tensor_parallel_mesh,
)
from rosejax.model_runner import (
    EXTRA_ROW_FIELDS,
    NUM_BIAS,
    NUM_STOP_IDS,
    ModelRunner,
)
from rosejax.models import (
    eos_token_ids,
    family_of,
    one_kernel_step_programs,
    with_context_len,
)
from rosejax.models.loader import load_model, resolve_dtype
from rosejax.models.one_kernel_step import decoder_step_buckets, with_decoder_step
from rosejax.sampling import (
    COUNT_MASK,
    PROMPT_BIT,
    SamplingParams,
    TokenLogprobs,
    seed_words,
)
from rosejax.settings import (
    EngineConfig,
    configure_process,
    freeze_heap,
)
from rosejax.tokenizer import IncrementalDetokenizer, TokenTexts, load_tokenizer

logger = logging.getLogger("rosejax")

# Prefills that compute prompt logprobs hold logits [tokens, V] in float32: at most this many
# padded tokens (V=151,936: 1.2 GB), longer prompts in chunks of PROMPT_LOGPROBS_CHUNK.
MAX_LOGITS_TOKENS = 2048
PROMPT_LOGPROBS_CHUNK = 512
_F32_MAX, _F32_TINY = float(np.finfo(np.float32).max), float(np.finfo(np.float32).tiny)


def _buckets(limit: int, start: int = 1, factor: int = 2) -> list[int]:
    """start, start * factor, ... below `limit`, then `limit` itself."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= factor
    return out + [limit]


def _bucket(n: int, buckets: list[int]) -> int:
    """The smallest of the (increasing) `buckets` that holds `n`: admission asks this for every
    request it considers, so it is a bisection, not a scan."""
    return buckets[bisect.bisect_left(buckets, n)]


def _fill_rows(out: np.ndarray, rows: list[list[int]]) -> None:
    """out[i, :len(rows[i])] = rows[i] for every row, in one masked assignment (row-major order
    of the mask is the order of the concatenated rows)."""
    lens = np.fromiter(map(len, rows), np.int64, len(rows))
    out[: len(rows)][np.arange(out.shape[1]) < lens[:, None]] = list(
        itertools.chain.from_iterable(rows)
    )


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        devices: Sequence[jax.Device] | None = None,
        replica: int = 0,
    ):
        """Load the model and tokenizer, size the KV cache, and (on a GPU) compile every bucket.
        Sets the process-wide XLA flags, `jax.distributed` and the compilation cache first
        (`configure_process`).

        `devices`: where this engine's params, KV cache and programs live (default: the first
        local device; with tensor parallelism the first `tensor_parallel_size` devices, of every
        process after `jax.distributed`). `replica`: its index among data parallel replicas
        (`DataParallelEngine`), which gives it a stream of request seeds of its own."""
        if config.data_parallel_size != 1:
            raise ValueError(
                "an LLMEngine is one replica: data_parallel_size > 1 needs DataParallelEngine "
                "(rosejax.engine.data_parallel.make_engine builds either)"
            )
        configure_process(
            config.compilation_cache_dir,
            coordinator_address=config.distributed_coordinator_address,
            num_processes=config.num_processes,
            process_id=config.process_id,
        )
        self.devices = tuple(devices or tensor_parallel_devices(config.tensor_parallel_size))
        # This process's first device of them: where what the build makes lands first.
        self.home_device = next(d for d in self.devices if d.process_index == jax.process_index())
        try:
            # What is made here lands on this engine's device, never the default one. Programs
            # run where their committed inputs live, and run outside this context: the default
            # device is part of jit's cache key, so a program warmed up inside it would compile
            # again outside.
            with jax.default_device(self.home_device):
                self._build(config, replica)
            # Compiling every bucket up front pays on a GPU (seconds per program, persistent
            # cache); on a CPU it takes minutes for GPT-2, so there buckets compile on first use.
            if config.warmup or (config.warmup is None and not self.on_cpu):
                self.warmup()
                # As a server once its programs compiled: the compile's ~200k objects (jaxprs,
                # traces) leave the collector's view, else every full collection walks them
                # (90-160 ms pauses inside a 256 x 256 generate on an H200).
                freeze_heap()
        except Exception as e:  # jax's runtime error type differs between versions
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise ValueError(
                "out of device memory while loading the model, allocating the KV cache or "
                "compiling: lower --kv-cache-memory-fraction (or --kv-cache-tokens), "
                f"--max-batch-size or --max-prefill-tokens, or pick a smaller dtype ({e})"
            ) from e

    def _build(self, config: EngineConfig, replica: int) -> None:
        self.on_cpu = on_cpu = self.home_device.platform == "cpu"
        self.engine_config = config
        self.kernels = config.kernel_config()
        self.dtype = resolve_dtype(
            config.dtype if config.dtype != "auto" else ("float32" if on_cpu else "float16")
        )
        self.tensor_parallel_size = tp = config.tensor_parallel_size
        mesh = self._mesh(config)
        start = time.perf_counter()
        logger.info("loading %s (%s) on %s", config.model, self.dtype.name, list(self.devices))
        # The tokenizer loads beside the weights: its parse (Rust) gives up the GIL.
        with ThreadPoolExecutor(1, thread_name_prefix="rosejax-tokenizer") as pool:
            tokenizer = pool.submit(load_tokenizer, config.model, config.tokenizer)
            self.config, params = load_model(config.model, self.dtype, config.seed)
            self.tokenizer = tokenizer.result()
        if config.max_model_len is not None:
            self.config = with_context_len(self.config, config.max_model_len)
        programs = one_kernel_step_programs(
            self.config,
            self.dtype,
            self.kernels,
            block_size=config.block_size,
            max_batch_size=config.max_batch_size,
            device=None if mesh is not None else self.home_device,
        )
        if programs:  # its weights before the cache takes the memory
            self.kernels = dataclasses.replace(self.kernels, decoder_step_programs=programs)
            fam, model = family_of(self.config), self.config
            params = with_decoder_step(
                params,
                fam.decoder_shape(model),
                lambda p: fam.decoder_layers(p, model),
                lambda p: fam.decoder_head(p, model),
            )
        cache_sharding = None
        if mesh is not None:
            layout = family_of(self.config).shard_layout(self.config)
            layout.check(tp)
            params = shard_params(params, layout, mesh)
            cache_sharding = NamedSharding(mesh, P(TP_AXIS))  # by KV heads
            logger.info("tensor parallel over %d devices: %s", tp, mesh.devices.tolist())
        self.token_texts = TokenTexts(self.tokenizer)  # the decoded_token of logprobs
        logger.info("loaded the model and tokenizer in %.1f s", time.perf_counter() - start)
        self.block_size = config.block_size
        self.max_batch_size = config.max_batch_size
        self._step_log = StepLog(config.step_log, replica) if config.step_log else None
        self.windows = DecodeWindows(config)
        self.decode_steps = self.windows.full  # the longest window
        self.prefill_overlap = config.prefill_overlap
        self._read_back_at = 0.0  # perf_counter when the last program's results were read back
        self.allocator = BlockAllocator(
            self._num_blocks(on_cpu), config.block_size, config.enable_prefix_caching
        )
        prefill_batch = min(
            config.prefill_max_batch_size or self.max_batch_size, self.max_batch_size
        )
        # Prefill buckets grow 4x: each one is a separate compile (seconds on a GPU), and
        # padding a prefill costs far less than padding the decode steps that follow it. Lengths
        # start at 8: short chat-like prompts padded to 16 doubled a 256-row prefill's work.
        max_len = self.config.max_model_len
        self.prefill_batch_buckets = _buckets(prefill_batch, factor=4)
        self.prefill_len_buckets = _buckets(max_len, start=min(8, max_len), factor=4)
        # Prompts longer than a chunk (default: the prefill budget) are prefilled a chunk at a
        # time between decode windows; without chunks a prefill must hold any one prompt, the
        # whole context. A chunk is a length bucket of its own: not padded to the next one.
        self.prefill_chunk = config.prefill_chunk_tokens or config.max_prefill_tokens
        if self.prefill_chunk >= max_len:
            self.prefill_chunk = None
        else:
            self.prefill_len_buckets = sorted({*self.prefill_len_buckets, self.prefill_chunk})
        self.scheduler = Scheduler(
            self.allocator,
            self.max_batch_size,
            max(config.max_prefill_tokens, self.prefill_chunk or max_len),
            prefill_batch,
            prefill_cost=self._prefill_shape_tokens,
            prefill_chunk=self.prefill_chunk,
            max_logits_tokens=min(config.max_prefill_tokens, MAX_LOGITS_TOKENS),
            logits_chunk=PROMPT_LOGPROBS_CHUNK,
        )
        gpu_min_batch = family_of(self.config).gpu_min_decode_batch
        min_batch = config.min_decode_batch or (1 if on_cpu else gpu_min_batch)
        num_slots = max(self.max_batch_size, min_batch)
        # A window may add ceil(2K / block_size) + 1 blocks per row: K in flight, K reserved.
        per_row = -(-2 * self.decode_steps // config.block_size) + 1
        cache = init_kv_cache(
            self.config, self.allocator.num_blocks, config.block_size, self.dtype, cache_sharding
        )
        self.runner = ModelRunner(
            self.config,
            params,
            cache,
            num_slots,
            self.decode_steps,
            config.decode_steps_per_trip,
            num_slots * per_row,
            self.kernels,
            self.devices[0] if mesh is None else mesh,
        )
        self.decode_buckets = _buckets(num_slots, start=min(min_batch, num_slots))
        if self.kernels.decoder_step_programs:  # the one-kernel step's widths, unpadded
            kernel_rows = [r for r in decoder_step_buckets(self.kernels) if r <= num_slots]
            self.decode_buckets = sorted({*self.decode_buckets, *kernel_rows})
        self.seed = config.seed
        # Seeds of requests that bring none; each replica draws its own stream.
        self._seeds = np.random.default_rng(config.seed if replica == 0 else [config.seed, replica])
        self._requests: dict[str, SequenceGroup] = {}
        # A min-heap: a new request takes the lowest free slot, so the decode width stays low.
        self._free_slots = list(range(self.max_batch_size))
        self._kill = np.zeros(num_slots, bool)  # slots the device must stop
        # Dispatched, not yet read back: (kind, tokens, their logprobs, [(request, epoch,
        # column)], window steps, prompt logprobs: None or (TokenLogprobs [Bp, T],
        # [(request, row, first prompt position)])).
        self._pending: deque = deque()
        # Where the host's time goes: scheduling and dispatch, waiting for the device, reading
        # results back into requests (bench/profile_decode.py prints it).
        self.host_seconds = {"dispatch": 0.0, "wait": 0.0, "harvest": 0.0}
        self.prefill_tokens_computed = 0
        self.prefill_steps = 0  # prefill programs run: a burst admitted at once is one
        self._warm: set[tuple[str, int, int | bool]] = set()  # programs warm-up compiled
        # Programs compile_ahead compiled (warm-up compiles none twice), not run yet: appended by
        # the compiling thread, taken by the stepping one (a deque: both thread-safe).
        self._unrun: collections.deque[tuple[str, int, int | bool]] = collections.deque()

    def _mesh(self, config: EngineConfig) -> Mesh | None:
        """The tensor-parallel mesh over this engine's devices (None for one device), checked
        before anything is loaded."""
        tp = config.tensor_parallel_size
        if len(self.devices) != tp:
            raise ValueError(
                f"--tensor-parallel-size {tp} needs {tp} devices, given {self.devices}"
            )
        if config.num_processes > 1 and tp != jax.device_count():
            raise ValueError(
                f"--tensor-parallel-size ({tp}) must span every process's devices: "
                f"{config.num_processes} processes hold {jax.device_count()} devices in all"
            )
        return None if tp == 1 else tensor_parallel_mesh(self.devices)

    @classmethod
    def from_args(cls, model: str, **kwargs) -> LLMEngine:
        """`LLMEngine(EngineConfig(model, **kwargs))`."""
        return cls(EngineConfig(model=model, **kwargs))

    def _num_blocks(self, on_cpu: bool) -> int:
        """KV blocks (scratch included) for the configured token budget or memory fraction;
        neither given: half the free memory, on a CPU no more than max_batch_size full
        contexts. Logs the size it chose."""
        config = self.engine_config
        tokens, fraction = config.kv_cache_tokens, config.kv_cache_memory_fraction

        def blocks(**budget) -> int:
            return num_blocks_for(
                self.config,
                self.block_size,
                self.dtype,
                max_num_seqs=self.max_batch_size,
                device=self.home_device,
                shards=self.tensor_parallel_size,
                **budget,
            )

        if tokens is not None:
            num_blocks = blocks(kv_cache_tokens=tokens)
        else:
            num_blocks = blocks(memory_fraction=fraction or 0.5)
            if on_cpu and fraction is None:  # more than a full context per request is never used
                full = self.max_batch_size * self.config.max_model_len
                num_blocks = min(num_blocks, blocks(kv_cache_tokens=full))
        per_block = kv_cache_bytes_per_block(
            self.config, self.block_size, self.dtype, self.tensor_parallel_size
        )
        logger.info(
            "KV cache: %d blocks of %d tokens, %d tokens, %.2f GiB a device (--kv-cache-tokens or "
            "--kv-cache-memory-fraction change it)",
            num_blocks - 1,
            self.block_size,
            (num_blocks - 1) * self.block_size,
            num_blocks * per_block / 2**30,
        )
        return num_blocks

    @property
    def num_kv_blocks(self) -> int:
        """KV blocks requests may hold (the scratch block aside)."""
        return self.allocator.num_blocks - 1

    @property
    def num_compiles(self) -> int:
        return self.runner.num_compiles

    @property
    def compile_seconds(self) -> float:
        return self.runner.compile_seconds

    # ------------------------------------------------------------------------------ warm-up

    def _prefill_shape(self, rows: int, longest: int) -> tuple[int, int]:
        """The compiled (rows, tokens) bucket a prefill of `rows` requests runs in."""
        return _bucket(rows, self.prefill_batch_buckets), _bucket(longest, self.prefill_len_buckets)

    def _prefill_shape_tokens(self, rows: int, longest: int) -> int:
        b, t = self._prefill_shape(rows, longest)
        return b * t

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, tokens) bucket the scheduler can admit (its own rule, on the buckets)."""
        # With chunks no prefill is longer than one (a chunk is a length bucket of its own).
        longest = self.prefill_chunk or self.prefill_len_buckets[-1]
        return [
            (b, t)
            for b in self.prefill_batch_buckets
            for t in self.prefill_len_buckets
            if self.scheduler.prefill_fits(b, t) and t <= longest
        ]

    def warmup_programs(self) -> list[tuple[str, int, int | bool]]:
        """Every program warm-up compiles, ("prefill", rows, tokens) or ("decode", rows, greedy),
        the ones a first request needs first (the smallest prefill, the smallest decode bucket
        greedy and sampled), then the rest from the smallest; on a GPU then each decode
        bucket's program with the logits processors and logprobs ("decode-extras", rows,
        False: its sampler picks greedy rows by argmax, so it has no greedy twin), last (a
        server compiles them while idle: a CPU compiles them on first use in seconds, and its
        tests need few). Prefills with them compile on first use."""
        prefill = [("prefill", b, t) for b, t in sorted(self.prefill_shapes(), key=math.prod)]
        decode = [("decode", b, g) for b in self.decode_buckets for g in (True, False)]
        long = [
            ("decode-long", b, g)
            for b in self.decode_buckets
            if self.runner.long_row_tokens(b) is not None
            for g in (True, False)
        ]
        extras = [] if self.on_cpu else [("decode-extras", b, False) for b in self.decode_buckets]
        plain = prefill[:1] + decode[:2] + sorted(prefill[1:] + decode[2:], key=lambda p: p[1])
        return plain + long + extras

    def cold_programs(self) -> list[tuple[str, int, int | bool]]:
        """The programs of `warmup_programs()` not compiled yet, in that order."""
        return [p for p in self.warmup_programs() if p not in self._warm]

    def warmup(self, programs: list[tuple[str, int, int | bool]] | None = None) -> float:
        """Compile `programs` (default: every one) that are not compiled yet and run each once,
        logging each; padded rows only touch the scratch block, so this may run between serving
        steps. Returns the seconds taken."""
        start = time.perf_counter()
        todo = [p for p in programs or self.cold_programs() if p not in self._warm]
        for i, program in enumerate(todo):
            seconds = self._run_once(program)
            kind, rows, arg = program
            logger.info(
                "compiled %s program %d/%d (%s rows, %s) in %.1f s",
                kind,
                i + 1,
                len(todo),
                rows,
                f"{arg} tokens" if kind == "prefill" else "greedy" if arg else "sampled",
                seconds,
            )
        return time.perf_counter() - start

    @property
    def programs_to_run(self) -> int:
        """Programs `compile_ahead` compiled that have not had their first run yet
        (`run_ahead`)."""
        return len(self._unrun)

    def run_ahead(self) -> bool:
        """Run once, as `warmup` does, the next program `compile_ahead` compiled that nothing has
        run yet: a program's first run costs more than its later ones (on an H100 one prefill's
        first dispatch took 0.26 s), which the first request needing it would pay. Only between
        steps, on the thread that steps (a server's loop, while idle). Whether one ran."""
        try:
            program = self._unrun.popleft()
        except IndexError:
            return False
        self._run_once(program)
        return True

    def _run_once(self, program: tuple[str, int, int | bool]) -> float:
        """Run `program` (compiling it first if need be) on no request; its seconds."""
        t0 = time.perf_counter()
        kind, rows, arg = program
        if kind == "prefill":
            self.runner.prefill(self._prefill_batch([], [], [], rows, arg, False))
        else:
            extras, long_rows = kind == "decode-extras", kind == "decode-long"
            self.runner.decode(rows, 0, arg, self._kill, [], (), extras, long_rows)
        jax.block_until_ready(self.runner.state)
        self._warm.add(program)
        return time.perf_counter() - t0

    def compile_ahead(self, *programs: tuple[str, int, int | bool]) -> None:
        """Compile `programs` of `warmup_programs()` without running them, logging each: each
        one is traced and lowered here while the ones before it compile (or load from the
        persistent cache) on threads, which XLA does without the GIL. Unlike `warmup`, any
        thread may call this while another serves: a server compiles what a first request needs
        so before it serves, and the rest on a thread of its own while idle, so no request
        waits for it."""
        todo = [p for p in dict.fromkeys(programs) if p not in self._warm]
        if not todo:
            return
        with ThreadPoolExecutor(len(todo), thread_name_prefix="rosejax-compile") as pool:
            started = []
            for program in todo:
                t0 = time.perf_counter()
                kind, rows, arg = program
                if kind == "prefill":
                    batch = self._prefill_batch([], [], [], rows, arg, False)
                    finish = self.runner.compile_prefill(batch, pool)
                else:
                    extras, long_rows = kind == "decode-extras", kind == "decode-long"
                    finish = self.runner.compile_decode(rows, arg, extras, pool, long_rows)
                started.append((program, t0, finish))
            for (kind, rows, arg), t0, finish in started:
                finish()
                self._warm.add((kind, rows, arg))
                self._unrun.append((kind, rows, arg))
                logger.info(
                    "compiled %s program (%s rows, %s) ahead in %.1f s",
                    kind,
                    rows,
                    f"{arg} tokens" if kind == "prefill" else "greedy" if arg else "sampled",
                    time.perf_counter() - t0,
                )

    # ------------------------------------------------------------------------------ requests

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids, checked (`checked_prompt_ids`). Reads only what never
        changes, so any thread may call it (a server tokenizes off the engine's thread)."""
        return checked_prompt_ids(prompt, self.tokenizer, self.config)

    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request (its n sequences). Bad input raises ValueError and leaves the engine
        as it was."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.prompt_ids(prompt)
        check_request(ids, params, self.config, self.num_kv_blocks, self.block_size)
        sequences = [
            Request(
                request_id,
                ids,
                params,
                0,  # drawn below, once the request is accepted
                IncrementalDetokenizer(self.tokenizer, vocab_size=self.config.vocab_size),
                eos_token_ids(self.config),
                self.config.max_model_len,
                index=i,
                token_texts=self.token_texts,
            )
            for i in range(params.n)
        ]
        # A request without a seed gets one drawn from the engine's: reproducible for one
        # engine seed and arrival order, a different stream for every request. With a seed,
        # sequence i samples with seed + i (vLLM's rule).
        for i, sequence in enumerate(sequences):
            seed = params.seed
            seed = int(self._seeds.integers(2**64, dtype=np.uint64)) if seed is None else seed + i
            sequence.seed = seed % 2**64  # the device takes a seed's 64 bits as two words
        metrics = RequestMetrics(time.monotonic())
        self._requests[request_id] = SequenceGroup(request_id, sequences, metrics, self.token_texts)
        for sequence in sequences:
            self.scheduler.add(sequence)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; unknown ids are ignored."""
        group = self._requests.pop(request_id, None)
        if group is not None:
            for sequence in group.sequences:
                self._release(sequence)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def _free_slot(self, request: Request) -> None:
        """Give the request's device row back; the device stops it at the next window."""
        if request.slot >= 0:
            self._kill[request.slot] = True
            heapq.heappush(self._free_slots, request.slot)
            request.slot = -1

    def _release(self, request: Request) -> None:
        self._free_slot(request)
        self.scheduler.finish(request)

    # ---------------------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Admit and prefill, dispatch the next decode window right behind the prefill (the new
        rows decode from the first tokens it left in their slots), then read back every program
        in flight but the newest, oldest first, while the device runs that one; one output per
        request that gained something."""
        begun = self._step_log.begin(self) if self._step_log is not None else None
        t0 = time.perf_counter()
        prefilled = self._admit()
        running = list(self.scheduler.running)  # every running request holds a slot
        window = None  # the decode window dispatched: (steps, rows, width)
        # Exact behind a prefill: it left each new row's first token, position, step count and
        # alive flag (off if that token already ends the row) in its slot, where windows read.
        if running and (self.prefill_overlap or not prefilled):
            window = self._dispatch_decode(running)
        self.host_seconds["dispatch"] += time.perf_counter() - t0
        keep = 1 if prefilled or window is not None else 0  # the newest: the device runs it
        touched: dict[str, SequenceGroup] = {}
        while len(self._pending) > keep:
            self._harvest(*self._pending.popleft(), touched)
        outputs = []
        for group in touched.values():
            outputs.append(group.take_output())
            if outputs[-1].finished:
                del self._requests[group.request_id]
        if begun is not None:
            self._step_log.end(self, begun, window, outputs)
        return outputs

    def _admit(self) -> bool:
        """Prefill the next admitted requests (and chunk); whether a prefill with first tokens
        went out."""
        plan = self.scheduler.admit()
        if plan is None:
            return False
        requests = plan.requests
        now = time.monotonic()
        for r in requests:
            if r.group.metrics.first_scheduled_time is None:
                r.group.metrics.first_scheduled_time = now
        # Rows that end their prompt take a slot and sample their first token; a chunk of a
        # prompt prefilled in chunks writes its KV only (its row's slot index is dropped).
        done = [r for r, final in zip(requests, plan.final, strict=True) if final]
        slots = [heapq.heappop(self._free_slots) for _ in done]
        for r, slot in zip(done, slots, strict=True):
            r.slot = slot
            r.epoch += 1
            r.blocks_on_device = len(r.table.blocks)
            r.inflight = 0
            if r.params.has_processors:
                self._load_row(r)
        self._kill[slots] = False
        suffix = plan.num_tokens
        self.prefill_tokens_computed += sum(suffix)
        self.prefill_steps += 1
        b, t = self._prefill_shape(len(requests), max(suffix))
        # Rows whose prompt logprobs this prefill computes: (request, row, first position,
        # positions).
        prompt_rows = [
            (r, i, c + 1, max(0, min(s, len(r.prompt_token_ids) - c - 1)))
            for i, (r, c, s) in enumerate(zip(requests, plan.num_cached, suffix, strict=True))
            if r.prompt_logprobs_needed
        ]
        batch = self._prefill_batch(requests, plan.num_cached, suffix, b, t, bool(prompt_rows))
        first, logprobs, prompt_logprobs = self.runner.prefill(batch)
        for r in done:
            r.prompt_logprobs_needed = False  # its whole prompt's logprobs are dispatched
        roster = [(r, r.epoch, i) for i, r in enumerate(requests) if r.slot >= 0]
        if roster or prompt_rows:
            prompt = (prompt_logprobs, prompt_rows) if prompt_rows else None
            self._pending.append(("prefill", first, logprobs, roster, 0, prompt, 0.0))
        return bool(done)

    def _load_row(self, request: Request) -> None:
        """Send a request's bias entries and token counts (prompt bits and output counts, for
        its penalties) to its slot, before the prefill that samples from them."""
        bias = (
            np.zeros(NUM_BIAS, np.int32),
            np.zeros(NUM_BIAS, np.float32),
            np.zeros(NUM_BIAS, np.int32),  # until 0: unused entries never hold
        )
        for array, values in zip(bias, request.bias_entries(), strict=True):
            array[: len(values)] = values
        ids = counts = np.zeros(0, np.int32)
        if request.params.has_penalties:
            prompt = np.unique(request.prompt_token_ids)
            output, times = np.unique(np.asarray(request.output_token_ids, int), return_counts=True)
            ids = np.union1d(prompt, output)
            counts = np.zeros(len(ids), np.uint16)
            counts[np.searchsorted(ids, prompt)] = PROMPT_BIT
            counts[np.searchsorted(ids, output)] |= np.minimum(times, COUNT_MASK).astype(np.uint16)
        self.runner.load_row(request.slot, bias, ids, counts)

    def _prefill_batch(
        self, requests, cached, suffix, b: int, t: int, prompt_logprobs: bool
    ) -> dict[str, np.ndarray]:
        n = len(requests)
        batch = dict(
            tokens=np.zeros((b, t), np.int32),
            positions=np.tile(np.arange(t, dtype=np.int32), (b, 1)),
            seq_lens=np.zeros(b, np.int32),
            last=np.zeros(b, np.int32),
            tables=np.zeros((b, self.runner.max_blocks), np.int32),
            slots=np.full(b, self.runner.num_slots, np.int32),  # padded rows: dropped
            temperature=np.zeros(b, np.float32),
            top_k=np.zeros(b, np.int32),
            top_p=np.ones(b, np.float32),
            seed=np.zeros((b, 2), np.uint32),  # [hi, lo] words of each 64-bit seed
            steps=np.zeros(b, np.int32),
            limit=np.zeros(b, np.int32),
            stop_ids=np.full((b, NUM_STOP_IDS), -1, np.int32),
        )
        # One array assignment per field, not one numpy write per request and field: all
        # requests of a batch arrive together in offline serving.
        uncached = [
            r.all_token_ids()[c : c + s] for r, c, s in zip(requests, cached, suffix, strict=True)
        ]
        _fill_rows(batch["tokens"], uncached)
        _fill_rows(batch["tables"], [r.table.blocks for r in requests])
        _fill_rows(batch["stop_ids"], [r.device_stop_ids[:NUM_STOP_IDS] for r in requests])
        if prompt_logprobs:  # each position's next prompt token (0 past the prompt: unread)
            targets = [
                r.prompt_token_ids[c + 1 : c + s + 1]
                for r, c, s in zip(requests, cached, suffix, strict=True)
            ]
            batch["prompt_targets"] = np.zeros((b, t), np.int32)
            _fill_rows(batch["prompt_targets"], targets)
        cached = np.asarray(cached, np.int32)
        suffix = np.asarray(suffix, np.int32)
        batch["positions"][:n] += cached[:, None]
        batch["seq_lens"][:n], batch["last"][:n] = cached + suffix, suffix - 1
        batch["slots"][:n] = [r.slot if r.slot >= 0 else self.runner.num_slots for r in requests]
        params = [r.params for r in requests]
        # Each value held inside float32, as it means: a temperature past its largest is as
        # hot; a top_p below its smallest positive one keeps the top token (0 would keep none).
        batch["temperature"][:n] = [min(p.temperature, _F32_MAX) for p in params]
        # top_k >= vocab keeps everything, like 0; clamping keeps it inside int32.
        batch["top_k"][:n] = [min(p.top_k, self.config.vocab_size) for p in params]
        batch["top_p"][:n] = [max(p.top_p, _F32_TINY) for p in params]
        batch["seed"][:n] = seed_words(np.fromiter((r.seed for r in requests), np.uint64, n))
        batch["steps"][:n] = [len(r.output_token_ids) for r in requests]
        batch["limit"][:n] = [r.max_output for r in requests]
        if any(r.extras for r in requests):  # the other program, with the extras' fields
            dtypes = {bool: bool, int: np.int32, float: np.float32}
            for name, neutral in EXTRA_ROW_FIELDS.items():
                batch[name] = np.full(b, neutral, dtypes[type(neutral)])
            batch["min_p"][:n] = [p.min_p for p in params]
            batch["logprobs"][:n] = [-1 if p.logprobs is None else p.logprobs for p in params]
            batch["presence"][:n] = [p.presence_penalty for p in params]
            batch["frequency"][:n] = [p.frequency_penalty for p in params]
            batch["repetition"][:n] = [p.repetition_penalty for p in params]
            batch["has_bias"][:n] = [bool(r.bias_entries()[0]) for r in requests]
        return batch

    def _window(self, running: list[Request]) -> int:
        """Steps for the next decode window of the running requests (`DecodeWindows`)."""
        left = (r.remaining - r.inflight for r in running)
        waiting = bool(self.scheduler.waiting)
        return self.windows.steps(len(running), left, waiting, self.max_batch_size)

    def _dispatch_decode(self, running: list[Request]) -> tuple[int, int, int] | None:
        """Dispatch the running requests' next decode window: its (steps, rows, width), or None
        if none is left running."""
        k = self._window(running)
        for r in self.scheduler.reserve(running, k):  # lost their blocks: the device must stop them
            self._free_slot(r)
        running = list(self.scheduler.running)
        if not running:
            return None
        moves = self._compact(running)
        updates = []
        longest = 0  # the longest row's context by the end of this window
        for r in running:
            blocks = r.table.blocks
            updates += [(r.slot, i, blocks[i]) for i in range(r.blocks_on_device, len(blocks))]
            r.blocks_on_device = len(blocks)
            r.inflight += k
            longest = max(longest, r.num_tokens + r.inflight)
        b = _bucket(max(r.slot for r in running) + 1, self.decode_buckets)
        extras = any(r.extras for r in running)
        greedy = not extras and all(r.params.temperature == 0 for r in running)
        long_row = self.runner.long_row_tokens(b)
        long_rows = long_row is not None and longest > long_row
        # A copy: on the CPU jax may alias a numpy argument, and this one is reset at once.
        kill = self._kill.copy()
        out = self.runner.decode(b, k, greedy, kill, updates, moves, extras, long_rows)
        self._kill[:] = False
        roster = [(r, r.epoch, r.slot) for r in running]
        self._pending.append(("decode", *out, roster, k, None, time.perf_counter()))
        return k, len(running), b

    def _compact(self, running: list[Request]) -> list[tuple[int, int]]:
        """Move the running requests that sit at or above the smallest decode bucket holding
        them all into the lowest free slots, so the window runs at that width whatever slots
        they were given and in whatever order others finished. Returns the (src, dst) moves;
        the device moves the rows at the start of the next window, before anything else."""
        width = _bucket(len(running), self.decode_buckets)
        moves = []
        for r in sorted((r for r in running if r.slot >= width), key=lambda r: r.slot):
            dst = heapq.heappop(self._free_slots)  # < width: fewer than width slots are held
            moves.append((r.slot, dst))
            heapq.heappush(self._free_slots, r.slot)
            r.slot = dst
        return moves

    def _harvest(
        self,
        kind: str,
        tokens: jax.Array,
        logprobs: TokenLogprobs,
        roster,
        k: int,
        prompt,
        dispatched: float,
        touched: dict[str, SequenceGroup],
    ) -> None:
        """Read back a dispatched program's tokens (and logprobs, if a request asked) and feed
        them to their requests, whose groups join `touched`. A decode window's time from when
        it could start (its `dispatched` time, or the previous read-back if later) to its
        read-back goes to `windows`."""
        t0 = time.perf_counter()
        tokens = np.asarray(tokens)  # waits for that program only
        t1 = time.perf_counter()
        self.host_seconds["wait"] += t1 - t0
        if kind == "decode":
            self.windows.read_back(t1 - max(dispatched, self._read_back_at), k)
        self._read_back_at = t1
        # One conversion to Python ints per program, not one numpy scalar per token; a window
        # of k steps fills only the first k of the program's max_decode_steps rows.
        columns = (tokens[None] if kind == "prefill" else tokens[:k]).T.tolist()  # [B][K]
        if any(r.logprobs is not None for r, _, _ in roster):
            logprobs = jax.device_get(logprobs)
            if kind == "prefill":
                logprobs = TokenLogprobs(*(a[None] for a in logprobs))  # [1, Bp, ...]
        if prompt is not None:
            self._take_prompt_logprobs(*prompt)
        decoded = kind == "decode"
        now = time.monotonic()
        for request, epoch, column in roster:
            if request.epoch != epoch or request.status != RequestStatus.RUNNING:
                continue  # preempted or aborted since: its tokens here are void
            request.inflight -= k
            row = columns[column]
            # A row that stops inside the window reads -1 from then on (a stopped row never
            # restarts within a window), so the -1s only trail.
            stopped = bool(row) and row[-1] < 0
            if stopped:
                row = row[: row.index(-1)]
            group = request.group
            touched[group.request_id] = group
            if not decoded and group.metrics.first_token_time is None:  # (a prefill's token)
                group.metrics.first_token_time = now
            group.fed(request)
            try:
                self._take(request, row, decoded, logprobs, column)
                if stopped and not request.finished:  # it would wait for tokens forever
                    raise RuntimeError("the device stopped a request the host still runs")
            except Exception as e:  # a failure serving one request ends that request alone
                logger.exception("request %s failed; ending it", request.request_id)
                group.fail(f"{type(e).__name__}: {e}")
                for sequence in group.sequences:
                    self._release(sequence)
            if request.finished:
                self._release(request)
        self.host_seconds["harvest"] += time.perf_counter() - t1

    def _take(
        self, request: Request, row: list[int], decoded: bool, logprobs: TokenLogprobs, column
    ) -> None:
        """Feed a request the tokens one program made for it (and their logprobs)."""
        taken = request.add_tokens(row)
        if decoded and taken:  # KV is now cached for the token fed at the window's first step
            # (the prefill's token, read back before any window) and for each taken but the last
            self.allocator.extend(request.table, request.output_token_ids[-taken - 1 : -1])
        if request.logprobs is not None and taken:
            request.add_logprobs(TokenLogprobs(*(a[:taken, column] for a in logprobs)))

    def _take_prompt_logprobs(self, logprobs: TokenLogprobs, rows) -> None:
        """Record a prefill's prompt logprobs: rows are (request, row, first position, count)."""
        logprobs = jax.device_get(logprobs)
        for request, row, start, count in rows:
            group = request.group
            if self._requests.get(group.request_id) is not group:
                continue  # aborted since
            group.add_prompt_logprobs(start, TokenLogprobs(*(a[row, :count] for a in logprobs)))
