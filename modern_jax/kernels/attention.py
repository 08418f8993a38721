"""Attention core and its dispatch.

Letters: B batch, T query length, S key length, K kv heads, G queries per kv head,
H head dim (keys), U head dim (values), as in `modern_jax`.

Every implementation takes grouped queries `q[B, T, K, G, H]` against `k[B, S, K, H]`
and `v[B, S, K, U]`, so grouped-query attention never materialises repeated K/V.
Masks are defined by positions, passed as one `masks.Visibility(q_pos, k_pos, q_seg,
k_seg)`: a key is visible when it is valid (`k_pos >= 0`), not in the future
(`k_pos <= q_pos`, if causal), inside the window (`q_pos - k_pos < window`), in the same
chunk (`q_pos // chunk == k_pos // chunk`, chunked local attention) and in the same segment
(packed sequences).

Asked with `return_max_logit=True`, every implementation but `cudnn` also returns the max
of |q.k| * scale over the visible pairs of each head, `[K, G]` (before any soft-cap; an
instability diagnostic, and what QK-clip rescales each head's weights by)
from its own pass over the scores: the blocked ones fold each visited tile into a running
per-row max beside the softmax's. It has no gradient, and the backward pass is the same.
cuDNN does not expose its scores, so `cudnn` reports it as a missing feature (`default`
falls back; an explicit `cudnn` raises).

Implementations (`AttentionImpl`), all with causal, GQA/MQA, window, chunks, soft-cap, sinks
and segment ids unless said otherwise:

| impl        | what                                                   | runs on            |
|-------------|--------------------------------------------------------|--------------------|
| reference   | plain einsum, fp32 softmax: the numerical oracle       | everywhere         |
| chunked     | online softmax over blocks, O(T) memory (`chunked.py`) | everywhere         |
| pallas_gpu  | flash attention kernels, Triton (`flash_gpu.py`)       | GPU, or interpret  |
| pallas_tpu  | flash attention kernels, Mosaic (`flash_tpu.py`)       | TPU, or interpret  |
| cudnn       | `jax.nn.dot_product_attention(implementation="cudnn")` | GPU; no sinks, no soft-cap, H == U, bf16/fp16 |

`cudnn` gets the position mask as a dense `[B, 1, T, S]` array (cuDNN's own causal and
window masks count indices, not positions), so it is there for comparison, not a default;
the dense mask carries every rule (windows, chunks, segments) exactly.

`default` resolves by platform (the one compiled for, `backend.platform()`) to the first implementation that can run the call:
GPU `pallas_gpu`, TPU `pallas_tpu` (then `chunked`, then `reference`), CPU `reference` (the
oracle; name `chunked` for its O(T) memory on long sequences).
An explicit choice that cannot run the call raises `UnsupportedFeatureError` naming
what is missing. Attention dropout exists only in `reference`. A single query (decoding
one token against the cache) always runs `chunked` (or `reference` with dropout): a
kernel tiled for long sequences has nothing to tile there; against a longer cache, `chunked`
reads it block by block up to the last block any row sees (`chunked.attention_decode`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from modern_jax.execution import ATTENTION_IMPLS
from modern_jax.sharding.devices import platform
from modern_jax.kernels.backend import UnsupportedFeatureError, can_run_pallas, interpret_target, note_kernel
from modern_jax.kernels.chunked import attention_chunked, attention_decode
from modern_jax.kernels.flash_gpu import flash_attention_gpu
from modern_jax.kernels.flash_tpu import flash_attention_tpu
from modern_jax.kernels.masks import MASK_VALUE, Visibility, softcap


# DEFAULT, REFERENCE, CHUNKED, CUDNN, PALLAS_GPU, PALLAS_TPU: the names `execution.ATTENTION_IMPLS` defines
AttentionImpl = enum.StrEnum("AttentionImpl", {name.upper(): name for name in ATTENTION_IMPLS})


@dataclass(frozen=True)
class AttentionSpec:
    """The static features of one attention call."""

    scale: float
    causal: bool = True
    window: int | None = None
    softcap: float | None = None
    dropout_rate: float = 0.0
    chunk: int | None = None  # chunked local attention: only keys of the query's own block of positions


def attention_reference(q_BTKGH, k_BSKH, v_BSKU, mask_BTS, spec: AttentionSpec, sinks_KG=None, keep_BKGTS=None,
                        return_max_logit: bool = False):
    """Plain einsum attention with fp32 softmax: the numerical oracle (`mask_BTS`: `Visibility.mask`).

    `keep_BKGTS`: attention dropout's mask (`dropout_mask`): the probabilities it keeps are
    scaled by `1 / (1 - spec.dropout_rate)`, the others dropped. With `return_max_logit`,
    returns `(o, max |q.k| * scale over the visible pairs, per head [K, G])`.
    """
    x_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
    x_BKGTS = x_BKGTS * spec.scale
    s_BKGTS = softcap(x_BKGTS, spec.softcap)
    s_BKGTS = jnp.where(mask_BTS[:, None, None], s_BKGTS, MASK_VALUE)
    m_BKGT1 = jnp.max(s_BKGTS, axis=-1, keepdims=True)
    if sinks_KG is not None:
        sink_11KG1 = sinks_KG.astype(jnp.float32)[None, :, :, None, None]
        m_BKGT1 = jnp.maximum(m_BKGT1, sink_11KG1)
    p_BKGTS = jnp.exp(s_BKGTS - m_BKGT1)
    denom_BKGT1 = jnp.sum(p_BKGTS, axis=-1, keepdims=True)
    if sinks_KG is not None:
        denom_BKGT1 = denom_BKGT1 + jnp.exp(sink_11KG1 - m_BKGT1)  # the sink joins the denominator only
    p_BKGTS = p_BKGTS / denom_BKGT1
    if keep_BKGTS is not None:
        p_BKGTS = jnp.where(keep_BKGTS, p_BKGTS / (1.0 - spec.dropout_rate), 0.0)
    o_BTKGU = jnp.einsum("BKGTS,BSKU->BTKGU", p_BKGTS.astype(v_BSKU.dtype), v_BSKU)
    if return_max_logit:
        return o_BTKGU, jax.lax.stop_gradient(jnp.max(jnp.where(mask_BTS[:, None, None], jnp.abs(x_BKGTS), 0.0),
                                                       axis=(0, 3, 4)))
    return o_BTKGU


def dropout_mask(rng, rate: float, B: int, K: int, G: int, T: int, S: int):
    """Attention dropout's keep mask `[B, K, G, T, S]`, True with probability `1 - rate`: one draw
    over the whole call's probabilities, so a mesh that splits them keeps what one device keeps."""
    return jax.random.bernoulli(rng, 1.0 - rate, (B, K, G, T, S))


