"""What a directory holds, who is writing into it, and the refusal to write into one that holds
something else.

Every command that writes names its kind of directory and claims it first:

| writer                        | writes into                         | with `overwrite`                 |
|-------------------------------|-------------------------------------|----------------------------------|
| `train` (`train.output_dir`)  | a new or empty directory, or its own run (resume) | -                  |
| `convert --from-hf`, `save_checkpoint` | a new or empty directory   | replaces a converted checkpoint  |
| `convert --to-hf`, `to_hf`    | a new or empty directory            | replaces an export of its own    |
| `harness --output-path`       | a new or empty directory, or its own results (adds files) | -          |

Anything else (a training run, one of its step directories, another kind of checkpoint,
files we did not write) is refused with what is there and how to proceed; nothing is
deleted unless `overwrite` is given, and then only a directory of the writer's own kind that
it wrote itself (a Hugging Face export carries the `MARKER` file), never one inside a run or a
checkpoint (a run's `hf/`, a checkpoint's `hf/`).

A directory has one writer at a time: `RunLock` takes `LOCK_FILE` (host, pid, command) before
anything is written there and keeps its modification time fresh (a heartbeat every
`HEARTBEAT_S`); a second writer is refused naming the live one. A lock left by a process that
is gone (same host: its pid is not running; another host: no heartbeat for `STALE_S`) is
taken over, saying so. `RunDirectory` is a training run's `train.output_dir` for one call of
`train`: claimed, locked (in a launch of several processes, by process 0 for all) and, if the
start fails, left as it was found.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import json
import os
import pathlib
import secrets
import shutil
import socket
import threading
import time

import yaml

from modern_jax import paths
from modern_jax.multihost import distributed

RUN, STEP, CHECKPOINT, HF, OTHER, EMPTY, MISSING = "run", "step", "checkpoint", "hf", "other", "empty", "missing"
PEFT = "peft"  # a LoRA adapter in PEFT's format
HARNESS = "harness"  # lm-eval's results and samples, written by `modern-jax harness`
LISTED = 4  # entries named in a description
LOCK_FILE = ".modern-jax.lock"  # the live writer of a directory (RunLock)
MARKER = ".modern-jax"  # in a Hugging Face export we wrote: what wrote it (`--overwrite` replaces only such)
OWN_FILES = (LOCK_FILE, MARKER)  # bookkeeping, not contents
HEARTBEAT_S = 10.0
STALE_S = 120.0  # a lock of another host whose heartbeat is this old is left by a dead run


@dataclasses.dataclass(frozen=True)
class Contents:
    kind: str  # one of the constants above
    description: str  # e.g. "a training run (checkpoints at steps 2, 4)"
    ours: bool = True  # written by modern-jax (a Hugging Face directory: only with the MARKER file)


def step_numbers(checkpoints) -> list[int]:
    """The steps under a run's `checkpoints/` (directories named by their step), ascending."""
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) if checkpoints.is_dir() else []


def _config_sections(path: pathlib.Path) -> dict:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _entries(path: pathlib.Path) -> list[str]:
    try:
        return sorted(p.name for p in path.iterdir() if p.name not in OWN_FILES)
    except PermissionError:
        raise ValueError(f"{str(path)!r} cannot be read (permission denied): choose a directory you own") from None


