"""A run directory has one writer, a start that fails leaves nothing, and nothing we did not write
is replaced: the lock, the resume checks, exports inside runs, failed writes, other model shapes."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
import yaml

from common import QUICK_FLAG
from modern_jax.cli import main
from modern_jax.training import Trainer, outputs
from modern_jax.training.outputs import LOCK_FILE, RunLock

REPO = pathlib.Path(__file__).parent.parent
HF_CHAT = REPO / "tests" / "fixtures" / "hf_chat"
TINY = ["model.n_layers=1", "model.d_model=32", "model.d_ff=64", "train.steps=4", "train.batch_size=8",
        "train.seq_len=16", "train.log_every=1", "train.eval_every=0", "train.eval_windows=8",
        "train.final_eval_windows=8", "train.eval_batch_size=8", "train.checkpoint_every=2", "train.samples=0",
        "train.warmup_steps=1", "train.progress=false", "train.plot=false", "train.tensorboard=false"]


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("text") / "notes.txt"
    path.write_text(" ".join(f"word{i % 17}" for i in range(4000)))
    return path


def _train(out, text, *more) -> int:
    return main(["train", "--data", str(text), "--output-dir", str(out), *TINY, *more])


def _files(path: pathlib.Path) -> dict:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _live_holder(directory: pathlib.Path, pid: int, host: str | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / LOCK_FILE).write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid,
                                                   "command": "train", "token": "theirs", "since": "earlier"}))


# ----- one writer ----------------------------------------------------------------------------


def test_a_second_writer_of_a_run_directory_is_refused_naming_the_live_one(tmp_path, text, capsys):
    """Two trains into one new directory: the second meets the first's lock and writes nothing."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _live_holder(tmp_path / "run", other.pid)
        assert _train(tmp_path / "run", text) == 2
        err = capsys.readouterr().err
        assert f"is in use by modern-jax train (host {socket.gethostname()}, pid {other.pid}, since earlier)" in err
        assert "nothing was written" in err and err.count("\n") == 1
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [LOCK_FILE]  # untouched
        # convert refuses a directory being written as well
        assert main(["convert", "--from-hf", str(HF_CHAT), "--out", str(tmp_path / "run")]) == 2
        assert f"is being written by modern-jax train (host {socket.gethostname()}, pid {other.pid}" in \
            capsys.readouterr().err
    finally:
        other.kill()
        other.wait()


def test_a_lock_left_by_a_dead_run_is_taken_over_saying_so(tmp_path, text, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _live_holder(tmp_path / "run", dead.pid)
    assert _train(tmp_path / "run", text) == 0
    out = capsys.readouterr().out
    assert f"taking over the lock of modern-jax train (host {socket.gethostname()}, pid {dead.pid}, since earlier), " \
           f"which is no longer running (process {dead.pid} on this host is no longer running)" in out
    assert not (tmp_path / "run" / LOCK_FILE).exists()  # released at the end
    assert (tmp_path / "run" / "checkpoints" / "4").is_dir()


def test_another_hosts_lock_is_live_until_its_heartbeat_stops(tmp_path, monkeypatch):
    lock = RunLock(tmp_path / "run", "train.output_dir")
    _live_holder(tmp_path / "run", 1, host="elsewhere")
    with pytest.raises(ValueError, match="is in use by modern-jax train \\(host elsewhere, pid 1"):
        lock.acquire(lambda *_: None)
    old = time.time() - outputs.STALE_S - 5
    os.utime(tmp_path / "run" / LOCK_FILE, (old, old))
    said = []
    lock.acquire(said.append)
    assert "no heartbeat from host elsewhere for" in said[0]
    lock.release()


def test_a_lock_taken_over_is_noticed_by_its_old_holder(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs, "HEARTBEAT_S", 0.05)
    lock = RunLock(tmp_path / "run", "train.output_dir").acquire()
    _live_holder(tmp_path / "run", os.getpid())  # another writer's lock replaces ours
    deadline = time.monotonic() + 5
    while lock.lost is None and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(ValueError, match="is now held by modern-jax train .* this process stops writing there"):
        lock.check()
    lock.release()
    assert (tmp_path / "run" / LOCK_FILE).exists()  # not ours to remove


# ----- a failed start, a resume that would change the run ------------------------------------


def test_a_start_that_fails_late_leaves_nothing_behind(tmp_path, text, monkeypatch, capsys):
    def refuse(*_):
        raise ValueError("the compiler refused the step")

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "compile", refuse)
        assert _train(tmp_path / "new", text) == 2
    assert not (tmp_path / "new").exists()  # no config.yaml, no tokenizer.json, no lock
    assert _train(tmp_path / "run", text) == 0
    before = _files(tmp_path / "run")
    monkeypatch.setattr(Trainer, "compile", refuse)
    assert _train(tmp_path / "run", text, "train.steps=6") == 2  # a resume that fails rewrites nothing
    assert _files(tmp_path / "run") == before
    capsys.readouterr()


