"""Orbax checkpoints of a run, their checksums, and loading a model from any checkpoint directory.

A run directory:

    <output_dir>/config.yaml          the resolved run config (model:, train:, data:)
    <output_dir>/tokenizer.json       the tokenizer (the char vocabulary, a trained BPE, ...)
    <output_dir>/checkpoints/<step>/  params/  (the model's parameters, a pure dict)
                                      state/   (opt_state, step, rng, nonfinite)
                                      meta/    (JSON: step, data-iterator state)
                                      checksums.json (size and CRC-32 of every file above)
    <output_dir>/damaged_checkpoints/<step>/  steps set aside on resume (never deleted)
    <output_dir>/hf/                  a fine-tuned model's source config.json and tokenizer files

Orbax writes each step into a temporary directory and renames it when complete, so a
process killed while saving leaves no step that looks complete; the partial one is removed
when the run restarts. A save that fails (a full disk) is one `CheckpointWriteError` naming
the step, the reason and the intact step before it. Each step's `meta` records the model
config it was saved with, so a checkpoint of another model shape is named as such, with the
fields that differ, before Orbax reads it. Once a save has completed, `checksums.json` records the size and
CRC-32 of each of its files (3-4 GB/s on one core), so a truncated, missing or overwritten
file is found and named before Orbax reads it. Resuming takes the newest step that restores
completely; newer damaged steps are named and moved to `damaged_checkpoints/`. A resumed run
keeps what its checkpoints were trained as (`check_objective`: its objective's section;
`check_resume`: the model, the `lora:` section, the optimiser, the tokenizer; `check_base`: a base
left out of them), and other changed settings are named.

`load_params(dir)` reads a model from a run directory (its newest step), from one step
directory, or from a converted checkpoint (`params/` with `config.yaml` beside it): every
layout keeps the parameters under `params/`. It names the step it loads and fails on a
damaged one; it never falls back to an older step by itself.

In a launch of several processes every process writes and reads its own shards; process 0
alone removes partial saves, checks checksums, seals and sets damaged steps aside, and
decides which step a run resumes from (`multihost.distributed`).

Every path may be on object storage (`gs://`, `s3://`; `modern_jax.paths`): Orbax writes
there directly (`s3://` through `orbax_s3`), and a step not finished there has no commit file
instead of a temporary name; its `checksums.json` records sizes alone (the objects carry their
own checksums).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import pathlib
import re
import sys
import traceback
import zlib

import jax
import orbax.checkpoint as ocp

from modern_jax import paths
from modern_jax.config import ModelConfig
from modern_jax.configfile import read_yaml
from modern_jax.multihost import distributed
from modern_jax.training.config import RunConfig, TrainConfig
from modern_jax.training.layout import leading, same_stack
from modern_jax.training.orbax_s3 import reach_s3
from modern_jax.training.outputs import step_numbers

CONFIG_FILE = "config.yaml"
CHECKPOINTS = "checkpoints"
HF_ASSETS_DIR = "hf"  # a Hugging Face source's config.json and tokenizer files, kept for the way back
BASE_FILE = "base.json"  # where a fine-tune started: `{"source": path, "files": {name: [size, CRC-32]}}`
DAMAGED = "damaged_checkpoints"
CHECKSUMS = "checksums.json"
ITEMS = ("params", "state", "meta")
reach_s3()  # Orbax writes and reads s3:// as it does gs://
MISMATCH = "tree structures do not match"  # Orbax's words for a target of another pytree structure


class CheckpointDamaged(ValueError):
    """A checkpoint that cannot be restored; the message names the step and the file."""


class CheckpointWriteError(ValueError):
    """A save that failed (a full disk, a lost mount); the steps before it are intact."""


# ----- checksums -------------------------------------------------------------------


def _crc32(path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_checksums(root, files, crc: bool = True) -> dict[str, list[int]]:
    """`{path relative to root: [size, CRC-32]}` of `files`: what checksums.json records of a
    checkpoint, and base.json of the base a LoRA run reads again (`crc=False`: sizes alone, the
    CRC None)."""
    return {p.relative_to(root).as_posix(): [paths.size(p), _crc32(p) if crc else None] for p in files}


def write_checksums(directory) -> None:
    """Record the size and CRC-32 of every file under `directory` (written last, atomically). On
    object storage the sizes alone: its objects carry their own checksums, checked as they are
    written and read, and computing CRC-32s would read the whole checkpoint back."""
    directory = paths.as_path(directory)
    files = [p for p in paths.files_under(directory) if p.name != CHECKSUMS]
    paths.write_text(directory / CHECKSUMS,
                     json.dumps({"files": file_checksums(directory, files, crc=not paths.is_remote(directory))}))


def check_base(run_dir, source: str, files: dict[str, list[int]], fix: str) -> None:
    """The base read again for a run whose checkpoints leave it out (`lora.save_base: false`) is the
    one it started from: `files`, the size and CRC-32 of each of `source`'s weight files now, equal
    those its base.json recorded then. Every byte counts, so another model of the same shape, or
    this one fine-tuned or merged with adapters, does not pass; a run recorded before base.json held
    them is not checked. Else a ValueError naming the base, the run, the file that differs and `fix`."""
    base_file = paths.as_path(run_dir) / BASE_FILE
    recorded = (_read_json(base_file) or {}).get("files")
    if recorded is None or recorded == files:
        return
    name = next(n for n in sorted(set(recorded) | set(files)) if recorded.get(n) != files.get(n))
    then, now = (f"{size:,} bytes, CRC-32 {crc:08x}" if size is not None else "no such file"
                 for size, crc in (recorded.get(name, (None, None)), files.get(name, (None, None))))
    raise ValueError(f"{source} is not the base {run_dir} was trained on ({name}: {then} when the run started, "
                     f"{now} now, by its {BASE_FILE}): {fix}")


def _changes(saved: dict, now: dict) -> list[str]:
    """`section.field old -> new` for every setting of `now` that differs from the saved config."""
    before, after = distributed.flatten(saved), distributed.flatten(now)
    return [f"{k} {before.get(k)!r} -> {after.get(k)!r}" for k in sorted(set(before) | set(after))
            if before.get(k) != after.get(k) and not k.startswith("model.")]


TOKENIZER_FIELDS = ("data.tokenizer", "data.tokenizer_path")  # what a resumed run's saved tokenizer fixes


def _differences(section: str, there: dict, here: dict) -> list[str]:
    """`section.field is X there, Y here` for each field of the saved `there` that `here` holds otherwise."""
    return [f"{section}.{k} is {v!r} there, {here.get(k)!r} here" for k, v in there.items() if here.get(k) != v]


def check_objective(out_dir, run: RunConfig) -> None:
    """A resumed run keeps the objective its checkpoints were trained for: its config.yaml's objective
    section (`dpo:`, `grpo:`; none: next-token) is `run`'s. Checked before its data is read, whose
    records the objective decides."""
    from modern_jax.configfile import OBJECTIVES

    config_path = out_dir / CONFIG_FILE
    if not config_path.exists():
        return
    saved = read_yaml(config_path)
    there = next((name for name in OBJECTIVES if isinstance(saved, dict) and name in saved), None)
    here = run.objective.section
    if there == here:
        return
    said = lambda section: f"a {section}: section" if section else "no objective section (next-token)"  # noqa: E731
    keep = f"its {there}: section" if there else f"no {' or '.join(f'{name}:' for name in OBJECTIVES)} section"
    raise ValueError(f"the checkpoints in {str(out_dir)!r} were trained for another objective ({said(there)} there, "
                     f"{said(here)} here, by its {CONFIG_FILE}): resume with the objective they were trained with "
                     f"({keep}), or start a new train.output_dir")


def check_resume(out_dir, run: RunConfig, log) -> None:
    """A resumed run keeps its model, its adapters' meaning (every `lora:` field but dropout), its
    optimiser (the state its checkpoints hold) and its tokenizer (and its objective: `check_objective`,
    checked first); other changed settings are named."""
    config_path = out_dir / CONFIG_FILE
    if not config_path.exists():
        return
    saved = read_yaml(config_path)
    saved = saved if isinstance(saved, dict) else {}
    model_diff = _differences("model", saved.get("model") or {}, run.model.to_dict())
    if model_diff:
        raise ValueError(f"the checkpoints in {str(out_dir)!r} belong to a different model ({'; '.join(model_diff[:3])}"
                         f", by its {CONFIG_FILE}): start a new train.output_dir or keep the model: section unchanged")
    from modern_jax.training.converters import resume_changes

    lora_diff = resume_changes(saved, run)
    if lora_diff:
        raise ValueError(f"the checkpoints in {str(out_dir)!r} were trained with other lora: settings "
                         f"({'; '.join(lora_diff)}, by its {CONFIG_FILE}): resume with the lora: section they were "
                         f"trained with, or start a new train.output_dir")
    there, here = _optimizer_of(saved.get("train")), _optimizer_of(run.train.to_dict())
    if there != here:
        raise ValueError(f"the checkpoints in {str(out_dir)!r} hold the optimizer state of {there} (by its "
                         f"{CONFIG_FILE}), not of {here}: resume with those settings, or start a new train.output_dir")
    now = run.to_dict()
    flat_saved, flat_now = distributed.flatten(saved), distributed.flatten(now)
    for field in TOKENIZER_FIELDS:
        if field in flat_saved and flat_saved[field] != flat_now.get(field):
            raise ValueError(f"{str(out_dir)!r} was trained with {field}={flat_saved[field]!r} (its tokenizer.json "
                             f"keeps it), not {flat_now.get(field)!r}: a resumed run keeps its tokenizer, so drop "
                             f"the new {field}, or start a new train.output_dir")
    changed = [c for c in _changes(saved, now) if not c.startswith("train.resume ")]
    if changed:
        log(f"resuming with changed settings: {'; '.join(changed)}")


def _optimizer_of(train) -> str:
    """What shapes a run's optimiser state, in words, from its `train:` section (absent fields: the
    defaults): `train.optimizer`, and Muon's `train.muon_groups`."""
    tc = {**TrainConfig().to_dict(), **(train if isinstance(train, dict) else {})}
    groups = f" with train.muon_groups={sorted(tc['muon_groups'])}" if tc["optimizer"] == "muon" else ""
    return f"train.optimizer={tc['optimizer']}{groups}"


