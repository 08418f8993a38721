"""Weights declared once: shape, logical axes and initialiser, applied by an einsum."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from modern_jax.config import ModelConfig


def param(rngs: nnx.Rngs, init, shape, axes, dtype) -> nnx.Param:
    """An `nnx.Param` carrying its logical axis names (`out_sharding`)."""
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=tuple(axes), eager_sharding=False)


def init_std(cfg: ModelConfig, role: str, fan_in: int, fan_out: int) -> float:
    """Standard deviation of a weight by its role.

    roles: `qk` (query/key projections), `v` (value), `in` (FFN input and other
    projections), `out` (the residual-writing projections: attention out, FFN down).
    normal: init_std, the residual-writing ones scaled by 1/sqrt(2L).
    xavier: sqrt(2 / (fan_in + fan_out)).
    deepnorm placement: xavier with gain (8L)^(-1/4) except on q and k (DeepNet).
    """
    xavier = math.sqrt(2.0 / (fan_in + fan_out))
    if cfg.norm_placement == "deepnorm":
        return xavier * (1.0 if role == "qk" else (8 * cfg.n_layers) ** -0.25)
    if cfg.init == "xavier":
        return xavier
    return cfg.init_std / math.sqrt(2 * cfg.n_layers) if role == "out" else cfg.init_std


class Proj(nnx.Module):
    """A projection `kernel[in..., out...]` (+ optional `bias[out...]`).

    `in_dims` leading dimensions of the kernel are contracted; the caller writes the
    einsum, so every layer reads as its equation, e.g. `q_proj("BTD,DNH->BTNH", x)`.
    """

    def __init__(self, cfg: ModelConfig, shape, axes, *, role: str, in_dims: int = 1, bias: bool = False,
                 rngs: nnx.Rngs):
        fan_in, fan_out = math.prod(shape[:in_dims]), math.prod(shape[in_dims:])
        std = init_std(cfg, role, fan_in, fan_out)
        dtype = jnp.dtype(cfg.param_dtype)
        self.kernel = param(rngs, jax.nn.initializers.normal(std), shape, axes, dtype)
        self.bias = param(rngs, jax.nn.initializers.zeros, shape[in_dims:], axes[in_dims:], dtype) if bias else None

    def __call__(self, equation: str, x):
        y = jnp.einsum(equation, x, self.kernel[...].astype(x.dtype))
        if self.bias is not None:
            b = self.bias[...].astype(x.dtype)
            y = y + b.reshape((1,) * (y.ndim - b.ndim) + b.shape)  # over every leading (batch, length) axis
        return y
