"""Token shards: a corpus of token-id files read a window at a time, never whole.

`data.path` names one token file, a directory of them, a glob (`corpus/part-*.bin`), or a
directory that `modern-jax prepare` wrote (its `index.json` lists the shards, their token
counts, the dtype, the separator and the tokenizer). The shards lie end to end as one array
of ids (`Shards`); opening it reads only each shard's size (and the index), so a process's
memory and start-up time do not grow with the corpus. A window is read when a batch asks for
it, by a ranged read of its bytes alone (no memory map, whose read-ahead would count the
pages around each window in the process's memory): a local shard through `pathlib`, one on
object storage (`gs://`, `s3://`) through `etils.epath`. Documents end at the
separator id (`data.doc_separator_id`, a prepared corpus's `<eos>`), found inside each window.

Every id a window reads is checked against the tokenizer's vocabulary, and the head of every
shard when the corpus opens; a shard that is missing, empty, or not a whole number of ids
(truncated) is refused by name before any step.
"""

from __future__ import annotations

import codecs
import json

import numpy as np
from etils import epath

from modern_jax import paths

INDEX_FILE = "index.json"  # what `modern-jax prepare` writes beside its shards
INDEX_FORMAT = "modern-jax token shards"
SHARD_SUFFIX = ".bin"
HEAD_IDS = 65536  # ids of each shard checked when the corpus opens
GLOB_CHARS = "*?["


def is_glob(path) -> bool:
    return any(c in str(path) for c in GLOB_CHARS)


def nothing_at(path, files: str = "files") -> ValueError:
    """The error of a `data.path` that names nothing: a path that does not exist, or a glob matching
    no `files`."""
    if is_glob(path):
        return ValueError(f"data.path={str(path)!r} matches no {files}")
    return ValueError(f"data.path={str(path)!r} does not exist")


def expand(path, suffixes: tuple[str, ...] = ()) -> list[epath.Path]:
    """The files `path` names: itself, the files under it (a directory; hidden ones left out)
    ending in one of `suffixes` (any: all), or a glob's matches; sorted, the corpus's order."""
    if is_glob(path):
        text = str(path)
        cut = text.rfind("/", 0, min(text.index(c) for c in GLOB_CHARS if c in text))
        parent, pattern = epath.Path(text[:cut] if cut >= 0 else "."), text[cut + 1:]
        return sorted(p for p in parent.glob(pattern) if p.is_file())
    path = epath.Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in _under(path) if not suffixes or p.name.endswith(suffixes))
    return []


def _under(directory: epath.Path):
    """The files under `directory`, hidden ones (and hidden folders) left out."""
    for entry in directory.iterdir():
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            yield from _under(entry)
        else:
            yield entry


def shard_name(shard: epath.Path, path) -> str:
    """How an error names `shard` of `data.path`: the path itself, or the path and the shard."""
    where = f"data.path={str(path)!r}"
    return where if str(shard) == str(path) else f"{where} ({shard.name})"