def describe(path) -> Contents:
    """The kind of `path`: missing, empty, a training run, a step of one, a converted
    checkpoint, a Hugging Face model directory, or other files."""
    path = paths.as_path(path)
    if not path.exists():
        return Contents(MISSING, "nothing")
    if not path.is_dir():
        return Contents(OTHER, "a file, not a directory", ours=False)
    names = _entries(path)
    if not names:
        return Contents(EMPTY, "nothing")
    entries = set(names)
    sections = _config_sections(path / "config.yaml") if "config.yaml" in entries else {}
    if "checkpoints" in entries or "train" in sections or "metrics.jsonl" in entries:
        steps = step_numbers(path / "checkpoints")
        listed = ", ".join(map(str, steps[-LISTED:]))
        return Contents(RUN, f"a training run ({'checkpoints at steps ' + listed if steps else 'no checkpoint yet'})")
    if "params" in entries and ({"state", "meta", "_CHECKPOINT_METADATA"} & entries or
                                (path.name.isdigit() and path.parent.name == "checkpoints")):
        return Contents(STEP, f"step {path.name} of a training run (params/, state/, meta/)")
    if "params" in entries and "config.yaml" in entries:
        return Contents(CHECKPOINT, "a converted checkpoint (config.yaml and params/)")
    if "adapter_config.json" in entries:
        return Contents(PEFT, "a PEFT adapter (adapter_config.json)", ours=(path / MARKER).is_file())
    if MARKER in entries or (path / MARKER).is_file():
        written = _marker_kind(path)
        if written == HARNESS:
            return Contents(HARNESS, "benchmark results of modern-jax harness")
    weights = [n for n in names if n.endswith(".safetensors")]
    if "config.json" in entries or weights:
        return Contents(HF, f"a Hugging Face model (config.json and {len(weights)} safetensors files)",
                        ours=(path / MARKER).is_file())
    shown = [n + "/" if (path / n).is_dir() else n for n in names[:LISTED]]
    more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return Contents(OTHER, f"{len(names)} entries that modern-jax did not write ({', '.join(shown)}{more})", ours=False)


