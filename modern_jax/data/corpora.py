"""Corpora: documents from the embedded corpus, text files, token files, ArrayRecord, or
records (JSON Lines, Parquet, Hugging Face `datasets`: `modern_jax.data.records`), split
deterministically into train / validation and encoded into one token stream each. Token
shards (`modern_jax.data.shards`), ArrayRecord shards (`modern_jax.data.arrayrecords`) and
the text of Parquet, of Hugging Face datasets and of large JSON Lines (`records.ParquetRecords`,
`HfRecords`, `JsonlRecords`, cut and read as ArrayRecord is: `read_as_records`) are read a window
at a time as batches ask, never whole; the others are read whole at the start.

A document is a text, token ids, or (`data.format: chat`) a conversation, rendered by the
chat template into one text whose assistant turns alone are trained (`modern_jax.data.chat`):
its stream marks each token as a target or not (`TokenStream.trained`), and the rendered
template stands alone, without the `<bos>` / `<eos>` put around other documents.

The embedded corpus needs no download: the standard library's own `.py` sources (test
suites and IDLE left out) and the `pydoc_data` help topics of the running Python, about
11 MB of text in some 700 documents.

Splits are deterministic. With ten documents or more, a document goes to validation when
`crc32(name) % 10_000 < val_fraction * 10_000` (stable when files are added); with fewer,
every document is cut at `1 - val_fraction` of its length, so a single file keeps its
first 90% for training and its last 10% for validation (the classic char-LM split), and
conversations, which are never cut, keep their last `round(val_fraction * n)` (at least one)
for validation.

Every token id read from a file is checked against the tokenizer's vocabulary, and an
empty file or split is an error: a wrong `token_dtype`, a text file read as tokens or a
mismatched tokenizer fails here, by name, instead of training on clamped ids.
"""

from __future__ import annotations

import pathlib
import sysconfig
import zlib
from dataclasses import dataclass

import numpy as np
from etils import epath

from modern_jax.data import chat
from modern_jax.data.arrayrecords import HEAD_RECORDS, RecordStream, open_records
from modern_jax.data.config import EXTENSIONS, RECORD_SOURCES, DataConfig, data_files
from modern_jax.data.records import HfRecords, JsonlRecords, ParquetRecords, record_documents, record_files
from modern_jax.data.shards import HEAD_IDS, Shards, open_file, open_shards, read_index, shard_name, text_hint
from modern_jax.data.tokenizers import ByteTokenizer, CharTokenizer, HFTokenizer, Tokenizer

SKIPPED_STDLIB_DIRS = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
MIN_DOCS_FOR_DOCUMENT_SPLIT = 10


@dataclass
class TokenStream:
    """Documents laid end to end: `tokens[N]` (an array, or `Shards` read a window at a time),
    where each document starts (`doc_starts`, or after each `separator` id), and, for
    conversations, whether each token is a training target (None: every token is)."""

    tokens: np.ndarray | Shards
    doc_starts: np.ndarray | None  # int64, sorted, starts with 0; None: documents end at `separator`
    trained: np.ndarray | None = None  # bool [N]
    separator: int | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_documents(cls, docs: list[np.ndarray], bos_id: int | None = None, eos_id: int | None = None,
                       dtype=np.int32, *, trained: list[np.ndarray] | None = None, what: str = "the corpus split",
                       fix: str = "give it some text") -> TokenStream:
        """`trained`: per document, which of its tokens are targets (then no `<bos>` / `<eos>` are
        added). `what` names the split and `fix` the remedy in the error for a split without tokens."""
        check_tokens(len(docs), sum(map(len, docs)), trained is not None and any(t.any() for t in trained),
                     trained is not None, what, fix)
        pieces, marks = document_pieces(docs, bos_id, eos_id, trained, dtype)
        starts = np.cumsum([0] + [len(piece) for piece in pieces[:-1]], dtype=np.int64)
        return cls(np.concatenate(pieces), starts, np.concatenate(marks) if trained is not None else None)


GOLDEN = (5 ** 0.5 - 1) / 2  # the Kronecker sequence frac((g + 1/2) * GOLDEN) spreads any weights evenly


