"""`ops.quant` (int8, NF4 with double quantization) against naive NumPy references written here."""

from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from modern_jax.ops import quant

# The NormalFloat4 values as published (QLoRA, Dettmers et al. 2023, Appendix E; bitsandbytes
# `functional.py`), typed in here independently of the module.
PUBLISHED_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]
EPS = 1e-6  # relative slack for float32 rounding in the bounds (a few ulps of the block absmax)


def rand(shape, seed=0, std=0.02):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32) * std


def blocks(a):
    """`[..., n]` -> `[..., n/64, 64]`."""
    return a.reshape(*a.shape[:-1], a.shape[-1] // 64, 64)


def unpack(codes):
    """uint8 `[..., n/2]` -> code indices `[..., n]`, the high nibble first (bitsandbytes' order)."""
    codes = np.asarray(codes).astype(np.int64)
    out = np.empty((*codes.shape[:-1], 2 * codes.shape[-1]), np.int64)
    out[..., 0::2] = codes // 16
    out[..., 1::2] = codes % 16
    return out


def naive_nf4_codes(w):
    """The nearest published NF4 value to each `w / absmax(block)`, one block at a time."""
    table = np.array(PUBLISHED_NF4, np.float64)
    flat = w.reshape(-1, w.shape[-1])
    out = np.zeros(flat.shape, np.int64)
    for r, row in enumerate(flat):
        for b in range(0, row.size, 64):
            block = row[b:b + 64]
            absmax = np.float32(np.abs(block).max())
            for i, value in enumerate(block):
                x = np.float64(value / absmax) if absmax > 0 else 0.0
                out[r, b + i] = int(np.argmin(np.abs(table - x)))
    return out.reshape(w.shape)


def test_nf4_codebook_is_the_published_one():
    np.testing.assert_array_equal(quant.NF4, np.array(PUBLISHED_NF4, np.float32))
    # and the published values are bitsandbytes' construction (`create_normal_map(0.9677083)`):
    # 8 positive and 7 negative quantiles of N(0, 1), an exact 0, scaled to [-1, 1]
    ppf, offset = NormalDist().inv_cdf, 0.9677083
    values = sorted([ppf(p) for p in np.linspace(offset, 0.5, 9)[:-1]] + [0.0]
                    + [-ppf(p) for p in np.linspace(offset, 0.5, 8)[:-1]])
    np.testing.assert_allclose(np.array(values) / max(values), PUBLISHED_NF4, rtol=0, atol=1e-6)


def test_nf4_codes_are_the_nearest_published_values():
    w = rand((3, 256), seed=1)
    w[1, 64:128] *= 50.0   # a block with a much larger scale than its row
    w[2, :64] = 0.0        # an all-zero block: code of 0.0 (index 7)
    codes = unpack(quant.quantize(jnp.asarray(w), "nf4")["codes"])
    np.testing.assert_array_equal(codes, naive_nf4_codes(w))
    assert (codes[2, :64] == 7).all()


def test_int8_codes_are_the_nearest_integers():
    w = rand((4, 192), seed=2)
    pieces = quant.quantize(jnp.asarray(w), "int8")
    absmax = np.abs(blocks(w.astype(np.float64))).max(-1, keepdims=True)
    target = blocks(w.astype(np.float64)) / absmax * 127
    q = blocks(np.asarray(pieces["q"], np.float64))
    assert np.abs(target - q).max() <= 0.5 + 1e-4
    np.testing.assert_allclose(pieces["scale"], absmax[..., 0] / 127, rtol=1e-6)


def test_int8_round_trip_within_half_a_step():
    w = rand((8, 512), seed=3) * np.exp(rand((8, 1), seed=4, std=2.0))  # rows of very different scales
    deq = np.asarray(quant.dequantize(quant.quantize(jnp.asarray(w), "int8"), "int8", jnp.float32))
    absmax = np.abs(blocks(w)).max(-1, keepdims=True)
    err = np.abs(blocks(w) - blocks(deq))
    assert (err <= absmax / 254 * (1 + EPS) + 1e-12).all(), float((err / absmax).max())


def test_nf4_round_trip_within_half_the_widest_gap_plus_the_absmax_error():
    """|w - NF4[c] a'| <= |w/a - NF4[c]| a + |NF4[c]| |a - a'| <= (gap/2) a + max_row |a - mean| / 254,
    gap the widest distance between adjacent codes (0.3038, between -1 and the next code), and
    max_row |a - mean| / 254 half a step of the int8 double quantization of the row's absmaxes."""
    w = rand((8, 1024), seed=5) * np.exp(rand((8, 1024 // 64, 1), seed=6, std=1.0)).repeat(64, -1).reshape(8, 1024)
    pieces = quant.quantize(jnp.asarray(w), "nf4")
    deq = np.asarray(quant.dequantize(pieces, "nf4", jnp.float32))
    absmax = np.abs(blocks(w)).max(-1).astype(np.float64)                    # [rows, m]
    spread = np.abs(absmax - absmax.mean(-1, keepdims=True)).max(-1, keepdims=True)
    dq_bound = spread / 254                                                  # [rows, 1]

    stored = (np.asarray(pieces["absmax_q"], np.float64) * np.asarray(pieces["absmax_scale"])
              + np.asarray(pieces["absmax_mean"]))
    assert (np.abs(stored - absmax) <= dq_bound * (1 + EPS) + EPS * absmax).all()

    half_gap = np.diff(PUBLISHED_NF4).max() / 2
    assert abs(half_gap - 0.1519) < 1e-4
    bound = half_gap * absmax + dq_bound + EPS * absmax                      # [rows, m]
    err = np.abs(blocks(w) - blocks(deq)).max(-1)
    assert (err <= bound).all(), float((err / bound).max())
    assert (err > 0.5 * half_gap * absmax).any()  # the bound is not vacuous


def test_relative_error_of_a_normal_weight():
    w = rand((64, 4096), seed=7)
    figures = {}
    for kind in quant.KINDS:
        deq = np.asarray(quant.dequantize(quant.quantize(jnp.asarray(w), kind), kind, jnp.float32))
        figures[kind] = (np.abs(w - deq).mean() / np.abs(w).mean(), np.linalg.norm(w - deq) / np.linalg.norm(w))
        print(f"{kind}: mean |w - w'| / mean |w| = {figures[kind][0]:.4f}, ||w - w'|| / ||w|| = {figures[kind][1]:.4f}")
    # N(0, s) in blocks of 64: int8 steps of absmax/127 ~ 2.4 s/127 -> ~0.7% rms; NF4 ~ 9-10%
    assert 0.004 < figures["int8"][1] < 0.009
    assert 0.08 < figures["nf4"][1] < 0.11


@pytest.mark.parametrize("kind", quant.KINDS)
def test_stacked_leading_dims_quantize_row_by_row(kind):
    w = rand((2, 3, 128), seed=8) * np.arange(1, 7, dtype=np.float32).reshape(2, 3, 1)
    pieces = quant.quantize(jnp.asarray(w), kind)
    assert {name: (p.shape, p.dtype) for name, p in pieces.items()} == quant.piece_shapes(w.shape, kind)
    for i in range(2):
        for j in range(3):
            alone = quant.quantize(jnp.asarray(w[i, j]), kind)
            for name in pieces:  # the codes equal; a row's float scales may differ in the last bit
                np.testing.assert_allclose(pieces[name][i, j], alone[name], rtol=1e-6, atol=0,
                                           err_msg=f"{kind} {name} [{i}, {j}]")
                if pieces[name].dtype != jnp.float32:
                    np.testing.assert_array_equal(pieces[name][i, j], alone[name], err_msg=f"{kind} {name}")
    deq = quant.dequantize(pieces, kind, jnp.float32)
    np.testing.assert_allclose(deq[1, 2], quant.dequantize(quant.quantize(jnp.asarray(w[1, 2]), kind),
                                                           kind, jnp.float32), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", quant.KINDS)
def test_dequantize_under_jit_in_bf16(kind):
    w = jnp.asarray(rand((4, 256), seed=9)).astype(jnp.bfloat16)
    pieces = quant.quantize(w, kind)
    eager = quant.dequantize(pieces, kind, jnp.float32)
    jitted = jax.jit(quant.dequantize, static_argnums=(1, 2))(pieces, kind, jnp.bfloat16)
    assert jitted.dtype == jnp.bfloat16 and jitted.shape == w.shape
    np.testing.assert_array_equal(np.asarray(jitted, np.float32), np.asarray(eager.astype(jnp.bfloat16), np.float32))
    # a bf16 weight quantizes as its float32 value does; quantize jits too
    up = quant.quantize(w.astype(jnp.float32), kind)
    jq = jax.jit(quant.quantize, static_argnums=1)(w, kind)
    for name in pieces:
        np.testing.assert_array_equal(pieces[name], up[name])
        np.testing.assert_array_equal(pieces[name], jq[name])


def test_dequantize_differentiates_through_the_scales():
    w = jnp.asarray(rand((2, 128), seed=10))
    pieces = quant.quantize(w, "int8")
    grad = jax.grad(lambda s: quant.dequantize({**pieces, "scale": s}, "int8", jnp.float32).sum())(pieces["scale"])
    np.testing.assert_allclose(grad, blocks(np.asarray(pieces["q"], np.float32)).sum(-1))  # d sum(q s) / ds
    pieces = quant.quantize(w, "nf4")
    grad = jax.grad(lambda m: quant.dequantize({**pieces, "absmax_mean": m}, "nf4", jnp.float32).sum())(
        pieces["absmax_mean"])
    expected = np.array(PUBLISHED_NF4)[unpack(pieces["codes"])].sum(-1, keepdims=True)  # d sum(NF4[c] a') / d mean
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", quant.KINDS)
def test_zero_blocks_and_equal_absmaxes_stay_finite(kind):
    w = np.zeros((3, 128), np.float32)
    w[1, :] = np.tile([0.5, -0.5], 64)  # every block absmax 0.5: nothing to double-quantize
    w[2, 64:] = rand((64,), seed=11)    # a zero block beside a non-zero one
    deq = np.asarray(quant.dequantize(quant.quantize(jnp.asarray(w), kind), kind, jnp.float32))
    assert np.isfinite(deq).all()
    np.testing.assert_allclose(deq[:2], w[:2], rtol=1e-6, atol=0)  # 0 and +-absmax: exact up to a/127*127
    np.testing.assert_array_equal(deq[2, :64], 0.0)


def test_storage_per_value():
    assert quant.bytes_per_value("int8", 4096) * 8 == 8.5
    assert quant.bytes_per_value("nf4", 4096) * 8 == 4 + 8 / 64 + 64 / 4096  # 4.140625 bits
    for kind in quant.KINDS:
        pieces = quant.quantize(jnp.zeros((2, 4096)), kind)
        assert sum(p.nbytes for p in pieces.values()) == quant.bytes_per_value(kind, 4096) * 2 * 4096
        abstract = jax.eval_shape(lambda w: quant.quantize(w, kind), jax.ShapeDtypeStruct((5, 2, 256), jnp.bfloat16))
        assert {n: (a.shape, a.dtype) for n, a in abstract.items()} == quant.piece_shapes((5, 2, 256), kind)


def test_errors_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"multiple of BLOCK=64, got shape \(4, 100\)"):
        quant.quantize(jnp.zeros((4, 100)), "int8")
    with pytest.raises(ValueError, match=r"multiple of BLOCK=64, got shape \(32,\)"):
        quant.piece_shapes((32,), "nf4")
    with pytest.raises(ValueError, match=r"kind='int4' is unknown: use one of \('int8', 'nf4'\)"):
        quant.quantize(jnp.zeros((64,)), "int4")
    with pytest.raises(ValueError, match=r"kind='fp4' is unknown"):
        quant.dequantize({}, "fp4", jnp.float32)
    with pytest.raises(ValueError, match=r"float weight, got dtype int32: cast it to float32"):
        quant.quantize(jnp.zeros((64,), jnp.int32), "nf4")
    with pytest.raises(ValueError, match=r"expects the pieces \['q', 'scale'\], got \['codes'\]"):
        quant.dequantize({"codes": jnp.zeros((32,), jnp.uint8)}, "int8", jnp.float32)
