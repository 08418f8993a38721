"""Flash-attention tile math shared by the Pallas GPU and TPU kernels, the chunked attention and the ring.

Letters (as in `modern_jax`): T rows of a query tile, S columns (keys) of a key tile, H key head
dim, U value head dim. Per-row statistics are columns `[T, 1]`; per-key ones rows `[1, S]`.

Forward (FlashAttention-2): each query tile visits its key tiles keeping the running
maximum `m`, the running denominator `l` and the unnormalised output `acc`; a sink
joins the denominator once at the end. The log-sum-exp `lse = m + log(l)` is kept for
the backward pass, which recomputes the probabilities `p = exp(s - lse)`:

    dv = p^T do     dp = do v^T     ds = p * (dp - delta),  delta = rowsum(do * o)
    dq = scale * ds' k     dk = scale * ds'^T q     with ds' = ds * (1 - tanh^2) under a soft-cap

The key-side pass works on transposed tiles (`s^T = k q^T`, rows are keys) so every
product is a plain or an `A B^T` matmul, which both Triton and Mosaic lower directly.
A query that sees no key (and has no sink) returns zeros.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from modern_jax.kernels.masks import MASK_VALUE, softcap  # a masked score: finite, so never inf - inf

@dataclass(frozen=True)
class Call:
    """The static part of one attention call (hashable: it keys the custom_vjp), shared by the
    implementations (`chunked`, `flash_gpu`, `flash_tpu`); each subclass adds its tiling."""

    scale: float
    causal: bool
    window: int | None
    chunk: int | None
    softcap: float | None
    max_logit: bool

    @classmethod
    def of(cls, spec, max_logit: bool, *tiling):
        """The call of `spec` (a `kernels.attention.AttentionSpec`) with the subclass's tiling."""
        return cls(spec.scale, spec.causal, spec.window, spec.chunk, spec.softcap, max_logit, *tiling)

    @property
    def rule(self) -> dict:
        """Which keys a query sees, as `Visibility.pairs` / `mask` / `tiles` take it."""
        return dict(causal=self.causal, window=self.window, chunk=self.chunk)


_NN = (((1,), (0,)), ((), ()))
_NT = (((1,), (1,)), ((), ()))


def matmul(a, b):
    """`a @ b` with an fp32 accumulator."""
    return jax.lax.dot_general(a, b, _NN, preferred_element_type=jnp.float32)


def matmul_nt(a, b):
    """`a @ b^T` with an fp32 accumulator."""
    return jax.lax.dot_general(a, b, _NT, preferred_element_type=jnp.float32)


def logits(q_TH, k_SH, scale: float):
    """`scale * q k^T` in fp32 (before any soft-cap)."""
    return matmul_nt(q_TH, k_SH) * scale


def scores(q_TH, k_SH, scale: float, cap: float | None):
    """`s = softcap(scale * q k^T)` in fp32."""
    return softcap(logits(q_TH, k_SH, scale), cap)


def fold_max_logit(mx_T1, x_TS, mask_TS):
    """The running per-row max |logit| over visible keys, with this tile's logits `x` folded in."""
    return jnp.maximum(mx_T1, jnp.max(jnp.where(mask_TS, jnp.abs(x_TS), 0.0), axis=-1, keepdims=True))


def softcap_grad(ds_TS, s_TS, softcap: float | None):
    """Chain `ds` through the soft-cap: d(c tanh(x / c))/dx = 1 - (s / c)^2."""
    if softcap is None:
        return ds_TS
    return ds_TS * (1.0 - jnp.square(s_TS / softcap))