def _read_json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def check_files(directory, items=ITEMS) -> str | None:
    """What is wrong with the checkpoint files of `items` under `directory`, or None.

    With `checksums.json` every recorded file is checked (present, size, CRC-32); without
    it (a save cut off before it was sealed, or an older checkpoint) the files Orbax needs
    first are checked to exist and parse."""
    directory = paths.as_path(directory)
    for item in items:
        if not (directory / item).is_dir():
            return f"{item}/ is missing"
    if (directory / CHECKSUMS).is_file():
        recorded = _read_json(directory / CHECKSUMS)
        if not isinstance(recorded, dict) or not isinstance(recorded.get("files"), dict):
            return f"{CHECKSUMS} is damaged"
        for name, (size, crc) in recorded["files"].items():
            if name.split("/")[0] not in items:
                continue
            path = directory / name
            if not path.is_file():
                return f"{name} is missing"
            actual = paths.size(path)
            if actual != size:
                return f"{name} has {actual:,} bytes, {size:,} when it was saved (truncated)" if actual < size else \
                       f"{name} has {actual:,} bytes, {size:,} when it was saved"
            if crc is not None and _crc32(path) != crc:
                return f"{name} has changed since it was saved (its CRC-32 differs)"
        return None
    for item in items:
        required = ["meta/metadata"] if item == "meta" else [f"{item}/_METADATA", f"{item}/manifest.ocdbt"]
        for name in required:
            if not (directory / name).is_file():
                return f"{name} is missing"
        if _read_json(directory / required[0]) is None:
            return f"{required[0]} is not valid JSON (truncated or overwritten)"
    return None


