"""Hugging Face safetensors checkpoints <-> the model, one tensor at a time.

    cfg, model = from_hf("path/to/hf_dir", dtype="bfloat16")     # or a hub name, "org/name"
    to_hf(model, "path/to/out_dir", model_type="llama")

A name that is not a directory is a Hugging Face hub repository (`org/name`), found in the
local Hugging Face cache by `huggingface_hub` (no network needed once it is there); one not
in the cache is downloaded where the network allows, else the error says how to get it.

Loading builds the model abstractly (no random initialisation), checks the checkpoint
against it before reading any data (every expected tensor present, no tensor left over but
those the family says its network does not use, such as DeepSeek's multi-token-prediction
layer, which are skipped and logged; every shape right; errors name the tensors and both
shapes; a quantised tensor without its scales is refused, naming both), then streams the
tensors from the (possibly sharded) safetensors files into one preallocated array per stacked
parameter (a tensor holding NaN or infinite values is refused, naming it and its file). The
tensors of a quantised checkpoint (block-fp8, mxfp4: `hf_quantised`) are dequantised as they
arrive, each with its scales, which are not parameters of their own. A
parameter is handed to JAX as soon as its last layer is filled, so the host holds about one
copy of the model, never two. Writing fetches one slot (a layer, an expert) of a parameter
at a time from the devices and holds at most one safetensors shard, so the host never holds
a whole stacked parameter.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from modern_jax.config import ModelConfig
from modern_jax.configfile import read_json
from modern_jax.convert.hf_config import config_from_hf, config_to_hf, family_of
from modern_jax.convert.hf_families import FAMILIES, Family
from modern_jax.convert.hf_keys import Reader
from modern_jax.convert.hf_quantised import RAW_DTYPES, Quantisation, quantisation_of, read_raw
from modern_jax.convert.hf_weights import Rule
from modern_jax.model import Transformer, abstract_model

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_SHARD_BYTES = 5 * 2**30
LISTED = 8  # names shown per kind of error
logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model its config describes."""


@dataclass
class Target:
    """One of our parameters (a stacked one: all its layers), filled slice by slice."""

    path: tuple
    variable: Any  # the nnx.Param in the model's state
    rule: Rule  # how Hugging Face tensors hold it
    layers: tuple[int, ...] | None  # stacked: the layer of each index along its first axis; None: not per layer
    buffer: np.ndarray | None = None
    filled: set = field(default_factory=set)
    sharding: Any = None  # where the finished parameter goes (None: the default device)

    @property
    def name(self) -> str:
        return ".".join(map(str, self.path))


@dataclass(frozen=True)
class Stored:
    """Where a Hugging Face tensor the model reads is: its file, name and dtype (as safetensors names it),
    and for a quantised one the file and name of its scales."""

    file: Path
    name: str
    dtype: str
    scales: tuple[Path, str] | None = None


@dataclass(frozen=True)
class Source:
    """One Hugging Face tensor's share of one of our parameters."""

    target: Target
    slot: tuple[int, ...]  # the index of the slice it fills: (layer slot, expert, ...); (): the whole parameter

    @property
    def rule(self) -> Rule:
        return self.target.rule

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the slice it fills."""
        return tuple(self.target.variable.shape)[len(self.slot):]


def targets(model: Transformer, state, family: Family) -> list[Target]:
    """Each parameter in `state` with its rule in the family's table (and, stacked, the layer of each slot)."""
    table, out = family.weights, []
    for path, variable in nnx.to_flat_state(state):
        if path[0] == "stages":
            _, s, _, j, *rest = path
            layers = model.stages[s].layer_numbers(j)
            rules, key = table.layer, ".".join(rest)
        elif path[0] == "mtp":  # the MTP modules, stacked: layers n .. n + D - 1, the block's under its layer names
            layers = mtp_layer_numbers(model.cfg)
            rules, key = (table.layer, ".".join(map(str, path[2:]))) if path[1] == "block" else (
                table.mtp, ".".join(map(str, path[1:])))
        else:
            layers, rules, key = None, table.top, ".".join(map(str, path))
        if key not in rules:
            raise CheckpointError(f"{family.model_type}: the model's parameter {'.'.join(map(str, path))} has no "
                                  f"Hugging Face counterpart (the config maps to a model this family does not have)")
        out.append(Target(path, variable, rules[key], layers))
    return out


