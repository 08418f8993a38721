"""Many processes, one run: `modern-jax` launched as `srun` launches it (N processes x M host CPU
devices on localhost, the SLURM variables of each task, no code of the user's) against one process.

- A dense FSDP x tensor run trained by Muon, with a multi-token-prediction module, on 2 processes
  x 4 devices is one run: every step's loss and MTP loss equal 1 process x 8 devices' (whose
  Muon and MTP equal one device's, test_optimizer.py, test_mtp.py), each record is logged once,
  and the checkpoint evaluates in a launch of 2 other processes to the run's validation loss; the run is on object
  storage (a local stand-in of GCS), the processes sharing no folder.
- A Hugging Face checkpoint loaded on 2 x 4 (fsdp 8): each process reads about half its bytes,
  every slice equals one whole load, and the two write back what one process writes.
- A mixture whose experts (and the context axis) span processes: killed (SIGKILL of one process)
  on 2 x 4, resumed and stopped by SIGTERM on 4 x 2 (both axes across processes), finished on 1
  process: every step's loss, each time it ran, equals one uninterrupted process.
- The machinery, with no model to compile: a lost process and a lost coordinator stop the others
  with one line naming them and the step; processes that differ are refused before any step.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from modern_jax import paths
from modern_jax.cli import main
from object_storage import gcs
from processes import REPO, Launch, free_job_id, records, slurm_env, wait_for_step

TINY = ["--config", str(REPO / "configs" / "tiny.yaml"), "model.n_layers=1", "model.d_model=32", "model.d_ff=64",
        "train.batch_size=8", "train.seq_len=32", "train.log_every=1", "train.eval_every=0", "train.eval_windows=8",
        "train.final_eval_windows=8", "train.eval_batch_size=8", "train.samples=0", "train.warmup_steps=2",
        "train.progress=false", "train.plot=false", "data.tokenizer=char", "model.vocab_size=auto",
        "model.vocab_pad_to=8"]
CHAT = REPO / "tests" / "fixtures" / "hf_chat" / "chat.jsonl"
MOE = [*TINY, "--config", str(REPO / "configs" / "moe_tiny.yaml"), "model.expert_d_ff=32", "model.n_experts=4"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    """Twelve small documents: split by name, tokenized by characters (process 0 builds the
    vocabulary; the processes tokenize their shares of the documents together)."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(12):
        words = " ".join(f"w{(i * 7 + j * 3) % 23}" for j in range(150 + 20 * i))
        (root / f"doc{i:02d}.txt").write_text(f"document {i}: {words}\n")
    return root


def _losses(run: pathlib.Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run)}


def _in_process(argv: list[str], capsys) -> str:
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_a_slurm_launch_is_one_run_equal_to_one_process(tmp_path, corpus, capsys):
    """Trained by Muon, with a multi-token-prediction module: its loss too equals one process's.
    The two processes share no folder: their run is on object storage (a local stand-in of GCS,
    `object_storage.gcs`), where each writes its own shards of every checkpoint."""
    with gcs():
        _slurm_run_into_a_bucket(tmp_path, corpus, capsys)


