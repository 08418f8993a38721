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

import fcntl
import hashlib
import json
import math
import os
import re
from pathlib import Path

GiB = 1024**3


def shard_bytes(abstract_tree) -> int:
    """Bytes of one device's shards of a tree of ShapeDtypeStructs with shardings."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def plan(run, mesh_sizes: dict, hbm_gib: float | None = None, topology: str | None = None, slices: int = 1,
         speed: bool = False, opaque_kernels_too: bool = True) -> dict:
    """Per-device memory of one training step of `run` (a RunConfig) on a mesh of `mesh_sizes`,
    of host CPU devices or of the chips of TPU `topology` (over `slices` slices); with `speed` (a
    topology only, when the step fits), the estimated step time too (`estimate_speed`; and with the
    kernels opaque too unless `opaque_kernels_too` is False)."""
    from modern_jax.kernels.backend import recording_kernels
    from modern_jax.sharding.devices import chip
    from modern_jax.training.trainer import trainer_for

    mesh, devices = _plan_mesh(mesh_sizes, topology, slices)
    execution = run.execution
    if topology is None and execution.attention_impl == "default":  # host devices stand in for accelerators:
        execution = execution.replace(attention_impl="chunked")  # O(T) attention, as the flash kernels are
    trainer = trainer_for(run, mesh, execution=execution)
    state = trainer.states.abstract()
    batch = trainer.batches.abstract(fields=trainer.objective.fields())
    with recording_kernels() as kernels:
        lowered = trainer.programs.lower("train", state, batch)
    memory = _memory(lowered, mesh, topology)
    out = {
        "mesh": dict(mesh.shape),
        "devices": mesh.size,
        "device_kind": _device_kind(mesh, devices, topology),
        "compiler": "TPU" if topology is not None else "XLA:CPU (estimate)",
        "kernels": {name: sorted(impls) for name, impls in sorted(kernels.items())},
        "parameters": shard_bytes(state["params"]),
        "optimizer": shard_bytes(state["opt_state"]),
        # the frozen copy an objective compares with (full-weight DPO's reference), if the state keeps one
        "reference": shard_bytes(state["reference"]) if "reference" in state else None,
        "batch": shard_bytes(batch),
    }
    if hbm_gib is None and topology is not None and chip(devices) is not None:
        hbm_gib = chip(devices).hbm_gib
    if "temporaries" not in memory:  # the compiler's count of all it needed (arguments included) when it stopped
        out.update(temporaries=None, peak=memory["peak"], hbm=memory["hbm"], fits=False, compiler_refused=True)
        return out
    out.update(memory)
    out["peak"] = _held(memory)
    _add_objective_programs(out, trainer, state, mesh, topology)
    if hbm_gib is not None:
        out["hbm"] = int(hbm_gib * GiB)
        out["fits"] = out["peak"] <= out["hbm"]
    if speed and topology is not None and out.get("fits", True):
        try:
            out["speed"] = estimate_speed(run, mesh, opaque_kernels_too=opaque_kernels_too)
        except CostModelFault as e:
            out["speed"] = {"unavailable": str(e)}
    return out


def _plan_mesh(mesh_sizes: dict, topology: str | None, slices: int):
    """`(mesh, devices)`: the mesh of `mesh_sizes` over the chips of TPU `topology`, or over this
    host's (CPU) devices."""
    import jax

    from modern_jax.sharding.devices import topology_devices
    from modern_jax.sharding.mesh import make_mesh

    if topology is not None:
        devices = topology_devices(topology, slices)
    else:
        n = math.prod(v for v in mesh_sizes.values() if v > 0)
        devices = jax.devices()[: n if -1 not in mesh_sizes.values() else None]
    return make_mesh(**mesh_sizes, devices=devices), devices


def _device_kind(mesh, devices, topology: str | None) -> str:
    """The mesh's device kind, with the chip's name for a TPU topology."""
    from modern_jax.sharding.devices import chip

    kind = mesh.devices.flat[0].device_kind
    if topology is not None and chip(devices) is not None:
        kind = f"{kind} ({chip(devices).name})"
    return kind