@dataclass
class Mixture:
    """Sources drawn by weight: row `g` of the run's batches (counted from the first batch) comes
    from the source its point `frac((g + 1/2) * GOLDEN)` falls in on the weights' cumulative
    sum, so every stretch of rows holds each source in proportion to its weight (to within a
    few rows), and row `g`'s source is a function of `g` alone."""

    names: list[str]
    streams: list[TokenStream]
    weights: np.ndarray  # float64, summing to 1

    def __len__(self) -> int:
        return sum(len(stream) for stream in self.streams)

    def sources_of_rows(self, first: int, count: int) -> np.ndarray:
        """The source index of each of rows `first .. first + count`."""
        points = ((np.arange(first, first + count, dtype=np.float64) + 0.5) * GOLDEN) % 1.0
        return np.minimum(np.searchsorted(np.cumsum(self.weights), points, side="right"), len(self.streams) - 1)

    def shares(self, first: int, count: int) -> dict[str, float]:
        """Each source's share of rows (and of tokens: every row is a window) `first .. first + count`."""
        counts = np.bincount(self.sources_of_rows(first, count), minlength=len(self.streams))
        return {name: float(c) / max(count, 1) for name, c in zip(self.names, counts)}


def document_pieces(docs, bos_id, eos_id, trained, dtype) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each non-empty document as it lies in a stream (`<bos> doc <eos>`; a conversation as
    rendered), with its trained marks."""
    pieces, marks = [], []
    for i, doc in enumerate(docs):
        if trained is None and bos_id is not None:
            doc = np.concatenate([[bos_id], doc])
        if trained is None and eos_id is not None:
            doc = np.concatenate([doc, [eos_id]])
        if len(doc) == 0:
            continue
        pieces.append(np.asarray(doc, dtype))
        if trained is not None:
            marks.append(np.asarray(trained[i], bool))
    return pieces, marks


def check_tokens(n_docs: int, n_tokens: int, any_trained: bool, chat: bool, what: str, fix: str) -> None:
    """A split without tokens (`<bos>` / `<eos>` alone are no data), or conversations without an
    assistant token, is an error naming the split and the fix."""
    if not n_tokens:
        raise ValueError(f"{what} is empty: its {n_docs} document(s) hold no tokens: {fix}")
    if chat and not any_trained:
        raise ValueError(f"{what} has no assistant tokens to train on: its {n_docs} conversation(s) hold "
                         f"no assistant turn (role 'assistant') with content: {fix}")


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
        hub = "; for a Hugging Face hub dataset set data.source: hf" if str(path).count("/") == 1 and \
            not str(path).startswith((".", "/", "~")) else ""
        raise ValueError(f"data.path={str(path)!r} does not exist{hub}")
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    docs = []
    for file in files:
        name = str(file.relative_to(path) if path.is_dir() else file.name)
        where = f"data.path={str(path)!r}" + (f" ({name})" if path.is_dir() else "")
        try:
            docs.append((name, file.read_bytes().decode("utf-8")))
        except OSError as e:
            raise ValueError(f"{where} cannot be read ({e.strerror or e}): check its permissions") from None
        except UnicodeDecodeError as e:
            fix = ("for token ids use source: tokens" if path.is_file() else
                   "convert it to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8) or move it out of the directory")
            raise ValueError(f"{where} is not UTF-8 text (byte {e.start}: 0x{e.object[e.start]:02x}): {fix}") \
                from None
    if not docs:
        raise ValueError(f"data.path={str(path)!r} holds no readable text files")
    if not any(text for _, text in docs):
        raise ValueError(f"data.path={str(path)!r} is empty: no text to train on")
    return docs


def arrayrecord_texts(path):
    """`(name, text)` of each UTF-8 text record, read one at a time (what `prepare` tokenizes)."""
    source, _ = open_records(path)
    for i in range(len(source)):
        yield f"record-{i}", _record_text(path, i, source[i])


def _record_text(path, i: int, record: bytes | str) -> str:
    if isinstance(record, str):  # a Parquet row's text
        return record
    try:
        return record.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data.path={str(path)!r} (record-{i}) is not UTF-8 text (byte {e.start}): for "
                         f"token ids set data.record_format: tokens") from None


def read_as_records(cfg: DataConfig) -> bool:
    """Whether `cfg`'s corpus is read a record at a time as batches ask: ArrayRecord, the text of Parquet
    and of a Hugging Face dataset (not streamed), and that of JSON Lines of at least
    `JsonlRecords.FROM_BLOCKS` blocks, uncompressed (gzip cannot seek: `.jsonl.gz` is read whole)."""
    source = cfg.resolved_source
    if source == "jsonl" and cfg.format == "text":
        files = [file for file, _ in record_files(cfg, "jsonl")]
        return not any(file.name.endswith(".gz") for file in files) and \
            sum(JsonlRecords.block_counts(files)) >= JsonlRecords.FROM_BLOCKS
    return source == "arrayrecord" or (source in ("parquet", "hf") and cfg.format == "text" and not cfg.streaming)


def open_sharded_records(cfg: DataConfig) -> tuple[object, list[int]]:
    """`(source, records per file)` of a corpus `read_as_records`: one random-access source of its records,
    of which opening reads the footers or sizes alone (`data.max_documents`: the first ones)."""
    if cfg.resolved_source in ("parquet", "jsonl", "hf"):
        source = {"parquet": ParquetRecords, "jsonl": JsonlRecords, "hf": HfRecords}[cfg.resolved_source](cfg)
        counts = source.counts
    else:
        source, counts = open_records(cfg.path)
    if cfg.max_documents is not None and cfg.max_documents < len(source):
        source, counts = First(source, cfg.max_documents), _first_counts(counts, cfg.max_documents)
    return source, counts


class First:
    """The first `n` records of a source."""

    def __init__(self, source, n: int):
        self.source, self.n = source, n
        if hasattr(source, "where"):  # records named as the source names them
            self.where = source.where

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.source[i]


def _first_counts(counts: list[int], n: int) -> list[int]:
    out = []
    for count in counts:
        out.append(min(count, n - sum(out)))
    return [c for c in out if c] or [0]


def _record_splits(cfg: DataConfig, tokenizer: Tokenizer | None, vocab_size: int | None,
                   shared: pathlib.Path | None) -> tuple[Tokenizer, RecordStream, RecordStream]:
    """The records of a corpus `read_as_records` cut at `1 - val_fraction` into two `RecordStream`s, read
    as batches ask (`modern_jax.data.arrayrecords`); a tokenizer built from the text (char, BPE) reads it
    once."""
    source, counts = open_sharded_records(cfg)
    n, where = len(source), _where(cfg, cfg.resolved_source)
    if n < 2:
        raise ValueError(f"{where} holds {n} record{'s' if n != 1 else ''}: a training and a validation split "
                         "need two or more")
    cut = min(max(1, int(n * (1.0 - cfg.val_fraction))), n - 1)
    if tokenizer is None and cfg.record_format == "tokens":
        tokenizer = load_tokenizer_for_tokens(cfg)
    if tokenizer is None:
        def texts(lo, hi):
            for i in range(lo, hi):
                record = source[i]
                yield from record if isinstance(record, list) else [_record_text(cfg.path, i, record)]

        tokenizer = _made_tokenizer(cfg, lambda: texts(0, cut), lambda: texts(0, n), vocab_size, shared)

    decode = _record_decoder(cfg, tokenizer, where, source)
    _check_heads(source, counts, decode, where)
    dtype = _stream_dtype(tokenizer.vocab_size)
    return (tokenizer, RecordStream(source, 0, cut, decode, tokenizer.bos_id, tokenizer.eos_id, dtype),
            RecordStream(source, cut, n, decode, tokenizer.bos_id, tokenizer.eos_id, dtype))


def _record_decoder(cfg: DataConfig, tokenizer: Tokenizer, where: str, source=None):
    """`(i, record) -> ids` of record `i` (named by the source's `where(i)`, if it has one, else its
    number): its token ids, or its text encoded (a list of texts, a JSON Lines block: each); checked."""
    name = getattr(source, "where", lambda i: f"{where} (record-{i})")
    tokens = cfg.record_format == "tokens" and cfg.resolved_source == "arrayrecord"

    def decode(i, record):
        if tokens:
            if len(record) % np.dtype(cfg.token_dtype).itemsize:
                raise ValueError(f"{name(i)}: {len(record)} bytes are not a whole number of "
                                 f"data.token_dtype={cfg.token_dtype} ids: set data.token_dtype to the dtype that "
                                 "wrote them")
            ids = np.frombuffer(record, cfg.token_dtype)
            check_token_ids(ids, tokenizer.vocab_size, name(i), cfg, record)
            return ids
        try:
            if isinstance(record, list):
                return [tokenizer.encode(text) for text in record]
            return tokenizer.encode(_record_text(cfg.path, i, record))
        except ValueError as e:  # a character the tokenizer has no id for
            raise ValueError(f"{name(i)}: {e}") from None
    return decode


def _check_heads(source, counts: list[int], decode, where: str) -> None:
    """The first `HEAD_RECORDS` records of each shard (a source's `head`, if it has one) decoded and
    checked, so that a wrong dtype or tokenizer fails before any step; a corpus read whole that way must
    hold some ids."""
    firsts, head = np.cumsum([0] + counts[:-1]), getattr(source, "head", HEAD_RECORDS)
    heads = [int(first) + i for first, count in zip(firsts, counts) for i in range(min(count, head))]
    decoded = [decode(i, source[i]) for i in heads]
    raw = sum(sum(map(len, ids)) if isinstance(ids, list) else len(ids) for ids in decoded)
    if len(heads) == len(source):
        check_tokens(len(heads), raw, False, False, where, "give it records with data")


def split_documents(docs: list, val_fraction: float, whole: bool = False) -> tuple[list, list]:
    """Deterministic train / validation split of (name, content) documents (module docstring).
    `whole` (conversations, which cannot be cut): with fewer than ten documents, the last
    `round(val_fraction * n)` (at least one) go to validation."""
    if len(docs) >= MIN_DOCS_FOR_DOCUMENT_SPLIT:
        threshold = val_fraction * 10_000
        val = [d for d in docs if zlib.crc32(d[0].encode()) % 10_000 < threshold]
        train = [d for d in docs if zlib.crc32(d[0].encode()) % 10_000 >= threshold]
        if train and val:
            return train, val
    if whole:
        if len(docs) < 2:
            raise ValueError(f"{len(docs)} conversation: a training and a validation split need two or more")
        n_val = min(max(1, round(val_fraction * len(docs))), len(docs) - 1)
        return docs[:-n_val], docs[-n_val:]
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


def read_documents(cfg: DataConfig, source: str) -> list[tuple[str, object]]:
    """`(name, content)` of every document of a source read whole (not token files, not
    ArrayRecord): text or conversations (`data.format: chat`)."""
    if cfg.format == "chat" and source not in RECORD_SOURCES:
        raise ValueError(f"data.format='chat' reads conversations from records, but data.path={str(cfg.path)!r} "
                         f"is read as source {source!r}: give .jsonl / .parquet files or a Hugging Face dataset "
                         f"(or set data.source: {' / '.join(RECORD_SOURCES)})")
    if cfg.streaming and source != "hf":
        raise ValueError(f"data.streaming=true streams a Hugging Face dataset, but data.path={str(cfg.path)!r} is "
                         f"read as source {source!r}: set data.source: hf, or data.streaming: false")
    if source == "embedded":
        return embedded_documents()
    if source == "text":
        if cfg.source == "auto" and pathlib.Path(cfg.path).is_dir():
            _refuse_mixed_records(pathlib.Path(cfg.path))
        return text_documents(cfg.path)
    return record_documents(cfg, source)


def _refuse_mixed_records(directory: pathlib.Path) -> None:
    """A directory read as text by `source: auto` that holds record files among others: their JSON
    syntax and every field would become training text, so say how to read them."""
    for source, extensions in EXTENSIONS.items():
        found = data_files(directory, extensions)
        if found:
            raise ValueError(f"data.path={str(directory)!r} holds {source} files ({found[0].name}, ...) among "
                             f"other files, so source: auto cannot tell how to read it: set data.source: {source} "
                             f"to read the {source} files alone, or data.source: text to read every file as text")


def chat_template(cfg: DataConfig, tokenizer: Tokenizer | None) -> str:
    """`data.chat_template` (a file), else the tokenizer's, else the built-in template."""
    if cfg.chat_template:
        path = pathlib.Path(cfg.chat_template)
        if not path.is_file():
            raise ValueError(f"data.chat_template={cfg.chat_template!r} does not exist: give a Jinja template file")
        return path.read_text(encoding="utf-8")
    if tokenizer is not None and tokenizer.chat_template:
        return tokenizer.chat_template
    return chat.BUILTIN_TEMPLATE


def _render_conversations(cfg: DataConfig, docs, tokenizer: Tokenizer | None):
    """`(template, {name: (text, trained spans)})` of every conversation, with the `where` of errors."""
    template = chat_template(cfg, tokenizer)
    special = tokenizer.special_tokens if tokenizer is not None else {}
    rendered = {}
    for name, messages in docs:
        where = f"data.path={str(cfg.path)!r} ({name})"
        rendered[name] = chat.render(chat.check_messages(messages, where, cfg.messages_field), template, special,
                                     where)
    return template, rendered


def _encoder(tokenizer: Tokenizer, rendered: dict | None):
    """`(name, content) -> (ids, trained or None)`."""
    def encode(name, content):
        if rendered is not None:
            text, spans = rendered[name]
            ids, start, end = tokenizer.encode_offsets(text)
            return ids, chat.trained_tokens(start, end, spans, len(text))
        return tokenizer.encode(content), None
    return encode


def _stream(cfg: DataConfig, docs, encode, tokenizer: Tokenizer, what: str, fix: str) -> TokenStream:
    encoded = []
    for name, content in docs:
        try:
            encoded.append(encode(name, content))
        except ValueError as e:  # a character the tokenizer has no id for
            raise ValueError(f"{what} ({name}): {e}") from None
    chat_marks = [t for _, t in encoded] if cfg.format == "chat" else None
    return TokenStream.from_documents([ids for ids, _ in encoded], tokenizer.bos_id, tokenizer.eos_id,
                                      _stream_dtype(tokenizer.vocab_size), trained=chat_marks, what=what, fix=fix)


def _share(docs, part: int, parts: int) -> slice:
    """The documents of `part` of `parts`: contiguous, of about equal size, the same on every process."""
    sizes = np.cumsum([len(content) if hasattr(content, "__len__") else 1 for _, content in docs], dtype=np.float64)
    total = sizes[-1] if len(sizes) else 0.0
    bounds = [0] + [int(np.searchsorted(sizes, total * k / parts, side="left")) + 1 for k in range(1, parts)]
    bounds = [min(b, len(docs)) for b in bounds] + [len(docs)]
    return slice(bounds[part], max(bounds[part], bounds[part + 1]))


def _shared_stream(cfg: DataConfig, docs, encode, tokenizer: Tokenizer, what: str, fix: str,
                   directory: pathlib.Path, split: str) -> TokenStream:
    """The stream of `docs` built by the processes of a launch together: each encodes its
    share of the documents (`_share`) and writes it at its offset into one file per array
    under `directory` (on the run's shared file system); every process then maps the files,
    so it holds in memory only the windows it reads. The stream is the one `_stream` makes."""
    from modern_jax.multihost import distributed

    chat = cfg.format == "chat"
    dtype = _stream_dtype(tokenizer.vocab_size)
    mine = docs[_share(docs, distributed.index(), distributed.count())]
    encoded = [encode(name, content) for name, content in mine]
    pieces, marks = document_pieces([ids for ids, _ in encoded], tokenizer.bos_id, tokenizer.eos_id,
                                    [t for _, t in encoded] if chat else None, dtype)
    counts = distributed.gather(f"data/{split}", {"raw": sum(len(ids) for ids, _ in encoded),
                                                  "tokens": sum(map(len, pieces)), "docs": len(pieces),
                                                  "trained": bool(chat and any(m.any() for m in marks))})
    check_tokens(len(docs), sum(c["raw"] for c in counts), any(c["trained"] for c in counts), chat, what, fix)
    n_tokens, n_docs = sum(c["tokens"] for c in counts), sum(c["docs"] for c in counts)
    me = distributed.index()
    token_at = sum(c["tokens"] for c in counts[:me])
    doc_at = sum(c["docs"] for c in counts[:me])
    files = {"tokens": (directory / f"{split}.tokens", dtype, n_tokens),
             "starts": (directory / f"{split}.starts", np.int64, n_docs)}
    if chat:
        files["trained"] = (directory / f"{split}.trained", np.bool_, n_tokens)
    if distributed.is_main():
        directory.mkdir(parents=True, exist_ok=True)
        for path, kind, n in files.values():
            np.memmap(path, kind, "w+", shape=(n,)).flush()
    distributed.barrier(f"data/{split}/files")
    local_starts = np.cumsum([0] + [len(p) for p in pieces[:-1]], dtype=np.int64) + token_at
    mine_arrays = {"tokens": (token_at, pieces), "starts": (doc_at, [local_starts] if pieces else []),
                   "trained": (token_at, marks)}
    for name, (path, kind, n) in files.items():
        at, parts = mine_arrays[name]
        if parts:
            out = np.memmap(path, kind, "r+", shape=(n,))
            out[at:at + sum(map(len, parts))] = np.concatenate(parts)
            out.flush()
            del out
    distributed.barrier(f"data/{split}/written")
    read = {name: np.memmap(path, kind, "r", shape=(n,)) for name, (path, kind, n) in files.items()}
    return TokenStream(read["tokens"], np.asarray(read["starts"]), read.get("trained"))


def _where(cfg: DataConfig, source: str) -> str:
    return "the embedded corpus" if source == "embedded" else f"data.path={str(cfg.path)!r}"


def load_splits(cfg: DataConfig, tokenizer: Tokenizer | None = None, vocab_size: int | None = None,
                shared: pathlib.Path | None = None) -> tuple[Tokenizer, TokenStream, TokenStream]:
    """(tokenizer, train stream, validation stream) for the `data:` config.

    `tokenizer`: reuse a saved one (resuming, evaluating); otherwise it is built here (the
    char vocabulary from the whole corpus, a BPE from the training split, conversations as
    the chat template renders them). A chat run's tokenizer carries its template.
    `shared`: in a launch of several processes, a directory they all see, where they build the
    streams together (`_shared_stream`) and process 0 alone builds a tokenizer from the text.
    """
    if cfg.sources is not None:
        return _mixture_splits(cfg, tokenizer, vocab_size, shared)
    source = cfg.resolved_source
    if source == "tokens":
        return _token_file_splits(cfg, tokenizer)
    if read_as_records(cfg):
        return _record_splits(cfg, tokenizer, vocab_size, shared)
    docs = read_documents(cfg, source)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction, whole=cfg.format == "chat")
    where = _where(cfg, source)
    rendered = None
    if tokenizer is None and (cfg.tokenizer_path or cfg.tokenizer == "byte"):
        tokenizer = build_tokenizer(cfg, [], [], vocab_size)  # needs no text
    if cfg.format == "chat":
        template, rendered = _render_conversations(cfg, docs, tokenizer)
    if tokenizer is None:
        def texts(split):  # a conversation as its template renders it
            return [rendered[name][0] if rendered else content for name, content in split]

        tokenizer = _made_tokenizer(cfg, lambda: texts(train_docs), lambda: texts(docs), vocab_size, shared)
    if rendered is not None:
        tokenizer.with_chat(template)

    encode = _encoder(tokenizer, rendered)
    fix = f"give more data or change data.val_fraction={cfg.val_fraction}"
    splits = []
    for split, split_docs, what in (("train", train_docs, "training"), ("val", val_docs, "validation")):
        what = f"the {what} split of {where}"
        splits.append(_stream(cfg, split_docs, encode, tokenizer, what, fix) if shared is None else
                      _shared_stream(cfg, split_docs, encode, tokenizer, what, fix, shared, split))
    return tokenizer, *splits


