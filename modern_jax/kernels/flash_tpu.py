"""Flash attention for TPUs in Pallas (Mosaic lowering): forward and backward.

Letters: B batch, T query length, S key length, K kv heads, G queries per kv head,
H key head dim, U value head dim; I query tiles, J key tiles; a query tile of
`tile_t` rows is written T, a key tile of `tile_s` keys S.

Mosaic tiles the two minor dimensions of every block, so the wrapper moves heads in
front of the sequence (`q[B, K, G, T, H]`, `k[B, K, S, H]`) and keeps per-row
statistics as columns `[T, 1]` and per-key ones as rows `[1, S]` (a reshape of the same
memory gives the other orientation). The grid runs the reduction axis last and keeps
the running state in VMEM scratch:

- forward and dq: grid `(B, K, G, I, J)`, J the reduction;
- dk / dv: grid `(B, K, J, G, I)`, (G, I) the reduction, so the G query heads that share
  a kv head accumulate into one dk / dv without repeating K/V.

The visible tile range of every row of tiles (`Visibility.tiles`) is prefetched
into SMEM: invisible tiles are skipped, and their index maps repeat the previous block
so no copy is issued either. Sinks' gradient is computed outside the kernels.
Tiles must be multiples of 128 on hardware (rows of `[1, T]` are lane-tiled); the
default is 512 for the forward and 256 for the backward, shrunk to short sequences.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from modern_jax.kernels import costs, flash
from modern_jax.kernels.backend import out_struct, varying_axes, vary_over
from modern_jax.kernels.masks import Visibility, pad_axis, round_up, softcap, visible_range


@dataclass(frozen=True)
class TpuBlocks:
    """Tile sizes (multiples of 128 on hardware; interpret mode takes any multiple of 8)."""

    block_q: int = 512
    block_k: int = 512
    block_q_bwd: int = 256
    block_k_bwd: int = 256
    min_block: int = 128

    def fit(self, T: int, S: int) -> TpuBlocks:
        """Shrink tiles that exceed the lengths (rounded up to `min_block`)."""
        cap_q, cap_k = round_up(T, self.min_block), round_up(S, self.min_block)
        return TpuBlocks(min(self.block_q, cap_q), min(self.block_k, cap_k), min(self.block_q_bwd, cap_q),
                         min(self.block_k_bwd, cap_k), self.min_block)


@dataclass(frozen=True)
class _Call(flash.Call):
    blocks: TpuBlocks
    interpret: bool


def flash_attention_tpu(q_BTKGH, k_BSKH, v_BSKU, spec, vis: Visibility, *, sinks_KG=None,
                        blocks: TpuBlocks | None = None, interpret: bool = False, return_max_logit: bool = False):
    """Attention through the Pallas TPU kernels; the contract of `kernels.attention`.

    With `return_max_logit`, returns `(o, max |q.k| * scale over visible pairs, per head [K, G])`: the
    forward kernel keeps a running per-row max |logit| in VMEM beside the softmax's and
    writes it out as it writes the log-sum-exp.
    """
    B, T, K, G, H = q_BTKGH.shape
    S = k_BSKH.shape[1]
    blocks = (blocks or TpuBlocks()).fit(T, S)
    Tp = round_up(T, math.lcm(blocks.block_q, blocks.block_q_bwd))
    Sp = round_up(S, math.lcm(blocks.block_k, blocks.block_k_bwd))
    dtype = q_BTKGH.dtype
    q_BKGTH = pad_axis(q_BTKGH.transpose(0, 2, 3, 1, 4), 3, Tp)
    k_BKSH = pad_axis(k_BSKH.astype(dtype).transpose(0, 2, 1, 3), 2, Sp)
    v_BKSU = pad_axis(v_BSKU.astype(dtype).transpose(0, 2, 1, 3), 2, Sp)
    vis = vis.padded(Tp, Sp)
    sinks = None if sinks_KG is None else sinks_KG.astype(jnp.float32)
    call = _Call.of(spec, return_max_logit, blocks, interpret)
    q_BKGTH, k_BKSH, v_BKSU, sinks = vary_over((q_BKGTH, k_BKSH, v_BKSU, sinks),
                                               varying_axes(q_BKGTH, k_BKSH, v_BKSU, sinks, vis))
    o_BKGTU, max_logit_BKGT1 = _flash(call, q_BKGTH, k_BKSH, v_BKSU, sinks, vis)
    o_BTKGU = o_BKGTU[:, :, :, :T].transpose(0, 3, 1, 2, 4)
    if return_max_logit:
        return o_BTKGU, jax.lax.stop_gradient(jnp.max(max_logit_BKGT1[:, :, :, :T], axis=(0, 3, 4)))
    return o_BTKGU


def _column(x_BT):
    return None if x_BT is None else x_BT[:, :, None]


def _row(x_BT):
    return None if x_BT is None else x_BT[:, None, :]


def _clamp(n, lo, hi):
    """Keep a skipped tile's block index on a visible one, so the pipeline copies nothing new."""
    return jnp.maximum(jnp.minimum(n, hi - 1), lo)


