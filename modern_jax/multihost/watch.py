"""The last word of a process that jax's coordination client ends.

When the coordinator of a launch (process 0) goes away, or reports another process lost, jax's
client ends every other process at once, from a native thread, with a page of log lines and a
native stack dump that name neither the step nor how to resume; so does a join that fails (a
peer that never connects, a coordinator that does not answer). `watch_stderr()` passes this
process's stderr (file descriptor 2, native writes included) through a small child process
that copies it; when that ending comes, the child leaves out jax's page and prints one line
instead, in the words of `distributed._Joined.lost` (which process was lost, at which step, and
how to resume) or, while joining, which process could not join where and why — from the
`status` lines this process sends it, which are never shown.

jax's client then calls `abort()`, which a shell reports as "Aborted" (exit status 134). While
the watcher runs, this process catches SIGABRT natively: when the watcher has seen jax's
ending (it says so on a pipe of its own), the process ends with exit status `ending` instead
(the launch's: 2 while joining, 4 once joined, as the lines of ours that name the same
failures end); any other abort goes on as one.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import select
import signal
import subprocess
import sys

STATUS = b"\x1emodern_jax-status "  # a line the watcher keeps and never prints
FATAL = b"Terminating process because the JAX distributed service detected fatal errors"
_LOG_LINE = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d")  # absl's native log lines
_MORE = (b" ", b"\t", b"=", b":", b".", b"\n", b"Additional", b"RPC", b"external/", b"The ", b"[type.")  # ... continued
_watching = None  # the watcher process
_terminal = None  # this process's own stderr, which the watcher writes to
_seen = None  # the pipe on which the watcher says it has seen jax's ending
_on_abort = None  # the SIGABRT handler the C library calls (`_catch_abort`)
ending = 134  # the exit status after jax's ending (set by `watch_stderr`, changed by the launch once joined)
_ABORT_WAIT_S = 5.0  # how long an abort waits for the watcher to say it was jax's ending


def watch_stderr(exit_status: int) -> None:
    """From now on this process's stderr goes through the watcher (one child process), and jax's
    ending ends the process with `exit_status` (kept in `ending`, which the launch may change)."""
    global _watching, _terminal, _seen, ending
    if _watching:
        return
    ending = exit_status
    read, write = os.pipe()
    _seen, seen = os.pipe()
    _terminal = os.dup(2)
    _watching = subprocess.Popen([sys.executable, "-m", "modern_jax.multihost.watch", str(seen)], stdin=read,
                                 stdout=subprocess.DEVNULL, stderr=_terminal, close_fds=True, pass_fds=(seen,))
    sys.stderr.flush()
    os.dup2(write, 2)
    for fd in (write, read, seen):
        os.close(fd)
    atexit.register(close)
    _catch_abort()


_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)


def _catch_abort() -> None:
    """SIGABRT runs `_aborted` (on the aborting native thread, before the process would end)."""
    global _on_abort
    _on_abort = _HANDLER(_aborted)  # kept: the C library holds a pointer to it
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, _HANDLER)
    libc.signal(signal.SIGABRT, _on_abort)


def _aborted(signum: int) -> None:
    """jax's ending (the watcher saw it): hand the watcher the rest and end with `ending`. Any
    other abort returns, and the C library ends the process by SIGABRT as before."""
    ready, _, _ = select.select([_seen], [], [], _ABORT_WAIT_S)
    if ready:
        close()
        os._exit(ending)


def close() -> None:
    """Hand the rest of stderr to the watcher and wait until it has written it (at exit)."""
    global _watching
    if not _watching:
        return
    watcher, _watching = _watching, False
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # our end of the pipe closes: the watcher reads its end
    os.close(devnull)
    try:  # a loaded host can take seconds to start the watcher: an error said at start-up must not be lost
        watcher.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass


def say(line: str) -> None:
    """A line on stderr now, not after what waits in the watcher (said before the command's first
    lines on stdout, which take no such detour)."""
    sys.stderr.flush()
    os.write(_terminal if _watching else 2, (line + "\n").encode())


def status(**fields) -> None:
    """Tell the watcher what its message would say (`command`, `index`, `count`, `peers`, `step`, `resume`)."""
    if _watching:
        os.write(2, STATUS + json.dumps(fields).encode() + b"\n")


def message(state: dict, fatal: bytes) -> str:
    """The one line that replaces jax's page."""
    command, index, count = state.get("command", "?"), state.get("index", "?"), state.get("count", "?")
    if state.get("joining"):
        return f"modern-jax {command}: error: {joining(state['joining'], index, count, fatal)}"
    peers = state.get("peers", {})

    def who(j):
        peer = peers.get(str(j), {})
        return f"host {peer.get('host', '?')}, pid {peer.get('pid', '?')}"

    lost = re.search(rb"unhealthy[^:]*:\s*([\d,\s]+)", fatal)
    again = re.search(rb"(\d+) unexpectedly tried to connect with a different incarnation", fatal)
    if lost:
        j = int(lost.group(1).replace(b",", b" ").split()[0])
        why = f"process {j} of {count} ({who(j)}) stopped (the coordinator found it lost)"
    elif again:
        j = int(again.group(1))
        why = (f"a second process {j} of {count} joined the running launch (two processes given the same id, or "
               f"process {j} started again on its own)")
    else:
        why = f"the coordinator (process 0 of {count}, {who(0)}) is gone (killed, out of memory or unreachable)"
    step = state.get("step")
    at = f" at step {step}" if step is not None else ""
    return f"modern-jax {command}: error: {why}{at}; stopping process {index} too.{state.get('resume', '')}"


