"""Corpora at scale (`modern_jax.data.shards`, `modern_jax.data.prepare`, `Mixture` in
`modern_jax.data.corpora`, its rows in `modern_jax.data.batches`): token shards read a window at
a time, `modern-jax prepare`, mixtures by weight, and shards on object storage (a stand-in)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from modern_jax import paths as paths_module
from modern_jax.data import DataConfig, TokenStream, load_splits, train_iterator
from modern_jax.data.batches import TrainBatches
from modern_jax.data.prepare import prepare

SEP = 258  # the byte tokenizer's <eos>


def corpus(seed: int, n: int) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(0, 256, n).astype(np.uint16)
    ids[np.random.default_rng(seed + 1).integers(0, n, n // 40)] = SEP
    return ids


def write_shards(directory, ids, cuts):
    directory.mkdir(parents=True, exist_ok=True)
    for k, part in enumerate(np.split(ids, cuts)):
        (directory / f"part-{k:03d}.bin").write_bytes(part.tobytes())
    return directory


def reference(ids: np.ndarray) -> TokenStream:
    """The ids in memory, documents found by a scan of the whole array (the in-memory path)."""
    return TokenStream(ids, np.r_[0, np.flatnonzero(ids[:-1] == SEP) + 1].astype(np.int64))


def test_shards_give_the_batches_of_the_corpus_in_memory(tmp_path):
    ids = corpus(0, 3000)
    write_shards(tmp_path / "dir", ids, [700, 1900])
    for path in (tmp_path / "dir", f"{tmp_path}/dir/part-*.bin"):
        _, train, val = load_splits(DataConfig(path=str(path), doc_separator_id=SEP, val_fraction=0.1))
        assert len(train) == 2700 and len(val) == 300
        got, want = TrainBatches(train, 64, 8, seed=3), TrainBatches(reference(ids[:2700]), 64, 8, seed=3)
        for i in (0, 1, 17):  # windows crossing shard boundaries among them
            for key, value in want[i].items():
                np.testing.assert_array_equal(got[i][key], value, err_msg=f"{path}: batch {i} {key}")


def test_processes_read_disjoint_rows_of_the_same_global_batch(tmp_path):
    a, b = write_shards(tmp_path / "a", corpus(1, 2000), [900]), write_shards(tmp_path / "b", corpus(2, 1500), [])
    cfg = DataConfig(sources=[{"path": str(a), "weight": 0.7}, {"path": str(b), "weight": 0.3}],
                     doc_separator_id=SEP)
    _, train, _ = load_splits(cfg)
    whole = TrainBatches(train, 32, 8, grad_accum=2, seed=0)
    halves = [TrainBatches(train, 32, 8, grad_accum=2, seed=0, rows=rows) for rows in (slice(0, 2), slice(2, 4))]
    for i in (0, 5):
        for key, value in whole[i].items():
            np.testing.assert_array_equal(np.concatenate([h[i][key] for h in halves], axis=1), value)


def test_a_mixture_draws_each_source_by_its_weight_and_resumes_exactly(tmp_path):
    paths = [write_shards(tmp_path / name, corpus(k, 600 + 300 * k), []) for k, name in enumerate("abc")]
    cfg = DataConfig(sources=[{"path": str(p), "weight": w} for p, w in zip(paths, (0.5, 0.3, 0.2))],
                     doc_separator_id=SEP)
    _, train, val = load_splits(cfg)
    assert train.names == ["a", "b", "c"] and val.names == ["a", "b", "c"]
    batches = TrainBatches(train, 16, 8, seed=0)
    rows = np.concatenate([batches.sources(i).ravel() for i in range(1000)])
    np.testing.assert_allclose(np.bincount(rows) / len(rows), [0.5, 0.3, 0.2], atol=0.002)  # 1% asked; drawn rows miss 0.2%
    first = batches[4]  # the rows of source 0 are windows of source 0's stream
    for key in ("inputs",):
        from_a = first[key][batches.sources(4) == 0]
        a = np.fromfile(paths[0] / "part-000.bin", np.uint16).astype(np.int32)
        assert all(any(np.array_equal(row, a[s:s + 16]) for s in range(len(a) - 16)) for row in from_a)
    iterator = train_iterator(train, seq_len=16, batch_size=8, seed=0, prefetch=0)
    for _ in range(3):
        next(iterator)
    state = iterator.get_state()
    expected = [next(iterator) for _ in range(2)]
    resumed = train_iterator(train, seq_len=16, batch_size=8, seed=0, prefetch=0, state=state)
    for want in expected:
        got = next(resumed)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


@pytest.mark.parametrize("case, message", [
    ("missing", r"data.path='.*prepared' \(shard-00001.bin\) is missing"),
    ("truncated", r"data.path='.*prepared' \(shard-00001.bin\) is truncated: \d+ of the \d+ ids"),
    ("no_match", r"data.path='.*nothing-\*.bin' matches no files"),
    ("empty_source", r"data.sources\[1\].path='.*empty' \(part-000.bin\) is empty: no tokens"),
    ("missing_source", r"data.sources\[1\].path='.*nowhere' does not exist"),
    ("weights", r"DataConfig.sources=\[0, 0.0\] is invalid: the weights do not sum to a positive number"),
    ("negative", r"DataConfig.sources\[1\].weight=-1 is invalid: expected a number >= 0"),
    ("objective", r"data.sources \(a mixture\) feeds the next-token objective, not dpo: give its data as data.path"),
], ids=["missing", "truncated", "no_match", "empty_source", "missing_source", "weights", "negative", "objective"])
def test_bad_corpora_are_refused_by_name(tmp_path, case, message):
    prepared = tmp_path / "prepared"
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(6)))
    prepare(DataConfig(path=str(jsonl)), prepared, documents_per_shard=2, log=lambda _: None)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "part-000.bin").write_bytes(b"")
    paths = {"missing": prepared, "truncated": prepared, "no_match": f"{tmp_path}/nothing-*.bin",
             "empty_source": tmp_path / "empty", "missing_source": tmp_path / "nowhere"}
    if case == "missing":
        (prepared / "shard-00001.bin").unlink()
    if case == "truncated":
        data = (prepared / "shard-00001.bin").read_bytes()
        (prepared / "shard-00001.bin").write_bytes(data[:-2])
    with pytest.raises(ValueError, match=message):
        if case in ("weights", "negative"):
            DataConfig(sources=[{"path": "a", "weight": 0}, {"path": "b", "weight": -1 if case == "negative" else 0.0}])
        elif case == "objective":
            from modern_jax.training import run_config_from_dict

            run_config_from_dict({"model": {"vocab_size": "auto"}, "dpo": {},
                                  "data": {"sources": [{"path": str(prepared), "weight": 1}]}})
        elif case in ("empty_source", "missing_source"):
            load_splits(DataConfig(sources=[{"path": str(prepared), "weight": 1}, {"path": str(paths[case]),
                                                                                   "weight": 1}]))
        else:
            load_splits(DataConfig(path=str(paths[case])))


def jsonl_corpus(path, n=23):
    path.write_text("".join(json.dumps({"text": f"document {i}: " + "word " * (i % 7)}) + "\n" for i in range(n)))
    return path


def files_of(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_prepare_on_two_processes_writes_the_shards_of_one(tmp_path):
    source = jsonl_corpus(tmp_path / "c.jsonl")
    prepare(DataConfig(path=str(source)), tmp_path / "one", documents_per_shard=4, log=lambda _: None)
    command = [sys.executable, "-m", "modern_jax.cli", "prepare", "--data", str(source), "--out",
               str(tmp_path / "two"), "--documents-per-shard", "4", "--num-processes", "2"]
    env = {**os.environ, "MODERN_JAX_ALONE": "1"}
    children = [subprocess.Popen(command + ["--process-id", str(p)], env=env, stderr=subprocess.PIPE) for p in (0, 1)]
    assert [c.wait(timeout=300) for c in children] == [0, 0], [c.stderr.read().decode()[-600:] for c in children]
    one, two = files_of(tmp_path / "one"), files_of(tmp_path / "two")
    assert sorted(one) == sorted(two) and len([n for n in one if n.startswith("shard-")]) == 6
    assert one == two
    # training on the shards tokenizes nothing: the documents are the corpus's, each <bos> text <eos>
    _, train, val = load_splits(DataConfig(path=str(tmp_path / "two"), val_fraction=0.2))
    ids = np.concatenate([np.asarray(train.tokens), np.asarray(val.tokens)])
    texts = [json.loads(line)["text"] for line in source.read_text().splitlines()]
    assert ids.tolist() == [t for text in texts for t in [257, *text.encode(), SEP]]


def test_a_killed_prepare_resumes_and_a_foreign_directory_is_refused(tmp_path, monkeypatch):
    source = jsonl_corpus(tmp_path / "c.jsonl")
    prepare(DataConfig(path=str(source)), tmp_path / "whole", documents_per_shard=4, log=lambda _: None)
    write = paths_module.write_bytes
    written = []

    def killed_after_three(path, data):
        if path.name.startswith("shard-") and len(written) == 3:
            (path.parent / f".{path.name}.partial-99").write_bytes(data[: len(data) // 2])  # cut mid-write
            raise KeyboardInterrupt
        write(path, data)
        written.append(path.name)

    monkeypatch.setattr(paths_module, "write_bytes", killed_after_three)
    with pytest.raises(KeyboardInterrupt):
        prepare(DataConfig(path=str(source)), tmp_path / "out", documents_per_shard=4, log=lambda _: None)
    monkeypatch.setattr(paths_module, "write_bytes", write)
    before = {n: (tmp_path / "out" / n).stat().st_mtime_ns for n in written}
    prepare(DataConfig(path=str(source)), tmp_path / "out", documents_per_shard=4, log=lambda _: None)
    assert {n: (tmp_path / "out" / n).stat().st_mtime_ns for n in written} == before  # not written again
    resumed = {k: v for k, v in files_of(tmp_path / "out").items() if ".partial-" not in k}
    assert resumed == files_of(tmp_path / "whole")

    with pytest.raises(ValueError, match=r"--out .*out was prepared with other settings \(documents_per_shard\)"):
        prepare(DataConfig(path=str(source)), tmp_path / "out", documents_per_shard=5, log=lambda _: None)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match=r"--out .*mine holds notes.txt, which prepare did not write"):
        prepare(DataConfig(path=str(source)), tmp_path / "mine", documents_per_shard=4, log=lambda _: None)


def test_shards_on_object_storage_are_read_through_epath(tmp_path):
    """gs:// paths served from a local folder by `etils.epath.testing.mock_epath` (no network)."""
    from etils.epath import testing

    ids = corpus(5, 2000)
    write_shards(tmp_path / "bucket" / "corpus", ids, [1000])
    prepare(DataConfig(path=str(jsonl_corpus(tmp_path / "c.jsonl"))), tmp_path / "bucket" / "prepared",
            documents_per_shard=4, log=lambda _: None)
    opened = []

    def local(path):
        return str(path).replace("gs://", f"{tmp_path}/", 1)

    def mapped(name):
        def fn(original, path, *args, **kwargs):
            if name == "open":
                opened.append(str(path))
            return original(local(path), *args, **kwargs)
        return fn

    names = ("open", "exists", "isdir", "listdir", "glob", "stat", "walk")
    with testing.mock_epath(**{name: mapped(name) for name in names}):
        _, train, _ = load_splits(DataConfig(path="gs://bucket/corpus", source="tokens", doc_separator_id=SEP))
        got = TrainBatches(train, 32, 4, seed=1)[2]
        tokenizer, prepared, _ = load_splits(DataConfig(path="gs://bucket/prepared", val_fraction=0.2))
        first = np.asarray(prepared.tokens[:40])
    want = TrainBatches(reference(ids[:1800]), 32, 4, seed=1)[2]
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value)
    assert any(p.startswith("gs://bucket/corpus/part-001.bin") for p in opened)
    assert any(p.startswith("gs://bucket/prepared/shard-00000.bin") for p in opened)
    assert tokenizer.decode(first).startswith("document 0: ")  # through its index and tokenizer


