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
