"""Orbax checkpoints of a run, and loading a model from any checkpoint directory.

A run directory:

    <output_dir>/config.yaml          the resolved run config (model:, train:, data:)
    <output_dir>/tokenizer.json       the tokenizer (the char vocabulary, a trained BPE, ...)
    <output_dir>/checkpoints/<step>/  params/  (the model's parameters, a pure dict)
                                      state/   (opt_state, step, rng, nonfinite)
                                      meta/    (JSON: step, data-iterator state)

Orbax writes each step into a temporary directory and renames it when complete, so a
process killed while saving leaves no step that looks complete; the manager ignores (and
on restart removes) the partial one, and resuming takes the newest complete step.

`load_params(dir)` reads a model from a run directory (its newest step), from one step
directory, or from a converted Hugging Face checkpoint (`params/` with `config.yaml`
beside it): every layout keeps the parameters under `params/`.
"""

from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp
import yaml

from modern_jax.config import ModelConfig

CONFIG_FILE = "config.yaml"
CHECKPOINTS = "checkpoints"


class Checkpointer:
    """Async save every N steps, keep the last K, restore the newest complete step."""

    def __init__(self, directory, keep: int = 3, async_save: bool = True):
        self.directory = pathlib.Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True,
                                                 enable_async_checkpointing=async_save),
            item_names=("params", "state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: dict, meta: dict) -> None:
        step = int(meta["step"])
        rest = {k: v for k, v in state.items() if k != "params"}
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state["params"]),
            state=ocp.args.StandardSave(rest),
            meta=ocp.args.JsonSave(meta),
        ), force=True)

    def restore(self, abstract_state: dict, step: int | None = None) -> tuple[dict, dict]:
        step = self.latest_step() if step is None else step
        rest = {k: v for k, v in abstract_state.items() if k != "params"}
        out = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_state["params"]),
            state=ocp.args.StandardRestore(rest),
            meta=ocp.args.JsonRestore(),
        ))
        return {"params": out["params"], **out["state"]}, dict(out["meta"])

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def resolve_checkpoint(path) -> tuple[pathlib.Path, pathlib.Path]:
    """`(params directory, config.yaml)` for a run directory, a step directory, or a converted
    checkpoint (`params/` and `config.yaml` side by side)."""
    path = pathlib.Path(path).absolute()
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is not a directory")
    if (path / CHECKPOINTS).is_dir():  # a run directory: its newest complete step
        steps = [int(p.name) for p in (path / CHECKPOINTS).iterdir() if p.name.isdigit() and (p / "params").is_dir()]
        if not steps:
            raise ValueError(f"run directory {str(path)!r} holds no complete checkpoint")
        return path / CHECKPOINTS / str(max(steps)) / "params", path / CONFIG_FILE
    if (path / "params").is_dir():
        for config in (path / CONFIG_FILE, path.parent.parent / CONFIG_FILE):
            if config.is_file():
                return path / "params", config
        raise ValueError(f"no {CONFIG_FILE} beside {str(path)!r} (nor in its run directory)")
    raise ValueError(f"{str(path)!r} is not a checkpoint: expected params/ (and config.yaml), or a run directory")


def read_config(config_path) -> dict:
    raw = yaml.safe_load(pathlib.Path(config_path).read_text()) or {}
    return raw if "model" in raw else {"model": raw}  # a bare model config is allowed


def load_params(path, dtype: str | None = None):
    """`(ModelConfig, params pure dict, raw config dict, run directory)` from a checkpoint directory."""
    from modern_jax.training.step import abstract_model
    from flax import nnx

    params_dir, config_path = resolve_checkpoint(path)
    raw = read_config(config_path)
    cfg = ModelConfig.from_dict(raw["model"])
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    _, abstract = abstract_model(cfg)
    target = nnx.to_pure_dict(abstract)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), target)
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(params_dir, target)
    return cfg, params, raw, config_path.parent