def _memory(lowered, mesh, topology: str | None) -> dict:
    """`_compile_memory` of a lowered program; for a TPU topology, remembered in the plan cache."""
    if topology is None:
        return _compile_memory(lowered)
    return _cached(_program_key(lowered, mesh, {"memory": True}), lambda: _compile_memory(lowered))


def _compile_memory(lowered) -> dict:
    """The compiled program's memory analysis (bytes of its arguments, outputs, aliased buffers and
    temporaries); or, when the TPU compiler refuses a program that cannot fit HBM, its `peak` and
    the `hbm` it had."""
    import jax

    try:
        analysis = lowered.compile().memory_analysis()
    except jax.errors.JaxRuntimeError as e:
        oom = _HBM_OOM.search(str(e))
        if oom is None:
            raise
        return {"peak": _bytes(*oom.group(1, 2)), "hbm": _bytes(*oom.group(3, 4))}
    return {"arguments": analysis.argument_size_in_bytes, "outputs": analysis.output_size_in_bytes,
            "aliased": analysis.alias_size_in_bytes, "temporaries": analysis.temp_size_in_bytes,
            # what a host-offload remat policy keeps in the host's pinned memory
            "host_temporaries": getattr(analysis, "host_temp_size_in_bytes", 0) or 0}


def _held(memory: dict) -> int:
    """The bytes a program holds at its peak (`_compile_memory`'s analysis)."""
    return memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temporaries"]


def _add_objective_programs(out: dict, trainer, state, mesh, topology: str | None) -> None:
    """An objective's own programs (GRPO's rollouts: the KV cache of a step's whole batch) run between
    the steps while the whole state stays in memory: each one's temporaries and peak into
    `out["programs"]`, and the plan's peak the larger."""
    from modern_jax.kernels.backend import recording_kernels

    resident = shard_bytes(state) - shard_bytes(state["params"])
    for name, (fn, args) in trainer.objective.programs(trainer, state["params"]).items():
        with recording_kernels():
            program = trainer.programs.lower_program(name, fn, *args)
        counted = _memory(program, mesh, topology)
        if "temporaries" not in counted:
            out.update(peak=max(out["peak"], counted["peak"] + resident), compiler_refused=True)
            continue
        peak = _held(counted) + resident
        out.setdefault("programs", {})[name] = {"temporaries": counted["temporaries"], "peak": peak}
        out["peak"] = max(out["peak"], peak)


# ----- speed ---------------------------------------------------------------------------------
#
# The TPU compiler's cost model (`compiled.cost_analysis()`: flops, bytes accessed and
# `optimal_seconds`, its roofline time of the step) counts a while loop's body once, whatever its
# trip count: the scanned layers, the loss's vocabulary chunks, the micro-batches and the
# compiler's own collective-matmul loops. The estimate therefore compiles counting programs with
# no loop at all (layers, chunks and micro-batches unrolled, windowed einsums off): every stack's
# unit twice (C), and for each stack that repeats more, its unit once more (C_s), extrapolated:
#
#     cost = C + sum over stacks s of (repeats_s - 2) (C_s - C)
#
# exact when a unit's cost does not depend on its neighbours (two units, not one, so the first and
# last layers' edges stay out of the step: within 0.01% of a whole unrolled program in the tests).
# Each is compiled twice: with the Pallas kernels declaring their costs (`kernels.costs`) and
# without (the compiler then sees their I/O bytes only). Sliced prefetches are off too: where
# the compiler copies a weight into on-chip memory in slices (v6e does, for layers as large as
# Llama 3 8B's; v5p does not), the cost model (libtpu 0.0.52) counts each `ConcatBitcast` that
# joins the slices as about -1 s, and a step's time comes out negative.
#
# A loop that carries a few bytes only is left in: megablox finds each tile's expert by a binary
# search over the experts' offsets (`jnp.searchsorted`, a while loop of about log2(E) trips on
# vectors of E), counted once instead of a few times, nanoseconds. A loop's body reads only what
# the loop carries (HLO has no closures), so one carrying at most `NEGLIGIBLE_LOOP_BYTES` cannot
# hide a cost that matters; any larger loop stops the estimate.

