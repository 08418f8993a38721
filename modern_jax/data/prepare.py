"""`modern-jax prepare`: a text corpus tokenized once into token shards with their index.

The documents (any `data:` source of text: text files, JSON Lines, Parquet, ArrayRecord,
Hugging Face datasets, a glob or directory of them) are read in their fixed order and cut
into shards of `documents_per_shard` documents: shard `j` holds documents
`[j * D, (j + 1) * D)`, each as `<bos> ids <eos>`, so a shard's bytes depend on the corpus,
the tokenizer and `D` alone. Process `p` of `n` tokenizes the shards `j % n == p` (every
process reads the documents; only its own are tokenized), so 2 processes write the bytes 1
process writes. A shard is written under a hidden name and renamed when whole: a killed run
started again skips the shards already there. The process that finds every shard written
writes `index.json` (shards, ids per shard, dtype, separator, tokenizer; the same bytes
whichever process writes it); training on the directory reads it (`modern_jax.data.shards`)
and tokenizes nothing.

The output directory is refused when it holds anything `prepare` did not write, or a
`prepare.json` of other settings (another corpus, tokenizer or shard size).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import numpy as np
from etils import epath

from modern_jax import paths
from modern_jax.data.config import DataConfig
from modern_jax.data.corpora import _stream_dtype, document_pieces, embedded_documents, text_documents
from modern_jax.data.records import iter_record_documents
from modern_jax.data.shards import INDEX_FILE, INDEX_FORMAT
from modern_jax.data.tokenizers import TOKENIZER_FILE, ByteTokenizer, Tokenizer, load_tokenizer

SETTINGS_FILE = "prepare.json"
OWN_NAMES = re.compile(rf"^({re.escape(SETTINGS_FILE)}|{re.escape(INDEX_FILE)}|{re.escape(TOKENIZER_FILE)}|"
                       r"shard-\d{5,}\.bin|\..*\.partial-\d+)$")


def shard_file(j: int) -> str:
    return f"shard-{j:05d}.bin"


def prepare(cfg: DataConfig, out, *, documents_per_shard: int, process_id: int = 0, num_processes: int = 1,
            log=print) -> dict | None:
    """Write this process's shards of `cfg`'s corpus under `out`; the index (returned) when
    every shard is written, else None."""
    source = cfg.resolved_source
    if source == "tokens" or cfg.format == "chat" or (source == "arrayrecord" and cfg.record_format != "text"):
        raise ValueError(f"data.path={str(cfg.path)!r}: prepare tokenizes text documents (source {source!r}, "
                         f"format {cfg.format!r} is not): token ids train as they are")
    tokenizer = _tokenizer(cfg)
    if tokenizer.eos_id is None:
        raise ValueError(f"data.tokenizer_path={cfg.tokenizer_path!r} has no <eos> token to end each document "
                         "with: give a tokenizer that has one")
    out = epath.Path(out)
    settings = {"data": {k: v for k, v in cfg.to_dict().items() if k not in ("num_threads", "prefetch",
                                                                              "val_fraction")},
                "documents_per_shard": documents_per_shard, "vocab_size": tokenizer.vocab_size}
    _claim(out, settings)
    if not (out / TOKENIZER_FILE).exists():
        paths.write_bytes(out / TOKENIZER_FILE, json.dumps(tokenizer.to_json()).encode())
    dtype = _stream_dtype(tokenizer.vocab_size)
    n_shards = n_written = 0
    for j, docs in enumerate(_chunks(_documents(cfg, source), documents_per_shard, process_id, num_processes)):
        n_shards = j + 1
        if docs is None or (out / shard_file(j)).exists():
            continue
        ids = []
        for name, text in docs:
            try:
                ids.append(tokenizer.encode(text))
            except ValueError as e:  # a character the tokenizer has no id for
                raise ValueError(f"data.path={str(cfg.path)!r} ({name}): {e}") from None
        pieces, _ = document_pieces(ids, tokenizer.bos_id, tokenizer.eos_id, None, dtype)
        paths.write_bytes(out / shard_file(j), np.concatenate(pieces).tobytes() if pieces else b"")
        n_written += 1
    log(f"prepare: process {process_id} of {num_processes} wrote {n_written} shard(s) of {n_shards}")
    if not n_shards:
        raise ValueError(f"data.path={str(cfg.path)!r} holds no documents")
    if not all((out / shard_file(j)).exists() for j in range(n_shards)):
        return None  # another process writes the rest, and the index
    itemsize = np.dtype(dtype).itemsize
    shards = [{"file": shard_file(j), "tokens": (out / shard_file(j)).stat().length // itemsize}
              for j in range(n_shards)]
    index = {"format": INDEX_FORMAT, "dtype": np.dtype(dtype).name, "separator": tokenizer.eos_id,
             "tokenizer": TOKENIZER_FILE, "tokens": sum(s["tokens"] for s in shards),
             "shards": [s for s in shards if s["tokens"]]}
    paths.write_bytes(out / INDEX_FILE, json.dumps(index, indent=1, sort_keys=True).encode())
    log(f"prepare: {index['tokens']:,} tokens in {len(index['shards'])} shard(s): {out / INDEX_FILE}")
    return index


def _tokenizer(cfg: DataConfig) -> Tokenizer:
    if cfg.tokenizer_path:
        return load_tokenizer(cfg.tokenizer_path)
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    raise ValueError(f"data.tokenizer={cfg.tokenizer!r}: prepare needs a tokenizer made before it (every process "
                     "uses the same): set data.tokenizer_path to a tokenizer.json, or data.tokenizer: byte")


def _documents(cfg: DataConfig, source: str) -> Iterator[tuple[str, str]]:
    if source in ("jsonl", "parquet", "hf"):
        return iter_record_documents(cfg, source)
    if source == "embedded":
        return iter(embedded_documents())
    if source == "arrayrecord":
        from modern_jax.data.corpora import arrayrecord_texts

        return arrayrecord_texts(cfg.path)
    return iter(text_documents(cfg.path))


def _chunks(docs, size: int, process_id: int, num_processes: int):
    """The documents cut into lists of `size`; None for the lists another process tokenizes."""
    chunk, j = [], 0
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk if j % num_processes == process_id else None
            chunk, j = [], j + 1
    if chunk:
        yield chunk if j % num_processes == process_id else None


def _claim(out: epath.Path, settings: dict) -> None:
    """Refuse `out` when it holds what prepare did not write, or another run's settings; else
    record the settings (a run started again finds them and resumes)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: give a directory for the shards")
    if out.exists():
        foreign = sorted(p.name for p in out.iterdir() if not OWN_NAMES.match(p.name))
        if foreign:
            raise ValueError(f"--out {out} holds {foreign[0]}, which prepare did not write: give an empty or new "
                             "directory")
        if (out / SETTINGS_FILE).exists():
            before = json.loads((out / SETTINGS_FILE).read_text())
            if before != settings:
                flat = [{**b.get("data", {}), **{k: v for k, v in b.items() if k != "data"}} for b in (before, settings)]
                changed = sorted(k for k in {**flat[0], **flat[1]} if flat[0].get(k) != flat[1].get(k))
                raise ValueError(f"--out {out} was prepared with other settings ({', '.join(changed)}): give a new "
                                 "directory, or the settings it was prepared with")
            return
    out.mkdir(parents=True, exist_ok=True)
    paths.write_bytes(out / SETTINGS_FILE, json.dumps(settings, indent=1, sort_keys=True).encode())

