"""Many processes, one run: start-up, agreement between the processes, and their heartbeats.

A command that computes (`train`, `evaluate`, `generate`, `plan`) calls `start()` before
anything else touches JAX. It joins the other processes of a launch (multi-process JAX,
`jax.distributed.initialize`) when one of these started it, looked for in this order:

    flags        --coordinator HOST:PORT --num-processes N --process-id I
    environment  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (`modern-jax launch`)
    SLURM        srun: SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID
    Open MPI     mpirun: OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_RANK, OMPI_MCA_orte_hnp_uri
    Cloud TPU    the workers of a pod slice (`gcloud ... --worker=all`), as jax detects them
    Kubernetes   as jax detects it (with the `kubernetes` package)

and otherwise starts as one process, at once. Each process of a launch prints `process i of
N, D devices (d local)` on stderr.

Joining is bounded by `join_timeout` and named, and a process that cannot join ends with one
line of ours and exit status 2 (`JoinFailed`), never with jax's native stack dump or SIGABRT.
Before jax is asked to join, the launch's variables are resolved and checked (an id out of
range is named at once), process 0 checks that the coordinator's port is free on its host, and
every other process waits for something to listen there and checks that it answers as a
coordinator does (HTTP/2, gRPC's protocol), so a port another program holds is named within
seconds on every process (and, while joining, that the coordinator is still there: a process 0
that stops first is noticed within seconds). jax's client then joins on a thread of its own
with a longer timeout than ours: at our deadline the main thread says which process could not
join where, and the process ends at once (`os._exit`), before jax's client can abort it (its
timeout, a failed join and its shutdown at exit all end the process with SIGABRT). The stderr
watcher (`watch.py`) runs from before the join, for what jax still says natively.

Across processes (all no-ops in one process):
- `decide(name, fn)`: process 0 computes, every process gets its result, or the same error
  (a directory guard, which checkpoint to resume) — decided once, followed by all.
- `check_same(name, facts)`: every process must hold the same facts (its config, mesh, data);
  a difference is named before any step runs.
- `barrier(name)`.
- Heartbeats: every process publishes one every `heartbeat_timeout / 6` seconds through the
  coordination service; a process that sends none for `heartbeat_timeout` seconds (killed,
  out of memory, hung) or a coordinator that cannot be reached stops every other process with
  one line naming the lost process and the step (`note(step=...)`), never a hang. A process
  that fails says so to the others (`fail`), which then stop at once with its message.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time

HEARTBEAT_TIMEOUT = 60.0  # seconds without a heartbeat after which a process is lost
JOIN_TIMEOUT = 120.0  # seconds for every process of a launch to connect (hosts start at different times)
LOST_EXIT = 4  # the exit status of a process stopped because another one was lost or failed
JOIN_EXIT = 2  # the exit status of a process that could not join its launch (`JoinFailed`)
_PROBE_S = 5.0  # how long a coordinator has to answer HTTP/2's connection preface (a gRPC server: at once)
_JAX_GRACE_S = 60  # jax's own join timeout runs this much past ours, so ours always speaks first
_PREFIX = "modern_jax"
_WAIT_MS = 24 * 3600 * 1000  # a decision can take as long as process 0's work (heartbeats bound real losses)


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process joins the others: `None` fields are left to jax's detection."""

    launcher: str  # "flags", "environment", "SLURM", "Open MPI", "Cloud TPU", "Kubernetes"
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    origin: str = ""  # where the coordinator's address comes from, as the messages say it


