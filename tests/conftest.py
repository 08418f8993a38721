"""Test setup: 8 host CPU devices for the multi-device tests (set before jax is imported)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax

jax.config.update("jax_numpy_rank_promotion", "raise")  # a silent broadcast of mismatched ranks is a bug


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _fresh_compilations():
    """Each test file starts without the previous files' compiled programs: the suite's memory
    stays that of one file, not of all of them."""
    yield
    from modern_jax.training import step

    step._EXECUTABLES.clear()
    jax.clear_caches()
    gc.collect()
