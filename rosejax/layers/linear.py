"""The linear layer: flax's `nn.Dense` params (and names, so checkpoints load unchanged), computed
by a Pallas kernel or XLA as the `KernelConfig` says.

- `Linear`: x @ w + b with its activation and residual add in the same kernel, for calls of at
  most `kernels.linear_max_rows` rows (decode steps of small batches), where XLA splits every
  matmul over K and needs a second kernel for the sum and epilogue. The kernel splits K only
  where a program's share would be long (GPT-2 small: the MLP down-projection), and then needs
  that second kernel too, unless a layer norm takes the sum (below).
- A residual `Linear` whose sum feeds a layer norm (GPT-2's attention and MLP outputs) may defer
  its epilogue: it returns the float32 partial sums of x @ w (`PendingSum`), and the next
  `LayerNorm` adds bias and residual in its own kernel (`add_layer_norm`), which also stores
  the sum for the residual stream. Per layer that is one kernel fewer, and the matmul may split
  K over more programs for free.
- Decode steps of many rows (`kernels.xla_split_k_min_rows`) defer those sums on XLA's path
  too where the output is narrow: two float32 partial sums over K in one batched GEMM (twice
  the output tiles of a GEMM whose few columns leave most of a GPU idle), the residual added in
  the norm's kernel.
- A SwiGLU MLP's gate/up projection (activation "swiglu", kernel [in, 2F]) returns
  silu(gate) * up [..., F]: the Pallas kernel computes it on its accumulators
  (`kernels.fused_swiglu`), every other path in XLA after the product
  (`pallas_kernels.linear.swiglu`, the same rounding).
- A row-parallel `Linear` (`reduce_axis`, tensor parallelism: `rosejax.layers.parallel`) holds
  its shard's rows of the kernel: its float32 partial sums are all-reduced over the mesh axis
  first, and the replicated bias and residual added after, once, rounded where one device's
  call rounds (so half-precision values match it up to the order of float32 sums).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from pallas_kernels.linear import (
    finish_partial_sums,
    linear,
    linear_partial_sums,
    linear_partial_sums_reference,
    linear_reference,
    linear_reference_epilogue,
    linear_supported,
    swiglu,
)
from rosejax.settings import XLA_KERNELS, KernelConfig

# XLA's split-K GEMMs (`KernelConfig.xla_split_k_min_rows`): two partial sums (4 were no
# faster), for outputs of at most 1,024 columns (Llama-3.2-1B's 2,048 fill an H200 without it:
# 1.006x the step time with it).
XLA_SPLIT_K = 2
XLA_SPLIT_K_MAX_COLUMNS = 1024


def pallas_linear_enabled(
    kernels: KernelConfig, rows: int, k: int, n: int, activation: str | None = None
) -> bool:
    """For an [rows, k] @ [k, n] call: the Pallas kernel is chosen, rows are few enough, and
    the kernel tiles the shape (with its block sizes and `activation`'s column tiles)."""
    blocks = {p: v for p, v in kernels.tile_kwargs("linear").items() if p in ("block_k", "block_n")}
    return (
        kernels.linear == "pallas"
        and rows <= kernels.linear_max_rows
        and linear_supported(k, n, activation=activation, **blocks)
    )


@flax.struct.dataclass
class PendingSum:
    """residual + x @ w + bias with the matmul's float32 partial sums not yet added up."""

    partials: jax.Array  # [S, M, N] float32
    bias: jax.Array | None  # [N]; None: no bias
    residual: jax.Array  # [..., N], M rows in all

    @property
    def shape(self) -> tuple[int, ...]:  # [..., N]: the stream's, as an array's
        return self.residual.shape

    def residual_rows(self) -> jax.Array:  # [M, N]
        return self.residual.reshape(self.partials.shape[1:])

    def value(self) -> jax.Array:  # [..., N], the residual's dtype
        h = finish_partial_sums(self.partials, self.bias, self.residual_rows())
        return h.reshape(self.residual.shape)


def select_tokens(x: jax.Array | PendingSum, indices: jax.Array) -> jax.Array:
    """Row b's token indices[b] of the residual stream x [B, T, E] (an array or a PendingSum):
    [B, E], the only rows whose logits are wanted."""
    x = x.value() if isinstance(x, PendingSum) else x
    return jnp.take_along_axis(x, indices[:, None, None], axis=1)[:, 0]


def given_param(module: nn.Module, name: str, shape: tuple[int, ...]) -> jax.Array:
    """`module`'s param `name`, which must have `shape`. rosejax's params are built (and their
    shapes checked) by each family's `params_from_tensors`, never by flax's init, so this is
    `module.param` without its check of the value against its initializer's output: an
    `eval_shape` per param per trace, a fifth of the time tracing a program takes (seconds of a
    server's start)."""
    value = module.get_variable("params", name)
    if value is None or value.shape != shape:
        got = None if value is None else value.shape
        raise ValueError(f"param {name!r} of {module.scope.path_text} is {got}, expected {shape}")
    return value


class Linear(nn.Module):
    """flax's `nn.Dense` (kernel [in, out], bias), then `activation` and `+ residual`."""

    features: int  # the kernel's columns (swiglu: its output has half as many)
    # None, "gelu_tanh" (GPT-2's gelu_new) or "swiglu" (the columns a gate half and an up half)
    activation: str | None = None
    kernels: KernelConfig = XLA_KERNELS
    use_bias: bool = True  # False: no bias param, nothing added
    reduce_axis: str | None = None  # row-parallel: psum the partial sums over this mesh axis

    @nn.compact
    def __call__(self, x, residual=None, *, defer: bool = False):
        """x [..., K], residual [..., N] or None -> [..., N] (swiglu: [..., N / 2]). With `defer`
        (a residual layer whose sum only a `LayerNorm` reads), a `PendingSum` instead when there
        is a residual, no activation, and the call is the Pallas kernel's; otherwise the array
        as without it."""
        if self.activation == "swiglu" and residual is not None:
            raise ValueError("a swiglu Linear takes no residual")
        k = x.shape[-1]
        kernel = given_param(self, "kernel", (k, self.features))
        # No bias is None, not zeros: zeros would be made every decode step (a kernel each).
        bias = given_param(self, "bias", (self.features,)) if self.use_bias else None
        lead = x.shape[:-1]
        rows = math.prod(lead)
        flat = x.reshape(rows, k)  # [rows, K]
        out = self.features // 2 if self.activation == "swiglu" else self.features
        res = None if residual is None else residual.reshape(rows, out)
        deferred = defer and residual is not None and self.activation is None  # a norm adds it
        pallas = pallas_linear_enabled(self.kernels, rows, k, self.features)
        tiles = self.kernels.tile_kwargs("linear") | {"interpret": self.kernels.interpret}
        if pallas and self.activation == "swiglu" and not self.fused_swiglu(rows, k):
            # The kernel's product, then silu(gate) * up in XLA.
            y = linear(flat, kernel, bias, **tiles)
            return swiglu(y).reshape(*lead, out)
        if self.reduce_axis is not None and not pallas:
            # Rounded where one device's `linear_reference` rounds (the whole product, then each
            # add), so the shards' sum gives the same half-precision values.
            product = linear_partial_sums_reference(flat, kernel)[0]  # float32
            product = jax.lax.psum(product, self.reduce_axis).astype(x.dtype)
            y = linear_reference_epilogue(product, bias, res, activation=self.activation)
            return y.reshape(*lead, out)
        if self.reduce_axis is not None:
            partials = linear_partial_sums(flat, kernel, **tiles)
            # The splits summed first: the all-reduce carries one [1, M, N] float32 sum.
            partials = jax.lax.psum(partials.sum(axis=0, keepdims=True), self.reduce_axis)
            if deferred:
                return PendingSum(partials, bias, residual)
            y = finish_partial_sums(partials, bias, res, activation=self.activation, dtype=x.dtype)
            return y.reshape(*lead, out)
        if not pallas:
            if deferred and self.xla_split_k(rows, k, decode=lead[-1] == 1):
                partials = linear_partial_sums_reference(flat, kernel, XLA_SPLIT_K)
                return PendingSum(partials, bias, residual)
            y = linear_reference(flat, kernel, bias, res, activation=self.activation)
            return y.reshape(*lead, out)
        if deferred:
            return PendingSum(linear_partial_sums(flat, kernel, **tiles), bias, residual)
        y = linear(flat, kernel, bias, res, activation=self.activation, **tiles)
        return y.reshape(*lead, out)

    def xla_split_k(self, rows: int, k: int, decode: bool) -> bool:
        """Whether a deferred call on XLA's path returns XLA_SPLIT_K partial sums (decode steps
        of `kernels.xla_split_k_min_rows` rows or more, narrow outputs; `decode`: one token a
        row)."""
        least = self.kernels.xla_split_k_min_rows
        narrow = self.features <= XLA_SPLIT_K_MAX_COLUMNS and k % XLA_SPLIT_K == 0
        return decode and narrow and least is not None and rows >= least

    def fused_swiglu(self, rows: int, k: int) -> bool:
        """Whether the Pallas kernel computes this swiglu layer's silu(gate) * up itself."""
        swiglu_ok = pallas_linear_enabled(self.kernels, rows, k, self.features, "swiglu")
        return self.kernels.fused_swiglu and swiglu_ok


def norm_stream(
    x: jax.Array | PendingSum,  # [..., E]
    weights: tuple[jax.Array, ...],  # the norm's [E] params: (scale,) or (scale, bias)
    eps: float,
    on_xla: bool,
    reference: Callable,  # (x [N, E], *weights, eps=) -> [N, E]
    kernel: Callable,  # the Pallas kernel of the same
    add_kernel: Callable,  # (partials, bias, residual, *weights, eps=, **tiles) -> (h, y)
    tiles: dict,
) -> tuple[jax.Array, jax.Array]:  # [..., E] each
    """A row norm (layer norm, RMSNorm) of the residual stream x, an array or a `PendingSum`:
    (the stream as an array, its norm). On the Pallas path a pending sum's bias, residual and
    partial sums are added in the norm's own kernel."""
    pending = isinstance(x, PendingSum)
    shape = x.shape
    e = shape[-1]
    if on_xla:
        x = x.value() if pending else x
        return x, reference(x.reshape(-1, e), *weights, eps=eps).reshape(shape)
    if pending:
        h, y = add_kernel(x.partials, x.bias, x.residual_rows(), *weights, eps=eps, **tiles)
        return h.reshape(shape), y.reshape(shape)
    return x, kernel(x.reshape(-1, e), *weights, eps=eps, **tiles).reshape(shape)
