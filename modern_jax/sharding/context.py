"""The active mesh, rules and strategies: what the ops read, so a layer passes no parallel choice.

    with logical_rules(mesh, rules, parallel_config):   # the Trainer, generate, the planner
        model(tokens)          # constrain(), the ops' shard_map and their strategies follow the mesh

Outside any, `active()` is None: `constrain` does nothing and every op runs as on one device.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.sharding import NamedSharding

from modern_jax.execution import scoped
from modern_jax.sharding.config import Strategies
from modern_jax.sharding.rules import RULES, logical_to_spec

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("modern_jax_logical_rules", default=None)
_STRATEGIES: contextvars.ContextVar = contextvars.ContextVar("modern_jax_strategies", default=Strategies())


@contextlib.contextmanager
def logical_rules(mesh, rules=RULES, strategies: Strategies | None = None):
    """Activate `rules` (a sequence of (logical name, mesh axes or None)) on `mesh`, with the
    axes' `strategies` (a `Strategies` or the run's `ParallelConfig`; None: the defaults)."""
    with scoped(_ACTIVE, (mesh, tuple(rules))), scoped(_STRATEGIES, strategies or Strategies()):
        yield


def active():
    """The active `(mesh, rules)`, or None."""
    return _ACTIVE.get()


def strategies() -> Strategies:
    """The active strategies of the context and expert axes (the defaults outside `logical_rules`)."""
    return _STRATEGIES.get()


def constrain(x, axes):
    """Constrain the activation `x` to the logical `axes` under the active rules."""
    state = _ACTIVE.get()
    if state is None:
        return x
    mesh, rules = state
    spec = logical_to_spec(axes, rules, mesh, x.shape, where="activation")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
