"""Flash attention for GPUs in Pallas (Triton lowering): forward and backward.

Letters: B batch, T query length, S key length, K kv heads, G queries per kv head
(N = K * G), H key head dim, U value head dim; a query tile of `tile_t` rows is
written T, a key tile of `tile_s` keys S.

The kernels read the attention contract's own layout (`q[B, T, K, G, H]`, `k[B, S, K, H]`)
through their block specs, so nothing is transposed or repeated:

- forward and dq: grid `(T / tile_t, B, N)`, one program per query tile of one head; it loops
  over the key tiles `[lo, hi)` that the positions make visible (`Visibility.tiles`),
  so causal, sliding-window and chunked attention skip the tiles they never see;
- dk / dv: grid `(S / tile_s, B, K)`, one program per key tile of one kv head; it loops over
  the G query heads of its group and their visible query tiles, accumulating in fp32.

Triton needs power-of-two tiles: T and S are padded to whole tiles, H and U to a power of
two (zeros, which change no score), and everything is sliced back. The tiles depend on the
head dim and dtype (`default_blocks`), chosen so that no kernel spills registers or
overflows shared memory on sm_90a (H100 / H200) or sm_80 (A100). Sinks' gradient is
`-sum_t exp(sink - lse_t) * delta_t` and is computed outside the kernels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from modern_jax.kernels import costs, flash
from modern_jax.kernels.backend import out_struct, varying_axes, vary_over
from modern_jax.kernels.masks import Visibility, pad_axis, round_up, softcap, visible_range


@dataclass(frozen=True)
class GpuBlocks:
    """Tile sizes (powers of two, at least 16) and Triton's launch settings, for all three kernels.

    The forward takes `block_q` x `block_k`; dq and dk / dv share `block_q_bwd` x `block_k_bwd`.
    Left out (`blocks=None`), they come from `default_blocks`; the field defaults here are its
    choice for head dim 128 in bfloat16.
    """

    block_q: int = 64
    block_k: int = 64
    block_q_bwd: int = 32
    block_k_bwd: int = 64
    num_warps: int = 8
    num_stages: int = 2

    def fit(self, T: int, S: int) -> GpuBlocks:
        """Shrink tiles that exceed the (padded) lengths."""
        cap_q, cap_k = max(16, pl.next_power_of_2(T)), max(16, pl.next_power_of_2(S))
        return GpuBlocks(min(self.block_q, cap_q), min(self.block_k, cap_k), min(self.block_q_bwd, cap_q),
                         min(self.block_k_bwd, cap_k), self.num_warps, self.num_stages)


# (padded head dim, bytes per element) -> tiles. Chosen by compiling with every feature on
# (soft-cap, window, sinks, segments and the max logit: the most registers) for sm_90a and
# sm_80 (`kernels/gpu_compile.py`, `scripts/check_kernels_compile.py`): the largest tiles
# tried with no spills, at most 240 registers (a margin for the Triton inside XLA) and shared
# memory at least 16 KiB under both limits, one choice serving both. Untimed; fp32 runs its
# matmuls in TF32.
_DEFAULT_BLOCKS = {
    (64, 2): GpuBlocks(128, 64, 64, 32),
    (64, 4): GpuBlocks(128, 64, 64, 32),
    (128, 2): GpuBlocks(64, 64, 32, 64),
    (128, 4): GpuBlocks(64, 32, 64, 32),
    (256, 2): GpuBlocks(32, 64, 64, 32),
    (256, 4): GpuBlocks(32, 32, 32, 16),
}


def default_blocks(head_dim: int, dtype) -> GpuBlocks:
    """The tiles for a head dim (the larger of the key's and the value's) and an input dtype.

    Head dims are padded to a power of two; below 64 they take 64's tiles and above 256 256's,
    1-byte dtypes take bf16's and 8-byte ones fp32's (none of these compile-checked). See
    `_DEFAULT_BLOCKS`.
    """
    padded = min(max(64, pl.next_power_of_2(head_dim)), 256)
    return _DEFAULT_BLOCKS[padded, 2 if jnp.dtype(dtype).itemsize <= 2 else 4]


@dataclass(frozen=True)
class _Call(flash.Call):
    blocks: GpuBlocks
    interpret: bool


def flash_attention_gpu(q_BTKGH, k_BSKH, v_BSKU, spec, vis: Visibility, *, sinks_KG=None,
                        blocks: GpuBlocks | None = None, interpret: bool = False, return_max_logit: bool = False):
    """Attention through the Pallas GPU kernels; the contract of `kernels.attention`.

    With `return_max_logit`, returns `(o, max |q.k| * scale over visible pairs, per head [K, G])`: the
    forward kernel keeps a running per-row max |logit| beside the softmax's and writes it
    out as it writes the log-sum-exp.
    """
    B, T, K, G, H = q_BTKGH.shape
    S, U = k_BSKH.shape[1], v_BSKU.shape[-1]
    blocks = (blocks or default_blocks(max(H, U), q_BTKGH.dtype)).fit(T, S)
    Hp, Up = max(16, pl.next_power_of_2(H)), max(16, pl.next_power_of_2(U))
    Tp = round_up(T, max(blocks.block_q, blocks.block_q_bwd))
    Sp = round_up(S, max(blocks.block_k, blocks.block_k_bwd))
    dtype = q_BTKGH.dtype
    q = pad_axis(pad_axis(q_BTKGH, 4, Hp), 1, Tp)
    k = pad_axis(pad_axis(k_BSKH.astype(dtype), 3, Hp), 1, Sp)
    v = pad_axis(pad_axis(v_BSKU.astype(dtype), 3, Up), 1, Sp)
    vis = vis.padded(Tp, Sp)
    sinks_KG = None if sinks_KG is None else sinks_KG.astype(jnp.float32)
    call = _Call.of(spec, return_max_logit, blocks, interpret)
    q, k, v, sinks_KG = vary_over((q, k, v, sinks_KG), varying_axes(q, k, v, sinks_KG, vis))
    o_BTKGU, max_logit_BKGT = _flash(call, q, k, v, sinks_KG, vis)
    if return_max_logit:
        return o_BTKGU[:, :T, :, :, :U], jax.lax.stop_gradient(jnp.max(max_logit_BKGT[..., :T], axis=(0, 3)))
    return o_BTKGU[:, :T, :, :, :U]


def _compiler_params(call: _Call):
    return plgpu.CompilerParams(num_warps=call.blocks.num_warps, num_stages=call.blocks.num_stages)


def _split_refs(refs, has_seg: bool):
    """(segment refs or Nones, the rest) from a kernel's trailing refs."""
    if has_seg:
        return refs[:2], refs[2:]
    return (None, None), refs


