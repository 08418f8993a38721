"""Rehearse a pod run on one machine: N processes of one launch, each with its own host CPU devices.

    modern-jax launch --processes 2 --devices 4 train --mesh data=2,fsdp=2,tensor=2 train.steps=20 train.warmup_steps=5

starts `modern-jax train ...` N times with `JAX_COORDINATOR_ADDRESS=localhost:PORT`,
`JAX_NUM_PROCESSES=N`, `JAX_PROCESS_ID=i`, `JAX_PLATFORMS=cpu` and
`--xla_force_host_platform_device_count=D`, as a cluster launcher would start it on N hosts:
the processes join, split the mesh's devices and the batch, and write one run. Every line a
process prints comes out prefixed `[i]`, except gloo's: the CPU collectives announce each group
of devices they connect (`[Gloo] Rank 0 is connected to 1 peer ranks...`, dozens of lines a run,
written piecewise from several threads), which the launch leaves out. SIGINT / SIGTERM are
passed on to every process; the launch ends when all have, with the first non-zero exit status
(0 if none).
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import socket
import subprocess
import sys


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch_env(index: int, processes: int, devices: int, port: int, base: dict | None = None) -> dict:
    """The environment of process `index` of a localhost launch."""
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env.update({"JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": str(processes),
                "JAX_PROCESS_ID": str(index), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
                "XLA_FLAGS": " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])})
    return env


def launch_local(command: list[str], processes: int = 2, devices: int = 4, port: int | None = None) -> int:
    """Run `modern-jax COMMAND...` as `processes` processes of one launch on this machine."""
    if processes < 1 or devices < 1:
        raise ValueError(f"--processes {processes} --devices {devices}: expected positive integers")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"--port {port}: expected a port from 1 to 65535 (or none, for a free one)")
    if command and command[0] == "--":
        command = command[1:]
    if not command or command[0] == "launch":
        raise ValueError("launch runs another command: modern-jax launch --processes 2 --devices 4 train ...")
    port = port or free_port()
    children = [subprocess.Popen([sys.executable, "-m", "modern_jax.cli", *command],
                                 env=launch_env(i, processes, devices, port), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, bufsize=0, start_new_session=True)
                for i in range(processes)]

    def pass_on(signum, frame):
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _relay(children)
        codes = [child.wait() for child in children]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return next((code for code in codes if code != 0), 0)


def _relay(children) -> None:
    """Copy every child's output to ours, line by line, each line prefixed with its process index."""
    selector = selectors.DefaultSelector()
    pending, gloo = {}, {}
    for i, child in enumerate(children):
        selector.register(child.stdout, selectors.EVENT_READ, i)
        pending[i], gloo[i] = b"", WithoutGloo()
    open_streams = len(children)
    while open_streams:
        for key, _ in selector.select():
            i = key.data
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                selector.unregister(key.fileobj)
                open_streams -= 1
                if pending[i]:
                    _write(i, gloo[i](pending[i]))
                continue
            *lines, pending[i] = (pending[i] + chunk).split(b"\n")
            for line in lines:
                _write(i, gloo[i](line))


_GLOO = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer ranks is : \d+")
# the pieces gloo writes one at a time: two threads announcing at once interleave them, across lines too
_GLOO_PIECES = re.compile(rb"\[Gloo\] Rank | is connected to | peer ranks\. |Expected number of connected peer ranks is : ")


class WithoutGloo:
    """One process's lines without gloo's announcements: `filter(line)` is the line, what is left
    of it, or None when it held nothing else (a number or a newline of gloo's included)."""

    def __init__(self):
        self.owed = 0  # newlines of announcements begun and not yet ended

    def __call__(self, line: bytes) -> bytes | None:
        self.owed += line.count(b"[Gloo] Rank ")
        rest = _GLOO_PIECES.sub(b"", _GLOO.sub(b"", line))
        if rest.strip(b"0123456789 \t") or (rest == line and not self.owed):
            return rest
        self.owed = max(self.owed - 1, 0)
        return None


def _write(i: int, line: bytes | None) -> None:
    if line is not None:
        sys.stdout.write(f"[{i}] {line.decode('utf-8', 'replace')}\n")
        sys.stdout.flush()
