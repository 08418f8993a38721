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
from modern_jax.layers.moe import SelectionBias
from modern_jax.model import Transformer

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
CONFIGS = Path(__file__).parent.parent / "configs"
PARAM_COUNTS = json.loads((FIXTURES / "param_counts.json").read_text())["entries"]


def model_param_count(cfg: ModelConfig) -> int:
    """The weights the model allocates, counted without allocating them: its parameters but DeepSeek's
    selection bias (`e_score_correction_bias`, a buffer in transformers, outside our optimiser)."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    weights = nnx.All(nnx.Param, nnx.Not(SelectionBias))
    return sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(abstract, weights)))


@pytest.mark.parametrize("entry", PARAM_COUNTS, ids=[e["name"] for e in PARAM_COUNTS])
def test_param_count_matches_transformers(entry):
    cfg = config_from_hf(entry["config"])
    assert model_param_count(cfg) == entry["count"], entry["name"]
    try:
        from modern_jax.accounting import param_counts
    except ImportError:
        return
    assert param_counts(cfg)["total"] == entry["count"], f"accounting.param_counts: {entry['name']}"


MOE_COUNTS = [e for e in PARAM_COUNTS if "active_count" in e]


@pytest.mark.parametrize("entry", MOE_COUNTS, ids=[e["name"] for e in MOE_COUNTS])
def test_active_param_count_matches_transformers(entry):
    """The parameters one token uses: all but the E - k routed experts of each mixture it is not sent to."""
    from modern_jax.accounting import param_counts

    cfg = config_from_hf(entry["config"])
    assert cfg.ffn_type == "moe"
    counts = param_counts(cfg)
    assert (counts["total"], counts["active"]) == (entry["count"], entry["active_count"]), entry["name"]


def test_the_published_mixtures_are_covered():
    names = {e["name"] for e in MOE_COUNTS if e["group"] == "published"}
    assert {"Mixtral-8x7B-v0.1", "Qwen3-30B-A3B", "Qwen3-235B-A22B", "DeepSeek-V3", "gpt-oss-20b", "gpt-oss-120b",
            "Llama-4-Scout-17B-16E (text)"} <= names
    counts = {e["name"]: (e["count"], e["active_count"]) for e in MOE_COUNTS}
    assert counts["DeepSeek-V3"] == (671_026_404_352, 37_552_282_624)  # without the multi-token-prediction layer
    assert counts["Mixtral-8x7B-v0.1"] == (46_702_792_704, 12_879_925_248)


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
    ("Llama-3-8B", "llama3_8b"), ("Llama-3.1-405B", "llama3_1_405b"), ("Mistral-7B-v0.1", "mistral_7b"), ("Qwen2-7B", "qwen2_7b"),
    ("Qwen3-0.6B", "qwen3_0_6b"), ("Qwen3-8B", "qwen3_8b"), ("Gemma-2-2B", "gemma2_2b"), ("Gemma-3-1B", "gemma3_1b"),
    ("OLMo-2-1124-7B", "olmo2_7b"), ("GPT-2 (124M)", "gpt2"), ("GPT-J-6B", "gptj_6b"), ("GPT-NeoX-20B", "gpt_neox_20b"),
    ("DeepSeek-V3", "deepseek_v3"), ("Qwen3-30B-A3B", "qwen3_30b_a3b"), ("Qwen3-235B-A22B", "qwen3_235b_a22b"),
    ("Mixtral-8x7B-v0.1", "mixtral_8x7b"), ("gpt-oss-20b", "gpt_oss_20b"), ("gpt-oss-120b", "gpt_oss_120b"),
    ("Llama-4-Scout-17B-16E (text)", "llama4_scout"),
])
def test_published_config_is_the_preset(name, preset):
    path = CONFIGS / f"{preset}.yaml"
    if not path.exists():
        pytest.skip(f"no preset {path.name}")
    want = ModelConfig.from_dict(yaml.safe_load(path.read_text())["model"])
    got = architecture(config_from_hf(published(name)))
    diff = {k: (v, got[k]) for k, v in architecture(want).items() if got[k] != v and k != "max_position_embeddings"}
    assert not diff, diff


@pytest.mark.quick
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


def test_mixtures_of_experts():
    qwen = config_from_hf(published("Qwen3-30B-A3B"))
    assert (qwen.ffn_type, qwen.n_experts, qwen.experts_per_token, qwen.expert_width, qwen.router_score,
            qwen.router_norm_topk, qwen.qk_norm, qwen.moe_pattern) == ("moe", 128, 8, 768, "softmax", True, "head", "E")
    sparse = dict(published("Qwen3-30B-A3B"), num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[5])
    assert [s.moe for s in config_from_hf(sparse).layer_specs()] == [False, True, False, True, False, False]
    saved = {k: v for k, v in published("Qwen3-30B-A3B").items() if k != "num_experts"}  # 5.x saves the alias
    assert config_from_hf(dict(saved, num_local_experts=128)) == qwen
    mixtral = config_from_hf(published("Mixtral-8x7B-v0.1"))
    assert (mixtral.n_experts, mixtral.experts_per_token, mixtral.expert_width, mixtral.router_score,
            mixtral.router_norm_topk, mixtral.attention_pattern) == (8, 2, 14336, "softmax", True, "G")
    deepseek = config_from_hf(published("DeepSeek-V3"))
    assert (deepseek.attention_type, deepseek.mla_q_rank, deepseek.mla_kv_rank, deepseek.mla_rope_dim,
            deepseek.rope_layout) == ("mla", 1536, 512, 64, "interleaved")
    assert (deepseek.moe_first_dense, deepseek.moe_pattern, deepseek.router_score, deepseek.router_selection_bias,
            deepseek.router_groups, deepseek.router_topk_groups, deepseek.router_norm_topk, deepseek.router_scale,
            deepseek.shared_width) == (3, "E", "sigmoid", True, 8, 4, True, 2.5, 2048)
    assert deepseek.rope_scaling == RopeScaling("yarn", 40.0, original_max_position_embeddings=4096, mscale=1.0,
                                                mscale_all_dim=1.0)
    oss = config_from_hf(published("gpt-oss-20b"))
    assert (oss.attention_pattern, oss.sliding_window, oss.attention_sinks, oss.qkv_bias, oss.out_bias) == (
        "LG", 128, True, True, True)
    assert (oss.router_score, oss.router_bias, oss.expert_bias, oss.expert_swiglu_limit, oss.expert_swiglu_alpha) == (
        "topk_softmax", True, True, 7.0, 1.702)
    assert oss.rope_scaling == RopeScaling("yarn", 32.0, original_max_position_embeddings=4096, truncate=False)
    unnamed = {k: v for k, v in published("gpt-oss-20b").items() if k not in ("rope_scaling", "layer_types")}
    assert config_from_hf(unnamed) == oss  # GptOssConfig's default rope and layer types


def test_llama4():
    scout = config_from_hf(published("Llama-4-Scout-17B-16E (text)"))
    assert (scout.attention_pattern, scout.rope_pattern, scout.attention_chunk_size, scout.qk_norm,
            scout.attn_temperature_floor, scout.attn_temperature_scale, scout.rope_layout) == (
        "CCCG", "RRRN", 8192, "l2", 8192, 0.1, "interleaved")
    assert (scout.router_score, scout.router_on_input, scout.experts_per_token, scout.n_shared_experts,
            scout.moe_pattern, scout.expert_width, scout.ffn_width) == ("sigmoid", True, 1, 1, "E", 8192, 16384)
    specs = scout.layer_specs()
    assert (specs[0].chunk, specs[0].qk_norm, specs[0].temperature) == (8192, "l2", None)
    assert (specs[3].chunk, specs[3].qk_norm, specs[3].rope, specs[3].temperature.floor) == (None, "none", None, 8192)
    assert config_from_hf(dict(published("Llama-4-Scout-17B-16E (text)"), attn_temperature_tuning=4)) == scout
    # unnamed: MoE layers from interleave_moe_layer_step, NoPE every 4th layer, layer types from both
    derived = dict(published("Llama-4-Scout-17B-16E (text)"), moe_layers=None, interleave_moe_layer_step=2,
                   no_rope_layers=None, attn_temperature_tuning=False)
    got = config_from_hf(derived)
    assert (got.moe_pattern, got.rope_pattern, got.attention_pattern, got.attn_temperature_floor) == (
        "DE", "RRRN", "CCCG", None)


def test_cycle_pattern():
    assert cycle_pattern("LGLGLG") == "LG"
    assert cycle_pattern("LLLLLGLLLLLGLL") == "LLLLLG"
    assert cycle_pattern("GGLL") == "GGLL"
    assert cycle_pattern("LLL") == "L"


# ----- round trips ------------------------------------------------------------------

@pytest.mark.quick
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
    deepseek = config_from_hf(published("DeepSeek-V3"))
    with pytest.raises(ValueError, match=r"qwen3_moe cannot express this model: .*router_score='sigmoid'"):
        config_to_hf(deepseek, "qwen3_moe")
    with pytest.raises(ValueError, match=r"deepseek_v3 cannot express this model: .*moe_pattern='DEDE"):
        config_to_hf(deepseek.replace(moe_first_dense=0, moe_pattern="DE"), "deepseek_v3")
    scout = config_from_hf(published("Llama-4-Scout-17B-16E (text)"))
    with pytest.raises(ValueError, match=r"mixtral cannot express this model: .*router_on_input=True.*"
                                         r"shared_width=8192"):
        config_to_hf(scout, "mixtral")


# ----- errors -----------------------------------------------------------------------

@pytest.mark.quick
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
    ("DeepSeek-V3", {"attention_bias": True}, r"attention_bias=True .*no biases"),
    ("DeepSeek-V3", {"num_key_value_heads": 8}, "num_key_value_heads=8"),
    ("DeepSeek-V3", {"rms_norm_eps": 1e-5}, r"rms_norm_eps=1e-05 .*latent norms"),
    ("Llama-4-Scout-17B-16E (text)", {"num_experts_per_tok": 2}, r"num_experts_per_tok=2 .*one expert per token"),
    ("Llama-4-Scout-17B-16E (text)", {"layer_types": ["sliding_attention"] * 48}, "sliding_attention"),
    ("Llama-4-Scout-17B-16E (text)", {"no_rope_layers": [1, 0]}, "no_rope_layers"),
    ("Qwen3-30B-A3B", {"mlp_only_layers": [48]}, "mlp_only_layers"),
])
def test_unsupported_family_settings(name, change, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(dict(published(name), **change))


def test_overrides_do_not_change_the_network():
    cfg = config_from_hf(published("Llama-3.2-1B"), dtype="bfloat16", param_dtype="bfloat16", attn_dropout=0.1)
    assert (cfg.dtype, cfg.param_dtype, cfg.attn_dropout) == ("bfloat16", "bfloat16", 0.1)
    assert architecture(cfg) == architecture(config_from_hf(published("Llama-3.2-1B")))
