"""Bad inputs a new user meets: each ends in one line naming the file, field or flag and the fix
(exit status 2, no traceback), and nothing quietly uses a value other than the one given.

Most cases run `modern_jax.cli.main` on a converted checkpoint of a tiny random model (no
training) or stop in the checks before anything compiles. The tests run as root, where
chmod does not deny reads: unreadable files are emulated by a read that raises
PermissionError, as the operating system's would.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from flax import nnx
from safetensors.numpy import load_file, save_file

import modern_jax.accounting as accounting
import modern_jax.training.step as step_module
from modern_jax.cli import main
from modern_jax.config import ModelConfig
from modern_jax.convert import CheckpointError, initial_weights, save_checkpoint
from modern_jax.data.config import DataConfig
from modern_jax.data.corpora import TokenStream, load_splits
from modern_jax.data.pipeline import TrainBatches
from modern_jax.data.records import record_documents
from modern_jax.generate import _generate
from modern_jax.parallel.mesh import make_mesh
from modern_jax.parallel.topology import check_topology
from modern_jax.training import TrainConfig, Trainer
from modern_jax.training.step import abstract_model

REPO = pathlib.Path(__file__).parent.parent
HF_CHAT = REPO / "tests" / "fixtures" / "hf_chat"
MISSING = "no_such_run"  # a checkpoint that does not exist: checks that come before loading it
TINY = dict(vocab_size=260, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_position_embeddings=64)
TEXT = "the quick brown fox jumps over the lazy dog; " * 300  # 13,500 bytes


@pytest.fixture(autouse=True)
def quick_compiles(monkeypatch):
    monkeypatch.setattr(step_module, "COMPILER_OPTIONS", {"xla_backend_optimization_level": 0})


def refused(argv, capsys, command=None) -> str:
    """Run the CLI, expect exit status 2 and one error line; return that line."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    line = err.splitlines()[-1]
    assert line.startswith(f"modern-jax {command or argv[0]}: error: "), err
    return line


def checkpoint(directory: pathlib.Path, edit=None, **model) -> pathlib.Path:
    """A converted checkpoint (config.yaml + params/) of a tiny model, no tokenizer: its parameters
    drawn from normal(0, 0.02) on the host (quicker than the model's own initialisation), then
    `edit(params)` (a pure dict of numpy arrays) changes them."""
    graphdef, state = abstract_model(ModelConfig.from_dict({**TINY, **model}))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.normal(0, 0.02, s.shape).astype(s.dtype), nnx.to_pure_dict(state))
    if edit is not None:
        edit(params)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return save_checkpoint(nnx.merge(graphdef, state), directory)


@pytest.fixture(scope="module")
def rope(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("rope") / "ckpt")


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("learned") / "ckpt", position_embedding="learned")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(TEXT)
    return path


def hf_copy(tmp_path: pathlib.Path, damage=None, files=("config.json", "model.safetensors", "tokenizer.json",
                                                         "tokenizer_config.json", "chat_template.jinja")):
    """A copy of the tiny Hugging Face chat fixture; `damage(tensors)` edits its weights."""
    out = tmp_path / "hf"
    out.mkdir()
    for name in files:
        shutil.copy(HF_CHAT / name, out / name)
    if damage is not None:
        tensors = {k: v.copy() for k, v in load_file(out / "model.safetensors").items()}
        damage(tensors)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def finetune(hf, tmp_path, *overrides):
    return ["train", "--init-from-hf", hf, "--data", HF_CHAT / "chat.jsonl", "--output-dir", tmp_path / "run",
            "train.steps=2", "train.warmup_steps=1", "train.seq_len=32", "train.batch_size=8",
            "train.eval_batch_size=8", "train.eval_every=0", "train.checkpoint_every=0", "train.progress=false",
            "train.plot=false", "train.tensorboard=false", *overrides]


# ----- mesh axes and TPU topologies: named, and checked before libtpu sees them -------------------