def describe_error(error: Exception, directory) -> str:
    """One line from an Orbax / TensorStore error: the file or array it names, if any."""
    text = str(error)
    first = (text.strip().splitlines() or [type(error).__name__])[0].split(". See full")[0][:160]
    files = re.findall(r'(?:Error reading|Error decoding local file) "([^"]+)"', text)
    paths = re.findall(r"'path': '([^']+)'", text)
    where = files[-1] if files else (paths[0] if paths else None)
    if where is None:
        return f"Orbax could not read it ({first})"
    with contextlib.suppress(ValueError):
        where = pathlib.Path(where).relative_to(pathlib.Path(directory).absolute()).as_posix()
    array = f", array {paths[-1].rstrip('/')}" if len(paths) > 1 else ""
    return f"{where}{array} could not be read ({first})"


def _orbax_read(read, directory):
    """`(read(), None)`, or `(None, what is wrong)` when Orbax fails."""
    try:
        return read(), None
    except Exception as e:  # Orbax / TensorStore raise many kinds; each means a damaged checkpoint
        _quiet_orbax_leftovers()
        return None, describe_error(e, directory)


def _orbax_leftover(unraisable) -> bool:
    """A failed Orbax read leaves reads in flight whose coroutines raise again when they finish
    or are collected, some after its event loop has closed."""
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None and "orbax" in code.co_filename:
        return True
    text = str(unraisable.exc_value)
    return isinstance(unraisable.exc_value, RuntimeError) and ("Event loop is closed" in text or
                                                                "cannot schedule new futures" in text)