def mtp_layer_numbers(cfg: ModelConfig) -> tuple[int, ...]:
    """The checkpoint's layer numbers of the MTP modules: past the last decoder layer."""
    return tuple(cfg.n_layers + k for k in range(cfg.mtp_depth))


def mtp_copies(family: Family, cfg: ModelConfig) -> dict[str, str]:
    """`{copy: shared tensor}` of every MTP layer's copies of the main model's tensors."""
    return {copy.format(i=i): shared for i in mtp_layer_numbers(cfg)
            for copy, shared in family.weights.mtp_copies.items()}


def plan(params: Iterable[Target]) -> dict[str, list[Source]]:
    """Every Hugging Face tensor name the parameters need, with the slices of them it fills
    (the parts of a fused tensor fill several)."""
    sources: dict[str, list[Source]] = {}
    for target in params:
        numbering = {} if target.layers is None else {"i": target.layers}
        for name, slot in target.rule.tensors(tuple(target.variable.shape), **numbering):
            sources.setdefault(name, []).append(Source(target, slot))
    return sources


HUB_FILES = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt")  # what a checkpoint needs


def resolve_hf(source: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The local directory of a Hugging Face model: `source` itself when it is a directory, else
    the snapshot of hub repository `source` (`org/name`) in the Hugging Face cache (`cache_dir`,
    default `HF_HUB_CACHE`), downloaded first when it is not there and the network allows."""
    path, name = Path(source), str(source)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:  # a path: read_hf_config names it
        return path
    import huggingface_hub
    from huggingface_hub import constants

    try:
        return Path(huggingface_hub.snapshot_download(name, cache_dir=cache_dir, local_files_only=True,
                                                      allow_patterns=list(HUB_FILES)))
    except Exception as e:  # not in the cache (LocalEntryNotFoundError) or an invalid name (HFValidationError)
        cached = e
    if not constants.HF_HUB_OFFLINE:
        try:
            return Path(huggingface_hub.snapshot_download(name, cache_dir=cache_dir, allow_patterns=list(HUB_FILES)))
        except Exception as e:  # no network, not on the hub, gated
            cached = e
    where = cache_dir or constants.HF_HUB_CACHE
    raise CheckpointError(f"{name!r} is not a directory, and the Hugging Face cache ({where}) does not hold it "
                          f"({type(cached).__name__}): download it where the network allows (`hf download {name}`, or "
                          f"huggingface_hub.snapshot_download), or give its directory") from None


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The config.json of Hugging Face model directory `path`."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model directory)")
    return read_json(config)


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those of the index if there is one, else all of them."""
    if (path / INDEX).is_file():
        weight_map = read_json(path / INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{path / INDEX}: expected a \"weight_map\" object of tensor name -> file name")
        files = [path / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{path}: {INDEX} lists files that are not there: {_listed(absent)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        hint = f" (found {', '.join(other)}: re-save with transformers' save_pretrained, which writes safetensors)" \
            if other else ""
        raise CheckpointError(f"{path}: no safetensors files{hint}")
    return files


@contextlib.contextmanager
def open_safetensors(file: Path, fix: str = "download it again"):
    """`safe_open`, with a damaged file (truncated, bad header) reported as a CheckpointError naming it."""
    try:
        f = safe_open(file, framework="np")
    except Exception as e:  # safetensors raises its own error types (not ValueError)
        raise CheckpointError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e}): "
                              f"the file is damaged or truncated; {fix}") from None
    with f:
        yield f


