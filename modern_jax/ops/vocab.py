"""The vocabulary: the output head, and the table split across the mesh (embedding lookup
and loss without full logits).

Letters (the package legend): B batch, T length, D model, V vocabulary rows (all of them, or a
slice of them).

`Head` is the one output head, over the model's own parameters (the tied embedding or
`lm_head`): `logits = softcap(h w^T + b)` in float32 for the rows `[first, first + V)` it
is given, with padding rows (ids >= the real vocabulary) held at MASK_VALUE.
`Transformer.logits` runs it over the whole vocabulary, the chunked loss over chunks of
each device's rows.

With `vocab` mapped to mesh axes of size > 1 (`tensor` by default), each device holds
`V / TP` rows of the embedding table and of the output head (Megatron's vocab-parallel
layout), and these two `shard_map`s keep it that way:

- `lookup`: each device looks up the tokens that fall in its rows (zeros for the rest)
  and a psum over the vocab axes adds the partial rows, so `[B, T, D]` crosses the
  wire and the table is never gathered; under sequence parallelism (the residual stream
  split along T over the vocab axes too) the psum is a reduce-scatter along T;
- `split_parts`: each device makes the logits of its own rows (in vocabulary chunks),
  their max, sum of exp and the target's logit where it owns the target; a pmax and
  psums combine them into the global logsumexp, so `[B, T]` numbers cross the wire and
  the `[B, T, V]` logits exist only as `[B, T, V / TP]` pieces, one chunk at a time.

Both keep the sequence split over the context axis (`activation_length`) as it comes.

Without an active mesh, or when the mesh does not split the vocabulary, both are the
plain single-device computation.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from modern_jax.kernels.masks import MASK_VALUE, softcap
from modern_jax.sharding.context import active
from modern_jax.sharding.rules import axis_position, live_axes


@dataclasses.dataclass(frozen=True)
class Head:
    """The output head: rows `w[V, D]` of the output matrix (the tied embedding, or `lm_head.kernel`
    transposed), their bias or None, the final soft-cap or None, and the real vocabulary size:
    ids at or past `vocab_size` are padding and never predicted (a slice may lower it to mask
    rows past its end). `replace(w_VD=rows, b_V=bias)` gives the head of a slice of rows."""

    w_VD: jax.Array
    b_V: jax.Array | None
    softcap: float | None
    vocab_size: int | jax.Array

    def replace(self, **fields) -> Head:
        return dataclasses.replace(self, **fields)

    def real(self, first=0):
        """[V] True on the rows whose global ids `first .. first + V` are real vocabulary entries."""
        return first + jnp.arange(self.w_VD.shape[0]) < self.vocab_size

    @jax.named_scope("head")
    def logits(self, h_BTD, first=0, dtype=jnp.float32):
        """`softcap(h w^T + b)` [B, T, V] for this head's V rows, whose global ids start at `first`,
        accumulated in float32 and written in `dtype`; padding rows hold MASK_VALUE."""
        z_BTV = jnp.einsum("BTD,VD->BTV", h_BTD, self.w_VD.astype(h_BTD.dtype), preferred_element_type=dtype)
        if self.b_V is not None:
            z_BTV = z_BTV + self.b_V.astype(dtype)[None, None, :]
        z_BTV = softcap(z_BTV, self.softcap)
        if isinstance(first, int) and isinstance(self.vocab_size, int) and first + z_BTV.shape[-1] <= self.vocab_size:
            return z_BTV  # statically no padding row
        return jnp.where(self.real(first)[None, None, :], z_BTV, MASK_VALUE)


def _split(n_rows: int, batch: int, length: int):
    """`(mesh, rules, vocab axes, batch axes, length axes)` when the active mesh splits `n_rows`
    vocabulary rows, else None; the batch and length axes leave out the vocab axes."""
    state = active()
    if state is None:
        return None
    mesh, rules = state
    vocab = live_axes("vocab", rules, mesh, n_rows)
    if vocab is None:
        return None
    others = lambda name, size: _others(name, size, vocab, mesh, rules)  # noqa: E731
    return mesh, rules, vocab, others("activation_batch", batch), others("activation_length", length)


def _others(name: str, size: int, vocab, mesh, rules):
    """The live mesh axes of the activation dimension `name`, less the vocab axes (None: none)."""
    axes = tuple(a for a in (live_axes(name, rules, mesh, size) or ()) if a not in vocab)
    return axes if axes and size % math.prod(mesh.shape[a] for a in axes) == 0 else None


def _first_row(vocab_axes, rows_per_device: int):
    """The global id of this device's first vocabulary row."""
    return axis_position(vocab_axes) * rows_per_device


