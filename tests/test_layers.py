"""Each component against an independent naive reference written here in NumPy."""

import math

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from modern_jax.config import ModelConfig, RopeScaling, RopeSpec
from modern_jax.kernels.masks import softcap
from modern_jax.layers.ffn import FFN
from modern_jax.layers.norms import Norm
from modern_jax.layers.positions import apply_rope, rope_frequencies, sinusoidal


def rand(shape, seed=0, scale=1.0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32) * scale


# ----- normalisation -----------------------------------------------------------

@pytest.mark.quick
def test_rmsnorm_statistics_in_fp32_under_bf16():
    cfg = ModelConfig(d_model=512, n_heads=8)
    norm = Norm(cfg, rngs=nnx.Rngs(0))
    gamma = rand((512,), 1)
    norm.weight[...] = jnp.asarray(gamma)
    x = jnp.asarray(rand((4, 512), 2, scale=300.0)).astype(jnp.bfloat16)
    y = norm(x)
    assert y.dtype == jnp.bfloat16
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    ref = x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + cfg.norm_eps) * gamma
    # within one bf16 rounding of the exact result (statistics in bf16 would be off by percents)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=2**-8, atol=1e-6)


def test_gemma_rmsnorm_scales_by_one_plus_gamma():
    cfg = ModelConfig(d_model=64, n_heads=4, norm_type="gemma_rmsnorm", norm_eps=1e-6)
    norm = Norm(cfg, rngs=nnx.Rngs(0))
    x = rand((3, 64))
    plain = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(norm(jnp.asarray(x)), plain, rtol=1e-5)  # gamma initialised to 0
    gamma = rand((64,), 3)
    norm.weight[...] = jnp.asarray(gamma)
    np.testing.assert_allclose(norm(jnp.asarray(x)), plain * (1 + gamma), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_layernorm(bias):
    cfg = ModelConfig(d_model=64, n_heads=4, norm_type="layernorm", norm_bias=bias)
    norm = Norm(cfg, rngs=nnx.Rngs(0))
    gamma, beta = rand((64,), 1), rand((64,), 2)
    norm.weight[...] = jnp.asarray(gamma)
    if bias:
        norm.bias[...] = jnp.asarray(beta)
    x = rand((3, 64), 4, scale=5.0) + 3.0
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + cfg.norm_eps) * gamma
    ref = ref + beta if bias else ref
    np.testing.assert_allclose(norm(jnp.asarray(x)), ref, rtol=1e-5, atol=1e-5)
    assert (norm.bias is not None) == bias


# ----- feed-forward ------------------------------------------------------------

NP_ACT = {
    "relu": lambda x: np.maximum(x, 0),
    "gelu": lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2))),
    "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    "silu": lambda x: x / (1 + np.exp(-x)),
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "identity": lambda x: x,
}
GATED = {"glu": "sigmoid", "reglu": "relu", "geglu": "gelu", "swiglu": "silu", "bilinear": "identity",
         "geglu_tanh": "gelu_tanh"}


def _set_ffn(ffn, fused, seed):
    d, f = ffn.down_proj.kernel.shape[1], ffn.down_proj.kernel.shape[0]
    w_gate, w_up, w_down = rand((d, f), seed, 0.2), rand((d, f), seed + 1, 0.2), rand((f, d), seed + 2, 0.2)
    if fused:
        ffn.gate_up_proj.kernel[...] = jnp.asarray(np.stack([w_gate, w_up], axis=1))
    else:
        ffn.gate_proj.kernel[...] = jnp.asarray(w_gate)
        ffn.up_proj.kernel[...] = jnp.asarray(w_up)
    ffn.down_proj.kernel[...] = jnp.asarray(w_down)
    return w_gate, w_up, w_down