def _slurm_run_into_a_bucket(tmp_path, corpus, capsys):
    run = [*TINY, "train.steps=10", "train.checkpoint_every=5", "train.optimizer=muon", "model.mtp_depth=1",
           f"--data={corpus}", "--mesh", "data=2,fsdp=2,tensor=2"]
    _in_process(["train", *run, "--output-dir", str(tmp_path / "one")], capsys)
    launch = Launch(["train", *run, "--output-dir", "gs://bucket/two"], n=2, devices=4, logdir=tmp_path)
    assert launch.wait() == [0, 0], launch.log(0)[-3000:] + launch.log(1)[-3000:]
    for i in range(2):  # the first line each process prints, before anything of the run
        assert launch.log(i).splitlines()[0] == f"process {i} of 2, 8 devices (4 local), launched by SLURM"
    one, two = tmp_path / "one", paths.as_path("gs://bucket/two")
    assert {p.name for p in (two / "checkpoints" / "10" / "params").iterdir()} >= {"ocdbt.process_0",
                                                                                    "ocdbt.process_1"}
    assert [r["step"] for r in records(two)] == list(range(1, 11))  # logged once, by process 0
    assert len(records(two, "val")) == 1
    expected = {r["step"]: (r["loss"], r["mtp_loss_1"]) for r in records(one)}
    for record in records(two):
        want = expected[record["step"]]
        assert abs(record["loss"] - want[0]) <= 1e-5 and abs(record["mtp_loss_1"] - want[1]) <= 1e-5, (record, want)
    assert "val_loss:" in launch.log(0) and "val_loss:" not in launch.log(1)  # results printed once
    assert len(list((two / "tensorboard").iterdir())) == 1
    assert not (two / ".modern-jax.lock").exists()
    # the checkpoint the two processes wrote evaluates to the run's validation loss in two processes of a
    # rehearsal launch, each feeding half of every batch: printed once
    evaluate = ["evaluate", "--checkpoint", "gs://bucket/two", "--batch-size", "8", "--max-windows", "8"]
    out = _in_process(["launch", "--processes", "2", "--devices", "2", *evaluate], capsys)
    [(rank, evaluated)] = re.findall(r"^\[(\d)\] loss: (\S+)$", out, re.M)
    assert rank == "0" and abs(float(evaluated) - records(two, "val")[0]["loss"]) <= 1e-4, out
    assert "[1] process 1 of 2, 4 devices (2 local), launched by environment" in out
    assert "Gloo" not in out and "peer ranks" not in out, out  # the CPU collectives' set-up is not relayed


SHARDED_LOAD = textwrap.dedent("""
    import sys
    import numpy as np
    from flax import nnx
    from modern_jax.multihost import distributed
    distributed.start(distributed.detect(), "convert")
    import jax
    from modern_jax.convert import from_hf, to_hf
    from modern_jax.convert.conversions import launch_mesh
    from modern_jax.convert.safetensors_files import SafetensorsFiles
    read, requested = SafetensorsFiles.read, []
    SafetensorsFiles.read = lambda self, entry, index=(): requested.append(read(self, entry, index)) or requested[-1]
    _, model = from_hf(sys.argv[1], mesh=launch_mesh())
    mine = sum(x.nbytes for x in requested)
    _, whole = from_hf(sys.argv[1])  # on this process's first device
    want = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(whole, nnx.Param))}
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        for shard in v[...].addressable_shards:
            assert np.array_equal(np.asarray(shard.data), want[path][shard.index]), path
    to_hf(model, sys.argv[2], model_type="llama", max_shard_bytes=1 << 30)
    print(f"read {mine} of {sum(x.nbytes for x in requested) - mine}", flush=True)
    distributed.finish()
""")


