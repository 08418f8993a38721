"""Benchmark the mixture-of-experts dispatches against a dense FFN of equal active parameters.

    uv run python scripts/bench_moe.py            # the default shapes
    uv run python scripts/bench_moe.py --small    # a quick run
    uv run python scripts/bench_moe.py --sharded  # + expert parallelism on 8 host CPU devices

One MoE layer (E experts, k per token, expert width F) forward + backward, jitted, timed
side by side in one run with a dense gated FFN of width k F (the same active parameters
and matmul FLOPs per token), on the same tokens:

- `dense`: every expert on every token (the oracle): E / k times the dense FFN's FLOPs;
- `grouped`: dropless, sorted tokens and `jax.lax.ragged_dot` per projection. On TPU / GPU
  XLA lowers it to grouped GEMMs; XLA:CPU masks it, so on CPU it costs about as much as
  `dense` (E times the useful work), which this table shows;
- `capacity`: per-expert slots (factor 1.25), batched matmuls over `[E, C, D]`: about
  `factor` times the dense FFN's FLOPs, plus the sort and the scatter / gather.

The figures are tokens/s and the ratio to the dense FFN (higher is better).

`--sharded` adds the expert-parallel exchanges on a mesh data=2 x expert=4 (on CPU: 8 host
devices sharing the machine's cores, so it shows the exchanges' overhead, not a speed-up):
`all_to_all` (tokens swapped with their experts' devices) and `all_gather` (the expert
group's tokens gathered, the outputs reduce-scattered), against the unsharded grouped
dispatch on the same devices (data=8).
"""

from __future__ import annotations

import argparse
import os
import sys

if "--sharded" in sys.argv:  # before jax is imported
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from modern_jax import execution
from modern_jax.execution import ExecutionConfig
from modern_jax.config import ModelConfig
from modern_jax.layers.ffn import FFN
from modern_jax.layers.moe import MoE
from modern_jax.sharding.mesh import make_mesh
from modern_jax.report import median_seconds
from modern_jax.sharding import Strategies, logical_rules, state_shardings


def step_seconds(layer, x, repeats: int, mesh=None, run: ExecutionConfig = ExecutionConfig(),
                 strategies: Strategies | None = None) -> float:
    graphdef, state = nnx.split(layer)

    def loss(state, x):
        y, _ = nnx.capture(nnx.merge(graphdef, state), nnx.Intermediate)(x)
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    step = jax.jit(jax.value_and_grad(loss))
    if mesh is None:
        with execution.use(run):
            return median_seconds(step, state, x, repeats=repeats)
    state = jax.device_put(state, state_shardings(state, mesh))
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp", "expert"))))
    with logical_rules(mesh, strategies=strategies), execution.use(run):
        return median_seconds(step, state, x, repeats=repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="a quick run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sharded", action="store_true", help="also expert parallelism on 8 host devices")
    args = parser.parse_args()
    B, T, D, E, K, F = (8, 64, 128, 8, 2, 128) if args.small else (8, 256, 256, 8, 2, 256)
    print(f"{jax.devices()[0].device_kind}: B={B} T={T} D={D}, E={E} experts, k={K}, expert width F={F}; "
          f"dense FFN width k F = {K * F}; forward + backward, median of {args.repeats}\n")
    base = ModelConfig(d_model=D, n_heads=4, ffn_type="moe", n_experts=E, experts_per_token=K, expert_d_ff=F)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, D)), jnp.float32)
    dense_ffn = FFN(ModelConfig(d_model=D, n_heads=4, d_ff=K * F), rngs=nnx.Rngs(0))
    reference = step_seconds(dense_ffn, x, args.repeats)
    rows = [("dense FFN, width k F", reference)]
    for kind, changes in (("dense (every expert, every token)", dict(moe_dispatch="dense")),
                          ("grouped (ragged_dot, dropless)", dict(moe_dispatch="grouped")),
                          ("capacity (factor 1.25)", dict(moe_dispatch="capacity", moe_capacity_factor=1.25))):
        rows.append((kind, step_seconds(MoE(base, rngs=nnx.Rngs(0)), x, args.repeats, run=ExecutionConfig(**changes))))
    if args.sharded:
        moe = MoE(base, rngs=nnx.Rngs(0))
        unsharded = step_seconds(moe, x, args.repeats, make_mesh(data=8))
        rows.append(("grouped, data=8 (experts replicated)", unsharded))
        for exchange in ("all_to_all", "all_gather"):
            rows.append((f"{exchange}, data=2 x expert=4", step_seconds(
                moe, x, args.repeats, make_mesh(data=2, expert=4), strategies=Strategies(moe_exchange=exchange))))
    print("| FFN | ms | tokens/s | vs dense FFN |")
    print("|---|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e3:.1f} | {B * T / seconds:,.0f} | {reference / seconds:.2f}x |")


if __name__ == "__main__":
    main()
