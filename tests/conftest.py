"""Test setup: 8 host CPU devices for the multi-device tests (set before jax is imported)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax

jax.config.update("jax_numpy_rank_promotion", "raise")  # a silent broadcast of mismatched ranks is a bug
