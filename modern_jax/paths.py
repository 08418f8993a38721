"""Paths on the local disk and on object storage, through one layer.

A path with a scheme (`gs://bucket/run`, `s3://bucket/corpus`) is on object storage and is
handled by `etils.epath`, the file-system layer Orbax and grain use (`gs://` through `gcsfs`:
`uv sync --extra gcs`; `s3://` through `s3fs`); any other path is a local one (`pathlib`).
The few things object storage does differently are here:

- no directories of their own: a "directory" is a prefix, there once an object lies under it;
- no rename: a move is a copy and a delete;
- no append: a file is written whole;
- writes are atomic per object, so what a local write does by writing a temporary file and
  renaming it over the target is one write there;
- listings are not cached (Orbax writes through TensorStore, around `fsspec`'s cache, so a
  cached listing would miss the steps it saved).
"""

from __future__ import annotations

import os
import pathlib
import shutil

import fsspec.config
from etils import epath

for _protocol in ("gs", "gcs", "s3"):  # `fsspec.filesystem(name)` takes these as defaults
    fsspec.config.conf.setdefault(_protocol, {}).setdefault("use_listings_cache", False)


def is_remote(path) -> bool:
    """True for a path on object storage (`scheme://...`)."""
    return "://" in str(path)


CHECKPOINT_SCHEMES = ("gs://", "s3://")  # object storage Orbax writes checkpoints to (TensorStore's GCS and S3 drivers)


def check_checkpoint_place(path, what: str) -> None:
    """Checkpoints (Orbax) lie on a local disk, in `gs://` or in `s3://`: another object store is
    refused naming `what`, the path and the fix."""
    if is_remote(path) and not str(path).startswith(CHECKPOINT_SCHEMES):
        scheme = str(path).split("://")[0]
        raise ValueError(f"{what}={str(path)!r}: checkpoints are written and read by Orbax, which reaches object "
                         f"storage through TensorStore's GCS and S3 drivers alone, so {scheme}:// holds no run or "
                         f"checkpoint: give a gs:// or s3:// path, or a local one")


def as_path(path):
    """`path` as a `pathlib.Path` (local) or an `epath.Path` (object storage)."""
    return epath.Path(str(path)) if is_remote(path) else pathlib.Path(str(path))


def absolute(path):
    """`path` made absolute (a path on object storage is already)."""
    return as_path(path) if is_remote(path) else pathlib.Path(path).absolute()


def size(path) -> int:
    """The size of a file in bytes."""
    return path.stat().length if is_remote(path) else path.stat().st_size


def mtime(path) -> float:
    """When a file was last written, by the clock of what holds it (seconds since the epoch)."""
    return float(path.stat().mtime) if is_remote(path) else path.stat().st_mtime


def files_under(directory) -> list:
    """Every file under `directory`, at any depth, sorted."""
    if not is_remote(directory):
        return sorted(p for p in pathlib.Path(directory).rglob("*") if p.is_file())
    found = []
    for entry in directory.iterdir():
        found.extend(files_under(entry) if entry.is_dir() else [entry])
    return sorted(found, key=str)


def write_bytes(path, data: bytes) -> None:
    """`path` holds `data` whole or not at all: locally written under a hidden name, then renamed
    over any copy another process wrote at the same time; on object storage one write (atomic there)."""
    if is_remote(path):
        path.write_bytes(data)
        return
    partial = path.parent / f".{path.name}.partial-{os.getpid()}"
    partial.write_bytes(data)
    os.replace(partial, path)


def write_text(path, text: str) -> None:
    """`write_bytes` of `text` as UTF-8."""
    write_bytes(path, text.encode())


def remove_tree(path) -> None:
    """`path` and everything under it (a file alone, if it is one)."""
    if is_remote(path):
        path.rmtree() if path.is_dir() else path.unlink()
    elif path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def move(source, target) -> None:
    """A file or directory moved to `target` (on object storage: copied, then the source removed)."""
    if not is_remote(source) and not is_remote(target):
        shutil.move(str(source), str(target))
        return
    if source.is_dir():
        for file in files_under(source):
            copy(file, as_path(f"{target}/{file.relative_to(source).as_posix()}"))
    else:
        copy(source, target)
    remove_tree(source)


def copy(source, target) -> None:
    """One file copied, between any two places."""
    if not is_remote(target):
        target.parent.mkdir(parents=True, exist_ok=True)
    with source.open("rb") as src, target.open("wb") as out:
        shutil.copyfileobj(src, out, 16 << 20)
