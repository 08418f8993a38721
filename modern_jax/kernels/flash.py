"""Flash-attention tile math shared by the Pallas GPU and TPU kernels.

Letters: R rows of a query tile, C columns (keys) of a key tile, H key head dim,
U value head dim (letters as in `modern_jax`). Per-row statistics are columns `[R, 1]`; per-key ones rows `[1, C]`.

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

import jax
import jax.numpy as jnp

from modern_jax.kernels.masks import MASK_VALUE, softcap  # a masked score: finite, so never inf - inf

_NN = (((1,), (0,)), ((), ()))
_NT = (((1,), (1,)), ((), ()))


def matmul(a, b):
    """`a @ b` with an fp32 accumulator."""
    return jax.lax.dot_general(a, b, _NN, preferred_element_type=jnp.float32)


def matmul_nt(a, b):
    """`a @ b^T` with an fp32 accumulator."""
    return jax.lax.dot_general(a, b, _NT, preferred_element_type=jnp.float32)


def logits(q_RH, k_CH, scale: float):
    """`scale * q k^T` in fp32 (before any soft-cap)."""
    return matmul_nt(q_RH, k_CH) * scale


def scores(q_RH, k_CH, scale: float, cap: float | None):
    """`s = softcap(scale * q k^T)` in fp32."""
    return softcap(logits(q_RH, k_CH, scale), cap)


def fold_max_logit(mx_R1, x_RC, mask_RC):
    """The running per-row max |logit| over visible keys, with this tile's logits `x` folded in."""
    return jnp.maximum(mx_R1, jnp.max(jnp.where(mask_RC, jnp.abs(x_RC), 0.0), axis=-1, keepdims=True))


def softcap_grad(ds_RC, s_RC, softcap: float | None):
    """Chain `ds` through the soft-cap: d(c tanh(x / c))/dx = 1 - (s / c)^2."""
    if softcap is None:
        return ds_RC
    return ds_RC * (1.0 - jnp.square(s_RC / softcap))


def init_state(rows: int, v_dim: int):
    return (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, v_dim), jnp.float32))


def forward_step(s_RC, mask_RC, v_CU, m_R1, l_R1, acc_RU, pv=matmul):
    """Fold one key tile into the running (m, l, acc); keys on the last axis of `s`.

    `pv(p, v)` is the probabilities-times-values product (leading axes may batch it).
    """
    m_new_R1 = jnp.maximum(m_R1, jnp.max(jnp.where(mask_RC, s_RC, MASK_VALUE), axis=-1, keepdims=True))
    p_RC = jnp.where(mask_RC, jnp.exp(s_RC - m_new_R1), 0.0)
    alpha_R1 = jnp.exp(m_R1 - m_new_R1)
    l_R1 = alpha_R1 * l_R1 + jnp.sum(p_RC, axis=-1, keepdims=True)
    acc_RU = alpha_R1 * acc_RU + pv(p_RC.astype(v_CU.dtype), v_CU)
    return m_new_R1, l_R1, acc_RU


def finish(m_R1, l_R1, acc_RU, sink=None):
    """Normalise: output `o[R, U]` (fp32) and `lse[R, 1]` (+inf for a row that saw nothing)."""
    if sink is not None:
        m_fin_R1 = jnp.maximum(m_R1, sink)
        alpha_R1 = jnp.exp(m_R1 - m_fin_R1)
        l_R1 = alpha_R1 * l_R1 + jnp.exp(sink - m_fin_R1)
        acc_RU, m_R1 = alpha_R1 * acc_RU, m_fin_R1
    seen_R1 = l_R1 > 0.0
    o_RU = acc_RU / jnp.where(seen_R1, l_R1, 1.0)
    lse_R1 = jnp.where(seen_R1, m_R1 + jnp.log(jnp.where(seen_R1, l_R1, 1.0)), jnp.inf)
    return o_RU, lse_R1


def dq_step(q_RH, k_CH, v_CU, do_RU, lse_R1, delta_R1, mask_RC, scale, softcap):
    """This key tile's contribution to `dq[R, H]` (fp32)."""
    s_RC = scores(q_RH, k_CH, scale, softcap)
    p_RC = jnp.where(mask_RC, jnp.exp(s_RC - lse_R1), 0.0)
    ds_RC = softcap_grad(p_RC * (matmul_nt(do_RU, v_CU) - delta_R1), s_RC, softcap)
    return matmul(ds_RC.astype(k_CH.dtype), k_CH) * scale


def dkdv_step(q_RH, k_CH, v_CU, do_RU, lse_1R, delta_1R, mask_CR, scale, softcap):
    """This query tile's contribution to `dk[C, H]` and `dv[C, U]` (fp32), on transposed tiles."""
    s_CR = scores(k_CH, q_RH, scale, softcap)
    p_CR = jnp.where(mask_CR, jnp.exp(s_CR - lse_1R), 0.0)
    dv_CU = matmul(p_CR.astype(do_RU.dtype), do_RU)
    ds_CR = softcap_grad(p_CR * (matmul_nt(v_CU, do_RU) - delta_1R), s_CR, softcap)
    dk_CH = matmul(ds_CR.astype(q_RH.dtype), q_RH) * scale
    return dk_CH, dv_CU


def recompute_vjp(forward, backward, stat, sink_stat):
    """Attention as a `jax.custom_vjp` that saves only `o` and the log-sum-exp.

    `forward(call, q, k, v, sinks, vis) -> (o, lse, max_logit)` and
    `backward(call, q, k, v, do, lse, delta, vis) -> (dq, dk, dv)` are one
    implementation's passes (`call`: its hashable static settings; `vis`: the padded
    `masks.Visibility`). `max_logit` is the per-row max |q.k| * scale over visible keys
    when `call.max_logit` asks for it, else None: it is returned beside `o` and never
    differentiated (its cotangent is dropped). Layouts are the implementation's: `stat(r)`
    puts a per-row statistic from `o`'s layout (without its value axis) into `lse`'s, and
    `sink_stat(sinks)` broadcasts the sinks to it. Shared here:

        delta  = rowsum(do * o)
        dsinks = -sum p_sink * delta,   p_sink = exp(sink - lse)   (the sink's probability)
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def attend(call, q, k, v, sinks, vis):
        o, _, max_logit = forward(call, q, k, v, sinks, vis)
        return o, max_logit

    def attend_fwd(call, q, k, v, sinks, vis):
        o, lse, max_logit = forward(call, q, k, v, sinks, vis)
        return (o, max_logit), (q, k, v, sinks, vis, o, lse)

    def attend_bwd(call, residuals, cotangents):
        do, _ = cotangents  # the max logit is a measurement: no gradient flows through it
        q, k, v, sinks, vis, o, lse = residuals
        delta = stat(jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1))
        dq, dk, dv = backward(call, q, k, v, do.astype(q.dtype), lse, delta, vis)
        dsinks = None
        if sinks is not None:
            sinks_stat, pullback = jax.vjp(sink_stat, sinks)
            d_stat = -jnp.exp(sinks_stat - lse) * delta
            broadcast = tuple(i for i, n in enumerate(sinks_stat.shape) if n == 1 and d_stat.shape[i] != 1)
            dsinks = pullback(jnp.sum(d_stat, axis=broadcast, keepdims=True))[0]
        return dq, dk, dv, dsinks, None

    attend.defvjp(attend_fwd, attend_bwd)
    return attend
