"""`modern-jax plan`: per-device memory (and, on a TPU topology, the estimated step time) of the
training step on a mesh, without an accelerator.

    modern-jax plan --config configs/llama3_8b.yaml --mesh data=1,fsdp=8,tensor=1 --batch 8 --seq 8192 --hbm-gib 141
    modern-jax plan --config configs/llama3_8b.yaml --topology v5p:2x2x2 --mesh fsdp=8 --batch 8 --seq 8192
"""

from __future__ import annotations

import math
import os
import sys

from modern_jax.cli.shared import _check_flags, _note, _overrides, _positive


def add_parser(subparsers) -> None:
    pl = subparsers.add_parser("plan", help="per-device memory of the training step on a mesh or a TPU topology "
                                            "(no accelerator needed)")
    pl.add_argument("--config", required=True, help="a YAML config (model:, optional train:)")
    pl.add_argument("--mesh", required=True,
                    help="e.g. data=1,fsdp=8,tensor=1 (axes: stage, data, fsdp, expert, context, tensor)")
    pl.add_argument("--batch", type=int, required=True, help="sequences per step, all devices together")
    pl.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    pl.add_argument("--topology", help="compile with the TPU compiler for this topology (libtpu), e.g. v5p:2x2x2, "
                                       "v5e:2x2, v6e:4x4; without it, host CPU devices give an estimate")
    pl.add_argument("--slices", type=int, default=1, help="--topology: the number of slices (multi-slice)")
    pl.add_argument("--hbm-gib", type=float, help="device memory to check the plan against (default with "
                                                  "--topology: the chip's)")
    pl.add_argument("--no-speed", action="store_true",
                    help="--topology: memory only, without the estimated step time (which compiles counting programs)")
    pl.add_argument("--search", action="store_true",
                    help="--topology: compile the combinations of the --search-* choices and rank those that fit by "
                         "estimated tokens/s per chip")
    pl.add_argument("--search-microbatches", metavar="M,M",
                    help="--search: pipeline microbatches, parallel.microbatches, for meshes with stages (default: "
                         "the run's)")
    pl.add_argument("--search-remat", default="full,save_qkv_out,dots", metavar="P,P",
                    help="--search: remat policies (default full,save_qkv_out,dots)")
    pl.add_argument("--search-accum", default="1,2", metavar="A,A",
                    help="--search: micro-batches per step, train.grad_accum (default 1,2)")
    pl.add_argument("--search-mesh", metavar="MESH;MESH",
                    help="--search: meshes of the topology's chips, ';'-separated (default: --mesh, and fsdp over "
                         "all chips)")
    pl.add_argument("--search-chunk", metavar="N,N",
                    help="--search: loss vocabulary chunks, train.loss_vocab_chunk; 'whole' is the vocabulary in one "
                         "(default: the run's and whole)")
    _overrides(pl, "execution.remat=full model.dtype=bfloat16")
    pl.set_defaults(func=run)


def run(args) -> int:
    """`plan` compiles ahead of time on one host: under a launcher process 0 plans and the others wait."""
    from modern_jax.multihost import distributed

    if not distributed.joined():
        return _plan(args)
    status = _plan(args) if distributed.is_main() else 0
    distributed.barrier("plan")
    return status


