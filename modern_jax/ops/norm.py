"""The fused norm under `shard_map`: each device normalises its own rows.

Letters: B batch, T length, N heads, H head dim.

XLA cannot split a Pallas call, so under a sharded `jit` the kernel would see gathered
inputs; here it runs per device over the batch shard and, for QK-norm of q/k `[B, T, N, H]`,
over the head shard the projections produce (gamma `[H]` replicated), so the projections
are never gathered. QK-norm over the whole projection (`full`, gamma `[N, H]`) with its
heads split has rows whose statistics span devices, which a per-device kernel cannot sum:
`default` runs the reference norm there, which XLA partitions with one all-reduce of
`[B, T]` partial sums, and an explicit `pallas` is refused (a per-device kernel over split
rows would normalise each shard by its own statistics; over gathered rows it would gather
q and k). The reference norm needs no wrapping.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from modern_jax.kernels.backend import UnsupportedFeatureError
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
    if x.ndim == 4:  # QK-norm of q/k [B, T, N, H]: on the head shards of the projections
        x_spec[2] = live_axes("activation_kv_heads", rules, mesh, x.shape[2])
        if x_spec[2] and weight.ndim == 2:  # "full": each row [N, H] spans the head shards
            if NormImpl(impl) is NormImpl.PALLAS:
                raise UnsupportedFeatureError(
                    "norm_impl='pallas' cannot run qk_norm='full' with its heads split over the mesh (each row's "
                    "statistics span devices, which a per-device kernel cannot sum): use norm_impl='default', "
                    "which runs the reference norm there, or keep the heads on one device")
            return kernel_norm(x, weight, bias, kind=kind, eps=eps, impl=NormImpl.REFERENCE)
    specs = (P(*x_spec), P()) + (() if bias is None else (P(),))

    def per_device(x, weight, *bias):
        return kernel_norm(x, weight, *(bias or (None,)), kind=kind, eps=eps, impl=impl)

    args = (x, weight) + (() if bias is None else (bias,))
    return jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=P(*x_spec), check_vma=False)(*args)
