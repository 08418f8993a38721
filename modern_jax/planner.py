"""The memory planner: compile the training step ahead of time and read XLA's memory analysis.

No accelerator is needed: the step is compiled for a mesh of host CPU devices of the
requested shape (`--xla_force_host_platform_device_count`), from abstract arrays, so
nothing is allocated. Parameter and optimizer bytes per device are exact (the shards the
rules give); the temporary bytes (activations kept for the backward pass plus scratch)
come from XLA:CPU's buffer assignment of the same partitioned program, an estimate of
what a GPU or TPU compile would need (their fusions and layouts differ).
"""

from __future__ import annotations

import math

GiB = 1024**3


def shard_bytes(abstract_tree) -> int:
    """Bytes of one device's shards of a tree of ShapeDtypeStructs with shardings."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def plan(run, mesh_sizes: dict, hbm_gib: float | None = None) -> dict:
    """Per-device memory of one training step of `run` (a RunConfig) on a mesh of `mesh_sizes`."""
    import jax

    from modern_jax.parallel.mesh import make_mesh
    from modern_jax.training.loop import _check_divisible
    from modern_jax.training.step import Trainer

    n = math.prod(v for v in mesh_sizes.values() if v > 0)
    mesh = make_mesh(**mesh_sizes, devices=jax.devices()[: n if -1 not in mesh_sizes.values() else None])
    _check_divisible("batch_size / grad_accum", run.train.batch_size // run.train.grad_accum, mesh)  # as in train
    trainer = Trainer(run.model, run.train, mesh, rules=run.parallel.rules_table())
    state = trainer.abstract_state()
    cfg = run.train
    A = cfg.grad_accum
    rows = cfg.batch_size // A
    batch = {key: jax.ShapeDtypeStruct((A, rows, cfg.seq_len), jax.numpy.float32 if key == "weights" else jax.numpy.int32,
                                       sharding=trainer.batch_sharding)
             for key in ("inputs", "targets", "positions", "segment_ids", "weights")}
    compiled = trainer.lower("train", state, batch).compile()
    analysis = compiled.memory_analysis()
    out = {
        "mesh": dict(mesh.shape),
        "devices": mesh.size,
        "parameters": shard_bytes(state["params"]),
        "optimizer": shard_bytes(state["opt_state"]),
        "batch": shard_bytes(batch),
        "arguments": analysis.argument_size_in_bytes,
        "outputs": analysis.output_size_in_bytes,
        "aliased": analysis.alias_size_in_bytes,
        "temporaries": analysis.temp_size_in_bytes,
    }
    out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
    if hbm_gib is not None:
        out["hbm"] = int(hbm_gib * GiB)
        out["fits"] = out["peak"] <= out["hbm"]
    return out


def format_plan(result: dict) -> str:
    mesh = ", ".join(f"{k}={v}" for k, v in result["mesh"].items())
    lines = [f"mesh: {mesh} ({result['devices']} devices)", "per device:"]
    for key, label in (("parameters", "parameters"), ("optimizer", "optimizer state"), ("batch", "batch"),
                       ("temporaries", "activations + temporaries (XLA)"), ("peak", "peak (arguments + outputs "
                                                                                       "- donated + temporaries)")):
        lines.append(f"  {label}: {result[key] / GiB:.2f} GiB ({result[key]} B)")
    if "hbm" in result:
        verdict = "fits" if result["fits"] else "does NOT fit"
        lines.append(f"{verdict} in {result['hbm'] / GiB:.0f} GiB of device memory")
    return "\n".join(lines)
