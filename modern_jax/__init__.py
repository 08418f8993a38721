"""modern_jax."""