def _made_tokenizer(cfg: DataConfig, train_texts, all_texts, vocab_size: int | None,
                    shared: pathlib.Path | None) -> Tokenizer:
    """The tokenizer built from the text (`train_texts()`, `all_texts()`); in a launch of several
    processes (`shared`), process 0's, saved there, for every process."""
    def build():
        built = build_tokenizer(cfg, train_texts(), all_texts(), vocab_size)
        if shared is not None:
            shared.mkdir(parents=True, exist_ok=True)
            return str(built.save(shared))
        return built

    if shared is None:
        return build()
    from modern_jax.data.tokenizers import load_tokenizer
    from modern_jax.multihost import distributed

    return load_tokenizer(distributed.decide("data/tokenizer", build))


def _mixture_splits(cfg: DataConfig, tokenizer: Tokenizer | None, vocab_size: int | None,
                    shared: pathlib.Path | None) -> tuple[Tokenizer, Mixture, Mixture]:
    """Each source of `data.sources` read as its own `data.path` (every one with the first's
    tokenizer), split, and mixed by weight."""
    weights = np.asarray([source["weight"] for source in cfg.sources], np.float64)
    splits = []
    for i, (name, source) in enumerate(zip(cfg.source_names, cfg.sources)):
        part = cfg.replace(sources=None, path=source["path"])
        try:
            tokenizer, train, val = load_splits(part, tokenizer, vocab_size, None if shared is None else shared / name)
        except ValueError as e:  # said of the source, whose path the user wrote, not of data.path
            raise ValueError(str(e).replace("data.path=", f"data.sources[{i}].path=")) from None
        splits.append((train, val))
    names = cfg.source_names
    return (tokenizer, Mixture(names, [t for t, _ in splits], weights / weights.sum()),
            Mixture(names, [v for _, v in splits], weights / weights.sum()))


