"""RMSNorm (Llama-style models): a `scale` param, computed by one Pallas kernel or XLA as the
`KernelConfig` says (`kernels.rms_norm`). Like `LayerNorm`, it takes the residual stream as an
array or a deferred residual `Linear`'s `PendingSum`, whose bias, residual and partial sums the
kernel adds first (`add_rms_norm`), and returns (the stream as an array, its RMSNorm)."""

from __future__ import annotations

import flax.linen as nn
import jax

from pallas_kernels.rms_norm import add_rms_norm, rms_norm, rms_norm_reference
from rosejax.layers.linear import PendingSum
from rosejax.settings import XLA_KERNELS, KernelConfig


class RMSNorm(nn.Module):
    epsilon: float
    kernels: KernelConfig = XLA_KERNELS

    @nn.compact
    def __call__(self, x: jax.Array | PendingSum) -> tuple[jax.Array, jax.Array]:  # [..., E] each
        pending = isinstance(x, PendingSum)
        shape = x.residual.shape if pending else x.shape
        e = shape[-1]
        scale = self.param("scale", nn.initializers.ones, (e,))
        if self.kernels.rms_norm == "xla":
            x = x.value() if pending else x
            return x, rms_norm_reference(x, scale, eps=self.epsilon)
        tiles = self.kernels.tile_kwargs("rms_norm") | {"interpret": self.kernels.interpret}
        if pending:
            h, y = add_rms_norm(
                x.partials, x.bias, x.residual_rows(), scale, eps=self.epsilon, **tiles
            )
            return h.reshape(shape), y.reshape(shape)
        y = rms_norm(x.reshape(-1, e), scale, eps=self.epsilon, **tiles)
        return x, y.reshape(shape)
