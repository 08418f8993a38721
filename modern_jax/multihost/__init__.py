"""Many processes, one run: joining a launch (`distributed`), rehearsing one on one machine
(`launch`), and watching for a lost process (`watch`). How the arrays are split is
`modern_jax.sharding`'s.
"""

from modern_jax.multihost.distributed import initialize_distributed

__all__ = ["initialize_distributed"]
