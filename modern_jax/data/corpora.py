"""Corpora: documents from the embedded corpus, text files, token files or ArrayRecord,
split deterministically into train / validation and encoded into one token stream each.

The embedded corpus needs no download: the standard library's own `.py` sources (test
suites and IDLE left out) and the `pydoc_data` help topics of the running Python, about
11 MB of text in some 700 documents.

Splits are deterministic. With ten documents or more, a document goes to validation when
`crc32(name) % 10_000 < val_fraction * 10_000` (stable when files are added); with fewer,
every document is cut at `1 - val_fraction` of its length, so a single file keeps its
first 90% for training and its last 10% for validation (the classic char-LM split).

Every token id read from a file is checked against the tokenizer's vocabulary, and an
empty file or split is an error: a wrong `token_dtype`, a text file read as tokens or a
mismatched tokenizer fails here, by name, instead of training on clamped ids.
"""

from __future__ import annotations

import codecs
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
                       dtype=np.int32, *, what: str = "the corpus split", fix: str = "give it some text"
                       ) -> TokenStream:
        """`what` names the split and `fix` the remedy in the error for a split without tokens."""
        if not any(len(doc) for doc in docs):  # <bos> / <eos> alone are no data
            raise ValueError(f"{what} is empty: its {len(docs)} document(s) hold no tokens: {fix}")
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
    if not any(text for _, text in docs):
        raise ValueError(f"data.path={str(path)!r} is empty: no text to train on")
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

    where = "the embedded corpus" if source == "embedded" else f"data.path={str(cfg.path)!r}"
    if not is_text:
        for name, ids in docs:
            check_token_ids(ids, tokenizer.vocab_size, f"{where} ({name})", cfg, ids.tobytes())

    def stream(split, name):
        ids = [tokenizer.encode(content) if is_text else np.asarray(content, np.int64) for _, content in split]
        return TokenStream.from_documents(ids, tokenizer.bos_id, tokenizer.eos_id, _stream_dtype(tokenizer.vocab_size),
                                          what=f"the {name} split of {where}",
                                          fix=f"give more data or change data.val_fraction={cfg.val_fraction}")

    return tokenizer, stream(train_docs, "training"), stream(val_docs, "validation")


def check_token_ids(ids: np.ndarray, vocab_size: int, where: str, cfg: DataConfig, head: bytes = b"") -> None:
    """Every id in [0, vocab_size), else a ValueError naming `where`, the worst id and its
    position, and the fix; `head` (the data's first bytes) adds a hint when it is text."""
    if not len(ids):
        return
    low, high = int(ids.min()), int(ids.max())
    if low >= 0 and high < vocab_size:
        return
    bad = high if high >= vocab_size else low
    position = int(np.argmax(np.asarray(ids) == bad))
    raise ValueError(f"{where}: token id {bad} at position {position} is outside the tokenizer's vocabulary "
                     f"[0, {vocab_size}): set data.token_dtype (now {cfg.token_dtype}) to the dtype that wrote "
                     f"the ids, or data.tokenizer_path to the tokenizer that made them{_text_hint(head)}")


def _text_hint(head: bytes) -> str:
    """A hint when binary data looks like UTF-8 text (printable, no NULs)."""
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head[:65536])
    except UnicodeDecodeError:
        return ""
    printable = sum(c.isprintable() or c in "\n\r\t" for c in text)
    return "; it looks like UTF-8 text: use source: text" if text and printable >= 0.95 * len(text) else ""


def _stream_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def _token_file_splits(cfg: DataConfig, tokenizer: Tokenizer | None):
    """A flat binary file of token ids; documents end at `doc_separator_id` (if given)."""
    path = pathlib.Path(cfg.path)
    if not path.is_file():
        raise ValueError(f"data.path={str(path)!r} does not exist")
    where, size, itemsize = f"data.path={str(path)!r}", path.stat().st_size, np.dtype(cfg.token_dtype).itemsize
    with path.open("rb") as f:
        head = f.read(65536)
    if size == 0:
        raise ValueError(f"{where} is empty: no tokens")
    if size % itemsize:
        raise ValueError(f"{where} holds {size} bytes, not a whole number of data.token_dtype={cfg.token_dtype} "
                         f"ids ({itemsize} bytes each): set data.token_dtype to the dtype that wrote it"
                         f"{_text_hint(head)}")
    tokens = np.memmap(path, dtype=cfg.token_dtype, mode="r")
    if len(tokens) < 4:
        raise ValueError(f"{where} holds fewer than 4 tokens")
    cut = int(len(tokens) * (1.0 - cfg.val_fraction))
    if tokenizer is None:
        tokenizer = load_tokenizer_for_tokens(cfg)
    check_token_ids(tokens, tokenizer.vocab_size, where, cfg, head)

    def stream(lo, hi):
        if hi <= lo:
            name = "training" if lo == 0 else "validation"
            raise ValueError(f"the {name} split of {where} is empty: 0 of its {len(tokens)} tokens with "
                             f"data.val_fraction={cfg.val_fraction}: use a longer file or change val_fraction")
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
