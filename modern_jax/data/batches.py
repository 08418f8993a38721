"""The grain input pipeline: packed windows with segment ids, sharded per host, checkpointable.

A batch is a dict of `[A, B, T]` arrays (the package legend: A gradient-accumulation steps,
B the rows this host feeds, T tokens):

    inputs, targets       int32   targets[t] = the token after inputs[t]
    positions             int32   restart at 0 at each document start (and window start)
    segment_ids           int32   1, 2, ... per document inside the row; 0 on padding
    weights               float32 1 where the target is in the same document as the input
                                  (in a conversation: and is one of the assistant's tokens)

Packing: a window is `T + 1` consecutive tokens of the stream of documents
(`<bos> doc <eos> <bos> doc ...`). Documents that share a row get different segment ids,
so attention never crosses a boundary, and the target that would cross one (a document's
last token predicting the next one's first) has weight 0. A conversation's targets outside
the assistant turns (`TokenStream.trained`) have weight 0 too, wherever its window is cut.

Training batch `i` is a pure function of `(seed, i)`: `A * B` window starts drawn
uniformly from the stream by `numpy.random.default_rng([seed, i])` (the classic random
window sampling of char-LM training; a split of at most T + 1 tokens gives every row the
whole split, with a warning). A process takes the rows `rows` of every accumulation step that
its devices hold (all of them on one process; `BatchPlacement.local_slices` says which), so processes
read disjoint rows that together make the global batch, and the global batch is the same
however many processes share it. The grain iterator's state is its next batch index: saving
it with the checkpoint and restoring it makes a resumed run see exactly the batches the
uninterrupted run sees.
"""

from __future__ import annotations

import warnings

import numpy as np

from modern_jax.data.arrayrecords import OFFSETS
from modern_jax.data.corpora import Mixture, RecordStream, TokenStream

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "weights")
UNBOUNDED = 2**62


