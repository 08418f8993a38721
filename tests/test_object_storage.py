"""Run directories and checkpoints on object storage: `gs://` served by a local stand-in of GCS
(`object_storage.gcs`, an emulator on localhost that gcsfs and TensorStore both speak to), and
`s3://` by moto's S3 server (`object_storage.s3`, which s3fs and TensorStore both speak to)."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from modern_jax import paths
from modern_jax.cli import main
from modern_jax.training import outputs
from modern_jax.training.checkpoint import Checkpointer

from object_storage import gcs, s3

REPO = pathlib.Path(__file__).parent.parent
TINY = ["--config", str(REPO / "configs" / "tiny.yaml"), "model.n_layers=1", "model.d_model=32", "model.d_ff=64",
        "train.batch_size=8", "train.seq_len=32", "train.log_every=1", "train.eval_every=0", "train.eval_windows=8",
        "train.final_eval_windows=8", "train.eval_batch_size=8", "train.samples=0", "train.warmup_steps=0",
        "train.progress=false", "data.tokenizer=char", "model.vocab_size=auto", "model.vocab_pad_to=8",
        "train.steps=4", "train.checkpoint_every=2", "train.schedule=constant"]


def losses(text: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, text.splitlines()) if r["split"] == "train"}


@pytest.fixture(scope="module")
def bucket():
    with gcs() as url:
        yield url


def test_a_run_on_object_storage_resumes_exactly_and_is_read_back(tmp_path, bucket, capsys):
    """2 steps into gs://, stop, resume for 2: the losses of one local run of 4 steps bit for bit;
    the run's files are there beside its checkpoints (its metrics going on from the first call),
    and evaluate reads the checkpoint there as it reads the local one."""
    assert main(["train", *TINY, "--output-dir", str(tmp_path / "local")]) == 0
    local = losses((tmp_path / "local" / "metrics.jsonl").read_text())
    assert main(["train", *TINY, "train.steps=2", "--output-dir", "gs://bucket/run"]) == 0
    assert main(["train", *TINY, "--output-dir", "gs://bucket/run"]) == 0
    assert "resumed from gs://bucket/run/checkpoints/2 at step 2" in capsys.readouterr().out
    run = paths.as_path("gs://bucket/run")
    assert losses((run / "metrics.jsonl").read_text()) == local  # tolerance 0
    names = {f.relative_to(run).as_posix() for f in paths.files_under(run)}
    assert {"config.yaml", "tokenizer.json", "loss.png", "checkpoints/4/checksums.json"} <= names, names
    assert not any(n.startswith(".modern-jax") for n in names), names  # the lock is released
    recorded = json.loads((run / "checkpoints" / "4" / "checksums.json").read_text())["files"]
    assert recorded["params/_METADATA"][0] == paths.size(run / "checkpoints" / "4" / "params" / "_METADATA")
    capsys.readouterr()
    for where in (str(tmp_path / "local"), "gs://bucket/run"):
        assert main(["evaluate", "--checkpoint", where]) == 0
    first, second = [line for line in capsys.readouterr().out.splitlines() if line.startswith("loss: ")]
    assert first == second, (first, second)


@pytest.mark.quick
def test_a_lock_and_a_cut_off_save_on_object_storage(bucket):
    """A second writer is refused naming the live one; a step whose save never finished (no
    commit file) is removed when the run's checkpointer opens, a finished one kept."""
    lock = outputs.RunLock("gs://bucket/locked", "train.output_dir").acquire()
    try:
        with pytest.raises(ValueError, match=r"train.output_dir='gs://bucket/locked' is in use by modern-jax train "
                                             r"\(host .*, pid \d+"):
            outputs.RunLock("gs://bucket/locked", "train.output_dir").acquire()
    finally:
        lock.release()
    assert not paths.as_path("gs://bucket/locked/" + outputs.LOCK_FILE).exists()
    outputs.RunLock("gs://bucket/locked", "train.output_dir").acquire().release()  # free again

    checkpoints = paths.as_path("gs://bucket/cut/checkpoints")
    (checkpoints / "6" / "params" / "_METADATA").write_text("{}")  # a save killed before its commit file
    (checkpoints / "4" / "params" / "_METADATA").write_text("{}")
    (checkpoints / "4" / "commit_success.txt").write_text("done")
    Checkpointer(checkpoints).manager.close()
    assert sorted(p.name for p in checkpoints.iterdir()) == ["4"]


def test_prepare_writes_to_object_storage_what_it_writes_on_a_disk(tmp_path, bucket):
    """The shards, index and tokenizer of a JSON Lines corpus prepared into gs:// equal a local
    preparation's byte for byte."""
    from modern_jax.data import DataConfig
    from modern_jax.data.prepare import prepare

    source = tmp_path / "c.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i}: " + "word " * (i % 7)}) + "\n" for i in range(23)))
    prepare(DataConfig(path=str(source)), tmp_path / "local", documents_per_shard=4, log=lambda _: None)
    prepare(DataConfig(path=str(source)), "gs://bucket/prepared", documents_per_shard=4, log=lambda _: None)
    remote = paths.as_path("gs://bucket/prepared")
    assert {p.name: p.read_bytes() for p in remote.iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}


def tree(directory) -> dict[str, bytes]:
    directory = paths.as_path(directory)
    return {f.relative_to(directory).as_posix(): f.read_bytes() for f in paths.files_under(directory)}


