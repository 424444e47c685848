"""Settings: what the engine and its kernels run with, built once by the entry points (`LLM`,
`LLMEngine`, the CLIs, the server) and handed down as values.

`KernelConfig` chooses each op's implementation (a Pallas kernel or XLA), its thresholds and tiles;
it is a static argument of every compiled program, so a different one compiles a different
program. `EngineConfig` is everything else an engine is built from. This is the one module that
reads the environment (`ROSEJAX_*`, `XLA_FLAGS`), and only to fill defaults when a config is made.
`configure_process` makes the process-wide changes (XLA flags, the persistent compilation cache)
that an entry point asks for; importing rosejax changes nothing.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import os
from collections.abc import Sequence
from typing import Any, Literal

import jax

from pallas_kernels.decoder_step import MAX_ROWS as MAX_DECODER_STEP_ROWS
from rosejax.compilation_cache import write_entries_whole

Impl = Literal["pallas", "xla"]
IMPLS = ("pallas", "xla")
KERNEL_OPS = ("kv_append", "attention", "prefill_attention", "layer_norm", "rms_norm", "linear")
# KernelConfig's on/off fields.
KERNEL_SWITCHES = (
    "fused_kv_append",
    "fused_qk_rope",
    "fused_swiglu",
    "concurrent_command_buffers",
)

# Environment variables that fill defaults, and what each sets.
ENV_KERNEL_SWITCHES = {  # "0" / "false" / "off" / "no" picks XLA for the op
    "kv_append": "ROSEJAX_PALLAS_KV_APPEND",
    "attention": "ROSEJAX_PALLAS_ATTENTION",
    "prefill_attention": "ROSEJAX_PALLAS_PREFILL_ATTENTION",
    "layer_norm": "ROSEJAX_PALLAS_LAYER_NORM",
    "rms_norm": "ROSEJAX_PALLAS_RMS_NORM",
    "linear": "ROSEJAX_PALLAS_LINEAR",
}
ENV_FUSED_KV_APPEND = "ROSEJAX_FUSED_KV_APPEND"
ENV_FUSED_QK_ROPE = "ROSEJAX_FUSED_QK_ROPE"
ENV_FUSED_SWIGLU = "ROSEJAX_FUSED_SWIGLU"
ENV_KV_APPEND_MIN_BATCH = "ROSEJAX_PALLAS_KV_APPEND_MIN_BATCH"
ENV_LINEAR_MAX_ROWS = "ROSEJAX_PALLAS_LINEAR_MAX_ROWS"
ENV_CUBLAS_MIN_BATCH = "ROSEJAX_CUBLAS_MIN_BATCH"
ENV_MIN_DECODE_BATCH = "ROSEJAX_MIN_DECODE_BATCH"
ENV_COMPILATION_CACHE_DIR = "ROSEJAX_COMPILATION_CACHE_DIR"

# XLA's Triton GEMMs win at small batches (B=1: 0.435 ms/step against 0.557 with cuBLAS, H200),
# cuBLAS with its bias/GELU epilogues at large ones (B=256: 1.066 against 1.124 ms).
DEFAULT_CUBLAS_MIN_BATCH = 256
# Rows up to which `Linear` runs the Pallas matmul; XLA's split-K GEMMs win from 32 rows (H100).
DEFAULT_LINEAR_MAX_ROWS = 16
DEFAULT_XLA_SPLIT_K_MIN_ROWS = 256
# Every append kernel beat XLA's scatter at every batch measured, B=1 included (H200).
DEFAULT_KV_APPEND_MIN_BATCH = 1
# GPT-2's decode batches of 1-16 share one 16-row program on a GPU: the Pallas matmul pads to 16
# rows anyway, and warm-up compiles one program instead of five (each family says its own:
# `rosejax.models.ModelFamily.gpu_min_decode_batch`).
DEFAULT_GPU_MIN_DECODE_BATCH = 16

# Process-wide XLA flags, unless XLA_FLAGS names them: WHILE/CONDITIONAL in command buffers make
# a decode window (a `lax.while_loop`) one CUDA graph (B=256: 0.98 ms/step against 1.09, H200).
_PROCESS_XLA_FLAGS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
}


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def env_switch(name: str) -> bool:
    """On unless the variable is 0, false, off or no."""
    return _env(name).lower() not in ("0", "false", "off", "no")


def env_int(name: str, default: int | None) -> int | None:
    raw = _env(name)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _xla_flags_name(flag: str) -> bool:
    return flag in os.environ.get("XLA_FLAGS", "")


# Keywords the layers pass the kernels themselves: a tile may not set them.
_SET_BY_LAYERS = frozenset(
    {
        "interpret",
        "eps",
        "activation",
        "new_head_offsets",
        "use_kernels",
        "min_batch",
        "num_q_heads",
    }
)


def _check_tile(op: str, param: str) -> None:
    """A tile must be a keyword-only parameter of every kernel function that gets `op`'s tiles."""
    from pallas_kernels.kv_append import (
        kv_append_full_batch,
        kv_append_generic,
        kv_append_identity_pos,
    )
    from pallas_kernels.layer_norm import add_layer_norm, layer_norm
    from pallas_kernels.linear import linear, linear_partial_sums
    from pallas_kernels.paged_attention import paged_decode_attention, paged_decode_attention_append
    from pallas_kernels.paged_prefill_attention import paged_prefill_attention
    from pallas_kernels.rms_norm import add_rms_norm, rms_norm

    takers = {
        "kv_append": [kv_append_generic, kv_append_identity_pos, kv_append_full_batch],
        "attention": [paged_decode_attention, paged_decode_attention_append],
        "prefill_attention": [paged_prefill_attention],
        "layer_norm": [layer_norm, add_layer_norm],
        "rms_norm": [rms_norm, add_rms_norm],
        "linear": [linear, linear_partial_sums],
    }[op]
    for fn in takers:
        kw = inspect.signature(fn).parameters.get(param)
        if param in _SET_BY_LAYERS or kw is None or kw.kind != inspect.Parameter.KEYWORD_ONLY:
            raise ValueError(
                f"{fn.__module__}.{fn.__name__} takes no tile {param!r}; {op} tiles go to "
                + ", ".join(f.__name__ for f in takers)
            )


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Which implementation each op runs, with its thresholds and tiles. Hashable: the compiled
    programs take it as a static argument.

    Pallas kernels compile through Triton on a GPU; `interpret=True` runs them in Pallas's
    interpreter (how the CPU tests run the GPU path).
    """

    kv_append: Impl = "xla"  # prefill chunks' (and unfused decode steps') K/V writes
    attention: Impl = "xla"  # paged decode attention
    # Flash attention of prefill chunks over the pages (Llama-style models; GPT-2 runs XLA's).
    prefill_attention: Impl = "xla"
    layer_norm: Impl = "xla"
    rms_norm: Impl = "xla"  # Llama-style models' norms, with the residual add before them
    linear: Impl = "xla"  # small-batch matmul with fused bias, GELU and residual
    # The small-batch Pallas matmul of a SwiGLU MLP's gate/up projection computes silu(gate) * up
    # on its accumulators (Qwen3-0.6B B=1: 0.956x the step time, H100).
    fused_swiglu: bool = True
    fused_kv_append: bool = True  # the Pallas decode attention writes the step's K/V itself
    # ... and normalizes (Qwen3's q/k RMSNorm) and rotates (RoPE) the step's q and k itself
    # (Qwen3-0.6B, H100: 0.91x / 0.90x the step time at 1 / 16 rows, 0.955x at 256).
    fused_qk_rope: bool = True
    kv_append_min_batch: int = DEFAULT_KV_APPEND_MIN_BATCH  # fewer appended rows: XLA scatter
    linear_max_rows: int = DEFAULT_LINEAR_MAX_ROWS  # more rows: XLA's GEMMs
    # Decode programs of at least this many rows use cuBLAS GEMMs, smaller ones XLA's Triton
    # GEMMs; None leaves the choice to XLA (XLA_FLAGS names xla_gpu_enable_triton_gemm).
    cublas_min_batch: int | None = DEFAULT_CUBLAS_MIN_BATCH
    # Decode steps of at least this many rows run the residual matmuls whose sum a norm reads
    # (attention output and MLP down projections) of at most 1,024 output columns as two float32
    # partial sums over K in one batched GEMM, summed in the norm's kernel: twice the output
    # tiles of one GEMM (256 rows, H200: 0.979x the step time for Qwen3-0.6B, 0.964x for GPT-2;
    # 128 rows: 1.004x / 1.012x). None: never (and off the GPU).
    xla_split_k_min_rows: int | None = None
    # Decode programs order their command buffer's kernels by the buffers they share
    # (CONCURRENT; -0.5% to -1.8% ms/step, H200) rather than in program order.
    concurrent_command_buffers: bool = True
    # Decode steps of one row run a GPT-2 or Llama-family decoder's every layer as one
    # persistent Mosaic GPU kernel of this many programs (`pallas_kernels.decoder_step`; at most
    # the GPU's SMs, with a second, tiled copy of the layers' weights); 0: off. None (auto): the
    # GPU's SMs where every decode step is one row (max_batch_size 1) and the kernel runs the
    # model on that GPU (B=1 step against the per-op kernels', H100: Qwen3-0.6B 0.715x, GPT-2
    # 0.66x), else off; a forward takes None as off (the engine hands it the count it resolved).
    decoder_step_programs: int | None = None
    # ... and decode programs of up to this many rows (1-16) take it too: its shared memory
    # holds 8 rows of GPT-2 small, 4 of Qwen3-0.6B at 4 weight stages. 1: each row adds ~40 µs
    # to GPT-2's step (H100: batch 4 ties the per-op kernels, batch 8 is 1.5x slower).
    decoder_step_rows: int = 1
    # Tile overrides, ((op, parameter, value), ...): keyword arguments of that op's kernel,
    # e.g. ("linear", "num_warps", 2). Ops: kv_append, attention, prefill_attention, layer_norm,
    # rms_norm, linear.
    tiles: tuple[tuple[str, str, int], ...] = ()
    interpret: bool = False

    def __post_init__(self) -> None:
        for op in KERNEL_OPS:
            if getattr(self, op) not in IMPLS:
                raise ValueError(f"kernels.{op} must be one of {IMPLS}, got {getattr(self, op)!r}")
        for op, param, value in self.tiles:
            if op not in KERNEL_OPS or not isinstance(param, str) or not isinstance(value, int):
                raise ValueError(
                    f"a tile override is (op, parameter, int) with op in {KERNEL_OPS}, "
                    f"got {(op, param, value)!r}"
                )
            _check_tile(op, param)
        for name in ("kv_append_min_batch", "linear_max_rows", "decoder_step_programs"):
            value = getattr(self, name)
            if value is None and name == "decoder_step_programs":  # auto
                continue
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"kernels.{name} must be an int >= 0, got {value!r}")
        if not 1 <= self.decoder_step_rows <= MAX_DECODER_STEP_ROWS:
            raise ValueError(
                f"kernels.decoder_step_rows must be 1 to {MAX_DECODER_STEP_ROWS}, "
                f"got {self.decoder_step_rows!r}"
            )
        if self.xla_split_k_min_rows is not None and self.xla_split_k_min_rows < 1:
            raise ValueError(
                f"kernels.xla_split_k_min_rows must be >= 1 or None, got {self.xla_split_k_min_rows}"
            )

    @classmethod
    def for_backend(cls, backend: str | None = None, **overrides) -> KernelConfig:
        """The defaults for `backend` (jax's default backend if None): every Pallas kernel on a
        GPU, XLA elsewhere (a CPU would interpret kernels program by program); then the
        ROSEJAX_* variables that are set; then `overrides`. Asking jax for its backend starts
        it, so that makes rosejax's XLA flags first (`set_xla_flags`)."""
        if backend is None:
            set_xla_flags()
            backend = jax.default_backend()
        gpu = backend in ("gpu", "cuda", "rocm")
        values: dict = {}
        for op, env in ENV_KERNEL_SWITCHES.items():
            values[op] = "pallas" if gpu and env_switch(env) else "xla"
        values["fused_kv_append"] = env_switch(ENV_FUSED_KV_APPEND)
        values["fused_qk_rope"] = env_switch(ENV_FUSED_QK_ROPE)
        values["fused_swiglu"] = env_switch(ENV_FUSED_SWIGLU)
        values["kv_append_min_batch"] = env_int(
            ENV_KV_APPEND_MIN_BATCH, DEFAULT_KV_APPEND_MIN_BATCH
        )
        values["linear_max_rows"] = env_int(ENV_LINEAR_MAX_ROWS, DEFAULT_LINEAR_MAX_ROWS)
        values["cublas_min_batch"] = (
            None
            if _xla_flags_name("xla_gpu_enable_triton_gemm")
            else env_int(ENV_CUBLAS_MIN_BATCH, DEFAULT_CUBLAS_MIN_BATCH)
        )
        values["xla_split_k_min_rows"] = DEFAULT_XLA_SPLIT_K_MIN_ROWS if gpu else None
        values["concurrent_command_buffers"] = not _xla_flags_name(
            "xla_gpu_command_buffer_scheduling_mode"
        )
        return cls(**(values | overrides))

    def tile_kwargs(self, op: str) -> dict[str, int]:
        """The keyword arguments this config passes to `op`'s kernel."""
        return {param: value for o, param, value in self.tiles if o == op}

    def decode_compiler_options(self, batch: int) -> dict[str, bool | str]:
        """Per-program XLA options of a decode program of `batch` rows."""
        options: dict[str, bool | str] = {}
        if self.concurrent_command_buffers:
            options["xla_gpu_command_buffer_scheduling_mode"] = "CONCURRENT"
        if self.cublas_min_batch is not None and batch >= self.cublas_min_batch:
            options["xla_gpu_enable_triton_gemm"] = False
        return options


XLA_KERNELS = KernelConfig()  # every op in XLA: the reference path, and a CPU's default


def _default_compilation_cache_dir() -> str:
    return _env(ENV_COMPILATION_CACHE_DIR) or os.path.expanduser("~/.cache/rosejax/jax")


def _default_min_decode_batch() -> int | None:
    return env_int(ENV_MIN_DECODE_BATCH, None)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything an `LLMEngine` is built from. None means "decide from the backend": see each
    field; `LLMEngine` resolves them once."""

    model: str  # hub id, local save_pretrained directory, or random:<preset>
    tokenizer: str | None = None  # default: the model's own, else the packaged GPT-2 tokenizer
    # Where requests' default sampling comes from (vLLM's flag): "auto", the model's
    # generation_config.json; "vllm", SamplingParams' own; or a directory holding one
    # (`rosejax.models.loader.sampling_defaults`). The server and `LLM` apply it.
    generation_config: str = "auto"
    dtype: str = "auto"  # float32 | bfloat16 | float16; auto: float16 on GPU, float32 on CPU
    max_batch_size: int = 64  # requests decoded together
    block_size: int = 16  # tokens per KV block (vLLM's default too)
    max_model_len: int | None = None  # the longest context served; None: the model's
    # KV cache size: a token budget or a fraction of free device memory (at most one); neither:
    # max_batch_size full contexts on a CPU, half the free memory on a GPU.
    kv_cache_tokens: int | None = None
    kv_cache_memory_fraction: float | None = None
    enable_prefix_caching: bool = True
    seed: int = 0  # random weights of random:<preset>, and the seeds of seedless requests
    max_prefill_tokens: int = 4096  # prompt tokens per prefill at most
    # Prompts with more uncached tokens are prefilled this many at a time, between decode
    # windows (one such prompt at once), so the running requests keep streaming. None:
    # max_prefill_tokens; max_model_len or more: every prompt in one prefill.
    prefill_chunk_tokens: int | None = None
    prefill_max_batch_size: int | None = None  # requests per prefill; default max_batch_size
    decode_steps: int | str = "auto"  # steps per decode window, or "auto"
    # Steps a trip round the decode window's `while` loop runs (its stop test between trips; a
    # window's last steps that fill no trip run one a trip): in a CUDA graph each trip costs
    # several µs of its own, but each step of a trip is compiled again.
    decode_steps_per_trip: int = 1
    # Under "auto": the window while slots are free (a request arriving then starts within about
    # that many steps), and the shortest window while requests wait for a slot.
    open_decode_steps: int = 8
    # Under "auto": a window's steps are cut to what fits this many ms at the last window's time
    # a step (at least one), so a stream's tokens come at least about this often. 0: no bound.
    max_decode_window_ms: float = 40.0
    # A server's idle engine loop, once a request arrives, goes on taking requests while each
    # comes within idle_gather_ms of the last (idle_gather_max_ms in all at most) before it
    # steps: a burst is prefilled together (a lone request pays up to idle_gather_ms of TTFT).
    # 0: it steps at once.
    idle_gather_ms: float = 2.0
    idle_gather_max_ms: float = 16.0
    # A step that prefills also dispatches the running requests' decode window right behind the
    # prefill, before reading its first tokens back. Off: that step decodes nothing (an A/B).
    prefill_overlap: bool = True
    # A file each engine step appends one JSON line to (`LLMEngine.step`: its timing, what it
    # prefilled and dispatched), for following a server's engine step by step; None: none.
    step_log: str | None = None
    # The smallest decode program: smaller batches pad to it (but a lone row, with the one-kernel
    # step on). None: the model family's on a GPU (GPT-2 16, Llama-style 1), 1 on a CPU.
    min_decode_batch: int | None = dataclasses.field(default_factory=_default_min_decode_batch)
    kernels: KernelConfig | None = None  # None: KernelConfig.for_backend(**kernel_overrides)
    # (field, value) pairs for `KernelConfig.for_backend` (the --kernel and --kernel-tile flags,
    # tiles as ("tiles", ...)), applied in the process that runs the engine: asking jax for its
    # backend starts it, which an API server process or a data-parallel parent must not (it
    # would take GPU memory from the engine processes).
    kernel_overrides: tuple[tuple[str, Any], ...] = ()
    compilation_cache_dir: str | None = dataclasses.field(
        default_factory=_default_compilation_cache_dir
    )  # jax's persistent compilation cache; None: off
    warmup: bool | None = None  # compile every bucket at start; None: on a GPU only
    data_parallel_size: int = 1  # engine replicas, each on its own device(s), behind one router
    # With several replicas: each one's engine in a process of its own (spawned), so that their
    # host work never shares a GIL; off, each on a thread of this process.
    engine_process: bool = True
    # Tensor parallelism: the model's heads, MLP units and vocabulary split over the first N
    # devices (across processes, once `jax.distributed` is initialized: see below).
    tensor_parallel_size: int = 1
    # Several processes, one per GPU, running one engine (`jax.distributed.initialize`): the
    # coordinator's host:port (process 0 listens there), how many processes, and this one's id.
    distributed_coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0

    def kernel_config(self) -> KernelConfig:
        """`kernels`, else the backend's defaults with `kernel_overrides` (starts jax)."""
        return self.kernels or KernelConfig.for_backend(**dict(self.kernel_overrides))

    def __post_init__(self) -> None:
        if self.kernels is not None and self.kernel_overrides:
            raise ValueError("give kernels or kernel_overrides, not both")
        if self.kernel_overrides:  # checked on any backend's defaults: they do not change them
            KernelConfig.for_backend("cpu", **dict(self.kernel_overrides))
        if self.max_batch_size < 1 or self.block_size < 1:
            raise ValueError("max_batch_size and block_size must be >= 1")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.decode_steps != "auto" and (
            not isinstance(self.decode_steps, int) or self.decode_steps < 1
        ):
            raise ValueError(
                f"decode_steps must be 'auto' or an int >= 1, got {self.decode_steps!r}"
            )
        for name in ("decode_steps_per_trip", "open_decode_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not 0 <= self.max_decode_window_ms <= 60000:
            raise ValueError(
                f"max_decode_window_ms must be in [0, 60000], got {self.max_decode_window_ms!r}"
            )
        if not 0 <= self.idle_gather_ms <= 1000:
            raise ValueError(f"idle_gather_ms must be in [0, 1000], got {self.idle_gather_ms!r}")
        if not 0 <= self.idle_gather_max_ms <= 10000:
            raise ValueError(
                f"idle_gather_max_ms must be in [0, 10000], got {self.idle_gather_max_ms!r}"
            )
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a directory, got "
                f"{self.generation_config!r}"
            )
        if self.min_decode_batch is not None and self.min_decode_batch < 1:
            raise ValueError(f"min_decode_batch must be >= 1, got {self.min_decode_batch}")
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_memory_fraction is not None:
            raise ValueError("give at most one of kv_cache_tokens and kv_cache_memory_fraction")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}"
            )
        check_distributed(self.distributed_coordinator_address, self.num_processes, self.process_id)
        if self.num_processes > 1 and self.data_parallel_size > 1:
            raise ValueError("--num-processes > 1 runs one engine: give --data-parallel-size 1")


