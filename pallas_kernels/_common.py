"""What the Pallas kernels share: the power-of-two rules of Triton tiles, optional operands, and
the filter for jax's Triton deprecation warning."""

from __future__ import annotations

import functools
import warnings

# jax 0.11 deprecates the Pallas Triton backend and warns each time a Triton pallas_call is
# *lowered*: that is when the jit around a whole decode step compiles, after our Python call
# has returned, so a filter scoped to the call site cannot catch it. The filter is installed
# once, the first time a compiled (non-interpret) kernel is built, and matches only this
# message and category. pyproject's pytest filter covers the test runs the same way.
TRITON_DEPRECATION = (
    r"The Pallas Triton backend is deprecated and will be removed in a future JAX version"
)


@functools.cache
def filter_triton_deprecation() -> None:
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


def without_absent(kernel, operands: tuple) -> tuple:
    """`kernel` and its input `operands`, some of them None (absent) -> a kernel that Pallas calls
    with the present ones' refs, and those operands; `kernel` gets None for each absent one (a
    layer without a bias loads and adds nothing, where zeros would cost a kernel of their own)."""
    present = [a is not None for a in operands]

    def call(*refs):
        refs = iter(refs)
        return kernel(*(next(refs) if p else None for p in present), *refs)

    return call, tuple(a for a in operands if a is not None)


def is_power_of_2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): Triton tiles must be powers of two."""
    return 1 << max(n - 1, 0).bit_length()
