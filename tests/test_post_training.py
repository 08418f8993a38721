"""The documented LoRA / QLoRA and DPO sections (docs/training.md, and their example on the
README's front page) run as written on the tiny fixtures, and what they write is checked: the
frozen base, the PEFT adapter (read back into the model: its logits), the merged export (read
by `from_hf`: the run's logits), the quantized base, the DPO run's TRL metrics and its start
from the adapter. The same adapter in PEFT itself: tests/test_convert_live.py. The DPO run and a
GRPO run (full weights, two steps) evaluated by `evaluate` to their own final validation figures,
and that GRPO run resumed for DPO refused by name (`modern_jax.cli.evaluate`,
`training.checkpoint`)."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from flax import nnx
from flax.nnx import traversals

from modern_jax.cli import main
from modern_jax.convert import from_hf, load_checkpoint
from modern_jax.convert.peft import peft_targets, read_peft, read_peft_config
from modern_jax.training import load_run_config, train
from modern_jax.convert import finetune_run

from common import lora_model
from test_finetune import readme_commands

REPO = pathlib.Path(__file__).parent.parent
LORA_SECTION, DPO_SECTION = "## Fine-tune with LoRA / QLoRA", "## Preference tuning (DPO)"
FRONT = "### Fine-tune with LoRA / QLoRA, and preference tuning (DPO)"
TOKENS = jnp.asarray(np.random.default_rng(0).integers(4, 33, (2, 16)), jnp.int32)


@nnx.jit
def logits(model, tokens):
    """The model's logits, one compile (eagerly each operation would compile)."""
    return model(tokens)


def records(path: pathlib.Path, split: str = "train") -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["split"] == split]


def flat(tree) -> dict:
    return traversals.flatten_mapping(jax.device_get(tree))


