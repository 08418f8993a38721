"""Attention core and layers against naive per-head loops written here in NumPy."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from modern_jax.config import ModelConfig
from modern_jax.kernels import AttentionSpec, Visibility, attention
from modern_jax.layers.attention import Attention, MLAttention
from modern_jax.layers.norms import l2_norm
from modern_jax.layers.positions import apply_rope, scale_queries


def rand(shape, seed=0, scale=1.0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32) * scale


def naive_attention(q_BTNH, k_BSNH, v_BSNH, q_pos, k_pos, *, scale, causal=True, window=None, q_seg=None,
                    k_seg=None, cap=None, sinks_N=None, chunk=None):
    """One head and one query at a time; K/V already repeated to N heads."""
    B, T, N, _ = q_BTNH.shape
    S = k_BSNH.shape[1]
    out = np.zeros(q_BTNH.shape[:3] + (v_BSNH.shape[-1],))
    for b in range(B):
        for n in range(N):
            for t in range(T):
                logits, values = [], []
                for s in range(S):
                    visible = k_pos[b, s] >= 0
                    visible &= (not causal) or k_pos[b, s] <= q_pos[b, t]
                    visible &= window is None or q_pos[b, t] - k_pos[b, s] < window
                    start = None if chunk is None else q_pos[b, t] // chunk * chunk  # the query's own block
                    visible &= chunk is None or start <= k_pos[b, s] < start + chunk
                    visible &= q_seg is None or q_seg[b, t] == k_seg[b, s]
                    if visible:
                        x = float(q_BTNH[b, t, n] @ k_BSNH[b, s, n]) * scale
                        logits.append(cap * np.tanh(x / cap) if cap else x)
                        values.append(v_BSNH[b, s, n])
                logits = np.array(logits + ([sinks_N[n]] if sinks_N is not None else []), np.float64)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[b, t, n] = p[: len(values)] @ np.array(values)
    return out


def grouped(q_BTNH, K):
    B, T, N, H = q_BTNH.shape
    return jnp.asarray(q_BTNH.reshape(B, T, K, N // K, H))


@pytest.mark.parametrize("K", [4, 2, 1])  # MHA, GQA, MQA
def test_gqa_equals_mha_with_repeated_kv(K):
    B, T, N, H = 2, 6, 4, 8
    q, k, v = rand((B, T, N, H), 1), rand((B, T, K, H), 2), rand((B, T, K, H), 3)
    pos = np.tile(np.arange(T), (B, 1))
    got = attention(grouped(q, K), jnp.asarray(k), jnp.asarray(v), AttentionSpec(scale=H**-0.5),
                    Visibility(jnp.asarray(pos), jnp.asarray(pos)))
    ref = naive_attention(q, np.repeat(k, N // K, 2), np.repeat(v, N // K, 2), pos, pos, scale=H**-0.5)
    np.testing.assert_allclose(np.asarray(got).reshape(B, T, N, H), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.quick
@pytest.mark.parametrize("feature", ["window", "segments", "softcap", "sinks", "non_causal", "empty_slots", "chunk",
                                     "chunk_segments", "chunk_non_causal"])
def test_masks_softcap_and_sinks(feature):
    B, T, N, K, H = 2, 9, 4, 2, 8
    q, k, v = rand((B, T, N, H), 1, 2.0), rand((B, T, K, H), 2, 2.0), rand((B, T, K, H), 3)
    pos = np.tile(np.arange(T), (B, 1))
    k_pos = pos.copy()
    kw = dict(scale=H**-0.5)
    spec_kw, call_kw, segments = {}, {}, (None, None)
    if feature == "window":
        kw["window"] = spec_kw["window"] = 3
    if feature.startswith("chunk"):
        kw["chunk"] = spec_kw["chunk"] = 4
    if feature.endswith("segments"):
        seg = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 3], [1, 1, 1, 1, 1, 1, 2, 2, 0]])
        kw.update(q_seg=seg, k_seg=seg)
        segments = (jnp.asarray(seg), jnp.asarray(seg))
    if feature == "softcap":
        kw["cap"] = spec_kw["softcap"] = 1.5
    if feature == "sinks":
        sinks = rand((N,), 4)
        kw["sinks_N"] = sinks
        call_kw["sinks_KG"] = jnp.asarray(sinks.reshape(K, N // K))
    if feature.endswith("non_causal"):
        kw["causal"] = spec_kw["causal"] = False
    if feature == "empty_slots":
        k_pos[:, -3:] = -1  # unwritten cache slots
    got = attention(grouped(q, K), jnp.asarray(k), jnp.asarray(v), AttentionSpec(scale=H**-0.5, **spec_kw),
                    Visibility(jnp.asarray(pos), jnp.asarray(k_pos), *segments), **call_kw)
    ref = naive_attention(q, np.repeat(k, N // K, 2), np.repeat(v, N // K, 2), pos, k_pos, **kw)
    np.testing.assert_allclose(np.asarray(got).reshape(B, T, N, H), ref, rtol=1e-5, atol=1e-5)


def test_sinks_only_shrink_attention_weights():
    B, T, H = 1, 4, 8
    q, k = jnp.asarray(rand((B, T, 1, 1, H), 1)), jnp.asarray(rand((B, T, 1, H), 2))
    v = jnp.ones((B, T, 1, H))  # outputs equal the total attention weight
    pos = jnp.arange(T)[None]
    spec = AttentionSpec(scale=1.0)
    plain = attention(q, k, v, spec, Visibility(pos, pos))
    sunk = attention(q, k, v, spec, Visibility(pos, pos), sinks_KG=jnp.full((1, 1), 2.0))
    np.testing.assert_allclose(plain, 1.0, rtol=1e-6)
    assert np.all(np.asarray(sunk) < 1.0)


@pytest.mark.parametrize("q_rank", [0, 16])
def test_mla_absorbed_equals_unabsorbed(q_rank):
    cfg = ModelConfig(d_model=64, n_heads=4, attention_type="mla", mla_kv_rank=24, mla_q_rank=q_rank,
                      mla_rope_dim=8, mla_nope_dim=16, mla_v_dim=12, rope_layout="interleaved")
    layer = MLAttention(cfg, cfg.layer_specs()[0], rngs=nnx.Rngs(0))
    x = jnp.asarray(rand((2, 7, 64), 1))
    pos = jnp.tile(jnp.arange(7), (2, 1))
    full, _ = layer(x, pos, absorb=False)
    absorbed, _ = layer(x, pos, absorb=True)
    np.testing.assert_allclose(absorbed, full, rtol=1e-4, atol=1e-5)
    assert full.shape == (2, 7, 64)


def test_mla_matches_naive_per_head_attention():
    cfg = ModelConfig(d_model=32, n_heads=2, attention_type="mla", mla_kv_rank=8, mla_rope_dim=4,
                      mla_nope_dim=6, mla_v_dim=5, position_embedding="rope")
    layer = MLAttention(cfg, cfg.layer_specs()[0], rngs=nnx.Rngs(1))
    x = rand((1, 5, 32), 2)
    pos = np.arange(5)[None]
    w_q = np.asarray(layer.q_proj.kernel[...])
    w_a = np.asarray(layer.kv_a_proj_with_mqa.kernel[...])
    w_b = np.asarray(layer.kv_b_proj.kernel[...])
    w_o = np.asarray(layer.o_proj.kernel[...])
    spec = cfg.layer_specs()[0].rope
    q = np.einsum("btd,dnh->btnh", x, w_q)
    q_pe = np.asarray(apply_rope(jnp.asarray(q[..., 6:]), jnp.asarray(pos), spec))
    ckv = x @ w_a
    c = ckv[..., :8] / np.sqrt(np.mean(ckv[..., :8] ** 2, -1, keepdims=True) + cfg.norm_eps)
    k_pe = np.asarray(apply_rope(jnp.asarray(ckv[:, :, None, 8:]), jnp.asarray(pos), spec))
    kv = np.einsum("bsc,cnh->bsnh", c, w_b)
    k = np.concatenate([kv[..., :6], np.repeat(k_pe, 2, 2)], -1)
    qq = np.concatenate([q[..., :6], q_pe], -1)
    o = naive_attention(qq, k, kv[..., 6:], pos, pos, scale=10**-0.5)
    ref = np.einsum("btnv,nvd->btd", o, w_o)
    got, _ = layer(jnp.asarray(x), jnp.asarray(pos))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


# ----- Llama 4: the weightless L2 QK-norm and the NoPE layers' temperature tuning ---------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_l2_norm_matches_numpy(dtype):
    """`x * rsqrt(mean(x^2, -1) + eps)` (transformers' Llama4TextL2Norm), float32 statistics:
    1e-6 relative in float32, one bfloat16 rounding (4e-3) in bfloat16."""
    x = rand((2, 5, 3, 16), 1, 3.0)
    x[0, 0, 0] = 0.0  # an all-zero head stays zero
    got = np.asarray(l2_norm(jnp.asarray(x, dtype), 1e-5), np.float32)
    x = np.asarray(jnp.asarray(x, dtype), np.float64)
    want = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == "float32" else 4e-3, atol=1e-6)


def test_temperature_matches_numpy():
    """q times `log(floor((p + 1) / floor) + 1) * scale + 1` per position (1e-6 relative), exact at
    multiples of the floor and past 2^24 (float32 rounds 2^25 - 1 up to 2^25, a step too far)."""
    from modern_jax.config import TemperatureSpec

    pos = np.array([[0, 1, 2, 3, 6, 7, 8, 100], [8190, 8191, 8192, 16383, 10**6, 2**25 - 2, 10**7, 5 * 10**7]])
    for floor, scale in ((8192, 0.1), (4, 0.5)):
        q = rand((2, 8, 3, 4), 2)
        got = scale_queries(jnp.asarray(q), jnp.asarray(pos, jnp.int32), TemperatureSpec(floor, scale))
        factor = np.vectorize(lambda p: math.log(math.floor((int(p) + 1) / floor) + 1) * scale + 1)(pos)
        np.testing.assert_allclose(got, q * factor[:, :, None, None], rtol=1e-6)
    assert np.floor(np.float32(2**25 - 1) / 8192) == 2**12 != (2**25 - 1) // 8192  # why the floor is integer


LLAMA4_LAYERS = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, attention_pattern="CG",
                     attention_chunk_size=3, rope_pattern="RN", qk_norm="l2", attn_temperature_floor=2,
                     attn_temperature_scale=0.5, rope_layout="interleaved", norm_eps=1e-5)


@pytest.mark.parametrize("layer", [0, 1])
def test_llama4_attention_layers_match_numpy(layer):
    """Layer 0 (chunked, RoPE): q, k L2-normalised per head after RoPE, chunks of 3; layer 1
    (global, NoPE): no norm, queries scaled by the temperature of their positions. Against NumPy
    projections, formulas and per-head loops (1e-4 relative, 1e-5 absolute)."""
    cfg = ModelConfig(**LLAMA4_LAYERS)
    spec = cfg.layer_specs()[layer]
    assert (spec.chunk, spec.qk_norm, spec.temperature is None) == ((3, "l2", True), (None, "none", False))[layer]
    attn = Attention(cfg, spec, rngs=nnx.Rngs(layer))
    x = rand((2, 9, 32), 3)
    pos = np.array([np.arange(9), np.arange(9) + 5])  # the second row starts mid-chunk, past the floor
    w = {name: np.asarray(getattr(attn, name).kernel[...]) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    q, k, v = (np.einsum("btd,dnh->btnh", x, w[name]) for name in ("q_proj", "k_proj", "v_proj"))
    if spec.rope is not None:
        q, k = (np.asarray(apply_rope(jnp.asarray(a), jnp.asarray(pos), spec.rope)) for a in (q, k))
        q, k = (a / np.sqrt(np.mean(a**2, -1, keepdims=True) + cfg.norm_eps) for a in (q, k))
    else:
        q = q * (np.log(np.floor((pos + 1) / 2) + 1) * 0.5 + 1)[:, :, None, None]
    o = naive_attention(q, np.repeat(k, 2, 2), np.repeat(v, 2, 2), pos, pos, scale=8**-0.5, chunk=spec.chunk)
    want = np.einsum("btnh,nhd->btd", o, w["o_proj"])
    got, _ = attn(jnp.asarray(x), jnp.asarray(pos))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