def _marker_kind(path: pathlib.Path) -> str | None:
    try:
        return json.loads((path / MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def enclosing(path) -> tuple[pathlib.Path, Contents] | None:
    """The training run, step or converted checkpoint that `path` lies inside, if any."""
    if paths.is_remote(path):  # a run on object storage is claimed as a whole: nothing lies inside one
        return None
    for parent in list(pathlib.Path(path).absolute().parents)[:3]:
        contents = describe(parent)
        if contents.kind in (RUN, STEP, CHECKPOINT):
            return parent, contents
    return None


def mark(path, kind: str, how: str) -> None:
    """Record in `path` that modern-jax wrote it (`how`: the command), so `overwrite` may replace it."""
    (paths.as_path(path) / MARKER).write_text(json.dumps({"kind": kind, "written_by": how}) + "\n")


def claim(path, kind: str, what: str, *, overwrite: bool = False, hint: str = "choose a new directory",
          dry_run: bool = False) -> Contents:
    """Check that the writer of `kind` may write into `path` (named `what` in messages);
    with `overwrite`, a directory of the same kind that modern-jax wrote, outside any run or
    checkpoint, is emptied first (not with `dry_run`, which only checks). Returns what was
    there before (of kind `kind`, missing or empty)."""
    if kind in (RUN, CHECKPOINT):  # written by Orbax
        paths.check_checkpoint_place(path, what)
    path = paths.as_path(path)
    contents = describe(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what}={str(path)!r} is a file, not a directory: {hint}")
    for parent in () if paths.is_remote(path) else path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{what}={str(path)!r} lies below {str(parent)!r}, which is a file, not a directory: "
                                 f"{hint}")
            break
    if kind != RUN:  # a run's own writer meets its lock in RunLock
        refuse_if_locked(path, what, hint)
    if contents.kind in (MISSING, EMPTY):
        return contents
    if contents.kind == kind and kind in (RUN, HARNESS):  # the trainer resumes its own run; results add up
        return contents
    if contents.kind == kind and overwrite:
        inside = enclosing(path)
        if inside is not None:
            raise ValueError(f"{what}={str(path)!r} lies inside {inside[1].description} ({str(inside[0])!r}); "
                             f"--overwrite never replaces a directory of a run or a checkpoint, and nothing was "
                             f"written: {hint} outside it")
        if not contents.ours:
            raise ValueError(f"{what}={str(path)!r} holds {contents.description} that modern-jax did not write (no "
                             f"{MARKER} file); --overwrite replaces only an export of its own, and nothing was "
                             f"written: {hint}, or remove it yourself")
        if dry_run:
            return contents
        for child in path.iterdir():
            paths.remove_tree(child)
        return contents
    again = " or pass --overwrite (overwrite=True) to replace it" if contents.kind == kind else ""
    raise ValueError(f"{what}={str(path)!r} already holds {contents.description}; nothing was written: "
                     f"{hint}{again}")


@contextlib.contextmanager
def staged(out, kind: str, what: str, *, overwrite: bool = False, command: str):
    """The directory a writer that needs a local disk (safetensors, Orbax's single-file writes,
    lm-eval's results) writes `out` into: `out` itself, or, for `out` on object storage, a local
    temporary directory whose files each process copies up to `out` when the writer is done.
    `out` is claimed first (`claim`: new or empty, or with `overwrite` an export of `kind` that
    modern-jax wrote, emptied only once the files are ready), and locked while they are copied."""
    if not paths.is_remote(out):
        yield out
        return
    import tempfile

    main = distributed.is_main()
    if main:
        claim(out, kind, what, overwrite=overwrite, dry_run=True)
    with tempfile.TemporaryDirectory(prefix="modern_jax-staged-") as temporary:
        local = pathlib.Path(temporary) / "out"
        yield local  # the writer makes it
        target = paths.as_path(out)
        if main:
            claim(target, kind, what, overwrite=overwrite)  # emptied now, with --overwrite
        with RunLock(target, what, command=command).acquire() if main else contextlib.nullcontext():
            distributed.barrier(f"{command}/staged")
            for file in paths.files_under(local):  # this process's files
                paths.copy(file, target / file.relative_to(local).as_posix())
            distributed.barrier(f"{command}/copied")


# ----- one writer per directory ------------------------------------------------------


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` (Linux `/proc`), to tell a reused pid from the lock's owner."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, starttime


def read_lock(path) -> dict | None:
    """The holder a lock file names (a dict), or None when it is unreadable or not ours."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return holder if isinstance(holder, dict) else None


def _fs_age(path) -> float:
    """Seconds since `path` was last modified, by the clock of the file system (or object store)
    that holds it (a shared file system's hosts may disagree on the time)."""
    probe = path.parent / f".modern-jax-clock-{secrets.token_hex(4)}"
    try:
        probe.write_text("")
        now = paths.mtime(probe)
        probe.unlink()
    except OSError:
        now = time.time()
    try:
        return max(0.0, now - paths.mtime(path))
    except FileNotFoundError:
        return 0.0


def _describe_holder(holder: dict) -> str:
    n = holder.get("processes", 1)
    several = f", {n} processes" if n and n > 1 else ""
    return (f"modern-jax {holder.get('command', '?')} (host {holder.get('host', '?')}, pid {holder.get('pid', '?')}"
            f"{several}, since {holder.get('since', '?')})")


def stale(path, holder: dict | None) -> str | None:
    """Why the lock at `path` was left by a process that is gone, or None if its writer may be live."""
    age = _fs_age(path)
    if holder is None:  # a writer killed between creating the file and writing it
        return f"an unreadable lock, {age:.0f} s old" if age > HEARTBEAT_S else None
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        pid = holder["pid"]
        started = _process_start(pid)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"process {pid} on this host is no longer running"
        except PermissionError:
            pass  # alive, another user's
        if started is not None and holder.get("started") not in (None, started):
            return f"pid {pid} now belongs to another process"
        return None
    if age > STALE_S:
        return f"no heartbeat from host {holder.get('host')} for {age:.0f} s"
    return None


def refuse_if_locked(path, what: str, hint: str) -> None:
    """A directory with a live writer (a run in progress, a conversion) is refused, naming it."""
    lock = paths.as_path(path) / LOCK_FILE
    if lock.exists():
        holder = read_lock(lock)
        if stale(lock, holder) is None:
            raise ValueError(f"{what}={str(path)!r} is being written by {_describe_holder(holder or {})}; nothing "
                             f"was written: wait for it to finish or {hint}")


class RunLock:
    """The one writer of `directory` (created if missing), from `acquire()` to `release()`.

    The lock file names this host, pid and command; a thread refreshes its modification
    time every `HEARTBEAT_S` and checks that it is still ours. On object storage, which has no
    exclusive create, the lock is written and read back, and two writers that start within
    the same moment are told apart at the first heartbeat (the one whose lock was overwritten
    stops: `check`)."""

    def __init__(self, directory, what: str, command: str = "train", processes: int = 1, hint: str = ""):
        self.directory = paths.as_path(directory)
        self.path = self.directory / LOCK_FILE
        self.what, self.hint = what, hint or f"choose another {what}"
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": _process_start(os.getpid()),
                       "command": command, "processes": processes, "token": secrets.token_hex(8),
                       "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        self.created = False  # the directory did not exist before acquire()
        self.lost: str | None = None  # set when another writer took the lock over
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, log=print) -> RunLock:
        d, what = self.directory, self.what
        self.created = not d.exists()
        if paths.is_remote(d):
            return self._acquire_remote(log)
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{what}={str(d)!r} cannot be created ({e.strerror or e}); nothing was written: "
                             f"{self.hint}") from None
        for _ in range(3):
            try:
                with _dir_flock(d):
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    with os.fdopen(fd, "w") as f:
                        f.write(json.dumps(self.holder) + "\n")
                        f.flush()
                        os.fsync(f.fileno())
            except FileExistsError:
                holder = read_lock(self.path)
                self._take_over(holder, log)
                with contextlib.suppress(FileNotFoundError):
                    if read_lock(self.path) == holder:
                        os.unlink(self.path)
                continue
            except OSError as e:
                self._forget()
                reason = "a read-only file system" if e.errno == errno.EROFS else (e.strerror or str(e))
                raise ValueError(f"{what}={str(d)!r} is not writable ({reason}); nothing was written: "
                                 f"{self.hint}") from None
            return self._held()
        raise self._changed_hands()

    def _acquire_remote(self, log) -> RunLock:
        """`acquire` on object storage: the lock written unless a live one is there, then read back."""
        d, what = self.directory, self.what
        for _ in range(3):
            if self.path.exists():
                self._take_over(read_lock(self.path), log)
            try:
                self.path.write_text(json.dumps(self.holder) + "\n")
            except OSError as e:
                raise ValueError(f"{what}={str(d)!r} is not writable ({e.strerror or e}); nothing was written: "
                                 f"{self.hint}") from None
            if (read_lock(self.path) or {}).get("token") == self.holder["token"]:
                return self._held()
        raise self._changed_hands()

    def _take_over(self, holder: dict | None, log) -> None:
        """The lock `holder` left: refused while its writer may be live, else said and taken over."""
        why = stale(self.path, holder)
        if why is None:
            self._forget()
            raise ValueError(f"{self.what}={str(self.directory)!r} is in use by {_describe_holder(holder or {})}; "
                             f"nothing was written: wait for it to finish, stop it, or {self.hint}") from None
        log(f"{self.what}={str(self.directory)!r}: taking over the lock of {_describe_holder(holder or {})}, which is "
            f"no longer running ({why})")

    def _held(self) -> RunLock:
        """The lock is ours: its heartbeat starts."""
        self._thread = threading.Thread(target=self._beat, name="modern_jax-lock", daemon=True)
        self._thread.start()
        return self

    def _changed_hands(self) -> ValueError:
        return ValueError(f"{self.what}={str(self.directory)!r}: its lock changed hands three times while taking it: "
                          f"another writer is starting there; {self.hint}")

    def _forget(self) -> None:
        """Leave no directory behind that acquire() created for nothing."""
        if self.created and not paths.is_remote(self.directory):
            with contextlib.suppress(OSError):
                self.directory.rmdir()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            holder = read_lock(self.path)
            if holder is None or holder.get("token") != self.holder["token"]:
                self.lost = f"the lock of {self.what}={str(self.directory)!r} is now held by " \
                            f"{_describe_holder(holder or {})}"
                return
            with contextlib.suppress(OSError):
                self.path.write_text(json.dumps(self.holder) + "\n") if paths.is_remote(self.path) else \
                    os.utime(self.path)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def check(self) -> None:
        """Raise if another writer has taken the directory over (before this one writes more)."""
        if self.lost:
            raise ValueError(f"{self.lost}; this process stops writing there")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        holder = read_lock(self.path)
        if holder is not None and holder.get("token") == self.holder["token"]:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


@contextlib.contextmanager
def _dir_flock(directory: pathlib.Path):
    """An advisory lock on the directory itself while a lock file is checked and taken (two
    processes of one host cannot both take over a stale lock); a file system without it goes on."""
    import fcntl

    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class RunDirectory:
    """`train.output_dir` for one call of `train`: claimed, locked and, if the start fails,
    left as it was found. In a launch of several processes, process 0 decides and locks; the
    others follow its verdict and check that they see the same directory.

    `root` is the run directory and `path` where the run writes its files. They are one local
    directory, except on object storage (`gs://`, `s3://`): there the checkpoints go to `root`
    directly (Orbax writes every process's shards there) and the other files (config.yaml,
    tokenizer.json, metrics.jsonl, TensorBoard's events, samples, the plot) into a local staging
    directory `path`, which starts as a copy of the run's (a resumed run's metrics go on) and is
    copied to `root` by `sync` (after each checkpoint, and at the end)."""

    WHAT, HINT = "train.output_dir", "choose a new train.output_dir (--output-dir)"

    def __init__(self, root, log):
        self.root, self.log = paths.absolute(root), log
        self.remote = paths.is_remote(root)
        self.path = None if self.remote else self.root  # the staging directory: made on entering
        self.lock: RunLock | None = None
        self.started = False  # the run's files are written: a failure from here on keeps them
        self.made: list[pathlib.Path] = []  # what this start wrote before `started` (removed on failure)
        self._synced: dict[str, tuple] = {}  # staged file -> (size, mtime) when last copied to `root`

    def __enter__(self) -> RunDirectory:
        def take() -> dict:
            claim(self.root, RUN, self.WHAT, hint=self.HINT)
            self.lock = RunLock(self.root, self.WHAT, processes=distributed.count(), hint=self.HINT)
            self.lock.acquire(self.log)
            claim(self.root, RUN, self.WHAT, hint=self.HINT)  # the lock is ours: look again
            return {"token": self.lock.holder["token"]}

        try:
            token = distributed.decide("run_directory", take)["token"]
            if self.remote:
                self._stage()
        except BaseException:
            self._release()
            raise
        if self.lock is None:  # another process's view of the directory process 0 locked
            lock = self.root / LOCK_FILE
            seen = read_lock(lock) if lock.exists() else None
            if (seen or {}).get("token") != token:
                raise distributed.Refused(
                    f"{self.WHAT}={str(self.root)!r} is not the directory that process 0 locked (its lock is not "
                    f"there): every process must see the run directory on a shared file system (NFS, a GCS "
                    f"mount, ...) or on object storage (gs://...), as checkpoints need it")
        distributed.on_stop(self._stopped)
        return self

    def _stopped(self) -> None:
        """Another process was lost: what the run wrote goes to the run directory, as far as it can."""
        if self.started:
            with contextlib.suppress(Exception):
                self.sync()
        self.abandon()

    def _stage(self) -> None:
        """The local staging directory, holding the run's files other than its checkpoints (process 0)."""
        import tempfile

        self.path = pathlib.Path(tempfile.mkdtemp(prefix="modern-jax-run-"))
        if not distributed.is_main() or not self.root.exists():
            return
        for file in paths.files_under(self.root):
            name = file.relative_to(self.root).as_posix()
            if name.split("/")[0] not in self.REMOTE_ONLY:
                paths.copy(file, self.path / name)
                self._synced[name] = self._stamp(self.path / name)

    REMOTE_ONLY = ("checkpoints", "damaged_checkpoints", LOCK_FILE)  # never staged, never copied back

    @staticmethod
    def _stamp(file: pathlib.Path) -> tuple:
        stat = file.stat()
        return stat.st_size, stat.st_mtime_ns

    def sync(self) -> None:
        """Copy the staged files written since the last copy to the run directory (process 0, on
        object storage; elsewhere nothing to do)."""
        if not self.remote or self.path is None or not distributed.is_main():
            return
        for file in paths.files_under(self.path):
            name, stamp = file.relative_to(self.path).as_posix(), self._stamp(file)
            if name.split("/")[0] not in self.REMOTE_ONLY and self._synced.get(name) != stamp:
                paths.copy(file, self.root / name)
                self._synced[name] = stamp

    def check(self) -> None:
        """Stop before writing more if another writer took the directory over."""
        if self.lock is not None:
            self.lock.check()

    def abandon(self) -> None:
        """A start that fails removes what it wrote (all of a directory it created), then unlocks."""
        if self.lock is not None and not self.started:
            if self.lock.created:
                if self.root.exists():
                    with contextlib.suppress(OSError):
                        paths.remove_tree(self.root)
            else:
                for path in self.made:
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        self._release()

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if self.remote and self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None

    def __exit__(self, *exc):
        if self.started:
            self.sync()
        self.abandon()