COUNTING_OPTIONS = {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                    "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
                    "xla_tpu_sliced_prefetch_max_slices": 0}
COST_KEYS = ("flops", "bytes accessed", "transcendentals", "optimal_seconds")
CACHE_ENV = "MODERN_JAX_PLAN_CACHE"
NEGLIGIBLE_LOOP_BYTES = 64 * 1024

_WHILE = re.compile(r"^\s*%?(\S+) = (\(.*?\)|\S+) while\((.*)$", re.M)
# an HLO array type: pred, or letters and the element's bits (s32, u8, bf16, f8e4m3fn, c64), and its dims
_ARRAY = re.compile(r"\b(pred|[a-z]+?(\d+)[a-z0-9]*)\[([\d,]*)\]")


def _shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (an array or a tuple of them): `(s32[], f32[8,128]{1,0})` is 4 + 4096."""
    return sum(math.prod(int(d) for d in dims.split(",") if d) * (int(bits) if bits else 8) // 8
               for _, bits, dims in _ARRAY.findall(shape))


def loops_that_count(hlo_text: str) -> list[str]:
    """The while loops of a compiled program that carry more than `NEGLIGIBLE_LOOP_BYTES` (whose
    body the cost model counting once would make the step's estimate wrong), by name and op."""
    found = []
    for name, shape, rest in _WHILE.findall(hlo_text):
        if (size := _shape_bytes(shape)) > NEGLIGIBLE_LOOP_BYTES:
            op = (re.findall(r'op_name="([^"]*)"', rest) or ["no op name"])[0]
            found.append(f"{name} ({op}, carrying {size:,} B)")
    return found


def counting_layers(cfg, start: int = 2) -> tuple[tuple, list[tuple[int, tuple]]]:
    """`(base, [(more, layers), ...])`: the layers of the counting program with every stack's unit
    `start` times (or as often as it repeats, if fewer), and for each stack that repeats more, the
    same with that unit once more, and how many more units the stack has than the base."""
    from modern_jax.model import plan_stages

    stages = plan_stages(cfg.layer_specs())
    counts = [min(repeats, start) for _, repeats in stages]
    layers = lambda extra: sum((unit * (n + (i == extra)) for i, ((unit, _), n) in enumerate(zip(stages, counts))),  # noqa: E731
                               ())
    return layers(None), [(repeats - n, layers(i)) for i, ((_, repeats), n) in enumerate(zip(stages, counts))
                          if repeats > n]


def _cache_path() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                     "modern_jax")
    return Path(root) / "plan_costs.json"


def _cached(key: str, compute):
    """`compute()` (a JSON-able dict) remembered under `key` in this user's plan cache (a compile
    of the same program for the same chips, with the same compiler, is not repeated)."""
    path = _cache_path()

    def read() -> dict:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    table = read()
    if key in table:
        return table[key]
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    # under a lock, the table as it is now (another planner may have added to it meanwhile) plus this entry
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table = {**read(), key: value}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table))
        os.replace(tmp, path)
    return value


def _program_key(lowered, mesh, options: dict) -> str:
    import jax

    device = mesh.devices.flat[0]
    ident = [lowered.as_text(), device.device_kind, mesh.size, sorted(options.items()), jax.__version__,
             _libtpu_version()]
    return hashlib.sha256(json.dumps(ident, default=str).encode()).hexdigest()


def _libtpu_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("libtpu")
    except PackageNotFoundError:
        return None


class CostModelFault(RuntimeError):
    """The compiler's cost analysis of a counting program is unusable (a step time <= 0, or a loop it
    counts once)."""


