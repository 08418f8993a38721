"""`modern-jax harness` (modern_jax/harness.py): lm-eval's tasks scored by our model give lm-eval's
own `hf` backend's figures.

The reference is tests/fixtures/harness/hf_chat.json, made by scripts/make_harness_fixtures.py
with lm-eval and transformers (PyTorch, CPU) on the tiny chat fixture and the three local tasks of
configs/harness (multiple choice, generation, rolling log-likelihood): every log-likelihood within
1e-4, every greedy flag and generated text identical, every metric within 1e-4. With
MODERN_JAX_HF_PYTHON naming an interpreter that has lm-eval and torch, the same comparison runs
against a fresh reference. Also: the scorer's log-probabilities and greedy flags against a naive
forward pass (the fixture's greedy flags are all False), a trained run scores the same as its
Hugging Face export, two processes of four devices as one process, the in-training figures in
metrics.jsonl and TensorBoard, the compilation cache read back, and the refusals (an unknown task,
a task file that does not parse, a hub task without network, a directory of other files, a --limit
that is not a whole count).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from modern_jax.cli import main

ROOT = Path(__file__).resolve().parent.parent
CHAT = "tests/fixtures/hf_chat"
REFERENCE = ROOT / "tests" / "fixtures" / "harness" / "hf_chat.json"
SCRIPT = ROOT / "scripts" / "make_harness_fixtures.py"
TASKS = ("sums_choice", "sums_answer", "sums_text")


@pytest.fixture(autouse=True)
def _at_the_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _value(x):
    """A response as lm-eval's sample files write it (strings) or as JSON holds it."""
    if isinstance(x, list):
        return [_value(v) for v in x]
    if x in ("True", "False"):
        return x == "True"
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return x
    return x


def our_samples(out: Path) -> dict[str, dict[int, list]]:
    samples = {}
    for task in TASKS:
        files = glob.glob(str(out / "*" / f"samples_{task}_*.jsonl"))
        if files:
            rows = [json.loads(line) for line in Path(sorted(files)[-1]).read_text().splitlines()]
            samples[task] = {row["doc_id"]: _value(row["resps"]) for row in rows}
    return samples


def our_metrics(out: Path) -> dict[str, float]:
    from modern_jax.harness import flat_metrics

    results = json.loads(Path(sorted(glob.glob(str(out / "*" / "results_*.json")))[-1]).read_text())
    return flat_metrics(results)


def assert_same_figures(ours: dict, metrics: dict, reference: dict) -> None:
    """Every response of `reference` (lm-eval's hf backend) equal to ours: log-likelihoods to 1e-4, the
    greedy flags and the generated texts exactly; then every metric to 1e-4."""
    compared = {"loglikelihood": 0, "greedy": 0, "text": 0}
    for task, rows in reference["samples"].items():
        for row in rows:
            theirs, mine = _value(row["resps"]), ours[task][row["doc_id"]]
            assert len(theirs) == len(mine), (task, row["doc_id"])
            for t, m in zip(theirs, mine):
                t, m = t[0], m[0]
                if isinstance(t, str):
                    assert m == t, (task, row["doc_id"], m, t)
                    compared["text"] += 1
                    continue
                t, m = (t, None) if not isinstance(t, list) else t, (m, None) if not isinstance(m, list) else m
                np.testing.assert_allclose(m[0], t[0], rtol=1e-4, atol=1e-5, err_msg=f"{task} doc {row['doc_id']}")
                compared["loglikelihood"] += 1
                if t[1] is not None:
                    assert m[1] == t[1], (task, row["doc_id"], "greedy")
                    compared["greedy"] += 1
    assert compared["loglikelihood"] >= 20 and compared["greedy"] >= 10 and compared["text"] >= 5, compared
    assert set(reference["metrics"]) <= set(metrics), set(reference["metrics"]) - set(metrics)
    for name, value in reference["metrics"].items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-4, err_msg=name)


