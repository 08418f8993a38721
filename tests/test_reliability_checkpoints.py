"""Never lose a run: writers refuse directories they did not make, damaged checkpoints are
named and skipped on resume (never deleted), a failed start leaves nothing behind, and a run
killed at random moments computes exactly the losses of an uninterrupted one.

Every refusal test checksums the directory before and after."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml

from modern_jax.cli import main
from modern_jax.config import ModelConfig
from modern_jax.sharding.mesh import make_mesh
from modern_jax.training import TrainConfig, run_config_from_dict, train
from modern_jax.training.checkpoint import CheckpointDamaged, load_params
from modern_jax.training.optimizer import learning_rate_schedule

import modern_jax.training.programs as programs_module

from common import QUICK_FLAG, make_trainer

REPO = pathlib.Path(__file__).parent.parent
HF_LLAMA = REPO / "tests" / "fixtures" / "hf" / "llama"
TINY_MODEL = {"vocab_size": "auto", "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64,
              "max_position_embeddings": 32}


def digest(path: pathlib.Path) -> str:
    """One hash of every file's relative path and bytes under `path`."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(p.relative_to(path).as_posix().encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def corpus(directory: pathlib.Path) -> pathlib.Path:
    path = directory / "corpus.txt"
    if not path.exists():
        words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "\n"]
        path.write_text(" ".join(np.random.default_rng(0).choice(words, 3000)))
    return path


def run_dict(directory: pathlib.Path, output_dir, **train_settings) -> dict:
    settings = {"steps": 6, "batch_size": 4, "seq_len": 16, "warmup_steps": 1, "log_every": 1, "eval_every": 0,
                "eval_windows": 4, "eval_batch_size": 4, "final_eval_windows": 4, "checkpoint_every": 2,
                "samples": 0, "progress": False, "plot": False, "tensorboard": False, "output_dir": str(output_dir),
                **train_settings}
    return {"model": TINY_MODEL, "train": settings, "data": {"path": str(corpus(directory)), "tokenizer": "char"}}