# the variables (or flags) that give each launcher's process count and id
_COUNT_AND_ID = {"flags": ("--num-processes", "--process-id"), "environment": ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"),
                 "SLURM": ("SLURM_NTASKS", "SLURM_PROCID"), "Open MPI": ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")}


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer (the process count or id of this launch)") from None


def detect(coordinator: str | None = None, num_processes: int | None = None,
           process_id: int | None = None) -> Launch | None:
    """The launch this process belongs to, or None when it runs alone (checked without waiting)."""
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    if any(v is not None for v in given.values()):
        missing = [flag for flag, v in given.items() if v is None]
        if missing:
            raise ValueError(f"{', '.join(missing)} missing: give --coordinator HOST:PORT, --num-processes N and "
                             f"--process-id I together (or none of them, to let the launcher's environment tell)")
        return _checked(Launch("flags", coordinator, num_processes, process_id, "--coordinator"))
    env = {k: os.environ.get(k) for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
    if env["JAX_NUM_PROCESSES"] is not None or env["JAX_PROCESS_ID"] is not None:
        missing = [k for k, v in env.items() if v is None]
        if missing:
            raise ValueError(f"{', '.join(missing)} not set: set JAX_COORDINATOR_ADDRESS=HOST:PORT, "
                             f"JAX_NUM_PROCESSES=N and JAX_PROCESS_ID=I together")
        return _checked(Launch("environment", env["JAX_COORDINATOR_ADDRESS"], _env_int("JAX_NUM_PROCESSES"),
                               _env_int("JAX_PROCESS_ID"), "JAX_COORDINATOR_ADDRESS"))
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        return Launch("Open MPI") if _env_int("OMPI_COMM_WORLD_SIZE") > 1 else None
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in os.environ for k in slurm):  # inside `srun` (an sbatch script alone lacks the step's list)
        return _slurm() if _env_int("SLURM_NTASKS") > 1 else None
    import jax  # noqa: F401  (importing jax finds out whether this is a Cloud TPU VM; no backend starts)
    from jax._src import cloud_tpu_init

    if cloud_tpu_init.running_in_cloud_tpu_vm:
        from jax._src import clusters

        for env_type in clusters.ClusterEnv._cluster_types:
            if "Tpu" in env_type.__name__ and env_type.is_env_present():
                return Launch("Cloud TPU") if env_type.get_process_count() > 1 else None
    if "KUBERNETES_SERVICE_HOST" in os.environ and _has_module("kubernetes"):
        from jax._src.clusters import k8s_cluster

        if k8s_cluster.K8sCluster.is_env_present() and k8s_cluster.K8sCluster.get_process_count() > 1:
            return Launch("Kubernetes")
    return None


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _slurm() -> Launch:
    """A task of `srun`: its coordinator is the step's first node, on a port its job id gives
    (jax's rule; JAX_COORDINATOR_ADDRESS or JAX_COORDINATOR_PORT override it, as in jax)."""
    from jax._src.clusters.slurm_cluster import SlurmCluster

    job = _env_int("SLURM_JOB_ID")
    if "JAX_COORDINATOR_ADDRESS" in os.environ:
        address, origin = os.environ["JAX_COORDINATOR_ADDRESS"], "JAX_COORDINATOR_ADDRESS"
    else:
        port = os.environ.get("JAX_COORDINATOR_PORT")
        address = SlurmCluster.get_coordinator_address(None, port)
        origin = ("the first node of SLURM_STEP_NODELIST, port " +
                  (f"JAX_COORDINATOR_PORT={port}" if port else f"61440 + SLURM_JOB_ID % 4096 with SLURM_JOB_ID={job}"))
    return _checked(Launch("SLURM", address, _env_int("SLURM_NTASKS"), _env_int("SLURM_PROCID"), origin))


def _checked(launch: Launch) -> Launch | None:
    n, i = launch.num_processes, launch.process_id
    count, ident = _COUNT_AND_ID[launch.launcher]
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"{count}={n}, {ident}={i}: process id {i} of {n} processes is invalid: ids run from 0 to "
                         f"{count} - 1; start the processes with the launcher's own variables (or check what sets "
                         f"{ident})")
    host, _, port = (launch.coordinator or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"the coordinator {launch.coordinator!r} (from {launch.origin}): expected HOST:PORT of process "
                         f"0, the port from 1 to 65535")
    return launch if n > 1 else None


# ----- the joined processes -----------------------------------------------------------------


