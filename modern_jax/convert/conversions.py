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

`finetune_run(run, source)` makes a fine-tuning run (`modern-jax train --init-from-hf`): the
model and tokenizer of `source` (a Hugging Face model directory or hub name, a converted
checkpoint, or a training run), the `train:`, `data:`, `execution:` and `parallel:` of the run file, whose `model:`
section may set only fields that are not the network itself (dtypes, dropout, ...). A source
without a tokenizer needs `data.tokenizer_path` (the model's ids mean nothing to another
tokenizer), and initial weights holding NaN or infinite values are refused, by name. A run
trained from a Hugging Face source keeps its config.json and tokenizer files in `hf/`, so
`convert_to_hf(run_dir)` writes the same family with the same tokenizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from flax.nnx import traversals

from modern_jax import paths
from modern_jax.config import NETWORK_FIELDS, ModelConfig
from modern_jax.configfile import read_json
from modern_jax.convert.hf_checkpoint import (checkpoint_files, from_hf, nonfinite, read_hf_config, refuse_nonfinite,
                                             resolve_hf, to_hf)
from modern_jax.convert.hf_config import config_from_hf, model_type_of
from modern_jax.data.tokenizers import TOKENIZER_FILE, Tokenizer, load_tokenizer
from modern_jax.lora_config import LoRAConfig
from modern_jax.model import Transformer, abstract_params
from modern_jax.training import outputs
from modern_jax.training.checkpoint import (BASE_FILE, HF_ASSETS_DIR, check_base, file_checksums, load_params,
                                           read_config, resolve_checkpoint, save_checkpoint, write_checksums)
from modern_jax.training.config import RunConfig
from modern_jax.training.converters import LoRA, abstract_converted, saved_converter, with_adapter_config
from modern_jax.training.loop import Initial

CONFIG, PARAMS, HF = "config.yaml", "params", HF_ASSETS_DIR
# files of a Hugging Face model directory that are not weights, kept for the way back
HF_ASSETS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
             "chat_template.jinja", "chat_template.json")
CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")  # kept in config.json, not in ModelConfig


def launch_mesh() -> jax.sharding.Mesh | None:
    """Of a launch of several processes, every device on `fsdp`: each process reads, holds and writes
    its share of the model, none the whole; one process keeps the model on its first device."""
    return jax.make_mesh((jax.device_count(),), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,)) \
        if jax.process_count() > 1 else None


def load_checkpoint(ckpt: str | os.PathLike, log=None, **overrides: Any) -> tuple[ModelConfig, Transformer]:
    """`(config, model)` from a converted checkpoint, a training run directory (its newest
    step) or one step directory; parameters come back in their saved dtype."""
    cfg, params, raw, _ = load_model_params(ckpt, log=log, **overrides)
    return cfg, _model(cfg, params, saved_converter(raw))


def _model(cfg: ModelConfig, params: dict, converter) -> Transformer:
    """The model of `params`, converted as its run trained it (a LoRA run's: with its adapters)."""
    return nnx.merge(abstract_converted(cfg, converter)[0], params)


def _plain(ckpt, log=None, mesh=None, **overrides: Any) -> tuple[ModelConfig, Transformer]:
    """`load_checkpoint`, as a plain model of its config: a LoRA run's adapters merged into its base."""
    cfg, params, raw, _ = load_model_params(ckpt, log=log, mesh=mesh, **overrides)
    converter = saved_converter(raw)
    return cfg, converter.merged(_model(cfg, params, converter))