def one_device():
    return make_mesh(data=-1, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished run with checkpoints at steps 2, 4, 6, and its per-step losses."""
    root = tmp_path_factory.mktemp("trained")
    result = train(run_config_from_dict(run_dict(root, root / "run")), mesh=one_device(), log=lambda *_: None)
    return root, [h["loss"] for h in result.history]


@pytest.fixture
def run_copy(trained, tmp_path):
    root, losses = trained
    shutil.copytree(root / "run", tmp_path / "run")
    return tmp_path / "run", losses


# ----- writers refuse what they did not make ---------------------------------------------


def test_convert_into_a_training_run_is_refused_and_the_run_is_untouched(run_copy, capsys):
    run, _ = run_copy
    before = digest(run)
    for argv in (["convert", "--from-hf", str(HF_LLAMA), "--out", str(run)],
                 ["convert", "--from-hf", str(HF_LLAMA), "--out", str(run), "--overwrite"],
                 ["convert", "--to-hf", str(run), "--out", str(run), "--model-type", "llama"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "already holds a training run (checkpoints at steps 2, 4, 6); nothing was written" in err, err
        assert "--overwrite" not in err  # another kind of directory is never replaced
    assert digest(run) == before
    assert load_params(run)[0].d_model == 32  # the run still loads


def test_convert_into_a_step_directory_keeps_its_parameters(run_copy, capsys):
    run, _ = run_copy
    step = run / "checkpoints" / "4"
    before = digest(run)
    assert main(["convert", "--from-hf", str(HF_LLAMA), "--out", str(step)]) == 2
    assert "already holds step 4 of a training run (params/, state/, meta/)" in capsys.readouterr().err
    assert digest(run) == before


def test_train_into_a_converted_checkpoint_is_refused(tmp_path, capsys):
    assert main(["convert", "--from-hf", str(HF_LLAMA), "--out", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    before = digest(tmp_path / "ckpt")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run_dict(tmp_path, tmp_path / "unused")))
    assert main(["train", "--config", str(config), "--output-dir", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "train.output_dir=" in err and "already holds a converted checkpoint (config.yaml and params/)" in err
    assert "choose a new train.output_dir (--output-dir)" in err
    assert digest(tmp_path / "ckpt") == before


def test_train_into_a_folder_of_other_files_is_refused(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("my notes")
    (tmp_path / "mine" / "data").mkdir()
    before = digest(tmp_path / "mine")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run_dict(tmp_path, tmp_path / "mine")))
    assert main(["train", "--config", str(config)]) == 2
    assert "already holds 2 entries that modern-jax did not write (data/, notes.txt)" in capsys.readouterr().err
    assert digest(tmp_path / "mine") == before


def test_an_earlier_conversion_is_replaced_only_with_overwrite(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["convert", "--from-hf", str(HF_LLAMA), "--out", str(out)]) == 0
    capsys.readouterr()
    before = digest(out)
    assert main(["convert", "--from-hf", str(HF_LLAMA), "--out", str(out)]) == 2
    assert "or pass --overwrite (overwrite=True) to replace it" in capsys.readouterr().err
    assert digest(out) == before
    # a bad source with --overwrite fails before anything is deleted
    assert main(["convert", "--from-hf", str(tmp_path / "missing"), "--out", str(out), "--overwrite"]) == 2
    capsys.readouterr()
    assert digest(out) == before
    assert main(["convert", "--from-hf", str(HF_LLAMA), "--out", str(out), "--overwrite"]) == 0
    assert load_params(out)[0] == load_params(tmp_path / "ckpt")[0]


def test_to_hf_refuses_an_existing_export_and_foreign_files(tmp_path, capsys):
    assert main(["convert", "--from-hf", str(HF_LLAMA), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    before = digest(tmp_path / "hf")
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 2
    assert "already holds a Hugging Face model (config.json and 1 safetensors files)" in capsys.readouterr().err
    assert digest(tmp_path / "hf") == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "thesis.tex").write_text("...")
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "other"), "--overwrite"]) == 2
    assert "1 entries that modern-jax did not write (thesis.tex)" in capsys.readouterr().err
    assert (tmp_path / "other" / "thesis.tex").read_text() == "..."
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--overwrite"]) == 0


@pytest.mark.parametrize("command", ["train", "from_hf", "to_hf"])
def test_an_output_directory_that_is_a_file_is_an_error(tmp_path, capsys, command):
    target = tmp_path / "taken"
    target.write_text("a file")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run_dict(tmp_path, target)))
    argv = {"train": ["train", "--config", str(config)],
            "from_hf": ["convert", "--from-hf", str(HF_LLAMA), "--out", str(target)],
            "to_hf": ["convert", "--to-hf", str(HF_LLAMA), "--out", str(target)]}[command]
    assert main(argv) == 2
    assert f"{str(target)!r} is a file, not a directory" in capsys.readouterr().err
    assert target.read_text() == "a file"


# ----- damaged checkpoints ----------------------------------------------------------------


def _largest(step: pathlib.Path, item: str) -> pathlib.Path:
    files = [p for p in (step / item).rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def _truncate(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _scribble(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3: len(data) // 3 + 16] = bytes(range(16))
    path.write_bytes(bytes(data))


DAMAGE = {  # what is done to step 6, and the words naming it
    "params data truncated": (lambda s: _truncate(_largest(s, "params")), r"params/\S*d/\w+ has [\d,]+ bytes, [\d,]+ when "
                              r"it was saved \(truncated\)"),
    "params data missing": (lambda s: _largest(s, "params").unlink(), r"params/\S*d/\w+ is missing"),
    "random bytes in a data file": (lambda s: _scribble(_largest(s, "params")),
                                    r"params/\S*d/\w+ has changed since it was saved"),
    "_METADATA truncated": (lambda s: _truncate(s / "params" / "_METADATA"), r"params/_METADATA has"),
    "meta/ missing": (lambda s: shutil.rmtree(s / "meta"), r"meta/ is missing"),
    "state/ data truncated": (lambda s: _truncate(_largest(s, "state")), r"state/\S*d/\w+ has"),
    "no params/": (lambda s: shutil.rmtree(s / "params"), r"params/ is missing"),
    # a save cut off before its checksums were written: the files Orbax reads first are checked
    "unsealed, _METADATA truncated": (lambda s: ((s / "checksums.json").unlink(), _truncate(s / "params/_METADATA")),
                                      r"params/_METADATA is not valid JSON"),
    "unsealed, meta missing": (lambda s: ((s / "checksums.json").unlink(), (s / "meta/metadata").unlink()),
                               r"meta/metadata is missing"),
    "unsealed, data truncated": (lambda s: ((s / "checksums.json").unlink(), _truncate(_largest(s, "params"))),
                                 r"params, array \S+ could not be read \(Encountered error while reading array index"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_resume_skips_a_damaged_step_names_it_and_keeps_it(run_copy, case, capfd):
    import re

    run, losses = run_copy
    damage, words = DAMAGE[case]
    damage(run / "checkpoints" / "6")
    damaged = digest(run / "checkpoints" / "6")
    messages = []
    result = train(run_config_from_dict(run_dict(run.parent, run)), mesh=one_device(), log=messages.append)
    text = "\n".join(messages)
    assert re.search(r"checkpoint step 6 \(.*checkpoints/6\) is damaged: " + words, text), text
    assert f"moved damaged step 6 to {run / 'damaged_checkpoints' / '6'} (nothing was deleted)" in text
    assert f"resumed from {run / 'checkpoints' / '4'} at step 4 (the newest step that restores completely)" in text
    assert [h["step"] for h in result.history] == [5, 6]
    np.testing.assert_array_equal([h["loss"] for h in result.history], losses[4:6])  # steps 5, 6 again, exactly
    assert digest(run / "damaged_checkpoints" / "6") == damaged  # set aside as it was
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_when_no_step_restores_nothing_is_moved(run_copy):
    run, _ = run_copy
    for step in (2, 4, 6):
        _truncate(run / "checkpoints" / str(step) / "params" / "_METADATA")
    before = digest(run)
    with pytest.raises(CheckpointDamaged) as info:
        train(run_config_from_dict(run_dict(run.parent, run, steps=8)), mesh=one_device(), log=lambda *_: None)
    message = str(info.value)
    assert message.startswith(f"no checkpoint in {run / 'checkpoints'} restores:")
    assert all(f"checkpoint step {s} (" in message for s in (2, 4, 6))
    assert "nothing was moved or deleted" in message
    assert digest(run) == before


@pytest.mark.parametrize("argv", [
    ["evaluate", "--checkpoint", "{run}", "--max-windows", "2"],
    ["generate", "--checkpoint", "{run}", "--max-new-tokens", "2"],
    ["convert", "--to-hf", "{run}", "--out", "{tmp}/hf", "--model-type", "llama"],
])
def test_loading_commands_name_the_step_and_refuse_a_damaged_one(run_copy, argv, capfd, tmp_path):
    run, _ = run_copy
    _truncate(_largest(run / "checkpoints" / "6", "params"))
    before = digest(run)
    argv = [a.format(run=run, tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert f"loading step 6 of {run}" in err
    assert f"checkpoint step 6 of {run} is damaged: params/" in err and "(truncated)" in err
    assert f"the step before it is 4: --checkpoint {run / 'checkpoints' / '4'}" in err
    assert "Traceback" not in err and "Exception ignored" not in err
    assert digest(run) == before and not (tmp_path / "hf").exists()
    argv[2] = str(run / "checkpoints" / "4")  # the step it suggests loads
    assert main(argv) == 0
    assert f"loading step 4 of {run}" in capfd.readouterr().err


def test_a_damaged_run_config_is_named(run_copy):
    run, _ = run_copy
    (run / "config.yaml").write_text("model: {d_model: 32\n")
    with pytest.raises(ValueError, match=r"config.yaml, line 2, column 1: could not parse YAML"):
        load_params(run)


def test_a_failed_start_leaves_nothing_behind_and_prints_one_error(tmp_path):
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 8)
    config = tmp_path / "run.yaml"
    raw = run_dict(tmp_path, tmp_path / "run")
    raw["data"]["path"] = str(tmp_path / "binary.txt")
    config.write_text(yaml.safe_dump(raw))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=QUICK_FLAG)
    proc = subprocess.run([sys.executable, "-m", "modern_jax.cli", "train", "--config", str(config)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"modern-jax train: error: data.path={str(tmp_path / 'binary.txt')!r} is not UTF-8 text "
                     "(byte 128: 0x80): for token ids use source: tokens"], proc.stderr
    assert not (tmp_path / "run").exists()


# ----- review fixes -----------------------------------------------------------------------


def _batch(rng, V, weight=1.0):
    tokens = rng.integers(0, V, (1, 4, 9))
    return {"inputs": tokens[..., :-1].astype(np.int32), "targets": tokens[..., 1:].astype(np.int32),
            "positions": np.broadcast_to(np.arange(8, dtype=np.int32), (1, 4, 8)).copy(),
            "segment_ids": np.ones((1, 4, 8), np.int32), "weights": np.full((1, 4, 8), weight, np.float32)}


def test_a_skipped_step_logs_no_learning_rate_and_consumes_its_schedule_step():
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    tc = TrainConfig(steps=4, batch_size=4, seq_len=8, warmup_steps=1, lr=1e-2, min_lr_ratio=0.1)
    trainer = make_trainer(cfg, tc, one_device())
    schedule = learning_rate_schedule(tc)
    rng = np.random.default_rng(0)
    state = trainer.states.init(0)
    logged = []
    for weight in (1.0, np.nan, 1.0, 1.0):  # step 2 is non-finite and skipped
        state, metrics = trainer.train_step(state, trainer.batches.put(_batch(rng, 32, weight)))
        logged.append(float(metrics["lr"]))
    assert logged[1] == 0.0
    for i in (0, 2, 3):
        assert logged[i] == pytest.approx(float(schedule(i)), rel=1e-6)
    assert logged[3] == pytest.approx(1e-3 + (1e-2 - 1e-3) * 0.5 * (1 + np.cos(np.pi * 2 / 3)), rel=1e-6)


def test_the_update_is_adamw_at_the_scheduled_rate():
    """Three steps equal optax's own AdamW driven by the same schedule (an independent reference)."""
    import optax

    from modern_jax.training.optimizer import decay_mask

    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    tc = TrainConfig(steps=10, batch_size=4, seq_len=8, warmup_steps=2, lr=1e-2, clip_norm=None, weight_decay=0.1)
    trainer = make_trainer(cfg, tc, one_device())
    state = trainer.states.init(0)
    batch = _batch(np.random.default_rng(1), 32)
    micro = jax.tree.map(lambda x: x[0], batch)

    def objective(params):
        sums, _ = trainer._loss(params, micro, None)
        return (sums["ce"] + tc.z_loss_weight * sums["z_loss"]) / np.sum(micro["weights"])

    reference = optax.adamw(learning_rate_schedule(tc), b1=tc.b1, b2=tc.b2, eps=tc.eps, weight_decay=0.1,
                            mask=lambda p: decay_mask(p, tc.no_decay))
    want = start = jax.tree.map(np.asarray, state["params"])
    opt = reference.init(want)
    for _ in range(3):
        updates, opt = reference.update(jax.grad(objective)(want), opt, want)
        want = optax.apply_updates(want, updates)
        state, _ = trainer.train_step(state, trainer.batches.put(batch))
    # Adam divides by sqrt(v): float noise in near-zero gradients moves a weight by up to ~1e-5 (1.4e-5
    # seen on one CPU, the sums' order being its own); a rate 10% off would move weights by ~1e-3
    # (the steps here use 0, 5e-3 and 1e-2)
    moved = 0.0
    for a, b, c in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(want), jax.tree.leaves(start)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4)
        moved = max(moved, float(np.max(np.abs(np.asarray(a) - c))))
    assert moved > 1e-3