class _Joined:
    """This process's place in a launch, and its heartbeat threads."""

    def __init__(self, command: str, heartbeat_timeout: float):
        import jax
        from jax._src import distributed

        self.client = distributed.global_state.client
        self.index, self.count = jax.process_index(), jax.process_count()
        self.command, self.timeout = command, heartbeat_timeout
        self.calls: dict[str, int] = {}
        self.status = {"step": None}  # what the loop last told `note`
        self.on_stop: list = []  # called (best effort) before a lost peer stops this process
        self.stopping = threading.Event()
        self.peers: dict[int, dict] = {}

    def key(self, name: str) -> str:
        n = self.calls[name] = self.calls.get(name, 0) + 1  # every process calls in the same order
        return f"{_PREFIX}/{name}/{n}"

    # heartbeats ---------------------------------------------------------------------------

    def start_heartbeats(self) -> None:
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        self.client.key_value_set(f"{_PREFIX}/who/{self.index}", json.dumps(me))
        for j in range(self.count):
            self.peers[j] = json.loads(self.client.blocking_key_value_get(f"{_PREFIX}/who/{j}", 300_000))
        self.last_ok = time.monotonic()
        self.seen = {j: (None, time.monotonic()) for j in range(self.count)}
        threading.Thread(target=self._beat, name="modern_jax-heartbeat", daemon=True).start()
        threading.Thread(target=self._judge, name="modern_jax-watchdog", daemon=True).start()

    def _beat(self) -> None:
        period, n = max(self.timeout / 6, 0.2), 0
        while not self.stopping.is_set():
            n += 1
            try:
                self.client.key_value_set(f"{_PREFIX}/alive/{self.index}", f"{n} {self.status['step']}",
                                          allow_overwrite=True)
                beats = dict(self.client.key_value_dir_get(f"{_PREFIX}/alive/"))
                now = time.monotonic()
                for key, value in beats.items():
                    j = int(key.rsplit("/", 1)[1])
                    if value != self.seen[j][0]:
                        self.seen[j] = (value, now)
                self.last_ok = now
            except Exception:  # the coordinator is unreachable: the judge decides when that is too long
                pass
            self.stopping.wait(period)

    def _judge(self) -> None:
        while not self.stopping.wait(1.0):
            now = time.monotonic()
            if now - self.last_ok > self.timeout:
                self.lost(0, f"the coordinator (process 0 of {self.count}, {self._who(0)}) has not answered for "
                             f"{self.timeout:.0f} s")
            for j, (value, when) in self.seen.items():
                if j == self.index or value is None:
                    continue
                if value.startswith("failed"):
                    self.lost(j, f"process {j} of {self.count} ({self._who(j)}) stopped: {value[len('failed '):]}")
                if value != "done" and now - when > self.timeout:
                    self.lost(j, f"process {j} of {self.count} ({self._who(j)}) has sent no heartbeat for "
                                 f"{self.timeout:.0f} s (killed, out of memory or hung)")

    def _who(self, j: int) -> str:
        peer = self.peers.get(j) or {}
        return f"host {peer.get('host', '?')}, pid {peer.get('pid', '?')}"

    def lost(self, j: int, why: str) -> None:
        """Stop this process: another one is gone."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        step = self.status.get("step")
        at = f" at step {step}" if step is not None else ""
        resume = self.status.get("resume", "")
        print(f"modern-jax {self.command}: error: {why}{at}; stopping process {self.index} too.{resume}",
              file=sys.stderr, flush=True)
        for hook in self.on_stop:
            try:
                hook()
            except Exception:
                pass
        from modern_jax.multihost import watch

        watch.close()
        os._exit(LOST_EXIT)

    def publish(self, state: str) -> None:
        """`done` or `failed MESSAGE`: what the others' watchdogs read instead of a missing heartbeat."""
        self.stopping.set()
        try:
            self.client.key_value_set(f"{_PREFIX}/alive/{self.index}", state, allow_overwrite=True)
        except Exception:
            pass


_JOINED: _Joined | None = None


class JoinFailed(ValueError):
    """This process could not join its launch. Once jax's client has begun to join, the process
    cannot go on (or exit normally: jax's client aborts it) and must end with `os._exit`
    (`stranded()`), as `modern-jax` does after printing the message."""


_JOINING: dict | None = None  # jax's join under way on a thread of its own: {"error": ...} (`_join`)


def stranded() -> bool:
    """True when jax's client began to join a launch and did not finish: the process must end with
    `os._exit`, before jax's client or its shutdown at exit aborts it."""
    return _JOINING is not None


def start(launch: Launch | None, command: str, heartbeat_timeout: float = HEARTBEAT_TIMEOUT, log=None,
          join_timeout: float = JOIN_TIMEOUT) -> None:
    """Join the launch (nothing to do for one process), print this process's place, start heartbeats;
    `JoinFailed` when it cannot join within `join_timeout` seconds."""
    global _JOINED
    if launch is None or _JOINED is not None:
        return
    for flag, value in (("--heartbeat-timeout", heartbeat_timeout), ("--join-timeout", join_timeout)):
        if not 0 < value < float("inf"):
            raise ValueError(f"{flag} {value}: expected a positive number of seconds")
    import jax

    from modern_jax.multihost import watch

    deadline = time.monotonic() + join_timeout
    launch = _resolved(launch, join_timeout)
    n, i, address = launch.num_processes, launch.process_id, launch.coordinator
    _check_host(launch)
    if i == 0:
        _check_port_free(launch)
    else:
        _await_coordinator(launch, deadline, join_timeout)
    # from here jax's client may end this process from a native thread: the watcher turns that into one line
    watch.watch_stderr(JOIN_EXIT)
    watch.status(command=command, index=i, count=n, joining={"address": address, "origin": launch.origin,
                                                              "timeout": join_timeout})
    _join(launch, heartbeat_timeout, deadline, join_timeout)
    watch.status(joining=None)
    watch.ending = LOST_EXIT
    (log or watch.say)(f"process {jax.process_index()} of {jax.process_count()}, {jax.device_count()} devices "
                       f"({jax.local_device_count()} local), launched by {launch.launcher}")
    _JOINED = _Joined(command, heartbeat_timeout)
    _JOINED.start_heartbeats()
    watch.status(peers={str(j): peer for j, peer in _JOINED.peers.items()})


