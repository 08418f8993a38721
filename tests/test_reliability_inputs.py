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
from modern_jax.cli import main
from modern_jax.config import ModelConfig
from modern_jax.convert import CheckpointError, initial_weights, save_checkpoint
from modern_jax.data.config import DataConfig
from modern_jax.data.corpora import TokenStream, load_splits
from modern_jax.data.batches import TrainBatches
from modern_jax.data.records import record_documents
from modern_jax import execution
from modern_jax.generate import _generate
from modern_jax.sharding.mesh import make_mesh
from modern_jax.sharding.devices import check_topology
from modern_jax.training import TrainConfig
from modern_jax.model import abstract_params

from common import make_trainer

REPO = pathlib.Path(__file__).parent.parent
HF_CHAT = REPO / "tests" / "fixtures" / "hf_chat"
MISSING = "no_such_run"  # a checkpoint that does not exist: checks that come before loading it
TINY = dict(vocab_size=260, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_position_embeddings=64)
TEXT = "the quick brown fox jumps over the lazy dog; " * 300  # 13,500 bytes


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
    graphdef, state = abstract_params(ModelConfig.from_dict({**TINY, **model}))
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

@pytest.mark.quick
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
        make_trainer(cfg, TrainConfig(seq_len=16, warmup_steps=0), make_mesh(data=2, fsdp=2, context=2))


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


# ----- evaluate and generate: the values they use, the memory they need, the flags they name ------

def test_evaluate_refuses_a_seq_len_past_learned_positions(learned, corpus, capsys):
    """The positions of a window run to seq_len - 1; past the table JAX would clamp them silently."""
    line = refused(["evaluate", "--checkpoint", learned, "--data", corpus, "--seq-len", "65"], capsys)
    assert line.endswith("--seq-len 65 exceeds the model's max_position_embeddings=64 (learned positions have no "
                         "row past it): give --seq-len 64 or less")