def test_batch_sharding_follows_the_rules_table():
    mesh = make_mesh(data=2, fsdp=4, tensor=1)
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    tc = TrainConfig(batch_size=8, seq_len=8, warmup_steps=0)
    default = make_trainer(cfg, tc, mesh)
    # expert and context: size 1 here (the sequence is split over context)
    assert tuple(default.batches.sharding.spec) == (None, ("data", "fsdp", "expert"), "context")
    from modern_jax.sharding import RULES

    rules = tuple((k, "data" if k == "activation_batch" else v) for k, v in RULES)
    only_data = make_trainer(cfg, tc, mesh, rules=rules)
    assert tuple(only_data.batches.sharding.spec) == (None, "data", "context")


def test_compiled_steps_are_shared_exactly_when_the_program_is_the_same(monkeypatch):
    monkeypatch.setattr(programs_module, "_EXECUTABLES", {})
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    batch = _batch(np.random.default_rng(0), 32)

    def executable(**changes):
        tc = TrainConfig(batch_size=4, seq_len=8, warmup_steps=0, **changes)
        trainer = make_trainer(cfg, tc, one_device())
        state = trainer.states.init(0)
        return trainer.programs.compile("train", state, trainer.batches.put(batch))

    base = executable()
    assert executable(output_dir="elsewhere", log_every=7) is base  # bookkeeping: the same program
    for changes in ({"lr": 2e-3}, {"b2": 0.99}, {"z_loss_weight": 0.0}, {"clip_norm": None}):
        assert executable(**changes) is not base, changes  # anything the step reads: a new program


