"""Attention under `shard_map`: KV heads split across the tensor axis.

Letters as in `modern_jax.kernels.attention`: B batch, T/S query/key length, K kv heads,
G queries per kv head, H/U key/value head dims.

Each device owns `K / TP` KV heads and exactly their query groups, so no K/V is
gathered. When the tensor axis has more devices than KV heads (2 KV heads on TP=8, MQA),
each KV head is replicated the minimum number of times `r = TP / gcd(K, TP)` and its
query group split in `r`, so every device still owns whole (smaller) query groups:
`q[B,T,K,G,H] -> q[B,T,K*r,G/r,H]`, `k[B,S,K,H] -> k[B,S,K*r,H]`. The batch is split
over the batch axes when it divides them. The kernel runs per device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from modern_jax import kernels
from modern_jax.sharding import active, live_axes, mesh_axes


def kv_replication(n_kv: int, group: int, tp: int) -> int:
    """How many copies of each KV head the tensor axis needs (1 when it divides K)."""
    r = tp // math.gcd(n_kv, tp)
    if group % r:
        raise ValueError(f"tensor axis {tp} cannot own whole query groups: {n_kv} KV heads x {group} queries each; "
                         f"choose a tensor size dividing {n_kv * group} (the query heads) and a multiple or divisor "
                         f"of {n_kv} (the KV heads)")
    return r


def attention(q_BTKGH, k_BSKH, v_BSKU, spec, vis, *, sinks_KG=None, dropout_rng=None, impl="reference",
              return_max_logit: bool = False):
    """`kernels.attention`, run per device under shard_map when a mesh is active.

    With `return_max_logit`, returns `(o, max_logit)`: each device's max, maxed over the
    devices (`pmax`) so every device holds the global one.
    """
    kwargs = dict(impl=impl, return_max_logit=return_max_logit)
    state = active()
    if state is None:
        return kernels.attention(q_BTKGH, k_BSKH, v_BSKU, spec, vis, sinks_KG=sinks_KG, dropout_rng=dropout_rng,
                                 **kwargs)
    mesh, rules = state
    B, T, K, G, H = q_BTKGH.shape
    tp_axes = tuple(a for a in mesh_axes("activation_kv_heads", rules) if mesh.shape.get(a, 1) > 1)
    tp = math.prod(mesh.shape[a] for a in tp_axes)
    r = kv_replication(K, G, tp) if tp > 1 else 1
    if r > 1:  # split each query group in r and give each part its own copy of the KV head
        q_BTKGH = q_BTKGH.reshape(B, T, K * r, G // r, H)
        k_BSKH, v_BSKU = jnp.repeat(k_BSKH, r, axis=2), jnp.repeat(v_BSKU, r, axis=2)
        if sinks_KG is not None:
            sinks_KG = sinks_KG.reshape(K * r, G // r)
    batch = live_axes("activation_batch", rules, mesh, B)
    heads = tp_axes or None
    split = tuple(batch or ()) + tuple(heads or ())  # the axes each device's share differs over
    args = [q_BTKGH, k_BSKH, v_BSKU, vis]
    specs = [P(batch, None, heads, None, None), P(batch, None, heads, None), P(batch, None, heads, None),
             jax.tree.map(lambda _: P(batch, None), vis)]
    optional = {"sinks": (sinks_KG, P(heads, None)), "rng": (dropout_rng, P())}
    names = [name for name, (value, _) in optional.items() if value is not None]
    args += [optional[name][0] for name in names]
    specs += [optional[name][1] for name in names]

    def per_device(q, k, v, vis, *rest):
        extra = dict(zip(names, rest))
        rng = extra.get("rng")
        if rng is not None:  # distinct dropout masks per device
            for axis in split:
                rng = jax.random.fold_in(rng, jax.lax.axis_index(axis))
        out = kernels.attention(q, k, v, spec, vis, sinks_KG=extra.get("sinks"), dropout_rng=rng, **kwargs)
        if return_max_logit:
            return out[0], jax.lax.pmax(out[1], split) if split else out[1]
        return out

    o_spec = P(batch, None, heads, None, None)
    out = jax.shard_map(per_device, mesh=mesh, in_specs=tuple(specs),
                        out_specs=(o_spec, P()) if return_max_logit else o_spec, check_vma=False)(*args)
    o_BTKGU, max_logit = out if return_max_logit else (out, None)
    o_BTKGU = o_BTKGU.reshape(B, T, K, G, o_BTKGU.shape[-1])
    return (o_BTKGU, jax.lax.stop_gradient(max_logit)) if return_max_logit else o_BTKGU
