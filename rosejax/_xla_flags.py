"""XLA flags rosejax needs on a GPU, set before jax starts its backend.

The decode window is a `lax.while_loop`. Without WHILE/CONDITIONAL in XLA's command buffers (CUDA
graphs), the host launches every kernel of every step and reads the loop predicate back each
iteration; with them, a window is one graph. Measured on an H200 (bench/RESULTS.md): B=256 decode
0.98 ms/step with them, 1.09 ms without. A user's own setting of the flag wins.
"""

from __future__ import annotations

import os

_COMMAND_BUFFER = (
    "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
)


def set_default_xla_flags() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_COMMAND_BUFFER}".strip()