def nonfinite(x) -> str | None:
    """`"1 NaN, 2 inf of 1,024 values"` for an array of floats holding NaN or infinite values, else None."""
    xp = np if isinstance(x, np.ndarray) else jnp  # a host tensor is counted on the host
    if not jnp.issubdtype(x.dtype, jnp.inexact) or bool(xp.isfinite(x).all()):
        return None
    return f"{int(xp.isnan(x).sum()):,} NaN, {int(xp.isinf(x).sum()):,} inf of {x.size:,} values"


def refuse_nonfinite(where: str, bad: list[str]) -> None:
    """`bad`: the tensors holding NaN or infinite values, each with its file and count."""
    if bad:
        raise CheckpointError(f"{where}: {len(bad)} tensor(s) hold NaN or infinite values: {_listed(bad)}. The "
                              f"weights are damaged or come from a run that diverged: download them again, or start "
                              f"from another checkpoint")


def _listed(names) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return ", ".join(names[:LISTED]) + more


def from_hf(path: str | os.PathLike, dtype: str = "float32", param_dtype: str | None = None, *,
            mesh: jax.sharding.Mesh | None = None, rules=None, log=None,
            **overrides: Any) -> tuple[ModelConfig, Transformer]:
    """Load a Hugging Face checkpoint directory (config.json + safetensors) as `(config, model)`.

    `dtype` is the compute dtype and, unless `param_dtype` is given, the parameters' dtype;
    tensors are cast as they stream in. With a `mesh`, each parameter is placed sharded by
    the logical-axis `rules` (default `sharding.RULES`) as soon as it is complete.
    `overrides` set other fields that are not the network itself (vocab_pad_to, dropout, ...).
    `log(message)` is told of tensors the model does not use that are skipped (DeepSeek-V3's
    multi-token-prediction layer); without it they go to the `logging` module at INFO.
    `path` may be a hub name (`org/name`), read from the Hugging Face cache (`resolve_hf`).
    """
    path = resolve_hf(path)
    hf, family, cfg, quant = _read_config(path, dtype, param_dtype or dtype, overrides)
    graphdef, state, rest, params = _build_targets(cfg, family, mesh, rules)
    sources = plan(params)
    found = _check_headers(path, hf, family, cfg, sources, quant, log)
    _stream(path, found, sources, cfg, quant)
    unfilled = {target.name for target in params if target.buffer is not None}
    assert not unfilled, f"parameters left unfilled: {sorted(unfilled)}"
    return cfg, nnx.merge(graphdef, state, rest)


def _read_config(path: Path, dtype: str, param_dtype: str, overrides: dict
                 ) -> tuple[dict, Family, ModelConfig, Quantisation | None]:
    """`(config.json, its family, our config, how its tensors are quantised)`; a quantisation that is
    not read here is refused, naming how transformers dequantises it."""
    hf = read_hf_config(path)
    try:
        family = family_of(hf)
        cfg = config_from_hf(hf, dtype=dtype, param_dtype=param_dtype, **overrides)
    except ValueError as e:
        raise (CheckpointError if isinstance(e, CheckpointError) else ValueError)(f"{path / 'config.json'}: {e}") \
            from None
    try:
        quant = quantisation_of(hf)
    except ValueError as e:
        raise CheckpointError(f"{path}: a quantised checkpoint: {e}") from None
    return hf, family, cfg, quant


def _build_targets(cfg: ModelConfig, family: Family, mesh, rules):
    """`(graphdef, state, rest, targets)` of the abstract model: each parameter a `Target` to fill,
    with its sharding when there is a `mesh` (so a mesh that cannot split the model fails before
    any reading)."""
    abstract = abstract_model(cfg)
    graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise CheckpointError(f"the model holds state other than parameters, which a checkpoint does not fill: "
                              f"{_listed('.'.join(map(str, p)) for p, _ in nnx.to_flat_state(rest))}")
    params = targets(abstract, state, family)
    if mesh is not None:
        from modern_jax.sharding import RULES, state_shardings

        shardings = dict(nnx.to_flat_state(state_shardings(state, mesh, rules or RULES)))
        for target in params:
            target.sharding = shardings[target.path]
    return graphdef, state, rest, params