def _forward(call, q, k, v, sinks_KG, vis):
    sinks_N = None if sinks_KG is None else sinks_KG.reshape(-1)  # one sink per query head
    B, Tp, K, G, H = q.shape
    Sp, U = k.shape[1], v.shape[-1]
    tile_t, tile_s = call.blocks.block_q, call.blocks.block_k
    tiles = vis.tiles(**call.rule, block_q=tile_t, block_k=tile_s)
    lo_BI, hi_BI = visible_range(tiles, axis=2)
    has_seg, has_sink = vis.q_seg is not None, sinks_N is not None

    def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, qpos_ref, kpos_ref, *refs):
        (qseg_ref, kseg_ref), refs = _split_refs(refs, has_seg)
        refs = list(refs)
        sink_ref = refs.pop(0) if has_sink else None
        o_ref, lse_ref, *max_ref = refs
        q_TH = q_ref[...]
        qpos_T1 = qpos_ref[...].reshape(tile_t, 1)
        qseg_T1 = qseg_ref[...].reshape(tile_t, 1) if has_seg else None

        def body(j, state):
            cols = pl.ds(pl.multiple_of(j * tile_s, tile_s), tile_s)
            kseg_1S = kseg_ref[cols].reshape(1, tile_s) if has_seg else None
            mask_TS = Visibility(qpos_T1, kpos_ref[cols].reshape(1, tile_s), qseg_T1, kseg_1S).pairs(**call.rule)
            x_TS = flash.logits(q_TH, k_ref[cols, :], call.scale)
            softmax = flash.forward_step(softcap(x_TS, call.softcap), mask_TS, v_ref[cols, :], *state[:3])
            return (*softmax, flash.fold_max_logit(state[3], x_TS, mask_TS)) if call.max_logit else softmax

        init = flash.init_state(tile_t, U) + ((jnp.zeros((tile_t, 1), jnp.float32),) if call.max_logit else ())
        state = jax.lax.fori_loop(lo_ref[...], hi_ref[...], body, init)
        o_TU, lse_T1 = flash.finish(*state[:3], sink_ref[...] if has_sink else None)
        o_ref[...] = o_TU.astype(o_ref.dtype)
        lse_ref[...] = lse_T1.reshape(tile_t)
        if call.max_logit:
            max_ref[0][...] = state[3].reshape(tile_t)

    scalar = pl.BlockSpec((None, None), lambda i, b, n: (b, i))
    in_specs = [
        scalar, scalar,
        pl.BlockSpec((None, tile_t, None, None, H), lambda i, b, n: (b, i, n // G, n % G, 0)),
        pl.BlockSpec((None, Sp, None, H), lambda i, b, n: (b, 0, n // G, 0)),
        pl.BlockSpec((None, Sp, None, U), lambda i, b, n: (b, 0, n // G, 0)),
        pl.BlockSpec((None, tile_t), lambda i, b, n: (b, i)),
        pl.BlockSpec((None, Sp), lambda i, b, n: (b, 0)),
    ]
    args = [lo_BI, hi_BI, q, k, v, vis.q_pos, vis.k_pos]
    if has_seg:
        in_specs += [pl.BlockSpec((None, tile_t), lambda i, b, n: (b, i)),
                     pl.BlockSpec((None, Sp), lambda i, b, n: (b, 0))]
        args += [vis.q_seg, vis.k_seg]
    if has_sink:
        in_specs.append(pl.BlockSpec((None,), lambda i, b, n: (n,)))
        args.append(sinks_N)
    row_stat = pl.BlockSpec((None, None, None, tile_t), lambda i, b, n: (b, n // G, n % G, i))
    n_stats = 2 if call.max_logit else 1  # the log-sum-exp, and the max |logit| when asked
    out_shape = [out_struct((B, Tp, K, G, U), q.dtype, q), *[out_struct((B, K, G, Tp), jnp.float32, q)] * n_stats]
    o, lse_BKGT, *max_logit_BKGT = pl.pallas_call(
        kernel,
        grid=(Tp // tile_t, B, K * G),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, tile_t, None, None, U), lambda i, b, n: (b, i, n // G, n % G, 0)),
                   *[row_stat] * n_stats],
        out_shape=out_shape,
        compiler_params=_compiler_params(call),
        cost_estimate=costs.attention("forward", call, heads=B * K * G, T=Tp, S=Sp, H=H, U=U, tile_t=tile_t,
                                      tile_s=tile_s, io=(args, out_shape)),
        interpret=call.interpret,
        name="flash_attention_gpu_fwd",
    )(*args)
    return o, lse_BKGT, max_logit_BKGT[0] if call.max_logit else None


def _backward(call, q, k, v, do, o, lse_BKGT, vis):
    B, Tp, K, G, H = q.shape
    delta_BKGT = flash.delta(do, o).transpose(0, 2, 3, 1)  # o[B, T, K, G, U] -> lse's layout
    Sp, U = k.shape[1], v.shape[-1]
    tile_t, tile_s = call.blocks.block_q_bwd, call.blocks.block_k_bwd
    tiles = vis.tiles(**call.rule, block_q=tile_t, block_k=tile_s)
    k_lo_BI, k_hi_BI = visible_range(tiles, axis=2)
    q_lo_BJ, q_hi_BJ = visible_range(tiles, axis=1)
    q_pos, k_pos, q_seg, k_seg = vis.q_pos, vis.k_pos, vis.q_seg, vis.k_seg
    has_seg = q_seg is not None
    params = _compiler_params(call)
    cost = functools.partial(costs.attention, call=call, heads=B * K * G, T=Tp, S=Sp, H=H, U=U, tile_t=tile_t,
                             tile_s=tile_s)

    # ---- dq: one program per query tile of one head, looping over visible key tiles ----
    def dq_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, *refs):
        (qseg_ref, kseg_ref), (dq_ref,) = _split_refs(refs, has_seg)
        q_TH, do_TU = q_ref[...], do_ref[...]
        lse_T1, delta_T1 = lse_ref[...].reshape(tile_t, 1), delta_ref[...].reshape(tile_t, 1)
        qpos_T1 = qpos_ref[...].reshape(tile_t, 1)
        qseg_T1 = qseg_ref[...].reshape(tile_t, 1) if has_seg else None

        def body(j, dq_TH):
            cols = pl.ds(pl.multiple_of(j * tile_s, tile_s), tile_s)
            kseg_1S = kseg_ref[cols].reshape(1, tile_s) if has_seg else None
            mask_TS = Visibility(qpos_T1, kpos_ref[cols].reshape(1, tile_s), qseg_T1, kseg_1S).pairs(**call.rule)
            return dq_TH + flash.dq_step(q_TH, k_ref[cols, :], v_ref[cols, :], do_TU, lse_T1, delta_T1, mask_TS,
                                         call.scale, call.softcap)

        dq_TH = jax.lax.fori_loop(lo_ref[...], hi_ref[...], body, jnp.zeros((tile_t, H), jnp.float32))
        dq_ref[...] = dq_TH.astype(dq_ref.dtype)

    scalar = pl.BlockSpec((None, None), lambda i, b, n: (b, i))
    q_tile = lambda D: pl.BlockSpec((None, tile_t, None, None, D),  # noqa: E731
                                    lambda i, b, n: (b, i, n // G, n % G, 0))
    kv_full = lambda D: pl.BlockSpec((None, Sp, None, D), lambda i, b, n: (b, 0, n // G, 0))  # noqa: E731
    row_stat = pl.BlockSpec((None, None, None, tile_t), lambda i, b, n: (b, n // G, n % G, i))
    in_specs = [scalar, scalar, q_tile(H), kv_full(H), kv_full(U), q_tile(U), row_stat, row_stat,
                pl.BlockSpec((None, tile_t), lambda i, b, n: (b, i)), pl.BlockSpec((None, Sp), lambda i, b, n: (b, 0))]
    args = [k_lo_BI, k_hi_BI, q, k, v, do, lse_BKGT, delta_BKGT, q_pos, k_pos]
    if has_seg:
        in_specs += [pl.BlockSpec((None, tile_t), lambda i, b, n: (b, i)),
                     pl.BlockSpec((None, Sp), lambda i, b, n: (b, 0))]
        args += [q_seg, k_seg]
    out_shape = out_struct(q.shape, q.dtype, q)
    dq = pl.pallas_call(
        dq_kernel, grid=(Tp // tile_t, B, K * G), in_specs=in_specs, out_specs=q_tile(H), out_shape=out_shape,
        compiler_params=params, cost_estimate=cost("dq", io=(args, out_shape)), interpret=call.interpret,
        name="flash_attention_gpu_dq",
    )(*args)

    # ---- dk, dv: one program per key tile of one kv head, looping over its G heads' query tiles ----
    def dkdv_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, *refs):
        (qseg_ref, kseg_ref), (dk_ref, dv_ref) = _split_refs(refs, has_seg)
        k_SH, v_SU = k_ref[...], v_ref[...]
        kpos_S1 = kpos_ref[...].reshape(tile_s, 1)
        kseg_S1 = kseg_ref[...].reshape(tile_s, 1) if has_seg else None
        lo = lo_ref[...]
        n_tiles = hi_ref[...] - lo

        def body(step, grads):
            g, i = step // n_tiles, lo + step % n_tiles
            rows = pl.ds(pl.multiple_of(i * tile_t, tile_t), tile_t)
            qseg_1T = qseg_ref[rows].reshape(1, tile_t) if has_seg else None
            mask_ST = Visibility(qpos_ref[rows].reshape(1, tile_t), kpos_S1, qseg_1T, kseg_S1).pairs(**call.rule)
            dk_SH, dv_SU = flash.dkdv_step(q_ref[rows, g, :], k_SH, v_SU, do_ref[rows, g, :],
                                           lse_ref[g, rows].reshape(1, tile_t), delta_ref[g, rows].reshape(1, tile_t),
                                           mask_ST, call.scale, call.softcap)
            return grads[0] + dk_SH, grads[1] + dv_SU

        init = (jnp.zeros((tile_s, H), jnp.float32), jnp.zeros((tile_s, U), jnp.float32))
        dk_SH, dv_SU = jax.lax.fori_loop(0, G * n_tiles, body, init)
        dk_ref[...] = dk_SH.astype(dk_ref.dtype)
        dv_ref[...] = dv_SU.astype(dv_ref.dtype)

    scalar = pl.BlockSpec((None, None), lambda j, b, h: (b, j))
    q_full = lambda D: pl.BlockSpec((None, Tp, None, G, D), lambda j, b, h: (b, 0, h, 0, 0))  # noqa: E731
    kv_tile = lambda D: pl.BlockSpec((None, tile_s, None, D), lambda j, b, h: (b, j, h, 0))  # noqa: E731
    stats = pl.BlockSpec((None, None, G, Tp), lambda j, b, h: (b, h, 0, 0))
    in_specs = [scalar, scalar, q_full(H), kv_tile(H), kv_tile(U), q_full(U), stats, stats,
                pl.BlockSpec((None, Tp), lambda j, b, h: (b, 0)), pl.BlockSpec((None, tile_s), lambda j, b, h: (b, j))]
    args = [q_lo_BJ, q_hi_BJ, q, k, v, do, lse_BKGT, delta_BKGT, q_pos, k_pos]
    if has_seg:
        in_specs += [pl.BlockSpec((None, Tp), lambda j, b, h: (b, 0)),
                     pl.BlockSpec((None, tile_s), lambda j, b, h: (b, j))]
        args += [q_seg, k_seg]
    out_shape = [out_struct(k.shape, k.dtype, q), out_struct(v.shape, v.dtype, q)]
    dk, dv = pl.pallas_call(
        dkdv_kernel, grid=(Sp // tile_s, B, K), in_specs=in_specs, out_specs=[kv_tile(H), kv_tile(U)],
        out_shape=out_shape, compiler_params=params, cost_estimate=cost("dkdv", io=(args, out_shape)),
        interpret=call.interpret, name="flash_attention_gpu_dkdv",
    )(*args)
    return dq, dk, dv, delta_BKGT


# o[B, T, K, G, U], lse[B, K, G, T], sinks[K, G]
_flash = flash.recompute_vjp(_forward, _backward, sink_stat=lambda s_KG: s_KG[None, :, :, None])