def test_convert_and_harness_write_to_object_storage_what_they_write_on_a_disk(tmp_path, bucket, capsys):
    """`convert --from-hf` into gs:// (Orbax writing there), `convert --to-hf` from there into
    gs:// (safetensors staged on the local disk, then copied up) and `harness --output-path gs://`
    write the files they write locally, byte for byte (the harness: its results); a second
    conversion into the same place is refused by name unless --overwrite, which replaces it."""
    fixture = REPO / "tests" / "fixtures" / "hf" / "llama"
    for where in (tmp_path / "ckpt", "gs://bucket/ckpt"):
        assert main(["convert", "--from-hf", str(fixture), "--out", str(where)]) == 0, capsys.readouterr().err
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    assert main(["convert", "--to-hf", "gs://bucket/ckpt", "--out", "gs://bucket/hf"]) == 0, capsys.readouterr().err
    local = tree(tmp_path / "hf")
    assert {"model.safetensors", "config.json", outputs.MARKER} <= local.keys() and tree("gs://bucket/hf") == local
    assert {"config.yaml", "hf/config.json", "checksums.json"} <= tree("gs://bucket/ckpt").keys()
    capsys.readouterr()
    assert main(["convert", "--to-hf", "gs://bucket/ckpt", "--out", "gs://bucket/hf"]) == 2
    assert "output directory='gs://bucket/hf' already holds a Hugging Face model" in capsys.readouterr().err
    assert main(["convert", "--to-hf", "gs://bucket/ckpt", "--out", "gs://bucket/hf", "--overwrite"]) == 0
    assert tree("gs://bucket/hf") == local

    harness = ["harness", "--hf", str(REPO / "tests" / "fixtures" / "hf_chat"), "--include-path",
               str(REPO / "configs" / "harness"), "--tasks", "sums_choice", "--limit", "8", "--batch-size", "8"]
    for where in (tmp_path / "results", "gs://bucket/results"):
        assert main([*harness, "--output-path", str(where)]) == 0, capsys.readouterr().err
    [(name, results)] = [(k, v) for k, v in tree(tmp_path / "results").items() if "/results_" in k]
    [(remote, uploaded)] = [(k, v) for k, v in tree("gs://bucket/results").items() if "/results_" in k]
    drop = ("date", "start_time", "end_time", "total_evaluation_time_seconds", "model_name_sanitized")
    same = lambda text: {k: v for k, v in json.loads(text).items() if k not in drop}  # noqa: E731
    assert same(uploaded)["results"] == same(results)["results"]



def test_s3_holds_corpora_runs_checkpoints_and_exports(tmp_path, capsys):
    """On `s3://` (moto's S3 server): a corpus prepared there is the local preparation byte for
    byte; a run there trained from it, stopped after 1 step and resumed past a save cut off before
    its commit file, has a local 2-step run's losses (tolerance 0); `convert --from-hf` into s3://
    and `--to-hf` from there write the local conversions' bytes; another object store is refused
    in one line before anything is written."""
    from modern_jax.data import DataConfig
    from modern_jax.data.prepare import prepare

    source = tmp_path / "c.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i}: " + "word " * (i % 7)}) + "\n" for i in range(40)))
    corpus = [*TINY, "train.steps=2", "train.checkpoint_every=1", "data.tokenizer=byte", "model.vocab_size=264"]
    with s3():
        for where in (tmp_path / "prepared", "s3://bucket/prepared"):
            prepare(DataConfig(path=str(source)), where, documents_per_shard=8, log=lambda _: None)
        assert tree("s3://bucket/prepared") == tree(tmp_path / "prepared")
        assert main(["train", *corpus, "--data", str(tmp_path / "prepared"), "--output-dir", str(tmp_path / "a")]) == 0
        remote = [*corpus, "--data", "s3://bucket/prepared", "--output-dir", "s3://bucket/run"]
        assert main(["train", *remote, "train.steps=1"]) == 0
        checkpoints = paths.as_path("s3://bucket/run/checkpoints")
        (checkpoints / "5" / "params" / "_METADATA").write_text("{}")  # a save killed before its commit file
        capsys.readouterr()
        assert main(["train", *remote]) == 0
        assert "resumed from s3://bucket/run/checkpoints/1 at step 1" in capsys.readouterr().out
        assert sorted(p.name for p in checkpoints.iterdir()) == ["1", "2"]
        assert losses((tmp_path / "a" / "metrics.jsonl").read_text()) == \
            losses(paths.as_path("s3://bucket/run/metrics.jsonl").read_text())

        fixture = REPO / "tests" / "fixtures" / "hf" / "llama"
        for ckpt, hf in ((tmp_path / "ckpt", tmp_path / "hf"), ("s3://bucket/ckpt", "s3://bucket/hf")):
            assert main(["convert", "--from-hf", str(fixture), "--out", str(ckpt)]) == 0
            assert main(["convert", "--to-hf", str(ckpt), "--out", str(hf)]) == 0
        assert tree("s3://bucket/hf") == tree(tmp_path / "hf")

        capsys.readouterr()
        assert main(["train", *TINY, "--output-dir", "az://container/run"]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()[-1:]
        assert re.search(r"'az://container/run': checkpoints are written and read by Orbax, which reaches object "
                         r"storage through TensorStore's GCS and S3 drivers alone", line), line
