"""Create NNX objects already sharded: no full copy on one device at init."""

from __future__ import annotations

import jax
from flax import nnx

from modern_jax.sharding.rules import RULES, state_shardings


def create_sharded(factory, mesh, rules=RULES):
    """Build `factory()` (a Module, or a tuple of them) with every array born sharded.

    The abstract object (`nnx.eval_shape`) gives the logical axes of every Variable;
    the initialiser is then jitted with those shardings as its outputs, so each device
    only ever materialises its own shards.
    """
    graphdef, abstract_state = nnx.split(nnx.eval_shape(factory))
    shardings = state_shardings(abstract_state, mesh, rules)
    state = jax.jit(lambda: nnx.split(factory())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)
