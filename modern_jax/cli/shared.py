"""What more than one command uses: the checks of flags, the flags of a launch of many processes,
notes on stderr, a checkpoint's tokenizer and scoring Trainer, and the compilation cache."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import warnings


def _check_flags(args, *checks) -> None:
    """`(flag, ok, expected)`: each given flag's value must pass `ok`, else a message naming the flag."""
    for flag, ok, expected in checks:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None and not ok(value):
            raise ValueError(f"{flag} {value} is invalid: expected {expected}")


def _positive(flag: str):
    return flag, lambda v: v >= 1, "a positive integer"


def _overrides(parser: argparse.ArgumentParser, example: str) -> None:
    """A config's dotted `section.key=value` overrides, which may come in any order among the options
    (`parse_args`)."""
    parser.add_argument("overrides", nargs="*", help=f"dotted overrides, e.g. {example}")


COMPUTING = ("train", "evaluate", "generate", "harness", "plan", "convert")  # the commands that join a launch


def _launch_flags(sub: argparse.ArgumentParser) -> None:
    """How a command joins the other processes of a launch (each is found by itself under srun,
    mpirun or a Cloud TPU pod slice's workers)."""
    group = sub.add_argument_group("many processes (found from the launcher's environment when not given)")
    group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (JAX_COORDINATOR_ADDRESS)")
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the launch (JAX_NUM_PROCESSES)")
    group.add_argument("--process-id", type=int, metavar="I", help="this process's id, 0 to N-1 (JAX_PROCESS_ID)")
    group.add_argument("--heartbeat-timeout", type=float, default=60.0, metavar="SECONDS",
                       help="a process silent this long is lost, and the others stop with its name (default 60)")
    group.add_argument("--join-timeout", type=float, default=120.0, metavar="SECONDS",
                       help="how long the processes wait for each other to start, before saying which could not "
                            "join (default 120)")


def _note(message: str) -> None:
    """Progress for the user on stderr, so stdout keeps only the command's result."""
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _warnings_as_notes(quiet: bool = False):
    """The library's warnings (a request it shortens, a context it runs past) as one line each on
    stderr (`quiet`: none, on the processes of a launch other than 0)."""
    with warnings.catch_warnings():
        show = warnings.showwarning

        def note(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, UserWarning):
                if not quiet:
                    _note(str(message))
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = note
        yield


def _checkpoint_tokenizer(run_dir, cfg):
    """The run's tokenizer.json, a converted checkpoint's hf/tokenizer.json, else bytes (if the
    model has room for their ids)."""
    from modern_jax.convert.conversions import checkpoint_tokenizer
    from modern_jax.data.tokenizers import TOKENIZER_FILE, ByteTokenizer

    tokenizer = checkpoint_tokenizer(run_dir)
    if tokenizer is None:
        if cfg.vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(f"no {TOKENIZER_FILE} in {run_dir} (nor in its hf/), and the byte tokenizer's "
                             f"{ByteTokenizer.vocab_size} ids do not fit the model's vocab_size={cfg.vocab_size}: "
                             f"copy the tokenizer.json the model was trained with into {run_dir}")
        _note(f"no {TOKENIZER_FILE} in {run_dir}: using the byte tokenizer")
        return ByteTokenizer()
    return tokenizer


def _scoring_trainer(cfg, raw: dict, tc, objective=None):
    """The Trainer that evaluates or samples checkpoint `cfg` (its run config `raw`: its adapters)
    under `tc`: next-token scoring (or `objective`, the run's own objective's config), no optimiser,
    one device (in a launch of several processes every device, each process feeding its rows)."""
    import jax

    from modern_jax.data.config import DataConfig
    from modern_jax.lora_config import LoRAConfig
    from modern_jax.sharding.mesh import make_mesh
    from modern_jax.training import RunConfig, trainer_for

    run = RunConfig(cfg.to_dict(), tc, DataConfig(), lora=LoRAConfig.of_run(raw))
    if objective is not None:
        run = dataclasses.replace(run, objective=objective)
    mesh = make_mesh(data=-1, devices=jax.devices()[:1] if jax.process_count() == 1 else None)
    return trainer_for(run, mesh, optimizer=False)


COMPILE_CACHE_ENV = "MODERN_JAX_COMPILE_CACHE"
COMPILE_CACHE = "~/.cache/modern_jax/xla"


def _compile_cache() -> None:
    """The programs a command compiles kept on disk (jax's persistent compilation cache), so that
    the same command again (a resumed run, the benchmarks of another checkpoint of the same model)
    reads them instead of compiling: in MODERN_JAX_COMPILE_CACHE (`off`: none), by default
    ~/.cache/modern_jax/xla, least recently used entries removed past 4 GiB. A directory given to jax
    itself (JAX_COMPILATION_CACHE_DIR) is left as it is. (The planner keeps its own cache.) A named
    directory that cannot be made is refused; the default, noted and done without."""
    where = os.environ.get(COMPILE_CACHE_ENV, "").strip()
    if where == "off" or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    path = os.path.expanduser(where or COMPILE_CACHE)
    try:
        os.makedirs(path, exist_ok=True)
        reason = None if os.access(path, os.W_OK) else "not writable"
    except OSError as e:
        reason = e.strerror or type(e).__name__
    if reason is not None:
        if where:
            raise ValueError(f"{COMPILE_CACHE_ENV}={where}: compiled programs cannot be kept there ({reason}): "
                             f"give a writable directory, or off")
        _note(f"note: compiling without a cache: {path} cannot be made ({reason}); set {COMPILE_CACHE_ENV} to "
              f"a writable directory, or off")
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)  # a program worth reading back
    jax.config.update("jax_compilation_cache_max_size", 4 << 30)
