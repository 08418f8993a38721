"""A launch of N processes x M host CPU devices on localhost, started as `srun` starts one.

Each process gets the variables SLURM sets for a task (SLURM_JOB_ID, SLURM_STEP_NODELIST,
SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID) and runs `python -m modern_jax.cli ...` (or a
script) with no code of ours to join them: `modern-jax` finds the launch by itself.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import socket
import subprocess
import sys
import time

from common import QUICK_FLAG

REPO = pathlib.Path(__file__).resolve().parent.parent


def free_job_id() -> int:
    """A SLURM job id whose coordinator port (jax: 61440 + id % 4096) is free here."""
    for _ in range(100):
        job = random.randint(1, 10**6)
        with socket.socket() as s:
            try:
                s.bind(("localhost", 61440 + job % 4096))
            except OSError:
                continue
        return job
    raise RuntimeError("no free coordinator port")


def slurm_env(i: int, n: int, devices: int, job: int, quick: bool = True) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_", "OMPI_"))}
    flags = f"--xla_force_host_platform_device_count={devices}" + (f" {QUICK_FLAG}" if quick else "")
    env.update(SLURM_JOB_ID=str(job), SLURM_STEP_NODELIST="localhost", SLURM_NTASKS=str(n), SLURM_PROCID=str(i),
               SLURM_LOCALID=str(i), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS=flags,
               MODERN_JAX_COMPILE_CACHE="off")  # jax's own cache went with JAX_*: none, not the user's
    return env


class Launch:
    """`n` processes of one launch; `logs[i]` is process i's stdout + stderr."""

    def __init__(self, argv: list[str], n: int, devices: int, logdir: pathlib.Path, *, script: str | None = None,
                 per_process: dict[int, list[str]] | None = None, quick: bool = True):
        job = free_job_id()
        self.paths = [pathlib.Path(logdir) / f"process{i}-{job}.log" for i in range(n)]
        self.started = time.monotonic()
        self.procs = []
        for i in range(n):
            command = [sys.executable, "-c", script] if script else [sys.executable, "-m", "modern_jax.cli"]
            with open(self.paths[i], "w") as log:
                self.procs.append(subprocess.Popen([*command, *argv, *(per_process or {}).get(i, [])], cwd=REPO,
                                                   env=slurm_env(i, n, devices, job, quick), stdout=log,
                                                   stderr=subprocess.STDOUT))

    def wait(self, timeout: float = 600) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in self.procs]
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def log(self, i: int) -> str:
        """Process i's output, without gloo's connection lines."""
        return "\n".join(line for line in self.paths[i].read_text(errors="replace").splitlines()
                         if "[Gloo]" not in line and "peer ranks" not in line)


def records(run: pathlib.Path, split: str = "train") -> list[dict]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, filter(None, lines)) if r["split"] == split]


def wait_for_step(run: pathlib.Path, step: int, launch: Launch, timeout: float = 400) -> None:
    """Until `metrics.jsonl` has logged `step` (after the launch started), or a process ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= step for r in records(run)):
            return
        if any(p.poll() is not None for p in launch.procs):
            raise AssertionError(f"a process ended before step {step}:\n" + launch.log(0)[-3000:])
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")
