"""Blockwise attention in pure JAX: memory linear in the sequence length, on every backend.

Letters: B batch, T query length, S key length, K kv heads, G queries per kv head,
H key head dim, U value head dim; I query blocks of `tile_t` rows, J key blocks of `tile_s` keys; a tile carries the
letter of the axis it slices (T for a query tile, S for a key tile), as in `kernels.flash`.

The same online softmax as the flash kernels (`kernels.flash`), written with `lax`
loops: the forward maps over query blocks and scans over key blocks carrying the running
max, denominator and output; the custom backward scans over key blocks (carrying dq)
and, inside, over query blocks (carrying dk, dv), recomputing the probabilities from the
saved log-sum-exp. Only `[B, K, G, T, S]` tiles ever exist, so memory grows linearly
with T. Blocks that no query of a block can see (causal, window, chunks, segments; see
`Visibility.tiles`) are skipped with `lax.cond`.

Decoding (`attention_decode`: one query a row against a KV cache) reads the cache in place, one
block of `DECODE_BLOCK` keys at a time, and only the blocks from the first to the last any row
sees: its cost follows the filled part of the cache (and a window's), not its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from modern_jax.kernels import flash
from modern_jax.kernels.backend import varying_axes, vary_over
from modern_jax.kernels.masks import Visibility, pad_axis, round_up, softcap


@dataclass(frozen=True)
class _Call(flash.Call):
    block_q: int
    block_k: int


def attention_chunked(q_BTKGH, k_BSKH, v_BSKU, spec, vis: Visibility, *, sinks_KG=None, block_q: int = 512,
                      block_k: int = 512, return_max_logit: bool = False):
    """Attention with an online softmax over key blocks; the contract of `kernels.attention`.

    With `return_max_logit`, returns `(o, max |q.k| * scale over visible pairs, per head [K, G])`: each
    visited tile folds its logits into a running per-row max beside the softmax's.
    """
    B, T, K, G, H = q_BTKGH.shape
    S = k_BSKH.shape[1]
    tile_t, tile_s = min(block_q, round_up(T, 8)), min(block_k, round_up(S, 8))
    Tp, Sp = round_up(T, tile_t), round_up(S, tile_s)
    dtype = q_BTKGH.dtype
    q = pad_axis(q_BTKGH, 1, Tp)
    k, v = pad_axis(k_BSKH.astype(dtype), 1, Sp), pad_axis(v_BSKU.astype(dtype), 1, Sp)
    vis = vis.padded(Tp, Sp)
    sinks = None if sinks_KG is None else sinks_KG.astype(jnp.float32)
    call = _Call.of(spec, return_max_logit, tile_t, tile_s)
    q, k, v, sinks = vary_over((q, k, v, sinks), varying_axes(q, k, v, sinks, vis))
    o, max_logit_BKGT = _chunked(call, q, k, v, sinks, vis)
    if return_max_logit:
        return o[:, :T], jax.lax.stop_gradient(jnp.max(max_logit_BKGT[..., :T], axis=(0, 3)))
    return o[:, :T]


DECODE_BLOCK = 128  # the keys of the cache read at a time when decoding


def attention_decode(q_B1KGH, k_BSKH, v_BSKU, spec, vis: Visibility, *, sinks_KG=None, block_k: int = DECODE_BLOCK,
                     return_max_logit: bool = False):
    """One query a row against a KV cache: the contract of `kernels.attention`, with a loop over
    the cache's key blocks from the first to the last block any row sees (the slots past the
    filled part hold position -1; a window leaves the first ones behind). Forward only (decoding
    takes no gradient)."""
    B, T, K, G, H = q_B1KGH.shape
    S = k_BSKH.shape[1]
    tile_s = min(block_k, round_up(S, 8))
    Sp = round_up(S, tile_s)
    dtype = q_B1KGH.dtype
    k, v = pad_axis(k_BSKH.astype(dtype), 1, Sp), pad_axis(v_BSKU.astype(dtype), 1, Sp)
    vis = vis.padded(T, Sp)
    sinks = None if sinks_KG is None else sinks_KG.astype(jnp.float32)
    call = _Call.of(spec, return_max_logit, T, tile_s)
    q, k, v, sinks = vary_over((q_B1KGH, k, v, sinks), varying_axes(q_B1KGH, k, v, sinks, vis))
    vis_J = vis.tiles(**call.rule, block_q=T, block_k=tile_s).any((0, 1))
    J = jnp.arange(Sp // tile_s)
    first, end = jnp.min(jnp.where(vis_J, J, J.size)), jnp.max(jnp.where(vis_J, J + 1, 0))  # the blocks rows see

    def key_block(j, state):
        tile = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, j * tile_s, tile_s, axis=1)  # noqa: E731
        mask = tile_mask(call, vis.q_pos, tile(vis.k_pos), vis.q_seg, tile(vis.k_seg))
        x_BKGTS = logits(call, q, tile(k))
        softmax = flash.forward_step(softcap(x_BKGTS, call.softcap), mask, tile(v), *state[:3], pv=pv)
        return softmax if not call.max_logit else (*softmax, flash.fold_max_logit(state[3], x_BKGTS, mask))

    init = flash.init_state((B, K, G, T), v.shape[-1])
    if call.max_logit:
        init += (jnp.zeros((B, K, G, T, 1), jnp.float32),)
    state = jax.lax.fori_loop(first, end, key_block, vary_over(init, varying_axes(q, k, v, sinks, vis)))
    sink = None if sinks is None else sinks[None, :, :, None, None]
    o_BKGTU, _ = flash.finish(*state[:3], sink)
    o_BTKGU = o_BKGTU.transpose(0, 3, 1, 2, 4).astype(dtype)
    if return_max_logit:
        return o_BTKGU, jnp.max(state[3][..., 0], axis=(0, 3))
    return o_BTKGU


def _blocks(x, size: int):
    """`x[B, L, ...]` -> `[L / size, B, size, ...]`, blocks leading (for scan)."""
    if x is None:
        return None
    B, L = x.shape[:2]
    return jnp.moveaxis(x.reshape(B, L // size, size, *x.shape[2:]), 1, 0)


def _unblock(x):
    """Inverse of `_blocks`."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def tile_mask(call, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS):
    """Visibility `[B, 1, 1, T, S]` of one tile (broadcasts over K and G)."""
    mask_BTS = Visibility(q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS).mask(**call.rule)
    return mask_BTS[:, None, None]


