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
shapes; a quantised tensor without its scales is refused, naming both; a file shorter than its
header says is refused, naming it), then builds each parameter on each of this process's devices
from the slice that device holds (`place`): the slice of each slot (layer, expert) it spans is
mapped back through the family's rule to the rows of the Hugging Face tensor that hold it
(`Rule.read`: q/k/v's heads, a fused tensor's part, the true vocabulary rows) and read from the
file alone (`safetensors_files`), cast as it arrives into a host buffer of that device's slice,
which goes to the device before the next is read. A quantised tensor (block-fp8, mxfp4:
`hf_quantised`) is read as the blocks the slice touches and their scales, and dequantised there.
So each process reads only its devices' share of the files, and holds, beside what its devices
hold, one device's slice of one parameter (`load_footprint` counts both for a mesh, without the
devices); the whole-tensor load of one device is the case of one slice per parameter. A tensor
holding NaN or infinite values is refused, naming it and its file.

Writing fetches one slot of a parameter at a time from the devices (gathered to every process of
a launch, which all fetch the same slots in the same order) and streams it into its safetensors
file, whose header is written first: each process writes the files it owns (`_write_hf`), and no
process holds more than one tensor of the model on the host.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from flax.nnx import traversals

from modern_jax import paths
from modern_jax.config import ModelConfig
from modern_jax.configfile import read_json
from modern_jax.convert.hf_config import config_from_hf, config_to_hf, family_of
from modern_jax.convert.hf_families import FAMILIES, Family
from modern_jax.convert.hf_keys import Reader
from modern_jax.convert.hf_quantised import Quantisation, quantisation_of
from modern_jax.convert.hf_weights import Rule
from modern_jax.convert.safetensors_files import (DamagedFile, Entry, SafetensorsFiles, SafetensorsWriter, dtype_name,
                                                  normalised)
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
    """One of our parameters (a stacked one: all its layers), read slice by slice."""

    path: tuple
    variable: Any  # the nnx.Param in the model's state
    rule: Rule  # how Hugging Face tensors hold it
    layers: tuple[int, ...] | None  # stacked: the layer of each index along its first axis; None: not per layer
    sharding: Any = None  # where it goes (None: the default device)

    @property
    def name(self) -> str:
        return ".".join(map(str, self.path))

    def slots(self) -> dict[tuple[int, ...], str]:
        """The Hugging Face tensor holding each slot (layer, expert, ...; `()`: the whole parameter)."""
        numbering = {} if self.layers is None else {"i": self.layers}
        return {slot: name for name, slot in self.rule.tensors(tuple(self.variable.shape), **numbering)}


@dataclass(frozen=True)
class Stored:
    """Where a Hugging Face tensor the model reads is (its header entry), and for a quantised one the
    entry of its scales."""

    entry: Entry
    scales: Entry | None = None

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def file(self) -> Path:
        return self.entry.file


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
        for slot, name in target.slots().items():
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
    config = paths.as_path(path) / "config.json"  # a converted checkpoint's hf/ may be on object storage
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
    """One safetensors file's tensors (`keys()`, `get_tensor(name)`), by the one reader
    (`SafetensorsFiles`); a damaged or truncated file is a CheckpointError naming it."""
    try:
        yield SafetensorsFiles([file], fix)
    except DamagedFile as e:
        raise CheckpointError(str(e)) from None


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
            mesh: jax.sharding.Mesh | None = None, rules=None, shardings: dict | None = None, log=None,
            **overrides: Any) -> tuple[ModelConfig, Transformer]:
    """Load a Hugging Face checkpoint directory (config.json + safetensors) as `(config, model)`.

    `dtype` is the compute dtype and, unless `param_dtype` is given, the parameters' dtype;
    tensors are cast as they stream in. With a `mesh`, each parameter is placed sharded by
    the logical-axis `rules` (default `sharding.RULES`); `shardings` (a pure dict of the model's
    parameters, each a sharding or anything with a `.sharding`) places them as a run does. Each
    process reads only the slices of the checkpoint its own devices hold.
    `overrides` set other fields that are not the network itself (vocab_pad_to, dropout, ...).
    `log(message)` is told of tensors the model does not use that are skipped (DeepSeek-V3's
    multi-token-prediction layer); without it they go to the `logging` module at INFO, as the
    bytes read always do. `path` may be a hub name (`org/name`), read from the Hugging Face cache (`resolve_hf`).
    """
    path = resolve_hf(path)
    hf, family, cfg, quant = _read_config(path, dtype, param_dtype or dtype, overrides)
    graphdef, state, rest, params = _build_targets(cfg, family, mesh, rules, shardings)
    files = _open_files(path)
    found = _check_headers(path, hf, family, cfg, plan(params), quant, log, files)
    bad: dict[str, list[int]] = {}
    for target in params:
        names = target.slots()
        target.variable.set_value(place(target, lambda slot, index, t=target, n=names: _read_slot(
            files, found[n[slot]], t, index, cfg.vocab_size, quant, bad)))
    refuse_nonfinite(str(path), [f"{name} in {found_by_name.file.name} ({nan:,} NaN, {inf:,} inf of {n:,} values)"
                                 for name, (found_by_name, nan, inf, n) in bad.items()])
    logger.info(f"{path}: read {files.requested / 2**20:,.1f} MiB of the checkpoint's "
               f"{sum(f.stat().st_size for f in files.headers) / 2**20:,.1f} MiB for this process's devices")
    return cfg, nnx.merge(graphdef, state, rest)