def run_harness(source: list[str], out: Path, settings: dict, *extra: str) -> None:
    argv = ["harness", *source, "--include-path", settings["include_path"], "--tasks", *settings["tasks"],
            "--batch-size", "8", "--log-samples", "--output-path", str(out), *extra]
    if settings.get("limit") is not None:
        argv += ["--limit", str(settings["limit"])]
    if settings.get("num_fewshot") is not None:
        argv += ["--num-fewshot", str(settings["num_fewshot"])]
    assert main(argv) == 0


def test_the_harness_gives_lm_eval_hf_backends_figures(tmp_path, capsys):
    reference = json.loads(REFERENCE.read_text())
    run_harness(["--hf", reference["settings"]["model"]], tmp_path / "out", reference["settings"])
    printed = capsys.readouterr().out
    assert "|sums_choice|" in printed and "exact_match" in printed  # lm-eval's table
    assert_same_figures(our_samples(tmp_path / "out"), our_metrics(tmp_path / "out"), reference)


def hf_python() -> str | None:
    return os.environ.get("MODERN_JAX_HF_PYTHON")


@pytest.mark.skipif(hf_python() is None, reason="needs MODERN_JAX_HF_PYTHON: an interpreter with lm-eval and torch")
def test_live_the_harness_gives_lm_eval_hf_backends_figures(tmp_path):
    """A fresh reference with two few-shot examples (prompts of many lengths), against ours."""
    fresh = tmp_path / "reference.json"
    done = subprocess.run([hf_python(), str(SCRIPT), "--out", str(fresh), "--num-fewshot", "2", "--tasks",
                           "sums_choice", "sums_answer", "--limit", "10"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    reference = json.loads(fresh.read_text())
    run_harness(["--hf", reference["settings"]["model"]], tmp_path / "out", reference["settings"])
    assert_same_figures(our_samples(tmp_path / "out"), our_metrics(tmp_path / "out"), reference)


def test_in_training_figures_equal_the_command_on_the_run_and_on_its_export(tmp_path, capsys):
    """A fine-tune with train.harness_*: the figures in metrics.jsonl and TensorBoard at the asked step
    and the last; `harness --checkpoint RUN` gives the last ones, and `--hf` on `convert --to-hf`'s
    export gives the same numbers as the run, response by response."""
    run, export = tmp_path / "run", tmp_path / "hf"
    tasks = "sums_choice,sums_answer,sums_text"
    assert main(["train", "--init-from-hf", CHAT, "--data", f"{CHAT}/chat.jsonl", "--output-dir", str(run),
                 "train.steps=4", "train.seq_len=64", "train.batch_size=8", "train.eval_batch_size=8",
                 "train.lr=3e-3", "train.warmup_steps=1", "train.samples=0", "train.plot=false",
                 "train.eval_every=0", "train.checkpoint_every=0", "train.harness_every=2",
                 f"train.harness_tasks={tasks}", "train.harness_limit=6",
                 "train.harness_include_path=configs/harness"]) == 0
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in records if r["split"] == "harness"}
    assert sorted(logged) == [2, 4], sorted(logged)
    assert logged[2]["sums_text/bits_per_byte"] != logged[4]["sums_text/bits_per_byte"]  # the state of each step
    final = {k: v for k, v in logged[4].items() if k not in ("step", "split")}
    assert {"sums_choice/acc", "sums_answer/exact_match", "sums_text/bits_per_byte"} <= set(final), final
    assert f"harness/sums_choice/acc: {final['sums_choice/acc']:.4f}" in printed  # the final summary
    from test_train import _tensorboard_scalars

    scalars = _tensorboard_scalars(run / "tensorboard")
    assert scalars["harness/sums_choice/acc"] == pytest.approx({2: logged[2]["sums_choice/acc"], 4: final[
        "sums_choice/acc"]}), scalars.keys()
    assert set(scalars["harness/sums_text/bits_per_byte"]) == {2, 4}

    settings = {"include_path": "configs/harness", "tasks": tasks.split(","), "limit": 6}
    run_harness(["--checkpoint", str(run)], tmp_path / "ours", settings)
    ours = our_metrics(tmp_path / "ours")
    for name, value in final.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-4, err_msg=name)
    assert main(["convert", "--to-hf", str(run), "--out", str(export)]) == 0
    run_harness(["--hf", str(export)], tmp_path / "export", settings)
    reference = {"metrics": ours, "samples": {task: [{"doc_id": d, "resps": r} for d, r in rows.items()]
                                              for task, rows in our_samples(tmp_path / "ours").items()}}
    assert_same_figures(our_samples(tmp_path / "export"), our_metrics(tmp_path / "export"), reference)