def logits(call, q_BTKGH, k_BSKH):
    """`call.scale * q k^T` of one tile in fp32 (before any soft-cap)."""
    return jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32) * call.scale


def _scores(call, q_BTKGH, k_BSKH):
    return softcap(logits(call, q_BTKGH, k_BSKH), call.softcap)


def pv(p_BKGTS, v_BSKU):
    """The probabilities times the values of one tile, accumulated in fp32."""
    return jnp.einsum("BKGTS,BSKU->BKGTU", p_BKGTS, v_BSKU, preferred_element_type=jnp.float32)


def _forward(call, q, k, v, sinks_KG, vis):
    B, Tp, K, G, H = q.shape
    U = v.shape[-1]
    tile_t, tile_s = call.block_q, call.block_k
    # Tie the positions to the queries. Under a scan over layers, reverse-mode AD hoists out of
    # the loop whatever depends only on loop invariants (JAX's scan partial eval); the positions
    # are invariant, so every tile's mask would be precomputed at once, [I, J, T, S]: O(T^2).
    # Behind the barrier the masks stay in the loops, one tile at a time.
    q, vis = jax.lax.optimization_barrier((q, vis))
    q_pos, k_pos, q_seg, k_seg = vis.q_pos, vis.k_pos, vis.q_seg, vis.k_seg
    vis_IJ = vis.tiles(**call.rule, block_q=tile_t, block_k=tile_s).any(0)
    keys = (_blocks(k, tile_s), _blocks(v, tile_s), _blocks(k_pos, tile_s), _blocks(k_seg, tile_s))
    inputs = (q, k, v, sinks_KG, vis)

    def query_block(xs):
        q_BTKGH, q_pos_BT, q_seg_BT, vis_J = xs

        def key_block(state, ys):
            k_BSKH, v_BSKU, k_pos_BS, k_seg_BS, visited = ys

            def fold(state):
                mask = tile_mask(call, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS)
                x_BKGTS = logits(call, q_BTKGH, k_BSKH)
                softmax = flash.forward_step(softcap(x_BKGTS, call.softcap), mask, v_BSKU, *state[:3], pv=pv)
                if not call.max_logit:
                    return softmax
                return (*softmax, flash.fold_max_logit(state[3], x_BKGTS, mask))

            return jax.lax.cond(visited, fold, lambda state: state, state), None

        init = flash.init_state((B, K, G, tile_t), U)
        if call.max_logit:
            init += (jnp.zeros((B, K, G, tile_t, 1), jnp.float32),)
        state, _ = jax.lax.scan(key_block, vary_over(init, varying_axes(inputs)), (*keys, vis_J))
        sink = None if sinks_KG is None else sinks_KG[None, :, :, None, None]
        o_BKGTU, lse_BKGT1 = flash.finish(*state[:3], sink)
        max_logit_BKGT = state[3][..., 0] if call.max_logit else None
        return o_BKGTU.transpose(0, 3, 1, 2, 4).astype(q.dtype), lse_BKGT1[..., 0], max_logit_BKGT

    o_IBTKGU, lse_IBKGT, max_logit_IBKGT = jax.lax.map(query_block, (_blocks(q, tile_t), _blocks(q_pos, tile_t),
                                                                      _blocks(q_seg, tile_t), vis_IJ))
    def per_row(x_IBKGT):
        return None if x_IBKGT is None else jnp.moveaxis(x_IBKGT, 0, 3).reshape(B, K, G, Tp)

    return _unblock(o_IBTKGU), per_row(lse_IBKGT), per_row(max_logit_IBKGT)