def _headers(path: Path) -> list[tuple[Path, str, str, tuple[int, ...]]]:
    """`(file, name, dtype, shape)` of every tensor in the checkpoint, in file order, from the headers."""
    out = []
    for file in checkpoint_files(path):
        with open_safetensors(file) as f:
            for name in f.keys():
                view = f.get_slice(name)
                out.append((file, name, view.get_dtype(), tuple(view.get_shape())))
    return out


def _check_headers(path: Path, hf: dict, family: Family, cfg: ModelConfig, sources, quant: Quantisation | None,
                   log) -> dict[str, Stored]:
    """Where each tensor the model reads is (`{canonical name: Stored}`), from the headers only: a
    missing, unused, doubled or misshapen tensor, or a quantised one without its scales, fails here,
    before any data is read; tensors the family skips are logged. A quantised tensor stands for the
    tensor it dequantises to (its shape is that one's), and its scales are read with it."""
    table = family.weights
    skipped = {pattern: (what, []) for pattern, what in family.skipped(Reader(family.model_type, hf, family.defaults),
                                                                        cfg)}
    copies = mtp_copies(family, cfg)
    if copies:  # the main model's embedding and head, saved again with each MTP layer
        skipped["^(" + "|".join(map(re.escape, copies)) + ")$"] = (
            "the multi-token-prediction layers' copies of the shared tensors", [])
    tied_head = table.top["lm_head.kernel"].hf if cfg.tie_embeddings else None
    headers = _headers(path)
    where: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file, name, _, shape in headers:
        where.setdefault(name, (file, shape))

    found: dict[str, Stored] = {}
    scaled, unused, twice, wrong, unscaled = set(), [], [], [], []

    def not_read(name: str, canonical: str) -> None:  # skipped (and logged), ignored, or a tensor left over
        skip = next((names for pattern, (_, names) in skipped.items() if re.search(pattern, canonical)), None)
        if skip is not None:
            skip.append(name)
        elif not (table.ignored(name) or table.ignored(canonical) or canonical == tied_head):
            unused.append(name)

    for file, name, dtype, shape in headers:
        if quant is not None and quant.is_scales(name):
            continue  # read with the tensor it scales; one that scales none is left over (below)
        original = quant.stands_for(name, dtype) if quant is not None else None
        canonical = table.canonical(original or name)
        if canonical not in sources:
            not_read(name, canonical)
            continue
        if canonical in found:
            twice.append(f"{name} ({found[canonical].file.name} and {file.name})")
            continue
        scales = None
        if original is not None:
            scales_name, need = quant.scales_name(name), quant.scales_shape(shape)
            if scales_name not in where:
                unscaled.append(f"{name} in {file.name} (no {scales_name})")
            else:
                scales = (where[scales_name][0], scales_name)
                if where[scales_name][1] != need:
                    wrong.append(f"{scales_name}: the checkpoint has {list(where[scales_name][1])}, its quantised "
                                 f"tensor {list(shape)} needs {list(need)}")
            scaled.add(scales_name)
            shape = quant.shape(shape)
        found[canonical] = Stored(file, name, dtype, scales)
        src = sources[canonical][0]
        want = src.rule.hf_shape(src.shape, cfg.vocab_size)
        if shape != want:
            wrong.append(f"{name}: the checkpoint has {list(shape)}{' (dequantised)' if original else ''}, the model "
                         f"expects {list(want)} (for {src.target.name} {list(src.shape)})")
    for file, name, _, _ in headers:
        if quant is not None and quant.is_scales(name) and name not in scaled:
            not_read(name, table.canonical(name))
    missing = [n for n in sources if n not in found]
    _refuse_misfit(path, family.model_type, missing, unused, twice, wrong, unscaled)
    for what, names in skipped.values():
        if names:
            message = f"{path}: skipping {len(names)} tensor(s) of {what}, which the model does not use: {_listed(names)}"
            if log is None:
                logger.info(message)
            else:
                log(message)
    return found


