"""Quantised Hugging Face checkpoints for the tests, and transformers' logits on them (PyTorch, CPU).

Runs in the environment of `make_hf_fixtures.py` (torch is never a dependency of modern_jax), with
accelerate, which transformers' fp8 loading needs:

    .hfvenv/bin/pip install torch==2.13.0 transformers safetensors accelerate
    .hfvenv/bin/python scripts/make_quantised_fixtures.py [--out DIR] [--only NAME ...]

Writes under tests/fixtures/hf_quantised/, per fixture, a tiny random checkpoint in a published
quantised layout, quantised here from float32 weights:

- `deepseek_v3_fp8/`: block-fp8 as DeepSeek-V3 / R1, Qwen3-FP8 and Kimi K2 publish it
  (`quantization_config.quant_method: fp8`, `weight_block_size`): every Linear of the decoder
  layers but the router stored as float8_e4m3fn, `W / s` per block, beside a float32
  `weight_scale_inv` of shape [ceil(out / b0), ceil(in / b1)] holding `s = amax / 448` of each
  block. The block [16, 32] is not square; it divides some sizes into several blocks and leaves
  others a single partial one (a ragged edge), e.g. `q_a_proj` [12, 64] and `o_proj` [64, 16].
  The multi-token-prediction layer (`model.layers.2.*`, quantised as well) is saved too, as the
  published checkpoints do.
- `gpt_oss_mxfp4/`: mxfp4 as the published gpt-oss (`quant_method: mxfp4`): the experts'
  `gate_up_proj` / `down_proj` ([E, in, out] unquantised) stored as `*_blocks` [E, out, in/32, 16]
  uint8, two fp4 e2m1 values a byte (the even element in the low nibble), and `*_scales`
  [E, out, in/32] uint8, the e8m0 exponent of each 32-value block plus 127.

and `reference.npz`: the prompt tokens [2, 12] and the float32 logits of transformers' own
dequantised model (`FineGrainedFP8Config(dequantize=True)`, `Mxfp4Config(dequantize=True)`,
dtype float32, eager attention). As in make_hf_fixtures.py, the seed is the first whose routers
never choose an expert by a score gap under ROUTER_MARGIN and whose top two logits are never
closer than MIN_MARGIN. `manifest.json` lists the seeds and margins.

transformers derives a block's size from the scale grid (`rows // scale_rows`), which is the
published one only where a size is a multiple of the block or smaller than it; the sizes here are
all one or the other (a ragged edge of several blocks, e.g. 48 rows in blocks of 32, is tested
against the formula itself, in tests/test_hf_quantised.py).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_hf_fixtures import (BATCH, MIN_MARGIN, PROMPT_LEN, ROUTER_MARGIN, TINY, hf_config,  # noqa: E402
                              randomise, watch_routers)

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf_quantised"

FP8_MAX = 448.0  # the largest float8_e4m3fn
FP8_BLOCK = [16, 32]  # rows (out), columns (in) per scale
# sizes (out, in) are multiples of the block or smaller than it: q_a_proj [12, 64], q_b_proj [64, 12],
# kv_a_proj_with_mqa [32, 64], kv_b_proj [48, 24], o_proj [64, 16], mlp [64, 64], experts [16, 64] / [64, 16]
DEEPSEEK_FP8 = dict(
    TINY["deepseek_v3"], hidden_size=64, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
    q_lora_rank=12, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=4,
    num_nextn_predict_layers=1)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": FP8_BLOCK}

MXFP4_BLOCK = 32
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of codes 0-7; code | 8 is negative
GPT_OSS_MXFP4 = dict(
    TINY["gpt_oss"], hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_local_experts=4,
    layer_types=["sliding_attention", "full_attention"])
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def quantise_fp8(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] float32 -> (float8_e4m3fn [R, C], float32 scales [ceil(R/b0), ceil(C/b1)]): each block
    divided by its scale, amax / 448, so that its largest value is 448 (a block of zeros: scale 1)."""
    (R, C), (b0, b1) = w.shape, block
    nr, nc = math.ceil(R / b0), math.ceil(C / b1)
    padded = torch.zeros(nr * b0, nc * b1)
    padded[:R, :C] = w
    blocks = padded.view(nr, b0, nc, b1)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).view(nr * b0, nc * b1)[:R, :C]
    return q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous(), scale.float()


def fp8_quantised(name: str, w: torch.Tensor) -> bool:
    """DeepSeek-V3's quantised weights: the matrices of the decoder layers (their Linears) but the router's."""
    return name.startswith("model.layers.") and name.endswith(".weight") and w.ndim == 2 and ".mlp.gate." not in name