def _query_major_specs(I: int, tile_t: int, tile_s: int):
    """Block specs for grid `(b, h, g, i, j)` with key tiles clamped to `[lo, hi)` of row `b * I + i`."""

    def j_(b, i, j, lo, hi):
        return _clamp(j, lo[b * I + i], hi[b * I + i])

    def q_tile(D):
        return pl.BlockSpec((None, None, None, tile_t, D), lambda b, h, g, i, j, lo, hi: (b, h, g, i, 0))

    def kv_tile(D):
        return pl.BlockSpec((None, None, tile_s, D), lambda b, h, g, i, j, lo, hi: (b, h, j_(b, i, j, lo, hi), 0))

    q_stat = pl.BlockSpec((None, None, None, tile_t, 1), lambda b, h, g, i, j, lo, hi: (b, h, g, i, 0))
    q_col = pl.BlockSpec((None, tile_t, 1), lambda b, h, g, i, j, lo, hi: (b, i, 0))
    k_row = pl.BlockSpec((None, 1, tile_s), lambda b, h, g, i, j, lo, hi: (b, 0, j_(b, i, j, lo, hi)))
    return q_tile, q_stat, q_col, kv_tile, k_row


def _key_major_specs(J: int, tile_t: int, tile_s: int):
    """Block specs for grid `(b, h, j, g, i)` with query tiles clamped to `[lo, hi)` of column `b * J + j`."""

    def i_(b, j, i, lo, hi):
        return _clamp(i, lo[b * J + j], hi[b * J + j])

    def q_tile(D):
        return pl.BlockSpec((None, None, None, tile_t, D),
                            lambda b, h, j, g, i, lo, hi: (b, h, g, i_(b, j, i, lo, hi), 0))

    def kv_tile(D):
        return pl.BlockSpec((None, None, tile_s, D), lambda b, h, j, g, i, lo, hi: (b, h, j, 0))

    q_stat = pl.BlockSpec((None, None, None, 1, tile_t),
                          lambda b, h, j, g, i, lo, hi: (b, h, g, 0, i_(b, j, i, lo, hi)))
    q_row = pl.BlockSpec((None, 1, tile_t), lambda b, h, j, g, i, lo, hi: (b, 0, i_(b, j, i, lo, hi)))
    k_col = pl.BlockSpec((None, tile_s, 1), lambda b, h, j, g, i, lo, hi: (b, j, 0))
    return q_tile, q_stat, q_row, kv_tile, k_col


def _tile_mask(qpos_ref, kpos_ref, qseg_ref, kseg_ref, **rule):
    """One tile's visibility from its position (and segment) blocks, laid out as column and row."""
    seg = lambda ref: None if ref is None else ref[...]  # noqa: E731
    return Visibility(qpos_ref[...], kpos_ref[...], seg(qseg_ref), seg(kseg_ref)).pairs(**rule)