def init_state(rows: int | tuple[int, ...], v_dim: int):
    """The running `(m, l, acc)` before any key tile, for `rows` queries (a count, or the leading
    shape of a batch of them)."""
    rows = rows if isinstance(rows, tuple) else (rows,)
    return (jnp.full((*rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((*rows, 1), jnp.float32),
            jnp.zeros((*rows, v_dim), jnp.float32))


def forward_step(s_TS, mask_TS, v_SU, m_T1, l_T1, acc_TU, pv=matmul):
    """Fold one key tile into the running (m, l, acc); keys on the last axis of `s`.

    `pv(p, v)` is the probabilities-times-values product (leading axes may batch it).
    """
    m_new_T1 = jnp.maximum(m_T1, jnp.max(jnp.where(mask_TS, s_TS, MASK_VALUE), axis=-1, keepdims=True))
    p_TS = jnp.where(mask_TS, jnp.exp(s_TS - m_new_T1), 0.0)
    alpha_T1 = jnp.exp(m_T1 - m_new_T1)
    l_T1 = alpha_T1 * l_T1 + jnp.sum(p_TS, axis=-1, keepdims=True)
    acc_TU = alpha_T1 * acc_TU + pv(p_TS.astype(v_SU.dtype), v_SU)
    return m_new_T1, l_T1, acc_TU


def finish(m_T1, l_T1, acc_TU, sink=None):
    """Normalise: output `o[T, U]` (fp32) and `lse[T, 1]` (+inf for a row that saw nothing)."""
    if sink is not None:
        m_fin_T1 = jnp.maximum(m_T1, sink)
        alpha_T1 = jnp.exp(m_T1 - m_fin_T1)
        l_T1 = alpha_T1 * l_T1 + jnp.exp(sink - m_fin_T1)
        acc_TU, m_T1 = alpha_T1 * acc_TU, m_fin_T1
    seen_T1 = l_T1 > 0.0
    o_TU = acc_TU / jnp.where(seen_T1, l_T1, 1.0)
    lse_T1 = jnp.where(seen_T1, m_T1 + jnp.log(jnp.where(seen_T1, l_T1, 1.0)), jnp.inf)
    return o_TU, lse_T1


def dq_step(q_TH, k_SH, v_SU, do_TU, lse_T1, delta_T1, mask_TS, scale, softcap):
    """This key tile's contribution to `dq[T, H]` (fp32)."""
    s_TS = scores(q_TH, k_SH, scale, softcap)
    p_TS = jnp.where(mask_TS, jnp.exp(s_TS - lse_T1), 0.0)
    ds_TS = softcap_grad(p_TS * (matmul_nt(do_TU, v_SU) - delta_T1), s_TS, softcap)
    return matmul(ds_TS.astype(k_SH.dtype), k_SH) * scale


def dkdv_step(q_TH, k_SH, v_SU, do_TU, lse_1T, delta_1T, mask_ST, scale, softcap):
    """This query tile's contribution to `dk[S, H]` and `dv[S, U]` (fp32), on transposed tiles."""
    s_ST = scores(k_SH, q_TH, scale, softcap)
    p_ST = jnp.where(mask_ST, jnp.exp(s_ST - lse_1T), 0.0)
    dv_SU = matmul(p_ST.astype(do_TU.dtype), do_TU)
    ds_ST = softcap_grad(p_ST * (matmul_nt(v_SU, do_TU) - delta_1T), s_ST, softcap)
    dk_SH = matmul(ds_ST.astype(q_TH.dtype), q_TH) * scale
    return dk_SH, dv_SU


def delta(do, o):
    """`rowsum(do * o)` in fp32 over the value axis (the last): per row, in `o`'s layout without it."""
    return jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)


def recompute_vjp(forward, backward, sink_stat):
    """Attention as a `jax.custom_vjp` that saves only `o` and the log-sum-exp.

    `forward(call, q, k, v, sinks, vis) -> (o, lse, max_logit)` and
    `backward(call, q, k, v, do, o, lse, vis) -> (dq, dk, dv, delta)` are one
    implementation's passes (`call`: its hashable static settings; `vis`: the padded
    `masks.Visibility`). `max_logit` is the per-row max |q.k| * scale over visible keys
    when `call.max_logit` asks for it, else None: it is returned beside `o` and never
    differentiated (its cotangent is dropped). The backward computes `delta = rowsum(do * o)`
    (`delta` above) where it is cheapest (the TPU dq kernel reads `o`'s tiles beside `do`'s,
    instead of a pass of its own over both) and returns it in `lse`'s layout, for the sinks.
    Layouts are the implementation's: `sink_stat(sinks)` broadcasts the sinks to `lse`'s.
    Shared here:

        dsinks = -sum p_sink * delta,   p_sink = exp(sink - lse)   (the sink's probability)
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def attend(call, q, k, v, sinks, vis):
        o, _, max_logit = forward(call, q, k, v, sinks, vis)
        return o, max_logit

    def attend_fwd(call, q, k, v, sinks, vis):
        o, lse, max_logit = forward(call, q, k, v, sinks, vis)
        # named, so that a remat policy saving the attention's output keeps what the backward needs
        o, lse = checkpoint_name(o, "attention_out"), checkpoint_name(lse, "attention_lse")
        return (o, max_logit), (q, k, v, sinks, vis, o, lse)

    def attend_bwd(call, residuals, cotangents):
        do, _ = cotangents  # the max logit is a measurement: no gradient flows through it
        q, k, v, sinks, vis, o, lse = residuals
        dq, dk, dv, delta = backward(call, q, k, v, do.astype(q.dtype), o, lse, vis)
        dsinks = None
        if sinks is not None:
            sinks_stat, pullback = jax.vjp(sink_stat, sinks)
            d_stat = -jnp.exp(sinks_stat - lse) * delta
            broadcast = tuple(i for i, n in enumerate(sinks_stat.shape) if n == 1 and d_stat.shape[i] != 1)
            dsinks = pullback(jnp.sum(d_stat, axis=broadcast, keepdims=True))[0]
        return dq, dk, dv, dsinks, None

    attend.defvjp(attend_fwd, attend_bwd)
    return attend