def test_the_lora_qlora_and_dpo_sections_run_as_written(tmp_path, monkeypatch, capsys):
    lora_commands = readme_commands("docs/training.md", LORA_SECTION)
    dpo_commands = readme_commands("docs/training.md", DPO_SECTION)
    assert [c[:2] for c in lora_commands] == [["train", "--config"], ["convert", "--to-peft"],
                                              ["convert", "--to-hf"], ["train", "--config"]]
    # the front page's example: LoRA, its exports and DPO from its adapter, as documented
    assert readme_commands("README.md", FRONT) == lora_commands[:3] + dpo_commands
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tests").symlink_to(REPO / "tests")
    (tmp_path / "configs").symlink_to(REPO / "configs")
    outputs = []
    for argv in lora_commands + dpo_commands:
        assert main(argv) == 0, capsys.readouterr().err
        outputs.append(capsys.readouterr().out)

    # LoRA: it learns, the base is the Hugging Face model's to the bit, only adapters are new
    lora_losses = [r["loss"] for r in records(tmp_path / "runs/lora/metrics.jsonl")]
    assert lora_losses[-1] < lora_losses[0] - 0.1
    cfg, base = from_hf("tests/fixtures/hf_chat")
    _, run_model = load_checkpoint("runs/lora")
    run_params, base_params = flat(nnx.to_pure_dict(nnx.state(run_model, nnx.Param))), flat(
        nnx.to_pure_dict(nnx.state(base, nnx.Param)))
    assert set(run_params) - set(base_params) == {k for k in run_params if "adapter" in k} != set()
    for k, v in base_params.items():
        np.testing.assert_array_equal(run_params[k], v, err_msg=str(k))  # frozen
    want = np.asarray(logits(run_model, TOKENS))
    assert np.max(np.abs(want - np.asarray(logits(base, TOKENS)))) > 1e-2  # the adapters changed it

    # the PEFT adapter read back onto the base: the run's logits; the merged export: the same
    adapter = tmp_path / "runs/lora_adapter"
    lora = dataclasses.replace(read_peft_config(adapter), targets=peft_targets(adapter, base, "llama"))
    assert (lora.rank, lora.alpha, lora.dropout) == (16, 32.0, 0.05)
    model = lora_model(cfg, lora)
    state = flat(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    state.update(base_params)
    state.update(traversals.flatten_mapping(read_peft(adapter, model, "llama")))
    model = nnx.merge(nnx.graphdef(model), traversals.unflatten_mapping(state))
    np.testing.assert_allclose(np.asarray(logits(model, TOKENS)), want, atol=1e-6)
    _, merged = from_hf(tmp_path / "runs/lora_merged")
    # merged: W + s B A rounded once in float32, so a few logits move by 2e-5 (the adapters moved them by > 1e-2)
    np.testing.assert_allclose(np.asarray(logits(merged, TOKENS)), want, atol=1e-4)

    # QLoRA: NF4 pieces in the checkpoint, and it learns
    _, qmodel = load_checkpoint("runs/qlora")
    pieces = {k[-1]: v.dtype for k, v in flat(nnx.to_pure_dict(nnx.state(qmodel, nnx.Param))).items()
              if "q_proj" in k and "kernel" in k}
    assert pieces == {"codes": np.uint8, "absmax_q": np.int8, "absmax_scale": np.float32, "absmax_mean": np.float32}
    q_losses = [r["loss"] for r in records(tmp_path / "runs/qlora/metrics.jsonl")]
    assert q_losses[-1] < q_losses[0] - 0.1

    # DPO from the adapter: TRL's names; step 1 is not log 2 (the adapter moved the policy from
    # its reference, the base); the chosen pull ahead: over the last 10 steps (4 pairs a step, so one
    # step's accuracy is 0.25 to 1.0 as the batch falls) and on the 2 held-out pairs
    dpo = records(tmp_path / "runs/dpo/metrics.jsonl")
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected"} <= set(dpo[0])
    assert abs(dpo[0]["loss"] - math.log(2)) > 1e-4 and dpo[0]["rewards/chosen"] != 0
    last = {k: np.mean([r[k] for r in dpo[-10:]]) for k in ("loss", "rewards/margins", "rewards/accuracies")}
    assert last["loss"] < dpo[0]["loss"] - 0.02 and last["rewards/margins"] > 0.03 and last["rewards/accuracies"] > 0.6
    val = records(tmp_path / "runs/dpo/metrics.jsonl", "val")[-1]
    assert val["rewards/margins"] > 0 and val["loss"] < math.log(2)
    assert "initialised from the Hugging Face model tests/fixtures/hf_chat with the PEFT adapter" in outputs[-1] or \
        (tmp_path / "runs/dpo/config.yaml").read_text().count("rank: 16") == 1
    # evaluate gives the DPO run TRL's figures of its own validation, against its base (the adapters off)
    assert_evaluates_to_its_validation(tmp_path / "runs/dpo", "pairs", capsys)


def test_a_resumed_lora_run_ends_with_the_adapters_of_an_unbroken_one(tmp_path, capsys):
    """Straight, and stopped after 2 steps then resumed with checkpoints that hold only the
    adapters (`lora.save_base=false`: the base is read again from --init-from-hf): the same model."""
    quiet = dict(log=lambda *_: None)
    finals = {}
    for name, stop, save_base in (("straight", None, "true"), ("resumed", 2, "false")):
        run = load_run_config(REPO / "configs/finetune_lora.yaml", [
            f"train.output_dir={tmp_path / name}", f"data.path={REPO / 'tests/fixtures/hf_chat/chat.jsonl'}",
            "train.steps=4", "train.seq_len=32", "train.warmup_steps=0", "train.eval_every=0", "train.plot=false",
            "train.tensorboard=false", "train.progress=false", "train.final_eval_windows=1",
            f"lora.save_base={save_base}"])
        run, init = finetune_run(run, REPO / "tests/fixtures/hf_chat")
        if stop is not None:
            assert train(run, init=init, stop_after=stop, **quiet).interrupted
        assert train(run, init=init, **quiet).step == 4
        finals[name] = flat(nnx.to_pure_dict(nnx.state(load_checkpoint(tmp_path / name)[1], nnx.Param)))
    assert finals["straight"].keys() == finals["resumed"].keys()
    for k, v in finals["straight"].items():
        np.testing.assert_array_equal(finals["resumed"][k], v, err_msg=str(k))
    assert any("adapter" in k for k in finals["straight"])
    def saved(name):  # the leaves the step's params item holds, by the checkpoint's own metadata
        with ocp.StandardCheckpointer() as checkpointer:
            meta = checkpointer.metadata(tmp_path / name / "checkpoints" / "4" / "params")
        tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
        return {"/".join(str(getattr(k, "key", k)) for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}
    assert any("embed" in k for k in saved("straight"))
    assert saved("resumed") and all("adapter" in k for k in saved("resumed"))  # the adapters, not the base
    # the adapters-only run evaluates and converts as the other: the base comes from its base.json
    assert json.loads((tmp_path / "resumed" / "base.json").read_text())["source"].endswith("hf_chat")
    for name in ("straight", "resumed"):
        assert main(["evaluate", "--checkpoint", str(tmp_path / name)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("loss:")][0] == [line for line in out if line.startswith("loss:")][1]


# ----- a run trained for DPO or GRPO: evaluated for its objective, resumed only for it ------------------

HF_CHAT = REPO / "tests" / "fixtures" / "hf_chat"
STEPS = {"steps": 2, "batch_size": 8, "eval_batch_size": 8, "seq_len": 32, "lr": 1e-3, "warmup_steps": 0,
         "log_every": 1, "eval_every": 0, "checkpoint_every": 2, "final_eval_windows": None, "samples": 0,
         "progress": False, "plot": False, "tensorboard": False}
SECTIONS = {"dpo": {"dpo": {"beta": 0.1}, "data": {"val_fraction": 0.2}},
            "grpo": {"grpo": {"rewards": [f"{REPO}/configs/rewards.py:exact_answer",
                                          f"{REPO}/configs/rewards.py:number_last"],
                              "num_generations": 4, "max_completion_length": 6, "beta": 0.04},
                     "data": {"val_fraction": 0.25}}}


def objective_train(home: pathlib.Path, name: str, *overrides) -> list[str]:
    """`train` of the chat fixture's full weights for `name`'s objective (dpo, grpo) into `home`/run."""
    config = home / f"{name}.yaml"
    config.write_text(json.dumps({"model": {}, "train": STEPS, **SECTIONS[name]}))
    if name == "dpo":
        data = HF_CHAT / "preferences.jsonl"
    else:
        import runpy

        data = home / "arithmetic.jsonl"
        runpy.run_path(str(REPO / "scripts" / "make_arithmetic.py"))["main"](["--out", str(data), "--largest", "3"])
    return ["train", "--config", str(config), "--init-from-hf", str(HF_CHAT), "--data", str(data), "--output-dir",
            str(home / "run"), *overrides]


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory) -> pathlib.Path:
    """Two steps of GRPO on the chat fixture's full weights, with a KL penalty: its checkpoints keep a
    frozen copy of its start, the reference (a LoRA run's is its base, the adapters off)."""
    home = tmp_path_factory.mktemp("grpo")
    assert main(objective_train(home, "grpo")) == 0
    return home / "run"


def assert_evaluates_to_its_validation(run: pathlib.Path, unit: str, capsys) -> None:
    """`evaluate` of `run` scores, by default, the held-out pairs or prompts of its final evaluation,
    and prints every figure its metrics.jsonl holds of it, equal within 1e-4 (printed to 4 decimals)."""
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(run)]) == 0, capsys.readouterr().err
    first, *lines = capsys.readouterr().out.splitlines()
    final = records(run / "metrics.jsonl", "val")[-1]
    setting = yaml.safe_load((run / "config.yaml").read_text())["train"]["final_eval_windows"]
    assert first == (f"scored: all {final[unit]} {unit} of the val split; the {unit} of the run's final evaluation "
                     f"(train.final_eval_windows={'null' if setting is None else setting}): at its last step, loss "
                     f"is its val_loss"), first
    printed = dict(line.split(": ", 1) for line in lines)
    assert printed.pop("split") == "val"
    assert set(printed) == set(final) - {"step", "split"}, printed
    for key, value in printed.items():
        assert abs(float(value) - final[key]) <= 1e-4, (key, value, final[key])


def test_evaluate_gives_a_grpo_run_the_figures_of_its_own_validation(grpo_run, capsys):
    """The reward, lengths, entropy and KL (to the reference its checkpoint keeps) of completions
    sampled for the held-out prompts with the run's own keys."""
    assert_evaluates_to_its_validation(grpo_run, "prompts", capsys)


def test_a_grpo_run_resumed_for_dpo_is_refused_naming_the_objective(grpo_run, capsys):
    saved = {p.relative_to(grpo_run): p.read_bytes() for p in grpo_run.rglob("*") if p.is_file()}
    assert main(objective_train(grpo_run.parent, "dpo", "train.steps=4")) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"modern-jax train: error: the checkpoints in {str(grpo_run)!r} were trained for another objective (a grpo: "
        f"section there, a dpo: section here, by its config.yaml): resume with the objective they were trained with "
        f"(its grpo: section), or start a new train.output_dir")
    assert {p.relative_to(grpo_run): p.read_bytes() for p in grpo_run.rglob("*") if p.is_file()} == saved