def joining(join: dict, index, count, fatal: bytes) -> str:
    """Why process `index` could not join: what jax's client reported, and what to check."""
    reported = re.search(rb"absl::Status: ([^\n]*)", fatal)
    rpc = re.search(rb"RPC: \S*/(\w+)", fatal)
    said = (reported.group(1).decode(errors="replace").strip()[:160] if reported else "its client ended the join")
    said += f", in {rpc.group(1).decode()}" if rpc else ""
    where = f"{join['address']} (from {join['origin']})"
    if index == 0:
        return (f"process 0 of {count} waited {join['timeout']:.0f} s at {where} and not every process joined "
                f"({said}): start all {count} processes with the same launch variables (a process given other "
                f"ones looks for another coordinator); --join-timeout sets the wait")
    return (f"process {index} of {count} reached {where} but could not join a launch of {count} processes there "
            f"({said}): another program or another launch may hold that port, or process 0 failed; start every "
            f"process with the same launch variables")


def main(seen: int) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # a launcher's signal is for the process; this one outlives it
    source, out = sys.stdin.buffer.raw, sys.stderr.buffer
    state, held, buffer, fatal = {}, [], b"", b""

    def emit(lines):
        if lines:
            out.write(b"".join(lines))
            out.flush()

    while True:
        ready, _, _ = select.select([source], [], [], 0.5)
        if not ready:  # quiet for a moment: what was held back was not jax's ending
            emit(held)
            held = []
            continue
        chunk = os.read(source.fileno(), 65536)
        if not chunk:
            break
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in (line + b"\n" for line in lines):
            if line.startswith(STATUS):
                state.update(json.loads(line[len(STATUS):]))
            elif fatal or FATAL in line:
                if not fatal:
                    os.write(seen, b"!")  # the process's abort is jax's ending
                fatal += line  # jax's ending and its stack dump: replaced by one line
            elif _LOG_LINE.match(line) or (held and (line.startswith(_MORE) or line.strip().isdigit())):
                held.append(line)  # a native log block, which may lead up to the ending
            else:
                emit(held)
                held = []
                emit([line])
    if fatal:
        emit([message(state, fatal).encode() + b"\n"])
    else:
        emit(held + ([buffer] if buffer else []))


if __name__ == "__main__":
    main(int(sys.argv[1]))