def counting_cost(trainer, *, kernel_costs: bool = True) -> dict:
    """The compiler's cost of one training step of `trainer` (built with `scan_layers=False`) as a
    program with no loop: flops, bytes accessed, transcendentals, optimal_seconds per device."""
    from modern_jax.kernels.backend import declaring_costs
    from modern_jax.sharding.devices import chip

    with declaring_costs(kernel_costs):
        lowered = trainer.programs.lower("train", trainer.states.abstract(),
                                trainer.batches.abstract(fields=trainer.objective.fields()))

    def compile_():
        compiled = lowered.compile(compiler_options=dict(COUNTING_OPTIONS))
        analysis = compiled.cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        return {**{k: float(analysis.get(k, 0.0) or 0.0) for k in COST_KEYS},
                "loops": loops_that_count(compiled.as_text())}

    # the compiler's answer is cached as it is, a faulty one too: the checks below need no recompile
    cost = _cached(_program_key(lowered, trainer.mesh, {**COUNTING_OPTIONS, "kernel_costs": kernel_costs}), compile_)
    if cost.get("loops"):
        raise CostModelFault(f"the counting program still holds a while loop, whose body the cost model counts "
                             f"once: {'; '.join(cost['loops'])}; the step-time estimate would be wrong")
    cost = {k: cost[k] for k in COST_KEYS}
    if not 0.0 < cost["optimal_seconds"] < math.inf:
        raise CostModelFault(
            f"the TPU compiler's cost model gave optimal_seconds={cost['optimal_seconds']:.4g} for a counting "
            f"program on {chip(list(trainer.mesh.devices.flat)).name} x {trainer.mesh.size} (its flops and bytes "
            f"are {cost['flops']:.4g} and {cost['bytes accessed']:.4g}): no step time can be estimated from it "
            "with this libtpu; the memory plan above stands")
    return cost


def step_cost(run, mesh, *, kernel_costs: bool = True, layers=None) -> dict:
    """The compiler's cost of one training step of `run` on `mesh`, its loops counted: the counting
    programs' costs extrapolated to every stack's repeats (or, with `layers`, that program alone)."""
    from modern_jax.training.trainer import trainer_for

    execution = run.execution.replace(scan_layers=False)

    def cost(layers):
        return counting_cost(trainer_for(run, mesh, execution=execution, layers=layers), kernel_costs=kernel_costs)

    if layers is not None:
        return cost(layers)
    if mesh.shape.get("stage", 1) > 1:
        return pipelined_cost(run, mesh, kernel_costs=kernel_costs)
    base, variants = counting_layers(run.model)
    counted = cost(base)
    total = dict(counted)
    for more, variant in variants:
        one_more = cost(variant)
        for k in COST_KEYS:
            total[k] += more * (one_more[k] - counted[k])
    return total


# A pipelined step (`ops.pipeline`) is the stages' loop of R M + S - 1 iterations, each running P
# units on every stage at once, inside the step's other work. Its counting programs keep the
# schedule and the microbatches (M, of the same rows) and vary the units a stage runs a round (p)
# and the rounds (r): with `p` in {1, 2} (just P when it is 1) and `r` in {1, 2} for GPipe, {2, 3}
# for the interleaved schedule, the cost is bilinear in (p, r) (iterations r M + S - 1 of c0 + c1 p
# each, and the parameters' own work, r p of them), evaluated at (P, R). An iteration's cost is the
# slope in r over M; the bubble is S - 1 iterations of it: (S - 1) / (R M + S - 1) of the loop.
# 1F1B runs one round (M + S - 1 forward and as many backward slots a stage), its cost linear in M:
# its programs vary p and the microbatches of the run's size, m and 2 m with m = min(M, S) (small
# programs: M + 2 S - 2 iterations unrolled would be many), extrapolated to M; an iteration is the
# slope in the microbatches.