def set_xla_flags() -> None:
    """rosejax's process-wide XLA flags, added to XLA_FLAGS unless it names them already. XLA
    reads XLA_FLAGS once, when jax starts its backend: later calls change nothing."""
    flags = os.environ.get("XLA_FLAGS", "")
    for name, value in _PROCESS_XLA_FLAGS.items():
        if name not in flags:
            flags = f"{flags} --{name}={value}"
    os.environ["XLA_FLAGS"] = flags.strip()


def check_distributed(coordinator_address: str | None, num_processes: int, process_id: int) -> None:
    """The --distributed-coordinator-address, --num-processes and --process-id flags, checked."""
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"--process-id must be in [0, --num-processes), and --num-processes >= 1; got "
            f"{process_id} of {num_processes}"
        )
    if num_processes > 1 and not coordinator_address:
        raise ValueError("--num-processes > 1 needs --distributed-coordinator-address HOST:PORT")
    host, _, port = (coordinator_address or "").rpartition(":")
    if coordinator_address and not (host and port.isdigit()):
        raise ValueError(
            f"--distributed-coordinator-address must be HOST:PORT, got {coordinator_address!r}"
        )


def initialize_distributed(
    coordinator_address: str | None, num_processes: int = 1, process_id: int = 0
) -> None:
    """`jax.distributed.initialize` (once per process) when a coordinator address is given: then
    `jax.devices()` lists every process's devices, and one mesh spans them. It must run before
    jax starts its backend, so entry points call it first (`configure_process` does too)."""
    check_distributed(coordinator_address, num_processes, process_id)
    if coordinator_address and not jax.distributed.is_initialized():
        jax.distributed.initialize(coordinator_address, num_processes, process_id)