def _quiet_orbax_leftovers() -> None:
    """From the first failed read on, keep Orbax's leftovers (and only those) off stderr. They
    are left to finish on their own: collecting them while TensorStore still calls back into
    them can crash the process."""
    hook = sys.unraisablehook
    if getattr(hook, "quiets_orbax", False):
        return

    def quiet(unraisable):
        if not _orbax_leftover(unraisable):
            hook(unraisable)

    quiet.quiets_orbax = True
    sys.unraisablehook = quiet


def _reason(error: BaseException) -> str:
    """The OS's words for a failed write (`No space left on device`), else the error's first line."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.strerror:
            return error.strerror
        text = str(error)
        for words in ("No space left on device", "Read-only file system", "Disk quota exceeded", "File too large",
                      "Permission denied"):
            if words in text:
                return words
        error = error.__cause__ or error.__context__
    return (text.strip().splitlines() or ["unknown error"])[0][:160]


@contextlib.contextmanager
def _orbax_log_quiet():
    """Orbax logs a failed background save's traceback as it fails; the CheckpointWriteError says it once."""
    loggers = [logging.getLogger(name) for name in ("absl", "orbax", "asyncio")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


class _OrbaxErrors(logging.Filter):
    """Orbax's own error logs of a failed background write (its traceback, and asyncio's "exception
    was never retrieved" for the writes it left): the checkpointer raises one CheckpointWriteError
    or CheckpointDamaged naming the step instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if "orbax" in record.pathname:
            return False
        error = record.exc_info[1] if record.exc_info else None
        frames = traceback.extract_tb(error.__traceback__) if error is not None else []
        return not ("never retrieved" in str(record.msg) and any("orbax" in f.filename for f in frames))


def _quiet_orbax_errors() -> None:
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OrbaxErrors) for f in logger.filters):
            logger.addFilter(_OrbaxErrors())


def saved_shapes(item_dir) -> dict[str, tuple] | None:
    """The shape of each array saved in `item_dir` (an Orbax item), by `_name`; None if unreadable."""
    try:
        with _orbax_log_quiet(), ocp.StandardCheckpointer() as checkpointer:
            saved = checkpointer.metadata(paths.as_path(item_dir))
        tree = getattr(getattr(saved, "item_metadata", saved), "tree", None)
    except Exception:  # unreadable metadata: the read itself will name the damaged file
        return None
    if not isinstance(tree, dict):
        return None
    return {_name(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(m, "shape")}


def shape_problem(step_dir, abstract_params, model: ModelConfig | None = None) -> str | None:
    """Why the parameters saved in `step_dir/params` do not fit `abstract_params` (another model
    shape), naming the config fields that differ when the step recorded its model; None if they fit
    (a layer stack saved in another layout fits: `training.layout`)."""
    have = saved_shapes(paths.as_path(step_dir) / "params")
    if have is None:
        return None
    want = {_name(p): tuple(s.shape) for p, s in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
    if want.keys() == have.keys() and all(have[k] == w or same_stack(have[k], w) for k, w in want.items()):
        return None
    meta = _read_json(paths.as_path(step_dir) / "meta" / "metadata") or {}
    if model is not None and isinstance(meta.get("model"), dict):
        ours = model.to_dict()
        fields = [f"saved {k}={v!r}, config {k}={ours.get(k)!r}" for k, v in meta["model"].items()
                  if ours.get(k) != v]
        if fields:
            return (f"holds a model of another shape than this config ({'; '.join(fields[:4])}): use the config it "
                    f"was saved with (its model: section), or another checkpoint")
    shapes = [f"{k} saved {list(have[k])}, expected {list(want[k])}" for k in want if k in have and have[k] != want[k]]
    shapes += [f"{k} expected but not saved" for k in want if k not in have][:2]
    shapes += [f"{k} saved but not in this model" for k in have if k not in want][:2]
    return (f"holds a model of another shape than its config describes ({'; '.join(shapes[:4])}): use the config it "
            f"was saved with, or another checkpoint")


def as_saved(abstract, item_dir):
    """`(what to read, fix)`: `abstract` with each layer stack saved in another layout
    (`training.layout`) read as saved, split over the same mesh axes, and `fix(tree)` reshaping
    those into `abstract`'s layout and shardings."""
    have = saved_shapes(item_dir) or {}
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    reads, moved = [], []
    for path, want in flat:
        saved = have.get(_name(path))
        if saved is None or not same_stack(saved, tuple(want.shape)):
            reads.append(want)
            continue
        moved.append(len(reads))
        reads.append(jax.ShapeDtypeStruct(saved, want.dtype, sharding=_stack_sharding(want, saved)))

    def fix(tree):
        leaves = jax.tree.leaves(tree)
        for i in moved:
            want = flat[i][1]
            leaves[i] = jax.jit(lambda a, shape=want.shape: a.reshape(shape), out_shardings=want.sharding)(leaves[i])
        return jax.tree.unflatten(treedef, leaves)

    return jax.tree.unflatten(treedef, reads), fix


def _stack_sharding(want, saved: tuple):
    """The sharding of a stack saved as `saved` that splits it as `want` (`[N, ...]` or `[R, N / R,
    ...]`) is split: its layers over the same mesh axes where they divide, the other dims alike."""
    sharding = getattr(want, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    shape = tuple(want.shape)
    k_saved, k_want = leading(saved, shape)
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    layers = spec[k_want - 1]  # the split of the last leading dimension, the layers'
    axes = () if layers is None else ((layers,) if isinstance(layers, str) else tuple(layers))
    size = math.prod(sharding.mesh.shape[axis] for axis in axes)
    lead = (None,) * (k_saved - 1) + (layers if saved[k_saved - 1] % size == 0 else None,)
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*lead, *spec[k_want:]))