def lookup(table_VD, tokens_BT):
    """`table[tokens]` -> `[B, T, D]`, vocab-parallel when the mesh splits the table's rows."""
    B, T = tokens_BT.shape
    split = _split(table_VD.shape[0], B, T)
    if split is None:
        return table_VD[tokens_BT]
    mesh, rules, vocab, batch, length = split
    # sequence parallelism: the residual stream is split along T over (context, then) the vocab axes
    residual = live_axes("activation_norm_length", rules, mesh, T) or ()
    scatter = tuple(residual) == tuple(length or ()) + tuple(vocab)

    def per_device(table_VD, tokens_BT):
        local_BT = tokens_BT - _first_row(vocab, table_VD.shape[0])
        here_BT = (local_BT >= 0) & (local_BT < table_VD.shape[0])
        rows_BTD = jnp.where(here_BT[..., None], table_VD[jnp.clip(local_BT, 0, table_VD.shape[0] - 1)],
                             jnp.zeros((), table_VD.dtype))
        if scatter:
            return jax.lax.psum_scatter(rows_BTD, vocab, scatter_dimension=1, tiled=True)
        return jax.lax.psum(rows_BTD, vocab)

    out_length = residual if scatter else length
    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(vocab, None), P(batch, length)),
                         out_specs=P(batch, out_length or None, None))(table_VD, tokens_BT)


def split_parts(parts, h_BTD, head: Head, targets_BT):
    """`parts(h, head, targets, first) -> (max, sum exp(z - max), target logit, max |z|[, sum
    exp(z - max) z])` over the rows of `head` (global ids from `first`), combined over the vocab
    shards when the mesh splits them."""
    split = _split(head.w_VD.shape[0], *targets_BT.shape)
    if split is None:
        return parts(h_BTD, head, targets_BT, 0)
    mesh, _, vocab, batch, length = split

    def per_device(h_BTD, w_VD, targets_BT, *b_V):
        m_BT, s_BT, z_target_BT, max_abs, *ez = parts(h_BTD, head.replace(w_VD=w_VD, b_V=b_V[0] if b_V else None),
                                                      targets_BT, _first_row(vocab, w_VD.shape[0]))
        m_all_BT = jax.lax.pmax(jax.lax.stop_gradient(m_BT), vocab)  # a stabiliser: lse does not depend on it
        scale_BT = jnp.exp(m_BT - m_all_BT)
        every = tuple(vocab) + tuple(batch or ()) + tuple(length or ())
        return (m_all_BT, jax.lax.psum(s_BT * scale_BT, vocab), jax.lax.psum(z_target_BT, vocab),
                jax.lax.pmax(jax.lax.stop_gradient(max_abs), every), *(jax.lax.psum(e * scale_BT, vocab) for e in ez))

    rows = P(batch, length)
    specs = (P(batch, length, None), P(vocab, None), rows) + (() if head.b_V is None else (P(vocab),))
    args = (h_BTD, head.w_VD, targets_BT) + (() if head.b_V is None else (head.b_V,))
    n_out = len(jax.eval_shape(lambda: parts(h_BTD, head, targets_BT, 0)))
    return jax.shard_map(per_device, mesh=mesh, in_specs=specs,
                         out_specs=(rows, rows, rows, P()) + (rows,) * (n_out - 4))(*args)
