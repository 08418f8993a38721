"""The `data:` section of a run config: where the text comes from and how it is tokenized."""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from dataclasses import dataclass
from typing import Any

from modern_jax.configfile import check_keys, fail

SOURCES = ("auto", "embedded", "text", "tokens", "arrayrecord", "jsonl", "parquet", "hf")
RECORD_SOURCES = ("jsonl", "parquet", "hf")  # records with named fields
TOKENIZERS = ("byte", "char", "hf")
TOKEN_DTYPES = ("uint16", "uint32")
RECORD_FORMATS = ("text", "tokens")
FORMATS = ("text", "chat")
EXTENSIONS = {"jsonl": (".jsonl", ".jsonl.gz"), "parquet": (".parquet",)}
SAVED_DATASET = ("dataset_dict.json", "state.json")  # what `datasets`' save_to_disk writes beside the data


def source_of_path(path) -> str:
    """What `source: auto` reads at `path`: by extension (a glob: of what it matches), and for a
    directory a corpus written by `modern-jax prepare`, a dataset saved by `save_to_disk`, or
    files that are all token files / all `.jsonl(.gz)` / all `.parquet`; else text."""
    from modern_jax.data.shards import INDEX_FILE, expand, is_glob

    name = str(path)
    if name.endswith(".bin"):
        return "tokens"
    if ".array_record" in name:
        return "arrayrecord"
    for source, extensions in EXTENSIONS.items():
        if name.endswith(extensions):
            return source
    if is_glob(name):
        kinds = {source_of_path(f) for f in expand(name)}
        return kinds.pop() if len(kinds) == 1 else "text"
    directory = pathlib.Path(path)
    if "://" in name or directory.is_dir():
        from etils import epath

        directory = epath.Path(path)
        if (directory / INDEX_FILE).is_file():
            return "tokens"
        if any((directory / marker).is_file() for marker in SAVED_DATASET):
            return "hf"
        kinds = {source_of_path(f) for f in expand(directory)}
        if len(kinds) == 1 and kinds <= {"tokens", "arrayrecord", *EXTENSIONS}:
            return kinds.pop()
    return "text"


def data_files(directory, extensions: tuple[str, ...] = ()) -> list[pathlib.Path]:
    """The files under `directory` (hidden ones left out) ending in one of `extensions` (any: all),
    sorted: the order documents are read in."""
    return sorted(p for p in pathlib.Path(directory).rglob("*") if p.is_file() and not p.name.startswith(".")
                  and (not extensions or p.name.endswith(extensions)))


_fail = functools.partial(fail, "DataConfig")


