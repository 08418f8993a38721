"""Positions: RoPE (both pair layouts, partial, linear / Llama-3 / YaRN scaling), sinusoids, and
the attention temperature tuning of layers without positions (Llama 4).

RoPE rotates pairs of query/key features by `position * inv_freq`; values are never
rotated. `half` pairs feature i with i + R/2 (Llama, Hugging Face); `interleaved`
pairs 2i with 2i + 1 (RoFormer, GPT-J). Only the first `rotary_dim` features rotate.
"""

from __future__ import annotations

import functools

import math

import jax
import jax.numpy as jnp
import numpy as np

from modern_jax.config import RopeSpec, TemperatureSpec


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(spec: RopeSpec) -> tuple[np.ndarray, float]:
    """Inverse frequencies [R/2] and the attention factor applied to cos/sin."""
    dim, base, s = spec.rotary_dim, spec.theta, spec.scaling
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    if s.type == "linear":
        return inv_freq / s.factor, 1.0
    if s.type == "llama3":
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        mixed = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return np.where(medium, mixed, scaled).astype(np.float32), 1.0
    if s.type == "yarn":
        if s.attention_factor is not None:
            attention_factor = s.attention_factor
        elif s.mscale and s.mscale_all_dim:
            attention_factor = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(s.factor)

        def correction_dim(rotations):
            return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv_freq = (inv_freq / s.factor) * (1 - extrapolation) + inv_freq * extrapolation
        return inv_freq.astype(np.float32), attention_factor
    return inv_freq, 1.0


def apply_rope(x_BTNH, pos_BT, spec: RopeSpec):
    """Rotate the first `spec.rotary_dim` features of every head of `x` by its position."""
    inv_freq, attention_factor = rope_frequencies(spec)
    angle_BTR = pos_BT.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]
    # x cos + rotate(x) sin in x's dtype, as transformers computes it; rotate(x) = x @ R, R a signed
    # permutation (exact in any dtype): one elementwise pass after a tiny matmul, no split halves
    cos_BT1R = (jnp.cos(angle_BTR) * attention_factor)[:, :, None, :].astype(x_BTNH.dtype)
    sin_BT1R = (jnp.sin(angle_BTR) * attention_factor)[:, :, None, :].astype(x_BTNH.dtype)
    cos_BT1R, sin_BT1R = (_per_feature(c, spec.layout) for c in (cos_BT1R, sin_BT1R))
    rot, rest = x_BTNH[..., : spec.rotary_dim], x_BTNH[..., spec.rotary_dim :]
    turned = jnp.matmul(rot, jnp.asarray(_rotation(spec.rotary_dim, spec.layout), rot.dtype),
                        precision=jax.lax.Precision.HIGHEST)  # [.., R] @ [R, R]; float32 stays float32 on a TPU too
    return jnp.concatenate([rot * cos_BT1R + turned * sin_BT1R, rest], axis=-1)


def _per_feature(c_BT1R, layout: str):
    """The angles' cos or sin [.., R / 2] per rotated feature [.., R]: halves (`half`) or pairs."""
    if layout == "half":
        return jnp.concatenate([c_BT1R, c_BT1R], axis=-1)
    return jnp.repeat(c_BT1R, 2, axis=-1)


@functools.lru_cache
def _rotation(R: int, layout: str) -> np.ndarray:
    """R [R, R] with x @ R = rotate(x): (-x2, x1) of the halves, or (-x_odd, x_even) in each pair."""
    m = np.zeros((R, R), np.float32)
    for i in range(R // 2):
        a, b = (i, i + R // 2) if layout == "half" else (2 * i, 2 * i + 1)
        m[b, a], m[a, b] = -1.0, 1.0  # out[a] = -x[b], out[b] = x[a]
    return m


def sinusoidal(pos_BT, d_model: int, dtype):
    """Vaswani et al. 2017: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...)."""
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, d_model, 2, dtype=np.float32) / d_model))
    angle_BTF = pos_BT.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]
    pe_BTD = jnp.stack([jnp.sin(angle_BTF), jnp.cos(angle_BTF)], axis=-1).reshape(*pos_BT.shape, d_model)
    return pe_BTD.astype(dtype)


def scale_queries(q_BTNH, pos_BT, spec: TemperatureSpec):
    """Temperature tuning (Llama 4's `attn_temperature_tuning`): the queries at position p times
    `log(floor((p + 1) / floor) + 1) * scale + 1` (1 while p + 1 < floor, then growing like log p).
    The floor is integer division, exact at any position."""
    steps_BT = ((jnp.maximum(pos_BT.astype(jnp.int32), 0) + 1) // spec.floor).astype(jnp.float32)  # padding: 0
    factor_BT11 = (jnp.log1p(steps_BT) * spec.scale + 1.0)[:, :, None, None]
    return (q_BTNH.astype(jnp.float32) * factor_BT11).astype(q_BTNH.dtype)
