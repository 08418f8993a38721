"""Corpora: documents from the embedded corpus, text files, token files or ArrayRecord,
split deterministically into train / validation and encoded into one token stream each.

The embedded corpus needs no download: the standard library's own `.py` sources (test
suites and IDLE left out) and the `pydoc_data` help topics of the running Python, about
11 MB of text in some 700 documents.

Splits are deterministic. With ten documents or more, a document goes to validation when
`crc32(name) % 10_000 < val_fraction * 10_000` (stable when files are added); with fewer,
every document is cut at `1 - val_fraction` of its length, so a single file keeps its
first 90% for training and its last 10% for validation (the classic char-LM split).
"""

from __future__ import annotations

import pathlib
import sysconfig
import zlib
from dataclasses import dataclass

import numpy as np

from modern_jax.data.config import DataConfig
from modern_jax.data.tokenizers import ByteTokenizer, CharTokenizer, HFTokenizer, Tokenizer

SKIPPED_STDLIB_DIRS = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
MIN_DOCS_FOR_DOCUMENT_SPLIT = 10


@dataclass
class TokenStream:
    """Documents laid end to end: `tokens[N]`, and the index where each document starts."""

    tokens: np.ndarray
    doc_starts: np.ndarray  # int64, sorted, starts with 0

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_documents(cls, docs: list[np.ndarray], bos_id: int | None = None, eos_id: int | None = None,
                       dtype=np.int32) -> TokenStream:
        pieces, starts, n = [], [], 0
        for doc in docs:
            if bos_id is not None:
                doc = np.concatenate([[bos_id], doc])
            if eos_id is not None:
                doc = np.concatenate([doc, [eos_id]])
            if len(doc) == 0:
                continue
            starts.append(n)
            pieces.append(np.asarray(doc, dtype))
            n += len(doc)
        if not pieces:
            raise ValueError("the corpus split is empty: no tokens")
        return cls(np.concatenate(pieces), np.asarray(starts, np.int64))


# ----- documents -----------------------------------------------------------------


