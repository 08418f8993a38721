"""The `modern-jax` command.

    modern-jax prepare --data corpus/*.jsonl --out shards/ [--documents-per-shard 10000] [data.text_field=...]
    modern-jax train [--config configs/tiny.yaml] [--data PATH] [train.steps=500 model.n_layers=2 ...]
    modern-jax train --init-from-hf HF_DIR --data chats.jsonl [--config configs/finetune_chat.yaml] [...]
    modern-jax evaluate --checkpoint runs/tiny [--split val | --data FILE] [--max-windows N|all]
    modern-jax generate --checkpoint runs/tiny --prompt "def " [--temperature 0.8 --top-k 50 --top-p 0.95]
    modern-jax harness --checkpoint runs/chat | --hf HF_DIR --tasks sums_choice [--include-path configs/harness ...]
    modern-jax info --config configs/llama3_8b.yaml [model.n_layers=4 ...] [--context 8192]
    modern-jax info --hf-config path/to/config.json
    modern-jax convert --from-hf HF_DIR --out CKPT  |  --to-hf CKPT --out HF_DIR [--model-type llama]
    modern-jax plan --config configs/llama3_8b.yaml --mesh data=1,fsdp=8,tensor=1 --batch 8 --seq 8192 --hbm-gib 141
    modern-jax plan --config configs/llama3_8b.yaml --topology v5p:2x2x2 --mesh fsdp=8 --batch 8 --seq 8192
    modern-jax launch --processes 2 --devices 4 train --mesh data=2,fsdp=2,tensor=2 [...]   (rehearse a pod run)

Under a cluster launcher (srun, mpirun, a Cloud TPU pod's workers) or with --coordinator /
--num-processes / --process-id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID),
train, evaluate, generate, harness, plan and convert join the other processes first
(`multihost.distributed`).
Each command is a module here that owns its parser (`add_parser`) and runs it (`run`); what more
than one command uses is `shared`'s.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback

from modern_jax.cli import convert, evaluate, generate, harness, info, launch, plan, prepare, train
from modern_jax.cli.shared import COMPUTING, _check_flags, _compile_cache, _launch_flags, _positive

COMMANDS = (info, prepare, train, evaluate, generate, harness, convert, plan, launch)  # in the order --help lists them


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modern-jax", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    for name in COMPUTING:
        _launch_flags(sub.choices[name])
    parser.commands = sub.choices
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """Options and `section.key=value` overrides may come in any order (`train model.n_layers=2 --config X`)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, _ = parser.parse_known_args(argv)
    if "overrides" in args and argv[0] == args.command:
        return parser.commands[args.command].parse_intermixed_args(argv[1:], argparse.Namespace(command=args.command))
    return parser.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    args.argv = argv  # the command as given (plan re-runs it in a fresh process)
    from modern_jax.multihost import distributed

    status, message, agreed = 1, None, False
    try:
        from modern_jax.sharding.devices import no_tpu_runtime_without_chips

        no_tpu_runtime_without_chips()  # every command: convert and report place arrays too
        if args.command in COMPUTING and args.command != "plan":
            _compile_cache()
        if args.command in COMPUTING and not os.environ.get("MODERN_JAX_ALONE"):
            seconds = (lambda t: 0 < t < math.inf, "a positive number of seconds")
            _check_flags(args, _positive("--num-processes"), ("--heartbeat-timeout", *seconds),
                         ("--join-timeout", *seconds))
            launch = distributed.detect(args.coordinator, args.num_processes, args.process_id)
            distributed.start(launch, args.command, args.heartbeat_timeout, join_timeout=args.join_timeout)
        status = args.func(args) or 0
    except ValueError as e:
        status, message, agreed = 2, str(e), isinstance(e, distributed.Refused)
        if distributed.is_main() or not agreed:  # an agreed refusal is said once, by process 0
            prefix = f"process {distributed.index()}: " if distributed.joined() and not agreed else ""
            print(f"modern-jax {args.command}: error: {prefix}{e}", file=sys.stderr)
    except BaseException as e:  # a bug, or Ctrl-C before the loop: the others must not wait for this process
        if not distributed.joined():
            raise
        from jax.errors import JaxRuntimeError

        if isinstance(e, JaxRuntimeError):  # a collective that lost its peer: the watchdog names it
            distributed.await_lost_peer()
        traceback.print_exc()
        message = f"{type(e).__name__}: {e}"
    finally:
        if distributed.stranded():  # jax's client began to join and did not: end now, before it aborts us
            from modern_jax.multihost import watch

            sys.stdout.flush()
            watch.close()
            os._exit(status)
        if distributed.joined():
            distributed.finish(failed=None if message is None or agreed else message)
            if message is not None and not agreed:  # this process's own error: no shutdown barrier
                from modern_jax.multihost import watch

                sys.stdout.flush()
                watch.close()
                os._exit(status)
    return status
