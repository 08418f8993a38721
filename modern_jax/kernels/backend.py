"""Where kernels run: the platform, Pallas interpret mode, and the error for a choice that cannot run.

Pallas kernels lower for one platform (the Triton lowering for GPU, Mosaic for TPU).
Interpret mode runs the same kernel bodies as plain JAX on any backend, slowly; the
tests use it to check every kernel against the reference on CPU. Turn it on with

    MODERN_JAX_PALLAS_INTERPRET=1        # or =gpu / =tpu, see below
    with pallas_interpret():             # or pallas_interpret("tpu")
        ...

Both are read when a function is traced, not when a jitted function runs: enter the
context before the first call of a jitted function (or clear its cache). The value names
the platform whose kernels an implementation that has one per platform (`norm_impl=
"pallas"`) interprets; `1` means `gpu`. Attention names its kernel (`pallas_gpu`,
`pallas_tpu`), so any value lets both run. Interpret mode never changes what `default`
resolves to.

The platform is the one the computation is compiled for, not the host's
(`sharding.devices.platform`: inside `compiling_for(mesh)` that mesh's devices' platform).
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax

from modern_jax.execution import scoped
from modern_jax.sharding.devices import platform

INTERPRET_ENV = "MODERN_JAX_PALLAS_INTERPRET"
_INTERPRET: contextvars.ContextVar[str | None] = contextvars.ContextVar("modern_jax_pallas_interpret", default=None)
_OFF = ("", "0", "false", "no", "off")
_SEEN: contextvars.ContextVar[tuple] = contextvars.ContextVar("modern_jax_resolved_kernels", default=())


class UnsupportedFeatureError(ValueError):
    """An explicitly requested kernel implementation cannot run this call."""


@contextlib.contextmanager
def pallas_interpret(target: str | bool = "gpu"):
    """Run Pallas kernels in interpret mode inside the block (`target`: gpu, tpu, or False to disable)."""
    value = "" if target is False else ("gpu" if target is True else str(target))
    if value not in ("", "gpu", "tpu"):
        raise ValueError(f"pallas_interpret target must be 'gpu', 'tpu' or False, got {target!r}")
    with scoped(_INTERPRET, value):
        yield


def interpret_target() -> str | None:
    """The platform interpret mode stands in for ('gpu' or 'tpu'), or None when it is off."""
    value = _INTERPRET.get()
    if value is None:
        value = os.environ.get(INTERPRET_ENV, "").strip().lower()
    if value in _OFF:
        return None
    if value in ("1", "true", "yes", "on", "gpu"):
        return "gpu"
    if value == "tpu":
        return "tpu"
    raise ValueError(f"{INTERPRET_ENV}={value!r}: expected 1, gpu, tpu or 0")


@contextlib.contextmanager
def recording_kernels():
    """Collect, while tracing inside the block, the implementation each dispatch resolved:
    yields a dict `{"attention": {"pallas_tpu"}, "norm": {"pallas"}, ...}` (nested recordings
    each see everything)."""
    seen: dict[str, set[str]] = {}
    with scoped(_SEEN, _SEEN.get() + (seen,)):
        yield seen


def note_kernel(kind: str, impl: str) -> None:
    """Record that a `kind` dispatch (attention, norm, moe_grouped) resolved to `impl`."""
    for seen in _SEEN.get():
        seen.setdefault(kind, set()).add(str(impl))


def pallas_platform() -> str | None:
    """The platform whose Pallas kernels run here: the device's, or the interpreted one."""
    target = interpret_target()
    if target is not None:
        return target
    return platform() if platform() in ("gpu", "tpu") else None


def can_run_pallas(kernel_platform: str) -> str | None:
    """None if a kernel written for `kernel_platform` can run here, else what is missing."""
    if interpret_target() is not None or platform() == kernel_platform:
        return None
    return (f"a {kernel_platform.upper()} (this computation is compiled for {platform()!r}; on CPU set "
            f"{INTERPRET_ENV}=1 or use kernels.pallas_interpret() to run it in interpret mode)")


def varying_axes(*trees) -> tuple[str, ...]:
    """The mesh axes any leaf of `trees` varies over inside `shard_map` (empty outside)."""
    axes = set()
    for leaf in jax.tree.leaves(trees):
        manual = getattr(jax.typeof(leaf), "manual_axis_type", None)
        axes |= set(getattr(manual, "varying", ()))
    return tuple(sorted(axes))


def vary_over(tree, axes: tuple[str, ...]):
    """Type every leaf of `tree` as varying over `axes` (no-op when empty).

    Kernels mix their inputs, so inside `shard_map` their outputs vary over the union of
    the inputs' axes. Casting the inputs first gives a custom_vjp consistent types, and the
    transpose of the cast sums the gradient of a replicated input (e.g. sinks shared by
    the batch shards) over the devices that used it.
    """

    def cast(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree) if axes else tree


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """A `pallas_call` output that varies over the mesh axes `like` varies over (inside shard_map)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


_COSTS: contextvars.ContextVar[bool] = contextvars.ContextVar("modern_jax_kernel_costs", default=True)


@contextlib.contextmanager
def declaring_costs(on: bool):
    """Inside, the Pallas kernels declare their costs to the compiler (`kernels.costs`) or, off,
    leave them opaque: costed by their operands' and results' bytes only. Read while tracing."""
    with scoped(_COSTS, on):
        yield


def costs_declared() -> bool:
    """Whether the kernels traced now declare their costs (`declaring_costs`)."""
    return _COSTS.get()
