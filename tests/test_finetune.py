"""Fine-tuning a Hugging Face model on conversations: the documented section (docs/training.md,
and its example on the README's front page) run as written on
the tiny fixture, the exported weights, `--init-from-hf` sources and refusals, and hub names
resolved through the local Hugging Face cache."""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from modern_jax.cli import main
from modern_jax.convert import CheckpointError, convert_from_hf, from_hf, initial_weights, load_checkpoint, resolve_hf

from common import leaves

REPO = pathlib.Path(__file__).parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "hf_chat"
SECTION = "## Fine-tune a Hugging Face model on your conversations"
FRONT_SECTION = "### Fine-tune a Hugging Face model on conversations"


def readme_commands(page: str = "docs/training.md", heading: str = SECTION) -> list[list[str]]:
    """The `uv run modern-jax ...` lines of a page's fine-tuning section (continuations joined)."""
    text = (REPO / page).read_text()
    section = text[text.index(heading):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    return [shlex.split(line.split("#")[0])[3:] for line in block.splitlines() if line.startswith("uv run modern-jax")]


def params_of(model) -> dict:
    return leaves(nnx.state(model, nnx.Param))


def test_the_readme_fine_tuning_section_runs_as_written(tmp_path, monkeypatch, capsys):
    commands = readme_commands()
    assert readme_commands("README.md", FRONT_SECTION) == commands  # the front page's example is this one
    assert [c[0] for c in commands] == ["train", "evaluate", "convert"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tests").symlink_to(REPO / "tests")  # the paths of the docs, from the repository root
    outputs = []
    for argv in commands:
        assert main(argv) == 0, capsys.readouterr().err
        outputs.append(capsys.readouterr().out)
    train_out, evaluate_out, _ = outputs
    val_loss = float(re.search(r"^val_loss: (\S+)$", train_out, re.M).group(1))
    losses = [json.loads(line) for line in (tmp_path / "runs/chat/metrics.jsonl").read_text().splitlines()]
    train_losses = [r["loss"] for r in losses if r["split"] == "train"]
    assert train_losses[0] > train_losses[-1] + 1.0  # it learns
    # evaluate: the loss over the assistant's tokens only: 6 per conversation ("a plus b is c" and <|im_end|>)
    tokens = int(re.search(r"^tokens: (\d+)$", evaluate_out, re.M).group(1))
    assert tokens % 6 == 0 and 0 < tokens < 6 * 25
    assert float(re.search(r"^loss: (\S+)$", evaluate_out, re.M).group(1)) == pytest.approx(val_loss, abs=1e-4)

    # the export: the fine-tuned parameters exactly, in the fixture's family, with its tokenizer files
    export = tmp_path / "runs/chat_hf"
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "llama" and config["eos_token_id"] == 2
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (export / name).read_bytes() == (FIXTURE / name).read_bytes(), name
    _, exported = from_hf(export)
    _, trained = load_checkpoint(tmp_path / "runs/chat")
    _, original = from_hf(FIXTURE)
    got, want, before = params_of(exported), params_of(trained), params_of(original)
    assert got.keys() == want.keys() == before.keys()
    for k in got:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        assert not np.allclose(got[k], before[k]), f"{k} did not change"

    # the same command again resumes the finished run (the weights come from its checkpoint)
    assert main(commands[0]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "initialised from" not in out and "steps: 60" in out


def test_init_from_a_converted_checkpoint_takes_its_weights_and_tokenizer(tmp_path):
    convert_from_hf(FIXTURE, tmp_path / "ckpt")
    cfg, init = initial_weights(tmp_path / "ckpt")
    hf_cfg, hf_init = initial_weights(FIXTURE)
    assert cfg == hf_cfg
    ours, theirs = init.params(), hf_init.params()
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)
    template = (FIXTURE / "chat_template.jinja").read_text()
    assert init.tokenizer.chat_template == hf_init.tokenizer.chat_template == template
    assert init.tokenizer.special_tokens["eos_token"] == "<|im_end|>"
    assert sorted(a.name for a in init.assets) == sorted(a.name for a in hf_init.assets)


def test_init_from_hf_refuses_a_model_section_that_changes_the_network(tmp_path, capsys):
    argv = ["train", "--init-from-hf", str(FIXTURE), "--data", str(FIXTURE / "chat.jsonl"),
            "--output-dir", str(tmp_path / "run")]
    assert main([*argv, "--config", str(REPO / "configs/tiny.yaml")]) == 2
    err = capsys.readouterr().err
    assert "the model comes from --init-from-hf" in err and "not vocab_size, d_model, n_layers" in err, err
    assert main([*argv, "model.n_heads=2"]) == 2
    assert "not n_heads" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing written


def _fake_hub_cache(root: pathlib.Path, repo: str, source: pathlib.Path) -> None:
    """The layout huggingface_hub keeps a downloaded snapshot in."""
    base = root / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    shutil.copytree(source, base / "snapshots" / commit)


def test_a_hub_name_resolves_through_the_local_cache_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    _fake_hub_cache(tmp_path / "hub", "tiny-org/chat", FIXTURE)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no network: the cache alone
    assert (resolve_hf("tiny-org/chat") / "config.json").read_bytes() == (FIXTURE / "config.json").read_bytes()
    cfg, model = from_hf("tiny-org/chat")
    _, direct = from_hf(FIXTURE)
    jax.tree.map(np.testing.assert_array_equal, params_of(model), params_of(direct))
    with pytest.raises(CheckpointError, match=r"'tiny-org/missing' is not a directory, and the Hugging Face cache "
                                              r"\(.*hub\) does not hold it .*`hf download tiny-org/missing`"):
        from_hf("tiny-org/missing")
