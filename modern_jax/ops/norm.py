"""The fused norm under `shard_map`: each device normalises its own rows.

Letters: B batch, T length, N heads, H head dim.

XLA cannot split a Pallas call, so under a sharded `jit` the kernel would see gathered
inputs; here it runs per device over the batch shard, the sequence shard (as it is split
where the norm runs: the residual stream's `activation_norm_length`, over `context` x
`tensor` under sequence parallelism, or `activation_length` inside a tensor-parallel region,
`sharding.sequence.length`) and, for QK-norm of q/k `[B, T, N, H]`,
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

from modern_jax import execution
from modern_jax.kernels.backend import UnsupportedFeatureError
from modern_jax.kernels.norm import NormImpl, resolve
from modern_jax.kernels.norm import add_norm as kernel_add_norm
from modern_jax.kernels.norm import norm as kernel_norm
from modern_jax.sharding import sequence
from modern_jax.sharding.context import active
from modern_jax.sharding.rules import free_axes, live_axes


def norm(x, weight, bias=None, *, kind="rmsnorm", eps=1e-6):
    """`kernels.norm.norm` with the active `execution.norm_impl`, per device under shard_map when a
    mesh is active and a kernel runs (x's second dimension is its sequence)."""
    return _per_device(x, None, weight, bias, kind, eps)


def add_norm(x, residual, weight, bias=None, *, kind="rmsnorm", eps=1e-6):
    """`(h, norm(h))` with `h = residual + x` (`kernels.norm.add_norm`), per device like `norm`."""
    return _per_device(x, residual, weight, bias, kind, eps)


def _per_device(x, residual, weight, bias, kind, eps):
    impl = execution.current().norm_impl

    def kernel(x, residual, weight, bias, impl=impl):
        if residual is None:
            return kernel_norm(x, weight, bias, kind=kind, eps=eps, impl=impl)
        return kernel_add_norm(x, residual, weight, bias, kind=kind, eps=eps, impl=impl)

    state = active()
    if state is None or resolve(impl) is NormImpl.REFERENCE:
        return kernel(x, residual, weight, bias)
    mesh, rules = state
    x_spec = [live_axes("activation_batch", rules, mesh, x.shape[0])] + [None] * (x.ndim - 1)
    if x.ndim >= 3:
        x_spec[1] = free_axes(live_axes(sequence.length(), rules, mesh, x.shape[1]), x_spec[0])
    if x.ndim == 4:  # QK-norm of q/k [B, T, N, H]: on the head shards of the projections
        x_spec[2] = free_axes(live_axes("activation_kv_heads", rules, mesh, x.shape[2]), x_spec[0], x_spec[1])
        if x_spec[2] and weight.ndim == 2:  # "full": each row [N, H] spans the head shards
            if NormImpl(impl) is NormImpl.PALLAS:
                raise UnsupportedFeatureError(
                    "execution.norm_impl='pallas' cannot run qk_norm='full' with its heads split over the mesh (each "
                    "row's statistics span devices, which a per-device kernel cannot sum): use execution.norm_impl="
                    "'default', "
                    "which runs the reference norm there, or keep the heads on one device")
            return kernel(x, residual, weight, bias, impl=NormImpl.REFERENCE)
    rows = P(*x_spec)
    arrays = {"x": (x, rows), "residual": (residual, rows), "weight": (weight, P()), "bias": (bias, P())}
    names = [name for name, (value, _) in arrays.items() if value is not None]

    def per_device(*values):
        given = dict(zip(names, values))
        return kernel(given["x"], given.get("residual"), given["weight"], given.get("bias"))

    return jax.shard_map(per_device, mesh=mesh, in_specs=tuple(arrays[n][1] for n in names),
                         out_specs=rows if residual is None else (rows, rows),
                         check_vma=False)(*(arrays[n][0] for n in names))

