"""RMSNorm (plain and Gemma's (1 + w)), LayerNorm and the weightless L2 norm, statistics in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from modern_jax.config import ModelConfig
from modern_jax.ops.norm import add_norm, norm
from modern_jax.layers.linear import param


class Norm(nnx.Module):
    """`x * rsqrt(mean(x^2) + eps) * gamma` (rmsnorm), `* (1 + gamma)` (gemma_rmsnorm),
    or `(x - mean) * rsqrt(var + eps) * gamma + beta` (layernorm).

    Normalises over the trailing `len(shape)` dimensions; statistics are computed in
    float32 and the result is cast back to the input dtype.
    """

    def __init__(self, cfg: ModelConfig, shape=None, axes=("norm",), *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.param_dtype)
        self.kind, self.eps = cfg.norm_type, cfg.norm_eps
        gamma_init = jax.nn.initializers.zeros if self.kind == "gemma_rmsnorm" else jax.nn.initializers.ones
        shape = (cfg.d_model,) if shape is None else tuple(shape)
        self.weight = param(rngs, gamma_init, shape, axes, dtype)
        self.bias = param(rngs, jax.nn.initializers.zeros, shape, axes, dtype) if cfg.norm_bias else None

    @jax.named_scope("norm")
    def __call__(self, x):
        bias = None if self.bias is None else self.bias[...]
        return norm(x, self.weight[...], bias, kind=self.kind, eps=self.eps)

    def add_norm(self, x, residual):
        """`(h, Norm(h))` with `h = residual + x`: the residual add fused into the norm's kernel."""
        bias = None if self.bias is None else self.bias[...]
        return add_norm(x, residual, self.weight[...], bias, kind=self.kind, eps=self.eps)


def l2_norm(x, eps: float):
    """`x * rsqrt(mean(x^2) + eps)` over the last axis, without a weight (Llama 4's QK-norm,
    `Llama4TextL2Norm`); statistics in float32, the result in x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)).astype(x.dtype)
