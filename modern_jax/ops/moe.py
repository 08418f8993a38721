"""Tokens to their experts and back: the dispatch a mixture-of-experts layer calls.

Letters (the package legend): M tokens (every leading axis flattened), K experts per token,
E experts, X token-expert assignments (`M K` of them, sorted by expert), D model width,
I / O a projection's input / output width; C slots per expert (capacity dispatch).

The layer chooses `experts[M, K]` and `weights[M, K]` (its router) and hands the expert
computation to `dispatch` as a function `experts_fn(x, matmul)`, where
`matmul(x, w[E, I, O], b[E, O] or None)` applies to each row the weight of that row's
expert. Each dispatch supplies its own `matmul`, so the expert FFN is written once:

- `dense`: every expert on every token (`x[E, M, D]`), combined with zero weight where not
  chosen. E times the work: the numerical oracle of the tests.
- `grouped` (dropless, the default): the `M K` assignments sorted by expert, the experts'
  matmuls as one grouped matmul each (`kernels.grouped`), unsorted and combined.
- `capacity`: the sorted assignments placed in `C = ceil(factor * M * K / E)` slots per
  expert (`x[E, C, D]`, batched matmuls); an expert's assignments past its C-th, in token
  order, are dropped (they add nothing) and counted.

With `on_input` the weight scales the expert's input instead of its output (Llama 4), and
the outputs of the chosen experts are added unweighted.

Under a mesh the dispatch runs under `shard_map`, each device on its own rows of the batch
(split over data x fsdp x expert): sorting and grouped matmuls stay local, where a sharded
sort would gather the batch (a capacity bound then counts each device's tokens). With the
experts unsplit, that is all (the width split over `tensor` adds its partial sums). When the
mesh splits `experts` (the `expert` axis, size P), each device holds E / P experts and
`exchange` picks how tokens meet them:

- `all_to_all`: route locally, sort the assignments by the device that owns their expert,
  place them in `C` slots per destination (`C = ceil(factor * M_local K / P)`, or every
  assignment with `exchange_factor=None`), swap the slots with one `all_to_all`, run the
  grouped matmuls on the local experts, swap back and combine. Assignments past a
  destination's C slots are dropped and counted; with enough slots the result is exactly
  the unsharded one.
- `ragged_all_to_all` (TPU and GPU; XLA:CPU does not implement it): the same sort, but each
  destination gets exactly its rows, no slots: packed into a receive buffer of `EP X` rows
  (room for the worst case: dropless) or `ceil(factor X)` (sources fill it in device order;
  rows past its end are not sent, dropped and counted).
- `all_gather`: gather every device's tokens along `expert`, run the local experts on the
  assignments they own, and reduce-scatter the weighted outputs back (no drops; better when
  a device holds few experts).

Expert weights enter the shard_map gathered over `fsdp` (their model dimension) and split
over `tensor` along their width: the down projection's partial sums add up by a `psum`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from flax import nnx
from jax.sharding import PartitionSpec as P

from modern_jax.kernels.backend import UnsupportedFeatureError
from modern_jax.kernels.grouped import grouped_matmul
from modern_jax import execution
from modern_jax.sharding.config import MOE_EXCHANGES
from modern_jax.sharding.context import active, strategies
from modern_jax.sharding.rules import axis_position, live_axes, logical_to_spec, mesh_axes
from modern_jax.sharding.targets import platform

def dispatch(x_MD, experts_MK, weights_MK, experts_fn, *, n_experts: int, on_input: bool = False,
             batch: int | None = None):
    """`(y[M, D], dropped)`: the weighted sum of each token's chosen experts' outputs and the
    number of assignments a capacity bound dropped (0 for the dropless dispatches), by the
    active `execution.moe_dispatch` (and grouped matmul) and, experts split over a mesh, the
    active `moe_exchange` strategy.

    `experts_fn(x, matmul)`: the expert FFN, an `nnx.Module` when experts may be split over a
    mesh (its weights enter the shard_map); `batch`: the B of the `M = B T` rows, whose
    sharding the rows keep."""
    run, strategy = execution.current(), strategies()
    exchange, exchange_factor = strategy.moe_exchange, strategy.moe_exchange_factor
    local = dict(kind=run.moe_dispatch, n_experts=n_experts, on_input=on_input,
                 capacity_factor=run.moe_capacity_factor, grouped_impl=run.moe_grouped_impl)
    split = _mesh_split(n_experts, batch or x_MD.shape[0])
    if split is not None:
        return _under_mesh(split, x_MD, experts_MK, weights_MK, experts_fn, local, exchange, exchange_factor)
    return _local(x_MD, experts_MK, weights_MK, experts_fn, **local)


def _local(x_MD, experts_MK, weights_MK, experts_fn, *, kind, n_experts, on_input, capacity_factor, grouped_impl,
           psum_axes=()):
    """The dispatch over every expert, on these rows (one device's, under a mesh). `psum_axes`:
    the mesh axes that split the expert width, whose partial sums the row-parallel matmul adds."""
    if kind == "dense":
        return _dense(x_MD, experts_MK, weights_MK, experts_fn, n_experts, on_input, psum_axes), jnp.zeros(
            (), jnp.int32)
    if kind not in ("grouped", "capacity"):
        raise ValueError(f"moe_dispatch={kind!r}: expected one of {', '.join(execution.MOE_DISPATCHES)}")
    M, K = experts_MK.shape
    E = n_experts
    expert_X = experts_MK.reshape(M * K)
    order_X = jnp.argsort(expert_X, stable=True)  # by expert; within an expert, in token order
    token_X, expert_X = order_X // K, expert_X[order_X]
    x_XD = x_MD[token_X]
    if on_input:
        x_XD = x_XD * weights_MK.reshape(M * K)[order_X][:, None].astype(x_XD.dtype)
    if kind == "grouped":
        y_XD, kept_X = _grouped(x_XD, expert_X, E, experts_fn, grouped_impl, psum_axes), None
    else:
        C = math.ceil(capacity_factor * M * K / E)
        y_XD, kept_X = _capacity(x_XD, expert_X, experts_fn, E, C, psum_axes)
    y_MKD = y_XD[jnp.argsort(order_X)].reshape(M, K, -1)  # back to token order
    combine_MK = jnp.ones_like(weights_MK) if on_input else weights_MK
    y_MD = jnp.einsum("MKD,MK->MD", y_MKD, combine_MK.astype(y_MKD.dtype))
    dropped = jnp.zeros((), jnp.int32) if kept_X is None else M * K - jnp.sum(kept_X.astype(jnp.int32))
    return y_MD, dropped


def _reduced(y, reduce: bool, psum_axes):
    """A row-parallel matmul's partial sums, added over the axes that split its contraction."""
    return jax.lax.psum(y, psum_axes) if reduce and psum_axes else y


def _dense(x_MD, experts_MK, weights_MK, experts_fn, E: int, on_input: bool, psum_axes=()):
    chosen_MKE = jax.nn.one_hot(experts_MK, E, dtype=jnp.float32)
    weight_ME = jnp.einsum("MKE,MK->ME", chosen_MKE, weights_MK.astype(jnp.float32))
    x_EMD = jnp.broadcast_to(x_MD[None], (E, *x_MD.shape))
    if on_input:
        x_EMD = x_EMD * weight_ME.T[:, :, None].astype(x_MD.dtype)
        weight_ME = jnp.sum(chosen_MKE, axis=1)  # the chosen experts' outputs, unweighted

    def matmul(x_EMI, w_EIO, b_EO=None, reduce=False):
        y_EMO = _reduced(jnp.einsum("EMI,EIO->EMO", x_EMI, w_EIO.astype(x_EMI.dtype)), reduce, psum_axes)
        return y_EMO if b_EO is None else y_EMO + b_EO.astype(y_EMO.dtype)[:, None, :]

    y_EMD = experts_fn(x_EMD, matmul)
    return jnp.einsum("EMD,ME->MD", y_EMD, weight_ME.astype(y_EMD.dtype))


def _grouped(x_XD, expert_X, E: int, experts_fn, impl: str, psum_axes=()):
    """The E experts on rows sorted by expert; a row with id E or more belongs to none (output 0,
    plus the last expert's bias: such rows are never read back)."""
    sizes_E = jnp.zeros((E,), jnp.int32).at[expert_X].add(1, mode="drop")

    def matmul(x_XI, w_EIO, b_EO=None, reduce=False):
        y_XO = _reduced(grouped_matmul(x_XI, w_EIO, sizes_E, impl=impl), reduce, psum_axes)
        return y_XO if b_EO is None else y_XO + b_EO.astype(y_XO.dtype)[jnp.minimum(expert_X, E - 1)]

    return experts_fn(x_XD, matmul)


def _slots(group_X, n_groups: int, C: int):
    """`(kept, slot)` of rows sorted by group: row x takes slot `group * C + its place in the
    group's queue` if that place is below C, else it is dropped and points past the end."""
    sizes_G = jnp.zeros((n_groups,), jnp.int32).at[group_X].add(1)
    rank_X = jnp.arange(group_X.shape[0]) - (jnp.cumsum(sizes_G) - sizes_G)[group_X]
    kept_X = rank_X < C
    return kept_X, jnp.where(kept_X, group_X * C + rank_X, n_groups * C)


def _place(x_XD, slot_X, n_slots: int, fill=0):
    """Rows into their slots `[n_slots, ...]` (slots past the end dropped, empty ones `fill`)."""
    return jnp.full((n_slots, *x_XD.shape[1:]), fill, x_XD.dtype).at[slot_X].set(x_XD, mode="drop")


def _take(y_SD, kept_X, slot_X):
    """Each row's output back from its slot; 0 for a dropped row."""
    y_XD = y_SD[jnp.minimum(slot_X, y_SD.shape[0] - 1)]
    return jnp.where(kept_X[:, None], y_XD, jnp.zeros((), y_XD.dtype))


def _capacity(x_XD, expert_X, experts_fn, E: int, C: int, psum_axes=()):
    kept_X, slot_X = _slots(expert_X, E, C)  # an expert's queue in token order
    x_ECD = _place(x_XD, slot_X, E * C).reshape(E, C, -1)

    def matmul(x_ECI, w_EIO, b_EO=None, reduce=False):
        y_ECO = _reduced(jnp.einsum("ECI,EIO->ECO", x_ECI, w_EIO.astype(x_ECI.dtype)), reduce, psum_axes)
        return y_ECO if b_EO is None else y_ECO + b_EO.astype(y_ECO.dtype)[:, None, :]

    y_ECD = experts_fn(x_ECD, matmul)
    return _take(y_ECD.reshape(E * C, -1), kept_X, slot_X), kept_X


# ----- expert parallelism ------------------------------------------------------------------

def _mesh_split(n_experts: int, batch: int):
    """`(mesh, rules, expert axes, batch axes, tensor axes)` when a mesh is active and splits the
    rows, the experts or their width (so each device dispatches its own rows)."""
    state = active()
    if state is None:
        return None
    mesh, rules = state
    experts = live_axes("experts", rules, mesh, n_experts) or ()
    rows = live_axes("activation_batch", rules, mesh, batch) or ()
    tensor = tuple(a for a in mesh_axes("mlp", rules) if mesh.shape.get(a, 1) > 1)
    if not (experts or rows or tensor):
        return None
    if not set(experts) <= set(rows):
        raise ValueError(f"the experts are split over {'x'.join(experts)} but the batch ({batch} rows) is not "
                         f"(batch axes: {'x'.join(rows) or 'none'}): map activation_batch to include "
                         f"{'x'.join(experts)} and make the batch divisible by it")
    return mesh, rules, experts, rows, tensor


def _under_mesh(split, x_MD, experts_MK, weights_MK, experts_module, local, exchange, factor):
    """The dispatch under `shard_map`: each device its own rows; with the experts split, the exchange."""
    mesh, rules, ep_axes, row_axes, tensor_axes = split
    E, on_input, impl = local["n_experts"], local["on_input"], local["grouped_impl"]
    if exchange not in MOE_EXCHANGES:
        raise ValueError(f"moe_exchange={exchange!r}: expected one of {', '.join(MOE_EXCHANGES)}")
    if exchange == "ragged_all_to_all" and platform() not in ("tpu", "gpu"):
        raise UnsupportedFeatureError(f"parallel.moe_exchange='ragged_all_to_all' needs a TPU or a GPU: "
                                      f"XLA:{platform().upper()} does not implement it; use all_to_all or all_gather "
                                      f"here")
    EP = math.prod(mesh.shape[a] for a in ep_axes)
    graphdef, state, rest = nnx.split(experts_module, nnx.Param, ...)  # rest: what nnx.capture attaches

    def weight_spec(var):  # the model dimension whole (gathered over fsdp), experts and width split
        axes = var.get_metadata()["out_sharding"]
        if len(axes) > len(var.shape):  # one layer of a stack: its metadata still names the stacked axis
            axes = tuple(a for a in axes if a != "layers")
        axes = tuple(None if a == "embed" else a for a in axes)
        return logical_to_spec(axes, rules, mesh, var.shape)

    state_specs = jax.tree.map(weight_spec, state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    rows = P(row_axes or None, None)

    def per_device(state, x_mD, experts_mK, weights_mK):
        experts = nnx.merge(graphdef, state, rest)
        if EP == 1:  # every expert here: the single-device dispatch on this device's rows
            y_mD, dropped = _local(x_mD, experts_mK, weights_mK, experts, psum_axes=tensor_axes, **local)
            return y_mD, jax.lax.psum(dropped, row_axes) if row_axes else dropped
        E_local = E // EP
        first = axis_position(ep_axes) * E_local  # the first expert this device owns

        def sort_and_run(x_RD, local_R):  # the local experts; ids >= E_local: no expert here
            order_R = jnp.argsort(local_R, stable=True)
            y_RD = _grouped(x_RD[order_R], local_R[order_R], E_local, experts, impl, tensor_axes)
            return y_RD[jnp.argsort(order_R)]

        m, K = experts_mK.shape
        combine_mK = jnp.ones_like(weights_mK) if on_input else weights_mK
        scale = (lambda x, w: x * w[:, None].astype(x.dtype)) if on_input else (lambda x, w: x)  # noqa: E731
        if exchange == "all_gather":
            x_AD = jax.lax.all_gather(x_mD, ep_axes, tiled=True)  # every token of the expert group
            experts_AK = jax.lax.all_gather(experts_mK, ep_axes, tiled=True)
            weights_AK = jax.lax.all_gather(weights_mK, ep_axes, tiled=True)
            local_X = experts_AK.reshape(-1) - first
            mine_X = (local_X >= 0) & (local_X < E_local)
            x_XD = scale(jnp.repeat(x_AD, K, axis=0), weights_AK.reshape(-1))
            y_XD = sort_and_run(x_XD, jnp.where(mine_X, local_X, E_local))
            combine_AK = (jnp.ones_like(weights_AK) if on_input else weights_AK) * mine_X.reshape(-1, K)
            y_AD = jnp.einsum("AKD,AK->AD", y_XD.reshape(-1, K, y_XD.shape[-1]), combine_AK.astype(y_XD.dtype))
            return jax.lax.psum_scatter(y_AD, ep_axes, scatter_dimension=0, tiled=True), jnp.zeros((), jnp.int32)

        X = m * K
        expert_X = experts_mK.reshape(X)
        order_X = jnp.argsort(expert_X, stable=True)
        expert_X = expert_X[order_X]
        x_XD = scale(x_mD[order_X // K], weights_mK.reshape(X)[order_X])
        dest_X = expert_X // E_local
        D = x_mD.shape[-1]
        if exchange == "ragged_all_to_all":
            kept_X, y_XD = _ragged_exchange(x_XD, expert_X - dest_X * E_local, dest_X, EP, E_local, factor, ep_axes,
                                            sort_and_run)
            return _combined(y_XD, order_X, combine_mK, row_axes, kept_X)
        C = X if factor is None else min(X, math.ceil(factor * X / EP))  # slots per destination device
        kept_X, slot_X = _slots(dest_X, EP, C)  # a destination's slots in token order
        send_PCD = _place(x_XD, slot_X, EP * C).reshape(EP, C, D)
        ids_PC = _place((expert_X - dest_X * E_local).astype(jnp.int32), slot_X, EP * C, fill=E_local).reshape(EP, C)
        recv_PCD = jax.lax.all_to_all(send_PCD, ep_axes, 0, 0, tiled=True)  # slot p: from device p
        recv_ids_PC = jax.lax.all_to_all(ids_PC, ep_axes, 0, 0, tiled=True)
        y_RD = sort_and_run(recv_PCD.reshape(EP * C, D), recv_ids_PC.reshape(EP * C))
        back_PCD = jax.lax.all_to_all(y_RD.reshape(EP, C, D), ep_axes, 0, 0, tiled=True)
        return _combined(_take(back_PCD.reshape(EP * C, D), kept_X, slot_X), order_X, combine_mK, row_axes, kept_X)

    return jax.shard_map(per_device, mesh=mesh, in_specs=(state_specs, rows, rows, rows), out_specs=(rows, P()),
                         check_vma=False)(state, x_MD, experts_MK, weights_MK)


def _combined(y_XD, order_X, combine_mK, row_axes, kept_X):
    """`(y[m, D], dropped over the mesh)` from the outputs of the expert-sorted assignments."""
    m, K = combine_mK.shape
    y_mKD = y_XD[jnp.argsort(order_X)].reshape(m, K, -1)
    y_mD = jnp.einsum("MKD,MK->MD", y_mKD, combine_mK.astype(y_mKD.dtype))
    return y_mD, jax.lax.psum(m * K - jnp.sum(kept_X.astype(jnp.int32)), row_axes)


def _ragged_exchange(x_XD, local_X, dest_X, EP: int, E_local: int, factor, ep_axes, run):
    """`(kept, y)`: the assignments (sorted by expert, so by destination) sent to their experts'
    devices with `ragged_all_to_all`, run there by `run(x, local expert ids)`, and sent back.

    Each device receives into a buffer of `R` rows: every assignment of the group (`EP X`, the
    worst case, nothing dropped) or `ceil(factor X)`. Sources fill a receiver's buffer in device
    order; the rows that would pass its end are not sent, and count as dropped."""
    X, D = x_XD.shape
    R = EP * X if factor is None else max(1, math.ceil(factor * X))
    send_P = jnp.zeros((EP,), jnp.int32).at[dest_X].add(1)
    sizes_SP = jax.lax.all_gather(send_P, ep_axes)  # rows each source sends each destination
    before_SP = jnp.cumsum(sizes_SP, axis=0) - sizes_SP  # where a source's rows start at their destination
    fits_SP = jnp.clip(R - before_SP, 0, sizes_SP)  # what the destination's buffer has room for
    me = axis_position(ep_axes)
    start_P = jnp.cumsum(send_P) - send_P  # where each destination's rows start here
    kept_X = jnp.arange(X) - start_P[dest_X] < fits_SP[me][dest_X]
    send_P, out_off_P, recv_P = fits_SP[me], before_SP[me], fits_SP[:, me]
    exchange = lambda rows, into, *offsets: jax.lax.ragged_all_to_all(  # noqa: E731
        rows, into, *offsets, axis_name=ep_axes)
    recv_RD = exchange(x_XD, jnp.zeros((R, D), x_XD.dtype), start_P, send_P, out_off_P, recv_P)
    ids_R = exchange(local_X.astype(jnp.int32), jnp.full((R,), E_local, jnp.int32), start_P, send_P, out_off_P,
                     recv_P)  # unfilled rows: no expert here
    y_RD = run(recv_RD, ids_R)
    recv_start_P = before_SP[:, me]  # where each source's rows sit in this buffer
    home_P = (jnp.cumsum(sizes_SP, axis=1) - sizes_SP)[:, me]  # where they came from in each source's rows
    y_XD = exchange(y_RD, jnp.zeros((X, D), y_RD.dtype), recv_start_P, recv_P, home_P, send_P)
    return kept_X, jnp.where(kept_X[:, None], y_XD, jnp.zeros((), y_XD.dtype))
