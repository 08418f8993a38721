"""RMSNorm (plain and Gemma's (1 + w)) and LayerNorm, statistics in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from modern_jax.config import ModelConfig
from modern_jax.layers.linear import param


class Norm(nnx.Module):
    """`x * rsqrt(mean(x^2) + eps) * gamma` (rmsnorm), `* (1 + gamma)` (gemma_rmsnorm),
    or `(x - mean) * rsqrt(var + eps) * gamma + beta` (layernorm).

    Normalises over the trailing `len(shape)` dimensions; statistics are computed in
    float32 and the result is cast back to the input dtype.
    """

    def __init__(self, cfg: ModelConfig, shape=None, axes=("norm",), *, rngs: nnx.Rngs):
        shape = (cfg.d_model,) if shape is None else tuple(shape)
        dtype = jnp.dtype(cfg.param_dtype)
        self.kind, self.eps = cfg.norm_type, cfg.norm_eps
        gamma_init = jax.nn.initializers.zeros if self.kind == "gemma_rmsnorm" else jax.nn.initializers.ones
        self.weight = param(rngs, gamma_init, shape, axes, dtype)
        self.bias = param(rngs, jax.nn.initializers.zeros, shape, axes, dtype) if cfg.norm_bias else None

    def __call__(self, x):
        axes = tuple(range(x.ndim - self.weight.ndim, x.ndim))
        x32 = x.astype(jnp.float32)
        if self.kind == "layernorm":
            x32 = x32 - jnp.mean(x32, axis=axes, keepdims=True)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=axes, keepdims=True) + self.eps)
        gamma = self.weight[...].astype(jnp.float32)
        y = y * (1.0 + gamma if self.kind == "gemma_rmsnorm" else gamma)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)
