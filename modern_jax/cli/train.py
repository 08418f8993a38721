"""`modern-jax train`: train a model, from scratch or fine-tuning a Hugging Face one.

    modern-jax train [--config configs/tiny.yaml] [--data PATH] [train.steps=500 model.n_layers=2 ...]
    modern-jax train --init-from-hf HF_DIR --data chats.jsonl [--config configs/finetune_chat.yaml] [...]
"""

from __future__ import annotations

import json
import pathlib
import sys

from modern_jax.cli.shared import _note, _overrides, _warnings_as_notes

DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parent.parent.parent / "configs" / "tiny.yaml"
FINETUNE_CONFIG = DEFAULT_CONFIG.parent / "finetune_chat.yaml"  # the default run file of --init-from-hf


def add_parser(subparsers) -> None:
    tr = subparsers.add_parser("train", help="train a model (default: configs/tiny.yaml on the embedded corpus)")
    tr.add_argument("--config", help=f"a run file with model:, train:, data: sections (default: {DEFAULT_CONFIG.name})")
    tr.add_argument("--data", help="text file or directory, .jsonl(.gz), .parquet, a saved Hugging Face dataset, "
                                   "token .bin or ArrayRecord (sets data.path)")
    tr.add_argument("--output-dir", help="run directory: checkpoints, metrics, samples (sets train.output_dir)")
    tr.add_argument("--init-from-hf", metavar="SOURCE",
                    help="fine-tune: start from this Hugging Face model directory or hub name (org/name, from the "
                         "local cache), or a converted checkpoint, with its config and tokenizer; the run file "
                         f"(default: {FINETUNE_CONFIG.name}) supplies train: and data:")
    tr.add_argument("--init-adapter", metavar="DIR",
                    help="with --init-from-hf: start a LoRA run from this PEFT adapter of that model (its rank, "
                         "alpha and projections set lora:)")
    tr.add_argument("--mesh", help="device mesh, e.g. data=2,fsdp=1,tensor=4 (-1 fills; sets "
                                   "parallel.stage/data/fsdp/expert/context/tensor)")
    _overrides(tr, "train.steps=500 model.n_layers=2")
    tr.set_defaults(func=run)


def _benchmarks(states, tokenizer, train_cfg):
    """`train.harness_tasks`' scorer for a run (lm-eval is imported only by a run that names tasks)."""
    from modern_jax.harness import Benchmarks

    return Benchmarks(states, tokenizer, train_cfg)


def run(args) -> int:
    import signal

    from modern_jax.multihost import distributed
    from modern_jax.training import TrainingDiverged, load_run_config, train

    overrides = list(args.overrides)
    if args.data is not None:
        overrides.append(f"data.path={json.dumps(args.data)}")
    if args.output_dir is not None:
        overrides.append(f"train.output_dir={json.dumps(args.output_dir)}")
    if args.mesh is not None:
        from modern_jax.sharding.mesh import parse_mesh

        overrides += [f"parallel.{axis}={size}" for axis, size in parse_mesh(args.mesh).items()]
    config = args.config or (FINETUNE_CONFIG if args.init_from_hf else DEFAULT_CONFIG)
    run = load_run_config(config, overrides)
    init = None
    if args.init_from_hf:
        from modern_jax.convert import finetune_run

        run, init = finetune_run(run, args.init_from_hf, log=_note, adapter=args.init_adapter)
    elif args.init_adapter:
        raise ValueError("--init-adapter needs --init-from-hf: the Hugging Face model the adapter was trained on")
    source = f"{config} from {args.init_from_hf}" if init is not None else str(config)
    main = distributed.is_main()
    if main:
        print(f"training {source} -> {run.train.output_dir}", flush=True)
    try:
        with _warnings_as_notes(quiet=not main):
            result = train(run, init=init, benchmarks=_benchmarks)
    except TrainingDiverged as e:
        if main:
            print(f"modern-jax train: {e}", file=sys.stderr)
        return 3
    if result.interrupted:  # after a checkpoint: Ctrl-C is 130; a stop request (SIGTERM, a preemption notice,
        return 130 if result.signal == signal.SIGINT and not distributed.joined() else 0  # any signal in a launch) 0
    if not main:
        return 0
    for i, text in enumerate(result.samples):
        print(f"--- sample {i} ---\n{text}")
    print(f"steps: {result.step}")
    print(f"wall_s: {result.wall_s:.1f}")
    print(f"compile_s: {result.compile_s:.1f}")
    for label, value in result.val_shown.items():  # the objective's own figures (bits per byte, DPO's margin)
        print(f"val_{label}: {value:.4f}")
    print(f"val_loss: {result.val_loss:.4f}")
    for name, value in result.harness.items():  # train.harness_tasks: lm-eval's figures at the last step
        print(f"harness/{name}: {value:.4f}")
    print(f"tokens_per_s: {result.tokens_per_s:.0f}")
    return 0