@pytest.mark.parametrize("name, problem", [
    ("v5e:0x2", "every dimension of the shape '0x2' must be a positive integer"),
    ("v5e:2x-1", "every dimension of the shape '2x-1' must be a positive integer"),
    ("v5e:2x", "every dimension of the shape '2x' must be a positive integer"),
    ("v5e:2x2x2", "v5e slices have 2 dimensions, '2x2x2' has 3"),
    ("v5p:2x2", "v5p slices have 3 dimensions, '2x2' has 2"),
    ("v7:2x2", "unknown generation 'v7' (known: v4, v5e, v5p, v6e)"),
    ("v5e", "not a topology name"),
])
def test_a_malformed_topology_is_refused_before_libtpu(name, problem, capsys):
    line = refused(["plan", "--config", REPO / "configs" / "tiny.yaml", "--topology", name, "--mesh", "data=4",
                    "--batch", "8", "--seq", "16"], capsys)
    assert line.endswith(f"--topology {name!r}: {problem}; expected GENERATION:SHAPE such as v5e:2x2, v6e:4x4, "
                         f"v5p:2x2x2, v4:2x2x1")


@pytest.mark.parametrize("name", ["v5e:2x2", "v6e:4x4", "v5p:2x2x1", "v4:2x2x1", "v5p:4x4x4_twisted"])
def test_well_formed_topologies_pass_the_check(name):
    check_topology(name)


def test_a_context_axis_that_does_not_divide_the_devices_is_named(tmp_path, capsys):
    line = refused(["train", "--mesh", "data=-1,context=3", "--data", tmp_path / "none.txt", "--output-dir",
                    tmp_path / "run"], capsys)
    assert line.endswith("mesh context=3 with data=-1 (fill): 8 devices do not split into 3 x a whole data: make "
                         "context a divisor of 8")


def test_a_seq_len_the_context_axis_does_not_divide_is_named(tmp_path, corpus, capsys):
    line = refused(["train", "--mesh", "data=4,context=2", "--data", corpus, "--output-dir", tmp_path / "run",
                    "train.seq_len=33", "train.batch_size=8", "train.eval_batch_size=8"], capsys)
    assert line.endswith("train.seq_len=33 is not divisible by the mesh's context=2 (the devices that split the "
                         "sequence): make it a multiple of 2, or change context in --mesh (parallel.context)")
    assert not (tmp_path / "run").exists()


def test_a_model_the_fsdp_and_context_axes_do_not_divide_names_both():
    cfg = ModelConfig.from_dict({**TINY, "d_model": 18, "n_heads": 2, "head_dim": 8})
    with pytest.raises(ValueError, match=re.escape("model.d_model=18 is not divisible by the mesh's fsdp=2 x "
                                                   "context=2 = 4: choose a mesh whose fsdp x context size divides "
                                                   "18")):
        Trainer(cfg, TrainConfig(seq_len=16, warmup_steps=0), make_mesh(data=2, fsdp=2, context=2))


# ----- data files: not UTF-8, unreadable, damaged, local files read as source: hf -----------------

