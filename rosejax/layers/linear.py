"""GPT-2's layer norm and linear layers: flax params, each dispatched to a Pallas kernel on a GPU.

Both keep the params (and names) of flax's `nn.LayerNorm` / `nn.Dense`, so checkpoints load
unchanged, and both compute in plain XLA off the GPU or when switched off:

- `LayerNorm`: one kernel instead of XLA's two (statistics, then normalize); GPT-2 has 25 a step.
  ROSEJAX_PALLAS_LAYER_NORM=0 turns it off.
- `Linear`: x @ w + b with its activation and residual add in the same kernel, for calls of at
  most ROSEJAX_PALLAS_LINEAR_MAX_ROWS rows (decode steps of small batches), where XLA splits
  every matmul over K and needs a second kernel for the sum and epilogue. The kernel splits K
  only where a program's share would be long (GPT-2 small: the MLP down-projection), and then
  needs that second kernel too, unless a layer norm takes the sum (below).
  ROSEJAX_PALLAS_LINEAR=0 turns it off.
- A residual `Linear` whose sum feeds a layer norm (GPT-2's attention and MLP outputs) may defer
  its epilogue: it returns the float32 partial sums of x @ w (`PendingSum`), and the next
  `LayerNorm` adds bias and residual in its own kernel (`add_layer_norm`), which also stores
  the sum for the residual stream. Per layer that is one kernel fewer, and the matmul may split
  K over more programs for free.
"""

from __future__ import annotations

import math

import flax.linen as nn
import flax.struct
import jax

from pallas_kernels._common import env_int, gpu_kernel_enabled
from pallas_kernels.linear import (
    finish_partial_sums,
    linear,
    linear_partial_sums,
    linear_reference,
    linear_supported,
)

# Rows up to which `Linear` runs the Pallas kernel. On an H100 (bench/RESULTS.md, session 10, before
# the kernel split K) the 16-row decode step (batches of 1-16) took 0.404 ms with it against 0.427
# without; at 32 and 64 rows XLA's split-K GEMMs won (0.473 vs 0.520, 0.521 vs 0.577).
DEFAULT_LINEAR_MAX_ROWS = 16


def pallas_linear_enabled(rows: int, k: int, n: int) -> bool:
    """For an [rows, k] @ [k, n] call: few rows, a shape the kernel tiles, and not switched off."""
    max_rows = env_int("ROSEJAX_PALLAS_LINEAR_MAX_ROWS", DEFAULT_LINEAR_MAX_ROWS)
    return (
        rows <= max_rows and linear_supported(k, n) and gpu_kernel_enabled("ROSEJAX_PALLAS_LINEAR")
    )


@flax.struct.dataclass
class PendingSum:
    """residual + x @ w + bias with the matmul's float32 partial sums not yet added up."""

    partials: jax.Array  # [S, M, N] float32
    bias: jax.Array  # [N]
    residual: jax.Array  # [..., N], M rows in all

    def residual_rows(self) -> jax.Array:  # [M, N]
        return self.residual.reshape(self.partials.shape[1:])

    def value(self) -> jax.Array:  # [..., N], the residual's dtype
        h = finish_partial_sums(self.partials, self.bias, self.residual_rows())
        return h.reshape(self.residual.shape)


class Linear(nn.Module):
    """flax's `nn.Dense` (kernel [in, out], bias), then `activation` and `+ residual`."""

    features: int
    activation: str | None = None  # None or "gelu_tanh" (GPT-2's gelu_new)

    @nn.compact
    def __call__(self, x, residual=None, *, defer: bool = False):
        """x [..., K], residual [..., N] or None -> [..., N]. With `defer` (a residual layer
        whose sum only a `LayerNorm` reads), a `PendingSum` instead when there is a residual, no
        activation, and the call is the Pallas kernel's; otherwise the array as without it."""
        k = x.shape[-1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (k, self.features))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        lead = x.shape[:-1]
        rows = math.prod(lead)
        pallas = pallas_linear_enabled(rows, k, self.features)
        if defer and pallas and residual is not None and self.activation is None:
            return PendingSum(linear_partial_sums(x.reshape(rows, k), kernel), bias, residual)
        impl = linear if pallas else linear_reference
        res = None if residual is None else residual.reshape(rows, self.features)
        y = impl(x.reshape(rows, k), kernel, bias, res, activation=self.activation)
        return y.reshape(*lead, self.features)
