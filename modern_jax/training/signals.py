"""SIGTERM / SIGINT stop a training run after a checkpoint, at a step every process agrees on
(`StopSignal`, which the loop holds for one call of `train`)."""

from __future__ import annotations

import os
import signal
import threading

from modern_jax.multihost import distributed


class StopSignal:
    """SIGTERM / SIGINT stop the run, after a checkpoint, at a step every process agrees on.

    One process: a flag the loop reads after each step (a second SIGINT interrupts at once).
    Several: SIGTERM is jax's preemption notice, whose handler tells the coordination service,
    which picks the step at which every process stops (`reached_preemption_sync_point`); a
    SIGINT is passed on as one."""

    def __init__(self):
        self.received: int | None = None
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            several = distributed.joined()
            for sig in (signal.SIGINT,) if several else (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._pass_on if several else self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def _pass_on(self, signum, frame):
        self.received = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.kill(os.getpid(), signal.SIGTERM)  # to jax's preemption notice

    def due(self, step: int) -> bool:
        """Stop after `step` (called after every step, by every process, in the same order)."""
        if distributed.joined():
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.received is not None

    def name(self) -> str:
        if distributed.joined():
            return "a stop signal (SIGTERM or Ctrl-C) to one of the processes"
        return signal.Signals(self.received).name

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
