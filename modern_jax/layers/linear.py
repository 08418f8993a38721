"""Weights declared once: shape, logical axes and initialiser, applied by an einsum; a frozen
weight may be stored quantized (`Quantized`, `ops.quant`), which the projection dequantizes as it
runs. A converter (`training.converters`) may subclass a projection and add modules of its own,
which draw their dropout from the block's key for them (`module_dropout`)."""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from flax import nnx

from modern_jax.config import ModelConfig
from modern_jax.ops import quant


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


_DROPOUT_KEY = contextvars.ContextVar("module_dropout_key", default=None)


@contextlib.contextmanager
def module_dropout(key):
    """The key, inside one block, of the dropout that modules added to the model draw (None: no
    dropout); each folds in a salt of its own."""
    token = _DROPOUT_KEY.set(key)
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


def module_dropout_key():
    """The current block's key for `module_dropout`, or None."""
    return _DROPOUT_KEY.get()


def _axes(variable) -> tuple:
    return tuple(variable.get_metadata()["out_sharding"])


class Quantized(nnx.Module):
    """A frozen kernel `[lead..., out...]` stored quantized (`ops.quant`) over its flattened output
    dims; each piece keeps the kernel's leading axes (and their sharding), the blocked axis the
    first output axis's."""

    def __init__(self, kernel, out_dims: int, kind: str):
        shape, axes = tuple(kernel.shape), _axes(kernel)
        lead = len(shape) - out_dims
        self.out_shape, self.kind = shape[lead:], kind
        flat = kernel[...].reshape(*shape[:lead], math.prod(self.out_shape))
        for name, piece in quant.quantize(flat, kind).items():
            last = axes[lead] if piece.shape[-1] > 1 else None  # per block (or per value); a row's scalar: whole
            setattr(self, name, nnx.Param(piece, out_sharding=(*axes[:lead], last), eager_sharding=False))

    def value(self, dtype):
        """The kernel, dequantized in `dtype`."""
        pieces = {name: getattr(self, name)[...] for name in quant.piece_shapes((math.prod(self.out_shape),),
                                                                                 self.kind)}
        flat = quant.dequantize(pieces, self.kind, dtype)
        return flat.reshape(*flat.shape[:-1], *self.out_shape)


def weight(kernel, dtype):
    """A kernel (an `nnx.Param`, or `Quantized`) in `dtype`."""
    return kernel.value(dtype) if isinstance(kernel, Quantized) else kernel[...].astype(dtype)


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
        self.in_dims, self.out_dims = in_dims, len(shape) - in_dims

    def weight(self, dtype):
        """The kernel as it acts, in `dtype` (for layers that read the weight itself: a router,
        MLA's absorbed `kv_b_proj`)."""
        return weight(self.kernel, dtype)

    def apply(self, equation: str, x):
        """`equation` (`x, kernel -> y`) applied to `x`, without the bias."""
        return jnp.einsum(equation, x, weight(self.kernel, x.dtype))

    def __call__(self, equation: str, x):
        y = self.apply(equation, x)
        if self.bias is not None:
            b = self.bias[...].astype(x.dtype)
            y = y + b.reshape((1,) * (y.ndim - b.ndim) + b.shape)  # over every leading (batch, length) axis
        return y