def test_a_file_that_is_not_utf8_in_a_text_directory_is_named_with_its_byte(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(TEXT[:3000])
    (tmp_path / "docs" / "b.txt").write_bytes(TEXT[:2000].encode() + b"\xff\xfe" + TEXT[:4000].encode())
    (tmp_path / "docs" / "c.txt").write_text(TEXT[:1000])
    line = refused(["train", "--data", tmp_path / "docs", "--output-dir", tmp_path / "run"], capsys)
    assert line.endswith(f"data.path='{tmp_path / 'docs'}' (b.txt) is not UTF-8 text (byte 2000: 0xff): convert "
                         f"it to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8) or move it out of the directory")
    (tmp_path / "docs" / "b.txt").unlink()
    _, train_stream, val_stream = load_splits(DataConfig(source="text", path=str(tmp_path / "docs")))
    assert len(train_stream) + len(val_stream) == 4000 + 2 * 2 * 2  # a.txt, c.txt: both parts in <bos> ... <eos>


def deny_reads(monkeypatch):
    """From now on, reading a file named `secret*` raises PermissionError, as it does for a user without
    read permission."""
    def deny(read):
        def guarded(self, *args, **kwargs):
            if self.name.startswith("secret"):
                raise PermissionError(13, "Permission denied", str(self))
            return read(self, *args, **kwargs)
        return guarded

    for method in ("read_bytes", "read_text", "open"):
        monkeypatch.setattr(pathlib.Path, method, deny(getattr(pathlib.Path, method)))


@pytest.mark.parametrize("layout, named", [
    ({"secret.txt": TEXT}, "data.path='{tmp}/secret.txt'"),
    ({"docs/a.txt": TEXT, "docs/secret.txt": TEXT}, "data.path='{tmp}/docs' (secret.txt)"),
    ({"secret.bin": np.arange(64, dtype=np.uint16).tobytes()}, "data.path='{tmp}/secret.bin'"),
], ids=["text_file", "text_directory", "token_file"])
def test_an_unreadable_data_file_is_named(layout, named, tmp_path, capsys, monkeypatch):
    for name, content in layout.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    data = tmp_path / next(iter(layout)).split("/")[0]
    deny_reads(monkeypatch)
    line = refused(["train", "--data", data, "--output-dir", tmp_path / "run"], capsys)
    assert line.endswith(named.format(tmp=tmp_path) + " cannot be read (Permission denied): check its permissions")


def test_an_unreadable_config_file_is_named(tmp_path, capsys, monkeypatch):
    (tmp_path / "secret.yaml").write_text("model: {}\n")
    deny_reads(monkeypatch)
    line = refused(["info", "--config", tmp_path / "secret.yaml"], capsys)
    assert line.endswith(f"{tmp_path / 'secret.yaml'} cannot be read (Permission denied): check its permissions")


TEXTS = [f"document {i}: " + TEXT[i * 40:(i + 1) * 40] for i in range(12)]


def write_records(directory: pathlib.Path) -> None:
    pq.write_table(pa.table({"text": TEXTS, "id": list(range(12))}), directory / "d.parquet")
    (directory / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (directory / "shards").mkdir()
    for k in range(3):
        pq.write_table(pa.table({"text": TEXTS[4 * k:4 * (k + 1)]}), directory / "shards" / f"part-{k}.parquet")


@pytest.mark.parametrize("name", ["d.parquet", "d.jsonl", "shards"])
def test_source_hf_reads_local_files_with_their_datasets_builder(name, tmp_path, monkeypatch):
    """A relative path, as a user types it: read here, never looked up on the hub."""
    write_records(tmp_path)
    monkeypatch.chdir(tmp_path)
    docs = record_documents(DataConfig(source="hf", path=name), "hf")
    assert [text for _, text in docs] == TEXTS


def test_source_hf_refuses_a_local_file_it_has_no_builder_for(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text(TEXT)
    line = refused(["train", "--data", tmp_path / "notes.txt", "data.source=hf", "--output-dir", tmp_path / "run"],
                   capsys)
    assert line.endswith(f"data.path='{tmp_path / 'notes.txt'}' is a local file: source: hf reads a file with the "
                         f"`datasets` builder of its extension (.parquet, .jsonl, .jsonl.gz, .json, .csv): give one "
                         f"of those, or set data.source: auto")


@pytest.mark.parametrize("data, source", [
    ("shards/part-1.parquet", "auto"), ("shards", "auto"), ("shards", "parquet"), ("shards", "hf"),
])
def test_a_damaged_parquet_file_is_named(data, source, tmp_path, capsys):
    write_records(tmp_path)
    bad = tmp_path / "shards" / "part-1.parquet"
    bad.write_bytes(bad.read_bytes()[:300])
    line = refused(["train", "--data", tmp_path / data, f"data.source={source}", "--output-dir", tmp_path / "run"],
                   capsys)
    assert str(bad) in line and "Parquet magic bytes not found in footer" in line, line


def test_a_train_seq_len_as_long_as_the_training_split_is_said(recwarn):
    stream = TokenStream(np.arange(20, dtype=np.int32), np.zeros(1, np.int64))
    with pytest.warns(UserWarning, match=r"train.seq_len=24 is as long as the training split \(20 tokens\): every "
                                         r"row of every batch is the whole split from its start, padded; lower "
                                         r"train.seq_len to at most 18 for windows at random starts"):
        batches = TrainBatches(stream, seq_len=24, batch_size=4)
    inputs_RT = batches[0]["inputs"][0]
    assert (inputs_RT == np.r_[np.arange(20), np.zeros(4)][None]).all()  # every row the same padded window
    with pytest.warns(UserWarning, match=r"train.seq_len=19 is as long as the training split \(20 tokens\): every "
                                         r"row of every batch is the whole split from its start; lower"):
        TrainBatches(stream, seq_len=19, batch_size=4)  # one window of T + 1 tokens: full, but only one
    TrainBatches(stream, seq_len=18, batch_size=4)  # two starts: no warning
    assert not [w for w in recwarn if "train.seq_len" in str(w.message)]


# ----- initial weights: NaN or inf, and a model without its tokenizer -----------------------------

def test_train_from_hf_weights_with_nan_or_inf_is_refused_before_training(tmp_path, capsys):
    def damage(tensors):
        tensors["model.layers.0.self_attn.q_proj.weight"][0, :3] = np.nan
        tensors["model.layers.2.mlp.down_proj.weight"][1, 1] = -np.inf

    hf = hf_copy(tmp_path, damage)
    line = refused(finetune(hf, tmp_path), capsys)
    assert f"{hf}: 2 tensor(s) hold NaN or infinite values: " in line
    assert "model.layers.0.self_attn.q_proj.weight in model.safetensors (3 NaN, 0 inf of 1,024 values)" in line
    assert "model.layers.2.mlp.down_proj.weight in model.safetensors (0 NaN, 1 inf of 2,048 values)" in line
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_converted_checkpoint_with_nan_is_refused_as_initial_weights(tmp_path):
    def damage(params):
        params["embed_tokens"][5, 2] = np.nan

    ckpt = checkpoint(tmp_path / "ckpt", damage)
    _, init = initial_weights(ckpt)
    with pytest.raises(CheckpointError, match=re.escape(f"{ckpt / 'params'}: 1 tensor(s) hold NaN or infinite "
                                                        f"values: embed_tokens (1 NaN, 0 inf of 4,160 values)")):
        init.params()


def test_a_model_without_a_tokenizer_is_refused_and_the_suggested_fix_trains(tmp_path, capsys):
    hf = hf_copy(tmp_path, files=("config.json", "model.safetensors"))
    line = refused(finetune(hf, tmp_path), capsys)
    assert line.endswith(f"--init-from-hf {hf} has no tokenizer.json, and the model's token ids mean nothing to "
                         f"another tokenizer: put the model's tokenizer files (tokenizer.json, tokenizer_config.json) "
                         f"beside its weights, or set data.tokenizer_path=FILE (the model's tokenizer.json)")
    assert not (tmp_path / "run").exists()
    (tmp_path / "bytes.json").write_text('{"kind": "byte"}')
    line = refused(finetune(hf, tmp_path, f"data.tokenizer_path={tmp_path / 'bytes.json'}"), capsys)
    assert line.endswith(f"data.tokenizer_path='{tmp_path / 'bytes.json'}' has 260 ids, more than the vocab_size=128 "
                         f"of the model from --init-from-hf {hf}: give the tokenizer the model was trained with")
    # the fix as suggested: the model's tokenizer.json (with its chat template beside it)
    assert main([str(a) for a in finetune(hf, tmp_path, f"data.tokenizer_path={HF_CHAT / 'tokenizer.json'}")]) == 0
    assert "val_loss: " in capsys.readouterr().out
    saved = json.loads((tmp_path / "run" / "tokenizer.json").read_text())
    assert saved["kind"] == "hf" and "<|im_end|>" in json.dumps(saved["tokenizer"])


def test_a_tokenizer_path_beside_a_model_with_its_own_tokenizer_is_refused(tmp_path, capsys):
    line = refused(finetune(HF_CHAT, tmp_path, f"data.tokenizer_path={HF_CHAT / 'tokenizer.json'}"), capsys)
    assert line.endswith(f"--init-from-hf {HF_CHAT} brings the model's own tokenizer, so data.tokenizer_path="
                         f"'{HF_CHAT / 'tokenizer.json'}' would not be used: remove it")