def test_evaluation_windows_past_the_validation_split_are_said(tmp_path, text, monkeypatch, capsys):
    """train.eval_windows and train.final_eval_windows beyond the windows the validation split
    holds are said as the run starts (it evaluates all of them), not used quietly."""
    def refuse(*_):  # stop once the start has said what it uses: nothing needs compiling here
        raise ValueError("stop here")

    monkeypatch.setattr(Trainer, "compile", refuse)
    assert _train(tmp_path / "run", text, "train.eval_every=2", "train.eval_windows=100000",
                  "train.final_eval_windows=100000") == 2
    out = capsys.readouterr().out
    said = re.findall(r"train\.(eval_windows|final_eval_windows)=100,000: the validation split has ([\d,]+) windows of "
                      r"16 tokens; evaluating all of them", out)
    assert [name for name, _ in said] == ["eval_windows", "final_eval_windows"], out
    assert 0 < int(said[0][1].replace(",", "")) < 100_000
    assert _train(tmp_path / "run", text, "train.eval_windows=100000") == 2  # eval_every=0: no periodic evaluation
    assert "train.eval_windows" not in capsys.readouterr().out


def test_a_resume_keeps_its_tokenizer_and_names_changed_settings(tmp_path, text, capsys):
    assert _train(tmp_path / "run", text) == 0
    before = _files(tmp_path / "run")
    capsys.readouterr()
    assert _train(tmp_path / "run", text, "data.tokenizer=char", "model.vocab_size=auto") == 2
    err = capsys.readouterr().err
    assert "was trained with data.tokenizer='byte' (its tokenizer.json keeps it), not 'char': a resumed run keeps " \
           "its tokenizer" in err
    assert _files(tmp_path / "run") == before  # config.yaml still names the tokenizer the run has
    assert _train(tmp_path / "run", text, "train.steps=6", "train.lr=0.003") == 0
    assert "resuming with changed settings: train.lr 0.002 -> 0.003; train.steps 4 -> 6" in capsys.readouterr().out
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]["steps"] == 6


def test_an_output_directory_below_a_file_or_unwritable_is_one_line(tmp_path, text, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    assert _train(tmp_path / "file" / "run", text) == 2
    assert capsys.readouterr().err.strip() == (
        f"modern-jax train: error: train.output_dir={str(tmp_path / 'file' / 'run')!r} lies below "
        f"{str(tmp_path / 'file')!r}, which is a file, not a directory: choose a new train.output_dir (--output-dir)")

    def read_only(self, *args, **kwargs):  # as root, permissions deny nothing: the file system's own error
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    assert _train(tmp_path / "ro" / "run", text) == 2
    assert capsys.readouterr().err.strip() == (
        f"modern-jax train: error: train.output_dir={str(tmp_path / 'ro' / 'run')!r} cannot be created (Read-only "
        f"file system); nothing was written: choose a new train.output_dir (--output-dir)")


# ----- what a checkpoint is, and a full disk ---------------------------------------------------


def test_a_checkpoint_of_another_model_shape_names_the_fields(tmp_path, text, capsys):
    assert _train(tmp_path / "run", text) == 0
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    config["model"]["n_layers"] = 3  # e.g. another run's config put beside these checkpoints
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(config))
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "checkpoint step 4 of" in err and "holds a model of another shape than this config (saved n_layers=1, " \
                                             "config n_layers=3)" in err
    assert "damaged" not in err and "step before it" not in err


