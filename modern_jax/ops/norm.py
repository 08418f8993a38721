"""The fused norm under `shard_map`: each device normalises its own rows.

XLA cannot split a Pallas call, so under a sharded `jit` the kernel would see gathered
inputs; here it runs per device over the batch shard (and the head shard for QK-norm
over `[B, T, N, H]`). The reference norm needs no wrapping: XLA partitions it itself.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from modern_jax.kernels.norm import NormImpl, resolve
from modern_jax.kernels.norm import norm as kernel_norm
from modern_jax.sharding import active, live_axes


def norm(x, weight, bias=None, *, kind="rmsnorm", eps=1e-6, impl="reference"):
    """`kernels.norm.norm`, per device under shard_map when a mesh is active and a kernel runs."""
    state = active()
    if state is None or resolve(impl) is NormImpl.REFERENCE:
        return kernel_norm(x, weight, bias, kind=kind, eps=eps, impl=impl)
    mesh, rules = state
    x_spec = [live_axes("activation_batch", rules, mesh, x.shape[0])] + [None] * (x.ndim - 1)
    w_spec = [None] * weight.ndim
    if x.ndim == 4 and weight.ndim == 2:  # QK-norm over whole projections [B, T, N, H] with gamma [N, H]
        x_spec[2] = w_spec[0] = live_axes("activation_kv_heads", rules, mesh, x.shape[2])
    specs = (P(*x_spec), P(*w_spec)) + (() if bias is None else (P(*w_spec),))

    def per_device(x, weight, *bias):
        return kernel_norm(x, weight, *(bias or (None,)), kind=kind, eps=eps, impl=impl)

    args = (x, weight) + (() if bias is None else (bias,))
    return jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=P(*x_spec), check_vma=False)(*args)