def pack_windows(stream: TokenStream, starts: np.ndarray, seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """The windows `stream[start : start + T + 1]` as a packed batch of `[B, T]` arrays, a row
    per start.

    Tokens past the end of the stream are padding: segment 0, weight 0.
    """
    idx_BT = np.asarray(starts, np.int64)[:, None] + np.arange(seq_len + 1)  # T + 1 here: inputs and targets
    valid_BT = idx_BT < len(stream)
    idx_BT = np.minimum(idx_BT, len(stream) - 1)
    read_BT = stream.tokens[idx_BT]
    tokens_BT = np.where(valid_BT, read_BT.astype(np.int32), pad_id)
    if stream.doc_starts is not None:
        doc_BT = stream.doc_starts.searchsorted(idx_BT, side="right") - 1
        doc_start_BT = np.maximum(stream.doc_starts[doc_BT], idx_BT[:, :1])  # a window starts a sequence
    else:  # a document starts after each separator: counted inside the window
        ends_BT = read_BT == stream.separator if stream.separator is not None else np.zeros(idx_BT.shape, bool)
        starts_BT = np.concatenate([np.ones_like(ends_BT[:, :1]), ends_BT[:, :-1]], axis=1)
        doc_BT = np.cumsum(starts_BT, axis=1) - 1
        doc_start_BT = np.maximum.accumulate(np.where(starts_BT, idx_BT, 0), axis=1)
    segment_BT = np.where(valid_BT, doc_BT - doc_BT[:, :1] + 1, 0)
    positions_BT = np.where(valid_BT, idx_BT - doc_start_BT, 0)
    same_doc_BT = (doc_BT[:, :-1] == doc_BT[:, 1:]) & valid_BT[:, 1:]
    if stream.trained is not None:  # a conversation: only the assistant's tokens are targets
        same_doc_BT &= stream.trained[idx_BT[:, 1:]]
    return {
        "inputs": tokens_BT[:, :-1],
        "targets": tokens_BT[:, 1:],
        "positions": positions_BT[:, :-1].astype(np.int32),
        "segment_ids": segment_BT[:, :-1].astype(np.int32),
        "weights": same_doc_BT.astype(np.float32),
    }


def read_windows(stream: TokenStream | RecordStream, starts, seq_len: int) -> dict[str, np.ndarray]:
    """`pack_windows` of either kind of stream: a `RecordStream`'s window is read from its records
    (`RecordStream.window`) and packed as a stream of its own."""
    if isinstance(stream, TokenStream):
        return pack_windows(stream, starts, seq_len)
    rows = []
    for start in starts:
        tokens, doc_starts = stream.window(start, seq_len + 1)
        if not len(tokens):  # past the stream's end: start 1 of a stream of 1 token, all padding
            rows.append(pack_windows(TokenStream(np.zeros(1, np.int32), np.zeros(1, np.int64)), [1], seq_len))
        else:
            rows.append(pack_windows(TokenStream(tokens, doc_starts), [0], seq_len))
    return {k: np.concatenate([row[k] for row in rows]) for k in BATCH_KEYS}


class TrainBatches:
    """Random-access grain source: record `i` is this process's rows of global batch `i`.

    A `Mixture`'s rows come from its sources by weight (`Mixture.sources_of_rows`); source `s`
    draws its starts from `default_rng([seed, i, s])` (source 0, and a single stream, from
    `default_rng([seed, i])`)."""

    def __init__(self, stream: TokenStream | Mixture, seq_len: int, batch_size: int, grad_accum: int = 1,
                 seed: int = 0, rows: slice | None = None):
        if batch_size % grad_accum:
            raise ValueError(f"batch_size={batch_size} is not a multiple of grad_accum={grad_accum}")
        self.mixture = stream if isinstance(stream, Mixture) else None
        self.streams = stream.streams if self.mixture is not None else [stream]
        self.seq_len, self.seed = seq_len, seed
        self.shape = (grad_accum, batch_size // grad_accum)
        self.rows = slice(None) if rows is None else rows
        for stream in self.streams:
            # a token stream with one start only: a window takes T + 1 tokens
            if isinstance(stream, TokenStream) and len(stream) <= seq_len + 1:
                padded = ", padded" if len(stream) <= seq_len else ""
                warnings.warn(f"train.seq_len={seq_len} is as long as the training split ({len(stream):,} tokens): "
                              f"every row of every batch is the whole split from its start{padded}; lower "
                              f"train.seq_len to at most {max(len(stream) - 2, 1):,} for windows at random starts",
                              stacklevel=2)
        self.highs = [max(1, len(stream) - seq_len) if isinstance(stream, TokenStream)  # windows of T + 1 fit below
                      else stream.positions() for stream in self.streams]

    def __len__(self) -> int:
        return UNBOUNDED

    def sources(self, i: int) -> np.ndarray:
        """`[A, B]`: the source of each row of global batch `i`."""
        if self.mixture is None:
            return np.zeros(self.shape, np.int64)
        n = self.shape[0] * self.shape[1]
        return self.mixture.sources_of_rows(int(i) * n, n).reshape(self.shape)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        sources_AB = self.sources(i)[:, self.rows]  # this process's rows: a chunk of B
        out = None
        for s in np.unique(sources_AB):
            key = [self.seed, int(i)] + ([int(s)] if s else [])
            starts_AB = np.random.default_rng(key).integers(0, self.highs[s], size=self.shape)[:, self.rows]
            mine = sources_AB == s
            batch = read_windows(self.streams[s], starts_AB[mine], self.seq_len)
            if out is None:
                out = {k: np.zeros((*sources_AB.shape, self.seq_len), v.dtype) for k, v in batch.items()}
            for k, v in batch.items():
                out[k][mine] = v
        return out


def grain_iterator(source, state: dict | None = None, options=None):
    """A grain iterator over a random-access `source` of batches; `state` (from `.get_state()`)
    resumes it exactly."""
    import grain  # here: the commands that only score or sample (evaluate, generate, harness) never load it

    iterator = iter(grain.MapDataset.source(source).to_iter_dataset(options))
    if state is not None:
        iterator.set_state(state)
    return iterator


def epoch_order(n: int, seed: int, first: int, count: int) -> np.ndarray:
    """Items `first .. first + count` of the run's sequence of `n` items: every item once per
    epoch, each epoch in its own order (`numpy.random.default_rng([seed, epoch]).permutation`)."""
    positions = first + np.arange(count)
    return np.concatenate([np.random.default_rng([seed, e]).permutation(n)[positions[positions // n == e] % n]
                           for e in np.unique(positions // n)])


def spread(items: np.ndarray, most: int | None) -> np.ndarray:
    """`items`, or `most` of them spread evenly over them."""
    if most is None or most >= len(items):
        return items
    return items[np.linspace(0, len(items) - 1, most).round().astype(np.int64)]


def train_iterator(stream: TokenStream, *, seq_len: int, batch_size: int, grad_accum: int = 1, seed: int = 0,
                   rows: slice | None = None, num_threads: int = 1, prefetch: int = 4, state: dict | None = None):
    """A grain iterator of training batches (this process's `rows`); `state` (from `.get_state()`)
    resumes it exactly."""
    import grain

    return grain_iterator(TrainBatches(stream, seq_len, batch_size, grad_accum, seed, rows), state,
                          grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch))


def n_eval_windows(stream: TokenStream | RecordStream, seq_len: int) -> int:
    """How many non-overlapping windows cover the stream (a `RecordStream`: one from each record's start)."""
    if isinstance(stream, RecordStream):
        return len(stream)
    return -(-max(len(stream) - 1, 1) // seq_len)


def eval_windows(stream: TokenStream | RecordStream, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """Starts of the non-overlapping windows that cover the stream (every target once), or
    `max_windows` of them spread evenly over it (a `RecordStream`: one from each record's start)."""
    if isinstance(stream, RecordStream):  # a window from each record's start
        return spread(np.arange(len(stream), dtype=np.int64), max_windows) * OFFSETS
    n = n_eval_windows(stream, seq_len)
    if max_windows is None or max_windows >= n:
        return np.arange(n, dtype=np.int64) * seq_len
    return np.linspace(0, n - 1, max_windows).round().astype(np.int64) * seq_len  # `spread`, without the n starts


class Batches:
    """Batches made as they are read, their number known before (a progress bar's total)."""

    def __init__(self, count: int, batches):
        self.count, self._batches = count, batches

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        return iter(self._batches)


def eval_batches(stream: TokenStream, *, seq_len: int, batch_size: int, max_windows: int | None = None,
                 rows: slice | None = None) -> Batches:
    """Batches `[1, R, T]` of evaluation windows (this process's `rows` of each); the last is
    filled up with padding rows."""
    starts = eval_windows(stream, seq_len, max_windows)
    n_batches = -(-len(starts) // batch_size)
    end = stream.positions() if isinstance(stream, RecordStream) else len(stream)
    padded = np.full(n_batches * batch_size, end, np.int64)  # a start past the end: all padding
    padded[: len(starts)] = starts
    rows = slice(None) if rows is None else rows

    def make():
        for b in range(n_batches):
            batch = read_windows(stream, padded[b * batch_size : (b + 1) * batch_size][rows], seq_len)
            yield {k: v[None] for k, v in batch.items()}

    return Batches(n_batches, make())