def _tell(log, message: str) -> None:
    if log is None:
        logger.info(message)
    else:
        log(message)


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


def _build_targets(cfg: ModelConfig, family: Family, mesh, rules, shardings=None):
    """`(graphdef, state, rest, targets)` of the abstract model: each parameter a `Target` to fill,
    with its sharding when there is a `mesh` or `shardings` (so a mesh that cannot split the model
    fails before any reading)."""
    abstract = abstract_model(cfg)
    graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise CheckpointError(f"the model holds state other than parameters, which a checkpoint does not fill: "
                              f"{_listed('.'.join(map(str, p)) for p, _ in nnx.to_flat_state(rest))}")
    params = targets(abstract, state, family)
    if mesh is not None:
        from modern_jax.sharding import RULES, state_shardings

        shardings = nnx.to_pure_dict(state_shardings(state, mesh, rules or RULES))
    if shardings is not None:
        flat = traversals.flatten_mapping(shardings)
        for target in params:  # one the run does not place (not in `shardings`) goes to the default device
            where = flat.get(target.path)
            target.sharding = getattr(where, "sharding", where)
    return graphdef, state, rest, params


def _open_files(path: Path) -> SafetensorsFiles:
    """The headers of the checkpoint's files; a damaged or truncated one is refused, naming it."""
    try:
        return SafetensorsFiles(checkpoint_files(path))
    except DamagedFile as e:
        raise CheckpointError(str(e)) from None


def _check_headers(path: Path, hf: dict, family: Family, cfg: ModelConfig, sources, quant: Quantisation | None,
                   log, files: SafetensorsFiles) -> dict[str, Stored]:
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
    headers = [(e.file, e.name, e.dtype, e.shape) for entries in files.headers.values() for e in entries]
    where = files.entries

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
                scales = where[scales_name]
                if scales.shape != need:
                    wrong.append(f"{scales_name}: the checkpoint has {list(scales.shape)}, its quantised "
                                 f"tensor {list(shape)} needs {list(need)}")
            scaled.add(scales_name)
            shape = quant.shape(shape)
        found[canonical] = Stored(next(e for e in files.headers[file] if e.name == name), scales)
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
            _tell(log, f"{path}: skipping {len(names)} tensor(s) of {what}, which the model does not use: "
                       f"{_listed(names)}")
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