def embedded_documents() -> list[tuple[str, str]]:
    """(name, text) of every standard-library source file and pydoc topic, in a fixed order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIPPED_STDLIB_DIRS.intersection(rel.parts):
            continue
        try:
            docs.append((str(rel), path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    docs.extend((f"pydoc_data/{name}", topics[name]) for name in sorted(topics))
    if not docs:
        raise ValueError(f"no standard-library sources found under {root} for the embedded corpus")
    return docs


def text_documents(path) -> list[tuple[str, str]]:
    """A text file (one document) or every file under a directory (one document each)."""
    path = pathlib.Path(path)
    if not path.exists():
        raise ValueError(f"data.path={str(path)!r} does not exist")
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    docs = []
    for file in files:
        try:
            docs.append((str(file.relative_to(path) if path.is_dir() else file.name), file.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            if path.is_file():
                raise ValueError(f"data.path={str(path)!r} is not UTF-8 text; for token ids use "
                                 "source: tokens") from None
    if not docs:
        raise ValueError(f"data.path={str(path)!r} holds no readable text files")
    return docs


def arrayrecord_documents(path, record_format: str, token_dtype: str):
    """Each record one document: UTF-8 text, or token ids of `token_dtype`."""
    import grain

    files = sorted(str(p) for p in pathlib.Path(path).parent.glob(pathlib.Path(path).name)) or [str(path)]
    if not all(pathlib.Path(f).exists() for f in files):
        raise ValueError(f"data.path={str(path)!r} does not exist")
    source = grain.sources.ArrayRecordDataSource(files)
    docs = []
    for i in range(len(source)):
        record = source[i]
        if record_format == "text":
            docs.append((f"record-{i}", record.decode("utf-8")))
        else:
            docs.append((f"record-{i}", np.frombuffer(record, token_dtype)))
    return docs


def split_documents(docs: list, val_fraction: float) -> tuple[list, list]:
    """Deterministic train / validation split of (name, content) documents (module docstring)."""
    if len(docs) >= MIN_DOCS_FOR_DOCUMENT_SPLIT:
        threshold = val_fraction * 10_000
        val = [d for d in docs if zlib.crc32(d[0].encode()) % 10_000 < threshold]
        train = [d for d in docs if zlib.crc32(d[0].encode()) % 10_000 >= threshold]
        if train and val:
            return train, val
    train, val = [], []
    for name, content in docs:
        cut = int(round(len(content) * (1.0 - val_fraction)))
        train.append((name, content[:cut]))
        val.append((name, content[cut:]))
    return train, val


# ----- tokenized splits ----------------------------------------------------------


def build_tokenizer(cfg: DataConfig, train_texts: list[str], all_texts: list[str], vocab_size: int | None) -> Tokenizer:
    if cfg.tokenizer_path:
        from modern_jax.data.tokenizers import load_tokenizer

        return load_tokenizer(cfg.tokenizer_path)
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer == "char":
        return CharTokenizer.from_texts(all_texts)
    if not vocab_size:
        raise ValueError("training a BPE (data.tokenizer=hf without tokenizer_path) needs model.vocab_size")
    return HFTokenizer.train_bpe(train_texts, vocab_size)


def text_or_embedded_splits(path: str | None, tokenizer: str = "char"):
    """`(tokenizer, train stream, validation stream, source)` of the text file (or directory)
    `path`, or of the embedded corpus when `path` is None or missing (experiments that run
    anywhere); `source` names what was read."""
    found = path is not None and pathlib.Path(path).exists()
    cfg = DataConfig(path=str(path), tokenizer=tokenizer) if found else DataConfig(source="embedded",
                                                                                  tokenizer=tokenizer)
    return *load_splits(cfg), str(path) if found else "embedded corpus"


def load_splits(cfg: DataConfig, tokenizer: Tokenizer | None = None, vocab_size: int | None = None
                ) -> tuple[Tokenizer, TokenStream, TokenStream]:
    """(tokenizer, train stream, validation stream) for the `data:` config.

    `tokenizer`: reuse a saved one (resuming, evaluating); otherwise it is built here (the
    char vocabulary from the whole corpus, a BPE from the training split).
    """
    source = cfg.resolved_source
    if source == "tokens":
        return _token_file_splits(cfg, tokenizer)
    if source == "embedded":
        docs = embedded_documents()
    elif source == "text":
        docs = text_documents(cfg.path)
    else:
        docs = arrayrecord_documents(cfg.path, cfg.record_format, cfg.token_dtype)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)
    is_text = not docs or isinstance(docs[0][1], str)
    if tokenizer is None:
        if not is_text:
            tokenizer = load_tokenizer_for_tokens(cfg)
        else:
            tokenizer = build_tokenizer(cfg, [t for _, t in train_docs], [t for _, t in docs], vocab_size)

    def stream(split):
        ids = [tokenizer.encode(content) if is_text else np.asarray(content, np.int64) for _, content in split]
        return TokenStream.from_documents(ids, tokenizer.bos_id, tokenizer.eos_id, _stream_dtype(tokenizer.vocab_size))

    return tokenizer, stream(train_docs), stream(val_docs)


def _stream_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def _token_file_splits(cfg: DataConfig, tokenizer: Tokenizer | None):
    """A flat binary file of token ids; documents end at `doc_separator_id` (if given)."""
    path = pathlib.Path(cfg.path)
    if not path.is_file():
        raise ValueError(f"data.path={str(path)!r} does not exist")
    tokens = np.memmap(path, dtype=cfg.token_dtype, mode="r")
    if len(tokens) < 4:
        raise ValueError(f"data.path={str(path)!r} holds fewer than 4 tokens")
    cut = int(len(tokens) * (1.0 - cfg.val_fraction))
    if tokenizer is None:
        tokenizer = load_tokenizer_for_tokens(cfg)

    def stream(lo, hi):
        part = np.asarray(tokens[lo:hi])
        starts = [0]
        if cfg.doc_separator_id is not None:
            ends = np.flatnonzero(part == cfg.doc_separator_id) + 1
            starts += [int(e) for e in ends if e < len(part)]
        return TokenStream(part, np.asarray(starts, np.int64))

    return tokenizer, stream(0, cut), stream(cut, len(tokens))


def load_tokenizer_for_tokens(cfg: DataConfig) -> Tokenizer:
    if cfg.tokenizer_path:
        from modern_jax.data.tokenizers import load_tokenizer

        return load_tokenizer(cfg.tokenizer_path)
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    raise ValueError("a token file needs the tokenizer that made it: set data.tokenizer_path (or tokenizer: byte)")