def _name(path) -> str:
    """`stages/0/blocks/0/mlp/down_proj/kernel` (a list index and its saved string key read alike, an
    optimizer state's field `opt_state/1/0/mu/...` as saved)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


# ----- the run's checkpoints ---------------------------------------------------------


class Checkpointer:
    """Async save every N steps, keep the last K, restore the newest step that is whole.

    The directory is created by the first save, so a run that fails to start leaves none."""

    def __init__(self, directory, keep: int = 3, async_save: bool = True):
        self.directory = paths.absolute(directory)
        _quiet_orbax_leftovers()  # a failed background save reports once, as a CheckpointWriteError
        _quiet_orbax_errors()
        if distributed.is_main() and self.directory.is_dir():
            for partial in ocp.path.step.tmp_checkpoints(self.directory):  # a save cut off by a kill (locally
                paths.remove_tree(self.directory / partial)  # a temporary name, on object storage no commit file)
        distributed.barrier("checkpoints/partial")
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=False, cleanup_tmp_directories=False,
                                                 enable_async_checkpointing=async_save),
            item_names=ITEMS,
        )
        self._unsealed: list[int] = []  # saved steps whose checksums are not written yet

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: dict, meta: dict) -> None:
        self.wait()  # Orbax would wait for the previous save here anyway
        step = int(meta["step"])
        rest = {k: v for k, v in state.items() if k != "params"}
        with self._writing(step):
            self.directory.mkdir(parents=True, exist_ok=True)
            self.manager.save(step, args=ocp.args.Composite(
                params=ocp.args.StandardSave(state["params"]),
                state=ocp.args.StandardSave(rest),
                meta=ocp.args.JsonSave(meta),
            ), force=True)
        self._unsealed.append(step)

    @contextlib.contextmanager
    def _writing(self, step: int):
        """Orbax's errors while writing `step` (synchronous or from its background save) as one
        CheckpointWriteError; its own log of them stays off stderr."""
        with _orbax_log_quiet():
            try:
                yield
            except Exception as e:  # Orbax and TensorStore raise many kinds; asyncio wraps them
                _quiet_orbax_leftovers()
                intact = [s for s in self.all_steps() if s < step]
                before = f"step {intact[-1]} before it is intact" if intact else "no earlier step exists"
                raise CheckpointWriteError(
                    f"checkpoint step {step} could not be written to {self.directory} ({_reason(e)}); {before}: "
                    f"free space there (or lower train.keep_checkpoints) and run the same command to resume"
                ) from None

    def restore(self, abstract_state: dict, step: int, model: ModelConfig | None = None) -> tuple[dict, dict]:
        """Step `step`, or `CheckpointDamaged` naming the file that is wrong; a step of another
        model than `model` (or than `abstract_state`'s shapes) is a ValueError naming the fields."""
        step_dir = self.directory / str(step)
        rest = {k: v for k, v in abstract_state.items() if k != "params"}
        problem = distributed.decide("checkpoint/files", lambda: check_files(step_dir))  # process 0 reads the bytes
        if problem is None:
            other = distributed.decide("checkpoint/shape", lambda: shape_problem(step_dir, abstract_state["params"],
                                                                                  model))
            if other is not None:
                raise ValueError(f"checkpoint step {step} ({step_dir}) {other}")
            params, fix_params = as_saved(abstract_state["params"], step_dir / "params")
            rest, fix_rest = as_saved(rest, step_dir / "state")
            out, problem = _orbax_read(lambda: self.manager.restore(step, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(params),
                state=ocp.args.StandardRestore(rest),
                meta=ocp.args.JsonRestore(),
            )), step_dir)
            problems = [p for p in distributed.gather("checkpoint/restore", problem) if p is not None]
            problem = problems[0] if problems else None
            if problem is None:
                return {"params": fix_params(out["params"]), **fix_rest(out["state"])}, dict(out["meta"])
            if MISMATCH in problem:
                raise ValueError(f"checkpoint step {step} ({step_dir}) holds a state of another structure than this "
                                 "run's (saved by another version of modern_jax, or with settings that shape the "
                                 "state, such as train.clip_norm or grpo.beta, which keeps a reference model when "
                                 "above 0): resume with the settings it was saved with, or start a new "
                                 "train.output_dir")
        raise CheckpointDamaged(f"checkpoint step {step} ({self.directory / str(step)}) is damaged: {problem}")

    def restore_newest(self, abstract_state: dict, log=print, model: ModelConfig | None = None
                       ) -> tuple[int, dict, dict]:
        """The newest step that restores completely. Newer damaged steps are named and moved
        to `damaged_checkpoints/` beside `checkpoints/`; if none restores, nothing is moved."""
        damaged = []
        for step in reversed(self.all_steps()):
            try:
                state, meta = self.restore(abstract_state, step, model)
            except CheckpointDamaged as e:
                damaged.append((step, str(e)))
                log(f"{e}; trying the step before it")
                continue
            for bad, _ in damaged:
                moved = self._set_aside(bad) if distributed.is_main() else None
                log(f"moved damaged step {bad} to {moved} (nothing was deleted)")
            distributed.barrier("checkpoints/set_aside")
            if damaged:
                self.manager.reload()
            return step, state, meta
        raise CheckpointDamaged("no checkpoint in " + str(self.directory) + " restores:\n  " +
                                "\n  ".join(message for _, message in damaged) +
                                "\nnothing was moved or deleted; repair or remove the damaged steps, or train into "
                                "a new train.output_dir")

    def _set_aside(self, step: int):
        target = self.directory.parent / DAMAGED / str(step)
        n = 1
        while target.exists():
            target, n = self.directory.parent / DAMAGED / f"{step}-{n}", n + 1
        target.parent.mkdir(exist_ok=True)
        paths.move(self.directory / str(step), target)
        return target

    def wait(self) -> None:
        """Wait for the save in flight, then seal every finished step with its checksums."""
        unsealed, self._unsealed = self._unsealed, []
        with self._writing(unsealed[-1] if unsealed else -1):
            self.manager.wait_until_finished()
            if distributed.is_main():
                for step in unsealed:
                    if (self.directory / str(step)).is_dir():
                        write_checksums(self.directory / str(step))

    def close(self) -> None:
        try:
            self.wait()
        finally:
            with _orbax_log_quiet():
                self.manager.close()