def place(target: Target, read: Callable[[tuple[int, ...], tuple[slice, ...]], np.ndarray]) -> jax.Array:
    """Our parameter, built on each of this process's devices from the slice it holds: the slice of
    each slot (layer, expert) it spans is `read(slot, index)` (the index within the slot), cast into a
    host buffer of the device's slice alone, which goes to the device before the next one is read
    (devices holding the same slice share one read)."""
    shape, dtype = tuple(target.variable.shape), np.dtype(target.variable.dtype)
    sharding = target.sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    slotted = len(target.rule.variables())
    indices = sharding.addressable_devices_indices_map(shape)
    by_index: dict[tuple, list] = {}
    for device, index in indices.items():
        by_index.setdefault(tuple((s.start, s.stop) for s in normalised(index, shape)), []).append(device)
    arrays = {}
    for bounds, devices in by_index.items():
        index = tuple(slice(*b) for b in bounds)
        host = np.empty([s.stop - s.start for s in index], dtype)
        for slot in itertools.product(*(range(s.start, s.stop) for s in index[:slotted])):
            host[tuple(k - s.start for k, s in zip(slot, index))] = read(slot, index[slotted:])
        for device in devices:
            arrays[device] = jax.device_put(host, device)
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, [arrays[d] for d in indices])


def _read_slot(files: SafetensorsFiles, stored: Stored, target: Target, index: tuple[slice, ...], vocab: int,
               quant: Quantisation | None, bad: dict[str, list]) -> np.ndarray:
    """Slice `index` of one slot of `target` from Hugging Face tensor `stored`: a quantised one
    dequantised from the blocks the slice touches and their scales; NaN and infinite values are
    counted into `bad` by tensor name."""
    shape = tuple(target.variable.shape)[len(target.rule.variables()):]

    def read(hf_index: tuple[slice, ...]) -> np.ndarray:
        try:
            if stored.scales is None:
                x = files.read(stored.entry, hf_index)
            else:
                x = quant.read(normalised(hf_index, quant.shape(stored.entry.shape)),
                               lambda i: files.read(stored.entry, i), lambda i: files.read(stored.scales, i))
        except (OSError, ValueError) as e:  # the file changed since its header was read
            raise CheckpointError(f"{stored.file}: cannot read tensor {stored.name} ({e}): the file is damaged or "
                                  f"truncated; download it again") from None
        if x.dtype.kind == "f" or x.dtype == ml_dtypes.bfloat16:
            finite = np.isfinite(x)
            if not finite.all():
                counts = bad.setdefault(stored.name, [stored, 0, 0, 0])
                counts[1] += int(np.isnan(x).sum())
                counts[2] += int(np.isinf(x).sum())
                counts[3] += x.size
        return x

    return target.rule.read(index, shape, vocab, read)


FETCH_BYTES = 4 * 2**20  # what one fetch of a slot's rows gathers onto each device


def host_slice(src: Source) -> np.ndarray:
    """The slot (one layer, one expert) of a parameter that `src` reads, fetched to the host alone:
    of a sharded array, in pieces of at most `FETCH_BYTES` along an axis the mesh does not split
    (gathered onto every device of its mesh, so every process of a launch gets each piece, all
    fetching the same pieces in the same order), so neither the host nor a device ever holds more
    of the parameter than the slot and one piece."""
    x = src.target.variable[...]
    if not isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding):
        return np.asarray(x[src.slot])
    shape, lead = tuple(x.shape[len(src.slot):]), len(src.slot)
    spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
    free = [a for a in range(len(shape)) if spec[lead + a] is None] or [None]
    axis = max(free, key=lambda a: -1 if a is None else shape[a])
    rows = 1 if axis is None else shape[axis]
    row_bytes = math.prod(shape) // max(rows, 1) * x.dtype.itemsize
    size = max([d for d in range(1, rows + 1) if rows % d == 0 and d * row_bytes <= FETCH_BYTES] or [1])
    whole = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())
    kept = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec(*spec[lead:]))
    out = np.empty(shape, np.dtype(x.dtype))
    for start in range(0, rows, size):
        piece = _piece(x, tuple(map(np.int32, src.slot)), np.int32(start), axis=axis, size=size, kept=kept,
                       out_sharding=whole)
        out[(slice(None),) * (axis or 0) + (slice(start, start + size),) if axis is not None else ()] = \
            np.asarray(piece.addressable_data(0))
    return out


