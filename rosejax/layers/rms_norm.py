"""RMSNorm (Llama-style models): a `scale` param, computed by one Pallas kernel or XLA as the
`KernelConfig` says (`kernels.rms_norm`). Like `LayerNorm`, it takes the residual stream as an
array or a deferred residual `Linear`'s `PendingSum`, whose bias, residual and partial sums the
kernel adds first (`add_rms_norm`), and returns (the stream as an array, its RMSNorm)."""

from __future__ import annotations

import flax.linen as nn
import jax

from pallas_kernels.rms_norm import add_rms_norm, rms_norm, rms_norm_reference
from rosejax.layers.linear import PendingSum, given_param, norm_stream
from rosejax.settings import XLA_KERNELS, KernelConfig


class RMSNorm(nn.Module):
    epsilon: float
    kernels: KernelConfig = XLA_KERNELS

    @nn.compact
    def __call__(self, x: jax.Array | PendingSum) -> tuple[jax.Array, jax.Array]:  # [..., E] each
        e = x.shape[-1]
        scale = self.scale(e)
        k = self.kernels
        tiles = k.tile_kwargs("rms_norm") | {"interpret": k.interpret}
        return norm_stream(
            x,
            (scale,),
            self.epsilon,
            k.rms_norm == "xla",
            rms_norm_reference,
            rms_norm,
            add_rms_norm,
            tiles,
        )

    def scale(self, e: int) -> jax.Array:  # [E]
        """The param, for a kernel that applies this norm itself (the decode attention)."""
        return given_param(self, "scale", (e,))
