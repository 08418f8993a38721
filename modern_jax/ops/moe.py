"""Tokens to their experts and back: the dispatch a mixture-of-experts layer calls.

Letters (the package legend): M tokens (every leading axis flattened), Y experts chosen per
token, E experts, Z token-expert assignments (`M Y` of them, sorted by expert; an expert's or
a device's slots are a chunk of them), D model width, W / O a projection's input / output
width, P the devices of the `expert` axis.

The layer chooses `experts[M, Y]` and `weights[M, Y]` (its router) and hands the expert
computation to `dispatch` as a function `experts_fn(x, matmul)`, where
`matmul(x, w[E, W, O], b[E, O] or None)` applies to each row the weight of that row's
expert. Each dispatch supplies its own `matmul`, so the expert FFN is written once:

- `dense`: every expert on every token (`x[E, M, D]`), combined with zero weight where not
  chosen. E times the work: the numerical oracle of the tests.
- `grouped` (dropless, the default): the `M Y` assignments sorted by expert, the experts'
  matmuls as one grouped matmul each (`kernels.grouped`), unsorted and combined.
- `capacity`: the sorted assignments placed in `ceil(factor * M * Y / E)` slots per expert
  (`x[E, Z, D]`, batched matmuls); an expert's assignments past its last slot, in token
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
  place them in `ceil(factor * M_local Y / P)` slots per destination (or every assignment
  with `exchange_factor=None`), swap the slots with one `all_to_all`, run the grouped
  matmuls on the local experts, swap back and combine. Assignments past a destination's
  slots are dropped and counted; with enough slots the result is exactly
  the unsharded one.
- `ragged_all_to_all` (TPU and GPU; XLA:CPU does not implement it): the same sort, but each
  destination gets exactly its rows, no slots: packed into a receive buffer of `P Z` rows
  (room for the worst case: dropless) or `ceil(factor Z)` (sources fill it in device order;
  rows past its end are not sent, dropped and counted).
- `all_gather`: gather every device's tokens along `expert`, run the local experts on the
  assignments they own, and reduce-scatter the weighted outputs back (no drops; better when
  a device holds few experts).

Expert weights enter the shard_map gathered over `fsdp` (their model dimension; in the compute
dtype when every device holds every expert) and split over `tensor` along their width: the
down projection's partial sums add up by a `psum`. Activations stay in the compute dtype
throughout (the grouped matmul accumulates in float32 and writes the compute dtype); the
router's scores and the combine weights are computed in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from flax import nnx
from jax.sharding import PartitionSpec as P

from modern_jax.kernels.backend import UnsupportedFeatureError
from modern_jax.kernels.grouped import grouped_matmul
from modern_jax import execution
from modern_jax.sharding.config import MOE_EXCHANGES
from modern_jax.sharding.context import active, strategies
from modern_jax.sharding.rules import axis_position, live_axes, logical_to_spec, mesh_axes
from modern_jax.sharding.devices import platform


def dispatch(x_MD, experts_MY, weights_MY, experts_fn, *, n_experts: int, on_input: bool = False,
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
        return _under_mesh(split, x_MD, experts_MY, weights_MY, experts_fn, local, exchange, exchange_factor)
    return _local(x_MD, experts_MY, weights_MY, experts_fn, **local)


@jax.named_scope("dispatch")
def _sort(x_MD, experts_MY, weights_MY, on_input: bool, by_expert: bool = True):
    """`(x[Z, D], expert[Z], order[Z])`: the token-expert assignments, sorted by expert (within
    an expert in token order; `by_expert=False`: in token order, `order` None), each a copy of
    its token's row, scaled by its weight when `on_input`."""
    M, Y = experts_MY.shape
    expert_Z, weight_Z, token_Z = experts_MY.reshape(M * Y), weights_MY.reshape(M * Y), jnp.arange(M * Y) // Y
    order_Z = None
    if by_expert:
        order_Z = jnp.argsort(expert_Z, stable=True)
        expert_Z, weight_Z, token_Z = expert_Z[order_Z], weight_Z[order_Z], order_Z // Y
    x_ZD = x_MD[token_Z]
    if on_input:
        x_ZD = x_ZD * weight_Z[:, None].astype(x_ZD.dtype)
    return checkpoint_name(x_ZD, "moe_dispatched"), expert_Z, order_Z


@jax.named_scope("combine")
def _combine(y_ZD, order_Z, weights_MY, on_input: bool, keep_MY=None):
    """`y[M, D]`: the assignments' outputs back in token order (`order_Z` from `_sort`), each
    token's summed with their weights (unweighted when `on_input`; an assignment not in
    `keep_MY` adds nothing)."""
    M, Y = weights_MY.shape
    y_MYD = (y_ZD if order_Z is None else y_ZD[jnp.argsort(order_Z)]).reshape(M, Y, -1)
    combine_MY = jnp.ones_like(weights_MY) if on_input else weights_MY
    if keep_MY is not None:
        combine_MY = combine_MY * keep_MY
    return checkpoint_name(jnp.einsum("MYD,MY->MD", y_MYD, combine_MY.astype(y_MYD.dtype)), "moe_combined")