DEFAULTS = {
    "gpu": (AttentionImpl.PALLAS_GPU, AttentionImpl.CHUNKED, AttentionImpl.REFERENCE),
    "tpu": (AttentionImpl.PALLAS_TPU, AttentionImpl.CHUNKED, AttentionImpl.REFERENCE),
    "cpu": (AttentionImpl.REFERENCE,),
}
DECODE = (AttentionImpl.CHUNKED, AttentionImpl.REFERENCE)  # one query: nothing to tile, O(S) memory


def missing_feature(impl: AttentionImpl, q_BTKGH, k_BSKH, v_BSKU, spec: AttentionSpec, sinks_KG, dropout,
                    max_logit: bool = False) -> str | None:
    """What `impl` lacks to run this call, or None if it can."""
    if impl is AttentionImpl.REFERENCE:
        return None
    if dropout:
        return "attention dropout (only 'reference' implements it)"
    if impl is AttentionImpl.CHUNKED:
        return None
    if impl is AttentionImpl.PALLAS_GPU:
        return can_run_pallas("gpu")
    if impl is AttentionImpl.PALLAS_TPU:
        return can_run_pallas("tpu")
    if impl is AttentionImpl.CUDNN:
        H, U = k_BSKH.shape[-1], v_BSKU.shape[-1]
        if platform() != "gpu":
            return f"an NVIDIA GPU with cuDNN (this computation is compiled for {platform()!r})"
        if max_logit:
            return ("the max attention logit (cuDNN does not expose its scores; train with "
                    "train.diagnostics=false, or another execution.attention_impl)")
        if sinks_KG is not None:
            return "attention sinks"
        if spec.softcap is not None:
            return "logit soft-cap"
        if H != U:
            return f"different key and value head dims (H={H}, U={U})"
        if q_BTKGH.dtype not in (jnp.bfloat16, jnp.float16):
            return f"{jnp.dtype(q_BTKGH.dtype).name} inputs (cuDNN flash attention takes bfloat16 or float16)"
        if H % 8 or H > 256:
            return f"head dim {H} (cuDNN needs a multiple of 8, at most 256)"
        return None
    raise AssertionError(impl)