def test_two_processes_read_half_the_checkpoint_each_and_write_what_one_writes(tmp_path):
    """A Hugging Face checkpoint loaded on 2 processes x 4 devices (fsdp 8) is read slice by slice,
    each process about half its bytes, into the same parameters as one whole load; the two write it
    back, each its own shard file, as the tensors one process writes from the whole model."""
    from modern_jax.convert import from_hf, to_hf

    fixture = REPO / "tests" / "fixtures" / "hf" / "llama"
    launch = Launch([str(fixture), str(tmp_path / "two")], n=2, devices=4, logdir=tmp_path, script=SHARDED_LOAD)
    assert launch.wait() == [0, 0], launch.log(0)[-3000:] + launch.log(1)[-3000:]
    for i in range(2):
        mine, whole = map(int, re.search(r"^read (\d+) of (\d+)$", launch.log(i), re.M).groups())
        assert 0.5 <= mine / whole < 0.55, (i, mine, whole)  # the norms, which every device holds whole, by both
    _, model = from_hf(fixture)
    to_hf(model, tmp_path / "one", model_type="llama")
    from safetensors.numpy import load_file

    one = load_file(tmp_path / "one" / "model.safetensors")
    files = sorted((tmp_path / "two").glob("*.safetensors"))  # shards of at most half the model, 1 and 3 process 0's
    index = json.loads((tmp_path / "two" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(files) > 1 and sorted(set(index.values())) == [f.name for f in files]
    two = {k: v for f in files for k, v in load_file(f).items()}
    assert sorted(two) == sorted(one)
    for name in one:
        assert two[name].tobytes() == one[name].tobytes(), name


def test_experts_and_context_across_processes_survive_a_kill_and_a_stop(tmp_path, capsys):
    """Conversations (only the assistant's tokens trained) on expert=2 x context=4: on 2 x 4 the
    experts span the processes; on 4 x 2 both axes do (each process feeds its part of every
    sequence, laid out two_chunk)."""
    run = [*MOE, "train.steps=8", "train.checkpoint_every=3", f"--data={CHAT}", "data.format=chat",
           "--mesh", "expert=2,context=4",
           "--heartbeat-timeout", "8"]
    _in_process(["train", *run, "--output-dir", str(tmp_path / "one")], capsys)
    expected = _losses(tmp_path / "one")
    out = tmp_path / "many"
    seen: list[dict] = []

    # 2 x 4: one process is killed after the checkpoint at step 3; the other stops, naming it
    launch = Launch(["train", *run, "--output-dir", str(out)], n=2, devices=4, logdir=tmp_path)
    wait_for_step(out, 4, launch)
    while not (out / "checkpoints" / "3").is_dir():  # the save of step 3 has completed
        time.sleep(0.05)
    launch.procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    codes = launch.wait(timeout=150)
    assert codes[0] == 4 and time.monotonic() - killed < 120, launch.log(0)[-2000:]
    assert re.search(rf"process 1 of 2 \(host {socket.gethostname()}, pid {launch.procs[1].pid}\) has sent no "
                     rf"heartbeat for 8 s .* at step \d+; stopping process 0 too\. The newest checkpoint is step "
                     rf"3; run the same command again", launch.log(0)), launch.log(0)[-2000:]
    seen += records(out)

    # 4 x 2: resumes from step 3; SIGTERM to one process stops all four at one step, after a checkpoint
    before = len(records(out))
    launch = Launch(["train", *run, "--output-dir", str(out)], n=4, devices=2, logdir=tmp_path)
    while len(records(out)) < before + 2:
        assert all(p.poll() is None for p in launch.procs), launch.log(0)[-3000:]
        time.sleep(0.05)
    launch.procs[2].send_signal(signal.SIGTERM)
    assert launch.wait() == [0, 0, 0, 0], launch.log(0)[-3000:]
    stopped = int(re.search(r"saved a checkpoint at step (\d+) and stopped", launch.log(0)).group(1))
    assert (out / "checkpoints" / str(stopped)).is_dir()
    seen += records(out)[before:]

    # 1 process finishes the run
    before = len(records(out))
    _in_process(["train", *run, "--output-dir", str(out)], capsys)
    seen += records(out)[before:]
    assert {r["step"] for r in seen} == set(range(1, 9))
    for record in seen:  # every step, each time it ran, on 2, 4 and 1 processes
        assert abs(record["loss"] - expected[record["step"]]) <= 1e-5, record


JOIN = textwrap.dedent("""
    import sys, time
    from modern_jax.multihost import distributed
    distributed.start(distributed.detect(), "train", heartbeat_timeout=float(sys.argv[1]))
    distributed.note(step=7, resume=" The newest checkpoint is step 5; run the same command again (every process) to resume.")
    assert distributed.decide("x", lambda: {"from": distributed.index()}) == {"from": 0}
    assert distributed.gather("y", distributed.index()) == list(range(distributed.count()))
    print("joined", flush=True)
    time.sleep(120)
""")


@pytest.mark.parametrize("victim", [1, 0], ids=["a process", "the coordinator"])
def test_a_lost_process_stops_the_others_with_one_line(tmp_path, victim):
    launch = Launch(["3"], n=2, devices=1, logdir=tmp_path, script=JOIN)
    deadline = time.monotonic() + 60
    while not all("joined" in launch.log(i) for i in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in launch.procs), launch.log(0)
        time.sleep(0.05)
    launch.procs[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    survivor = 1 - victim
    launch.procs[survivor].wait(timeout=60)
    assert time.monotonic() - killed < 15
    assert launch.procs[survivor].returncode == 4  # stopped by a lost peer: not SIGABRT (-6), "Aborted" in a shell
    while "modern-jax train: error" not in launch.log(survivor) and time.monotonic() - killed < 20:
        time.sleep(0.05)  # its last line may still be on its way through the stderr watcher
    log = launch.log(survivor).strip()
    who = f"host {socket.gethostname()}, pid {launch.procs[victim].pid}"
    lost = (f"process 1 of 2 ({who}) has sent no heartbeat for 3 s (killed, out of memory or hung)" if victim else
            f"the coordinator (process 0 of 2, {who}) is gone (killed, out of memory or unreachable)")
    assert log.splitlines()[-1] == (f"modern-jax train: error: {lost} at step 7; stopping process {survivor} too. The "
                                    f"newest checkpoint is step 5; run the same command again (every process) to "
                                    f"resume."), log
    assert "stack trace" not in log and "Traceback" not in log, log


def test_processes_that_differ_are_refused_before_any_step(tmp_path, corpus):
    run = [*TINY, "train.steps=3", f"--data={corpus}", "--output-dir", str(tmp_path / "run")]
    launch = Launch(["train", *run], n=2, devices=1, logdir=tmp_path, per_process={1: ["train.lr=0.003"]})
    assert launch.wait() == [2, 2]
    assert re.search(r"modern-jax train: error: the processes of this launch differ before the first step: process 1 "
                     r"\(host .*, pid \d+\) has train.lr=0.003 where process 0 has 0.002", launch.log(0)), launch.log(0)
    assert "error" not in launch.log(1)  # said once, by process 0
    assert not (tmp_path / "run").exists()  # a failed start leaves nothing behind


# --- a launch that never forms: every process ends within seconds of the first failure, exit 2, one line ------

JOIN_TIMEOUT = 4


def _task(i: int, n: int, job: int, logdir: pathlib.Path, join_timeout: float | None = JOIN_TIMEOUT,
          **env) -> tuple[subprocess.Popen, pathlib.Path]:
    """Task `i` of an `srun` of `n` tasks in job `job` (SLURM's variables, with `env` on top), running
    `train` with a short join timeout (None: the default, 120 s)."""
    log = logdir / f"task{i}-{job}-{time.monotonic_ns()}.log"
    wait = [] if join_timeout is None else ["--join-timeout", str(join_timeout)]
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "modern_jax.cli", "train", *TINY, *wait, "--output-dir",
                                 str(logdir / "run")], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**slurm_env(i, n, 1, job), **env})
    return proc, log