def _local(x_MD, experts_MY, weights_MY, experts_fn, *, kind, n_experts, on_input, capacity_factor, grouped_impl,
           psum_axes=()):
    """The dispatch over every expert, on these rows (one device's, under a mesh). `psum_axes`:
    the mesh axes that split the expert width, whose partial sums the row-parallel matmul adds."""
    if kind == "dense":
        return _dense(x_MD, experts_MY, weights_MY, experts_fn, n_experts, on_input, psum_axes), jnp.zeros(
            (), jnp.int32)
    if kind not in ("grouped", "capacity"):
        raise ValueError(f"moe_dispatch={kind!r}: expected one of {', '.join(execution.MOE_DISPATCHES)}")
    M, Y = experts_MY.shape
    E = n_experts
    x_ZD, expert_Z, order_Z = _sort(x_MD, experts_MY, weights_MY, on_input)
    if kind == "grouped":
        y_ZD, kept_Z = _grouped(x_ZD, expert_Z, E, experts_fn, grouped_impl, psum_axes), None
    else:
        slots = math.ceil(capacity_factor * M * Y / E)
        y_ZD, kept_Z = _capacity(x_ZD, expert_Z, experts_fn, E, slots, psum_axes)
    dropped = jnp.zeros((), jnp.int32) if kept_Z is None else M * Y - jnp.sum(kept_Z.astype(jnp.int32))
    return _combine(y_ZD, order_Z, weights_MY, on_input), dropped


def _reduced(y, reduce: bool, psum_axes):
    """A row-parallel matmul's partial sums, added over the axes that split its contraction."""
    return jax.lax.psum(y, psum_axes) if reduce and psum_axes else y


def _dense(x_MD, experts_MY, weights_MY, experts_fn, E: int, on_input: bool, psum_axes=()):
    with jax.named_scope("dispatch"):
        chosen_MYE = jax.nn.one_hot(experts_MY, E, dtype=jnp.float32)
        weight_ME = jnp.einsum("MYE,MY->ME", chosen_MYE, weights_MY.astype(jnp.float32))
        x_EMD = jnp.broadcast_to(x_MD[None], (E, *x_MD.shape))
        if on_input:
            x_EMD = x_EMD * weight_ME.T[:, :, None].astype(x_MD.dtype)
            weight_ME = jnp.sum(chosen_MYE, axis=1)  # the chosen experts' outputs, unweighted
        x_EMD = checkpoint_name(x_EMD, "moe_dispatched")

    def matmul(x_EMW, w_EWO, b_EO=None, reduce=False):
        y_EMO = _reduced(jnp.einsum("EMW,EWO->EMO", x_EMW, w_EWO.astype(x_EMW.dtype)), reduce, psum_axes)
        return y_EMO if b_EO is None else y_EMO + b_EO.astype(y_EMO.dtype)[:, None, :]

    y_EMD = experts_fn(x_EMD, matmul)
    with jax.named_scope("combine"):
        return checkpoint_name(jnp.einsum("EMD,ME->MD", y_EMD, weight_ME.astype(y_EMD.dtype)), "moe_combined")


def _grouped(x_ZD, expert_Z, E: int, experts_fn, impl: str, psum_axes=()):
    """The E experts on rows sorted by expert; a row with id E or more belongs to none (output 0,
    plus the last expert's bias: such rows are never read back)."""
    sizes_E = jnp.zeros((E,), jnp.int32).at[expert_Z].add(1, mode="drop")

    def matmul(x_ZW, w_EWO, b_EO=None, reduce=False):
        y_ZO = _reduced(grouped_matmul(x_ZW, w_EWO, sizes_E, impl=impl), reduce, psum_axes)
        return y_ZO if b_EO is None else y_ZO + b_EO.astype(y_ZO.dtype)[jnp.minimum(expert_Z, E - 1)]

    return experts_fn(x_ZD, matmul)


def _slots(group_Z, n_groups: int, slots: int):
    """`(kept, slot)` of rows sorted by group: row z takes slot `group * slots + its place in the
    group's queue` if that place is below `slots`, else it is dropped and points past the end."""
    queued = jnp.zeros((n_groups,), jnp.int32).at[group_Z].add(1)  # [n_groups]: experts or devices, no one letter
    rank_Z = jnp.arange(group_Z.shape[0]) - (jnp.cumsum(queued) - queued)[group_Z]
    kept_Z = rank_Z < slots
    return kept_Z, jnp.where(kept_Z, group_Z * slots + rank_Z, n_groups * slots)