def test_two_processes_of_four_devices_give_the_figures_of_one(tmp_path):
    """`harness` under a launch of 2 processes x 4 host devices: the rows of every batch split over
    the 8 devices, process 0 alone writes the files and prints the table, and every response and
    metric is the one process's (lm-eval's hf backend's, which test_the_harness_gives_lm_eval_hf_
    backends_figures holds one process to)."""
    from processes import Launch

    reference = json.loads(REFERENCE.read_text())
    settings, out = reference["settings"], tmp_path / "out"
    argv = ["harness", "--hf", settings["model"], "--include-path", settings["include_path"], "--tasks",
            *settings["tasks"], "--limit", str(settings["limit"]), "--batch-size", "8", "--log-samples",
            "--output-path", str(out)]
    launch = Launch(argv, n=2, devices=4, logdir=tmp_path)
    assert launch.wait() == [0, 0], launch.log(0)[-3000:] + launch.log(1)[-3000:]
    assert "process 0 of 2, 8 devices (4 local)" in launch.log(0)
    assert "|sums_choice|" in launch.log(0) and "|sums_choice|" not in launch.log(1)
    assert len(glob.glob(str(out / "*" / "results_*.json"))) == 1
    assert_same_figures(our_samples(out), our_metrics(out), reference)


READ_BACK = """
import json, logging, sys
from modern_jax.cli import main

read = []  # the cache entries read back: jax logs each (at debug level) as it reads it


def seen(record):
    if str(record.msg).startswith("Persistent compilation cache hit"):
        read.append(record.args[1])  # (the program's name, its cache key)
    return record.levelno >= logging.WARNING  # what jax would have shown anyway


log = logging.getLogger("jax._src.compiler")
log.setLevel(logging.DEBUG)
log.addFilter(seen)
status = main(sys.argv[1:])
print("read back", json.dumps(read))
sys.exit(status)
"""


def test_a_second_run_reads_the_programs_the_first_kept(tmp_path):
    """The CLI keeps its compiled programs in ~/.cache/modern_jax/xla (or MODERN_JAX_COMPILE_CACHE): the
    first run writes them, the same command again reads every one of them back and prints the same
    figures; `off` keeps none. The programs counted are the command's own (the scorer's): a tiny one
    of jax's (a random key's fold-in) takes past the cache's 0.1 s to compile only under load, and is
    kept by one run or the other."""
    from modern_jax.harness import Scorer

    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "MODERN_JAX_COMPILE_CACHE")}
    argv = [sys.executable, "-c", READ_BACK, "harness", "--hf", CHAT, "--include-path", "configs/harness",
            "--tasks", "sums_answer", "--limit", "4", "--batch-size", "8"]
    programs = tuple(f"jit_{fn.__name__}-" for fn in (Scorer._score, Scorer._decode))  # how jax names their entries

    def run(home: Path, **more) -> tuple[str, list[str]]:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env={**env, "HOME": str(home), **more})
        assert done.returncode == 0, done.stderr[-3000:]
        table, read = done.stdout.rsplit("read back ", 1)
        return table, json.loads(read)

    def entries(cache: Path) -> set[str]:
        return {p.name.removesuffix("-cache") for p in cache.glob("*-cache")}

    first, read = run(tmp_path / "home")
    cache = tmp_path / "home" / ".cache" / "modern_jax" / "xla"
    kept = entries(cache)
    ours = {key for key in kept if key.startswith(programs)}
    assert read == [] and any(key.startswith("jit__decode-") for key in ours), kept
    again, read = run(tmp_path / "other", MODERN_JAX_COMPILE_CACHE=str(cache))
    assert again == first and "|sums_answer|" in again
    assert ours <= set(read) <= kept, (ours, read, kept)  # every program of its own read back
    _, read = run(tmp_path / "third", MODERN_JAX_COMPILE_CACHE="off")
    assert read == [] and not (tmp_path / "third" / ".cache" / "modern_jax").exists() and not (ROOT / "off").exists()