def quantise_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's experts [E, in, out] float32 -> (blocks [E, out, in/32, 16] uint8, scales [E, out, in/32]
    uint8): per 32 values of a row of the [E, out, in] matrix, the exponent e = ceil(log2(amax / 6)) and
    each value / 2^e rounded to the nearest e2m1 (two a byte, the even one in the low nibble)."""
    x = w.transpose(1, 2).float()  # [E, out, in], as the published checkpoint stores it
    E, R, C = x.shape
    groups = x.reshape(E, R, C // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = groups.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / FP4_E2M1[-1])), torch.full_like(amax, -127.0))
    exp = exp.clamp(-127, 127)
    scaled = groups / torch.exp2(exp)[..., None]
    magnitudes = torch.tensor(FP4_E2M1)
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) | (scaled < 0).long() << 3
    packed = code[..., 0::2] | code[..., 1::2] << 4
    return packed.to(torch.uint8).contiguous(), (exp + 127).to(torch.uint8).contiguous()


def mtp_tensors(tensors: dict, config: dict) -> dict:
    """Some tensors of DeepSeek's multi-token-prediction layer `model.layers.{n}.*`, its projection of
    [embedding; hidden] and one copied decoder weight quantised like the others."""
    n, D = config["num_hidden_layers"], config["hidden_size"]
    g = torch.Generator().manual_seed(n)
    return {f"model.layers.{n}.eh_proj.weight": torch.randn(D, 2 * D, generator=g) / (2 * D) ** 0.5,
            f"model.layers.{n}.enorm.weight": torch.ones(D), f"model.layers.{n}.hnorm.weight": torch.ones(D),
            f"model.layers.{n}.shared_head.norm.weight": torch.ones(D),
            f"model.layers.{n}.self_attn.q_a_proj.weight": tensors["model.layers.1.self_attn.q_a_proj.weight"]}


def quantise_deepseek_fp8(tensors: dict, config: dict) -> dict:
    tensors = {**tensors, **mtp_tensors(tensors, config)}
    out = {}
    for name, w in tensors.items():
        if fp8_quantised(name, w):
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = quantise_fp8(w, FP8_BLOCK)
        else:
            out[name] = w
    return out


def quantise_gpt_oss_mxfp4(tensors: dict, config: dict) -> dict:
    out = {}
    for name, w in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = quantise_mxfp4(w)
        else:
            out[name] = w
    return out


FIXTURE_KINDS = {  # name: (config, quantization_config, how to quantise, how transformers dequantises)
    "deepseek_v3_fp8": (DEEPSEEK_FP8, FP8_CONFIG, quantise_deepseek_fp8, lambda: FineGrainedFP8Config(dequantize=True)),
    "gpt_oss_mxfp4": (GPT_OSS_MXFP4, MXFP4_CONFIG, quantise_gpt_oss_mxfp4, lambda: Mxfp4Config(dequantize=True)),
}


def save_quantised(directory: Path, config: dict, quant: dict, quantise, seed: int) -> None:
    """A random float32 model of `config`, saved by transformers, then its tensors quantised in place."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(config), attn_implementation="eager").eval()
    randomise(model, seed)
    shutil.rmtree(directory, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors = load_file(str(Path(tmp) / "model.safetensors"))
        saved = json.loads((Path(tmp) / "config.json").read_text())
    directory.mkdir(parents=True)
    save_file(quantise(tensors, config), str(directory / "model.safetensors"), metadata={"format": "pt"})
    saved.update(quantization_config=quant, num_nextn_predict_layers=config.get("num_nextn_predict_layers"))
    if saved["num_nextn_predict_layers"] is None:
        del saved["num_nextn_predict_layers"]
    (directory / "config.json").write_text(json.dumps(saved, indent=2) + "\n")


@torch.no_grad()
def make_fixture(name: str, out: Path) -> dict:
    config, quant, quantise, dequantize = FIXTURE_KINDS[name]
    directory = out / name
    start = zlib.crc32(name.encode()) % 2**31
    for seed in range(start, start + 100):
        save_quantised(directory, config, quant, quantise, seed)
        model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=dequantize(), dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        routing = watch_routers(model)
        tokens = torch.randint(0, config["vocab_size"], (BATCH, PROMPT_LEN),
                               generator=torch.Generator().manual_seed(seed))
        logits = model(tokens).logits.float()
        top2 = logits.topk(2, dim=-1).values
        margin = float((top2[..., 0] - top2[..., 1]).min())
        used = [len(picked) for picked in routing["picked"]]
        if margin >= MIN_MARGIN and routing["margin"] >= ROUTER_MARGIN:
            break
    np.savez_compressed(directory / "reference.npz", tokens=tokens.numpy().astype(np.int32),
                        logits=logits.numpy().astype(np.float32))
    files = sorted(p.name for p in directory.iterdir())
    size = sum(p.stat().st_size for p in directory.iterdir())
    print(f"{name:18s} seed {seed:10d}  logit margin {margin:.4f}  router margin {routing['margin']:.4f}  "
          f"experts used {used}  {size:,d} bytes  {files}")
    return {"seed": seed, "logit_margin": margin, "router_margin": routing["margin"], "experts_used": used,
            "files": files}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=FIXTURES)
    parser.add_argument("--only", nargs="*", choices=sorted(FIXTURE_KINDS), help="fixtures to (re)make")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"checkpoints": {}}
    for name in FIXTURE_KINDS:
        if not args.only or name in args.only:
            manifest["checkpoints"][name] = make_fixture(name, args.out)
    manifest.update(transformers=transformers.__version__, torch=torch.__version__, prompt_len=PROMPT_LEN,
                    batch=BATCH)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.exit(main())