def _place(x_ZD, slot_Z, n_slots: int, fill=0):
    """Rows into their slots `[n_slots, ...]` (slots past the end dropped, empty ones `fill`)."""
    return jnp.full((n_slots, *x_ZD.shape[1:]), fill, x_ZD.dtype).at[slot_Z].set(x_ZD, mode="drop")


def _take(slots_ZD, kept_Z, slot_Z):
    """Each row's output back from its slot; 0 for a dropped row."""
    y_ZD = slots_ZD[jnp.minimum(slot_Z, slots_ZD.shape[0] - 1)]
    return jnp.where(kept_Z[:, None], y_ZD, jnp.zeros((), y_ZD.dtype))


def _capacity(x_ZD, expert_Z, experts_fn, E: int, slots: int, psum_axes=()):
    kept_Z, slot_Z = _slots(expert_Z, E, slots)  # an expert's queue in token order
    x_EZD = _place(x_ZD, slot_Z, E * slots).reshape(E, slots, -1)

    def matmul(x_EZW, w_EWO, b_EO=None, reduce=False):
        y_EZO = _reduced(jnp.einsum("EZW,EWO->EZO", x_EZW, w_EWO.astype(x_EZW.dtype)), reduce, psum_axes)
        return y_EZO if b_EO is None else y_EZO + b_EO.astype(y_EZO.dtype)[:, None, :]

    y_EZD = experts_fn(x_EZD, matmul)
    return _take(y_EZD.reshape(E * slots, -1), kept_Z, slot_Z), kept_Z


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


def _under_mesh(split, x_MD, experts_MY, weights_MY, experts_module, local, exchange, factor):
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
    is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731

    def whole_model_dim(var):  # the model dimension whole (gathered over fsdp), experts and width split
        axes = var.get_metadata()["out_sharding"]
        if len(axes) > len(var.shape):  # one layer of a stack: its metadata still names the stacked axis
            axes = tuple(a for a in axes if a != "layers")
        return logical_to_spec(tuple(None if a == "embed" else a for a in axes), rules, mesh, var.shape)

    state_specs = jax.tree.map(whole_model_dim, state, is_leaf=is_var)
    if EP == 1:
        # every device gathers every expert: gathered in the compute dtype, and their gradients
        # reduced in it (Mixtral on fsdp 32: 29.42 GiB per chip instead of 31.17). With the
        # experts split the gathers are EP times smaller and the cast measured worse (fsdp 8 x
        # expert 4: 30.27 instead of 30.05), so there the matmuls cast them on arrival.
        # (the experts' own float weights, `nnx.Param` itself: a frozen base's quantized pieces and
        # the parameters a converter adds, of their own Param types, stay as they are)
        cast = lambda v: v.replace(v[...].astype(x_MD.dtype)) if (  # noqa: E731
            jnp.issubdtype(v.dtype, jnp.floating) and type(v) is nnx.Param) else v
        state = jax.tree.map(cast, state, is_leaf=is_var)
    rows = P(row_axes or None, None)

    def per_device(state, x_MD, experts_MY, weights_MY):  # this device's rows
        experts = nnx.merge(graphdef, state, rest)
        if EP == 1:  # every expert here: the single-device dispatch on this device's rows
            y_MD, dropped = _local(x_MD, experts_MY, weights_MY, experts, psum_axes=tensor_axes, **local)
            return y_MD, jax.lax.psum(dropped, row_axes) if row_axes else dropped
        E_local = E // EP
        first = axis_position(ep_axes) * E_local  # the first expert this device owns

        def sort_and_run(x_ZD, local_Z):  # the local experts; ids >= E_local: no expert here
            order_Z = jnp.argsort(local_Z, stable=True)
            y_ZD = _grouped(x_ZD[order_Z], local_Z[order_Z], E_local, experts, impl, tensor_axes)
            return y_ZD[jnp.argsort(order_Z)]

        if exchange == "all_gather":  # every token of the expert group, the assignments in token order
            gather = lambda a: jax.lax.all_gather(a, ep_axes, tiled=True)  # noqa: E731
            all_x_MD, all_experts_MY, all_weights_MY = gather(x_MD), gather(experts_MY), gather(weights_MY)
            x_ZD, expert_Z, _ = _sort(all_x_MD, all_experts_MY, all_weights_MY, on_input, by_expert=False)
            local_Z = expert_Z - first
            mine_Z = (local_Z >= 0) & (local_Z < E_local)
            y_ZD = sort_and_run(x_ZD, jnp.where(mine_Z, local_Z, E_local))
            y_MD = _combine(y_ZD, None, all_weights_MY, on_input, keep_MY=mine_Z.reshape(all_weights_MY.shape))
            return jax.lax.psum_scatter(y_MD, ep_axes, scatter_dimension=0, tiled=True), jnp.zeros((), jnp.int32)

        x_ZD, expert_Z, order_Z = _sort(x_MD, experts_MY, weights_MY, on_input)
        Z, D = x_ZD.shape
        dest_Z = expert_Z // E_local
        if exchange == "ragged_all_to_all":
            kept_Z, y_ZD = _ragged_exchange(x_ZD, expert_Z - dest_Z * E_local, dest_Z, EP, E_local, factor, ep_axes,
                                            sort_and_run)
        else:
            slots = Z if factor is None else min(Z, math.ceil(factor * Z / EP))  # slots per destination device
            kept_Z, slot_Z = _slots(dest_Z, EP, slots)  # a destination's slots in token order
            send_PZD = _place(x_ZD, slot_Z, EP * slots).reshape(EP, slots, D)
            ids_PZ = _place((expert_Z - dest_Z * E_local).astype(jnp.int32), slot_Z, EP * slots,
                            fill=E_local).reshape(EP, slots)
            recv_PZD = jax.lax.all_to_all(send_PZD, ep_axes, 0, 0, tiled=True)  # slot p: from device p
            recv_ids_PZ = jax.lax.all_to_all(ids_PZ, ep_axes, 0, 0, tiled=True)
            y_ZD = sort_and_run(recv_PZD.reshape(EP * slots, D), recv_ids_PZ.reshape(EP * slots))
            back_PZD = jax.lax.all_to_all(y_ZD.reshape(EP, slots, D), ep_axes, 0, 0, tiled=True)
            y_ZD = _take(back_PZD.reshape(EP * slots, D), kept_Z, slot_Z)
        dropped = jax.lax.psum(Z - jnp.sum(kept_Z.astype(jnp.int32)), row_axes)
        return _combine(y_ZD, order_Z, weights_MY, on_input), dropped

    return jax.shard_map(per_device, mesh=mesh, in_specs=(state_specs, rows, rows, rows), out_specs=(rows, P()),
                         check_vma=False)(state, x_MD, experts_MY, weights_MY)


