"""Kernels behind one small dispatch: a pure-JAX reference always, Pallas where it pays."""

from modern_jax.kernels.attention import AttentionImpl, AttentionSpec, attention, attention_mask

__all__ = ["AttentionImpl", "AttentionSpec", "attention", "attention_mask"]
