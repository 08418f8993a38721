"""Parallelism, below the layers: how arrays and computation are split over the devices.

| module        | what                                                                              |
|---------------|-----------------------------------------------------------------------------------|
| `mesh.py`     | the device mesh: axes `data`, `fsdp`, `expert`, `context`, `tensor`                 |
| `rules.py`    | the logical-axis rules table and the specs and shardings it gives                  |
| `config.py`   | the run's `parallel:` section: mesh sizes, rule overrides, the axes' strategies, the context layout |
| `context.py`  | the active mesh, rules and strategies that `constrain` and the ops read             |
| `sequence.py` | sequence parallelism: the tensor-parallel regions and the residual stream's split  |
| `devices.py`  | the devices compiled for: the platform, TPU chips and topologies, abstract GPUs   |
| `create.py`   | NNX objects created already sharded                                                 |

The ops (`modern_jax.ops`) implement the strategies; a layer calls an op or `region` and
passes no parallel choice. Many processes (pod slices, GPU clusters) are `modern_jax.multihost`'s.
"""

from modern_jax.sharding.config import ParallelConfig, Strategies
from modern_jax.sharding.context import active, constrain, logical_rules, strategies
from modern_jax.sharding.create import create_sharded
from modern_jax.sharding.mesh import AXES, make_mesh, parse_mesh
from modern_jax.sharding.rules import RULES, check_mesh, logical_to_spec, mesh_axes, state_shardings

__all__ = ["AXES", "RULES", "ParallelConfig", "Strategies", "active", "check_mesh", "constrain", "create_sharded",
           "logical_rules", "logical_to_spec", "make_mesh", "mesh_axes", "parse_mesh", "state_shardings", "strategies"]
