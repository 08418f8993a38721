"""Attention core and layers against naive per-head loops written here in NumPy."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from modern_jax.config import ModelConfig
from modern_jax.kernels import AttentionSpec, Visibility, attention
from modern_jax.layers.attention import MLAttention


def rand(shape, seed=0, scale=1.0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32) * scale


def naive_attention(q_BTNH, k_BSNH, v_BSNH, q_pos, k_pos, *, scale, causal=True, window=None, q_seg=None,
                    k_seg=None, cap=None, sinks_N=None):
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


@pytest.mark.parametrize("feature", ["window", "segments", "softcap", "sinks", "non_causal", "empty_slots"])
def test_masks_softcap_and_sinks(feature):
    B, T, N, K, H = 2, 9, 4, 2, 8
    q, k, v = rand((B, T, N, H), 1, 2.0), rand((B, T, K, H), 2, 2.0), rand((B, T, K, H), 3)
    pos = np.tile(np.arange(T), (B, 1))
    k_pos = pos.copy()
    kw = dict(scale=H**-0.5)
    spec_kw, call_kw, segments = {}, {}, (None, None)
    if feature == "window":
        kw["window"] = spec_kw["window"] = 3
    if feature == "segments":
        seg = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 3], [1, 1, 1, 1, 1, 1, 2, 2, 0]])
        kw.update(q_seg=seg, k_seg=seg)
        segments = (jnp.asarray(seg), jnp.asarray(seg))
    if feature == "softcap":
        kw["cap"] = spec_kw["softcap"] = 1.5
    if feature == "sinks":
        sinks = rand((N,), 4)
        kw["sinks_N"] = sinks
        call_kw["sinks_KG"] = jnp.asarray(sinks.reshape(K, N // K))
    if feature == "non_causal":
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
    from modern_jax.layers.positions import apply_rope

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