def _ragged_exchange(x_ZD, local_Z, dest_Z, EP: int, E_local: int, factor, ep_axes, run):
    """`(kept, y)`: the assignments (sorted by expert, so by destination) sent to their experts'
    devices with `ragged_all_to_all`, run there by `run(x, local expert ids)`, and sent back.

    Each device receives into a buffer of `room` rows: every assignment of the group (`EP Z`,
    the worst case, nothing dropped) or `ceil(factor Z)`. Sources fill a receiver's buffer in
    device order; the rows that would pass its end are not sent, and count as dropped."""
    Z, D = x_ZD.shape
    room = EP * Z if factor is None else max(1, math.ceil(factor * Z))
    send_P = jnp.zeros((EP,), jnp.int32).at[dest_Z].add(1)
    sizes_PP = jax.lax.all_gather(send_P, ep_axes)  # [source, destination]: the rows one sends the other
    before_PP = jnp.cumsum(sizes_PP, axis=0) - sizes_PP  # where a source's rows start at their destination
    fits_PP = jnp.clip(room - before_PP, 0, sizes_PP)  # what the destination's buffer has room for
    me = axis_position(ep_axes)
    start_P = jnp.cumsum(send_P) - send_P  # where each destination's rows start here
    kept_Z = jnp.arange(Z) - start_P[dest_Z] < fits_PP[me][dest_Z]
    send_P, out_off_P, recv_P = fits_PP[me], before_PP[me], fits_PP[:, me]
    exchange = lambda rows, into, *offsets: jax.lax.ragged_all_to_all(  # noqa: E731
        rows, into, *offsets, axis_name=ep_axes)
    recv_ZD = exchange(x_ZD, jnp.zeros((room, D), x_ZD.dtype), start_P, send_P, out_off_P, recv_P)
    ids_Z = exchange(local_Z.astype(jnp.int32), jnp.full((room,), E_local, jnp.int32), start_P, send_P, out_off_P,
                     recv_P)  # unfilled rows: no expert here
    y_ZD = run(recv_ZD, ids_Z)
    recv_start_P = before_PP[:, me]  # where each source's rows sit in this buffer
    home_P = (jnp.cumsum(sizes_PP, axis=1) - sizes_PP)[:, me]  # where they came from in each source's rows
    y_ZD = exchange(y_ZD, jnp.zeros((Z, D), y_ZD.dtype), recv_start_P, recv_P, home_P, send_P)
    return kept_Z, jnp.where(kept_Z[:, None], y_ZD, jnp.zeros((), y_ZD.dtype))
