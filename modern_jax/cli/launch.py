"""`modern-jax launch`: run a command as N processes of one launch on this machine (a pod run
rehearsed on host CPU devices).

    modern-jax launch --processes 2 --devices 4 train --mesh data=2,fsdp=2,tensor=2 [...]
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    la = subparsers.add_parser("launch", help="run a command as N processes of one launch on this machine (a pod run "
                                              "rehearsed on host CPU devices)")
    la.add_argument("--processes", "-n", type=int, default=2, help="processes to start (default 2)")
    la.add_argument("--devices", type=int, default=4, help="host CPU devices per process (default 4)")
    la.add_argument("--port", type=int, help="the coordinator's port on localhost (default: a free one)")
    la.add_argument("rest", nargs=argparse.REMAINDER, help="the command and its arguments, e.g. train --mesh ...")
    la.set_defaults(func=run)


def run(args) -> int:
    from modern_jax.cli import parse_args  # the package's, which composes this parser
    from modern_jax.multihost.launch import launch_local

    if not args.rest:
        raise ValueError("launch needs a command to run: modern-jax launch --processes 2 --devices 4 train ...")
    command = args.rest[1:] if args.rest[0] == "--" else args.rest
    if command and command[0] != "launch":
        parse_args(command)  # a command the processes would refuse, refused once (argparse's own message)
    return launch_local(command, processes=args.processes, devices=args.devices, port=args.port)