def configure_process(
    compilation_cache_dir: str | None = None,
    *,
    coordinator_address: str | None = None,
    num_processes: int = 1,
    process_id: int = 0,
) -> None:
    """The process-wide settings an engine runs best with, made by its entry points: XLA flags
    (`set_xla_flags`), `jax.distributed` when a coordinator address is given
    (`initialize_distributed`), and jax's persistent compilation cache in
    `compilation_cache_dir` (if given), so a second start skips compiling; its entries written
    whole (`rosejax.compilation_cache`)."""
    set_xla_flags()
    initialize_distributed(coordinator_address, num_processes, process_id)
    if compilation_cache_dir:
        write_entries_whole()  # other processes may read the same entries as they are written
        jax.config.update("jax_compilation_cache_dir", compilation_cache_dir)
        # Every program, however quick to compile: an engine's small ones load faster than they
        # compile (CPU, three engine-heavy test files: 139 -> 99 s warm, 235 -> 211 s cold).
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def select_gpus(indices: Sequence[int], flag: str) -> None:
    """Let this process see only these of the GPUs it was given (positions in
    CUDA_VISIBLE_DEVICES when set), numbered from 0; before jax starts its backend. CUDA
    renumbers them, where jax_cuda_visible_devices keeps their ids and jax's programs then
    refuse them ("Device id 1 is out of range [0, 1)"). ValueError, naming `flag`, if fewer
    GPUs were given."""
    given = _env("CUDA_VISIBLE_DEVICES")
    ids = given.split(",") if given else None
    if ids is not None and max(indices) >= len(ids):
        raise ValueError(
            f"{flag} needs GPU {max(indices)} of CUDA_VISIBLE_DEVICES={given!r}: lower {flag}"
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i] if ids else str(i) for i in indices)


def set_prometheus_multiproc_dir(directory: str) -> None:
    """Point prometheus_client's multiprocess mode at `directory`: its per-process value files
    go there (prometheus_client reads the directory only from PROMETHEUS_MULTIPROC_DIR, as each
    value's file is opened). `rosejax.serve.metrics.share_across_processes` calls it."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory


def freeze_heap() -> None:
    """Take every object alive now (modules, weights' handles, compiled programs) out of the
    garbage collector's view, as a server does once it is built: a full collection walked all of
    them, a pause of about 100 ms in the middle of serving, for garbage they never are."""
    gc.collect()
    gc.freeze()