def load_model_params(ckpt: str | os.PathLike, log=None, mesh=None, **overrides: Any):
    """`load_params`, with the frozen base of a LoRA run whose checkpoints hold only its adapters
    (`lora.save_base: false`) read again from where it started (its `base.json`) and quantized
    as the run does: `(config, every parameter, raw config, run directory)`; `mesh`: as `load_params`."""
    cfg, params, raw, home = load_params(ckpt, log=log, mesh=mesh, **overrides)
    lora = LoRAConfig.of_run(raw)
    if lora is None or lora.save_base:
        return cfg, params, raw, home
    base_file = Path(home) / BASE_FILE
    if not base_file.is_file():
        raise ValueError(f"{home}: its checkpoints hold only the adapters (lora.save_base=false) and {BASE_FILE}, "
                         f"which names the base they were trained on, is missing: put it back "
                         f'({{"source": "path/to/hf_model"}})')
    source = read_json(base_file).get("source")
    settings = {k: v for k, v in cfg.to_dict().items() if k not in NETWORK_FIELDS}
    base_cfg, init = initial_weights(source, log=log, **settings)
    if base_cfg.replace(**settings) != cfg:
        raise ValueError(f"{base_file}: the base {source} is not the model this run trained ({home / 'config.yaml'}): "
                         f"point {BASE_FILE} at the model the run started from")
    check_base(home, source, init.checksums(), fix=f"put the model the run started from back there, or point "
                                                  f"{base_file}'s source at it")
    model = nnx.merge(abstract_params(cfg)[0], init.params())
    LoRA(lora).convert(model, nnx.Rngs(0))  # the frozen base as the run holds it (quantized), adapters replaced below
    full = traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    full.update(traversals.flatten_mapping(params))
    return cfg, traversals.unflatten_mapping(full), raw, home


def convert_from_hf(src: str | os.PathLike, out: str | os.PathLike, dtype: str = "float32",
                    overwrite: bool = False, log=None) -> Path:
    """Hugging Face model directory `src` -> our checkpoint `out` (config.yaml + params/ + hf/);
    `log` is told of skipped tensors (`from_hf`)."""
    outputs.claim(out, outputs.CHECKPOINT, "output directory", overwrite=overwrite, dry_run=True)  # before reading
    src = resolve_hf(src)
    _, model = from_hf(src, dtype=dtype, mesh=launch_mesh(), log=log)
    out = save_checkpoint(model, out, overwrite=overwrite)
    if jax.process_index() == 0:  # of several processes, process 0 writes what is not a share of the model
        (out / HF).mkdir(exist_ok=True)
        for name in HF_ASSETS:
            if (src / name).is_file():
                paths.copy(src / name, out / HF / name)  # the local disk or object storage
        write_checksums(out)
    return out


def _hf_source(ckpt) -> tuple[Path, dict | None]:
    """The directory of `ckpt`'s config.yaml (a run's, for one of its steps) and the Hugging Face
    config.json kept in its hf/ (the model it was converted or fine-tuned from), if any."""
    _, config_path, _, _ = resolve_checkpoint(ckpt)
    home = config_path.parent
    return home, read_hf_config(home / HF) if (home / HF / "config.json").is_file() else None


def convert_to_hf(ckpt: str | os.PathLike, out: str | os.PathLike, model_type: str | None = None,
                  dtype: str | None = None, overwrite: bool = False, log=None) -> list[str]:
    """Our checkpoint `ckpt` (converted, or a training run) -> a Hugging Face model directory `out`.

    `model_type` defaults to the family the checkpoint was converted from (hf/config.json);
    a model trained here needs it named. Token ids and tokenizer files come along when known.
    """
    outputs.claim(out, outputs.HF, "output directory", overwrite=overwrite, dry_run=True)  # before reading
    home, source = _hf_source(ckpt)
    if model_type is None:
        if source is None:
            raise ValueError(f"{ckpt} was not converted from Hugging Face: name the model_type to write")
        model_type = model_type_of(source)
        model_type = "gemma3_text" if model_type == "gemma3" else model_type
    extra = {}
    if source is not None:
        text = source.get("text_config") or {}
        extra = {k: source.get(k, text.get(k)) for k in CARRIED_KEYS if k in source or k in text}
    _, model = _plain(ckpt, log=log, mesh=launch_mesh())  # a LoRA run: its adapters added into the base
    files = to_hf(model, out, model_type=model_type, dtype=dtype, extra_config=extra, overwrite=overwrite)
    for name in HF_ASSETS if jax.process_index() == 0 else ():  # of several processes, process 0 copies them
        if name != "config.json" and (home / HF / name).is_file():
            shutil.copy2(home / HF / name, Path(out) / name)
            files.append(name)
    return files