@functools.partial(jax.jit, static_argnames=("axis", "size", "kept", "out_sharding"))
def _piece(x, slot, start, *, axis, size, kept, out_sharding):
    """Rows `start` to `start + size` along `axis` of slot `slot` of `x` (all of it: `axis` None), cut
    where it lies (`kept`: the slot's sharding, as `x`'s), then whole on every device."""
    y = x[slot] if slot else x
    y = y if axis is None else jax.lax.dynamic_slice_in_dim(y, start, size, axis)
    y = jax.lax.with_sharding_constraint(y, kept)
    return jax.lax.with_sharding_constraint(y, out_sharding)  # the piece alone is gathered, not the parameter


def hf_tensor(srcs: list[Source], piece: Callable[[Source], np.ndarray] = host_slice,
              vocab: int | None = None) -> np.ndarray:
    """The Hugging Face tensor `srcs` (one name's sources: the parts of a fused tensor, in any order)
    make of our parameters; `piece(src)` is the host array of one source's slot."""
    parts = sorted(srcs, key=lambda s: s.rule.part or 0)
    return parts[0].rule.to_hf([piece(src) for src in parts], vocab)


# ----- writing ---------------------------------------------------------------------------

def to_hf(model: Transformer, path: str | os.PathLike, model_type: str, *, dtype: str | None = None,
          max_shard_bytes: int = MAX_SHARD_BYTES, extra_config: dict[str, Any] | None = None,
          overwrite: bool = False) -> list[str]:
    """Write `model` as a Hugging Face checkpoint of `model_type` (config.json + safetensors).

    `dtype` casts the tensors (default: the parameters' dtype). `extra_config` adds keys
    that do not change the network (token ids, ...) to config.json. Returns the files written.
    Raises ValueError if `model_type` cannot express the model, or if `path` holds anything
    but nothing or (with `overwrite`, which replaces it) a Hugging Face model.
    """
    from modern_jax.multihost import distributed
    from modern_jax.training import outputs

    cfg = model.cfg
    hf = config_to_hf(cfg, model_type)  # refuses a model the family cannot express
    dtype = dtype or cfg.param_dtype
    hf.update(extra_config or {})
    hf["torch_dtype"] = dtype
    path, main = Path(path), jax.process_index() == 0  # of a launch of several processes, process 0 claims it
    if main:
        outputs.claim(path, outputs.HF, "output directory", overwrite=overwrite)
    with outputs.RunLock(path, "output directory", command="convert --to-hf").acquire() if main else \
            contextlib.nullcontext():
        distributed.barrier("to_hf/claimed")
        files = _write_hf(model, path, model_type, hf, dtype, max_shard_bytes)
        if main:
            outputs.mark(path, outputs.HF, f"modern-jax convert --to-hf (model_type {model_type})")
    return files