def _join(launch: Launch, heartbeat_timeout: float, deadline: float, timeout: float) -> None:
    """`jax.distributed.initialize` on a thread of its own, given `_JAX_GRACE_S` more than our
    `deadline`: this thread waits for it (in Python, so signals are handled) and says, at the
    deadline, which process could not join where (`JoinFailed`; the process is then `stranded`);
    a process other than 0 says at once when the coordinator it reached goes away."""
    global _JOINING
    import jax

    n, i, address = launch.num_processes, launch.process_id, launch.coordinator
    joining = _JOINING = {"error": None}

    def initialize():
        try:  # jax's own heartbeat outlasts ours, so ours names the lost process first
            jax.distributed.initialize(address, n, i, heartbeat_timeout_seconds=int(heartbeat_timeout) + 60,
                                       initialization_timeout=max(int(deadline - time.monotonic()), 1) + _JAX_GRACE_S)
        except BaseException as e:  # jax raises ValueError / RuntimeError / its runtime's error types
            joining["error"] = e

    thread = threading.Thread(target=initialize, name="modern_jax-join", daemon=True)
    thread.start()
    look, gone = time.monotonic() + 1.0, 0  # processes other than 0: is the coordinator still there?
    while thread.is_alive():
        thread.join(max(min(deadline - time.monotonic(), 0.1), 0.0))
        if not thread.is_alive():
            break
        if time.monotonic() >= deadline:
            raise JoinFailed(_not_joined(launch, timeout))
        if i > 0 and time.monotonic() >= look:
            look, gone = time.monotonic() + 1.0, 0 if _listening(launch) else gone + 1
            if gone >= 2:  # process 0 failed or was stopped: said now, not at the deadline
                raise JoinFailed(f"process {i} of {n} reached the coordinator at {address} (from {launch.origin}), "
                                 f"which went away before every process joined: process 0 failed or was stopped "
                                 f"(its own line says why); start every process of the launch again")
    e = joining["error"]
    if e is not None:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise JoinFailed(f"process {i} of {n} could not join the others at {address} ({first}): check that every "
                         f"process was started with the same launch variables ({launch.origin})")
    _JOINING = None


def _listening(launch: Launch) -> bool:
    """Something accepts connections at the coordinator's address."""
    try:
        with socket.create_connection(_host_port(launch.coordinator), timeout=1):
            return True
    except OSError:
        return False


def _not_joined(launch: Launch, timeout: float) -> str:
    """Why the launch did not form within `timeout` seconds, as this process sees it."""
    n, i = launch.num_processes, launch.process_id
    where = f"{launch.coordinator} (from {launch.origin})"
    if i == 0:
        return (f"process 0 of {n} waited {timeout:.0f} s at {where} and not every process joined: start all {n} "
                f"processes with the same launch variables (a process given other ones looks for another "
                f"coordinator); --join-timeout sets the wait")
    return (f"process {i} of {n} reached the coordinator at {where} and waited {timeout:.0f} s, and not every "
            f"process joined (or another launch holds that port): start all {n} processes with the same launch "
            f"variables; --join-timeout sets the wait")