def _one_line_each(tasks, started: float) -> tuple[list[str], list[float]]:
    """Every task ends with exit status 2 (not SIGABRT's -6: no "Aborted" in a shell) within the join
    timeout (and its start-up), saying one line of ours: `(lines, seconds from started to each end)`."""
    ended = [None] * len(tasks)
    while None in ended:
        assert time.monotonic() - started < JOIN_TIMEOUT + 60, [log.read_text() for _, log in tasks]
        for k, (proc, _) in enumerate(tasks):
            if ended[k] is None and proc.poll() is not None:
                ended[k] = time.monotonic() - started
        time.sleep(0.05)
    lines = []
    for (proc, log), took in zip(tasks, ended):
        text = log.read_text()
        assert proc.returncode == 2 and took < JOIN_TIMEOUT + 30, (proc.returncode, took, text)
        assert text.count("\n") == 1 and text.startswith("modern-jax train: error: "), text  # no native page
        lines.append(text.strip())
    return lines, ended


def _port(job: int) -> int:
    return 61440 + job % 4096  # jax's rule for SLURM


def test_a_process_whose_peer_never_starts_says_so(tmp_path):
    """Only process 1 of 2: nothing listens at its coordinator's address."""
    job, started = free_job_id(), time.monotonic()
    (line,), _ = _one_line_each([_task(1, 2, job, tmp_path)], started)
    assert line.startswith(f"modern-jax train: error: process 1 of 2 found nothing listening at localhost:"
                           f"{_port(job)} within {JOIN_TIMEOUT} s (the address comes from the first node of "
                           f"SLURM_STEP_NODELIST, port 61440 + SLURM_JOB_ID % 4096 with SLURM_JOB_ID={job}): process 0 "
                           f"was not started, failed, or listens elsewhere"), line


