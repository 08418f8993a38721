"""Attention under `shard_map`: KV heads split across the tensor axis, the sequence across `context`.

Letters (the package legend): B batch, T/S query/key length, K kv heads, G queries per kv
head, H/U key/value head dims, P the devices of the context axis.

Each device owns `K / TP` KV heads and exactly their query groups, so no K/V is
gathered. When the tensor axis has more devices than KV heads (2 KV heads on TP=8, MQA),
each KV head is replicated the minimum number of times `r = TP / gcd(K, TP)` and its
query group split in `r`, so every device still owns whole (smaller) query groups:
`q[B,T,K,G,H] -> q[B,T,K*r,G/r,H]`, `k[B,S,K,H] -> k[B,S,K*r,H]`. The batch is split
over the batch axes when it divides them. The kernel runs per device.

Context parallelism: with `activation_length` mapped to a `context` axis of P > 1 devices,
each device holds `T / P` queries and keys (in whatever order the sequence was laid out over
the axis: the masks are positions and segment ids, so packing, windows, chunks, sinks and
soft-cap hold for any order). Two strategies (`parallel.context_strategy`, read from the
active `sharding.strategies()`):

- `all_gather` (default): each device gathers the keys and values (and their positions and
  segments) of the whole sequence along the axis and runs the kernel on its own queries; the
  queries are never gathered, the backward reduce-scatters dK and dV.
- `ring`: the key/value blocks travel round the axis (`ppermute`, P steps) while each device
  folds every block into its queries' online softmax (running max, sum and output in float32),
  so no device holds more than one block of keys; the steps are rematerialised in the
  backward. The blocks are computed in plain JAX (the online softmax of the `chunked` kernel at
  the ring's granularity, folded by the same `kernels.flash` steps), so an explicit Pallas or
  cuDNN `attention_impl` is refused with it; attention dropout too.

Attention dropout draws one mask over the whole call's probabilities, `[B, K, G, T, S]`, as one
device does (`kernels.attention.dropout_mask`), and each device gets its block of it (its rows,
heads and queries): a mesh drops exactly what one device drops, from the same key. Each device
draws only its own block (the random bits of an element do not depend on how the array is split).

Decoding (a cache, one new token) splits nothing along the sequence.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from modern_jax import execution, kernels
from modern_jax.kernels import chunked, flash
from modern_jax.kernels.attention import AttentionImpl, AttentionSpec, dropout_mask
from modern_jax.kernels.backend import UnsupportedFeatureError, note_kernel
from modern_jax.kernels.masks import MASK_VALUE, Visibility, softcap
from modern_jax.sharding.context import active, strategies
from modern_jax.sharding.rules import free_axes, live_axes, mesh_axes


def kv_replication(n_kv: int, group: int, tp: int) -> int:
    """How many copies of each KV head the tensor axis needs (1 when it divides K)."""
    r = tp // math.gcd(n_kv, tp)
    if group % r:
        raise ValueError(f"tensor axis {tp} cannot own whole query groups: {n_kv} KV heads x {group} queries each; "
                         f"choose a tensor size dividing {n_kv * group} (the query heads) and a multiple or divisor "
                         f"of {n_kv} (the KV heads)")
    return r


def attention(q_BTKGH, k_BSKH, v_BSKU, spec, vis, *, sinks_KG=None, dropout_rng=None, return_max_logit: bool = False):
    """`kernels.attention` with the active `execution.attention_impl`, run per device under
    shard_map when a mesh is active, the context axis as the active strategy says.

    With `return_max_logit`, returns `(o, max_logit[K, G])`: each head's max, each device's maxed
    over the devices that split the batch and the sequence (`pmax`); the heads stay where they are.
    """
    impl = execution.current().attention_impl
    kwargs = dict(impl=impl, return_max_logit=return_max_logit)
    B, T, K, G, H = q_BTKGH.shape
    S = k_BSKH.shape[1]
    keep_BKGTS = (dropout_mask(dropout_rng, spec.dropout_rate, B, K, G, T, S)
                  if spec.dropout_rate > 0.0 and dropout_rng is not None else None)
    state = active()
    if state is None:
        return kernels.attention(q_BTKGH, k_BSKH, v_BSKU, spec, vis, sinks_KG=sinks_KG, keep_BKGTS=keep_BKGTS,
                                 **kwargs)
    mesh, rules = state
    tp_axes = tuple(a for a in mesh_axes("activation_kv_heads", rules) if mesh.shape.get(a, 1) > 1)
    tp = math.prod(mesh.shape[a] for a in tp_axes)
    r = kv_replication(K, G, tp) if tp > 1 else 1
    if r > 1:  # split each query group in r and give each part its own copy of the KV head
        q_BTKGH = q_BTKGH.reshape(B, T, K * r, G // r, H)
        k_BSKH, v_BSKU = jnp.repeat(k_BSKH, r, axis=2), jnp.repeat(v_BSKU, r, axis=2)
        if sinks_KG is not None:
            sinks_KG = sinks_KG.reshape(K * r, G // r)
        if keep_BKGTS is not None:
            keep_BKGTS = keep_BKGTS.reshape(B, K * r, G // r, T, S)
    batch = live_axes("activation_batch", rules, mesh, B)
    heads = tp_axes or None
    ctx = free_axes(live_axes("activation_length", rules, mesh, T), batch, heads)
    k_ctx = ctx if ctx is not None and S % math.prod(mesh.shape[a] for a in ctx) == 0 else None
    ring = strategies().context_strategy == "ring" and ctx is not None and S == T
    if ring:
        _check_ring(impl, keep_BKGTS)
    args = [q_BTKGH, k_BSKH, v_BSKU, vis]
    specs = [P(batch, ctx, heads, None, None), P(batch, k_ctx, heads, None), P(batch, k_ctx, heads, None),
             Visibility(P(batch, ctx), P(batch, k_ctx), *(None if x is None else P(batch, c)
                                                         for x, c in ((vis.q_seg, ctx), (vis.k_seg, k_ctx))))]
    # each device its block of the one dropout mask: the mesh drops what one device drops
    optional = {"sinks": (sinks_KG, P(heads, None)), "keep": (keep_BKGTS, P(batch, heads, None, ctx, None))}
    names = [name for name, (value, _) in optional.items() if value is not None]
    args += [optional[name][0] for name in names]
    specs += [optional[name][1] for name in names]

    def per_device(q, k, v, vis, *rest):
        extra = dict(zip(names, rest))
        if ring:
            out = ring_attention(q, k, v, spec, vis, ctx, sinks_KG=extra.get("sinks"),
                                 return_max_logit=return_max_logit)
        else:
            if k_ctx is not None:  # the keys of the whole sequence, from every device of the context axis
                gather = lambda x: None if x is None else jax.lax.all_gather(x, k_ctx, axis=1, tiled=True)  # noqa: E731
                k, v = gather(k), gather(v)
                vis = Visibility(vis.q_pos, gather(vis.k_pos), vis.q_seg, gather(vis.k_seg))
            out = kernels.attention(q, k, v, spec, vis, sinks_KG=extra.get("sinks"), keep_BKGTS=extra.get("keep"),
                                    **kwargs)
        if return_max_logit:  # each head's max over the rows and the queries
            rows = tuple(batch or ()) + tuple(ctx or ())
            return out[0], jax.lax.pmax(out[1], rows) if rows else out[1]
        return out

    o_spec = P(batch, ctx, heads, None, None)
    out = jax.shard_map(per_device, mesh=mesh, in_specs=tuple(specs),
                        out_specs=(o_spec, P(heads, None)) if return_max_logit else o_spec, check_vma=False)(*args)
    o_BTKGU, max_logit = out if return_max_logit else (out, None)
    o_BTKGU = o_BTKGU.reshape(B, T, K, G, o_BTKGU.shape[-1])
    return (o_BTKGU, jax.lax.stop_gradient(max_logit.reshape(K, G))) if return_max_logit else o_BTKGU


def _check_ring(impl, keep_BKGTS) -> None:
    if AttentionImpl(impl) not in (AttentionImpl.DEFAULT, AttentionImpl.REFERENCE, AttentionImpl.CHUNKED):
        raise UnsupportedFeatureError(f"execution.attention_impl={AttentionImpl(impl).value!r} cannot run "
                                      f"parallel.context_strategy='ring' (the ring folds its blocks in plain JAX): use "
                                      f"execution.attention_impl=default, or parallel.context_strategy=all_gather")
    if keep_BKGTS is not None:
        raise UnsupportedFeatureError("attention dropout cannot run parallel.context_strategy='ring': set "
                                      "model.attn_dropout=0 or use parallel.context_strategy=all_gather")


def ring_attention(q_BTKGH, k_BSKH, v_BSKU, spec: AttentionSpec, vis: Visibility, axes, *, sinks_KG=None,
                   return_max_logit: bool = False):
    """Inside `shard_map`: this device's queries against every device's keys along `axes`, the
    key/value blocks passed round the ring (`ppermute`) and folded into an online softmax.

    Step s holds the block that started `s` devices back; each is masked by its own positions and
    segments, so the order they arrive in changes nothing. The sinks join the denominator once,
    at the end."""
    devices = math.prod(jax.lax.axis_size(a) for a in axes)  # P
    perm = [(i, (i + 1) % devices) for i in range(devices)]
    B, T, K, G, H = q_BTKGH.shape
    U = v_BSKU.shape[-1]

    call = flash.Call.of(spec, return_max_logit)

    @jax.checkpoint
    def fold(carry, _):
        state, top_BKGT1, k_BSKH, v_BSKU, k_pos_BS, k_seg_BS = carry
        x_BKGTS = chunked.logits(call, q_BTKGH, k_BSKH)
        visible = chunked.tile_mask(call, vis.q_pos, k_pos_BS, vis.q_seg, k_seg_BS)
        # masked before the step: the ring is differentiated through it, and exp of a masked
        # score must stay finite
        s_BKGTS = jnp.where(visible, softcap(x_BKGTS, spec.softcap), MASK_VALUE)
        state = flash.forward_step(s_BKGTS, visible, v_BSKU, *state, pv=chunked.pv)
        if return_max_logit:
            top_BKGT1 = flash.fold_max_logit(top_BKGT1, jax.lax.stop_gradient(x_BKGTS), visible)
        passed = [jax.lax.ppermute(x, axes, perm) if x is not None else None
                  for x in (k_BSKH, v_BSKU, k_pos_BS, k_seg_BS)]
        return (state, top_BKGT1, *passed), None

    init = flash.init_state((B, K, G, T), U)
    top = jnp.zeros((B, K, G, T, 1), jnp.float32) if return_max_logit else None
    (state, top, *_), _ = jax.lax.scan(fold, (init, top, k_BSKH, v_BSKU, vis.k_pos, vis.k_seg), None, length=devices)
    sink = None if sinks_KG is None else sinks_KG.astype(jnp.float32)[None, :, :, None, None]
    o_BKGTU, _ = flash.finish(*state, sink)  # the sink's logit joins the denominator only
    o_BTKGU = o_BKGTU.transpose(0, 3, 1, 2, 4).astype(q_BTKGH.dtype)
    note_kernel("attention", "ring")
    return (o_BTKGU, jnp.max(top, axis=(0, 3, 4))) if return_max_logit else o_BTKGU
