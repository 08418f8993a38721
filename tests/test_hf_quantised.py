"""Quantised Hugging Face checkpoints (modern_jax/convert/hf_quantised.py and its use in from_hf).

The fixtures under tests/fixtures/hf_quantised/ are tiny random checkpoints in the published
layouts (DeepSeek-V3's block-fp8, gpt-oss's mxfp4) with the logits of transformers' own
dequantised models on them (scripts/make_quantised_fixtures.py); no torch is needed here. The
formulas are also checked against the formats' definitions value by value, on ragged edges
transformers does not read the same way, and on block-aligned slices.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from modern_jax.convert import CheckpointError, from_hf
from modern_jax.convert.hf_quantised import MXFP4, BlockFP8, dequantize_fp8, dequantize_mxfp4
from modern_jax.convert.safetensors_files import SafetensorsFiles

FIXTURES = Path(__file__).parent / "fixtures" / "hf_quantised"
NAMES = ("deepseek_v3_fp8", "gpt_oss_mxfp4")
LOGIT_TOL = 1e-5


def tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint, float8 ones included."""
    files = SafetensorsFiles(sorted(directory.glob("*.safetensors")))
    return {name: files.read(entry) for name, entry in files.entries.items()}


def rewrite(name: str, dst: Path, change) -> Path:
    """A copy of fixture `name` in `dst` with `change(tensors)` applied."""
    directory = dst / name
    shutil.copytree(FIXTURES / name, directory)
    t = tensors(directory)
    change(t)
    save_file(t, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def loaded():
    told: dict[str, list[str]] = {}
    models = {}
    for name in NAMES:
        told[name] = []
        models[name] = from_hf(FIXTURES / name, log=told[name].append)
    return models, told


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


# ----- parity with transformers' dequantised models ----------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_dequantised(name, loaded):
    models, _ = loaded
    with np.load(FIXTURES / name / "reference.npz") as ref:
        logits = np.asarray(_forward(models[name][1], jnp.asarray(ref["tokens"])))
        diff = float(np.max(np.abs(logits - ref["logits"])))
    print(f"{name}: max|logit diff| = {diff:.2e}")
    assert diff <= LOGIT_TOL, diff


def test_scales_are_no_tensors_of_their_own_and_the_mtp_layer_is_skipped(loaded):
    """DeepSeek's multi-token-prediction layer is skipped by name, its scales with it; every other
    `weight_scale_inv` is read with its weight, and gpt-oss's `_blocks` / `_scales` stand for the
    experts' tensors."""
    _, told = loaded
    stored = tensors(FIXTURES / "deepseek_v3_fp8")
    mtp = sorted(n for n in stored if n.startswith("model.layers.2."))
    assert any(n.endswith("weight_scale_inv") for n in mtp)
    assert len(told["deepseek_v3_fp8"]) == 1, told
    assert f"skipping {len(mtp)} tensor(s) of the multi-token-prediction layer" in told["deepseek_v3_fp8"][0]
    assert told["gpt_oss_mxfp4"] == []
    cfg, model = loaded[0]["gpt_oss_mxfp4"]
    (_, s, i, j), = [m for m in model.moe_layers() if m[0] == 1]
    experts = model.stages[s].blocks[j].mlp.experts
    oss = tensors(FIXTURES / "gpt_oss_mxfp4")
    gate_up = MXFP4().dequantize(oss["model.layers.1.mlp.experts.gate_up_proj_blocks"],
                                 oss["model.layers.1.mlp.experts.gate_up_proj_scales"])  # [E, D, 2F]
    np.testing.assert_array_equal(np.asarray(experts.gate_proj.kernel[i]), gate_up[..., 0::2])
    np.testing.assert_array_equal(np.asarray(experts.up_proj.kernel[i]), gate_up[..., 1::2])


def test_scales_in_another_shard_are_read_with_their_tensor(tmp_path, loaded):
    """A sharded checkpoint whose scales are all in a file of their own loads the same parameters."""
    stored = tensors(FIXTURES / "deepseek_v3_fp8")
    files = {k: f"model-0000{1 + k.endswith('_scale_inv')}-of-00002.safetensors" for k in stored}
    for file in set(files.values()):
        save_file({k: v for k, v in stored.items() if files[k] == file}, str(tmp_path / file), metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    shutil.copy(FIXTURES / "deepseek_v3_fp8" / "config.json", tmp_path)
    _, model = from_hf(tmp_path, log=lambda message: None)
    want = nnx.to_flat_state(nnx.state(loaded[0]["deepseek_v3_fp8"][1], nnx.Param))
    got = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path, value in want:
        np.testing.assert_array_equal(np.asarray(got[path][...]), np.asarray(value[...]), err_msg=str(path))


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


# ----- what is refused ------------------------------------------------------------------------

@pytest.mark.quick
def test_a_quantised_tensor_without_its_scales_is_refused_naming_it_and_its_file(tmp_path):
    o_proj = "model.layers.1.self_attn.o_proj.weight"
    directory = rewrite("deepseek_v3_fp8", tmp_path, lambda t: t.pop(o_proj + "_scale_inv"))
    with pytest.raises(CheckpointError, match=rf"1 quantised tensor\(s\) without their scales: {o_proj} in "
                                              rf"model\.safetensors \(no {o_proj}_scale_inv\)$"):
        from_hf(directory)
    experts = "model.layers.0.mlp.experts.down_proj"
    directory = rewrite("gpt_oss_mxfp4", tmp_path / "b", lambda t: t.pop(experts + "_scales"))
    with pytest.raises(CheckpointError, match=rf"without their scales: {experts}_blocks in model\.safetensors "
                                              rf"\(no {experts}_scales\)$"):
        from_hf(directory)


def test_scales_of_the_wrong_shape_or_of_no_quantised_tensor_are_named(tmp_path):
    q_a = "model.layers.1.self_attn.q_a_proj.weight"

    def change(t):
        t[q_a + "_scale_inv"] = np.ones((2, 2), np.float32)  # [12, 64] in blocks of [16, 32]: [1, 2]
        t["model.layers.1.mlp.gate.weight_scale_inv"] = np.ones((1, 2), np.float32)  # the router is not fp8

    directory = rewrite("deepseek_v3_fp8", tmp_path, change)
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) the deepseek_v3 model has no place for: "
                                              r"model\.layers\.1\.mlp\.gate\.weight_scale_inv\. .*"
                                              rf"{q_a}_scale_inv: the checkpoint has \[2, 2\], its quantised tensor "
                                              r"\[12, 64\] needs \[1, 2\]"):
        from_hf(directory)