def _write_hf(model: Transformer, path: Path, model_type: str, hf: dict, dtype: str, max_shard_bytes: int
              ) -> list[str]:
    """The safetensors files (and index) of `model`, a tensor at a time: every process of a launch
    fetches each slot in the same order (`host_slice`), and each writes the files it owns (shard k is
    process k's, modulo the process count: with several processes the shards are at most 1/N of the
    model each, so each writes a share), so no process holds more than one tensor of the model."""
    from modern_jax.multihost import distributed

    cfg = model.cfg
    sources = plan(targets(model, nnx.state(model, nnx.Param), FAMILIES[model_type]))

    def order(name: str):
        src = sources[name][0]
        layer = src.target.layers[src.slot[0]] if src.target.layers is not None else (
            -1 if "embed" in src.target.name else 1 << 30)
        return layer, name

    out, processes = np.dtype(jnp.dtype(dtype)), jax.process_count()
    # each tensor, then each MTP layer's copies of the shared ones (as the family saves them)
    origin = {**{name: name for name in sorted(sources, key=order)}, **mtp_copies(FAMILIES[model_type], cfg)}
    shapes = {name: sources[shared][0].rule.hf_shape(sources[shared][0].shape, cfg.vocab_size)
              for name, shared in origin.items()}
    total = sum(math.prod(shape) for shape in shapes.values()) * out.itemsize
    shards = _shards(shapes, out.itemsize, min(max_shard_bytes, -(-total // processes)))
    files = [SINGLE] if len(shards) == 1 else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for k in range(len(shards))]
    for k, names in enumerate(shards):
        writer = SafetensorsWriter(path / files[k], {n: (shapes[n], dtype_name(out)) for n in names}) \
            if k % processes == jax.process_index() else None
        for name in names:
            x = hf_tensor(sources[origin[name]], vocab=cfg.vocab_size)  # every process takes part in fetching it
            if writer is not None:
                writer.write(name, x.astype(out, copy=False))
            del x
        if writer is not None:
            writer.close()
    distributed.barrier("to_hf/shards")
    if jax.process_index() == 0:
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {name: files[k] for k, names in enumerate(shards) for name in names}}
            (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return ["config.json", *([INDEX] if len(shards) > 1 else []), *files]


def _shards(shapes: dict[str, tuple[int, ...]], itemsize: int, max_bytes: int) -> list[list[str]]:
    """Tensor names in order, cut into shards of at most `max_bytes` (one tensor may exceed it)."""
    shards, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


# ----- accounting --------------------------------------------------------------------------

def load_footprint(cfg: ModelConfig, model_type: str, mesh_shape: dict[str, int], processes: int,
                   stored_dtype: str = "bfloat16", rules=None) -> dict[str, int]:
    """The bytes one process of a launch deals in while `from_hf` loads `cfg` (a `model_type`
    checkpoint stored in `stored_dtype`) onto a mesh of `mesh_shape` (its devices in row-major
    order, `processes` consecutive groups of them, as a pod slice's hosts hold them), the largest
    over the processes, found from the shapes alone (no devices needed):

    - `held`: what its devices hold, in the parameters' dtype (on a host whose devices are its own
      CPUs, host memory);
    - `read`: the bytes it reads from the files (each distinct slice its devices hold, once);
    - `slice`: the most it holds on the host beside that at any moment: one device's slice of one
      parameter being filled, plus the Hugging Face slot slice being read into it (read, and cast
      to float32 where the reshaping copies it).
    """
    from modern_jax.sharding import RULES, logical_to_spec

    names, sizes = list(mesh_shape), list(mesh_shape.values())
    devices = math.prod(sizes)
    if devices % processes:
        raise ValueError(f"{devices} devices cannot be split over {processes} processes")
    per_process, stored = devices // processes, np.dtype(jnp.dtype(stored_dtype)).itemsize
    coords = np.stack(np.unravel_index(np.arange(devices), sizes), axis=-1)  # [device, mesh axis]
    mesh = type("MeshShape", (), {"shape": dict(mesh_shape)})()
    abstract = abstract_model(cfg)
    held, read, largest = np.zeros(processes), np.zeros(processes), 0
    for target in targets(abstract, nnx.state(abstract, nnx.Param), FAMILIES[model_type]):
        shape, itemsize = tuple(target.variable.shape), np.dtype(target.variable.dtype).itemsize
        axes = target.variable.get_metadata().get("out_sharding") or (None,) * len(shape)
        spec = logical_to_spec(axes, rules or RULES, mesh, shape)
        groups = [() if s is None else (s,) if isinstance(s, str) else tuple(s) for s in spec]
        groups += [()] * (len(shape) - len(groups))
        splits = [math.prod(mesh_shape[a] for a in g) for g in groups]
        piece = [n // k for n, k in zip(shape, splits)]
        shard = math.prod(piece)
        slotted = len(target.rule.variables())
        index = np.stack([np.ravel_multi_index(tuple(coords[:, names.index(a)] for a in g), [mesh_shape[a] for a in g])
                          if g else np.zeros(devices, int) for g in groups], axis=-1)
        for p in range(processes):
            mine = index[p * per_process:(p + 1) * per_process]
            held[p] += per_process * shard * itemsize
            read[p] += len({tuple(row) for row in mine}) * shard * stored
        slot_slice = math.prod(piece[slotted:])
        largest = max(largest, shard * itemsize + slot_slice * (stored + 4))
    return {"held": int(held.max()), "read": int(read.max()), "slice": int(largest)}
