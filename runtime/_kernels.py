"""Former name of `hexiseq.runtime.kernels` (kept so old imports keep working)."""

from hexiseq.runtime.kernels import (  # noqa: F401
    backward_with,
    block_backward,
    block_forward,
    explicit_backward,
    explicit_forward,
    forward_with,
    kernel_for,
)