def test_a_launch_missing_a_process_ends_with_its_coordinator(tmp_path):
    """Processes 0 and 1 of 3 (process 2 never starts): process 0 says so at its join timeout, and
    process 1, which would wait longer, ends within seconds of it, saying its coordinator went away."""
    job, started = free_job_id(), time.monotonic()
    tasks = [_task(0, 3, job, tmp_path), _task(1, 3, job, tmp_path, join_timeout=JOIN_TIMEOUT + 40)]
    (first, second), ended = _one_line_each(tasks, started)
    where = (f"localhost:{_port(job)} (from the first node of SLURM_STEP_NODELIST, port 61440 + SLURM_JOB_ID % 4096 "
             f"with SLURM_JOB_ID={job})")
    assert first == (f"modern-jax train: error: process 0 of 3 waited {JOIN_TIMEOUT} s at {where} and not every "
                     f"process joined: start all 3 processes with the same launch variables (a process given other "
                     f"ones looks for another coordinator); --join-timeout sets the wait"), first
    assert second == (f"modern-jax train: error: process 1 of 3 reached the coordinator at {where}, which went away "
                      f"before every process joined: process 0 failed or was stopped (its own line says why); start "
                      f"every process of the launch again"), second
    assert ended[1] - ended[0] < 10, ended  # about 2 s of looking, not its own join timeout


def test_a_taken_coordinator_port_ends_every_process_within_seconds(tmp_path):
    """Another program holds the port (it accepts, never answers): process 0 says so at once, and
    process 1, which reaches that program, says within seconds that it is no coordinator, not after
    the default --join-timeout of 120 s."""
    job = free_job_id()
    with socket.socket(socket.AF_INET6) as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("::", _port(job)))
        squatter.listen()
        started = time.monotonic()
        (first, second), ended = _one_line_each([_task(i, 2, job, tmp_path, join_timeout=None) for i in range(2)],
                                                started)
    assert ended[0] < 20 and ended[1] - ended[0] < 15, ended  # at once (start-up included), then the probe's 5 s
    assert first.startswith(f"modern-jax train: error: process 0 cannot serve the launch on port {_port(job)} of "
                            f"this host (Address already in use): another program, or a run still alive, holds "
                            f"it"), first
    assert second == (f"modern-jax train: error: process 1 of 2 reached localhost:{_port(job)} (from the first node of "
                      f"SLURM_STEP_NODELIST, port 61440 + SLURM_JOB_ID % 4096 with SLURM_JOB_ID={job}), but what "
                      f"listens there is not a launch's coordinator (it accepted the connection but said nothing "
                      f"within 5 s): another program holds that port, so process 0 cannot serve the launch there; "
                      f"stop that program, or give every process another port (JAX_COORDINATOR_ADDRESS=HOST:PORT)"), \
        second


def test_tasks_of_different_jobs_each_say_where_they_looked(tmp_path):
    jobs = [free_job_id(), free_job_id()]
    started = time.monotonic()
    lines, ended = _one_line_each([_task(i, 2, jobs[i], tmp_path) for i in range(2)], started)
    assert abs(ended[1] - ended[0]) < 10, ended  # each at its join timeout, none waiting for the other's end
    assert f"process 0 of 2 waited {JOIN_TIMEOUT} s at localhost:{_port(jobs[0])} " in lines[0], lines
    assert f"SLURM_JOB_ID={jobs[0]}" in lines[0], lines
    assert f"process 1 of 2 found nothing listening at localhost:{_port(jobs[1])} " in lines[1], lines
    assert f"SLURM_JOB_ID={jobs[1]}" in lines[1], lines