def _refuse_misfit(path: Path, model_type: str, missing, unused, twice, wrong, unscaled) -> None:
    """One error naming every tensor that keeps the checkpoint from filling the model, by kind."""
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing: {_listed(missing)}")
    if unscaled:
        problems.append(f"{len(unscaled)} quantised tensor(s) without their scales: {_listed(unscaled)}")
    if unused:
        problems.append(f"{len(unused)} tensor(s) the {model_type} model has no place for: {_listed(unused)}")
    if twice:
        problems.append(f"{len(twice)} tensor(s) stored twice: {_listed(twice)}")
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) with the wrong shape: " + "; ".join(wrong[:LISTED]))
    if problems:
        raise CheckpointError(f"{path} does not fit the {model_type} model of its config.json: " + ". ".join(problems))


def _read(f, file: Path, name: str, dtype: str) -> np.ndarray:
    """Tensor `name` of the open safetensors `file` (`f`); a damaged file is a CheckpointError naming it."""
    try:
        return read_raw(file, name) if dtype in RAW_DTYPES else f.get_tensor(name)
    except Exception as e:  # safetensors raises its own error types on a damaged file
        raise CheckpointError(f"{file}: cannot read tensor {name} ({type(e).__name__}: {e}): "
                              f"the file is damaged or truncated") from None


def _stream(path: Path, found: dict[str, Stored], sources, cfg: ModelConfig, quant: Quantisation | None) -> None:
    """The data, file by file, into one preallocated buffer per parameter (`fill`), a quantised tensor
    dequantised with its scales (float32) as it arrives; a tensor holding NaN or infinite values is
    refused, by name."""
    by_file: dict[Path, list[tuple[str, Stored]]] = {}
    for canonical, stored in found.items():
        by_file.setdefault(stored.file, []).append((canonical, stored))
    bad = []
    for file, tensors in by_file.items():
        with open_safetensors(file) as f:
            for canonical, stored in tensors:
                x = _read(f, file, stored.name, stored.dtype)
                if stored.scales is not None:
                    scales_file, scales_name = stored.scales
                    with contextlib.ExitStack() as other:
                        g = f if scales_file == file else other.enter_context(open_safetensors(scales_file))
                        x = quant.dequantize(x, _read(g, scales_file, scales_name, ""))
                count = nonfinite(x)
                if count is not None:
                    bad.append(f"{stored.name} in {file.name} ({count})")
                for src in sources[canonical]:
                    fill(src, x, cfg.vocab_size)
                del x
    refuse_nonfinite(str(path), bad)


def fill(src: Source, x: np.ndarray, vocab: int | None = None) -> None:
    """Put Hugging Face tensor `x` into its slice of our parameter; hand the parameter to JAX once
    every slice is filled."""
    target = src.target
    if target.buffer is None:
        target.buffer = np.empty(target.variable.shape, np.dtype(target.variable.dtype))
    target.buffer[src.slot] = src.rule.to_ours(x, src.shape, vocab)
    target.filled.add(src.slot)
    if len(target.filled) == math.prod(target.variable.shape[:len(src.slot)]):
        put = jnp.asarray if target.sharding is None else (lambda a: jax.device_put(a, target.sharding))
        target.variable.set_value(put(target.buffer))
        target.buffer = None


def host_slice(src: Source) -> np.ndarray:
    """The slot (one layer, one expert) of a parameter that `src` reads, fetched to the host alone:
    a sharded array gives up just that slice, so the host never holds a whole stacked parameter."""
    return np.asarray(src.target.variable[...][src.slot])