def convert_to_peft(ckpt: str | os.PathLike, out: str | os.PathLike, model_type: str | None = None,
                    overwrite: bool = False, log=None) -> list[str]:
    """A LoRA run's adapters (its newest step, or a step directory) -> a PEFT adapter directory `out`,
    which `PeftModel.from_pretrained(base, out)` loads onto the Hugging Face base."""
    from modern_jax.convert.peft import write_peft
    from modern_jax.training import outputs

    outputs.claim(out, outputs.PEFT, "output directory", overwrite=overwrite, dry_run=True)  # before reading
    _, source = _hf_source(ckpt)
    if model_type is None:
        if source is None:
            raise ValueError(f"{ckpt} was not started from a Hugging Face model: name the base's family with "
                             f"--model-type")
        model_type = model_type_of(source)
    cfg, params, raw, _ = load_model_params(ckpt, log=log, mesh=launch_mesh())
    lora = LoRAConfig.of_run(raw)
    if lora is None:
        raise ValueError(f"{ckpt} is not a LoRA run (its config.yaml has no lora: section): convert --to-hf "
                         f"writes the whole model")
    model = _model(cfg, params, LoRA(lora))
    main = jax.process_index() == 0  # of a launch of several processes, process 0 writes the adapters
    if main:
        outputs.claim(out, outputs.PEFT, "output directory", overwrite=overwrite)
    with outputs.RunLock(Path(out), "output directory", command="convert --to-peft").acquire() if main else \
            contextlib.nullcontext():
        files = write_peft(model, lora, out, model_type, base=(source or {}).get("_name_or_path", ""))
        if main:
            outputs.mark(out, outputs.PEFT, f"modern-jax convert --to-peft (model_type {model_type})")
    return files


# ----- fine-tuning ---------------------------------------------------------------------


def checkpoint_tokenizer(directory) -> Tokenizer | None:
    """The tokenizer of a run or a converted checkpoint directory: its `tokenizer.json`, else the
    Hugging Face one in `hf/` (with its chat template); None if it has neither."""
    directory = paths.as_path(directory)
    for path in (directory / TOKENIZER_FILE, directory / HF / TOKENIZER_FILE):
        if path.is_file():
            return load_tokenizer(path)
    return None


def initial_weights(source: str | os.PathLike, log=None, **overrides: Any) -> tuple[ModelConfig, Initial]:
    """`(config, Initial)` of `source`: a Hugging Face model directory or hub name, a converted
    checkpoint, or a training run (its newest step); `overrides` set fields that do not change
    the network. The parameters are read only when `Initial.params()` is called."""
    path = paths.as_path(source)
    if path.is_dir() and ((path / PARAMS).is_dir() or (path / "checkpoints").is_dir()):  # one of ours
        directory, config_path, what, _ = resolve_checkpoint(path)
        cfg = ModelConfig.from_dict({**read_config(config_path)["model"], **overrides})
        home = config_path.parent
        tokenizer = checkpoint_tokenizer(home)
        assets = tuple(home / HF / name for name in HF_ASSETS if (home / HF / name).is_file())

        def ours(shardings=None) -> dict:  # a LoRA run's: its adapters merged into its base
            _, model = _plain(path, log=log, **overrides)
            params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            flat = jax.tree_util.tree_flatten_with_path(params)[0]
            counts = ((".".join(str(getattr(k, "key", k)) for k in key), nonfinite(x)) for key, x in flat)
            refuse_nonfinite(str(directory / PARAMS), [f"{name} ({count})" for name, count in counts
                                                       if count is not None])
            return params

        weights = sorted(p for p in (directory / PARAMS).rglob("*") if p.is_file())
        return cfg, Initial(what, ours, tokenizer, assets, path=str(path.absolute()),
                            checksums=lambda: file_checksums(directory, weights))
    path = resolve_hf(source)
    hf = read_hf_config(path)
    try:
        cfg = config_from_hf(hf, **overrides)
    except ValueError as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from None
    tokenizer = load_tokenizer(path / TOKENIZER_FILE) if (path / TOKENIZER_FILE).is_file() else None
    rest = {k: v for k, v in overrides.items() if k not in ("dtype", "param_dtype")}

    def params(shardings=None) -> dict:  # placed as `shardings` (of the run) as they are read
        _, model = from_hf(path, dtype=cfg.dtype, param_dtype=cfg.param_dtype, shardings=shardings, log=log, **rest)
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    assets = tuple(path / name for name in HF_ASSETS if (path / name).is_file())
    return cfg, Initial(f"the Hugging Face model {source}", params, tokenizer, assets, path=str(path.absolute()),
                        checksums=lambda: file_checksums(path, checkpoint_files(path)))


