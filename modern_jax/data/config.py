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
    """What `source: auto` reads at `path`: by extension, and for a directory a dataset saved by
    `save_to_disk`, or files that are all `.jsonl(.gz)` / all `.parquet`; else text."""
    name = str(path)
    if name.endswith(".bin"):
        return "tokens"
    if ".array_record" in name:
        return "arrayrecord"
    for source, extensions in EXTENSIONS.items():
        if name.endswith(extensions):
            return source
    directory = pathlib.Path(path)
    if directory.is_dir():
        if any((directory / marker).is_file() for marker in SAVED_DATASET):
            return "hf"
        kinds = {source_of_path(f) for f in data_files(directory)}
        if len(kinds) == 1 and kinds <= set(EXTENSIONS):
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
    path: str | None = None  # hf: a save_to_disk directory, local data files, or a hub name
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
        if self.source not in ("auto", "embedded") and not self.path:
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
