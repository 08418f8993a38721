"""Parallelism: the device mesh, sharded creation, shard_map attention and the memory planner.

The logical-axis rules themselves live in `modern_jax.sharding`.
"""

from modern_jax.parallel.distributed import initialize_distributed
from modern_jax.parallel.mesh import AXES, make_mesh, parse_mesh
from modern_jax.parallel.config import ParallelConfig
from modern_jax.parallel.create import create_sharded

__all__ = ["AXES", "ParallelConfig", "create_sharded", "initialize_distributed", "make_mesh", "parse_mesh"]