def test_a_mixture_run_reports_each_source_and_resumes_bit_for_bit(tmp_path):
    """4 steps straight vs 2, stop, resume for 2 on a 2-source mixture: the same losses bit for
    bit; metrics.jsonl holds each source's validation loss, the mixture's as their mean by weight,
    and each source's share of the tokens."""
    from common import one_device
    from modern_jax.training import run_config_from_dict, train
    from modern_jax.training.metrics import read_metrics

    paths = [write_shards(tmp_path / name, corpus(k, 1500), []) for k, name in enumerate(("web", "code"))]

    def run(out):
        settings = {"steps": 4, "batch_size": 4, "seq_len": 16, "warmup_steps": 1, "log_every": 2, "eval_every": 2,
                    "eval_windows": 4, "eval_batch_size": 4, "final_eval_windows": 4, "checkpoint_every": 0,
                    "samples": 0, "progress": False, "plot": False, "output_dir": str(tmp_path / out)}
        return run_config_from_dict({
            "model": {"vocab_size": "auto", "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32,
                      "max_position_embeddings": 16},
            "train": settings,
            "data": {"sources": [{"path": str(paths[0]), "weight": 0.75}, {"path": str(paths[1]), "weight": 0.25}],
                     "doc_separator_id": SEP}})

    quiet = {"mesh": one_device(), "log": lambda *_: None}
    straight = train(run("a"), **quiet)
    first = train(run("b"), stop_after=2, **quiet)
    second = train(run("b"), **quiet)
    assert first.interrupted and [h["loss"] for h in first.history + second.history] == \
        [h["loss"] for h in straight.history]
    records = read_metrics(tmp_path / "a" / "metrics.jsonl")
    final = {r["split"]: r for r in records if r["step"] == 4 and r["split"].startswith("val")}
    assert sorted(final) == ["val", "val/code", "val/web"]
    assert final["val"]["loss"] == pytest.approx(0.75 * final["val/web"]["loss"] + 0.25 * final["val/code"]["loss"])
    assert final["val/web"]["loss"] != final["val/code"]["loss"]
    assert final["val"]["tokens"] == final["val/web"]["tokens"] + final["val/code"]["tokens"]
    shares = [r for r in records if r["split"] == "data"]
    assert [r["step"] for r in shares] == [2, 4] and all(r["share/web"] + r["share/code"] == 1 for r in shares)
