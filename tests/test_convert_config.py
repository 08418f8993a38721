"""Hugging Face config translation: mapping, round trips, errors, and exact parameter counts.

The parameter counts in tests/fixtures/hf/param_counts.json were recorded by
scripts/make_hf_fixtures.py with transformers (see CONVERT.md); this test needs no torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import pytest
import yaml
from flax import nnx

from modern_jax.config import ModelConfig, RopeScaling
from modern_jax.convert import config_from_hf, config_to_hf
from modern_jax.convert.hf_config import architecture
from modern_jax.convert.hf_keys import cycle_pattern
from modern_jax.model import Transformer

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
CONFIGS = Path(__file__).parent.parent / "configs"
PARAM_COUNTS = json.loads((FIXTURES / "param_counts.json").read_text())["entries"]


def model_param_count(cfg: ModelConfig) -> int:
    """The parameters the model allocates, counted without allocating them."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize("entry", PARAM_COUNTS, ids=[e["name"] for e in PARAM_COUNTS])
def test_param_count_matches_transformers(entry):
    cfg = config_from_hf(entry["config"])
    assert model_param_count(cfg) == entry["count"], entry["name"]
    try:
        from modern_jax.accounting import param_counts
    except ImportError:
        return
    assert param_counts(cfg)["total"] == entry["count"], f"accounting.param_counts: {entry['name']}"


def test_fixture_covers_every_family_and_the_oracles():
    types = {e["config"]["model_type"] for e in PARAM_COUNTS}
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "olmo2", "gpt2", "gpt_neox",
            "gptj", "phi"} <= types
    counts = {e["name"]: e["count"] for e in PARAM_COUNTS}
    assert counts["Llama-3.2-3B"] == 3_212_749_824  # SPEC oracles
    assert counts["Llama-2-7B"] == 6_738_415_616


# ----- the mapping, family by family ---------------------------------------------------

def published(name: str) -> dict:
    return next(e["config"] for e in PARAM_COUNTS if e["name"] == name)


@pytest.mark.parametrize("name, preset", [
    ("Llama-3.2-1B", "llama3_2_1b"), ("Llama-3.2-3B", "llama3_2_3b"), ("Llama-2-7B", "llama2_7b"),
    ("Llama-3-8B", "llama3_8b"), ("Mistral-7B-v0.1", "mistral_7b"), ("Qwen2-7B", "qwen2_7b"),
    ("Qwen3-0.6B", "qwen3_0_6b"), ("Qwen3-8B", "qwen3_8b"), ("Gemma-2-2B", "gemma2_2b"), ("Gemma-3-1B", "gemma3_1b"),
    ("OLMo-2-1124-7B", "olmo2_7b"), ("GPT-2 (124M)", "gpt2"), ("GPT-J-6B", "gptj_6b"), ("GPT-NeoX-20B", "gpt_neox_20b"),
])
def test_published_config_is_the_preset(name, preset):
    path = CONFIGS / f"{preset}.yaml"
    if not path.exists():
        pytest.skip(f"no preset {path.name}")
    want = ModelConfig.from_dict(yaml.safe_load(path.read_text())["model"])
    got = architecture(config_from_hf(published(name)))
    diff = {k: (v, got[k]) for k, v in architecture(want).items() if got[k] != v and k != "max_position_embeddings"}
    assert not diff, diff


def test_llama3_rope_scaling_and_rope_type_key():
    cfg = config_from_hf(published("Llama-3.2-1B"))
    assert cfg.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert cfg.rope_theta == 500000.0 and cfg.tie_embeddings and cfg.head_size == 64 and cfg.num_kv_heads == 8
    old = dict(published("Llama-2-7B"), rope_scaling={"type": "linear", "factor": 4.0})
    assert config_from_hf(old).rope_scaling == RopeScaling("linear", 4.0)
    # transformers 5.x writes `rope_parameters` instead of rope_theta / rope_scaling
    new = {k: v for k, v in published("Llama-3.2-1B").items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {"rope_theta": 500000.0, **published("Llama-3.2-1B")["rope_scaling"]}
    assert config_from_hf(new) == cfg


def test_mistral_window_qwen2_bias():
    mistral = config_from_hf(published("Mistral-7B-v0.1"))
    assert (mistral.attention_pattern, mistral.sliding_window) == ("L", 4096)
    assert config_from_hf(dict(published("Mistral-7B-v0.1"), sliding_window=None)).attention_pattern == "G"
    qwen2 = config_from_hf(published("Qwen2-7B"))
    assert (qwen2.qkv_bias, qwen2.out_bias, qwen2.attention_pattern) == (True, False, "G")
    windowed = dict(published("Qwen2-7B"), use_sliding_window=True, sliding_window=4096, max_window_layers=14)
    assert config_from_hf(windowed).attention_pattern == "G" * 14 + "L" * 14


def test_gemma2_and_gemma3():
    g2 = config_from_hf(published("Gemma-2-2B"))
    assert (g2.norm_type, g2.norm_placement, g2.attention_pattern, g2.activation) == (
        "gemma_rmsnorm", "sandwich", "LG", "gelu_tanh")
    assert (g2.attn_scale, g2.attn_softcap, g2.final_softcap, g2.embed_scale) == (1 / 16, 50.0, 30.0, True)
    g3 = config_from_hf(published("Gemma-3-4B (text)"))  # a multimodal config: its text_config
    assert (g3.attention_pattern, g3.qk_norm, g3.rope_local_theta, g3.rope_theta) == ("LLLLLG", "head", 1e4, 1e6)
    assert g3.rope_scaling == RopeScaling("linear", 8.0)  # on the global layers only
    specs = g3.layer_specs()
    assert specs[0].rope.scaling.type == "none" and specs[0].window == 1024
    assert specs[5].rope.scaling.type == "linear" and specs[5].window is None
    # 5.x: rope_parameters nested by layer type, and layer_types spelled out
    text = dict(published("Gemma-3-4B (text)")["text_config"])
    for key in ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern"):
        text.pop(key)
    text["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    text["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34)]
    assert config_from_hf(text) == g3
    # fewer layers than the period: the pattern is cut to the layers there are
    assert config_from_hf(dict(text, num_hidden_layers=4, layer_types=None)).attention_pattern == "L"


