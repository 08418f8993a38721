"""The frozen base of QLoRA stored quantized: int8, or NF4 with double quantization.

A weight `w [..., n]` is cut along its last axis into `m = n / BLOCK` blocks of `BLOCK = 64`
values; each block is scaled by its absmax `a = max |w_block|` (Dettmers et al. 2023, QLoRA).
Every piece keeps the weight's leading axes `[...]`, and its last axis is `n`, `n/2`, `m` or 1,
so a caller gives each piece the weight's own logical sharding axes (a stacked `[layers, ...]`
weight quantizes layer by layer, a row never mixes with another row).

    int8   q     = round(w / s) in [-127, 127]    s = a / 127          int8    [..., n]
           scale = s                                                  float32 [..., m]
           w'    = q * s                          |w - w'| <= a / 254

    nf4    c = nearest NF4 code to w / a (its index 0..15), two per byte:
           codes        = c[2i] << 4 | c[2i+1]   (the first of each pair in the high nibble,
                                                  as bitsandbytes packs)     uint8  [..., n/2]
           double quantization of the block absmaxes of one row, a [..., m]:
           absmax_mean  = mean(a)                                           float32 [..., 1]
           absmax_scale = max |a - absmax_mean| / 127                       float32 [..., 1]
           absmax_q     = round((a - absmax_mean) / absmax_scale)           int8    [..., m]
           a'           = absmax_q * absmax_scale + absmax_mean
           w'           = NF4[c] * a'

NF4 is the 16-value NormalFloat4 codebook of the paper (Appendix E) and of bitsandbytes
(`functional.py`): quantiles of N(0, 1) scaled to [-1, 1], with an exact 0. The nearest code is
the one whose interval between the midpoints of neighbouring codes holds `w / a` (a value on a
midpoint takes the lower code), the thresholds bitsandbytes compares against.

Double quantization differs from QLoRA's in its groups: QLoRA quantizes the absmaxes of groups
of 256 blocks (across rows) with 8-bit floats; here the group is one row's `m` block absmaxes,
quantized as int8 around their mean, so every piece keeps the weight's leading axes and
sharding is unchanged. Storage per weight value (`bytes_per_value`): int8 `1 + 4/64` bytes
(8.5 bits); nf4 `1/2 + 1/64 + 8/n` bytes, i.e. `4 + 8/64 + 64/n` bits: 4.141 bits for
n = 4096 (QLoRA's own groups: `4 + 8/64 + 32/(64 * 256)` = 4.127 bits).

`dequantize` is pure elementwise jax.numpy (jit- and grad-safe, no communication between
shards of the leading axes); `quantize` reduces only within a row. Both check their arguments
in Python, then run as one jitted program (inlined when called under `jit`), so an eager
quantize of a large weight fuses rather than materialising each float32 intermediate.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from modern_jax.lora_config import QUANTIZE

# The kinds are named once, by the `lora:` section that chooses one (imports point down: the
# config cannot import this module); "none" keeps a weight as it is.
KINDS = tuple(kind for kind in QUANTIZE if kind != "none")
BLOCK = 64
INT8_MAX = 127

# The NormalFloat4 code values (QLoRA Appendix E; bitsandbytes `functional.py`), as float32.
NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], np.float32)
# The 15 decision thresholds: a normalised value above k of them takes code k.
_NF4_MIDPOINTS = ((NF4[:-1].astype(np.float64) + NF4[1:]) / 2).astype(np.float32)


def quantize(w, kind: str) -> dict[str, jax.Array]:
    """`w [..., n]` (float, `n` a multiple of `BLOCK`) as the named pieces of `kind` (module
    docstring), all with `w`'s leading axes `[...]`."""
    _check_kind(kind)
    if not jnp.issubdtype(jnp.result_type(w), jnp.floating):
        raise ValueError(f"quantize expects a float weight, got dtype {jnp.result_type(w)}: "
                         f"cast it to float32 or bfloat16 first")
    _check_shape(jnp.shape(w))
    return _quantize(w, kind)