def pipelined_cost(run, mesh, *, kernel_costs: bool = True) -> dict:
    """`step_cost` of a pipelined run, with `iteration` (one iteration's cost) and `bubble_seconds`
    when the rounds (or, for 1F1B, the microbatches) vary (for GPipe, M >= S)."""
    import dataclasses

    from modern_jax.model import plan_stages
    from modern_jax.training.trainer import trainer_for

    S, M, R = mesh.shape["stage"], run.parallel.microbatches, run.parallel.stage_repeats
    stacks = plan_stages(run.model.layer_specs())
    if len(stacks) != 1:
        raise CostModelFault(f"a pipelined step's estimate counts models of one layer stack; this one has "
                             f"{len(stacks)} (layers of different kinds)")
    unit, repeats = stacks[0]
    P = repeats // (S * R)
    execution = run.execution.replace(scan_layers=False)
    one_f_one_b = run.parallel.pipeline_schedule == "1f1b"
    A = run.train.grad_accum
    b = run.train.batch_size // A // M  # a microbatch's rows

    def cost(p: int, x: int) -> dict:  # x: the rounds (the microbatches for 1F1B)
        if one_f_one_b:  # x microbatches of the run's rows
            rows = x * b * A
            counted = dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, microbatches=x),
                                          train=dataclasses.replace(run.train, batch_size=rows, eval_batch_size=rows))
        else:
            counted = dataclasses.replace(run, parallel=dataclasses.replace(
                run.parallel, stage_repeats=x, pipeline_schedule="interleaved" if x > 1 else "gpipe"))
        trainer = trainer_for(counted, mesh, execution=execution, layers=unit * (S * (1 if one_f_one_b else x) * p))
        return counting_cost(trainer, kernel_costs=kernel_costs)

    ps = [1] if P == 1 else [1, 2]
    if one_f_one_b:  # the fewest microbatches (from min(M, S)) whose rows still split over the data shards
        from modern_jax.sharding.rules import split_size

        shards = split_size("activation_batch", mesh, run.parallel.rules_table())
        m = next(m for m in range(min(M, S), M + 1) if (m * b) % shards == 0)
        xs = [m, 2 * m]
    else:
        xs = ([1, 2] if M >= S else [1]) if R == 1 else [2, 3]
    at = {(p, x): cost(p, x) for p in ps for x in xs}

    def line(values: dict, x: int) -> float:  # the line through two keys' values (or one key's), at x
        (x0, y0), *rest = sorted(values.items())
        return y0 if not rest else y0 + (x - x0) * (rest[0][1] - y0) / (rest[0][0] - x0)

    total, slope = {}, {}
    for k in COST_KEYS:
        total[k] = line({p: line({x: at[p, x][k] for x in xs}, M if one_f_one_b else R) for p in ps}, P)
        if len(xs) == 2:
            slope[k] = line({p: (at[p, xs[1]][k] - at[p, xs[0]][k]) / (xs[1] - xs[0]) for p in ps}, P)
    if slope:
        total["iteration"] = slope if one_f_one_b else {k: v / M for k, v in slope.items()}
        total["bubble_seconds"] = (S - 1) * total["iteration"]["optimal_seconds"]
    return total


