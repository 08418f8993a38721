"""What a directory holds, and the refusal to write into one that holds something else.

Every command that writes names its kind of directory and claims it first:

| writer                        | writes into                         | with `overwrite`                 |
|-------------------------------|-------------------------------------|----------------------------------|
| `train` (`train.output_dir`)  | a new or empty directory, or its own run (resume) | -                  |
| `convert --from-hf`, `save_checkpoint` | a new or empty directory   | replaces a converted checkpoint  |
| `convert --to-hf`, `to_hf`    | a new or empty directory            | replaces a Hugging Face model    |

Anything else (a training run, one of its step directories, another kind of checkpoint,
files we did not write) is refused with what is there and how to proceed; nothing is
deleted unless `overwrite` is given, and then only a directory of the writer's own kind.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil

import yaml

RUN, STEP, CHECKPOINT, HF, OTHER, EMPTY, MISSING = "run", "step", "checkpoint", "hf", "other", "empty", "missing"
LISTED = 4  # entries named in a description


@dataclasses.dataclass(frozen=True)
class Contents:
    kind: str  # one of the constants above
    description: str  # e.g. "a training run (checkpoints at steps 2, 4)"


def step_numbers(checkpoints: pathlib.Path) -> list[int]:
    """The steps under a run's `checkpoints/` (directories named by their step), ascending."""
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) if checkpoints.is_dir() else []


def _config_sections(path: pathlib.Path) -> dict:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return raw if isinstance(raw, dict) else {}


def describe(path) -> Contents:
    """The kind of `path`: missing, empty, a training run, a step of one, a converted
    checkpoint, a Hugging Face model directory, or other files."""
    path = pathlib.Path(path)
    if not path.exists():
        return Contents(MISSING, "nothing")
    if not path.is_dir():
        return Contents(OTHER, "a file, not a directory")
    names = sorted(p.name for p in path.iterdir())
    if not names:
        return Contents(EMPTY, "nothing")
    entries = set(names)
    sections = _config_sections(path / "config.yaml") if "config.yaml" in entries else {}
    if "checkpoints" in entries or "train" in sections or "metrics.jsonl" in entries:
        steps = step_numbers(path / "checkpoints")
        listed = ", ".join(map(str, steps[-LISTED:]))
        return Contents(RUN, f"a training run ({'checkpoints at steps ' + listed if steps else 'no checkpoint yet'})")
    if "params" in entries and ({"state", "meta", "_CHECKPOINT_METADATA"} & entries or
                                (path.name.isdigit() and path.parent.name == "checkpoints")):
        return Contents(STEP, f"step {path.name} of a training run (params/, state/, meta/)")
    if "params" in entries and "config.yaml" in entries:
        return Contents(CHECKPOINT, "a converted checkpoint (config.yaml and params/)")
    weights = [n for n in names if n.endswith(".safetensors")]
    if "config.json" in entries or weights:
        return Contents(HF, f"a Hugging Face model (config.json and {len(weights)} safetensors files)")
    shown = [n + "/" if (path / n).is_dir() else n for n in names[:LISTED]]
    more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return Contents(OTHER, f"{len(names)} entries that modern-jax did not write ({', '.join(shown)}{more})")


def claim(path, kind: str, what: str, *, overwrite: bool = False, hint: str = "choose a new directory",
          dry_run: bool = False) -> Contents:
    """Check that the writer of `kind` may write into `path` (named `what` in messages);
    with `overwrite`, a directory of the same kind is emptied first (not with `dry_run`,
    which only checks). Returns what was there before (of kind `kind`, missing or empty)."""
    path = pathlib.Path(path)
    contents = describe(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what}={str(path)!r} is a file, not a directory: {hint}")
    if contents.kind in (MISSING, EMPTY):
        return contents
    if contents.kind == kind and kind == RUN:  # the trainer resumes its own run
        return contents
    if contents.kind == kind and overwrite:
        if dry_run:
            return contents
        for child in path.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        return contents
    again = " or pass --overwrite (overwrite=True) to replace it" if contents.kind == kind else ""
    raise ValueError(f"{what}={str(path)!r} already holds {contents.description}; nothing was written: "
                     f"{hint}{again}")