def _resolved(launch: Launch, timeout: float) -> Launch:
    """`launch` with its coordinator, process count and id filled in as jax would find them."""
    if None not in (launch.coordinator, launch.num_processes, launch.process_id):
        return launch
    from jax._src import clusters

    address, n, i, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        launch.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS"), launch.num_processes, launch.process_id,
        None, None, int(timeout))
    if None in (address, n, i):
        raise ValueError(f"the {launch.launcher} launch does not say where process 0 is or how many processes it has: "
                         f"set JAX_COORDINATOR_ADDRESS=HOST:PORT, JAX_NUM_PROCESSES=N and JAX_PROCESS_ID=I")
    return _checked(dataclasses.replace(launch, coordinator=address, num_processes=n, process_id=i,
                                        origin=launch.origin or f"the {launch.launcher} launch"))


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _check_host(launch: Launch) -> None:
    host, port = _host_port(launch.coordinator)
    try:
        socket.getaddrinfo(host, port)
    except socket.gaierror as e:
        raise ValueError(f"process {launch.process_id} of {launch.num_processes}: the coordinator's host {host!r} "
                         f"(from {launch.origin}) cannot be resolved ({e.strerror}): check the launch's "
                         f"variables") from None


def _check_port_free(launch: Launch) -> None:
    """Process 0 serves the launch on its coordinator's port (on every address, as jax binds it):
    a port already taken is said at once instead of after the join's timeout."""
    _, port = _host_port(launch.coordinator)
    family, any_address = (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET, "0.0.0.0")
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: a closed run's port is free
        try:
            s.bind((any_address, port))
        except OSError as e:
            raise ValueError(f"process 0 cannot serve the launch on port {port} of this host ({e.strerror}): another "
                             f"program, or a run still alive, holds it (the port comes from {launch.origin}); stop "
                             f"it, or give every process another port (JAX_COORDINATOR_ADDRESS=HOST:PORT)") from None


def _await_coordinator(launch: Launch, deadline: float, timeout: float) -> None:
    """Processes other than 0 wait for something to listen on the coordinator's port, and check
    that it answers as a coordinator does (`_speaks_http2`): a port another program holds (where
    process 0 could not serve the launch) is said within seconds, not at the deadline."""
    host, port = _host_port(launch.coordinator)
    where = f"{launch.coordinator} (from {launch.origin})"
    while True:
        try:
            with socket.create_connection((host, port), timeout=2) as s:
                answer = _speaks_http2(s, min(_PROBE_S, max(deadline - time.monotonic(), 1.0)))
        except OSError:
            if time.monotonic() >= deadline:
                raise ValueError(
                    f"process {launch.process_id} of {launch.num_processes} found nothing listening at "
                    f"{launch.coordinator} within {timeout:.0f} s (the address comes from {launch.origin}): process "
                    f"0 was not started, failed, or listens elsewhere; start every process of the launch with the "
                    f"same launch variables (--join-timeout sets the wait)") from None
            time.sleep(0.2)
            continue
        if answer is None:
            return
        raise ValueError(f"process {launch.process_id} of {launch.num_processes} reached {where}, but what listens "
                         f"there is not a launch's coordinator ({answer}): another program holds that port, so process "
                         f"0 cannot serve the launch there; stop that program, or give every process another port "
                         f"(JAX_COORDINATOR_ADDRESS=HOST:PORT)")


# HTTP/2's client connection preface and an empty SETTINGS frame; a server's first frame is its SETTINGS
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4


def _speaks_http2(s: socket.socket, wait: float) -> str | None:
    """None if the server on `s` answers HTTP/2's preface with its SETTINGS frame (a gRPC server, as
    jax's coordinator is, does at once), else what it did instead. Not asked where jax's connection
    uses TLS (jax's mTLS settings), which this plain preface cannot speak."""
    import jax

    if any(getattr(jax.config, name, None) for name in ("jax_mtls_cert_file", "jax_mtls_ca_file")):
        return None
    try:
        s.settimeout(wait)
        s.sendall(_HTTP2_PREFACE)
        head = b""
        while len(head) < 9:
            chunk = s.recv(9 - len(head))
            if not chunk:
                return "it closed the connection without answering" if not head else "it answered in another protocol"
            head += chunk
    except socket.timeout:
        return f"it accepted the connection but said nothing within {wait:.0f} s"
    except OSError as e:
        return f"the connection failed: {e.strerror or type(e).__name__}"
    return None if head[3] == _SETTINGS else "it answered in another protocol"


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
                           join_timeout: float = JOIN_TIMEOUT) -> None:
    """In Python, what the commands do first: join the launch this process belongs to (found from
    its launcher's environment, or the three arguments given together), with heartbeats. A
    process that runs alone returns at once. Then `training.train(run)` is one run of them all.
    A launch that cannot form ends the process with one line and exit status 2 once jax's client
    has begun to join (`stranded`), else raises `JoinFailed`."""
    try:
        start(detect(coordinator_address, num_processes, process_id), "python", heartbeat_timeout,
              join_timeout=join_timeout)
    except JoinFailed as e:
        if not stranded():
            raise
        end(f"modern-jax: error: {e}", JOIN_EXIT)