def test_a_coordinator_that_refuses_the_join_ends_it_with_exit_status_2(tmp_path):
    """Process 2 of 3 reaches the coordinator of a launch of 2 (the same job, another task count),
    which refuses it: jax's client aborts the process, which exits with status 2 after its one line
    (not SIGABRT), while process 0 says at its timeout that not every process joined."""
    job, started = free_job_id(), time.monotonic()
    (waited, refused), _ = _one_line_each([_task(0, 2, job, tmp_path), _task(2, 3, job, tmp_path)], started)
    assert "process 0 of 2 waited" in waited and "not every process joined" in waited, waited
    assert refused.startswith(f"modern-jax train: error: process 2 of 3 reached localhost:{_port(job)} (from the "
                              f"first node of SLURM_STEP_NODELIST, port 61440 + SLURM_JOB_ID % 4096 with "
                              f"SLURM_JOB_ID={job}) but could not join a launch of 3 processes there "
                              f"(INVALID_ARGUMENT: Unexpected task registered with task=2, in RegisterTask)"), refused


def test_a_process_id_out_of_range_is_named_at_once(tmp_path):
    job, started = free_job_id(), time.monotonic()
    (waited, wrong), ended = _one_line_each([_task(0, 2, job, tmp_path),
                                             _task(1, 2, job, tmp_path, SLURM_PROCID="2")], started)
    assert ended[1] < 20, ended  # no wait for the others
    assert wrong == ("modern-jax train: error: SLURM_NTASKS=2, SLURM_PROCID=2: process id 2 of 2 processes is invalid: "
                     "ids run from 0 to SLURM_NTASKS - 1; start the processes with the launcher's own variables (or "
                     "check what sets SLURM_PROCID)"), wrong
    assert "not every process joined" in waited


@pytest.mark.quick
def test_a_process_that_joins_a_running_launch_again_is_named():
    """jax's ending (0.12's words, captured) when a second process 1 connects to a launch that has
    formed: every process's line names it, not a lost coordinator."""
    from modern_jax.multihost.watch import message

    fatal = (b"F1207 12:13:29.419559   17286 client.h:86] Terminating process because the JAX distributed service "
             b"detected fatal errors. This most likely indicates that another task died; see the other task logs for "
             b"more details. absl::Status: ABORTED: 1 unexpectedly tried to connect with a different incarnation. It "
             b"has likely restarted.\n\nRPC: /xla.coordination.CoordinationService/PollForError\n")
    state = {"command": "train", "index": 0, "count": 2, "step": 1, "resume": " No checkpoint has been written yet."}
    assert message(state, fatal) == (
        "modern-jax train: error: a second process 1 of 2 joined the running launch (two processes given the same "
        "id, or process 1 started again on its own) at step 1; stopping process 0 too. No checkpoint has been "
        "written yet.")


@pytest.mark.quick
def test_the_rehearsal_leaves_out_gloo_announcements_even_interleaved():
    """What one process of a rehearsal wrote (captured), gloo's announcements from two threads cut
    into each other, across lines too, between lines of its own."""
    from modern_jax.multihost.launch import WithoutGloo

    full = b"[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
    captured = [b"model: 821,120 parameters", full,
                b"[Gloo] Rank [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
                b"1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
                b"[Gloo] Rank 0 is connected to 7[Gloo] Rank 1 is connected to 7 peer ranks. Expected number of "
                b"connected peer ranks is : 7", b"", b"57 peer ranks. ", b"Expected number of connected peer ranks is : 7",
                b"step 4/4 | loss 5.0441", b"", b"--- sample 0 ---", b"2024", b"val_loss: 4.5205"]
    keep = WithoutGloo()
    kept = [line for line in map(keep, captured) if line is not None]
    assert kept == [b"model: 821,120 parameters", b"step 4/4 | loss 5.0441", b"", b"--- sample 0 ---", b"2024",
                    b"val_loss: 4.5205"]


@pytest.mark.quick
@pytest.mark.parametrize("env, expected", [
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[01-02]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
      "SLURM_LOCALID": "0"}, "SLURM"),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n01", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
      "SLURM_LOCALID": "0"}, None),  # one task: one process, no waiting for others
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, None),  # an sbatch script outside srun
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"}, "Open MPI"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, "environment"),
    ({}, None),
])
def test_the_launcher_is_found_from_its_environment(monkeypatch, env, expected):
    from modern_jax.multihost import distributed

    for key in [k for k in __import__("os").environ if k.startswith(("SLURM_", "OMPI_", "JAX_COORD", "JAX_NUM",
                                                                      "JAX_PROCESS"))]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    launch = distributed.detect()
    assert (launch and launch.launcher) == expected