def estimate_speed(run, mesh, *, opaque_kernels_too: bool = True) -> dict:
    """Estimated step time (the compiler's `optimal_seconds` with loops counted), tokens per second
    per chip and MFU of `run` on `mesh` of TPU chips: `seconds` with the kernels' declared costs,
    `seconds_io_kernels` with the kernels costed as their I/O (what the compiler sees of an
    undeclared kernel). MFU's FLOPs: 6 N per token plus causal attention (`accounting.flops_per_token`)."""
    from modern_jax.accounting import flops_per_token
    from modern_jax.sharding.devices import chip

    with_costs = step_cost(run, mesh, kernel_costs=True)
    io_only = step_cost(run, mesh, kernel_costs=False) if opaque_kernels_too else None
    seconds = with_costs["optimal_seconds"]
    for name, cost in (("", with_costs), (" without the kernels' costs", io_only)):
        if cost is not None and not cost["optimal_seconds"] > 0.0:
            raise CostModelFault(f"the counting programs extrapolate to a step of {cost['optimal_seconds']:.4g} s{name}: "
                                 "the compiler's cost model is not consistent from one layer to the next here")
    tokens = run.train.batch_size * run.train.seq_len
    model_flops = flops_per_token(run.model, run.train.seq_len)["causal_total"] * tokens
    peak = chip(list(mesh.devices.flat)).peak_tflops * 1e12
    out = {"seconds": seconds, "tokens_per_s_per_chip": tokens / seconds / mesh.size,
           "mfu": model_flops / (seconds * mesh.size * peak), "model_flops": model_flops,
           "compiler_flops": with_costs["flops"] * mesh.size, "bytes_per_chip": with_costs["bytes accessed"]}
    if io_only is not None:
        out["seconds_io_kernels"] = io_only["optimal_seconds"]
    if "bubble_seconds" in with_costs:
        S, M, R = mesh.shape["stage"], run.parallel.microbatches, run.parallel.stage_repeats
        loop = (R * M + S - 1) * with_costs["iteration"]["optimal_seconds"]
        out.update(bubble_seconds=with_costs["bubble_seconds"], bubble_of_loop=with_costs["bubble_seconds"] / loop,
                   bubble_formula=(S - 1) / (R * M + S - 1), pipeline_loop_seconds=loop)
    return out


def search(run, topology: str, *, slices: int = 1, remats, accums, meshes, chunks, microbatches=(1,),
           log=lambda message: None) -> dict:
    """Plan every combination of remat policy, micro-batches (`train.grad_accum`), mesh (with pipeline
    stages, each of the pipeline's `microbatches` counts) and loss vocabulary chunk on TPU `topology`,
    and rank those that fit by estimated tokens/s per chip.
    Every compile is cached (`_cached`): a repeated search, or one that shares combinations with
    an earlier one, compiles only what is new. `{"rows": ranked rows, "seconds": the search's time}`."""
    import dataclasses
    import itertools
    import time

    start = time.perf_counter()
    meshes = [dict(m) for m in dict.fromkeys(tuple(sorted(m.items())) for m in meshes)]
    rows = []
    combos = [(mesh, remat, accum, chunk, m) for mesh, remat, accum, chunk in
              itertools.product(meshes, remats, accums, chunks)
              for m in (microbatches if mesh.get("stage", 1) > 1 else (1,))]
    for i, (mesh_sizes, remat, accum, chunk, m) in enumerate(combos, 1):
        row = {"mesh": ",".join(f"{k}={v}" for k, v in mesh_sizes.items() if v > 1) or "1 device",
               "remat": remat, "grad_accum": accum, "loss_vocab_chunk": chunk, "microbatches": m}
        log(f"[{i}/{len(combos)}] {row['mesh']}, remat {remat}, {accum} micro-batch(es), loss chunk {chunk}"
            + (f", {m} pipeline microbatches" if mesh_sizes.get("stage", 1) > 1 else ""))
        try:
            parallel = dataclasses.replace(run.parallel, **mesh_sizes, microbatches=m)
            candidate = dataclasses.replace(run, execution=run.execution.replace(remat=remat), parallel=parallel,
                                            train=dataclasses.replace(run.train, grad_accum=accum,
                                                                      loss_vocab_chunk=chunk))
            result = plan(candidate, mesh_sizes, topology=topology, slices=slices, speed=True, opaque_kernels_too=False)
        except ValueError as e:  # a combination the run refuses (batch not divisible, heads not splittable)
            rows.append({**row, "fits": False, "note": str(e).split(";")[0]})
            continue
        row.update(fits=result["fits"], peak_gib=result["peak"] / GiB)
        if "unavailable" in result.get("speed", {}):
            row["note"] = "no estimate: the compiler's cost model failed"
        elif "speed" in result:
            row.update(seconds=result["speed"]["seconds"], tokens_per_s_per_chip=result["speed"]["tokens_per_s_per_chip"],
                       mfu=result["speed"]["mfu"])
        rows.append(row)
    rows.sort(key=lambda r: (not r["fits"], -r.get("tokens_per_s_per_chip", 0.0)))
    return {"rows": rows, "seconds": time.perf_counter() - start, "topology": topology}


