"""Our checkpoint layout, and the conversions behind `modern-jax convert`.

A converted checkpoint directory holds:

    config.yaml      the ModelConfig (`yaml.safe_dump(cfg.to_dict())`)
    params/          nnx.state(model, nnx.Param) as a pure dict, saved by Orbax's StandardCheckpointer
    hf/              when converted from Hugging Face: its config.json and tokenizer files,
                     so that converting back writes the same family, token ids and tokenizer

the layout `modern_jax.training.checkpoint.load_params` reads, so the trainer can
fine-tune from it; `load_checkpoint` returns the model itself.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
import yaml
from flax import nnx

from modern_jax.config import ModelConfig
from modern_jax.convert.hf_checkpoint import from_hf, read_config, to_hf
from modern_jax.convert.hf_config import model_type_of
from modern_jax.model import Transformer

CONFIG, PARAMS, HF = "config.yaml", "params", "hf"
# files of a Hugging Face model directory that are not weights, kept for the way back
HF_ASSETS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
             "chat_template.jinja", "chat_template.json")
CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")  # kept in config.json, not in ModelConfig


def save_checkpoint(model: Transformer, out: str | os.PathLike) -> Path:
    """Save `model` as config.yaml + params/ (Orbax, the parameters as a pure dict) under `out`."""
    out = Path(out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(yaml.safe_dump(model.cfg.to_dict(), sort_keys=False))
    if (out / PARAMS).exists():
        shutil.rmtree(out / PARAMS)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(out / PARAMS, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        checkpointer.wait_until_finished()
    return out


def load_checkpoint(ckpt: str | os.PathLike, **overrides: Any) -> tuple[ModelConfig, Transformer]:
    """`(config, model)` from a converted checkpoint, a training run directory (its newest
    step) or one step directory; parameters come back in their saved dtype."""
    from modern_jax.training.checkpoint import read_config, resolve_checkpoint

    params_dir, config_path = resolve_checkpoint(ckpt)
    cfg = ModelConfig.from_dict({**read_config(config_path)["model"], **overrides})
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), nnx.to_pure_dict(params))
    with ocp.StandardCheckpointer() as checkpointer:
        nnx.replace_by_pure_dict(params, checkpointer.restore(params_dir, target))
    return cfg, nnx.merge(graphdef, params, rest)


def convert_from_hf(src: str | os.PathLike, out: str | os.PathLike, dtype: str = "float32") -> Path:
    """Hugging Face model directory `src` -> our checkpoint `out` (config.yaml + params/ + hf/)."""
    src = Path(src)
    _, model = from_hf(src, dtype=dtype)
    out = save_checkpoint(model, out)
    (out / HF).mkdir(exist_ok=True)
    for name in HF_ASSETS:
        if (src / name).is_file():
            shutil.copy2(src / name, out / HF / name)
    return out


def convert_to_hf(ckpt: str | os.PathLike, out: str | os.PathLike, model_type: str | None = None,
                  dtype: str | None = None) -> list[str]:
    """Our checkpoint `ckpt` (converted, or a training run) -> a Hugging Face model directory `out`.

    `model_type` defaults to the family the checkpoint was converted from (hf/config.json);
    a model trained here needs it named. Token ids and tokenizer files come along when known.
    """
    ckpt = Path(ckpt)
    source = read_config(ckpt / HF) if (ckpt / HF / "config.json").is_file() else None
    if model_type is None:
        if source is None:
            raise ValueError(f"{ckpt} was not converted from Hugging Face: name the model_type to write")
        model_type = model_type_of(source)
        model_type = "gemma3_text" if model_type == "gemma3" else model_type
    extra = {}
    if source is not None:
        text = source.get("text_config") or {}
        extra = {k: source.get(k, text.get(k)) for k in CARRIED_KEYS if k in source or k in text}
    _, model = load_checkpoint(ckpt)
    files = to_hf(model, out, model_type=model_type, dtype=dtype, extra_config=extra)
    for name in HF_ASSETS:
        if name != "config.json" and (ckpt / HF / name).is_file():
            shutil.copy2(ckpt / HF / name, Path(out) / name)
            files.append(name)
    return files
