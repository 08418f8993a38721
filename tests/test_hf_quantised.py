"""Quantised Hugging Face tensors (modern_jax/convert/hf_quantised.py): the formulas of block-fp8 and
mxfp4, checked against the formats' definitions value by value, on ragged edges and on block-aligned
slices, and on tensors of the quantised fixtures (tests/fixtures/hf_quantised/, made by
scripts/make_quantised_fixtures.py).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from modern_jax.convert.hf_quantised import MXFP4, BlockFP8, dequantize_fp8, dequantize_mxfp4, read_raw

FIXTURES = Path(__file__).parent / "fixtures" / "hf_quantised"


def tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint, float8 ones included."""
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="np") as f:
            for name in f.keys():
                raw = f.get_slice(name).get_dtype().startswith("F8")
                out[name] = read_raw(file, name) if raw else f.get_tensor(name)
    return out


# ----- the formulas ---------------------------------------------------------------------------

def e2m1(code: int) -> float:
    """An fp4 e2m1 code's value from its bits: sign, two exponent bits (bias 1), one mantissa bit."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if sign else magnitude


@pytest.mark.quick
def test_fp8_dequantisation_is_the_block_formula_and_works_on_aligned_slices():
    """W[r, c] = Q[r, c] * S[r // b0, c // b1], with ragged last blocks of several blocks (40 rows in
    blocks of 16, 80 columns in blocks of 32: transformers would read 40 / 3 rows a block, and refuse);
    a block-aligned slice of Q and S gives that slice of W; e8m0 byte scales are 2^(s - 127)."""
    rng = np.random.default_rng(0)
    block = (16, 32)
    q = rng.uniform(-448, 448, (3, 40, 80)).astype(ml_dtypes.float8_e4m3fn)  # [experts, out, in]
    s = rng.uniform(1e-4, 1e-2, (3, 3, 3)).astype(np.float32)
    w = dequantize_fp8(q, s, block)
    r, c = np.arange(40)[:, None], np.arange(80)[None, :]
    want = q.astype(np.float32) * s[:, r // block[0], c // block[1]]
    assert w.dtype == np.float32
    np.testing.assert_array_equal(w, want)
    np.testing.assert_array_equal(dequantize_fp8(q[1:, 16:40, 32:80], s[1:, 1:3, 1:3], block), w[1:, 16:40, 32:80])
    np.testing.assert_array_equal(BlockFP8(block).dequantize(q[:, :32, :64], s[:, :2, :2]), w[:, :32, :64])
    exponents = rng.integers(110, 140, (3, 3, 3)).astype(np.uint8)
    np.testing.assert_array_equal(dequantize_fp8(q, exponents, block),
                                  dequantize_fp8(q, (2.0 ** (exponents.astype(np.float64) - 127)).astype(np.float32),
                                                 block))
    with pytest.raises(ValueError, match=r"expected \[3, 3, 3\]"):
        dequantize_fp8(q, s[:, :2], block)
    # a stored tensor of the fixture: [64, 64] in blocks of [16, 32], sliced on block boundaries
    stored = tensors(FIXTURES / "deepseek_v3_fp8")
    q, s = stored["model.layers.0.mlp.down_proj.weight"], stored["model.layers.0.mlp.down_proj.weight_scale_inv"]
    fp8 = BlockFP8((16, 32))
    np.testing.assert_array_equal(fp8.dequantize(q[16:48, 32:], s[1:3, 1:]), fp8.dequantize(q, s)[16:48, 32:])


@pytest.mark.quick
def test_mxfp4_dequantisation_is_the_e2m1_e8m0_formula_and_works_on_aligned_slices():
    """Value k of a row is code k of its block (byte k // 2, the low nibble for even k) times
    2^(scale - 127), e2m1 decoded from its bits; the [.., R, 32 G] result is the tensor transposed; a
    slice of whole blocks and rows gives that slice."""
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (2, 5, 3, 16)).astype(np.uint8)  # [E, rows, G, 16]
    scales = rng.integers(120, 135, (2, 5, 3)).astype(np.uint8)
    rows = dequantize_mxfp4(blocks, scales)
    assert rows.shape == (2, 5, 96) and rows.dtype == np.float32
    want = np.empty((2, 5, 96), np.float32)
    for e, r, k in np.ndindex(2, 5, 96):
        byte = int(blocks[e, r, k // 32, (k % 32) // 2])
        want[e, r, k] = e2m1(byte >> 4 if k % 2 else byte & 0x0F) * 2.0 ** (int(scales[e, r, k // 32]) - 127)
    np.testing.assert_array_equal(rows, want)
    whole = MXFP4().dequantize(blocks, scales)  # the unquantised tensor: [E, 32 G, rows]
    np.testing.assert_array_equal(whole, np.swapaxes(want, -1, -2))
    np.testing.assert_array_equal(MXFP4().dequantize(blocks[1:, 2:5, 1:3], scales[1:, 2:5, 1:3]),
                                  whole[1:, 32:96, 2:5])
    assert MXFP4().shape(blocks.shape) == whole.shape and MXFP4().scales_shape(blocks.shape) == scales.shape
    stored = tensors(FIXTURES / "gpt_oss_mxfp4")
    b, s = (stored[f"model.layers.0.mlp.experts.down_proj_{k}"] for k in ("blocks", "scales"))  # [E, D, F/32, 16]
    np.testing.assert_array_equal(MXFP4().dequantize(b[:, 8:40, 1:], s[:, 8:40, 1:]),
                                  MXFP4().dequantize(b, s)[:, 32:, 8:40])
