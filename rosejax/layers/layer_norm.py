"""GPT-2's layer norm: flax params, one Pallas kernel on a GPU (XLA makes two: statistics, then
normalize); GPT-2 runs 25 a step. It also finishes a deferred residual `Linear` (`PendingSum`):
bias, residual and the matmul's partial sums are added in the same kernel."""

from __future__ import annotations

import flax.linen as nn
import jax

from pallas_kernels._common import gpu_kernel_enabled
from pallas_kernels.layer_norm import add_layer_norm, layer_norm, layer_norm_reference
from rosejax.layers.linear import PendingSum


def pallas_layer_norm_enabled() -> bool:
    return gpu_kernel_enabled("ROSEJAX_PALLAS_LAYER_NORM")


class LayerNorm(nn.Module):
    """flax's `nn.LayerNorm` (scale, bias; float32 statistics), taking the residual stream as
    an array or a `PendingSum` and returning (the stream as an array, its layer norm)."""

    epsilon: float

    @nn.compact
    def __call__(self, x: jax.Array | PendingSum) -> tuple[jax.Array, jax.Array]:  # [..., E] each
        pending = isinstance(x, PendingSum)
        shape = x.residual.shape if pending else x.shape
        e = shape[-1]
        scale = self.param("scale", nn.initializers.ones, (e,))
        bias = self.param("bias", nn.initializers.zeros, (e,))
        kernel = pallas_layer_norm_enabled()
        if pending and kernel:
            h, y = add_layer_norm(
                x.partials, x.bias, x.residual_rows(), scale, bias, eps=self.epsilon
            )
            return h.reshape(shape), y.reshape(shape)
        x = x.value() if pending else x
        norm = layer_norm if kernel else layer_norm_reference
        return x, norm(x.reshape(-1, e), scale, bias, eps=self.epsilon).reshape(shape)