class Shards:
    """Token ids of `files` laid end to end, `[lo, hi)` of them, read a window at a time.

    `counts`: ids per shard. `vocab_size`: every id read must lie below it.
    """

    def __init__(self, files, counts, dtype, path, vocab_size: int, lo: int = 0, hi: int | None = None):
        self.files, self.dtype, self.path, self.vocab_size = list(files), np.dtype(dtype), str(path), vocab_size
        self.offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.lo, self.hi = lo, int(self.offsets[-1]) if hi is None else hi

    def __len__(self) -> int:
        return self.hi - self.lo

    def part(self, lo: int, hi: int) -> Shards:
        """Ids `[lo, hi)` of this view."""
        return Shards(self.files, np.diff(self.offsets), self.dtype, self.path, self.vocab_size, self.lo + lo,
                      self.lo + hi)

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Ids `[lo, hi)` of this view, checked against the vocabulary."""
        lo, hi = lo + self.lo, hi + self.lo
        pieces = []
        for s in range(int(np.searchsorted(self.offsets, lo, "right")) - 1, len(self.files)):
            if self.offsets[s] >= hi:
                break
            a, b = max(lo, self.offsets[s]) - self.offsets[s], min(hi, self.offsets[s + 1]) - self.offsets[s]
            with open_file(self.files[s], shard_name(self.files[s], self.path)) as f:  # a ranged read: no map
                f.seek(int(a) * self.dtype.itemsize)
                ids = np.frombuffer(f.read(int(b - a) * self.dtype.itemsize), self.dtype)
            check_ids(ids, self.vocab_size, shard_name(self.files[s], self.path), int(a))
            pieces.append(ids)
        return np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)

    def __getitem__(self, index):
        """A slice, or an array of indices whose rows are each a run of consecutive ones (windows)."""
        if isinstance(index, slice):
            lo, hi, _ = index.indices(len(self))
            return self.read(lo, max(lo, hi))
        index = np.asarray(index)
        rows = index.reshape(-1, index.shape[-1]) if index.ndim else index.reshape(1, 1)
        out = np.empty(rows.shape, self.dtype)
        for r, row in enumerate(rows):
            lo = int(row.min())
            out[r] = self.read(lo, int(row.max()) + 1)[row - lo]
        return out.reshape(index.shape)

    def __array__(self, dtype=None, copy=None):
        ids = self.read(0, len(self))
        return ids if dtype is None else ids.astype(dtype)


def open_file(file, where: str):
    """`file` opened for reading (a local one through `pathlib`, others through `etils.epath`); an
    error naming `where` when it cannot be."""
    try:
        return paths.as_path(file).open("rb")
    except OSError as e:
        raise ValueError(f"{where} cannot be read ({e.strerror or e}): check its permissions") from None


def check_ids(ids: np.ndarray, vocab_size: int, where: str, first: int = 0) -> None:
    """Every id below `vocab_size`, else a ValueError naming `where` and the position of the worst."""
    if len(ids) and int(ids.max()) >= vocab_size:
        bad = int(ids.max())
        raise ValueError(f"{where}: token id {bad} at position {first + int(np.argmax(ids == bad))} is outside the "
                         f"tokenizer's vocabulary [0, {vocab_size}): set data.token_dtype to the dtype that wrote "
                         f"the ids, or data.tokenizer_path to the tokenizer that made them")


def read_index(directory) -> dict | None:
    """A prepared corpus's index (None: `directory` is no prepared corpus), checked."""
    file = epath.Path(directory) / INDEX_FILE
    if is_glob(directory) or not file.exists():
        return None
    where = f"data.path={str(directory)!r} ({INDEX_FILE})"
    try:
        index = json.loads(file.read_text())
    except (ValueError, OSError) as e:
        raise ValueError(f"{where} cannot be read ({e}): run modern-jax prepare again") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise ValueError(f"{where} is not the index of a prepared corpus (format {INDEX_FORMAT!r})")
    return index


def open_shards(path, token_dtype: str, index: dict | None) -> tuple[list[epath.Path], list[int], str]:
    """`(files, ids per file, dtype)` of the corpus at `path`: the index's shards, each checked
    to be there in full, or the token files `path` names."""
    if index is not None:
        root = epath.Path(path)
        files, dtype = [root / s["file"] for s in index["shards"]], index["dtype"]
        expected = [int(s["tokens"]) for s in index["shards"]]
    else:
        files, dtype = expand(path, (SHARD_SUFFIX,)), token_dtype
        expected = None
        if not files:
            raise nothing_at(path)
    itemsize, counts = np.dtype(dtype).itemsize, []
    for i, file in enumerate(files):
        where = shard_name(file, path)
        if not file.exists():
            raise ValueError(f"{where} is missing: the corpus's {INDEX_FILE} lists it; run modern-jax prepare "
                             "again to write it")
        size = file.stat().length
        if size == 0:
            raise ValueError(f"{where} is empty: no tokens")
        if size % itemsize:
            raise ValueError(f"{where} holds {size} bytes, not a whole number of data.token_dtype={dtype} ids "
                             f"({itemsize} bytes each): set data.token_dtype to the dtype that wrote it"
                             f"{_text_hint(file)}")
        if expected is not None and size != expected[i] * itemsize:
            raise ValueError(f"{where} is truncated: {size // itemsize} of the {expected[i]} ids its "
                             f"{INDEX_FILE} lists; run modern-jax prepare again to write it")
        counts.append(size // itemsize)
    return files, counts, dtype


def text_hint(head: bytes) -> str:
    """A hint when binary data looks like UTF-8 text (printable, no NULs)."""
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head[:65536])
    except UnicodeDecodeError:
        return ""
    printable = sum(c.isprintable() or c in "\n\r\t" for c in text)
    return "; it looks like UTF-8 text: use source: text" if text and printable >= 0.95 * len(text) else ""


def _text_hint(file) -> str:
    with open_file(file, str(file)) as f:
        return text_hint(f.read(65536))