@pytest.mark.skipif(os.geteuid() != 0, reason="a small file system needs `mount` (root)")
def test_a_full_disk_during_a_save_is_one_line_and_the_step_before_resumes(tmp_path, text):
    """A 1 MB tmpfs holds the run and its step-2 checkpoint, not step 4's. The command runs as a
    user runs it (a process of its own, whose log records reach stderr)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        run = disk / "run"
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=QUICK_FLAG)
        command = [sys.executable, "-m", "modern_jax.cli", "train", "--data", str(text), "--output-dir", str(run),
                   *TINY, "train.steps=8", "train.keep_checkpoints=4", "train.batch_size=4", "train.eval_batch_size=4"]
        full = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert full.returncode == 2
        err = [line for line in full.stderr.splitlines() if line.strip()]
        failed = re.match(r"modern-jax train: error: checkpoint step (\d+) could not be written to ", err[0])
        assert len(err) == 1 and failed, full.stderr
        intact = int(failed.group(1)) - 2
        assert err[0].endswith(f"{run / 'checkpoints'} (No space left on device); step {intact} before it is intact: "
                               "free space there (or lower train.keep_checkpoints) and run the same command to "
                               "resume") and intact >= 2, err
        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr
        assert f"resumed from {run / 'checkpoints' / str(intact)} at step {intact}" in resumed.stdout
        assert (run / "checkpoints" / "8").is_dir()
    finally:
        subprocess.run(["umount", str(disk)], check=False)


# ----- exports never replace what a run or a checkpoint holds ---------------------------------


def test_overwrite_never_replaces_a_runs_hf_directory(tmp_path, capsys):
    """A chat fine-tune keeps its source's tokenizer files in hf/; an export with --overwrite into
    it is refused and every file stays; a converted checkpoint's hf/ likewise."""
    run = tmp_path / "chat"  # what `train --init-from-hf` leaves: config.yaml, checkpoints/, hf/
    (run / "checkpoints" / "2").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {}, "train": {"steps": 2}}))
    shutil.copytree(HF_CHAT, run / "hf", ignore=shutil.ignore_patterns("*.safetensors", "*.jsonl", "*.npz"))
    before = _files(run)
    assert {"hf/tokenizer.json", "hf/tokenizer_config.json", "hf/config.json"} <= set(before)
    assert main(["convert", "--to-hf", str(run), "--out", str(run / "hf"), "--overwrite"]) == 2
    assert "lies inside a training run" in capsys.readouterr().err
    assert _files(run) == before
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "--from-hf", str(HF_CHAT), "--out", str(ckpt)]) == 0
    before = _files(ckpt)
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(ckpt / "hf"), "--overwrite"]) == 2
    assert "lies inside a converted checkpoint" in capsys.readouterr().err
    assert _files(ckpt) == before
    # a Hugging Face directory we did not write is not replaced either; one we wrote is
    shutil.copytree(HF_CHAT, tmp_path / "theirs")
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "theirs"), "--overwrite"]) == 2
    assert "that modern-jax did not write" in capsys.readouterr().err
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "ours")]) == 0
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "ours"), "--overwrite"]) == 0


# ----- the first command on a CPU host ---------------------------------------------------------


def test_train_on_a_host_without_a_tpu_says_nothing_of_libtpu(tmp_path, text):
    """libtpu is installed (the planner compiles for TPU topologies with it) and this host has no TPU:
    `train`, left to choose its platform, prints nothing on stderr (libtpu's start-up warnings were
    four lines and a source-location trace on every command)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE",
                                                            "TPU_WORKER_HOSTNAMES", "TF_CPP_MIN_LOG_LEVEL")}
    done = subprocess.run([sys.executable, "-m", "modern_jax.cli", "train", "--data", str(text), "--output-dir",
                           str(tmp_path / "run"), *TINY], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    assert "val_loss: " in done.stdout
    done = subprocess.run([sys.executable, "-m", "modern_jax.cli", "convert", "--to-hf", str(tmp_path / "run"), "--out",
                           str(tmp_path / "hf"), "--model-type", "qwen3"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "libtpu" not in done.stderr and "TPU" not in done.stderr, done.stderr