@dataclass(frozen=True, slots=True)
class DataConfig:
    """Input data. `source: auto` picks from `path` (`source_of_path`): none -> the embedded
    corpus, `*.bin` -> tokens, `*.array_record*` -> arrayrecord, `*.jsonl(.gz)` -> jsonl,
    `*.parquet` -> parquet, a `save_to_disk` directory -> hf, else text."""

    source: str = "auto"
    path: str | None = None  # a file, directory or glob of shards; hf: also a save_to_disk directory or a hub name
    sources: list | None = None  # a mixture, in place of `path`: [{path: ..., weight: ..., name: ...}, ...]
    format: str = "text"  # records: `text` (one document per record) or `chat` (conversations)
    text_field: str = "text"  # format text: the field of each record that holds its text
    messages_field: str = "messages"  # format chat: the field holding the list of {role, content}
    chat_template: str | None = None  # format chat: a .jinja file; default the tokenizer's, else built in
    hf_config: str | None = None  # hf: the dataset's configuration name
    hf_split: str = "train"  # hf: the split of the dataset to read (then split by val_fraction)
    streaming: bool = False  # hf: read records as they stream (with max_documents: a prefix of a large one)
    max_documents: int | None = None  # records: read at most this many (the first, in order)
    tokenizer: str = "byte"
    tokenizer_path: str | None = None  # a tokenizer.json (a run's or Hugging Face's); hf without one trains a BPE
    token_dtype: str = "uint16"  # tokens (and arrayrecord tokens) files
    record_format: str = "text"  # arrayrecord: UTF-8 text documents or token arrays
    doc_separator_id: int | None = None  # tokens files: the id that ends each document
    val_fraction: float = 0.1
    num_threads: int = 1  # grain read threads
    prefetch: int = 4  # batches prepared ahead

    def __post_init__(self):
        for name, choices in (("source", SOURCES), ("tokenizer", TOKENIZERS), ("token_dtype", TOKEN_DTYPES),
                              ("record_format", RECORD_FORMATS)):
            if getattr(self, name) not in choices:
                _fail(name, getattr(self, name), f"expected one of {', '.join(choices)}")
        if self.format not in FORMATS:
            _fail("format", self.format, f"expected one of {', '.join(FORMATS)}")
        if self.sources is not None:
            self._check_sources()
        elif self.source not in ("auto", "embedded") and not self.path:
            _fail("path", self.path, f"source={self.source!r} needs a path (--data PATH)")
        if self.format == "chat" and self.source not in ("auto", *RECORD_SOURCES):
            _fail("format", self.format, f"conversations are records with a {self.messages_field!r} field: use "
                  f"source {', '.join(RECORD_SOURCES)} (source={self.source!r} holds plain text or tokens)")
        for name in ("text_field", "messages_field", "hf_split"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                _fail(name, getattr(self, name), "expected a field name")
        if self.streaming and self.source not in ("auto", "hf"):
            _fail("streaming", self.streaming, "streaming reads a Hugging Face dataset: use source: hf")
        if self.max_documents is not None and (not isinstance(self.max_documents, int) or self.max_documents <= 0):
            _fail("max_documents", self.max_documents, "expected a positive integer or null")
        if self.source == "embedded" and self.path:
            _fail("path", self.path, "the embedded corpus takes no path; use source: auto or text")
        if not 0.0 < self.val_fraction < 1.0:
            _fail("val_fraction", self.val_fraction, "expected a fraction in (0, 1)")
        for name in ("num_threads", "prefetch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                _fail(name, value, "expected a non-negative integer")

    def _check_sources(self) -> None:
        """A mixture: a list of {path, weight[, name]}, weights >= 0 summing to a positive number,
        names (given, or each path's last part) unique."""
        if self.path:
            _fail("sources", "...", f"give data.path={self.path!r} or data.sources (a mixture), not both")
        if not isinstance(self.sources, (list, tuple)) or not self.sources:
            _fail("sources", self.sources, "expected a list of {path: ..., weight: ...}")
        for i, source in enumerate(self.sources):
            if not isinstance(source, dict) or not isinstance(source.get("path"), str) or not source["path"]:
                _fail(f"sources[{i}]", source, "expected {path: ..., weight: ...} with a path")
            unknown = sorted(set(source) - {"path", "weight", "name"})
            if unknown:
                _fail(f"sources[{i}]", source, f"unknown key {unknown[0]!r}: expected path, weight, name")
            weight = source.get("weight")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < float("inf"):
                _fail(f"sources[{i}].weight", weight, "expected a number >= 0")
        total = sum(source["weight"] for source in self.sources)
        if not total > 0:
            _fail("sources", [source["weight"] for source in self.sources],
                  "the weights do not sum to a positive number: give at least one source a weight above 0")
        names = self.source_names
        for name in names:
            if names.count(name) > 1:
                _fail("sources", name, "two sources have this name: give each a distinct name: ...")

    @property
    def source_names(self) -> list[str]:
        """Each mixture source's name: its `name`, else the last part of its path."""
        return [str(s.get("name") or pathlib.PurePosixPath(s["path"].rstrip("/")).name.split(".")[0])
                for s in self.sources or ()]

    @property
    def resolved_source(self) -> str:
        if self.source != "auto":
            return self.source
        if not self.path:
            return "embedded"
        return source_of_path(self.path)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> DataConfig:
        values = dict(values or {})
        check_keys("data", values, [f.name for f in dataclasses.fields(cls)])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> DataConfig:
        return dataclasses.replace(self, **changes)