def test_a_compilation_cache_that_cannot_be_made_is_refused_when_named_and_done_without_by_default(
        tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)  # the suite's own (jax's config stays as it is)
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("MODERN_JAX_COMPILE_CACHE", str(tmp_path / "a_file"))
    assert main(["harness", "--hf", CHAT, "--include-path", "configs/harness", "--tasks", "sums_choice"]) == 2
    assert (f"error: MODERN_JAX_COMPILE_CACHE={tmp_path / 'a_file'}: compiled programs cannot be kept there "
            "(File exists): give a writable directory, or off") in capsys.readouterr().err
    from modern_jax.cli import shared

    monkeypatch.delenv("MODERN_JAX_COMPILE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "a_file"))
    shared._compile_cache()
    assert "note: compiling without a cache: " in capsys.readouterr().err


@pytest.mark.quick
def test_the_padded_lengths_are_few():
    from modern_jax.harness import buckets

    assert buckets(128) == [16, 32, 64, 128]
    assert buckets(100) == [16, 32, 64, 100]
    assert buckets(8) == [8]


def naive_pack(lengths, marked, room, marks):
    """The reference: longest item left starts a row; then, over and over, the longest item left that
    fits the space (among the marked ones only while the row has fewer than `marks` of them)."""
    left, rows = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)), []
    while left:
        row = [left.pop(0)]
        space = room - lengths[row[0]]
        while True:
            used = sum(marked[i] for i in row)
            fits = [i for i in left if lengths[i] <= space and not (marked[i] and used == marks)]
            if not fits:
                break
            row.append(fits[0])
            left.remove(fits[0])
            space -= lengths[fits[0]]
        rows.append(sorted(row))
    return rows


@pytest.mark.quick
def test_inputs_pack_into_rows_longest_first_as_a_naive_packer_does():
    from modern_jax.harness import pack

    rng = np.random.default_rng(0)
    for room, marks in ((128, 16), (64, 2), (16, 1)):
        lengths = sorted(rng.integers(1, room + 1, size=300).tolist(), reverse=True)
        marked = rng.random(300) < 0.5
        rows = pack(lengths, marked.tolist(), room, marks)
        assert sorted(i for row in rows for i in row) == list(range(300))  # each once
        assert all(sum(lengths[i] for i in row) <= room and marked[row].sum() <= marks for row in rows)
        assert rows == naive_pack(lengths, marked.tolist(), room, marks)
        assert sum(lengths) / (len(rows) * room) > 0.85  # rows full: short inputs fill the long ones' rows
    with pytest.raises(ValueError, match="an input of 129 tokens does not fit a row of 128"):
        pack([129], [False], 128, 16)