@functools.partial(jax.jit, static_argnums=1)
def _quantize(w, kind):
    lead, n = w.shape[:-1], w.shape[-1]
    blocks = jnp.asarray(w, jnp.float32).reshape(*lead, n // BLOCK, BLOCK)  # [..., m, 64]
    absmax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)              # [..., m, 1]
    if kind == "int8":
        scale = absmax / INT8_MAX
        q = jnp.round(_safe_divide(blocks, scale)).clip(-INT8_MAX, INT8_MAX)
        return {"q": q.astype(jnp.int8).reshape(*lead, n), "scale": scale[..., 0]}
    x = _safe_divide(blocks, absmax).reshape(*lead, n)                     # [..., n] in [-1, 1]
    c = jnp.searchsorted(jnp.asarray(_NF4_MIDPOINTS), x, side="left").astype(jnp.uint8)
    pairs = c.reshape(*lead, n // 2, 2)                                     # [..., n/2, 2]
    codes = (pairs[..., 0] << 4) | pairs[..., 1]
    return {"codes": codes, **_double_quantize(absmax[..., 0])}


def dequantize(pieces: dict, kind: str, dtype) -> jax.Array:
    """The weight `[..., n]` in `dtype` from the pieces `quantize(w, kind)` returned."""
    _check_kind(kind)
    expected = set(piece_shapes((BLOCK,), kind))
    if set(pieces) != expected:
        raise ValueError(f"dequantize(kind={kind!r}) expects the pieces {sorted(expected)}, got "
                         f"{sorted(pieces)}: pass what quantize(w, {kind!r}) returned")
    return _dequantize(pieces, kind, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _dequantize(pieces, kind, dtype):
    # the barrier keeps the compiler from re-laying out the stored pieces for the matmul that
    # reads the result: on TPU it copied every stacked int8 weight before the layer loop
    # (Llama 3 8B, one v6e chip: 8.84 GiB of temporaries instead of 2.34)
    pieces = jax.lax.optimization_barrier(pieces)
    if kind == "int8":
        q = pieces["q"]                                                     # [..., n]
        lead, n = q.shape[:-1], q.shape[-1]
        blocks = q.reshape(*lead, n // BLOCK, BLOCK).astype(jnp.float32)
        w = blocks * pieces["scale"][..., None]                             # [..., m, 64]
        return w.reshape(*lead, n).astype(dtype)
    codes = pieces["codes"]                                                 # [..., n/2]
    lead, half = codes.shape[:-1], codes.shape[-1]
    absmax = (pieces["absmax_q"].astype(jnp.float32) * pieces["absmax_scale"]
              + pieces["absmax_mean"])                                      # [..., m]
    absmax = jnp.repeat(absmax, BLOCK // 2, axis=-1)                        # [..., n/2]: each code pair's block
    table = jnp.asarray(NF4)
    # the high and low nibbles looked up apart and interleaved last: a [..., n/2, 2] array of
    # codes would be padded to 128 lanes on TPU (4 GiB for Llama 3 8B's o_proj)
    high, low = table[codes >> 4] * absmax, table[codes & 0xF] * absmax
    return jnp.stack([high.astype(dtype), low.astype(dtype)], axis=-1).reshape(*lead, 2 * half)


def piece_shapes(shape: tuple, kind: str) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
    """The `(shape, dtype)` of each piece `quantize` returns for a weight of `shape` (an abstract
    model allocates nothing)."""
    _check_kind(kind)
    shape = tuple(shape)
    _check_shape(shape)
    lead, n = shape[:-1], shape[-1]
    if kind == "int8":
        return {"q": ((*lead, n), jnp.dtype(jnp.int8)),
                "scale": ((*lead, n // BLOCK), jnp.dtype(jnp.float32))}
    return {"codes": ((*lead, n // 2), jnp.dtype(jnp.uint8)),
            "absmax_q": ((*lead, n // BLOCK), jnp.dtype(jnp.int8)),
            "absmax_scale": ((*lead, 1), jnp.dtype(jnp.float32)),
            "absmax_mean": ((*lead, 1), jnp.dtype(jnp.float32))}


def bytes_per_value(kind: str, n: int) -> float:
    """Storage bytes per weight value, scales included, for rows of `n` values."""
    pieces = piece_shapes((n,), kind)
    return float(sum(np.prod(s) * d.itemsize for s, d in pieces.values()) / n)


def _double_quantize(absmax):
    """One row's block absmaxes `[..., m]` as int8 around their mean (module docstring)."""
    mean = jnp.mean(absmax, axis=-1, keepdims=True)                        # [..., 1]
    centred = absmax - mean
    scale = jnp.max(jnp.abs(centred), axis=-1, keepdims=True) / INT8_MAX   # [..., 1]
    q = jnp.round(_safe_divide(centred, scale)).clip(-INT8_MAX, INT8_MAX)
    return {"absmax_q": q.astype(jnp.int8), "absmax_scale": scale, "absmax_mean": mean}


def _safe_divide(x, d):
    """`x / d`, and 0 where `d` is 0 (an all-zero block; a row whose block absmaxes are equal)."""
    return jnp.where(d > 0, x / jnp.where(d > 0, d, 1.0), 0.0)


def _check_kind(kind):
    if kind not in KINDS:
        raise ValueError(f"quantization kind={kind!r} is unknown: use one of {KINDS}")


def _check_shape(shape):
    if len(shape) < 1 or shape[-1] < BLOCK or shape[-1] % BLOCK:
        raise ValueError(f"quantization needs a last axis that is a multiple of BLOCK={BLOCK}, got shape "
                         f"{tuple(shape)}: quantize a weight whose rows split into blocks of {BLOCK} values "
                         f"(or leave this weight unquantized)")
