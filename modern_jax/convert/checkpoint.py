"""Our checkpoint layout, and the conversions behind `modern-jax convert`.

A converted checkpoint directory holds:

    config.yaml      the ModelConfig (`yaml.safe_dump(cfg.to_dict())`)
    params/          nnx.state(model, nnx.Param) as a pure dict, saved by Orbax's StandardCheckpointer
    hf/              when converted from Hugging Face: its config.json and tokenizer files,
                     so that converting back writes the same family, token ids and tokenizer

    checksums.json   size and CRC-32 of every file, checked before loading

the layout `modern_jax.training.checkpoint.load_params` reads, so the trainer can
fine-tune from it; `load_checkpoint` returns the model itself. Writers refuse a directory
that holds anything else (`modern_jax.training.outputs`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
import yaml
from flax import nnx

from modern_jax.config import ModelConfig
from modern_jax.convert.hf_checkpoint import from_hf, read_hf_config, to_hf
from modern_jax.convert.hf_config import model_type_of
from modern_jax.model import Transformer
from modern_jax.training import outputs
from modern_jax.training.checkpoint import load_params, write_checksums
from modern_jax.training.step import abstract_model

CONFIG, PARAMS, HF = "config.yaml", "params", "hf"
# files of a Hugging Face model directory that are not weights, kept for the way back
HF_ASSETS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
             "chat_template.jinja", "chat_template.json")
CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")  # kept in config.json, not in ModelConfig


def save_checkpoint(model: Transformer, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Save `model` as config.yaml + params/ (Orbax, the parameters as a pure dict) under `out`:
    a new or empty directory, or with `overwrite` a converted checkpoint (replaced)."""
    out = Path(out).absolute()
    outputs.claim(out, outputs.CHECKPOINT, "output directory", overwrite=overwrite)
    out.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(out / PARAMS, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        checkpointer.wait_until_finished()
    (out / CONFIG).write_text(yaml.safe_dump(model.cfg.to_dict(), sort_keys=False))
    write_checksums(out)
    return out


def load_checkpoint(ckpt: str | os.PathLike, log=None, **overrides: Any) -> tuple[ModelConfig, Transformer]:
    """`(config, model)` from a converted checkpoint, a training run directory (its newest
    step) or one step directory; parameters come back in their saved dtype."""
    cfg, params, _, _ = load_params(ckpt, log=log, **overrides)
    graphdef, _ = abstract_model(cfg)
    return cfg, nnx.merge(graphdef, params)


def convert_from_hf(src: str | os.PathLike, out: str | os.PathLike, dtype: str = "float32",
                    overwrite: bool = False, log=None) -> Path:
    """Hugging Face model directory `src` -> our checkpoint `out` (config.yaml + params/ + hf/);
    `log` is told of skipped tensors (`from_hf`)."""
    src = Path(src)
    outputs.claim(out, outputs.CHECKPOINT, "output directory", overwrite=overwrite, dry_run=True)  # before reading
    _, model = from_hf(src, dtype=dtype, log=log)
    out = save_checkpoint(model, out, overwrite=overwrite)
    (out / HF).mkdir(exist_ok=True)
    for name in HF_ASSETS:
        if (src / name).is_file():
            shutil.copy2(src / name, out / HF / name)
    write_checksums(out)
    return out


def convert_to_hf(ckpt: str | os.PathLike, out: str | os.PathLike, model_type: str | None = None,
                  dtype: str | None = None, overwrite: bool = False, log=None) -> list[str]:
    """Our checkpoint `ckpt` (converted, or a training run) -> a Hugging Face model directory `out`.

    `model_type` defaults to the family the checkpoint was converted from (hf/config.json);
    a model trained here needs it named. Token ids and tokenizer files come along when known.
    """
    ckpt = Path(ckpt)
    outputs.claim(out, outputs.HF, "output directory", overwrite=overwrite, dry_run=True)  # before reading
    source = read_hf_config(ckpt / HF) if (ckpt / HF / "config.json").is_file() else None
    if model_type is None:
        if source is None:
            raise ValueError(f"{ckpt} was not converted from Hugging Face: name the model_type to write")
        model_type = model_type_of(source)
        model_type = "gemma3_text" if model_type == "gemma3" else model_type
    extra = {}
    if source is not None:
        text = source.get("text_config") or {}
        extra = {k: source.get(k, text.get(k)) for k in CARRIED_KEYS if k in source or k in text}
    _, model = load_checkpoint(ckpt, log=log)
    files = to_hf(model, out, model_type=model_type, dtype=dtype, extra_config=extra, overwrite=overwrite)
    for name in HF_ASSETS:
        if name != "config.json" and (ckpt / HF / name).is_file():
            shutil.copy2(ckpt / HF / name, Path(out) / name)
            files.append(name)
    return files