# ----- SIGKILL at random moments ------------------------------------------------------------


def _metrics(run: pathlib.Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    if (run / "metrics.jsonl").exists():
        for line in (run / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record.get("split") == "train":
                out.setdefault(record["step"], []).append(record["loss"])
    return out


KILLED_STEPS = 28  # the run the random kills interrupt: a save every step


def test_random_sigkills_during_start_up_steps_and_saves_change_no_loss(tmp_path):
    """Kill the run at random moments (start-up, steps, saves: it saves every step), resume
    until done: every step's loss (each time it ran) equals the uninterrupted run's."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=QUICK_FLAG)

    def command(name):
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump(run_dict(tmp_path, tmp_path / name, steps=KILLED_STEPS,
                                                  checkpoint_every=1, keep_checkpoints=2)))
        return [sys.executable, "-m", "modern_jax.cli", "train", "--config", str(config)]

    t0 = time.monotonic()
    subprocess.run(command("straight"), env=env, check=True, capture_output=True, timeout=300)
    whole = time.monotonic() - t0  # start-up and the steps, each saved
    want = {step: values[0] for step, values in _metrics(tmp_path / "straight").items()}
    assert sorted(want) == list(range(1, KILLED_STEPS + 1))
    rng, kills = random.Random(0), 0
    for _ in range(8):  # until four kills landed (a try that outlives its delay is a kill; one that ends is not)
        if kills == 4:
            break
        # a moment of the try about to run: about half of `whole` is start-up, the rest the steps
        # still to run, so a try that would finish the run is not let finish (no more kills after)
        left = 1 - len(_metrics(tmp_path / "killed")) / KILLED_STEPS
        delay = rng.uniform(0.1, 0.6) * whole / 2 * (1 + left)
        proc = subprocess.Popen(command("killed"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
    subprocess.run(command("killed"), env=env, check=True, capture_output=True, timeout=300)
    assert kills >= 3
    got = _metrics(tmp_path / "killed")
    assert sorted(got) == sorted(want)
    for step, values in got.items():
        assert all(v == want[step] for v in values), (step, values, want[step])
    assert not any("tmp" in p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