@pytest.mark.quick
@pytest.mark.parametrize("env, message", [
    ({"JAX_NUM_PROCESSES": "2"}, "JAX_COORDINATOR_ADDRESS, JAX_PROCESS_ID not set"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     "process id 2 of 2 processes is invalid"),
    ({"JAX_COORDINATOR_ADDRESS": "h", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "expected HOST:PORT"),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n", "SLURM_NTASKS": "two", "SLURM_PROCID": "0",
      "SLURM_LOCALID": "0"}, "SLURM_NTASKS='two' is not an integer"),
    ({"JAX_COORDINATOR_ADDRESS": "localhost:abc", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     "the coordinator 'localhost:abc' (from JAX_COORDINATOR_ADDRESS): expected HOST:PORT of process 0, the port from "
     "1 to 65535"),
    ({"JAX_COORDINATOR_ADDRESS": "localhost:99999", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
     "the port from 1 to 65535"),
    ({"SLURM_JOB_ID": "12", "SLURM_STEP_NODELIST": "", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
      "SLURM_LOCALID": "0"}, "the coordinator ':61452' (from the first node of SLURM_STEP_NODELIST, port 61440 + "
                             "SLURM_JOB_ID % 4096 with SLURM_JOB_ID=12): expected HOST:PORT"),
    ({"SLURM_JOB_ID": "12", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2", "SLURM_PROCID": "-1",
      "SLURM_LOCALID": "0"}, "SLURM_NTASKS=2, SLURM_PROCID=-1: process id -1 of 2 processes is invalid"),
    ({"JAX_COORDINATOR_ADDRESS": "nohost.invalid:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     "process 0 of 2: the coordinator's host 'nohost.invalid' (from JAX_COORDINATOR_ADDRESS) cannot be resolved"),
])
def test_a_half_given_launch_is_one_line(monkeypatch, capsys, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["train", "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("modern-jax train: error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.quick
@pytest.mark.parametrize("argv, message", [
    (["--port", "99999", "train"], "modern-jax launch: error: --port 99999: expected a port from 1 to 65535"),
    (["frobnicate"], "modern-jax: error: argument command: invalid choice: 'frobnicate'"),
])
def test_a_rehearsal_refuses_what_its_processes_would_before_starting_them(argv, message, capsys, monkeypatch):
    import subprocess as started

    monkeypatch.setattr(started, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    try:
        status = main(["launch", "--processes", "2", "--devices", "2", *argv])
    except SystemExit as e:  # argparse's own refusal
        status = e.code
    err = capsys.readouterr().err
    assert status == 2 and message in err and "[0]" not in err, err


def test_the_readme_rehearsal_is_a_valid_run():
    """The `modern-jax launch ... train ...` of the docs' "Many hosts" section is a run its
    processes accept (its overrides resolve to a valid config), read as `train` reads them."""
    from modern_jax.cli import parse_args
    from modern_jax.cli.train import DEFAULT_CONFIG
    from modern_jax.sharding.mesh import parse_mesh
    from modern_jax.training import load_run_config

    section = (REPO / "docs" / "parallelism.md").read_text().split("## Many hosts", 1)[1]
    command = re.search(r"uv run modern-jax (launch .*?)\n\s*```", section, re.S).group(1).replace("\\\n", " ")
    launch = parse_args(shlex.split(command))
    args = parse_args(launch.rest)
    assert (launch.processes, launch.devices, args.command) == (2, 4, "train")
    mesh = parse_mesh(args.mesh)
    assert math.prod(mesh.values()) == launch.processes * launch.devices
    overrides = [*args.overrides, *(f"parallel.{axis}={size}" for axis, size in mesh.items())]
    load_run_config(args.config or DEFAULT_CONFIG, overrides)  # raises on an invalid run