def test_evaluate_says_which_values_it_uses(rope, corpus, capsys):
    argv = ["evaluate", "--checkpoint", str(rope), "--data", str(corpus)]
    assert main(argv + ["--max-windows", "100000", "--batch-size", "100000"]) == 0
    err = capsys.readouterr().err
    windows = -(-(len(TEXT) + 1) // 64)  # <bos> text <eos>: 13,502 tokens, 13,501 targets in windows of 64
    assert f"no tokenizer.json in {rope}: using the byte tokenizer" in err
    assert "windows of 64 tokens: the checkpoint's config has no train.seq_len (--seq-len sets it)" in err
    assert (f"--max-windows 100000: --data {corpus} has {windows} windows of 64 tokens; evaluating all of them"
            in err)
    assert f"--batch-size 100000: --data {corpus} gives {windows} windows of 64 tokens; one batch of {windows}" in err
    assert main(argv + ["--seq-len", "65"]) == 0
    assert ("--seq-len 65 exceeds the model's max_position_embeddings=64: the windows run past the trained context "
            "(rope positions), and the loss there measures that") in capsys.readouterr().err


def test_evaluate_refuses_the_byte_tokenizer_for_a_model_its_ids_do_not_fit(tmp_path, corpus, capsys):
    small = checkpoint(tmp_path / "ckpt", vocab_size=128)
    line = refused(["evaluate", "--checkpoint", small, "--data", corpus], capsys)
    assert line.endswith(f"no tokenizer.json in {small} (nor in its hf/), and the byte tokenizer's 260 ids do not "
                         f"fit the model's vocab_size=128: copy the tokenizer.json the model was trained with into "
                         f"{small}")


def test_evaluate_prints_an_infinite_perplexity_as_inf(tmp_path, corpus, capsys):
    """A loss past 700 nats: exp(loss) overflows; it was printed as exp(700)."""
    def scale_head(params):
        params["lm_head"]["kernel"] *= 1e6  # logits of thousands

    ckpt = checkpoint(tmp_path / "ckpt", scale_head)
    assert main(["evaluate", "--checkpoint", str(ckpt), "--data", str(corpus), "--max-windows", "2"]) == 0
    out = capsys.readouterr().out
    assert float(re.search(r"^loss: (\S+)$", out, re.M).group(1)) > 1000
    assert re.search(r"^perplexity: inf$", out, re.M), out


def test_generate_says_in_one_line_that_it_stops_at_learned_positions(learned, capsys):
    assert main(["generate", "--checkpoint", str(learned), "--max-new-tokens", "100", "--greedy"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[-1] == ("generation stops at the context of max_position_embeddings=64 tokens "
                                             "(learned positions): 63 new tokens after the 1-token prompt, not "
                                             "max_new_tokens=100")
    assert "Warning" not in captured.err, captured.err


def needs(compiled, resident) -> int:
    """XLA's count of a compiled program's peak, less the parameters already in memory."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes - \
        resident


def test_evaluate_refuses_a_batch_larger_than_the_memory_and_says_what_fits(rope, corpus, capsys, monkeypatch):
    monkeypatch.setattr(accounting, "free_memory", lambda device: (3 * 2**20, "this host"))
    line = refused(["evaluate", "--checkpoint", rope, "--data", corpus, "--batch-size", "128", "--seq-len", "64"],
                   capsys)
    match = re.fullmatch(r"modern-jax evaluate: error: evaluate needs ([\d.]+) MiB for --batch-size 128 x "
                         r"--seq-len 64 \(XLA's count\); this host has 3.00 MiB free: lower --batch-size \(at most "
                         r"about (\d+) fit\)", line)
    assert match, line
    fits = int(match.group(2))
    # the reference: XLA's own count of the evaluation step at those batch sizes
    cfg = ModelConfig.from_dict(TINY)
    trainer = make_trainer(cfg, TrainConfig(seq_len=64, warmup_steps=0), make_mesh(data=-1, devices=jax.devices()[:1]))
    graphdef, abstract = abstract_params(cfg)
    params = nnx.to_pure_dict(abstract)
    resident = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))

    def need(rows):
        return needs(trainer.programs.lower("eval", params, trainer.batches.abstract((rows, 64)),
                                   jax.ShapeDtypeStruct((260,), jnp.int32), None).compile(), resident)

    assert abs(float(match.group(1)) - need(128) / 2**20) < 0.01
    assert need(fits) <= 3 * 2**20 * 1.02 and need(int(fits * 1.2) + 1) > 3 * 2**20  # nearly affine


def test_evaluate_names_the_seq_len_when_one_window_does_not_fit(rope, corpus, capsys):
    """On this host, for real: one window of a million tokens needs terabytes (dense attention scores)."""
    line = refused(["evaluate", "--checkpoint", rope, "--data", corpus, "--seq-len", "1000000"], capsys)
    assert re.fullmatch(r"modern-jax evaluate: error: evaluate needs [\d.,]+ TiB for --batch-size 1 x --seq-len "
                        r"1000000 \(XLA's count\); this host has [\d.,]+ [KMGT]iB free: lower --seq-len", line), line


def test_generate_refuses_more_tokens_than_the_memory_holds_and_says_how_many_fit(rope, capsys, monkeypatch):
    free = 2 * 2**20
    monkeypatch.setattr(accounting, "free_memory", lambda device: (free, "this host"))
    line = refused(["generate", "--checkpoint", rope, "--max-new-tokens", "20000", "--num-samples", "2"], capsys)
    match = re.fullmatch(r"modern-jax generate: error: generate needs [\d.]+ MiB for --max-new-tokens 20000 x "
                         r"--num-samples 2 \(XLA's count\); this host has 2.00 MiB free: lower --max-new-tokens "
                         r"\(at most about ([\d,]+) fit\)", line)
    assert match, line
    fits = int(match.group(1).replace(",", ""))
    # the reference: XLA's own count of the sampling program with that many new tokens
    cfg = ModelConfig.from_dict(TINY)
    graphdef, abstract = abstract_params(cfg)
    params = nnx.to_pure_dict(abstract)
    resident = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))

    def need(tokens):
        return needs(_generate.lower(graphdef, params, jax.ShapeDtypeStruct((2, 1), jnp.int32), jax.random.key(0),
                                     max_new_tokens=tokens, temperature=0.8, top_k=None, top_p=None,
                                     eos_id=258, run=execution.current()).compile(), resident)

    assert need(fits) <= free * 1.02 and need(int(fits * 1.2) + 1) > free  # "about": XLA's count is nearly affine
    line = refused(["generate", "--checkpoint", rope, "--max-new-tokens", "10", "--num-samples", "20000"], capsys)
    assert re.search(r"x --num-samples 20000 \(XLA's count\); this host has 2.00 MiB free: lower --num-samples "
                     r"\(at most about [\d,]+ fit\)$", line), line


def test_generate_refuses_a_top_k_above_the_vocabulary(rope, capsys):
    line = refused(["generate", "--checkpoint", rope, "--top-k", "100000"], capsys)
    assert re.fullmatch(r"modern-jax generate: error: --top-k 100000 exceeds the model's vocabulary of [\d,]+ tokens, "
                        r"so it would keep every token: give at most [\d,]+, or leave it out \(no top-k\)", line), line


def test_a_prompt_with_a_byte_that_is_not_utf8_names_the_flag(capsys):
    """The shell hands a byte that is not UTF-8 to Python as a surrogate escape ('\\udcff' for 0xff)."""
    line = refused(["generate", "--checkpoint", MISSING, "--prompt", "ab\udcffc"], capsys)
    assert line.endswith("--prompt is not UTF-8 text: the byte 0xff at character 2; give the prompt as UTF-8 (check "
                         "the terminal's or the file's encoding)")


def test_a_prompt_the_tokenizer_cannot_encode_names_the_flag(tmp_path, capsys):
    ckpt = checkpoint(tmp_path / "ckpt", vocab_size=6)
    (ckpt / "tokenizer.json").write_text(json.dumps({"kind": "char", "chars": "abcd"}))
    line = refused(["generate", "--checkpoint", ckpt, "--prompt", "abz"], capsys)
    assert line.endswith("--prompt cannot be encoded: characters outside the char tokenizer's vocabulary: ['z']")


def test_evaluate_names_its_flags_not_settings_it_does_not_take(rope, tmp_path, capsys):
    (tmp_path / "body.jsonl").write_text(json.dumps({"body": TEXT}) + "\n")
    line = refused(["evaluate", "--checkpoint", rope, "--data", tmp_path / "body.jsonl"], capsys)
    assert line.endswith(f"{tmp_path / 'body.jsonl'}, line 1: no field 'text' (data.text_field); the fields are "
                         f"'body': evaluate reads --data with the run's data: settings ({rope / 'config.yaml'}), "
                         f"which it does not change: give --data a file they read")
    (tmp_path / "bytes.txt").write_bytes(b"ab\xffc")
    line = refused(["evaluate", "--checkpoint", rope, "--data", tmp_path / "bytes.txt"], capsys)
    assert line.endswith(f"--data {tmp_path / 'bytes.txt'} is not UTF-8 text (byte 2: 0xff): evaluate reads --data "
                         f"with the run's data: settings ({rope / 'config.yaml'}), which it does not change: give "
                         f"--data a file they read")
    line = refused(["evaluate", "--checkpoint", rope, "--data", "org/name"], capsys)
    assert line.endswith("--data org/name does not exist: give a file or directory of documents")


def test_evaluate_names_the_runs_data_path_when_it_is_gone(tmp_path, capsys):
    ckpt = checkpoint(tmp_path / "ckpt")
    config = ckpt / "config.yaml"
    config.write_text(yaml.safe_dump({"model": yaml.safe_load(config.read_text()),
                                      "data": {"path": str(tmp_path / "moved.txt")}}))
    line = refused(["evaluate", "--checkpoint", ckpt], capsys)
    assert line.endswith(f"the run's data.path='{tmp_path / 'moved.txt'}' (in {config}) does not exist: give --data "
                         f"FILE to evaluate a file instead")
