"""Weights declared once: shape, logical axes and initialiser, applied by an einsum; and what a
LoRA run adds to them: low-rank adapters, and a frozen kernel stored quantized (`modern_jax.lora`)."""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from flax import nnx

from modern_jax.config import ModelConfig
from modern_jax.lora import LoRAConfig, LoRAParam
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


_DROPOUT_KEY = contextvars.ContextVar("adapter_dropout_key", default=None)


@contextlib.contextmanager
def adapter_dropout(key):
    """The key of the adapters' dropout inside one block (None: no dropout); each adapter folds in its own salt."""
    token = _DROPOUT_KEY.set(key)
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


def _axes(variable) -> tuple:
    return tuple(variable.get_metadata()["out_sharding"])


class LoRA(nnx.Module):
    """`(alpha / r) B A x`: A `[lead..., in..., r]`, B `[lead..., r, out...]` (lead: stacked layers,
    experts), initialised as PEFT does: A uniform in +-1/sqrt(in) (torch's Linear default), B zero,
    so an adapted model starts equal to its base."""

    def __init__(self, kernel, in_dims: int, out_dims: int, lora: LoRAConfig, salt: int, rngs: nnx.Rngs):
        shape, axes = tuple(kernel.shape), _axes(kernel)
        lead = len(shape) - in_dims - out_dims
        ins, outs = slice(lead, lead + in_dims), slice(lead + in_dims, None)
        bound = 1.0 / math.sqrt(math.prod(shape[ins]))
        a_shape, b_shape = (*shape[:lead], *shape[ins], lora.rank), (*shape[:lead], lora.rank, *shape[outs])
        self.lora_a = LoRAParam(jax.random.uniform(rngs.params(), a_shape, jnp.float32, -bound, bound),
                                out_sharding=(*axes[:lead], *axes[ins], None), eager_sharding=False)
        self.lora_b = LoRAParam(jnp.zeros(b_shape, jnp.float32), out_sharding=(*axes[:lead], None, *axes[outs]),
                                eager_sharding=False)
        self.scale, self.dropout, self.salt, self.in_dims = lora.scale, lora.dropout, salt, in_dims

    def delta(self, dtype):
        """`scale A B`, the adapter as a weight `[lead..., in..., out...]` in `dtype`."""
        a, b = self.lora_a[...], self.lora_b[...]
        a = a.reshape(*a.shape[:a.ndim - 1 - self.in_dims], -1, a.shape[-1])  # [lead..., in, r]
        lead = a.shape[:-2]
        b2 = b.reshape(*lead, b.shape[len(lead)], -1)  # [lead..., r, out]
        w = jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b2.astype(jnp.float32)) * self.scale
        return w.reshape(*self.lora_a.shape[:-1], *b.shape[len(lead) + 1:]).astype(dtype)

    def __call__(self, equation: str, x):
        """`scale B A dropout(x)` for a projection applied as `equation` (`x, kernel -> y`)."""
        key = _DROPOUT_KEY.get()
        if self.dropout and key is not None:
            keep = jax.random.bernoulli(jax.random.fold_in(key, self.salt), 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
        ins, out = equation.split("->")
        x_letters, w_letters = ins.split(",")
        contracted, kept = w_letters[:self.in_dims], w_letters[self.in_dims:]
        r = next(c for c in "rRzZqQ" if c not in equation)
        h = jnp.einsum(f"{x_letters},{contracted}{r}->{out.replace(kept, r)}", x, self.lora_a[...].astype(x.dtype))
        return jnp.einsum(f"{out.replace(kept, r)},{r}{kept}->{out}", h * jnp.asarray(self.scale, x.dtype),
                          self.lora_b[...].astype(x.dtype))


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
        self.adapter: LoRA | None = nnx.data(None)  # `adapt` adds one in a LoRA run

    def weight(self, dtype):
        """The kernel as it acts, in `dtype`: dequantized, plus the adapter's `scale A B` (for layers
        that read the weight itself: a router, MLA's absorbed `kv_b_proj`)."""
        w = weight(self.kernel, dtype)
        return w if self.adapter is None else w + self.adapter.delta(dtype)

    def __call__(self, equation: str, x):
        y = jnp.einsum(equation, x, weight(self.kernel, x.dtype))
        if self.adapter is not None:
            y = y + self.adapter(equation, x)
        if self.bias is not None:
            b = self.bias[...].astype(x.dtype)
            y = y + b.reshape((1,) * (y.ndim - b.ndim) + b.shape)  # over every leading (batch, length) axis
        return y
