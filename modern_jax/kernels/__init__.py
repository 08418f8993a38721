"""Kernels behind one small dispatch: a pure-JAX reference always, Pallas where it pays.

`attention(..., impl=)` and `norm(..., impl=)` pick an implementation per call; see
`kernels/attention.py` and `kernels/norm.py` for the choices and the platform defaults,
and `kernels/backend.py` for running the Pallas kernels in interpret mode on CPU.
"""

from modern_jax.kernels.attention import (
    AttentionImpl,
    AttentionSpec,
    attention,
    attention_reference,
)
from modern_jax.kernels.backend import UnsupportedFeatureError, pallas_interpret
from modern_jax.kernels.masks import Visibility
from modern_jax.kernels.norm import NormImpl, add_norm, norm, norm_reference

__all__ = [
    "AttentionImpl",
    "AttentionSpec",
    "NormImpl",
    "UnsupportedFeatureError",
    "Visibility",
    "add_norm",
    "attention",
    "attention_reference",
    "norm",
    "norm_reference",
    "pallas_interpret",
]