def _plan(args) -> int:
    from modern_jax.sharding.mesh import parse_mesh

    _check_flags(args, _positive("--batch"), _positive("--seq"), _positive("--slices"),
                 ("--hbm-gib", lambda g: 0 < g < math.inf, "a positive number of GiB"))
    sizes = {"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1, **parse_mesh(args.mesh)}
    if any(v < 1 for v in sizes.values()):
        raise ValueError("plan needs explicit mesh sizes (no -1)")
    if args.slices > 1 and not args.topology:
        raise ValueError("--slices needs --topology (the slices of a TPU topology)")
    if args.search and not args.topology:
        raise ValueError("--search needs --topology: it ranks by the TPU compiler's estimated step time")
    if args.topology:
        from modern_jax.sharding.devices import check_topology

        check_topology(args.topology)
    searched = _search_options(args, sizes) if args.search else None  # refused before anything compiles
    from modern_jax.training.config import load_run_config

    # only the training step is planned: the evaluation batch follows --batch unless it is given
    overrides = ([f"train.eval_batch_size={args.batch}"] + list(args.overrides)
                 + [f"train.batch_size={args.batch}", f"train.seq_len={args.seq}"]
                 + [f"parallel.{axis}={size}" for axis, size in sizes.items()])  # the run's mesh is the plan's
    run = load_run_config(args.config, overrides)  # config errors here, before any re-execution
    if not isinstance(run.model_dict.get("vocab_size"), int):
        raise ValueError("plan needs a numeric model.vocab_size (override model.vocab_size=N)")
    env = {"JAX_PLATFORMS": "cpu"}  # the TPU is only a compile target; host CPU devices otherwise
    if not args.topology:
        flag = f"--xla_force_host_platform_device_count={math.prod(sizes.values())}"
        if flag not in os.environ.get("XLA_FLAGS", ""):
            env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    if any(os.environ.get(k) != v for k, v in env.items()):  # set before JAX starts: in a fresh process
        import subprocess

        return subprocess.call([sys.executable, "-m", "modern_jax.cli", *args.argv],  # it joins no launch
                               env={**os.environ, **env, "MODERN_JAX_ALONE": "1"})
    from modern_jax.planner import format_plan, format_search, plan, search

    if args.search:
        searched["microbatches"] = searched["microbatches"] or [run.parallel.microbatches]
        result = search(run, args.topology, slices=args.slices, **searched, chunks=_chunks(args.search_chunk, run),
                        log=_note)
        print(format_search(result))
        return 0
    print(format_plan(plan(run, sizes, args.hbm_gib, topology=args.topology, slices=args.slices,
                           speed=not args.no_speed)))
    return 0


def _search_options(args, sizes: dict) -> dict:
    """`--search`'s meshes, remat policies and micro-batch counts, each flag checked by name."""
    from modern_jax.execution import REMAT_POLICIES
    from modern_jax.sharding.mesh import parse_mesh

    devices = math.prod(sizes.values())
    ones = {k: 1 for k in sizes}
    meshes = [sizes, {**ones, "fsdp": devices}]
    if args.search_mesh:
        meshes = []
        for text in args.search_mesh.split(";"):
            try:
                mesh = {**ones, **parse_mesh(text)}
            except ValueError as e:
                raise ValueError(f"--search-mesh {text!r}: {e}") from None
            if math.prod(mesh.values()) != devices or min(mesh.values()) < 1:
                raise ValueError(f"--search-mesh {text!r}: its axes multiply to {math.prod(mesh.values())}, the "
                                 f"planned devices are {devices} (--mesh {args.mesh}): give sizes whose product is "
                                 f"{devices}, separated by ';'")
            meshes.append(mesh)
    remats = _names(args.search_remat, "--search-remat")
    unknown = [r for r in remats if r not in REMAT_POLICIES]
    if unknown:
        raise ValueError(f"--search-remat {args.search_remat!r}: {', '.join(map(repr, unknown))} is not a remat "
                         f"policy; expected some of {', '.join(REMAT_POLICIES)}")
    microbatches = _numbers(args.search_microbatches, "--search-microbatches") if args.search_microbatches else None
    return {"meshes": meshes, "remats": remats, "accums": _numbers(args.search_accum, "--search-accum"),
            "microbatches": microbatches}


def _names(text: str, flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"{flag} {text!r}: give one or more comma-separated choices")
    return list(dict.fromkeys(names))


def _numbers(text: str, flag: str) -> list[int]:
    names = _names(text, flag)
    if not all(n.isdigit() and int(n) > 0 for n in names):
        raise ValueError(f"{flag} {text!r}: expected positive integers, e.g. 1,2,4")
    return [int(n) for n in names]


def _chunks(text: str | None, run) -> list[int]:
    whole = run.model.padded_vocab_size
    if text is None:
        return sorted({run.train.loss_vocab_chunk, whole})
    names = _names(text, "--search-chunk")
    if not all(n == "whole" or (n.isdigit() and int(n) > 0) for n in names):
        raise ValueError(f"--search-chunk {text!r}: expected positive integers or 'whole', e.g. 8192,whole")
    return sorted({whole if n == "whole" else int(n) for n in names})
