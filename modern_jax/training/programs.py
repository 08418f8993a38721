"""Programs compiled for one mesh: what the Trainer, the objectives, the planner and the harness
compile and run.

    on_mesh = Programs(mesh, rules, strategies, execution)
    on_mesh.define("train", step_fn, in_shardings=..., donate_argnums=(0,))
    on_mesh.run("train", state, batch)           # compiled once per argument shapes, on first use
    on_mesh.program("harness_score", fn, *args)  # an ad-hoc program, once per name and argument types
    on_mesh.lower("train", *abstract, platform="tpu")  # lowered only (the planner's)

Every program is traced and lowered under the run's rules, strategies and execution choices
(kernels, dispatch, remat), so a layer's ops read them from the active context; the kernels
each dispatch resolved to are recorded (`kernels`). An executable is shared by every Programs
whose lowered program is the same text, so two objects that compile the same step compile it
once a process; jax's persistent cache (`cli.shared`) keeps them across processes.
"""

from __future__ import annotations

import contextlib
import hashlib

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from modern_jax.execution import ExecutionConfig
from modern_jax.execution import use as use_execution
from modern_jax.kernels.backend import recording_kernels
from modern_jax.sharding import RULES, Strategies, logical_rules
from modern_jax.sharding.devices import compiling_for, lowering_for
from modern_jax.sharding.rules import split_size
from modern_jax.training.placement import rows_sharding

# XLA options for the compiled programs (over those of XLA_FLAGS). Programs named in `ONCE` compile
# at level 0: they run once.
COMPILER_OPTIONS: dict = {}
ONCE = ("init",)
_EXECUTABLES: dict = {}  # compiled programs shared by every Programs whose lowered programs are identical


class Programs:
    """The programs of one (mesh, rules, strategies, execution): defined by name, lowered, compiled
    once per lowered text and run (the module docstring)."""

    def __init__(self, mesh: Mesh, rules=RULES, strategies: Strategies | None = None,
                 execution: ExecutionConfig | None = None):
        self.mesh, self.rules = mesh, tuple(rules)
        self.strategies, self.execution = strategies or Strategies(), execution or ExecutionConfig()
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.kernels: dict[str, set[str]] = {}  # what each dispatch resolved to, as the programs were traced
        self.compilations: dict[str, int] = {}  # programs compiled here, per name
        self._jitted: dict = {}
        self._by_shapes: dict = {}  # `run`'s executables, per name and argument shapes (a GRPO batch's widths)
        self._by_arguments: dict = {}  # `program`'s executables, per name and argument types

    @property
    def stages(self) -> int:
        """The pipeline stages of the mesh (1: none)."""
        return self.mesh.shape.get("stage", 1)

    @property
    def data_shards(self) -> int:
        """How many ways a batch's rows split (`activation_batch`)."""
        return split_size("activation_batch", self.mesh, self.rules)

    def rows(self, ndim: int, rows_axis: int = 1) -> NamedSharding:
        """The sharding of an `ndim`-axis array whose axis `rows_axis` holds a batch's rows."""
        return rows_sharding(self.mesh, self.rules, ndim, rows_axis)

    def define(self, name: str, fn, **jit_options) -> None:
        """Name `jax.jit(fn, **jit_options)` (the first definition of a name stays)."""
        self._jitted.setdefault(name, jax.jit(fn, **jit_options))

    def lower(self, name: str, *args, platform: str | None = None):
        """Trace and lower program `name` for the mesh's devices (their platform picks the kernels),
        or for `platform` ('cuda', 'tpu') with no such device here (lowered only: compile it with that
        platform's compiler); on a multi-device mesh the rules shape every activation."""
        program = self._jitted[name]
        with compiling_for(platform or self.mesh), use_execution(self.execution), recording_kernels() as seen, \
                contextlib.ExitStack() as stack:
            stack.callback(lambda: [self.kernels.setdefault(k, set()).update(v) for k, v in seen.items()])
            if self.mesh.size > 1:
                stack.enter_context(logical_rules(self.mesh, self.rules, self.strategies))
            if platform is None:
                return program.lower(*args)
            if platform == "cuda":  # the Triton lowering asks for a GPU: name one (an H100; the IR is the same)
                stack.enter_context(lowering_for("sm_90a", self.mesh))
            return program.trace(*args).lower(lowering_platforms=(platform,))

    def compile(self, name: str, *args):
        """Program `name` compiled for these arguments (abstract ones will do), without running it;
        `run` runs it for arguments of these shapes (its `memory_analysis()` is XLA's count)."""
        options = {"xla_backend_optimization_level": 0} if name in ONCE else COMPILER_OPTIONS
        lowered = self.lower(name, *args)
        key = (hashlib.sha256(lowered.as_text().encode()).hexdigest(), tuple(sorted(options.items())))
        if key not in _EXECUTABLES:
            _EXECUTABLES[key] = lowered.compile(compiler_options=dict(options) or None)
            self.compilations[name] = self.compilations.get(name, 0) + 1
        self._by_shapes[(name, _shapes(args))] = _EXECUTABLES[key]
        return _EXECUTABLES[key]

    def run(self, name: str, *args):
        """Run program `name`, compiled once for each shape of its arguments, on first use (or
        by `compile`, which keeps what it makes for those shapes)."""
        executable = self._by_shapes.get((name, _shapes(args)))
        if executable is None:
            executable = self.compile(name, *args)
        return executable(*args)

    def program(self, name: str, fn, *args, out_shardings=None):
        """`fn(*args)` compiled for the mesh, once per `name` and argument types: an objective's own
        programs (GRPO's rollouts, one per prompt width) and the benchmarks' (`harness`);
        `out_shardings` as `jax.jit` takes them (None: as the compiler lays them out)."""
        leaves = jax.tree.leaves(args)
        key = (name, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
        if key not in self._by_arguments:
            self.define(name, fn, out_shardings=out_shardings)
            self._by_arguments[key] = self.compile(name, *args)
        return self._by_arguments[key](*args)

    def lower_program(self, name: str, fn, *args, platform: str | None = None):
        """`fn(*args)` lowered as `program` compiles it (abstract arguments will do): the planner's."""
        self.define(name, fn)
        return self.lower(name, *args, platform=platform)


def _shapes(args) -> tuple:
    """The shapes and dtypes of a program's arguments (what picks its executable)."""
    return tuple((tuple(x.shape), x.dtype) if hasattr(x, "shape") else x for x in jax.tree.leaves(args))


def programs_of(run, mesh: Mesh, execution: ExecutionConfig | None = None) -> Programs:
    """The programs of a run (a RunConfig) on `mesh`: its rules and strategies, and its execution
    choices (or `execution`'s: the planner's host estimate)."""
    return Programs(mesh, run.parallel.rules_table(), run.parallel, execution or run.execution)


def describe_kernels(kernels: dict[str, set[str]]) -> str:
    """`attention pallas_tpu, norm pallas, moe_grouped megablox`: what the dispatches chose."""
    return ", ".join(f"{kind} {'/'.join(sorted(impls))}" for kind, impls in sorted(kernels.items())) or "none"


__all__ = ["COMPILER_OPTIONS", "Programs", "describe_kernels", "programs_of"]