def end(line: str, status: int) -> None:
    """Say `line` on stderr and end the process now (`os._exit`): what a process `stranded` in a
    join must do, before jax's client aborts it."""
    from modern_jax.multihost import watch

    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    watch.close()
    os._exit(status)


def joined() -> bool:
    """True in a launch of several processes."""
    return _JOINED is not None


def is_main() -> bool:
    """Process 0, the one that writes a run's files and prints."""
    return _JOINED is None or _JOINED.index == 0


def index() -> int:
    return 0 if _JOINED is None else _JOINED.index


def count() -> int:
    return 1 if _JOINED is None else _JOINED.count


def note(**status) -> None:
    """What a lost process's message says: `step=`, and `resume=` (how to continue)."""
    if _JOINED is not None:
        from modern_jax.multihost import watch

        _JOINED.status.update(status)
        watch.status(**status)


def on_stop(hook) -> None:
    """`hook()` runs before this process stops because another one was lost (e.g. a lock's release)."""
    if _JOINED is not None:
        _JOINED.on_stop.append(hook)


class Refused(ValueError):
    """An error decided once on process 0 and raised by every process."""


def decide(name: str, fn):
    """`fn()` on process 0; every process returns its (JSON) result, or raises its ValueError."""
    if _JOINED is None:
        return fn()
    key = _JOINED.key(f"decide/{name}")
    if _JOINED.index == 0:
        try:
            outcome = {"value": fn()}
        except ValueError as e:
            outcome = {"error": str(e)}
        _JOINED.client.key_value_set(key, json.dumps(outcome))
    else:
        outcome = json.loads(_JOINED.client.blocking_key_value_get(key, _WAIT_MS))
    if "error" in outcome:
        raise Refused(outcome["error"])
    return outcome["value"]


def gather(name: str, value) -> list:
    """Every process's (JSON) `value`, in process order."""
    if _JOINED is None:
        return [value]
    key = _JOINED.key(f"gather/{name}")
    _JOINED.client.key_value_set(f"{key}/{_JOINED.index}", json.dumps(value))
    return [json.loads(_JOINED.client.blocking_key_value_get(f"{key}/{j}", _WAIT_MS)) for j in range(_JOINED.count)]


def barrier(name: str) -> None:
    if _JOINED is not None:
        _JOINED.client.wait_at_barrier(_JOINED.key(f"barrier/{name}"), _WAIT_MS)


def check_same(name: str, facts: dict) -> None:
    """Every process holds the same `facts` (flat `name -> value`), else a Refused naming the differences."""
    if _JOINED is None:
        return
    everyone = gather(f"same/{name}", {k: _plain(v) for k, v in facts.items()})
    differences = []
    for j, theirs in enumerate(everyone[1:], 1):
        for k in sorted(set(everyone[0]) | set(theirs)):
            if everyone[0].get(k) != theirs.get(k):
                differences.append(f"process {j} ({_JOINED._who(j)}) has {k}={theirs.get(k)!r} where process 0 has "
                                   f"{everyone[0].get(k)!r}")
    if differences:
        more = f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""
        raise Refused(f"the processes of this launch differ before the first step: {'; '.join(differences[:3])}{more}: "
                      f"start every process with the same command, config and data")


def _plain(value):
    return json.loads(json.dumps(value, default=str))


def await_lost_peer() -> None:
    """A computation across the processes failed (a connection reset inside a collective: gloo,
    NCCL): most often because another process is gone. Wait, up to the heartbeat timeout and a
    little more, for the watchdog to name it and stop this process (exit `LOST_EXIT`, its one
    line), before the caller treats the error as this process's own."""
    if _JOINED is not None:
        time.sleep(_JOINED.timeout + 10)  # the watchdog's thread ends the process in the meantime


def finish(failed: str | None = None) -> None:
    """Tell the others how this process ends: `done`, or `failed` with a message of its own (an
    error the others did not share), which stops them at once."""
    if _JOINED is None:
        return
    _JOINED.publish("done" if failed is None else f"failed {failed}")


def flatten(tree: dict, prefix: str = "") -> dict:
    """`{"train": {"lr": 1}}` -> `{"train.lr": 1}`: the dotted names the messages show."""
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, name + "."))
        else:
            out[name] = v
    return out