def _forward(call, q, k, v, sinks_KG, vis):
    B, K, G, Tp, H = q.shape
    Sp, U = k.shape[2], v.shape[-1]
    tile_t, tile_s = call.blocks.block_q, call.blocks.block_k
    I, J = Tp // tile_t, Sp // tile_s
    tiles = vis.tiles(**call.rule, block_q=tile_t, block_k=tile_s)
    lo_BI, hi_BI = visible_range(tiles, axis=2)
    has_seg, has_sink = vis.q_seg is not None, sinks_KG is not None

    def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, qpos_ref, kpos_ref, *refs):
        refs = list(refs)
        qseg_ref, kseg_ref = (refs.pop(0), refs.pop(0)) if has_seg else (None, None)
        sinks_ref = refs.pop(0) if has_sink else None
        if call.max_logit:
            o_ref, lse_ref, max_ref, m_scr, l_scr, acc_scr, max_scr = refs
        else:
            o_ref, lse_ref, m_scr, l_scr, acc_scr = refs
        b, h, g, i, j = (pl.program_id(a) for a in range(5))

        @pl.when(j == 0)
        def _init():
            m_scr[...], l_scr[...], acc_scr[...] = flash.init_state(tile_t, U)
            if call.max_logit:
                max_scr[...] = jnp.zeros((tile_t, 1), jnp.float32)

        @pl.when((j >= lo_ref[b * I + i]) & (j < hi_ref[b * I + i]))
        def _step():
            mask_TS = _tile_mask(qpos_ref, kpos_ref, qseg_ref, kseg_ref, **call.rule)
            x_TS = flash.logits(q_ref[...], k_ref[...], call.scale)
            m_scr[...], l_scr[...], acc_scr[...] = flash.forward_step(
                softcap(x_TS, call.softcap), mask_TS, v_ref[...], m_scr[...], l_scr[...], acc_scr[...])
            if call.max_logit:
                max_scr[...] = flash.fold_max_logit(max_scr[...], x_TS, mask_TS)

        @pl.when(j == J - 1)
        def _finish():
            sink = sinks_ref[h, g] if has_sink else None
            o_TU, lse_T1 = flash.finish(m_scr[...], l_scr[...], acc_scr[...], sink)
            o_ref[...] = o_TU.astype(o_ref.dtype)
            lse_ref[...] = lse_T1
            if call.max_logit:
                max_ref[...] = max_scr[...]

    q_tile, q_stat, q_col, kv_tile, k_row = _query_major_specs(I, tile_t, tile_s)
    in_specs = [q_tile(H), kv_tile(H), kv_tile(U), q_col, k_row]
    args = [q, k, v, _column(vis.q_pos), _row(vis.k_pos)]
    if has_seg:
        in_specs += [q_col, k_row]
        args += [_column(vis.q_seg), _row(vis.k_seg)]
    if has_sink:
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        args.append(sinks_KG)
    n_stats = 2 if call.max_logit else 1  # the log-sum-exp, and the max |logit| when asked
    args = [lo_BI.reshape(-1), hi_BI.reshape(-1), *args]
    out_shape = [out_struct((B, K, G, Tp, U), q.dtype, q), *[out_struct((B, K, G, Tp, 1), jnp.float32, q)] * n_stats]
    o, lse, *max_logit = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, K, G, I, J),
            in_specs=in_specs,
            out_specs=[q_tile(U), *[q_stat] * n_stats],
            scratch_shapes=[pltpu.VMEM((tile_t, 1), jnp.float32), pltpu.VMEM((tile_t, 1), jnp.float32),
                            pltpu.VMEM((tile_t, U), jnp.float32),
                            *[pltpu.VMEM((tile_t, 1), jnp.float32)] * (n_stats - 1)],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 4 + ("arbitrary",)),
        cost_estimate=costs.attention("forward", call, heads=B * K * G, T=Tp, S=Sp, H=H, U=U, tile_t=tile_t,
                                      tile_s=tile_s, io=(args, out_shape)),
        interpret=call.interpret,
        name="flash_attention_tpu_fwd",
    )(*args)
    return o, lse, max_logit[0] if call.max_logit else None


