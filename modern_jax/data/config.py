"""The `data:` section of a run config: where the text comes from and how it is tokenized."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from modern_jax.configfile import check_keys, fail

SOURCES = ("auto", "embedded", "text", "tokens", "arrayrecord")
TOKENIZERS = ("byte", "char", "hf")
TOKEN_DTYPES = ("uint16", "uint32")
RECORD_FORMATS = ("text", "tokens")


_fail = functools.partial(fail, "DataConfig")


@dataclass(frozen=True, slots=True)
class DataConfig:
    """Input data. `source: auto` picks from `path`: none -> the embedded corpus, a directory or
    a text file -> text, `*.bin` -> tokens, `*.array_record*` -> arrayrecord."""

    source: str = "auto"
    path: str | None = None
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
        if self.source in ("text", "tokens", "arrayrecord") and not self.path:
            _fail("path", self.path, f"source={self.source!r} needs a path (--data PATH)")
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
        name = str(self.path)
        if name.endswith(".bin"):
            return "tokens"
        if ".array_record" in name:
            return "arrayrecord"
        return "text"

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> DataConfig:
        values = dict(values or {})
        check_keys("data", values, [f.name for f in dataclasses.fields(cls)])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> DataConfig:
        return dataclasses.replace(self, **changes)
