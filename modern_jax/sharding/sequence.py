"""Sequence parallelism (Megatron-SP): the residual stream split along T, whole inside the regions.

Letters: B batch, T length, D model.

Between the tensor-parallel regions (attention and the FFN) the residual stream `[B, T, D]` is
split along T over `context` x `tensor` (`activation_norm_length`, `residual`): norms, residual
adds and dropout run on `T / (C x TP)` rows. A region's input is constrained along T over
`context` only (`activation_length`), so the compiler all-gathers the sequence over `tensor`
entering it and reduce-scatters its row-parallel output, partial sums over the heads or the FFN
width, leaving it instead of all-reducing it; and the same, mirrored, for the gradients.

Only what changes the compiled program is here. The constraint on the residual stream makes
the reduce-scatters: mapped like the sequence inside the regions
(`parallel.rules.activation_norm_length=context`), the block outputs are all-reduced whole. The
constraint entering a region keeps XLA:CPU from gathering the q/k/v projections' kernels
(tests/test_sharding.py, the QK-norm test, fails without it). A constraint on a region's output
and a `custom_vjp` that reduce-scatters the gradient entering it leave both compilers' programs
as they are (the TPU compiler's for the data=2 x tensor=4 test model on 8 v5p: the same 6
reduce-scatters and 6 all-gathers), so they are not here. `region` also tells the ops where they
run (`length()`): a norm inside a region (QK-norm, MLA's latents) and one of the residual stream
run per device on the rows they hold.
"""

from __future__ import annotations

import contextvars

from modern_jax.sharding.context import constrain

_INSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("modern_jax_inside_region", default=False)


def residual(x_BTD):
    """`x` as the residual stream holds it: split along T over `context` x `tensor`."""
    return constrain(x_BTD, ("activation_batch", "activation_norm_length", "activation_embed"))


def region(f, x_BTD):
    """`f(x)` as a tensor-parallel region: `x` whole along T over `tensor` (split over `context`
    only), and the ops inside see the sequence as the region splits it."""
    token = _INSIDE.set(True)
    try:
        return f(constrain(x_BTD, ("activation_batch", "activation_length", "activation_embed")))
    finally:
        _INSIDE.reset(token)


def length() -> str:
    """The logical name of the sequence dimension here: `activation_length` inside a region,
    the residual stream's `activation_norm_length` outside."""
    return "activation_length" if _INSIDE.get() else "activation_norm_length"