def _backward(call, q, k, v, do, o, lse_BKGT, vis):
    B, Tp, K, G, H = q.shape
    delta_BKGT = flash.delta(do, o).transpose(0, 2, 3, 1)  # o[B, T, K, G, U] -> lse's layout
    U = v.shape[-1]
    tile_t, tile_s = call.block_q, call.block_k
    I = Tp // tile_t
    q_pos, k_pos, q_seg, k_seg = vis.q_pos, vis.k_pos, vis.q_seg, vis.k_seg
    vis_JI = vis.tiles(**call.rule, block_q=tile_t, block_k=tile_s).any(0).T
    stats_IBKGT = tuple(jnp.moveaxis(x.reshape(B, K, G, I, tile_t), 3, 0) for x in (lse_BKGT, delta_BKGT))
    inputs = (q, k, v, do, lse_BKGT, delta_BKGT, vis)
    queries = (_blocks(q, tile_t), _blocks(do, tile_t), *stats_IBKGT, _blocks(q_pos, tile_t), _blocks(q_seg, tile_t))

    def key_block(dq_IBTKGH, xs):
        k_BSKH, v_BSKU, k_pos_BS, k_seg_BS, vis_I = xs

        def query_block(dkv, ys):
            q_BTKGH, do_BTKGU, lse_BKGT, delta_BKGT, q_pos_BT, q_seg_BT, vis = ys

            def grads(_):
                s_BKGTS = _scores(call, q_BTKGH, k_BSKH)
                mask = tile_mask(call, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS)
                p_BKGTS = jnp.where(mask, jnp.exp(s_BKGTS - lse_BKGT[..., None]), 0.0)
                dv_BSKU = jnp.einsum("BKGTS,BTKGU->BSKU", p_BKGTS.astype(do.dtype), do_BTKGU,
                                     preferred_element_type=jnp.float32)
                dp_BKGTS = jnp.einsum("BTKGU,BSKU->BKGTS", do_BTKGU, v_BSKU, preferred_element_type=jnp.float32)
                ds_BKGTS = flash.softcap_grad(p_BKGTS * (dp_BKGTS - delta_BKGT[..., None]), s_BKGTS, call.softcap)
                ds_BKGTS = (ds_BKGTS * call.scale).astype(q.dtype)
                dq_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", ds_BKGTS, k_BSKH, preferred_element_type=jnp.float32)
                dk_BSKH = jnp.einsum("BKGTS,BTKGH->BSKH", ds_BKGTS, q_BTKGH, preferred_element_type=jnp.float32)
                return dq_BTKGH, dk_BSKH, dv_BSKU

            def nothing(_):
                zeros = (jnp.zeros((B, tile_t, K, G, H), jnp.float32), jnp.zeros((B, tile_s, K, H), jnp.float32),
                         jnp.zeros((B, tile_s, K, U), jnp.float32))
                return vary_over(zeros, varying_axes(inputs))

            dq_BTKGH, dk_BSKH, dv_BSKU = jax.lax.cond(vis, grads, nothing, None)
            return (dkv[0] + dk_BSKH, dkv[1] + dv_BSKU), dq_BTKGH

        init = vary_over((jnp.zeros((B, tile_s, K, H), jnp.float32), jnp.zeros((B, tile_s, K, U), jnp.float32)),
                         varying_axes(inputs))
        (dk_BSKH, dv_BSKU), dq_part_IBTKGH = jax.lax.scan(query_block, init, (*queries, vis_I))
        return dq_IBTKGH + dq_part_IBTKGH, (dk_BSKH.astype(k.dtype), dv_BSKU.astype(v.dtype))

    keys = (_blocks(k, tile_s), _blocks(v, tile_s), _blocks(k_pos, tile_s), _blocks(k_seg, tile_s), vis_JI)
    dq_init = vary_over(jnp.zeros((I, B, tile_t, K, G, H), jnp.float32), varying_axes(inputs))
    dq_IBTKGH, (dk_JBSKH, dv_JBSKU) = jax.lax.scan(key_block, dq_init, keys)
    return _unblock(dq_IBTKGH).astype(q.dtype), _unblock(dk_JBSKH), _unblock(dv_JBSKU), delta_BKGT


# o[B, T, K, G, U], lse[B, K, G, T], sinks[K, G]
_chunked = flash.recompute_vjp(_forward, _backward, sink_stat=lambda s_KG: s_KG[None, :, :, None])
