"""Test setup: 8 host CPU devices for the multi-device tests (set before jax is imported).

The device count is forced to 8 whatever `XLA_FLAGS` the environment brings (its other flags
are kept), and a run that still sees fewer than 8 devices stops with an error: the sharded
tests never turn into skips."""

import os
import re
import sys

# jax reads JAX_PLATFORMS and its compilation cache's settings when it is imported: set below
if "jax" in sys.modules:
    raise RuntimeError("jax was imported before tests/conftest.py set its environment (the platform, the "
                       "compilation cache): keep what pytest loads first (pyproject.toml's filterwarnings "
                       "categories, plugins) free of jax")

DEVICES = 8
_COUNT = "--xla_force_host_platform_device_count"
_LEVEL = "--xla_backend_optimization_level"
_flags = re.sub(rf"{_COUNT}=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
# Every program the tests compile is tiny: LLVM's optimisation of XLA:CPU's code takes longer
# than the code then runs, so the suite compiles at level 0 unless XLA_FLAGS sets a level (about
# 0.6x the time of tests/test_model.py; the commands the tests start inherit it). XLA's default
# level is checked by tests/test_parallel.py::test_training_step_matches_single_device.
if not any(flag.startswith(_LEVEL) for flag in _flags):
    _flags.append(f"{_LEVEL}=0")
os.environ["XLA_FLAGS"] = " ".join([*_flags, f"{_COUNT}={DEVICES}"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole run, made here (in the process that starts the
# workers) and removed at its end: the two workers, and every command a test starts (the CLI,
# the many-process launches), compile the same small programs again and again.
_CACHE = None
if "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="modern_jax-tests-cache-")
    # the planner's cache of TPU compiles likewise: the run's own, never the user's
    os.environ["MODERN_JAX_PLAN_CACHE"] = os.path.join(_CACHE, "plan")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")  # a silent broadcast of mismatched ranks is a bug


import gc  # noqa: E402

import pytest  # noqa: E402


# the longest tests (many processes, random kills) start first, so that the two workers do not
# end with one of them running one alone
FIRST = ("tests/test_multihost.py::", "tests/test_reliability_checkpoints.py::test_random_sigkills",
         "tests/test_speed.py::test_the_counted_step", "tests/test_speed.py::test_a_pipelined_step_counted",
         "tests/test_grpo.py::test_two_processes", "tests/test_post_training.py::test_the_lora_qlora_and_dpo",
         "tests/test_pipeline.py::test_cli_pipelined_runs", "tests/test_grpo.py::test_the_reinforcement_learning")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))  # stable: the rest keep their order


def pytest_unconfigure(config):
    if _CACHE is not None:
        import shutil

        shutil.rmtree(_CACHE, ignore_errors=True)


def pytest_configure(config):
    if len(jax.devices()) < DEVICES:
        raise pytest.UsageError(
            f"the tests need {DEVICES} devices, JAX sees {len(jax.devices())} ({jax.devices()[0].platform}): run them "
            f"on the host CPU (JAX_PLATFORMS=cpu; tests/conftest.py sets {_COUNT}={DEVICES} in XLA_FLAGS)")


@pytest.fixture(autouse=True, scope="module")
def _fresh_compilations():
    """Each test file starts without the previous files' compiled programs: the suite's memory
    stays that of one file, not of all of them."""
    yield
    from modern_jax.training import programs

    programs._EXECUTABLES.clear()
    jax.clear_caches()
    gc.collect()
