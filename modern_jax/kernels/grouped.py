"""Grouped matmul: rows sorted by group, each group multiplied by its own weight.

Letters (the package legend): Z rows (token-expert assignments, sorted by expert), W and O
the contracted and output widths, E groups (experts).

    y[z] = x[z] @ w[e(z)]      rows 0 .. n_0 - 1 use w[0], the next n_1 rows w[1], ...

`impl`:
- `ragged_dot`: `jax.lax.ragged_dot`, which XLA lowers to grouped GEMMs on GPU and TPU;
  on CPU it masks, so it costs E times the dense work there.
- `megablox`: the Pallas TPU grouped matmul (`jax.experimental.pallas.ops.tpu.megablox`),
  forward and backward; rows are padded to whole tiles. In Pallas interpret mode
  (`kernels.backend.pallas_interpret`) it runs on any backend.
- `default`: megablox on TPU, ragged_dot elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from modern_jax.execution import GROUPED_IMPLS
from modern_jax.sharding.devices import platform
from modern_jax.kernels.backend import UnsupportedFeatureError, interpret_target, note_kernel
from modern_jax.kernels.masks import pad_axis, round_up



# Megablox's tiles. A tile of rows reads its expert's whole weight, and a tile of output columns
# reads the rows again: the weight is read once per ROWS_TILE rows and the rows once per
# WIDTH_TILE columns: 128 x 128 tiles read Mixtral's experts 4x and its rows 8x as often as these
# (512 flops per byte of a bfloat16 weight read, near v6e's ridge: 918 TFLOP/s over 1.64 TB/s).
# In VMEM, double-buffered, with the float32 accumulator: 10 MiB (x w) to 12 MiB (x^T dy) for
# 2-byte operands; 4-byte ones take half the width (7 MiB): inside the 16 MiB default scoped limit.
ROWS_TILE = 512
WIDTH_TILE = 1024


@dataclass(frozen=True)
class _Tiling:
    """Megablox's `tiling(m, k, n)`: each call of the forward and backward (x w, dy w^T, x^T dy)
    gets tiles of its own widths."""

    rows: int
    widest: int

    def __call__(self, m: int, k: int, n: int) -> tuple[int, int, int]:
        return self.rows, _tile(k, self.widest), _tile(n, self.widest)


def _tile(n: int, widest: int) -> int:
    """The widest multiple of 128 up to `widest` that divides n, or the whole n when 128 does not."""
    return next((t for t in range(widest, 0, -128) if n % t == 0), n)


def grouped_matmul(x_ZW, w_EWO, group_sizes_E, *, impl: str = "default"):
    """`[Z, O]` for rows `x[Z, W]` sorted by group, written in x's dtype (the compute dtype: no
    float32 copy of the output exists) and accumulated in float32 by the kernel (megablox's
    accumulator, XLA's on GPU and TPU); the backward's gradients come out in the operands'
    dtypes the same way."""
    if impl == "default":
        impl = "megablox" if platform() == "tpu" else "ragged_dot"
    note_kernel("moe_grouped", impl)
    if impl == "ragged_dot":
        return jax.lax.ragged_dot(x_ZW, w_EWO.astype(x_ZW.dtype), group_sizes_E.astype(jnp.int32),
                                  preferred_element_type=x_ZW.dtype)
    if impl != "megablox":
        raise ValueError(f"grouped matmul impl={impl!r}: expected one of {', '.join(GROUPED_IMPLS)}")
    interpret = interpret_target() is not None
    if not interpret and platform() != "tpu":
        raise UnsupportedFeatureError(f"execution.moe_grouped_impl='megablox' is a TPU kernel; this computation is compiled "
                                      f"for {platform()!r}: use 'ragged_dot' or 'default'")
    from jax.experimental.pallas.ops.tpu.megablox import ops

    Z = x_ZW.shape[0]
    tile_z = min(ROWS_TILE, round_up(Z, 8))
    Zp = round_up(Z, tile_z)
    # padding rows join the last group: zero rows whose outputs are cut off below
    sizes_E = group_sizes_E.astype(jnp.int32).at[-1].add(Zp - Z)
    tiling = _Tiling(tile_z, WIDTH_TILE if x_ZW.dtype.itemsize <= 2 else WIDTH_TILE // 2)
    y_ZO = ops.gmm(pad_axis(x_ZW, 0, Zp), w_EWO.astype(x_ZW.dtype), sizes_E, preferred_element_type=x_ZW.dtype,
                   tiling=tiling, interpret=interpret)
    return y_ZO[:Z]
