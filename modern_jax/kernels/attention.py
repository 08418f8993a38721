"""Attention core and its dispatch.

Letters: B batch, T query length, S key length, K kv heads, G queries per kv head,
H head dim (keys), V head dim (values).

Every implementation takes grouped queries `q[B, T, K, G, H]` against `k[B, S, K, H]`
and `v[B, S, K, V]`, so grouped-query attention never materialises repeated K/V.
Masks are defined by positions: a key is visible when it is valid (`k_pos >= 0`),
not in the future (`k_pos <= q_pos`, if causal), inside the window
(`q_pos - k_pos < window`) and in the same segment (packed sequences).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import jax
import jax.numpy as jnp


class AttentionImpl(enum.StrEnum):
    REFERENCE = "reference"


@dataclass(frozen=True)
class AttentionSpec:
    """The static features of one attention call."""

    scale: float
    causal: bool = True
    window: int | None = None
    softcap: float | None = None
    dropout_rate: float = 0.0


def attention_mask(q_pos_BT, k_pos_BS, q_seg_BT=None, k_seg_BS=None, *, causal=True, window=None):
    """Boolean visibility mask [B, T, S] from positions and segment ids."""
    q_BT1 = q_pos_BT[:, :, None]
    k_B1S = k_pos_BS[:, None, :]
    mask_BTS = jnp.broadcast_to(k_B1S >= 0, (q_pos_BT.shape[0], q_pos_BT.shape[1], k_pos_BS.shape[1]))
    if causal:
        mask_BTS &= k_B1S <= q_BT1
    if window is not None:
        mask_BTS &= q_BT1 - k_B1S < window
    if q_seg_BT is not None:
        mask_BTS &= q_seg_BT[:, :, None] == k_seg_BS[:, None, :]
    return mask_BTS


def softcap(x, cap):
    """`cap * tanh(x / cap)`: bounds logits smoothly to (-cap, cap)."""
    return cap * jnp.tanh(x / cap)


def attention_reference(q_BTKGH, k_BSKH, v_BSKV, mask_BTS, spec: AttentionSpec, sinks_KG=None, dropout_rng=None):
    """Plain einsum attention with fp32 softmax: the numerical oracle."""
    s_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
    s_BKGTS = s_BKGTS * spec.scale
    if spec.softcap is not None:
        s_BKGTS = softcap(s_BKGTS, spec.softcap)
    s_BKGTS = jnp.where(mask_BTS[:, None, None], s_BKGTS, jnp.finfo(jnp.float32).min)
    m_BKGT1 = jnp.max(s_BKGTS, axis=-1, keepdims=True)
    if sinks_KG is not None:
        sink_11KG1 = sinks_KG.astype(jnp.float32)[None, :, :, None, None]
        m_BKGT1 = jnp.maximum(m_BKGT1, sink_11KG1)
    p_BKGTS = jnp.exp(s_BKGTS - m_BKGT1)
    denom_BKGT1 = jnp.sum(p_BKGTS, axis=-1, keepdims=True)
    if sinks_KG is not None:
        denom_BKGT1 = denom_BKGT1 + jnp.exp(sink_11KG1 - m_BKGT1)  # the sink joins the denominator only
    p_BKGTS = p_BKGTS / denom_BKGT1
    if spec.dropout_rate > 0.0 and dropout_rng is not None:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - spec.dropout_rate, p_BKGTS.shape)
        p_BKGTS = jnp.where(keep, p_BKGTS / (1.0 - spec.dropout_rate), 0.0)
    o_BTKGV = jnp.einsum("BKGTS,BSKV->BTKGV", p_BKGTS.astype(v_BSKV.dtype), v_BSKV)
    return o_BTKGV


def attention(
    q_BTKGH,
    k_BSKH,
    v_BSKV,
    spec: AttentionSpec,
    *,
    q_pos_BT,
    k_pos_BS,
    q_seg_BT=None,
    k_seg_BS=None,
    sinks_KG=None,
    dropout_rng=None,
    impl: AttentionImpl | str = AttentionImpl.REFERENCE,
):
    """Scaled dot-product attention through the implementation `impl`."""
    impl = AttentionImpl(impl)
    mask_BTS = attention_mask(q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, causal=spec.causal, window=spec.window)
    return attention_reference(q_BTKGH, k_BSKH, v_BSKV, mask_BTS, spec, sinks_KG, dropout_rng)
