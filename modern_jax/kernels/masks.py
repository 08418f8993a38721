"""`Visibility`: masks from positions, and which key tiles each query tile can see.

Letters: B batch, T query length, S key length, I query blocks, J key blocks.

A key is visible to a query when it is valid (`k_pos >= 0`), not in the future
(`k_pos <= q_pos`, if causal), inside the window (`q_pos - k_pos < window`), in the same
chunk (`q_pos // chunk == k_pos // chunk`: chunked attention, Llama 4) and in the same
segment. Blocked kernels pad T and S up to whole blocks: padded keys get position
-1 (never visible), padded queries repeat the last real position (their rows are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

_NO_KEY = jnp.iinfo(jnp.int32).max
MASK_VALUE = float(jnp.finfo(jnp.float32).min)  # the logit of an invisible key or a padded vocabulary row


def softcap(x, cap: float | None):
    """`cap * tanh(x / cap)`: bounds logits smoothly to (-cap, cap); None: `x` unchanged."""
    return x if cap is None else cap * jnp.tanh(x / cap)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Visibility:
    """Which keys each query sees: `q_pos[B, T]`, `k_pos[B, S]` and optional segment ids.

    A pytree (its arrays are the leaves), so it passes whole through jit, custom_vjp and
    shard_map (whose in_specs are then a Visibility of PartitionSpecs). Inside a kernel the
    same class holds one tile's positions, laid out on broadcasting axes (`pairs`).
    """

    q_pos: jax.Array
    k_pos: jax.Array
    q_seg: jax.Array | None = None
    k_seg: jax.Array | None = None

    def pairs(self, *, causal: bool, window: int | None, chunk: int | None = None):
        """Elementwise visibility; the fields are already laid out on broadcasting axes."""
        ok = self.k_pos >= 0
        if causal:
            ok = ok & (self.k_pos <= self.q_pos)
        if window is not None:
            ok = ok & (self.q_pos - self.k_pos < window)
        if chunk is not None:
            ok = ok & (self.q_pos // chunk == self.k_pos // chunk)
        if self.q_seg is not None:
            ok = ok & (self.q_seg == self.k_seg)
        return ok

    def mask(self, *, causal: bool, window: int | None, chunk: int | None = None):
        """The dense mask `[..., T, S]` from `[..., T]` queries and `[..., S]` keys."""
        q = lambda x: None if x is None else x[..., :, None]  # noqa: E731
        k = lambda x: None if x is None else x[..., None, :]  # noqa: E731
        mask = Visibility(q(self.q_pos), k(self.k_pos), q(self.q_seg), k(self.k_seg)).pairs(causal=causal,
                                                                                            window=window, chunk=chunk)
        return jnp.broadcast_to(mask, (*self.q_pos.shape, self.k_pos.shape[-1]))

    def padded(self, Tp: int, Sp: int) -> Visibility:
        """int32, padded to `Tp` queries and `Sp` keys (see the module docstring)."""
        i32 = lambda x: None if x is None else x.astype(jnp.int32)  # noqa: E731
        return Visibility(pad_axis(i32(self.q_pos), 1, Tp, "edge"), pad_axis(i32(self.k_pos), 1, Sp, value=-1),
                          pad_axis(i32(self.q_seg), 1, Tp, "edge"), pad_axis(i32(self.k_seg), 1, Sp, value=0))

    def tiles(self, *, causal: bool, window: int | None, block_q: int, block_k: int, chunk: int | None = None):
        """`vis[B, I, J]`: may any query of tile I see any key of tile J? (conservative)

        Decided from each tile's range of positions and segment ids, so it holds for any
        position layout (ring caches, packed documents); it is exact for runs of consecutive
        positions without segments, chunks included (two runs whose ranges of chunk ids overlap
        share a chunk, and its earliest key is at or before its latest query).
        """
        B, T = self.q_pos.shape
        S = self.k_pos.shape[1]
        q_BIT = self.q_pos.reshape(B, T // block_q, block_q)
        k_BJS = self.k_pos.reshape(B, S // block_k, block_k)
        valid_BJS = k_BJS >= 0
        q_min_BI1, q_max_BI1 = q_BIT.min(-1)[:, :, None], q_BIT.max(-1)[:, :, None]
        k_min_B1J = jnp.where(valid_BJS, k_BJS, _NO_KEY).min(-1)[:, None, :]
        k_max_B1J = jnp.where(valid_BJS, k_BJS, -1).max(-1)[:, None, :]
        vis_BIJ = jnp.broadcast_to(k_max_B1J >= 0, (B, T // block_q, S // block_k))
        if causal:
            vis_BIJ &= k_min_B1J <= q_max_BI1
        if window is not None:
            vis_BIJ &= q_min_BI1 - k_max_B1J < window
        if chunk is not None:  # the tiles' ranges of chunk ids overlap
            vis_BIJ &= (q_min_BI1 // chunk <= k_max_B1J // chunk) & (k_min_B1J // chunk <= q_max_BI1 // chunk)
        if self.q_seg is not None:
            qs_BIT = self.q_seg.reshape(B, T // block_q, block_q)
            ks_BJS = self.k_seg.reshape(B, S // block_k, block_k)
            ks_min_B1J = jnp.where(valid_BJS, ks_BJS, _NO_KEY).min(-1)[:, None, :]
            ks_max_B1J = jnp.where(valid_BJS, ks_BJS, jnp.iinfo(jnp.int32).min).max(-1)[:, None, :]
            vis_BIJ &= (qs_BIT.min(-1)[:, :, None] <= ks_max_B1J) & (ks_min_B1J <= qs_BIT.max(-1)[:, :, None])
        return vis_BIJ


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_axis(x, axis: int, length: int, mode: str = "constant", value=0):
    """Pad `x` along `axis` up to `length` (`mode='edge'` repeats the last entry)."""
    if x is None or x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    if mode == "edge":
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def visible_range(vis, axis: int):
    """First and one-past-last visible block along `axis` (both 0 when none is visible), int32."""
    n = vis.shape[axis]
    any_ = vis.any(axis)
    first = jnp.argmax(vis, axis=axis)
    last = n - 1 - jnp.argmax(jnp.flip(vis, axis), axis=axis)
    lo = jnp.where(any_, first, 0).astype(jnp.int32)
    hi = jnp.where(any_, last + 1, 0).astype(jnp.int32)
    return lo, hi