@pytest.mark.quick
def test_prompts_split_into_as_few_and_as_even_batches_as_the_data_axes_allow():
    from modern_jax.harness import even_rows

    for n, batch, shards in ((81, 16, 1), (80, 16, 1), (81, 16, 8), (27, 16, 1), (1, 16, 1), (17, 16, 4), (300, 32, 2)):
        rows = even_rows(n, batch, shards)
        batches = -(-n // rows)
        assert rows <= batch and rows % shards == 0 and batches == -(-n // batch), (n, batch, shards)
        assert rows - shards < -(-n // batches), (n, batch, shards)  # no smaller multiple of the shards does
    assert [even_rows(81, 16, 1), even_rows(81, 16, 8), even_rows(17, 16, 4)] == [14, 16, 12]


@pytest.mark.quick
def test_a_few_rows_move_up_to_a_longer_program_where_they_pad_less_than_a_batch():
    from modern_jax.harness import fewer_programs

    def rows(**counts):
        return {int(n[1:]): [f"{n}.{i}" for i in range(k)] for n, k in counts.items()}

    # lm-eval's windows of 8 documents: 1, 2 and 1 short ones join the 10 whole ones (one program, not four)
    merged = fewer_programs(rows(L16=1, L32=2, L64=1, L128=10), rows_per_batch=16)
    assert list(merged) == [128] and merged[128][:10] == rows(L128=10)[128] and len(merged[128]) == 14
    # a hundred rows of each length would pad by more than a batch: each keeps its program
    assert fewer_programs(rows(L32=100, L64=100), 16) == rows(L64=100, L32=100)
    # the bound itself: 32 rows x 32 more tokens = one batch of 16 x 64 moves; one row more stays
    assert list(fewer_programs(rows(L32=32, L64=5), 16)) == [64]
    assert list(fewer_programs(rows(L32=33, L64=5), 16)) == [64, 32]
    # rows moved up count again at the next length: 20 + 13 rows at 64 would pad 33 x 64 > 16 x 128
    assert list(fewer_programs(rows(L32=20, L64=12, L128=3), 16)) == [128]
    assert list(fewer_programs(rows(L32=20, L64=13, L128=3), 16)) == [128, 64]


def test_the_scorer_flags_a_greedy_continuation_as_a_naive_forward_pass_does(monkeypatch):
    """Every log-probability and greedy flag of the scorer against the whole vocabulary's log-softmax
    of one forward pass and its argmax: inputs that several final tokens share are scored at their
    marked last position (lm-eval's choices), among them the argmax, greedy, and two that are not;
    scoring 4 tokens, the 3 before are the model's own greedy choices; inputs with one final token
    are scored as targets, greedy or not. The three inputs pack into one row, run as a batch of
    one row, not of `batch_size`."""
    import jax

    from common import one_device
    from modern_jax.harness import Scorer
    from modern_jax.training.config import run_config_from_dict
    from modern_jax.training.trainer import trainer_for

    run = run_config_from_dict({"model": {"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64,
                                          "max_position_embeddings": 32},
                                "train": {"batch_size": 4, "eval_batch_size": 4, "seq_len": 32}})
    trainer = trainer_for(run, one_device(), optimizer=False)
    params = trainer.states.init(0)["params"]
    logps = jax.jit(lambda x: jax.nn.log_softmax(trainer.states.model(params)(x[None])[0], axis=-1))  # [T, V]

    def naive(ids):  # log p of each token after the ones before, of a prefix of 12 (the rest padding)
        return np.asarray(logps(np.asarray(ids + [0] * (12 - len(ids)), np.int32)), np.float64)

    context = [5, 9, 2]
    while len(context) < 8:  # its last tokens the model's own greedy choices
        context.append(int(np.argmax(naive(context)[len(context) - 1])))
    logp_TV = naive(context)  # every row below is a prefix of the context and a final token
    top, low = int(np.argmax(logp_TV[7])), [int(v) for v in np.argsort(logp_TV[7])[:2]]
    assert top != 0  # a marked input's own target slot holds 0: 0 the argmax would hide a mixed-up flag
    rows = [(context + [top], 1), (context + [low[0]], 1), (context + [low[1]], 1),  # three finals: marked
            (context + [top], 4), (context + [low[0]], 4),
            (context[:6] + [context[6]], 3),  # one final token each: unmarked, greedy
            (context[:5] + [low[0] if low[0] != context[5] else low[1]], 2)]  # and not greedy
    shapes, score = [], Scorer._score
    monkeypatch.setattr(Scorer, "_score", lambda self, params, arrays: shapes.append(arrays["inputs"].shape)
                        or score(self, params, arrays))
    got = Scorer(trainer.states, params, batch_size=4, chunk=trainer.train_cfg.loss_vocab_chunk)(rows)
    assert shapes == [(1, 1, 32)]  # traced once: one row of 32 positions
    for (tokens, n), (logp, greedy) in zip(rows, got):
        positions = range(len(tokens) - n, len(tokens))
        want = sum(logp_TV[i - 1, tokens[i]] for i in positions)
        np.testing.assert_allclose(logp, want, rtol=1e-5, err_msg=str((tokens, n)))
        assert greedy == all(np.argmax(logp_TV[i - 1]) == tokens[i] for i in positions), (tokens, n)
    assert [greedy for _, greedy in got] == [True, False, False, True, False, True, False]


def test_an_unknown_task_is_refused_with_the_close_names(capsys):
    assert main(["harness", "--hf", CHAT, "--include-path", "configs/harness", "--tasks", "sums_choise"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no task named 'sums_choise' (close: sums_choice" in err, err


@pytest.mark.quick
def test_a_directory_of_other_files_is_refused_before_anything_is_read(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("x")
    assert main(["harness", "--hf", CHAT, "--include-path", "configs/harness", "--tasks", "sums_choice",
                 "--output-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--output-path" in err and "did not write" in err and "nothing was written" in err, err


@pytest.mark.quick
def test_a_task_of_the_hub_without_network_is_one_line_naming_it_and_the_local_fix(tmp_path, capsys):
    (tmp_path / "hub.yaml").write_text("task: hub_sums\ndataset_path: some-org/some-sums\ntest_split: test\n"
                                       "output_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
                                       "doc_to_choice: '{{choices}}'\ndoc_to_target: label\n")
    assert main(["harness", "--hf", CHAT, "--include-path", str(tmp_path), "--tasks", "hub_sums"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "task hub_sums: its data come from the Hugging Face hub (some-org/some-sums)" in err, err
    assert "dataset_path: json" in err and "--include-path" in err, err


def test_a_task_file_whose_yaml_does_not_parse_is_named_with_its_error(tmp_path):
    """lm-eval skips a YAML file it cannot parse in silence, so the task it holds is unknown: the
    refusal names the file, the line and the problem (`check_tasks`, as the command and
    train.harness_tasks call it, on the include path's own TaskManager)."""
    from lm_eval.tasks import TaskManager

    from modern_jax.harness import check_tasks

    task = (ROOT / "configs/harness/sums_choice.yaml").read_text()
    (tmp_path / "sums_choice.yaml").write_text(task.replace("\ntask: sums_choice", "\ntask: sums_choice\n  path: x: y"))
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    with pytest.raises(ValueError) as refused:
        check_tasks(manager, ["sums_choice"])
    err = str(refused.value)
    assert err.count("\n") == 0 and err.startswith("--tasks: no task named 'sums_choice'"), err
    assert err.endswith(f"{tmp_path / 'sums_choice.yaml'}, line 6, column 7: could not parse YAML (mapping values are "
                        f"not allowed in this context), and lm-eval leaves out a task file it cannot read: fix it"), err


@pytest.mark.quick
def test_a_limit_that_is_not_a_whole_count_or_a_fraction_is_refused(capsys):
    """--limit 2.5 would score 2 documents: refused, as train.harness_limit=2.5 is."""
    from modern_jax.training import TrainConfig

    assert main(["harness", "--hf", CHAT, "--include-path", "configs/harness", "--tasks", "sums_choice",
                 "--limit", "2.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("modern-jax harness: error: --limit 2.5 is invalid: expected a whole count of documents, or a "
                   "fraction below 1"), err
    with pytest.raises(ValueError, match=r"harness_limit=2.5 is invalid: expected a whole count of documents, a "
                                         r"fraction below 1, or null"):
        TrainConfig(harness_limit=2.5)