def resolve(impl: AttentionImpl | str, q_BTKGH, k_BSKH, v_BSKU, spec: AttentionSpec, sinks_KG=None,
            dropout: bool = False, max_logit: bool = False) -> AttentionImpl:
    """The implementation that runs this call (see the module docstring for the rules)."""
    impl = AttentionImpl(impl)
    features = (q_BTKGH, k_BSKH, v_BSKU, spec, sinks_KG, dropout, max_logit)
    if impl is AttentionImpl.DEFAULT or (q_BTKGH.shape[1] == 1 and impl is not AttentionImpl.REFERENCE):
        candidates = DEFAULTS.get(platform(), DEFAULTS["cpu"]) if q_BTKGH.shape[1] > 1 else DECODE
        return next(c for c in candidates if missing_feature(c, *features) is None)
    reason = missing_feature(impl, *features)
    if reason is not None:
        raise UnsupportedFeatureError(f"execution.attention_impl={impl.value!r} cannot run this call: it needs "
                                      f"{reason}")
    return impl


def attention_cudnn(q_BTKGH, k_BSKH, v_BSKU, spec: AttentionSpec, mask_BTS):
    """cuDNN flash attention. Its causal and window masks count indices, not positions, so the
    position mask is passed whole (`[B, 1, T, S]`): exact for any layout, but O(T S) memory."""
    B, T, K, G, H = q_BTKGH.shape
    o_BTNH = jax.nn.dot_product_attention(
        q_BTKGH.reshape(B, T, K * G, H), k_BSKH, v_BSKU, mask=mask_BTS[:, None], scale=spec.scale,
        implementation="cudnn")
    return o_BTNH.reshape(B, T, K, G, H)


def attention(q_BTKGH, k_BSKH, v_BSKU, spec: AttentionSpec, vis: Visibility, *, sinks_KG=None, keep_BKGTS=None,
              impl: AttentionImpl | str = AttentionImpl.REFERENCE, return_max_logit: bool = False):
    """Scaled dot-product attention through the implementation `impl` (resolved by `resolve`).

    `vis`: the queries' and keys' positions and segments (`masks.Visibility`). `keep_BKGTS`:
    attention dropout's mask (`dropout_mask`), or None for no dropout. With
    `return_max_logit` (static), returns `(o, max_logit)`: the max of |q.k| * scale over the
    visible pairs of each head (before any soft-cap), float32 `[K, G]` without gradient, measured
    by the implementation's own pass over the scores.
    """
    impl = resolve(impl, q_BTKGH, k_BSKH, v_BSKU, spec, sinks_KG, keep_BKGTS is not None, return_max_logit)
    note_kernel("attention", impl.value)
    kwargs = dict(sinks_KG=sinks_KG, return_max_logit=return_max_logit)
    interpret = interpret_target() is not None
    match impl:
        case AttentionImpl.CHUNKED if q_BTKGH.shape[1] == 1 < k_BSKH.shape[1]:  # decoding against a cache
            return attention_decode(q_BTKGH, k_BSKH, v_BSKU, spec, vis, **kwargs)
        case AttentionImpl.CHUNKED:
            return attention_chunked(q_BTKGH, k_BSKH, v_BSKU, spec, vis, **kwargs)
        case AttentionImpl.PALLAS_GPU:
            return flash_attention_gpu(q_BTKGH, k_BSKH, v_BSKU, spec, vis, interpret=interpret, **kwargs)
        case AttentionImpl.PALLAS_TPU:
            return flash_attention_tpu(q_BTKGH, k_BSKH, v_BSKU, spec, vis, interpret=interpret, **kwargs)
    mask_BTS = vis.mask(causal=spec.causal, window=spec.window, chunk=spec.chunk)
    if impl is AttentionImpl.CUDNN:
        return attention_cudnn(q_BTKGH, k_BSKH, v_BSKU, spec, mask_BTS)
    return attention_reference(q_BTKGH, k_BSKH, v_BSKU, mask_BTS, spec, sinks_KG, keep_BKGTS, return_max_logit)