@pytest.mark.quick
def test_a_quantisation_not_read_here_is_refused_naming_the_fix(tmp_path):
    directory = tmp_path / "fp8"
    shutil.copytree(FIXTURES / "deepseek_v3_fp8", directory)
    config = json.loads((directory / "config.json").read_text())
    for quant, message in (
            ({"quant_method": "fp8", "weight_block_size": None}, r"weight_block_size=None: fp8 is read in blocks.*"
                                                                 r"FineGrainedFP8Config\(dequantize=True\)"),
            ({"quant_method": "awq", "bits": 4}, r"quant_method='awq': from_hf dequantises fp8 \(in blocks\) and "
                                                 r"mxfp4 checkpoints only; dequantise it with transformers first")):
        (directory / "config.json").write_text(json.dumps(dict(config, quantization_config=quant)))
        with pytest.raises(CheckpointError, match=message):
            from_hf(directory)


def test_float8_tensors_load_in_bfloat16_as_the_rounded_float32_product(tmp_path, caplog):
    """Dequantised in float32, then cast: a bf16 model holds the float32 product rounded once."""
    stored = tensors(FIXTURES / "deepseek_v3_fp8")
    with caplog.at_level(logging.INFO, logger="modern_jax.convert.hf_checkpoint"):
        _, model = from_hf(FIXTURES / "deepseek_v3_fp8", dtype="bfloat16")
    kv_b = "model.layers.1.self_attn.kv_b_proj.weight"  # [N (nope + v), C]; ours [C, N, nope + v]
    w = BlockFP8((16, 32)).dequantize(stored[kv_b], stored[kv_b + "_scale_inv"])
    (stage, j, i), = [(stage, j, stage.layer_numbers(j).index(1)) for stage in model.stages
                      for j in range(len(stage.blocks)) if 1 in stage.layer_numbers(j)]
    ours = np.asarray(stage.blocks[j].self_attn.kv_b_proj.kernel[i])
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_array_equal(ours.reshape(ours.shape[0], -1).T, w.astype(jnp.bfloat16))
    assert "skipping" in caplog.text