def _backward(call, q, k, v, do, o, lse_BKGT1, vis):
    B, K, G, Tp, H = q.shape
    Sp, U = k.shape[2], v.shape[-1]
    tile_t, tile_s = call.blocks.block_q_bwd, call.blocks.block_k_bwd
    I, J = Tp // tile_t, Sp // tile_s
    tiles = vis.tiles(**call.rule, block_q=tile_t, block_k=tile_s)
    k_lo_BI, k_hi_BI = visible_range(tiles, axis=2)
    q_lo_BJ, q_hi_BJ = visible_range(tiles, axis=1)
    q_pos, k_pos, q_seg, k_seg = vis.q_pos, vis.k_pos, vis.q_seg, vis.k_seg
    has_seg = q_seg is not None
    cost = functools.partial(costs.attention, call=call, heads=B * K * G, T=Tp, S=Sp, H=H, U=U, tile_t=tile_t,
                             tile_s=tile_s)

    # ---- dq: grid (B, K, G, I, J), reducing over the visible key tiles; it also writes
    # delta = rowsum(do * o), from the query tile's o and do it holds anyway, for dk / dv ----
    def dq_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, o_ref, lse_ref, qpos_ref, kpos_ref, *refs):
        refs = list(refs)
        qseg_ref, kseg_ref = (refs.pop(0), refs.pop(0)) if has_seg else (None, None)
        dq_ref, delta_ref, dq_scr = refs
        b, i, j = pl.program_id(0), pl.program_id(3), pl.program_id(4)

        @pl.when(j == 0)
        def _init():
            dq_scr[...] = jnp.zeros((tile_t, H), jnp.float32)
            delta_ref[...] = flash.delta(do_ref[...], o_ref[...])[:, None]

        @pl.when((j >= lo_ref[b * I + i]) & (j < hi_ref[b * I + i]))
        def _step():
            mask_TS = _tile_mask(qpos_ref, kpos_ref, qseg_ref, kseg_ref, **call.rule)
            dq_scr[...] += flash.dq_step(q_ref[...], k_ref[...], v_ref[...], do_ref[...], lse_ref[...],
                                         delta_ref[...], mask_TS, call.scale, call.softcap)

        @pl.when(j == J - 1)
        def _finish():
            dq_ref[...] = dq_scr[...].astype(dq_ref.dtype)

    q_tile, q_stat, q_col, kv_tile, k_row = _query_major_specs(I, tile_t, tile_s)
    in_specs = [q_tile(H), kv_tile(H), kv_tile(U), q_tile(U), q_tile(U), q_stat, q_col, k_row]
    args = [q, k, v, do, o, lse_BKGT1, _column(q_pos), _row(k_pos)]
    if has_seg:
        in_specs += [q_col, k_row]
        args += [_column(q_seg), _row(k_seg)]
    args = [k_lo_BI.reshape(-1), k_hi_BI.reshape(-1), *args]
    out_shape = [out_struct(q.shape, q.dtype, q), out_struct(lse_BKGT1.shape, jnp.float32, q)]
    dq, delta_BKGT1 = pl.pallas_call(
        dq_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B, K, G, I, J), in_specs=in_specs, out_specs=[q_tile(H), q_stat],
            scratch_shapes=[pltpu.VMEM((tile_t, H), jnp.float32)]),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 4 + ("arbitrary",)),
        cost_estimate=cost("dq", io=(args, out_shape)),
        interpret=call.interpret,
        name="flash_attention_tpu_dq",
    )(*args)

    # ---- dk, dv: grid (B, K, J, G, I), reducing over the G heads and their visible query tiles ----
    def dkdv_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, *refs):
        refs = list(refs)
        qseg_ref, kseg_ref = (refs.pop(0), refs.pop(0)) if has_seg else (None, None)
        dk_ref, dv_ref, dk_scr, dv_scr = refs
        b, j, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)

        @pl.when((g == 0) & (i == 0))
        def _init():
            dk_scr[...] = jnp.zeros((tile_s, H), jnp.float32)
            dv_scr[...] = jnp.zeros((tile_s, U), jnp.float32)

        @pl.when((i >= lo_ref[b * J + j]) & (i < hi_ref[b * J + j]))
        def _step():
            mask_ST = _tile_mask(qpos_ref, kpos_ref, qseg_ref, kseg_ref, **call.rule)
            dk_SH, dv_SU = flash.dkdv_step(q_ref[...], k_ref[...], v_ref[...], do_ref[...], lse_ref[...],
                                           delta_ref[...], mask_ST, call.scale, call.softcap)
            dk_scr[...] += dk_SH
            dv_scr[...] += dv_SU

        @pl.when((g == G - 1) & (i == I - 1))
        def _finish():
            dk_ref[...] = dk_scr[...].astype(dk_ref.dtype)
            dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)

    q_tile, q_stat, q_row, kv_tile, k_col = _key_major_specs(J, tile_t, tile_s)
    in_specs = [q_tile(H), kv_tile(H), kv_tile(U), q_tile(U), q_stat, q_stat, q_row, k_col]
    lse_BKG1T, delta_BKG1T = (x.reshape(B, K, G, 1, Tp) for x in (lse_BKGT1, delta_BKGT1))
    args = [q, k, v, do, lse_BKG1T, delta_BKG1T, _row(q_pos), _column(k_pos)]
    if has_seg:
        in_specs += [q_row, k_col]
        args += [_row(q_seg), _column(k_seg)]
    args = [q_lo_BJ.reshape(-1), q_hi_BJ.reshape(-1), *args]
    out_shape = [out_struct(k.shape, k.dtype, q), out_struct(v.shape, v.dtype, q)]
    dk, dv = pl.pallas_call(
        dkdv_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B, K, J, G, I), in_specs=in_specs, out_specs=[kv_tile(H), kv_tile(U)],
            scratch_shapes=[pltpu.VMEM((tile_s, H), jnp.float32), pltpu.VMEM((tile_s, U), jnp.float32)]),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3 + ("arbitrary",) * 2),
        cost_estimate=cost("dkdv", io=(args, out_shape)),
        interpret=call.interpret,
        name="flash_attention_tpu_dkdv",
    )(*args)
    return dq, dk, dv, delta_BKGT1


# o[B, K, G, T, U], lse[B, K, G, T, 1], sinks[K, G]
_flash = flash.recompute_vjp(_forward, _backward, sink_stat=lambda s_KG: s_KG[None, :, :, None, None])