def test_olmo2_gpt2_neox_gptj_phi():
    olmo = config_from_hf(published("OLMo-2-1124-7B"))
    assert (olmo.norm_placement, olmo.qk_norm) == ("output", "full")
    gpt2 = config_from_hf(published("GPT-2 (124M)"))
    assert (gpt2.norm_type, gpt2.norm_bias, gpt2.position_embedding, gpt2.ffn_type, gpt2.activation) == (
        "layernorm", True, "learned", "mlp", "gelu_tanh")
    assert gpt2.qkv_bias and gpt2.out_bias and gpt2.mlp_bias and gpt2.tie_embeddings
    neox = config_from_hf(published("Pythia-160M"))
    assert (neox.norm_placement, neox.parallel_shared_norm, neox.rotary_dim) == ("parallel", False, 16)
    sequential = config_from_hf(dict(published("Pythia-160M"), use_parallel_residual=False))
    assert (sequential.norm_placement, sequential.parallel_shared_norm) == ("pre", True)
    gptj = config_from_hf(published("GPT-J-6B"))
    assert (gptj.norm_placement, gptj.parallel_shared_norm, gptj.rope_layout, gptj.rotary_dim) == (
        "parallel", True, "interleaved", 64)
    assert gptj.head_bias and gptj.mlp_bias and not gptj.qkv_bias and not gptj.out_bias
    phi = config_from_hf(published("Phi-2"))
    assert (phi.rotary_dim, phi.head_bias, phi.qk_norm) == (32, True, "none")


def test_cycle_pattern():
    assert cycle_pattern("LGLGLG") == "LG"
    assert cycle_pattern("LLLLLGLLLLLGLL") == "LLLLLG"
    assert cycle_pattern("GGLL") == "GGLL"
    assert cycle_pattern("LLL") == "L"


# ----- round trips ------------------------------------------------------------------

@pytest.mark.parametrize("entry", PARAM_COUNTS, ids=[e["name"] for e in PARAM_COUNTS])
def test_round_trip(entry):
    cfg = config_from_hf(entry["config"])
    model_type = entry["config"]["model_type"]
    model_type = "gemma3_text" if model_type == "gemma3" else model_type
    hf = config_to_hf(cfg, model_type)
    assert architecture(config_from_hf(hf)) == architecture(cfg)


def test_config_to_hf_refuses_what_the_family_cannot_express():
    llama = config_from_hf(published("Llama-3-8B"))
    with pytest.raises(ValueError, match=r"qk_norm='head' \(a llama config gives 'none'\)"):
        config_to_hf(llama.replace(qk_norm="head"), "llama")
    with pytest.raises(ValueError, match=r"norm_type=.rmsnorm. \(a gpt2 config gives .layernorm.\)"):
        config_to_hf(llama, "gpt2")
    with pytest.raises(ValueError, match="supported: llama"):
        config_to_hf(llama, "bert")
    with pytest.raises(ValueError, match="gemma3_text"):
        config_to_hf(llama, "gemma3")


# ----- errors -----------------------------------------------------------------------

@pytest.mark.parametrize("change, match", [
    ({"model_type": "bert"}, r"model_type 'bert' is not supported; supported: llama, mistral"),
    ({"model_type": None}, "model_type None is not supported"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_type='dynamic'.*supported: default, linear"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}},
     r"rope_scaling.low_freq_factor=1.0 is not supported \(a 'linear' rope takes factor\)"),
    ({"hidden_act": "quick_gelu"}, r"hidden_act='quick_gelu' is not supported \(supported: silu"),
])
def test_unsupported_llama_settings(change, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(dict(published("Llama-2-7B"), **change))


@pytest.mark.parametrize("name, change, match", [
    ("GPT-2 (124M)", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ("GPT-2 (124M)", {"add_cross_attention": True}, "add_cross_attention=True"),
    ("Gemma-3-1B", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ("GPT-J-6B", {"rotary_dim": None}, "rotary_dim=None"),
    ("Gemma-2-2B", {"layer_types": ["sliding_attention", "chunked_attention"] * 13}, "chunked_attention"),
])
def test_unsupported_family_settings(name, change, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(dict(published(name), **change))


def test_overrides_do_not_change_the_network():
    cfg = config_from_hf(published("Llama-3.2-1B"), dtype="bfloat16", param_dtype="bfloat16", remat="full")
    assert (cfg.dtype, cfg.param_dtype, cfg.remat) == ("bfloat16", "bfloat16", "full")
    assert architecture(cfg) == architecture(config_from_hf(published("Llama-3.2-1B")))