def hf_tensor(srcs: list[Source], piece: Callable[[Source], np.ndarray] = host_slice,
              vocab: int | None = None) -> np.ndarray:
    """The Hugging Face tensor `srcs` (one name's sources: the parts of a fused tensor, in any order)
    make of our parameters; `piece(src)` is the host array of one source's slot."""
    parts = sorted(srcs, key=lambda s: s.rule.part or 0)
    return parts[0].rule.to_hf([piece(src) for src in parts], vocab)


# ----- writing ---------------------------------------------------------------------------

class _ShardWriter:
    """Writes tensors into safetensors shards of at most `max_bytes` (one tensor may exceed it)."""

    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes, self.shards, self.total = 0, [], 0

    def add(self, name: str, x: np.ndarray) -> None:
        if self.pending and self.pending_bytes + x.nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = np.ascontiguousarray(x)
        self.pending_bytes += x.nbytes
        self.total += x.nbytes

    def flush(self) -> None:
        file = self.path / f".shard-{len(self.shards)}.safetensors"
        save_file(self.pending, str(file), metadata={"format": "pt"})
        self.shards.append((file, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        if self.pending or not self.shards:
            self.flush()
        n = len(self.shards)
        if n == 1:
            self.shards[0][0].rename(self.path / SINGLE)
            return [SINGLE]
        weight_map = {}
        for k, (file, names) in enumerate(self.shards):
            final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            file.rename(self.path / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return [INDEX, *sorted(set(weight_map.values()))]


def to_hf(model: Transformer, path: str | os.PathLike, model_type: str, *, dtype: str | None = None,
          max_shard_bytes: int = MAX_SHARD_BYTES, extra_config: dict[str, Any] | None = None,
          overwrite: bool = False) -> list[str]:
    """Write `model` as a Hugging Face checkpoint of `model_type` (config.json + safetensors).

    `dtype` casts the tensors (default: the parameters' dtype). `extra_config` adds keys
    that do not change the network (token ids, ...) to config.json. Returns the files written.
    Raises ValueError if `model_type` cannot express the model, or if `path` holds anything
    but nothing or (with `overwrite`, which replaces it) a Hugging Face model.
    """
    from modern_jax.training import outputs

    cfg = model.cfg
    hf = config_to_hf(cfg, model_type)  # refuses a model the family cannot express
    dtype = dtype or cfg.param_dtype
    hf.update(extra_config or {})
    hf["torch_dtype"] = dtype
    path = Path(path)
    outputs.claim(path, outputs.HF, "output directory", overwrite=overwrite)
    with outputs.RunLock(path, "output directory", command="convert --to-hf").acquire():
        files = _write_hf(model, path, model_type, hf, dtype, max_shard_bytes)
        outputs.mark(path, outputs.HF, f"modern-jax convert --to-hf (model_type {model_type})")
    return files


def _write_hf(model: Transformer, path: Path, model_type: str, hf: dict, dtype: str, max_shard_bytes: int
              ) -> list[str]:
    cfg = model.cfg
    sources = plan(targets(model, nnx.state(model, nnx.Param), FAMILIES[model_type]))

    def order(name: str):
        src = sources[name][0]
        layer = src.target.layers[src.slot[0]] if src.target.layers is not None else (
            -1 if "embed" in src.target.name else 1 << 30)
        return layer, name

    writer = _ShardWriter(path, max_shard_bytes)  # holds at most one shard of tensors on the host
    for name in sorted(sources, key=order):
        writer.add(name, hf_tensor(sources[name], vocab=cfg.vocab_size).astype(np.dtype(jnp.dtype(dtype))))
    for copy, shared in mtp_copies(FAMILIES[model_type], cfg).items():  # each MTP layer's copies, as the family saves
        writer.add(copy, hf_tensor(sources[shared], vocab=cfg.vocab_size).astype(np.dtype(jnp.dtype(dtype))))
    files = writer.close()
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return ["config.json", *files]
