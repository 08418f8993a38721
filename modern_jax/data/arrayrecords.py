"""ArrayRecord corpora, read a record at a time: never whole, never into a list.

`data.path` names one `.array_record` file, a directory of them or a glob of shards. The
shards' records, in file order, are the corpus's documents: UTF-8 text (`data.record_format:
text`, encoded by the tokenizer as it is read) or token ids of `data.token_dtype` (`tokens`).
Opening the corpus reads each shard's footer (its record count) and the head of each shard
(its first `HEAD_RECORDS` records, checked like every record read after them), and nothing
more, so a process's memory and start-up time do not grow with the corpus; a batch reads the
records its own rows start in and the few after them.

The train / validation cut is at `1 - data.val_fraction` of the records. A record lies in the
stream as `<bos> ids <eos>`. A training window starts in a record drawn uniformly and at an
offset drawn uniformly inside it, and runs on through the records after it (each a document
of its own) until it holds `T + 1` tokens: start `s` is record `s // OFFSETS` at
`(s % OFFSETS) / OFFSETS` of its length. An evaluation window starts at the beginning of a
record (all of them, or `max_windows` spread evenly over them: `batches.eval_windows`).
"""

from __future__ import annotations

import numpy as np

OFFSETS = 1 << 16  # the offsets a start can name inside a record
HEAD_RECORDS = 64  # records of each shard read and checked when the corpus opens


def arrayrecord_files(path) -> list[str]:
    """The `.array_record` files `path` names (a file, a directory or a glob), in the corpus's order."""
    from modern_jax.data.shards import expand, nothing_at

    files = [str(f) for f in expand(path) if ".array_record" in f.name]
    if not files:
        raise nothing_at(path, ".array_record files")
    return files


def open_records(path):
    """`(source, records per file)`: the shards as one random-access source of records."""
    import grain

    files = arrayrecord_files(path)
    counts = []
    for file in files:
        try:
            counts.append(len(grain.sources.ArrayRecordDataSource([file])))
        except Exception as e:  # the reader's errors (a damaged footer, not an ArrayRecord file) name no file
            raise ValueError(f"data.path={str(path)!r} ({file}): not a readable ArrayRecord file "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
    # each file named with its count (`file[0:n]`): the source does not read the footers again
    return grain.sources.ArrayRecordDataSource([f"{f}[0:{n}]" for f, n in zip(files, counts)]), counts


class RecordStream:
    """Records `[lo, hi)` of a random-access source (ArrayRecord's; `records.ParquetRecords`,
    `HfRecords`, `JsonlRecords`) as a stream of documents (module docstring).

    `decode(i, record) -> ids` turns record `i` (its global number) into the token ids of its
    document, checked against the vocabulary; `bos_id` / `eos_id` are put around each."""

    unit = "records"

    def __init__(self, source, lo: int, hi: int, decode, bos_id: int | None, eos_id: int | None, dtype):
        self.source, self.lo, self.hi, self.decode = source, lo, hi, decode
        self.bos_id, self.eos_id, self.dtype = bos_id, eos_id, dtype

    def __len__(self) -> int:
        return self.hi - self.lo

    def documents(self, r: int) -> list[np.ndarray]:
        """The documents of record `r` of the stream as they lie in it, each `<bos> ids <eos>` (a
        record is one document, or with a decode that returns a list, several: a JSON Lines block)."""
        i = self.lo + r
        decoded = self.decode(i, self.source[i])
        framed = []
        for ids in decoded if isinstance(decoded, list) else [decoded]:
            pieces = ([[self.bos_id]] if self.bos_id is not None else []) + [ids] + \
                ([[self.eos_id]] if self.eos_id is not None else [])
            framed.append(np.concatenate(pieces).astype(self.dtype))
        return framed

    def window(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """`(tokens, document starts)` of the `n` tokens (fewer at the end of the stream) from
        start `start`: its record from its offset (into the record's tokens), then the records after it."""
        r, k = divmod(int(start), OFFSETS)
        pieces, starts, filled = [], [], 0
        while filled < n and r < len(self):
            docs = self.documents(r)
            skip = k * sum(map(len, docs)) // OFFSETS
            for doc in docs:
                doc, skip = doc[skip:], max(skip - len(doc), 0)
                if len(doc) and filled < n:
                    starts.append(filled)
                    pieces.append(doc[: n - filled])
                    filled += len(pieces[-1])
            r, k = r + 1, 0
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)
        return tokens, np.asarray(starts, np.int64)

    def positions(self) -> int:
        """Training windows start in `[0, positions())`; `positions()` itself is past the end (a
        window of padding)."""
        return len(self) * OFFSETS
