"""The memory planner: compile the training step ahead of time and read XLA's memory analysis.

No accelerator is needed. With a TPU topology (`topology="v5p:2x2x2"`, libtpu) the step
is compiled by the TPU compiler for that topology's chips, with the kernels the dispatch
picks for them (Pallas TPU attention and norm): its memory analysis is the chip's own.
Without one, the step is compiled for a mesh of host CPU devices of the requested shape
(`--xla_force_host_platform_device_count`): parameter and optimizer bytes are still exact
(the shards the rules give), but the temporaries (activations kept for the backward pass
plus scratch) come from XLA:CPU's buffer assignment, an estimate of an accelerator's
(their fusions, layouts and kernels differ: within -1% to +5% of the TPU compiler's in the
README's table); with no `execution.attention_impl` named, the host estimate runs the
`chunked` attention, whose O(T) memory is the flash kernels'. Either way the arrays are
abstract: nothing is allocated.
"""

from __future__ import annotations

import math
import re

GiB = 1024**3


def shard_bytes(abstract_tree) -> int:
    """Bytes of one device's shards of a tree of ShapeDtypeStructs with shardings."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def plan(run, mesh_sizes: dict, hbm_gib: float | None = None, topology: str | None = None, slices: int = 1) -> dict:
    """Per-device memory of one training step of `run` (a RunConfig) on a mesh of `mesh_sizes`,
    of host CPU devices or of the chips of TPU `topology` (over `slices` slices)."""
    import jax

    from modern_jax.kernels.backend import recording_kernels
    from modern_jax.sharding.mesh import make_mesh
    from modern_jax.sharding.targets import chip, topology_devices
    from modern_jax.training.step import Trainer

    if topology is not None:
        devices = topology_devices(topology, slices)
    else:
        n = math.prod(v for v in mesh_sizes.values() if v > 0)
        devices = jax.devices()[: n if -1 not in mesh_sizes.values() else None]
    mesh = make_mesh(**mesh_sizes, devices=devices)
    execution = run.execution
    if topology is None and execution.attention_impl == "default":  # host devices stand in for accelerators:
        execution = execution.replace(attention_impl="chunked")  # O(T) attention, as the flash kernels are
    trainer = Trainer(run.model, run.train, mesh, rules=run.parallel.rules_table(),
                      context_layout=run.parallel.context_layout, strategies=run.parallel,
                      execution=execution, lora=run.lora)
    state = trainer.abstract_state()
    batch = trainer.abstract_batch()
    with recording_kernels() as kernels:
        lowered = trainer.lower("train", state, batch)
    try:
        analysis = lowered.compile().memory_analysis()
    except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program that cannot fit HBM
        oom = _HBM_OOM.search(str(e))
        if oom is None:
            raise
        analysis = None
    kind = mesh.devices.flat[0].device_kind
    if topology is not None and chip(devices) is not None:
        kind = f"{kind} ({chip(devices).name})"
    out = {
        "mesh": dict(mesh.shape),
        "devices": mesh.size,
        "device_kind": kind,
        "compiler": "TPU" if topology is not None else "XLA:CPU (estimate)",
        "kernels": {name: sorted(impls) for name, impls in sorted(kernels.items())},
        "parameters": shard_bytes(state["params"]),
        "optimizer": shard_bytes(state["opt_state"]),
        "batch": shard_bytes(batch),
    }
    if hbm_gib is None and topology is not None and chip(devices) is not None:
        hbm_gib = chip(devices).hbm_gib
    if analysis is None:  # the compiler's count of all it needed (arguments included) when it stopped
        out.update(temporaries=None, peak=_bytes(*oom.group(1, 2)), hbm=_bytes(*oom.group(3, 4)), fits=False,
                   compiler_refused=True)
        return out
    out.update(arguments=analysis.argument_size_in_bytes, outputs=analysis.output_size_in_bytes,
               aliased=analysis.alias_size_in_bytes, temporaries=analysis.temp_size_in_bytes)
    out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
    if hbm_gib is not None:
        out["hbm"] = int(hbm_gib * GiB)
        out["fits"] = out["peak"] <= out["hbm"]
    return out


# XLA's CompileTimeHbmOom ("the total memory required for HLO temporaries (211.22G) exceeds available HBM
# (95.73G)": the total includes the arguments), its sizes in binary units ("147.98G", "2.74T")
_SIZE = r"([\d.]+)([KMGTP]?)B?"
_HBM_OOM = re.compile(rf"CompileTimeHbmOom: .*?HLO temporaries \({_SIZE}\) exceeds available HBM \({_SIZE}\)")


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * 1024 ** ("KMGTP".index(unit) + 1 if unit else 0))


def format_plan(result: dict) -> str:
    mesh = ", ".join(f"{k}={v}" for k, v in result["mesh"].items())
    lines = [f"device: {result['device_kind']} (compiled by {result['compiler']})",
             f"mesh: {mesh} ({result['devices']} devices)"]
    lines += [f"{name}: {', '.join(impls)}" for name, impls in result["kernels"].items()]
    lines.append("per device:")
    for key, label in (("parameters", "parameters"), ("optimizer", "optimizer state"), ("batch", "batch"),
                       ("temporaries", "activations + temporaries (XLA)"), ("peak", "peak (arguments + outputs "
                                                                                       "- donated + temporaries)")):
        if result.get("compiler_refused") and key == "peak":
            lines.append(f"  {label}: {result[key] / GiB:.2f} GiB by the compiler's count, more than the chip's "
                         f"{result['hbm'] / GiB:.2f} GiB (it stopped there; no temporaries reported)")
        elif result[key] is not None:
            lines.append(f"  {label}: {result[key] / GiB:.2f} GiB ({result[key]} B)")
    if "hbm" in result:
        verdict = "fits" if result["fits"] else "does NOT fit"
        lines.append(f"{verdict} in {result['hbm'] / GiB:.0f} GiB of device memory")
    return "\n".join(lines)
