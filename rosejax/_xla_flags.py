"""XLA flags rosejax needs on a GPU, set before jax starts its backend.

The decode window is a `lax.while_loop`. Without WHILE/CONDITIONAL in XLA's command buffers (CUDA
graphs), the host launches every kernel of every step and reads the loop predicate back each
iteration; with them, a window is one graph. Measured on an H200 (bench/RESULTS.md): B=256 decode
0.98 ms/step with them, 1.09 ms without. A user's own setting of either flag wins.

`decode_compiler_options` sets options of each decode program's compile (not process-wide flags):
its GEMM library, and how its command buffer orders kernels.
"""

from __future__ import annotations

import os

from pallas_kernels._common import env_int

_DEFAULTS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
}


def set_default_xla_flags() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    for name, value in _DEFAULTS.items():
        if name not in flags:
            flags = f"{flags} --{name}={value}"
    os.environ["XLA_FLAGS"] = flags.strip()


# XLA's Triton GEMMs win at small batches (B=1: 0.435 ms/step against 0.557 with cuBLAS on an
# H200), cuBLAS with its bias/GELU epilogues at large ones (B=256: 1.066 against 1.124 ms), so the
# choice is made per decode program (bench/RESULTS.md has the runs).
#
# A command buffer's kernels in XLA's default order (LHS) wait for every kernel before them;
# CONCURRENT makes each wait only for the kernels whose buffers it uses, so independent work (a
# step's bookkeeping, the next step's embedding) overlaps. In one process on an H200 (session 14):
# -1.2% ms/step at B=1, -1.5% at B=16, -0.5% at B=128, -1.8% at B=256, greedy tokens unchanged.
_SCHEDULING = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


def decode_compiler_options(batch: int) -> dict[str, bool | str]:
    """Per-program XLA options for a decode program of `batch` rows: cuBLAS GEMMs from
    ROSEJAX_CUBLAS_MIN_BATCH rows up (default 256) and concurrent command-buffer scheduling,
    each unless XLA_FLAGS already decides it."""
    flags = os.environ.get("XLA_FLAGS", "")
    options = {k: v for k, v in _SCHEDULING.items() if k not in flags}
    if "xla_gpu_enable_triton_gemm" not in flags and batch >= env_int(
        "ROSEJAX_CUBLAS_MIN_BATCH", 256
    ):
        options["xla_gpu_enable_triton_gemm"] = False
    return options