@pytest.mark.quick
@pytest.mark.parametrize("name", list(GATED))
@pytest.mark.parametrize("fused", [False, True])
def test_gated_ffn(name, fused):
    act = GATED[name]
    cfg = ModelConfig(d_model=32, n_heads=4, d_ff=48, ffn_type="gated", activation=act, fused_gate_up=fused)
    ffn = FFN(cfg, rngs=nnx.Rngs(0))
    w_gate, w_up, w_down = _set_ffn(ffn, fused, 10)
    x = rand((2, 5, 32), 1)
    ref = (NP_ACT[act](x @ w_gate) * (x @ w_up)) @ w_down
    np.testing.assert_allclose(ffn(jnp.asarray(x)), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu"])
def test_plain_mlp(act):
    cfg = ModelConfig(d_model=32, n_heads=4, ffn_type="mlp", activation=act, mlp_bias=True)
    ffn = FFN(cfg, rngs=nnx.Rngs(0))
    assert ffn.up_proj.kernel.shape == (32, 128)  # 4d by default
    w1, b1, w2, b2 = rand((32, 128), 1, 0.2), rand((128,), 2), rand((128, 32), 3, 0.2), rand((32,), 4)
    ffn.up_proj.kernel[...], ffn.up_proj.bias[...] = jnp.asarray(w1), jnp.asarray(b1)
    ffn.down_proj.kernel[...], ffn.down_proj.bias[...] = jnp.asarray(w2), jnp.asarray(b2)
    x = rand((2, 3, 32), 5)
    np.testing.assert_allclose(ffn(jnp.asarray(x)), NP_ACT[act](x @ w1 + b1) @ w2 + b2, rtol=1e-4, atol=1e-5)


# ----- positions ---------------------------------------------------------------

def naive_rope(x, pos, theta, rotary_dim, layout):
    """Rotate each feature pair as a complex number by pos * theta^(-2i/R)."""
    out = x.astype(np.float64).copy()
    for i in range(rotary_dim // 2):
        a, b = (i, i + rotary_dim // 2) if layout == "half" else (2 * i, 2 * i + 1)
        angle = pos[:, :, None] * theta ** (-2 * i / rotary_dim)
        z = (x[..., a] + 1j * x[..., b]) * np.exp(1j * angle)
        out[..., a], out[..., b] = z.real, z.imag
    return out


@pytest.mark.quick
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [16, 8])  # full and partial rotary
def test_rope_against_complex_rotation(layout, rotary_dim):
    spec = RopeSpec(10000.0, rotary_dim, layout, RopeScaling())
    x = rand((2, 7, 3, 16))
    pos = np.array([np.arange(7), np.arange(7) * 3 + 5])
    got = apply_rope(jnp.asarray(x), jnp.asarray(pos), spec)
    np.testing.assert_allclose(got, naive_rope(x, pos, 10000.0, rotary_dim, layout), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])  # untouched tail


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_scores_depend_only_on_relative_position(layout):
    spec = RopeSpec(500.0, 32, layout, RopeScaling())
    q, k = jnp.asarray(rand((1, 1, 1, 32), 1)), jnp.asarray(rand((1, 1, 1, 32), 2))

    def score(m, n):
        qm = apply_rope(q, jnp.array([[m]]), spec)
        kn = apply_rope(k, jnp.array([[n]]), spec)
        return float(jnp.sum(qm * kn))

    base = score(3, 7)
    for m in (0, 10, 100, 1000):
        assert score(m, m + 4) == pytest.approx(base, rel=1e-4, abs=1e-4)
    assert abs(score(3, 8) - base) > 1e-3  # and it does depend on n - m


def test_rope_scalings():
    base = RopeSpec(500000.0, 128, "half", RopeScaling())
    plain, _ = rope_frequencies(base)
    linear, _ = rope_frequencies(RopeSpec(500000.0, 128, "half", RopeScaling("linear", factor=4.0)))
    np.testing.assert_allclose(linear, plain / 4.0, rtol=1e-6)
    llama3 = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=8192)
    scaled, factor = rope_frequencies(RopeSpec(500000.0, 128, "half", llama3))
    wavelen = 2 * np.pi / plain
    assert factor == 1.0
    np.testing.assert_allclose(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])  # high freq: kept
    np.testing.assert_allclose(scaled[wavelen > 8192], plain[wavelen > 8192] / 8.0, rtol=1e-6)  # low: / factor
    mid = (wavelen >= 2048) & (wavelen <= 8192)
    assert mid.any() and np.all(scaled[mid] <= plain[mid]) and np.all(scaled[mid] >= plain[mid] / 8.0)
    yarn = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=4096)
    y_freq, y_factor = rope_frequencies(RopeSpec(10000.0, 64, "half", yarn))
    assert y_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    plain64, _ = rope_frequencies(RopeSpec(10000.0, 64, "half", RopeScaling()))
    assert y_freq[0] == pytest.approx(plain64[0])  # fastest pair extrapolates
    assert y_freq[-1] == pytest.approx(plain64[-1] / 4.0)  # slowest pair interpolates


def test_sinusoidal_positions():
    pos = np.array([[0, 1, 5, 17]])
    got = np.asarray(sinusoidal(jnp.asarray(pos), 8, jnp.float32))
    for t, p in enumerate(pos[0]):
        for i in range(4):
            assert got[0, t, 2 * i] == pytest.approx(math.sin(p / 10000 ** (2 * i / 8)), abs=1e-5)
            assert got[0, t, 2 * i + 1] == pytest.approx(math.cos(p / 10000 ** (2 * i / 8)), abs=1e-5)


