"""Live parity with transformers (PyTorch, CPU): fresh tiny checkpoints, every family.

Runs when torch and transformers import here, or when MODERN_JAX_HF_PYTHON names an
interpreter that has them (e.g. `MODERN_JAX_HF_PYTHON=.hfvenv/bin/python`, see CONVERT.md);
skipped otherwise (the golden-fixture tests in test_convert_hf.py always run). The torch
side runs through scripts/make_hf_fixtures.py in that interpreter:
1. transformers makes and saves each tiny model with its logits and greedy tokens;
2. from_hf loads it: fp32 logits within 1e-4, the same 32 greedy tokens with the KV cache,
   chosen from logits within 1e-4;
3. to_hf writes it back; transformers loads that and gives identical logits and tokens.
And the tiny chat fixture (tests/fixtures/hf_chat), fine-tuned a few steps on its
conversations and exported: transformers renders and tokenizes the conversations with the
exported tokenizer as we do, and gives the fine-tuned model's logits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from modern_jax.cli import main
from modern_jax.convert import from_hf, load_checkpoint, to_hf
from modern_jax.convert.conversions import checkpoint_tokenizer
from modern_jax.data import chat
from test_convert_hf import LOGIT_TOL, _forward, greedy

SCRIPT = Path(__file__).parent.parent / "scripts" / "make_hf_fixtures.py"
CHAT_FIXTURE = Path(__file__).parent / "fixtures" / "hf_chat"


def hf_python() -> str | None:
    if all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "safetensors")):
        return sys.executable
    return os.environ.get("MODERN_JAX_HF_PYTHON")


pytestmark = pytest.mark.skipif(hf_python() is None, reason="needs torch + transformers (or MODERN_JAX_HF_PYTHON)")


def run_script(*args: str) -> None:
    done = subprocess.run([hf_python(), str(SCRIPT), *args], capture_output=True, text=True)
    assert done.returncode == 0, f"{SCRIPT.name} {' '.join(args[:2])} failed:\n{done.stderr[-4000:]}"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    run_script("checkpoints", "--out", str(out))
    return out


def test_live_parity_and_round_trip(fresh, tmp_path):
    manifest = json.loads((fresh / "manifest.json").read_text())
    names = sorted(manifest["checkpoints"])
    report, written = {}, []
    for name in names:
        with np.load(fresh / name / "reference.npz") as z:
            ref = dict(z)
        _, model = from_hf(fresh / name)
        logits = np.asarray(_forward(model, jnp.asarray(ref["tokens"])))
        report[name] = float(np.max(np.abs(logits - ref["logits"])))
        tokens, step_logits = greedy(model, ref["tokens"], ref["greedy"].shape[1])
        np.testing.assert_array_equal(tokens, ref["greedy"], err_msg=name)
        report[name] = max(report[name], float(np.max(np.abs(step_logits - ref["step_logits"]))))
        model_type = json.loads((fresh / name / "config.json").read_text())["model_type"]
        dtype = manifest["checkpoints"][name]["dtype"]
        to_hf(model, tmp_path / name, model_type=model_type, dtype=dtype)
        np.save(tmp_path / name / "tokens.npy", ref["tokens"])
        written.append(name)
    print("max|logit diff| vs transformers:", json.dumps(report, indent=1))
    assert max(report.values()) <= LOGIT_TOL, report

    run_script("reference", *(str(tmp_path / name) for name in written))
    for name in written:  # transformers on what to_hf wrote: the original model, exactly
        with np.load(fresh / name / "reference.npz") as z, np.load(tmp_path / name / "transformers.npz") as back:
            np.testing.assert_array_equal(back["logits"], z["logits"], err_msg=name)
            np.testing.assert_array_equal(back["greedy"], z["greedy"], err_msg=name)
            np.testing.assert_array_equal(back["step_logits"], z["step_logits"], err_msg=name)


def test_a_fine_tuned_chat_model_loads_in_transformers_with_its_new_weights(tmp_path):
    run, export = tmp_path / "run", tmp_path / "hf"
    assert main(["train", "--init-from-hf", str(CHAT_FIXTURE), "--data", str(CHAT_FIXTURE / "chat.jsonl"),
                 "--output-dir", str(run), "train.steps=20", "train.seq_len=64", "train.lr=3e-3",
                 "train.warmup_steps=2"]) == 0
    assert main(["convert", "--to-hf", str(run), "--out", str(export)]) == 0
    lines = (CHAT_FIXTURE / "chat.jsonl").read_text().splitlines()
    conversations = [json.loads(line)["messages"] for line in lines[:4]]
    tokenizer = checkpoint_tokenizer(run)  # the run's, with the fixture's chat template
    rendered = [chat.render(c, tokenizer.chat_template, tokenizer.special_tokens, "test")[0] for c in conversations]
    ids = np.stack([tokenizer.encode(text) for text in rendered])  # the sums all take as many words
    np.save(export / "tokens.npy", ids)
    (export / "conversations.json").write_text(json.dumps(conversations))
    run_script("reference", str(export))
    run_script("chat-reference", str(export))

    theirs = json.loads((export / "transformers_chat.json").read_text())
    assert theirs["texts"] == rendered and theirs["ids"] == ids.tolist()
    _, trained = load_checkpoint(run)
    _, original = from_hf(CHAT_FIXTURE)
    ours = np.asarray(_forward(trained, jnp.asarray(ids)))
    before = np.asarray(_forward(original, jnp.asarray(ids)))
    with np.load(export / "transformers.npz") as back:
        print("max|logit diff| fine-tuned vs transformers:", float(np.max(np.abs(back["logits"] - ours))))
        np.testing.assert_allclose(back["logits"], ours, atol=LOGIT_TOL, rtol=0)
        assert np.max(np.abs(back["logits"] - before)) > 0.1  # the new weights, not the fixture's


def test_a_lora_run_exported_to_peft_loads_in_peft_with_our_logits(tmp_path):
    """A LoRA run trained here (B moved from zero), `convert --to-peft`: PeftModel.from_pretrained
    on the transformers base gives the run's logits within 1e-4 of their scale."""
    run, adapter = tmp_path / "run", tmp_path / "adapter"
    assert main(["train", "--config", str(Path(__file__).parent.parent / "configs" / "finetune_lora.yaml"),
                 "--init-from-hf", str(CHAT_FIXTURE),
                 "--data", str(CHAT_FIXTURE / "chat.jsonl"), "--output-dir", str(run), "train.steps=20",
                 "train.seq_len=64", "train.lr=1e-2", "train.warmup_steps=2"]) == 0
    assert main(["convert", "--to-peft", str(run), "--out", str(adapter)]) == 0
    tokens = np.random.default_rng(0).integers(4, 33, (2, 16)).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    run_script("peft-logits", "--base", str(CHAT_FIXTURE), "--adapter", str(adapter), "--tokens",
               str(tmp_path / "tokens.npy"), "--out", str(tmp_path / "peft.npz"))
    _, trained = load_checkpoint(run)
    _, original = from_hf(CHAT_FIXTURE)
    ours = np.asarray(trained(jnp.asarray(tokens)))
    with np.load(tmp_path / "peft.npz") as z:
        theirs = z["logits"]
    scale = float(np.max(np.abs(ours)))
    print("max|logit diff| LoRA run vs PEFT:", float(np.max(np.abs(theirs - ours))), "scale", scale)
    np.testing.assert_allclose(theirs, ours[..., :theirs.shape[-1]], atol=1e-4 * scale, rtol=0)
    assert np.max(np.abs(ours - np.asarray(original(jnp.asarray(tokens))))) > 1e-2  # the adapters act
