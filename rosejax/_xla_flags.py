"""XLA flags rosejax needs on a GPU, set before jax starts its backend.

The decode window is a `lax.while_loop`. Without WHILE/CONDITIONAL in XLA's command buffers (CUDA
graphs), the host launches every kernel of every step and reads the loop predicate back each
iteration; with them, a window is one graph. Measured on an H200 (bench/RESULTS.md): B=256 decode
0.98 ms/step with them, 1.09 ms without. A user's own setting of either flag wins.
"""

from __future__ import annotations

import os

# XLA's own GEMM choice stays: its Triton GEMMs win at small batches (B=1: 0.435 ms/step against
# 0.557 with --xla_gpu_enable_triton_gemm=false on an H200), cuBLAS by 5% at B=256 (1.066 against
# 1.124 ms); latency matters more here. bench/RESULTS.md has the runs.
_DEFAULTS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
}


def set_default_xla_flags() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    for name, value in _DEFAULTS.items():
        if name not in flags:
            flags = f"{flags} --{name}={value}"
    os.environ["XLA_FLAGS"] = flags.strip()