# ----- reading a model from any checkpoint directory ----------------------------------


def read_config(config_path) -> dict:
    """A checkpoint's config.yaml as `{"model": ..., ...}` (a bare model config is allowed)."""
    config_path = paths.as_path(config_path)
    raw = read_yaml(config_path)
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path} is not a mapping of sections (model:, ...): damaged or not ours")
    raw = raw if "model" in raw else {"model": raw}
    if not isinstance(raw["model"], dict):
        raise ValueError(f"{config_path}: the model: section is not a mapping")
    return raw


def resolve_checkpoint(path) -> tuple:
    """`(directory holding params/, config.yaml, what it is, where else to look)` for a run
    directory (its newest step, complete or not), a step directory, or a converted checkpoint;
    local or on object storage."""
    paths.check_checkpoint_place(path, "checkpoint")
    path = paths.absolute(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is not a directory")
    if (path / CHECKPOINTS).is_dir():  # a run directory: its newest step
        steps = step_numbers(path / CHECKPOINTS)
        if not steps:
            raise ValueError(f"run directory {str(path)!r} holds no checkpoint yet")
        step_dir = path / CHECKPOINTS / str(steps[-1])
        older = f"; the step before it is {steps[-2]}: --checkpoint {step_dir.parent / str(steps[-2])}" \
            if len(steps) > 1 else ""
        return step_dir, path / CONFIG_FILE, f"step {steps[-1]} of {path}", older
    if (path / "params").is_dir():
        for config in (path / CONFIG_FILE, path.parent.parent / CONFIG_FILE):
            if config.is_file():
                what = f"step {path.name} of {path.parent.parent}" if config != path / CONFIG_FILE else str(path)
                return path, config, what, ""
        raise ValueError(f"no {CONFIG_FILE} beside {str(path)!r} (nor in its run directory)")
    raise ValueError(f"{str(path)!r} is not a checkpoint: expected params/ (and config.yaml), or a run directory")


def save_checkpoint(model, out, overwrite: bool = False):
    """Save the Transformer `model` as a converted checkpoint, config.yaml + params/ (Orbax, the
    parameters as a pure dict), under `out`: a new or empty directory, or with `overwrite` a
    converted checkpoint (replaced). `load_params` reads it."""
    import yaml
    from flax import nnx

    from modern_jax.training import outputs

    from modern_jax.multihost import distributed

    out, main = paths.absolute(out), jax.process_index() == 0  # of several processes, each saves its share
    if main:
        outputs.claim(out, outputs.CHECKPOINT, "output directory", overwrite=overwrite)
    with outputs.RunLock(out, "output directory", command="convert").acquire() if main else \
            contextlib.nullcontext(), ocp.StandardCheckpointer() as saver:
        distributed.barrier("save_checkpoint/claimed")
        saver.save(out / "params", nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        saver.wait_until_finished()
        if main:
            (out / CONFIG_FILE).write_text(yaml.safe_dump(model.cfg.to_dict(), sort_keys=False))
    if main:
        write_checksums(out)
    return out


def load_params(path, log=None, mesh=None, **overrides):
    """`(ModelConfig, params pure dict, raw config dict, run directory)` from a checkpoint
    directory; `overrides` replace ModelConfig fields (e.g. `dtype`). `log` is told which
    step is loaded; a damaged one raises `CheckpointDamaged` naming the file, one of another
    model shape than its config a ValueError naming what differs. The parameters land sharded on
    `mesh` by the logical-axis rules (each process reading only its devices' shards), else on the
    first device, or replicated on every device of a launch of several processes."""
    from flax import nnx

    from modern_jax.training.converters import abstract_converted, saved_converter

    directory, config_path, what, elsewhere = resolve_checkpoint(path)
    raw = read_config(config_path)
    cfg = ModelConfig.from_dict({**raw["model"], **overrides})
    if log is not None:
        log(f"loading {what}")
    problem = check_files(directory, items=("params",))
    if problem is None:
        converter = saved_converter(raw)
        _, abstract = abstract_converted(cfg, converter)
        if not converter.saves_base:  # the trained only (convert.load_checkpoint adds the base)
            abstract = nnx.from_flat_state([(path, v) for path, v in nnx.to_flat_state(abstract)
                                            if converter.trains(v)])
        if mesh is not None:
            from modern_jax.sharding import state_shardings

            shardings = nnx.to_pure_dict(state_shardings(abstract, mesh))
        else:
            sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices(), ("all",)), jax.sharding.PartitionSpec()) \
                if jax.process_count() > 1 else jax.sharding.SingleDeviceSharding(jax.devices()[0])
            shardings = jax.tree.map(lambda _: sharding, nnx.to_pure_dict(abstract))
        target = jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                              nnx.to_pure_dict(abstract), shardings)
        other = shape_problem(directory, target, ModelConfig.from_dict(raw["model"]))
        if other is not None:
            raise ValueError(f"checkpoint {what} {other}")

        target, fix = as_saved(target, directory / "params")

        def read():
            with ocp.StandardCheckpointer() as checkpointer:
                return checkpointer.restore(directory / "params", target)

        params, problem = _orbax_read(read, directory)
        if problem is None:
            return cfg, fix(params), raw, config_path.parent
    raise CheckpointDamaged(f"checkpoint {what} is damaged: {problem}{elsewhere}")


def load_reference(path, params: dict) -> dict:
    """The frozen copy of the starting parameters that a run's checkpoints keep beside its parameters
    where its objective compares against one (`StateBuilder.keeps_reference`: DPO, GRPO with a KL
    penalty, full weights), read from the step `load_params(path)` read, placed as `params` are; a
    damaged one raises `CheckpointDamaged` naming the file."""
    directory, _, what, elsewhere = resolve_checkpoint(path)
    problem = check_files(directory, items=("state",))
    if problem is None:
        placed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
        target, fix = as_saved({"reference": placed}, directory / "state")

        def read():
            with ocp.PyTreeCheckpointer() as checkpointer:
                return checkpointer.restore(directory / "state", args=ocp.args.PyTreeRestore(
                    item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                    partial_restore=True))

        state, problem = _orbax_read(read, directory)
        if problem is None:
            return fix(state)["reference"]
    raise CheckpointDamaged(f"checkpoint {what} is damaged: {problem}{elsewhere}")