def load_stream(cfg: DataConfig, tokenizer: Tokenizer) -> TokenStream:
    """Every document of `cfg` (no split) as one stream, encoded by `tokenizer` (evaluating a file)."""
    source = cfg.resolved_source
    if source == "tokens":
        raise ValueError(f"data.path={str(cfg.path)!r} is a token file: evaluate reads documents (text, records, "
                         "conversations); evaluate a token file as the run's --split")
    if read_as_records(cfg):  # read as its windows ask
        records, counts = open_sharded_records(cfg)
        decode = _record_decoder(cfg, tokenizer, _where(cfg, source), records)
        _check_heads(records, counts, decode, _where(cfg, source))
        return RecordStream(records, 0, len(records), decode, tokenizer.bos_id, tokenizer.eos_id,
                            _stream_dtype(tokenizer.vocab_size))
    docs = read_documents(cfg, source)
    rendered = _render_conversations(cfg, docs, tokenizer)[1] if cfg.format == "chat" else None
    return _stream(cfg, docs, _encoder(tokenizer, rendered), tokenizer, _where(cfg, source), "give it some data")


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
                     f"the ids, or data.tokenizer_path to the tokenizer that made them{text_hint(head)}")


def _stream_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def _token_file_splits(cfg: DataConfig, tokenizer: Tokenizer | None):
    """Token shards (one file, a directory or glob of them, or a prepared corpus: `shards`),
    cut at `1 - val_fraction` of their ids; documents end at the separator id."""
    index = read_index(cfg.path)
    files, counts, dtype = open_shards(cfg.path, cfg.token_dtype, index)
    if tokenizer is None:
        tokenizer = load_tokenizer_for_tokens(cfg, index)
    cfg = cfg.replace(token_dtype=dtype)
    for file in files:  # the head of each shard: a wrong dtype or tokenizer fails before any step
        with open_file(file, shard_name(file, cfg.path)) as f:
            head = f.read(HEAD_IDS * np.dtype(dtype).itemsize)
        check_token_ids(np.frombuffer(head, dtype), tokenizer.vocab_size, shard_name(file, cfg.path), cfg, head)
    tokens = Shards(files, counts, dtype, cfg.path, tokenizer.vocab_size)
    where = f"data.path={str(cfg.path)!r}"
    if len(tokens) < 4:
        raise ValueError(f"{where} holds fewer than 4 tokens")
    cut = int(len(tokens) * (1.0 - cfg.val_fraction))
    separator = index["separator"] if index is not None else cfg.doc_separator_id

    def stream(lo, hi):
        if hi <= lo:
            name = "training" if lo == 0 else "validation"
            raise ValueError(f"the {name} split of {where} is empty: 0 of its {len(tokens)} tokens with "
                             f"data.val_fraction={cfg.val_fraction}: use a longer file or change val_fraction")
        return TokenStream(tokens.part(lo, hi), None, separator=separator)

    return tokenizer, stream(0, cut), stream(cut, len(tokens))


def load_tokenizer_for_tokens(cfg: DataConfig, index: dict | None = None) -> Tokenizer:
    """The tokenizer of token ids: `data.tokenizer_path`, else a prepared corpus's own, else bytes."""
    from modern_jax.data.tokenizers import load_tokenizer

    if cfg.tokenizer_path:
        return load_tokenizer(cfg.tokenizer_path)
    if index is not None:
        return load_tokenizer(epath.Path(cfg.path) / index["tokenizer"])
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    raise ValueError("a token file needs the tokenizer that made it: set data.tokenizer_path (or tokenizer: byte)")