@pytest.mark.quick
def test_softcap_oracles():
    assert float(softcap(jnp.float32(75.0), 50.0)) == pytest.approx(45.2574, abs=1e-4)
    assert float(softcap(jnp.float32(100.0), 30.0)) == pytest.approx(29.92, abs=5e-3)
    chex.assert_trees_all_close(softcap(jnp.float32(1e-3), 50.0), jnp.float32(1e-3), rtol=1e-5)


# ----- block placements ----------------------------------------------------------

def np_rmsnorm(x, norm, eps):
    return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps) * np.asarray(norm.weight[...], np.float64)


def np_attention(x, attn):
    """Causal multi-head attention from the layer's projection kernels, float64."""
    w = {name: np.asarray(getattr(attn, name).kernel[...], np.float64)
         for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    q, k, v = (np.einsum("btd,dnh->btnh", x, w[name]) for name in ("q_proj", "k_proj", "v_proj"))
    s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    T = x.shape[1]
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("btnh,nhd->btd", np.einsum("bnts,bsnh->btnh", p, v), w["o_proj"])


def np_swiglu(x, ffn):
    gate, up, down = (np.asarray(getattr(ffn, name).kernel[...], np.float64)
                      for name in ("gate_proj", "up_proj", "down_proj"))
    return NP_ACT["silu"](x @ gate) * (x @ up) @ down


def np_block(x, block, placement, eps, n_layers):
    """SPEC's formula of each placement, per sublayer F: post `Norm(x + F(x))`, deepnorm
    `Norm(alpha x + F(x))` with DeepNet's alpha = (2 L)^(1/4), parallel `x + Attn(Norm(x)) +
    FFN(Norm(x))` (GPT-NeoX: a second norm for the FFN)."""
    attn = lambda h: np_attention(h, block.self_attn)  # noqa: E731
    ffn = lambda h: np_swiglu(h, block.mlp)  # noqa: E731
    norm = lambda h, name: np_rmsnorm(h, getattr(block, name), eps)  # noqa: E731
    if placement == "parallel":
        ffn_norm = "input_layernorm" if block.pre_feedforward_layernorm is None else "pre_feedforward_layernorm"
        return x + attn(norm(x, "input_layernorm")) + ffn(norm(x, ffn_norm))
    alpha = (2 * n_layers) ** 0.25 if placement == "deepnorm" else 1.0
    h = norm(alpha * x + attn(x), "post_attention_layernorm")
    return norm(alpha * h + ffn(h), "post_feedforward_layernorm")


@pytest.mark.parametrize("placement, shared", [("post", True), ("deepnorm", True), ("parallel", True),
                                               ("parallel", False)])
def test_block_placements_against_their_formulas(placement, shared):
    """A whole block (attention + SwiGLU, RMSNorm) with random weights and norm gains against the
    placement's formula written out in NumPy (8 layers: DeepNet's alpha is 2)."""
    from modern_jax.layers.block import Block

    cfg = ModelConfig(d_model=32, n_heads=4, n_layers=8, d_ff=48, position_embedding="none", norm_placement=placement,
                      parallel_shared_norm=shared)
    block = Block(cfg, cfg.layer_specs()[0], rngs=nnx.Rngs(0))
    rng = np.random.default_rng(7)
    for path, var in nnx.to_flat_state(nnx.state(block, nnx.Param)):
        noise = rng.normal(size=var.shape).astype(np.float32)
        var.set_value(jnp.asarray(1.0 + 0.5 * noise if "norm" in str(path[-2]) else 0.3 * noise))
    x = rand((2, 6, 32), 8)
    got, _ = block(jnp.asarray(x), jnp.tile(jnp.arange(6), (2, 1)))
    want = np_block(x.astype(np.float64), block, placement, cfg.norm_eps, cfg.n_layers)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_deepnorm_scales_the_initialisation():
    """DeepNet's init: Xavier, with gain (8 L)^(-1/4) on v, the attention output and the FFN,
    none on q and k (sample standard deviations within 10%)."""
    from modern_jax.layers.block import Block

    L, D = 8, 64
    cfg = ModelConfig(d_model=D, n_heads=4, n_layers=L, d_ff=128, norm_placement="deepnorm")
    block = Block(cfg, cfg.layer_specs()[0], rngs=nnx.Rngs(0))
    beta = (8 * L) ** -0.25
    attn, ffn = block.self_attn, block.mlp
    for layer, name, fan_in, fan_out, gain in [(attn, "q_proj", D, D, 1.0), (attn, "k_proj", D, D, 1.0),
                                               (attn, "v_proj", D, D, beta), (attn, "o_proj", D, D, beta),
                                               (ffn, "up_proj", D, 128, beta), (ffn, "down_proj", 128, D, beta)]:
        std = float(np.std(np.asarray(getattr(layer, name).kernel[...])))
        assert std == pytest.approx(gain * math.sqrt(2 / (fan_in + fan_out)), rel=0.1), name
