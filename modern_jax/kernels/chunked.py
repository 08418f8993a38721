"""Blockwise attention in pure JAX: memory linear in the sequence length, on every backend.

Letters: B batch, T query length, S key length, K kv heads, G queries per kv head,
H key head dim, U value head dim; I query blocks of R rows, J key blocks of C keys (the
tile letters R and C, as in `kernels.flash`).

The same online softmax as the flash kernels (`kernels.flash`), written with `lax`
loops: the forward maps over query blocks and scans over key blocks carrying the running
max, denominator and output; the custom backward scans over key blocks (carrying dq)
and, inside, over query blocks (carrying dk, dv), recomputing the probabilities from the
saved log-sum-exp. Only `[B, K, G, R, C]` tiles ever exist, so memory grows linearly
with T. Blocks that no query of a block can see (causal, window, segments; see
`Visibility.tiles`) are skipped with `lax.cond`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from modern_jax.kernels import flash
from modern_jax.kernels.backend import varying_axes, vary_over
from modern_jax.kernels.masks import MASK_VALUE, Visibility, pad_axis, round_up, softcap


@dataclass(frozen=True)
class _Call:
    scale: float
    causal: bool
    window: int | None
    softcap: float | None
    block_q: int
    block_k: int
    max_logit: bool = False


def attention_chunked(q_BTKGH, k_BSKH, v_BSKU, spec, vis: Visibility, *, sinks_KG=None, block_q: int = 512,
                      block_k: int = 512, return_max_logit: bool = False):
    """Attention with an online softmax over key blocks; the contract of `kernels.attention`.

    With `return_max_logit`, returns `(o, max |q.k| * scale over visible pairs)`: each
    visited tile folds its logits into a running per-row max beside the softmax's.
    """
    B, T, K, G, H = q_BTKGH.shape
    S = k_BSKH.shape[1]
    R, C = min(block_q, round_up(T, 8)), min(block_k, round_up(S, 8))
    Tp, Sp = round_up(T, R), round_up(S, C)
    dtype = q_BTKGH.dtype
    q = pad_axis(q_BTKGH, 1, Tp)
    k, v = pad_axis(k_BSKH.astype(dtype), 1, Sp), pad_axis(v_BSKU.astype(dtype), 1, Sp)
    vis = vis.padded(Tp, Sp)
    sinks = None if sinks_KG is None else sinks_KG.astype(jnp.float32)
    call = _Call(spec.scale, spec.causal, spec.window, spec.softcap, R, C, return_max_logit)
    q, k, v, sinks = vary_over((q, k, v, sinks), varying_axes(q, k, v, sinks, vis))
    o, max_logit_BKGT = _chunked(call, q, k, v, sinks, vis)
    if return_max_logit:
        return o[:, :T], jax.lax.stop_gradient(jnp.max(max_logit_BKGT[..., :T]))
    return o[:, :T]


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


def _tile_mask(call, q_pos_BR, k_pos_BC, q_seg_BR, k_seg_BC):
    """Visibility `[B, 1, 1, R, C]` of one tile (broadcasts over K and G)."""
    mask_BRC = Visibility(q_pos_BR, k_pos_BC, q_seg_BR, k_seg_BC).mask(causal=call.causal, window=call.window)
    return mask_BRC[:, None, None]


def _logits(call, q_BRKGH, k_BCKH):
    return jnp.einsum("BRKGH,BCKH->BKGRC", q_BRKGH, k_BCKH, preferred_element_type=jnp.float32) * call.scale


def _scores(call, q_BRKGH, k_BCKH):
    return softcap(_logits(call, q_BRKGH, k_BCKH), call.softcap)


def _pv(p_BKGRC, v_BCKU):
    return jnp.einsum("BKGRC,BCKU->BKGRU", p_BKGRC, v_BCKU, preferred_element_type=jnp.float32)


def _forward(call, q, k, v, sinks_KG, vis):
    B, Tp, K, G, H = q.shape
    U = v.shape[-1]
    R, C = call.block_q, call.block_k
    # Tie the positions to the queries. Under a scan over layers, reverse-mode AD hoists out of
    # the loop whatever depends only on loop invariants (JAX's scan partial eval); the positions
    # are invariant, so every tile's mask would be precomputed at once, [I, J, R, C]: O(T^2).
    # Behind the barrier the masks stay in the loops, one tile at a time.
    q, vis = jax.lax.optimization_barrier((q, vis))
    q_pos, k_pos, q_seg, k_seg = vis.q_pos, vis.k_pos, vis.q_seg, vis.k_seg
    vis_IJ = vis.tiles(causal=call.causal, window=call.window, block_q=R, block_k=C).any(0)
    keys = (_blocks(k, C), _blocks(v, C), _blocks(k_pos, C), _blocks(k_seg, C))
    inputs = (q, k, v, sinks_KG, vis)

    def query_block(xs):
        q_BRKGH, q_pos_BR, q_seg_BR, vis_J = xs

        def key_block(state, ys):
            k_BCKH, v_BCKU, k_pos_BC, k_seg_BC, visited = ys

            def fold(state):
                mask = _tile_mask(call, q_pos_BR, k_pos_BC, q_seg_BR, k_seg_BC)
                x_BKGRC = _logits(call, q_BRKGH, k_BCKH)
                softmax = flash.forward_step(softcap(x_BKGRC, call.softcap), mask, v_BCKU, *state[:3], pv=_pv)
                if not call.max_logit:
                    return softmax
                return (*softmax, flash.fold_max_logit(state[3], x_BKGRC, mask))

            return jax.lax.cond(visited, fold, lambda state: state, state), None

        init = (jnp.full((B, K, G, R, 1), MASK_VALUE, jnp.float32), jnp.zeros((B, K, G, R, 1), jnp.float32),
                jnp.zeros((B, K, G, R, U), jnp.float32))
        if call.max_logit:
            init += (jnp.zeros((B, K, G, R, 1), jnp.float32),)
        state, _ = jax.lax.scan(key_block, vary_over(init, varying_axes(inputs)), (*keys, vis_J))
        sink = None if sinks_KG is None else sinks_KG[None, :, :, None, None]
        o_BKGRU, lse_BKGR1 = flash.finish(*state[:3], sink)
        max_logit_BKGR = state[3][..., 0] if call.max_logit else None
        return o_BKGRU.transpose(0, 3, 1, 2, 4).astype(q.dtype), lse_BKGR1[..., 0], max_logit_BKGR

    o_IBRKGU, lse_IBKGR, max_logit_IBKGR = jax.lax.map(query_block, (_blocks(q, R), _blocks(q_pos, R),
                                                                      _blocks(q_seg, R), vis_IJ))
    def per_row(x_IBKGR):
        return None if x_IBKGR is None else jnp.moveaxis(x_IBKGR, 0, 3).reshape(B, K, G, Tp)

    return _unblock(o_IBRKGU), per_row(lse_IBKGR), per_row(max_logit_IBKGR)


def _backward(call, q, k, v, do, lse_BKGT, delta_BKGT, vis):
    B, Tp, K, G, H = q.shape
    U = v.shape[-1]
    R, C = call.block_q, call.block_k
    I = Tp // R
    q_pos, k_pos, q_seg, k_seg = vis.q_pos, vis.k_pos, vis.q_seg, vis.k_seg
    vis_JI = vis.tiles(causal=call.causal, window=call.window, block_q=R, block_k=C).any(0).T
    stats_IBKGR = tuple(jnp.moveaxis(x.reshape(B, K, G, I, R), 3, 0) for x in (lse_BKGT, delta_BKGT))
    inputs = (q, k, v, do, lse_BKGT, delta_BKGT, vis)
    queries = (_blocks(q, R), _blocks(do, R), *stats_IBKGR, _blocks(q_pos, R), _blocks(q_seg, R))

    def key_block(dq_IBRKGH, xs):
        k_BCKH, v_BCKU, k_pos_BC, k_seg_BC, vis_I = xs

        def query_block(dkv, ys):
            q_BRKGH, do_BRKGU, lse_BKGR, delta_BKGR, q_pos_BR, q_seg_BR, vis = ys

            def grads(_):
                s_BKGRC = _scores(call, q_BRKGH, k_BCKH)
                mask = _tile_mask(call, q_pos_BR, k_pos_BC, q_seg_BR, k_seg_BC)
                p_BKGRC = jnp.where(mask, jnp.exp(s_BKGRC - lse_BKGR[..., None]), 0.0)
                dv_BCKU = jnp.einsum("BKGRC,BRKGU->BCKU", p_BKGRC.astype(do.dtype), do_BRKGU,
                                     preferred_element_type=jnp.float32)
                dp_BKGRC = jnp.einsum("BRKGU,BCKU->BKGRC", do_BRKGU, v_BCKU, preferred_element_type=jnp.float32)
                ds_BKGRC = flash.softcap_grad(p_BKGRC * (dp_BKGRC - delta_BKGR[..., None]), s_BKGRC, call.softcap)
                ds_BKGRC = (ds_BKGRC * call.scale).astype(q.dtype)
                dq_BRKGH = jnp.einsum("BKGRC,BCKH->BRKGH", ds_BKGRC, k_BCKH, preferred_element_type=jnp.float32)
                dk_BCKH = jnp.einsum("BKGRC,BRKGH->BCKH", ds_BKGRC, q_BRKGH, preferred_element_type=jnp.float32)
                return dq_BRKGH, dk_BCKH, dv_BCKU

            def nothing(_):
                zeros = (jnp.zeros((B, R, K, G, H), jnp.float32), jnp.zeros((B, C, K, H), jnp.float32),
                         jnp.zeros((B, C, K, U), jnp.float32))
                return vary_over(zeros, varying_axes(inputs))

            dq_BRKGH, dk_BCKH, dv_BCKU = jax.lax.cond(vis, grads, nothing, None)
            return (dkv[0] + dk_BCKH, dkv[1] + dv_BCKU), dq_BRKGH

        init = vary_over((jnp.zeros((B, C, K, H), jnp.float32), jnp.zeros((B, C, K, U), jnp.float32)),
                         varying_axes(inputs))
        (dk_BCKH, dv_BCKU), dq_part_IBRKGH = jax.lax.scan(query_block, init, (*queries, vis_I))
        return dq_IBRKGH + dq_part_IBRKGH, (dk_BCKH.astype(k.dtype), dv_BCKU.astype(v.dtype))

    keys = (_blocks(k, C), _blocks(v, C), _blocks(k_pos, C), _blocks(k_seg, C), vis_JI)
    dq_init = vary_over(jnp.zeros((I, B, R, K, G, H), jnp.float32), varying_axes(inputs))
    dq_IBRKGH, (dk_JBCKH, dv_JBCKU) = jax.lax.scan(key_block, dq_init, keys)
    return _unblock(dq_IBRKGH).astype(q.dtype), _unblock(dk_JBCKH), _unblock(dv_JBCKU)


# o[B, T, K, G, U], lse[B, K, G, T], sinks[K, G]
_chunked = flash.recompute_vjp(_forward, _backward, stat=lambda r_BTKG: r_BTKG.transpose(0, 2, 3, 1),
                               sink_stat=lambda s_KG: s_KG[None, :, :, None])
