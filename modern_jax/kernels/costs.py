"""What each Pallas kernel declares it costs (`pl.CostEstimate`), for the TPU and GPU kernels alike.

A `pallas_call` is opaque to XLA. Without an estimate the TPU compiler counts only its
operands' and results' bytes, so `compiled.cost_analysis()`, its `optimal_seconds` and the
scheduler that overlaps collectives with compute see the kernel as free of flops. The Triton
lowering (GPU) drops the estimate (jax 0.12); the GPU kernels declare it all the same.

Letters as in the kernels: T, S query and key lengths as the kernel sees them (padded to
whole tiles), H, U key and value head dims, `tile_t` x `tile_s` a kernel's tile; M rows and
D features of a norm.

- flops: attention counts its matmuls, 2 m n k each, over the tiles it visits (the few
  elementwise flops per score, against 2 (H + U) or more of matmul, are left out); a norm is
  all elementwise work, counted one flop per operation and element.
- transcendentals: per visited score an exp, and a tanh under a soft-cap (per-row exps and
  logs, 1 / tile_s of that, are left out); one rsqrt per norm row.
- bytes_accessed: every operand and result once, the I/O the compiler counted without it.

Inside `backend.declaring_costs(False)` each returns None: the kernels opaque again (the
planner's step time "without the Pallas kernels").
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from modern_jax.kernels import flash
from modern_jax.kernels.backend import costs_declared

# Per visited score, how many of a pass's matmuls contract over H and how many over U:
#   forward   s = q k^T (H), o += p v (U)                                               1, 1
#   dq        s = q k^T (H), dp = do v^T (U), dq += ds k (H), s and p recomputed        2, 1
#   dk / dv   s^T = k q^T (H), dv += p^T do (U), dp^T = v do^T (U), dk += ds^T q (H)    2, 2
_ATTENTION_MATMULS = {"forward": (1, 1), "dq": (2, 1), "dkdv": (2, 2)}

# Flops per element of the rows (`norm_rows`), one per elementwise operation or reduced element:
#   forward   rmsnorm  h^2, sum, * rstd, * w                                                    4
#             layernorm adds sum h, h - mean                                                    6
#   backward  xhat again (3, layernorm 5), g = dy w, g xhat, sum, xhat *, g -, * rstd, dy xhat  10
#             layernorm adds sum g, dx -                                                        14
# Per-row scalars (/ D, + eps) and Gemma's 1 + w are left out.
_NORM_FLOPS = {"rmsnorm": (4, 10), "gemma_rmsnorm": (4, 10), "layernorm": (6, 14)}


def io_bytes(arrays) -> int:
    """Bytes of every array (anything with a shape and a dtype) in `arrays`, each once."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(arrays))


@functools.lru_cache
def visited_tiles(T: int, S: int, tile_t: int, tile_s: int, *, causal: bool, window: int | None,
                  chunk: int | None) -> int:
    """The (query tile, key tile) pairs a kernel visits for one batch row and head.

    The rule of `Visibility.tiles` on positions 0 .. T - 1 and 0 .. S - 1 (training, prefill;
    padding counted as tokens), in numpy, since it runs while tracing. Its visible tiles are a
    run in every row and column, so the kernels' `[lo, hi)` ranges visit exactly these. Tiles
    that only the data decide are counted as this layout: segment ids skip more, ring caches
    and packed documents shift them.
    """
    q_min = np.arange(0, T, tile_t)[:, None]
    k_min = np.arange(0, S, tile_s)[None, :]
    q_max, k_max = q_min + tile_t - 1, k_min + tile_s - 1
    vis_IJ = np.ones((T // tile_t, S // tile_s), bool)
    if causal:
        vis_IJ &= k_min <= q_max
    if window is not None:
        vis_IJ &= q_min - k_max < window
    if chunk is not None:
        vis_IJ &= (q_min // chunk <= k_max // chunk) & (k_min // chunk <= q_max // chunk)
    return int(vis_IJ.sum())


def attention(kernel: str, call: flash.Call, *, heads: int, T: int, S: int, H: int, U: int, tile_t: int,
              tile_s: int, io) -> pl.CostEstimate | None:
    """One flash-attention pass (`kernel`: forward, dq or dkdv) over `heads` = B K G (query, key) problems.

        scores = heads * visited tiles * tile_t * tile_s
        flops = 2 * scores * (n_H * H + n_U * U)     n_H, n_U: the pass's matmuls (above)
        transcendentals = scores (exp), 2 * scores under a soft-cap (tanh)
    """
    if not costs_declared():
        return None
    n_H, n_U = _ATTENTION_MATMULS[kernel]
    scores = heads * visited_tiles(T, S, tile_t, tile_s, **call.rule) * tile_t * tile_s
    return pl.CostEstimate(flops=2 * scores * (n_H * H + n_U * U),
                           transcendentals=scores * (2 if call.softcap is not None else 1), bytes_accessed=io_bytes(io))


def norm_forward(kind: str, M: int, D: int, *, fused_add: bool, bias: bool, io) -> pl.CostEstimate | None:
    """The fused (residual add +) norm: the row math, + 1 a element for the add and for the bias."""
    if not costs_declared():
        return None
    flops = M * D * (_NORM_FLOPS[kind][0] + fused_add + bias)
    return pl.CostEstimate(flops=flops, transcendentals=M, bytes_accessed=io_bytes(io))


def norm_backward(kind: str, M: int, D: int, *, fused_add: bool, io) -> pl.CostEstimate | None:
    """Its backward: the row math, + 2 a element for the dw and db sums over rows, + 1 for dx + dh."""
    if not costs_declared():
        return None
    flops = M * D * (_NORM_FLOPS[kind][1] + 2 + fused_add)
    return pl.CostEstimate(flops=flops, transcendentals=M, bytes_accessed=io_bytes(io))
