"""Parameter, KV-cache and FLOP accounting against the published oracles of SPEC section 2."""

import pathlib

import pytest

from modern_jax.accounting import flops_per_token, kv_cache_bytes, kv_cache_bytes_per_token, param_counts
from modern_jax.cli import main
from modern_jax.config import ModelConfig, model_config_from_file

CONFIGS = pathlib.Path(__file__).parent.parent / "configs"
GiB = 1024**3


def test_llama_3_2_3b_exact():
    cfg = ModelConfig(vocab_size=128256, d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8, head_dim=128,
                      d_ff=8192, tie_embeddings=True)
    assert param_counts(cfg)["total"] == 3_212_749_824
    assert param_counts(model_config_from_file(CONFIGS / "llama3_2_3b.yaml"))["total"] == 3_212_749_824


@pytest.mark.quick
def test_llama_2_7b_exact():
    cfg = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008)
    assert param_counts(cfg)["total"] == 6_738_415_616
    assert param_counts(model_config_from_file(CONFIGS / "llama2_7b.yaml"))["total"] == 6_738_415_616


def test_one_gqa_block_with_qk_norm():
    cfg = ModelConfig(d_model=512, n_layers=1, n_heads=8, n_kv_heads=2, d_ff=1365, qk_norm="head")
    assert param_counts(cfg)["per_block"] == [2_753_152]


def test_one_mha_swiglu_block():
    cfg = ModelConfig(d_model=256, n_layers=1, n_heads=8, ffn_multiple_of=1)
    assert cfg.ffn_width == 683
    assert param_counts(cfg)["per_block"] == [787_200]
    no_ffn = ModelConfig(d_model=256, n_layers=1, n_heads=8, d_ff=1)
    ffn = 787_200 - param_counts(no_ffn)["per_block"][0] + 3 * 256  # a width-1 FFN has 3 * 256 weights
    assert ffn == 524_544 and 787_200 - ffn - 2 * 256 == 262_144  # FFN, attention (and two norms)


def test_llama_style_lm():
    cfg = ModelConfig(vocab_size=1000, d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=688, qk_norm="head")
    assert param_counts(cfg)["total"] == 3_283_456


@pytest.mark.quick
def test_kv_cache_oracles():
    llama3_70b = ModelConfig(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8)
    assert kv_cache_bytes_per_token(llama3_70b) == 327_680
    assert kv_cache_bytes(llama3_70b, 131_072) == 40 * GiB
    assert kv_cache_bytes(llama3_70b.replace(n_kv_heads=64), 131_072) == 320 * GiB
    l32 = ModelConfig(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8)
    assert kv_cache_bytes_per_token(l32) == 128 * 1024
    assert kv_cache_bytes(l32, 32_768) == 4 * GiB
    deepseek = ModelConfig(d_model=7168, n_layers=61, n_heads=128, attention_type="mla", mla_kv_rank=512,
                           mla_rope_dim=64)
    assert kv_cache_bytes(deepseek, 128 * 1024) / GiB == pytest.approx(8.6, abs=0.05)


def test_kv_cache_of_local_layers_is_bounded_by_the_window():
    cfg = ModelConfig(d_model=64, n_layers=6, n_heads=4, sliding_window=100, attention_pattern="LLG")
    per_layer = 2 * 4 * 16 * 2
    assert kv_cache_bytes(cfg, 1000) == per_layer * (4 * 100 + 2 * 1000)


def test_flops_per_token_is_6n_plus_attention():
    cfg = ModelConfig(vocab_size=100, d_model=64, n_layers=2, n_heads=4, d_ff=128, tie_embeddings=True)
    n = param_counts(cfg)["total"]  # tied: the embedding matrix is used once as the head
    flops = flops_per_token(cfg, seq_len=32)
    assert flops["weights"] == 6 * n
    assert flops["attention"] == 12 * 2 * 4 * 16 * 32  # PaLM: 12 L H Q T


@pytest.mark.quick
def test_info_command_prints_the_total(capsys):
    assert main(["info", "--config", str(CONFIGS / "llama2_7b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "parameters: 6738415616\n" in out
    assert "kv cache per token (bfloat16): 524288" in out
    assert main(["info", "--config", str(CONFIGS / "llama2_7b.yaml"), "model.n_layer=2"]) == 2
    assert "unknown key model.n_layer" in capsys.readouterr().err