def format_search(result: dict) -> str:
    """The ranked table: those that fit first, fastest first."""
    lines = ["| rank | mesh | remat | micro-batches | pipeline microbatches | loss chunk | peak GiB | step s | "
             "tokens/s/chip | MFU |", "|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(result["rows"], 1):
        if "tokens_per_s_per_chip" in r:
            speed = f"{r['seconds']:.4f} | {r['tokens_per_s_per_chip']:,.0f} | {100 * r['mfu']:.1f}%"
        else:
            speed = "does not fit | | " if "note" not in r else f"{r['note']} | | "
        peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else ""
        lines.append(f"| {i if r['fits'] else '-'} | {r['mesh']} | {r['remat']} | {r['grad_accum']} | "
                     f"{r.get('microbatches', 1)} | {r['loss_vocab_chunk']} | {peak} | {speed} |")
    fit = sum(r["fits"] for r in result["rows"])
    lines.append(f"{len(result['rows'])} configurations on {result['topology']}, {fit} fit; searched in "
                 f"{result['seconds']:.0f} s (compiles cached: a repeat is quick)")
    return "\n".join(lines)


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
    for key, label in (("parameters", "parameters"), ("optimizer", "optimizer state"),
                       ("reference", "frozen reference (a copy of the starting weights)"), ("batch", "batch"),
                       ("temporaries", "activations + temporaries (XLA)"), ("peak", "peak (arguments + outputs "
                                                                                       "- donated + temporaries)"),
                       ("host_temporaries", "host memory (activations offloaded by the remat policy)")):
        if result.get("compiler_refused") and key == "peak":
            lines.append(f"  {label}: {result[key] / GiB:.2f} GiB by the compiler's count, more than the chip's "
                         f"{result['hbm'] / GiB:.2f} GiB (it stopped there; no temporaries reported)")
        elif result.get(key) is not None and (key != "host_temporaries" or result[key]):
            lines.append(f"  {label}: {result[key] / GiB:.2f} GiB ({result[key]} B)")
    for name, program in result.get("programs", {}).items():
        lines.append(f"  {name}: {program['peak'] / GiB:.2f} GiB with the state ({program['temporaries'] / GiB:.2f} GiB "
                     f"of its own temporaries: a rollout's KV cache and logits; the peak is the larger)")
    if "hbm" in result:
        verdict = "fits" if result["fits"] else "does NOT fit"
        lines.append(f"{verdict} in {result['hbm'] / GiB:.0f} GiB of device memory")
    if "speed" in result:
        lines += format_speed(result["speed"])
    return "\n".join(lines)


def format_speed(speed: dict) -> list[str]:
    """The estimate's lines: step time (and without the kernels' declared costs), tokens/s/chip, MFU."""
    if "unavailable" in speed:
        return [f"estimated step time: not available: {speed['unavailable']}"]
    head = f"estimated step time: {speed['seconds']:.5g} s"
    if "seconds_io_kernels" in speed:
        head += f" ({speed['seconds_io_kernels']:.5g} s without the Pallas kernels)"
    lines = [head + " (the TPU compiler's roofline, loops counted; no overlap of communication beyond its model)",
             f"estimated tokens/s per chip: {speed['tokens_per_s_per_chip']:,.0f}",
             f"estimated MFU: {100 * speed['mfu']:.1f}% (6N + causal attention = {speed['model_flops']:.4g} FLOPs a step)"]
    if "bubble_seconds" in speed:
        lines.append(f"pipeline bubble: {speed['bubble_seconds']:.5g} s, {100 * speed['bubble_of_loop']:.2f}% of the "
                     f"stages' loop ({speed['pipeline_loop_seconds']:.5g} s; (S - 1) / (M R + S - 1) = "
                     f"{100 * speed['bubble_formula']:.2f}%), {100 * speed['bubble_seconds'] / speed['seconds']:.2f}% "
                     f"of the step")
    return lines
