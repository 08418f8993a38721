"""Logical axis names on activations.

Model code names logical axes only (`activation_batch`, `activation_embed`, ...);
`constrain` turns them into a sharding constraint when a mesh and a rules table
are active (`with logical_rules(mesh, rules):`), and does nothing otherwise, so
the same model runs on one CPU and on a pod slice.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.sharding import NamedSharding, PartitionSpec

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("modern_jax_logical_rules", default=None)


@contextlib.contextmanager
def logical_rules(mesh, rules):
    """Activate `rules` (a sequence of (logical name, mesh axes or None)) on `mesh`."""
    token = _ACTIVE.set((mesh, tuple(rules)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def logical_to_spec(axes, rules) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec; a mesh axis is used at most once."""
    table = dict(rules)
    used, out = set(), []
    for name in axes:
        mesh_axes = table.get(name) if name is not None else None
        if mesh_axes is None:
            out.append(None)
            continue
        group = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        group = tuple(a for a in group if a not in used)
        used.update(group)
        out.append(group if len(group) > 1 else (group[0] if group else None))
    return PartitionSpec(*out)


def constrain(x, axes):
    """Constrain the activation `x` to the logical `axes` under the active rules."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes, rules)))
