"""Where a run's batches go on the mesh: `[A, B, T]` arrays (micro-batches, rows, tokens) whose
rows split as `activation_batch` is and whose tokens split over the context axis, laid out
for causal balance (`context_layout`); each process passes the part its devices hold.

    where = BatchPlacement(mesh, rules, train_cfg, context_layout)
    rows, tokens = where.local_slices(train_cfg.batch_size)   # this process's share of a batch
    arrays = where.put(local_batch, rows=train_cfg.batch_size) # global arrays on the mesh
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from modern_jax.sharding import RULES, logical_to_spec, mesh_axes
from modern_jax.sharding.config import layout_order
from modern_jax.sharding.rules import split_size

FIELDS = {"inputs": jnp.int32, "targets": jnp.int32, "positions": jnp.int32, "segment_ids": jnp.int32,
          "weights": jnp.float32}  # what a batch holds (an objective may add to it: `Objective.fields`)


def batch_sharding(mesh: Mesh, rules=RULES) -> NamedSharding:
    """Batches `[A, B, T]` (micro-batches, rows, tokens): rows split as `activation_batch` is."""
    return NamedSharding(mesh, logical_to_spec((None, "activation_batch", "activation_length"), rules, mesh))


def rows_sharding(mesh: Mesh, rules, ndim: int, rows_axis: int = 1) -> NamedSharding:
    """An array of `ndim` axes whose axis `rows_axis` holds a batch's rows: the rows split as a
    batch's are (`activation_batch`), the other axes whole."""
    names = [None] * ndim
    names[rows_axis] = "activation_batch"
    return NamedSharding(mesh, logical_to_spec(tuple(names), rules, mesh))


def from_whole(x: np.ndarray, sharding) -> jax.Array:
    """A host array every process holds whole, as the global array of `sharding`."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


class BatchPlacement:
    """The batches of one train config on one mesh: checked to split, described, laid out and placed."""

    def __init__(self, mesh: Mesh, rules, train_cfg, context_layout: str = "two_chunk"):
        _check_divisible("batch_size / grad_accum", train_cfg.batch_size // train_cfg.grad_accum, mesh, rules)
        _check_divisible("eval_batch_size", train_cfg.eval_batch_size, mesh, rules)
        # the devices splitting the sequence (context parallelism) and the order laid over them
        self.context = split_size("activation_length", mesh, rules)
        if train_cfg.seq_len % self.context:
            raise ValueError(f"train.seq_len={train_cfg.seq_len} is not divisible by the mesh's context={self.context} "
                             f"(the devices that split the sequence): make it a multiple of {self.context}, or "
                             f"change context in --mesh (parallel.context)")
        layout_order(train_cfg.seq_len, self.context, context_layout)  # its errors name the fields
        self.cfg, self.context_layout = train_cfg, context_layout
        self.sharding = batch_sharding(mesh, rules)

    def abstract(self, eval_shape: tuple[int, int] | None = None, fields: dict | None = None) -> dict:
        """ShapeDtypeStructs (with shardings) of one step's batch: `[grad_accum, rows, seq_len]` each;
        with `eval_shape` (rows, length), of one evaluation batch `[1, rows, length]`; `fields`: the
        arrays and their dtypes (default `FIELDS`)."""
        A = self.cfg.grad_accum
        shape = (A, self.cfg.batch_size // A, self.cfg.seq_len) if eval_shape is None else (1, *eval_shape)
        return {key: jax.ShapeDtypeStruct(shape, dtype, sharding=self.sharding)
                for key, dtype in (FIELDS if fields is None else fields).items()}

    def width(self, tokens: int) -> int:
        """The width of a batch whose longest row holds `tokens` tokens: the least of `widths()`
        that holds it (a batch pays for its real tokens, not for `seq_len`)."""
        return next(w for w in self.widths() if w >= tokens)

    def widths(self) -> tuple[int, ...]:
        """The widths a batch may take, so that a step compiles for a few: 16, 24, 32, 48, 64, 96 ...
        (powers of two and 1.5 times them), capped at `seq_len`; only `seq_len` where devices split the
        sequence (context parallelism lays out whole windows)."""
        T = self.cfg.seq_len
        if self.context > 1:
            return (T,)
        steps = [w for k in range(4, T.bit_length()) for w in (1 << k, 3 << (k - 1)) if w < T]
        return tuple(sorted(steps)) + (T,)

    def laid_out(self, batch: dict) -> dict:
        """`batch` with its sequences in the order laid over the context axis (`context_layout`):
        positions, segments and weights travel with their tokens, so no number changes."""
        order = layout_order(next(iter(batch.values())).shape[-1], self.context, self.context_layout)
        return batch if order is None else {k: np.asarray(v)[..., order] for k, v in batch.items()}

    def local_slices(self, rows: int, width: int | None = None) -> tuple[slice, slice]:
        """The rows and the (laid-out) token positions of a `[A, rows, width]` batch (None: seq_len)
        that this process's devices hold: everything on one process; a share of them on each of several."""
        shape = (1, rows, self.cfg.seq_len if width is None else width)
        held = self.sharding.addressable_devices_indices_map(shape).values()
        return tuple(_span([index[d] for index in held], shape[d], ("rows", "tokens")[d - 1]) for d in (1, 2))

    def put(self, batch: dict, rows: int | None = None) -> dict:
        """This process's rows (`local_slices(rows)` of a global batch of `rows` rows; None: the
        batch is all of them, one process) as global arrays on the mesh, laid out for the context
        axis; a process whose devices hold part of each sequence passes its part."""
        laid_out = self.laid_out(batch)
        first = next(iter(laid_out.values()))
        rows = first.shape[1] if rows is None else rows
        _, tokens = self.local_slices(rows, first.shape[2])
        shape = (first.shape[0], rows, first.shape[2])
        return {k: jax.make_array_from_process_local_data(self.sharding, np.ascontiguousarray(v[..., tokens]), shape)
                for k, v in laid_out.items()}


def _check_divisible(name: str, rows: int, mesh, rules=RULES) -> None:
    """The batch rows split over the mesh axes of `activation_batch` (each process holds whole shards)."""
    axes = [a for a in mesh_axes("activation_batch", rules) if a in mesh.shape]
    shards = split_size("activation_batch", mesh, rules)
    if rows % shards:
        raise ValueError(f"train.{name} gives {rows} rows, not divisible by the {shards} data shards of the mesh "
                         f"({' x '.join(f'{a}={mesh.shape[a]}' for a in axes)}): make it a multiple of {shards}")


def _span(slices, size: int, what: str) -> slice:
    """One slice covering `slices` (a process's devices' shares of one dimension), which must touch."""
    ranges = sorted({(s.start or 0, size if s.stop is None else s.stop) for s in slices})
    start, stop = ranges[0]
    for lo, hi in ranges[1:]:
        if lo > stop:
            raise ValueError(f"this process's devices hold {what} {ranges} of {size}, which do not touch: lay the "
                             f"mesh out so that each process holds one block of the batch")
        stop = max(stop, hi)
    return slice(start, stop)
