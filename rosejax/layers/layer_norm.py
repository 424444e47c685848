"""Layer norm: flax's `nn.LayerNorm` params, computed by one Pallas kernel (XLA makes two:
statistics, then normalize; GPT-2 runs 25 a step) or XLA as the `KernelConfig` says. It also finishes a deferred residual `Linear` (`PendingSum`):
bias, residual and the matmul's partial sums are added in the same kernel."""

from __future__ import annotations

import flax.linen as nn
import jax

from pallas_kernels.layer_norm import add_layer_norm, layer_norm, layer_norm_reference
from rosejax.layers.linear import PendingSum, given_param, norm_stream
from rosejax.settings import XLA_KERNELS, KernelConfig


class LayerNorm(nn.Module):
    """flax's `nn.LayerNorm` (scale, bias; float32 statistics), taking the residual stream as
    an array or a `PendingSum` and returning (the stream as an array, its layer norm)."""

    epsilon: float
    kernels: KernelConfig = XLA_KERNELS

    @nn.compact
    def __call__(self, x: jax.Array | PendingSum) -> tuple[jax.Array, jax.Array]:  # [..., E] each
        e = x.shape[-1]
        scale = given_param(self, "scale", (e,))
        bias = given_param(self, "bias", (e,))
        k = self.kernels
        tiles = k.tile_kwargs("layer_norm") | {"interpret": k.interpret}
        return norm_stream(
            x,
            (scale, bias),
            self.epsilon,
            k.layer_norm == "xla",
            layer_norm_reference,
            layer_norm,
            add_layer_norm,
            tiles,
        )
