"""Masks from positions, and which key blocks each query block can see.

Letters: B batch, T query length, S key length, I query blocks, J key blocks.

A key is visible to a query when it is valid (`k_pos >= 0`), not in the future
(`k_pos <= q_pos`, if causal), inside the window (`q_pos - k_pos < window`) and in the
same segment. Blocked kernels pad T and S up to whole blocks: padded keys get position
-1 (never visible), padded queries repeat the last real position (their rows are dropped).
"""

from __future__ import annotations

import jax.numpy as jnp

_NO_KEY = jnp.iinfo(jnp.int32).max


def visible(q_pos, k_pos, q_seg=None, k_seg=None, *, causal: bool, window: int | None):
    """Elementwise visibility; the caller lays out queries and keys on broadcasting axes."""
    ok = k_pos >= 0
    if causal:
        ok = ok & (k_pos <= q_pos)
    if window is not None:
        ok = ok & (q_pos - k_pos < window)
    if q_seg is not None:
        ok = ok & (q_seg == k_seg)
    return ok


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


def pad_positions(q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, Tp: int, Sp: int):
    """Positions and segments padded to `Tp` queries and `Sp` keys (see the module docstring)."""
    return (pad_axis(q_pos_BT, 1, Tp, "edge"), pad_axis(k_pos_BS, 1, Sp, value=-1),
            pad_axis(q_seg_BT, 1, Tp, "edge"), pad_axis(k_seg_BS, 1, Sp, value=0))


def block_visibility(q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, *, causal, window, block_q, block_k):
    """`vis[B, I, J]`: may any query of block I see any key of block J? (conservative)

    Decided from each block's range of positions and segment ids, so it holds for any
    position layout (ring caches, packed documents); it is exact for increasing positions.
    """
    B, T = q_pos_BT.shape
    S = k_pos_BS.shape[1]
    q_BIR = q_pos_BT.reshape(B, T // block_q, block_q)
    k_BJC = k_pos_BS.reshape(B, S // block_k, block_k)
    valid_BJC = k_BJC >= 0
    q_min_BI1, q_max_BI1 = q_BIR.min(-1)[:, :, None], q_BIR.max(-1)[:, :, None]
    k_min_B1J = jnp.where(valid_BJC, k_BJC, _NO_KEY).min(-1)[:, None, :]
    k_max_B1J = jnp.where(valid_BJC, k_BJC, -1).max(-1)[:, None, :]
    vis_BIJ = jnp.broadcast_to(k_max_B1J >= 0, (B, T // block_q, S // block_k))
    if causal:
        vis_BIJ &= k_min_B1J <= q_max_BI1
    if window is not None:
        vis_BIJ &= q_min_BI1 - k_max_B1J < window
    if q_seg_BT is not None:
        qs_BIR = q_seg_BT.reshape(B, T // block_q, block_q)
        ks_BJC = k_seg_BS.reshape(B, S // block_k, block_k)
        ks_min_B1J = jnp.where(valid_BJC, ks_BJC, _NO_KEY).min(-1)[:, None, :]
        ks_max_B1J = jnp.where(valid_BJC, ks_BJC, jnp.iinfo(jnp.int32).min).max(-1)[:, None, :]
        vis_BIJ &= (qs_BIR.min(-1)[:, :, None] <= ks_max_B1J) & (ks_min_B1J <= qs_BIR.max(-1)[:, :, None])
    return vis_BIJ


def visible_range(vis, axis: int):
    """First and one-past-last visible block along `axis` (both 0 when none is visible), int32."""
    n = vis.shape[axis]
    any_ = vis.any(axis)
    first = jnp.argmax(vis, axis=axis)
    last = n - 1 - jnp.argmax(jnp.flip(vis, axis), axis=axis)
    lo = jnp.where(any_, first, 0).astype(jnp.int32)
    hi = jnp.where(any_, last + 1, 0).astype(jnp.int32)
    return lo, hi