def finetune_run(run: RunConfig, source: str | os.PathLike, log=None, adapter: str | os.PathLike | None = None
                 ) -> tuple[RunConfig, Initial]:
    """`run` with the model of `source` (see `initial_weights`), and the `Initial` that
    `train(run, init=...)` starts from. The run's `model:` section may set only the fields that
    do not change the network. `adapter`: a PEFT LoRA adapter of that model to start from (its
    rank, alpha and projections become the run's `lora:`)."""
    fixed = [k for k in run.model_dict if k in NETWORK_FIELDS]
    if fixed:
        allowed = ", ".join(f for f in ModelConfig.__dataclass_fields__ if f not in NETWORK_FIELDS)
        raise ValueError(f"the model comes from --init-from-hf {source}, so the run's model: section may set only "
                         f"fields that leave its network as it is ({allowed}; how it runs is the execution: "
                         f"section), not {', '.join(fixed)}: remove them, or use configs/finetune_chat.yaml")
    cfg, init = initial_weights(source, log=log, **run.model_dict)
    if init.tokenizer is not None and run.data.tokenizer_path:
        raise ValueError(f"--init-from-hf {source} brings the model's own tokenizer, so data.tokenizer_path="
                         f"{run.data.tokenizer_path!r} would not be used: remove it")
    if init.tokenizer is None:
        if not run.data.tokenizer_path:
            raise ValueError(f"--init-from-hf {source} has no {TOKENIZER_FILE}, and the model's token ids mean "
                             f"nothing to another tokenizer: put the model's tokenizer files ({TOKENIZER_FILE}, "
                             f"tokenizer_config.json) beside its weights, or set data.tokenizer_path=FILE (the "
                             f"model's {TOKENIZER_FILE})")
        tokenizer = load_tokenizer(run.data.tokenizer_path)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"data.tokenizer_path={run.data.tokenizer_path!r} has {tokenizer.vocab_size} ids, more "
                             f"than the vocab_size={cfg.vocab_size} of the model from --init-from-hf {source}: give "
                             f"the tokenizer the model was trained with")
        init = dataclasses.replace(init, tokenizer=tokenizer)
    run = dataclasses.replace(run, model_dict=cfg.to_dict())
    if adapter is not None:
        run, init = _with_adapter(run, init, source, adapter)
    return run, init


def _with_adapter(run: RunConfig, init: Initial, source, adapter) -> tuple[RunConfig, Initial]:
    """The run set to the PEFT adapter's rank, alpha and projections, starting from its weights."""
    from modern_jax.convert.peft import peft_targets, read_peft, read_peft_config
    from modern_jax.model import abstract_model

    path = Path(source)
    hf_config = (path / "config.json") if (path / "config.json").is_file() else path / HF / "config.json"
    if not hf_config.is_file():
        raise ValueError(f"--init-adapter {adapter}: the base {source} has no Hugging Face config.json, so the "
                         f"adapter's module names cannot be mapped: start from the Hugging Face model")
    model_type = model_type_of(read_json(hf_config))
    cfg = run.model
    found = read_peft_config(adapter)
    targets = peft_targets(adapter, abstract_model(cfg), model_type)
    lora = with_adapter_config(run, dataclasses.replace(found, targets=targets), adapter)
    model = nnx.merge(*abstract_converted(cfg, LoRA(lora)))
    adapters = functools.partial(read_peft, adapter, model, model_type)
    return dataclasses.replace(run, lora=lora), dataclasses.replace(
        init, source=f"{init.source} with the PEFT adapter {adapter}", adapters=adapters)
