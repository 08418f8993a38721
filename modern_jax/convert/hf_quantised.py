"""Quantised Hugging Face checkpoints, dequantised as they load: block-fp8 and mxfp4.

    scheme = quantisation_of(config_json)        # None for an unquantised checkpoint
    w = scheme.dequantize(values, scales)        # float32: the tensor a quantised one stands for
    w = scheme.read(index, read_values, read_scales)   # a slice of it, from the blocks it touches

The two published layouts, by `quantization_config.quant_method`:

- `fp8` with `weight_block_size: [b0, b1]` (DeepSeek-V3 / R1, Qwen3-FP8, Kimi K2): a matrix W
  [..., R, C] stored as float8_e4m3fn Q under its own name, beside `<name>_scale_inv` S, float32
  [..., ceil(R / b0), ceil(C / b1)]: W[r, c] = Q[r, c] * S[r // b0, c // b1] (a size the block does
  not divide ends in a partial block). The tensors stored in float8 are the quantised ones; the
  others (norms, embeddings, the router, the head) are read as they are.
- `mxfp4` (gpt-oss's experts): `<name>_blocks` [..., R, G, 16] uint8 and `<name>_scales` [..., R, G]
  uint8 stand for `<name>`. Byte j of a block holds values 2j (its low nibble) and 2j + 1 (its
  high nibble), each an fp4 e2m1 code (`FP4_E2M1`), and a block's 32 values are scaled by
  2^(scale - 127) (an e8m0 exponent). The [..., R, 32 G] matrix this gives is `<name>` transposed:
  gpt-oss's experts are [E, in, out] unquantised and [E, out, in] quantised.

Both give, bit for bit, what transformers' `FineGrainedFP8Config(dequantize=True)` and
`Mxfp4Config(dequantize=True)` give where the two agree on the layout: the product in float32,
which the loader then casts to the parameters' dtype. (transformers derives the fp8 block from the
scale grid, `R // ceil(R / b0)`, which is `b0` only when b0 divides R or exceeds it; here the
block is the config's, as the format defines it.)

Every function here works on a block-aligned slice as on the whole tensor: values
`[..., r0:r1, c0:c1]` with r0, c0 multiples of the block (fp8: b0, b1; mxfp4: a row, a block of
32) and the scales of the blocks they touch, `[..., r0 // b0 : ceil(r1 / b0), c0 // b1 :
ceil(c1 / b1)]`, give the same slice of the dequantised tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes  # numpy's float8 types (a dependency of jax)
import numpy as np

# the value of each fp4 e2m1 code: 1 sign bit, 2 exponent bits, 1 mantissa bit
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)
E8M0_BIAS = 127  # an e8m0 scale byte s is 2^(s - 127)
MXFP4_BLOCK = 32  # values per scale
# the safetensors dtypes of block-fp8's quantised tensors
RAW_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}
Read = Callable[[tuple[slice, ...]], np.ndarray]  # a stored tensor's slice, by index
# how transformers dequantises a checkpoint of each `quant_method` on loading (for those read here: a
# layout they may hold that is not)
TRANSFORMERS_DEQUANTISE = {"mxfp4": "Mxfp4Config(dequantize=True)", "fp8": "FineGrainedFP8Config(dequantize=True)"}


def dequantize_fp8(values: np.ndarray, scales: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 W [..., R, C] = values * scales, each scale spread over its `block` of (rows, columns).

    `values` [..., R, C] (float8_e4m3fn, or any float), `scales` [..., ceil(R / b0), ceil(C / b1)]
    float (an inverse scale, `weight_scale_inv`) or uint8 (an e8m0 exponent, 2^(s - 127)); a
    block-aligned slice of both gives that slice of W."""
    (R, C), (b0, b1) = values.shape[-2:], block
    want = (*values.shape[:-2], math.ceil(R / b0), math.ceil(C / b1))
    if scales.shape != want:
        raise ValueError(f"scales of shape {list(scales.shape)} for values {list(values.shape)} in blocks of "
                         f"{list(block)}: expected {list(want)}")
    if scales.dtype == np.uint8:
        scales = np.ldexp(np.float32(1), scales.astype(np.int32) - E8M0_BIAS)
    per_value = np.repeat(np.repeat(scales.astype(np.float32), b0, axis=-2)[..., :R, :], b1, axis=-1)[..., :C]
    return values.astype(np.float32) * per_value


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., G * 32] from `blocks` [..., G, 16] uint8 (two fp4 e2m1 codes a byte, the even value
    in the low nibble) and `scales` [..., G] uint8 (e8m0: a block's values times 2^(s - 127)); a slice of
    whole blocks gives that slice."""
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or scales.shape != blocks.shape[:-1]:
        raise ValueError(f"mxfp4 blocks {list(blocks.shape)} and scales {list(scales.shape)}: expected "
                         f"[..., G, {MXFP4_BLOCK // 2}] and [..., G]")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., G, 16, 2]: values 2j, 2j + 1
    values = np.ldexp(FP4_E2M1[codes], (scales.astype(np.int32) - E8M0_BIAS)[..., None, None])
    return values.reshape(*blocks.shape[:-2], -1)


@dataclass(frozen=True)
class BlockFP8:
    """`quant_method: fp8` with `weight_block_size`: float8 tensors beside their `_scale_inv`."""

    block: tuple[int, int]
    method = "fp8"

    def stands_for(self, name: str, dtype: str) -> str | None:
        """The tensor a stored one is the quantised form of (its own name), or None when it is not quantised."""
        return name if dtype in RAW_DTYPES else None

    def scales_name(self, name: str) -> str:
        return name + "_scale_inv"

    def is_scales(self, name: str) -> bool:
        return name.endswith("_scale_inv")

    def shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        """The dequantised tensor's shape."""
        return stored

    def scales_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        *lead, R, C = stored
        return (*lead, math.ceil(R / self.block[0]), math.ceil(C / self.block[1]))

    def dequantize(self, values: np.ndarray, scales: np.ndarray) -> np.ndarray:
        return dequantize_fp8(values, scales, self.block)

    def read(self, index: tuple[slice, ...], values: Read, scales: Read) -> np.ndarray:
        """Slice `index` (concrete bounds) of the dequantised tensor, from the values of the blocks it
        touches and their scales: a slice not on the blocks' edges reads its partial blocks whole."""
        *lead, rows, cols = index
        (b0, b1), r, c = self.block, rows.start // self.block[0], cols.start // self.block[1]
        w = self.dequantize(values((*lead, slice(r * b0, rows.stop), slice(c * b1, cols.stop))),
                            scales((*lead, slice(r, -(-rows.stop // b0)), slice(c, -(-cols.stop // b1)))))
        return w[..., rows.start - r * b0:, cols.start - c * b1:]


@dataclass(frozen=True)
class MXFP4:
    """`quant_method: mxfp4`: `<name>_blocks` and `<name>_scales` for `<name>`, stored transposed."""

    method = "mxfp4"

    def stands_for(self, name: str, dtype: str) -> str | None:
        return name.removesuffix("_blocks") if name.endswith("_blocks") else None

    def scales_name(self, name: str) -> str:
        return name.removesuffix("_blocks") + "_scales"

    def is_scales(self, name: str) -> bool:
        return name.endswith("_scales")

    def shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        *lead, R, G, _ = stored
        return (*lead, G * MXFP4_BLOCK, R)

    def scales_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        return stored[:-1]

    def dequantize(self, blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """[..., R, G, 16] blocks, [..., R, G] scales -> [..., 32 G, R]: the rows of a slice's blocks
        are its columns."""
        return np.swapaxes(dequantize_mxfp4(blocks, scales), -1, -2)

    def read(self, index: tuple[slice, ...], values: Read, scales: Read) -> np.ndarray:
        """Slice `index` (concrete bounds) of the dequantised [..., 32 G, R] tensor, from the blocks of
        32 it touches ([..., R, G, 16]) and their scales."""
        *lead, cols, rows = index
        g0, g1 = cols.start // MXFP4_BLOCK, -(-cols.stop // MXFP4_BLOCK)
        w = self.dequantize(values((*lead, rows, slice(g0, g1))), scales((*lead, rows, slice(g0, g1))))
        return w[..., cols.start - g0 * MXFP4_BLOCK:cols.stop - g0 * MXFP4_BLOCK, :]


Quantisation = BlockFP8 | MXFP4


def quantisation_of(hf: dict[str, Any]) -> Quantisation | None:
    """How a checkpoint's config.json says its tensors are quantised (`quantization_config`, or its
    `text_config`'s); None: they are not. A method or layout not read here raises a ValueError naming
    it and how transformers dequantises it."""
    quant = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    how = TRANSFORMERS_DEQUANTISE.get(method, "<its config class>(dequantize=True), where it has one")
    fix = (f"dequantise it with transformers first: AutoModelForCausalLM.from_pretrained(path, "
           f"quantization_config={how}, dtype=torch.bfloat16).save_pretrained(out), then load `out`")
    if method == "mxfp4":
        return MXFP4()
    if method == "fp8":
        block = quant.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size={block!r}: fp8 is read in blocks (a list of two "
                             f"positive sizes, e.g. [128, 128]), not per tensor; {fix}")
        return BlockFP8(tuple(block))
    raise ValueError(f"quantization_config.quant_method={method!r}: from_hf dequantises fp8 (in blocks) and mxfp4 "
                     f"checkpoints only; {fix}")

