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
the outputs of the chosen experts are added unweighted. Expert parallelism plugs in here:
the same three functions over the devices' local experts, behind the same call.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from modern_jax.kernels.grouped import grouped_matmul

DISPATCHES = ("grouped", "dense", "capacity")


def dispatch(kind: str, x_MD, experts_MK, weights_MK, experts_fn, *, n_experts: int, on_input: bool = False,
             capacity_factor: float = 1.0, grouped_impl: str = "default"):
    """`(y[M, D], dropped)`: the weighted sum of each token's chosen experts' outputs and the
    number of assignments a capacity bound dropped (0 for the dropless dispatches)."""
    if kind == "dense":
        return _dense(x_MD, experts_MK, weights_MK, experts_fn, n_experts, on_input), jnp.zeros((), jnp.int32)
    if kind not in ("grouped", "capacity"):
        raise ValueError(f"moe_dispatch={kind!r}: expected one of {', '.join(DISPATCHES)}")
    M, K = experts_MK.shape
    E = n_experts
    expert_X = experts_MK.reshape(M * K)
    order_X = jnp.argsort(expert_X, stable=True)  # by expert; within an expert, in token order
    token_X, expert_X = order_X // K, expert_X[order_X]
    x_XD = x_MD[token_X]
    if on_input:
        x_XD = x_XD * weights_MK.reshape(M * K)[order_X][:, None].astype(x_XD.dtype)
    sizes_E = jnp.zeros((E,), jnp.int32).at[expert_X].add(1)
    if kind == "grouped":
        y_XD, kept_X = _grouped(x_XD, expert_X, sizes_E, experts_fn, grouped_impl), None
    else:
        y_XD, kept_X = _capacity(x_XD, expert_X, sizes_E, experts_fn, E, math.ceil(capacity_factor * M * K / E))
    y_MKD = y_XD[jnp.argsort(order_X)].reshape(M, K, -1)  # back to token order
    combine_MK = jnp.ones_like(weights_MK) if on_input else weights_MK
    y_MD = jnp.einsum("MKD,MK->MD", y_MKD, combine_MK.astype(y_MKD.dtype))
    dropped = jnp.zeros((), jnp.int32) if kept_X is None else M * K - jnp.sum(kept_X.astype(jnp.int32))
    return y_MD, dropped


def _dense(x_MD, experts_MK, weights_MK, experts_fn, E: int, on_input: bool):
    chosen_MKE = jax.nn.one_hot(experts_MK, E, dtype=jnp.float32)
    weight_ME = jnp.einsum("MKE,MK->ME", chosen_MKE, weights_MK.astype(jnp.float32))
    x_EMD = jnp.broadcast_to(x_MD[None], (E, *x_MD.shape))
    if on_input:
        x_EMD = x_EMD * weight_ME.T[:, :, None].astype(x_MD.dtype)
        weight_ME = jnp.sum(chosen_MKE, axis=1)  # the chosen experts' outputs, unweighted

    def matmul(x_EMI, w_EIO, b_EO=None):
        y_EMO = jnp.einsum("EMI,EIO->EMO", x_EMI, w_EIO.astype(x_EMI.dtype))
        return y_EMO if b_EO is None else y_EMO + b_EO.astype(y_EMO.dtype)[:, None, :]

    y_EMD = experts_fn(x_EMD, matmul)
    return jnp.einsum("EMD,ME->MD", y_EMD, weight_ME.astype(y_EMD.dtype))


def _grouped(x_XD, expert_X, sizes_E, experts_fn, impl: str):
    def matmul(x_XI, w_EIO, b_EO=None):
        y_XO = grouped_matmul(x_XI, w_EIO, sizes_E, impl=impl)
        return y_XO if b_EO is None else y_XO + b_EO.astype(y_XO.dtype)[expert_X]

    return experts_fn(x_XD, matmul)


def _capacity(x_XD, expert_X, sizes_E, experts_fn, E: int, C: int):
    starts_E = jnp.cumsum(sizes_E) - sizes_E
    rank_X = jnp.arange(expert_X.shape[0]) - starts_E[expert_X]  # place in its expert's queue
    kept_X = rank_X < C
    slot_X = jnp.where(kept_X, expert_X * C + rank_X, E * C)  # dropped ones point past the end
    x_ECD = jnp.zeros((E * C, x_XD.shape[-1]), x_XD.dtype).at[slot_X].set(x_XD, mode="drop").reshape(E, C, -1)

    def matmul(x_ECI, w_EIO, b_EO=None):
        y_ECO = jnp.einsum("ECI,EIO->ECO", x_ECI, w_EIO.astype(x_ECI.dtype))
        return y_ECO if b_EO is None else y_ECO + b_EO.astype(y_ECO.dtype)[:, None, :]

    y_ECD = experts_fn(x_ECD, matmul)
    y_XD = y_ECD.reshape(E * C, -1)[jnp.minimum(slot_X, E * C - 1)]
    return jnp.where(kept_X[:, None], y_XD, jnp.zeros((), y_XD.dtype)), kept_X
