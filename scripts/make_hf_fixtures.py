"""Golden fixtures for the Hugging Face conversion tests, made with transformers (PyTorch, CPU).

Runs in its own Python 3.11 environment (torch is never a dependency of modern_jax):

    /root/.pyenv/versions/3.11.7/bin/python -m venv .hfvenv
    .hfvenv/bin/pip install torch==2.13.0 transformers safetensors
    .hfvenv/bin/python scripts/make_hf_fixtures.py            # everything
    .hfvenv/bin/python scripts/make_hf_fixtures.py counts     # param_counts.json only
    .hfvenv/bin/python scripts/make_hf_fixtures.py checkpoints [--out DIR] [--only NAME ...]
    .hfvenv/bin/python scripts/make_hf_fixtures.py reference DIR ...   # for the live test
    .hfvenv/bin/python scripts/make_hf_fixtures.py chat [--out DIR]    # tests/fixtures/hf_chat
    .hfvenv/bin/python scripts/make_hf_fixtures.py mtp [--out DIR]     # tests/fixtures/hf/deepseek_v3_mtp
    .hfvenv/bin/python scripts/make_hf_fixtures.py chat-reference DIR ...   # for the live test
    .hfvenv/bin/pip install peft trl                                        # for the four below
    .hfvenv/bin/python scripts/make_hf_fixtures.py peft [--out DIR]    # tests/fixtures/hf_peft
    .hfvenv/bin/python scripts/make_hf_fixtures.py peft-logits --base DIR --adapter DIR --tokens IDS.npy --out OUT.npz
    .hfvenv/bin/python scripts/make_hf_fixtures.py dpo-reference --model DIR [--ref-model DIR] [--adapter DIR] \
        --batch BATCH.npz --out OUT.npz [--beta B] [--loss-type sigmoid|ipo] [--label-smoothing S]
    .hfvenv/bin/python scripts/make_hf_fixtures.py grpo-reference [--model DIR --adapter DIR] [--batch BATCH.npz] \
        [--out DIR]                                                   # tests/fixtures/hf_peft/llama/grpo

Writes under tests/fixtures/hf/:
- `param_counts.json`: for each config (tiny ones and the published sizes of the presets),
  the config dict and transformers' exact parameter count (model built on the `meta`
  device, tied weights counted once); for a mixture of experts also `active_count`, the
  parameters one token uses (embedding and head included), and where the config names
  multi-token-prediction layers (DeepSeek-V3) `mtp_count`, theirs, which `count` leaves out
  as transformers' model does.
- `<name>/`: a tiny randomly initialised checkpoint per family as transformers saves it
  (`config.json`, safetensors), and `reference.npz` with the prompt tokens, the fp32
  logits of a forward pass over them, 32 greedily generated tokens (KV cache) and the
  logits each was chosen from. `manifest.json` lists them with their seeds and margins.

And `tests/fixtures/hf_chat/`: a tiny Llama as transformers initialises and saves it, with a
word-level tokenizer (ChatML's `<|im_start|>` / `<|im_end|>`, `<|im_end|>` the eos token) and
its chat template saved by `PreTrainedTokenizerFast.save_pretrained`, and `chat.jsonl`: 25
conversations of sums in words, to fine-tune it on (docs/training.md, "Fine-tune a Hugging Face
model on your conversations").

And `tests/fixtures/hf_peft/`: for a tiny Llama (untied head) and a tiny Qwen3 (tied), a random float32
`base/`, a PEFT LoRA `adapter/` (r 4, alpha 8, on every projection, A and B random) as
`PeftModel.save_pretrained` writes it, and `reference.npz` with `tokens` and the logits of the base,
of the PeftModel and of its `merge_and_unload()`. `peft-logits` gives PEFT's logits for an adapter
(one we export must load there, strictly); `dpo-reference` gives TRL's DPO loss and metrics on a
batch of preference pairs, from TRL's own `DPOTrainer._compute_loss`.

And `tests/fixtures/hf_peft/llama/grpo/` (`grpo-reference`, the llama base and adapter unless --model / --adapter
name others): `batch.npz`, a fixed GRPO batch (2 prompts x 4 completions, their rewards from two reward functions
`correct` and `format`, None as NaN, and perturbed old log-probabilities; see `make_grpo_batch`), and per setting
in GRPO_SETTINGS `<name>.npz`: TRL's loss, advantages, per-token log-probabilities and entropies of the policy (and
of the reference, the base, when beta != 0) and every metric TRL logs for the step, as the JSON string `metrics`
under TRL's names, from a `GRPOTrainer` built by its own constructor with only its generation replaced.

And `tests/fixtures/hf/deepseek_v3_mtp/` (`mtp`): the tiny DeepSeek-V3 with one multi-token-prediction layer,
saved as DeepSeek-V3's checkpoint holds it (`model.layers.{n}.eh_proj`, `enorm`, `hnorm`, its block, `shared_head.norm`,
and copies of the embedding and head as `embed_tokens` and `shared_head.head`), its weights random; `reference.npz`
holds `tokens` and `mtp_logits`, the logits with which the layer predicts token i + 2 at each position i, computed by
transformers' own `MtpLayer` (with the model's `DeepseekV3DecoderLayer` as its block) from the main model's final
hidden states and the embedded token i + 1, through the shared head.

The tests read only these files, so the default test run needs neither torch nor
transformers. `tests/test_convert_live.py` runs the same comparisons live, through this
script, when torch and transformers import (or MODERN_JAX_HF_PYTHON names an interpreter
that has them, e.g. .hfvenv/bin/python).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import zlib
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_layers import MtpLayer

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hf"

LLAMA3_ROPE = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}

# The published configurations (as their config.json files spell them, 4.x keys).
PUBLISHED = {
    "Llama-3.2-1B": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True),
    "Llama-3.2-3B": dict(model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                         num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True),
    "Llama-2-7B": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                       tie_word_embeddings=False),
    "Llama-3-8B": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
                       tie_word_embeddings=False),
    "Llama-3.1-405B": dict(model_type="llama", vocab_size=128256, hidden_size=16384, intermediate_size=53248,
                           num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                           max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                           rope_scaling=dict(LLAMA3_ROPE, factor=8.0), tie_word_embeddings=False),
    "Mistral-7B-v0.1": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                            max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0,
                            sliding_window=4096, tie_word_embeddings=False),
    "Qwen2-7B": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     use_sliding_window=False, sliding_window=131072, max_window_layers=28,
                     tie_word_embeddings=False),
    "Qwen3-0.6B": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       attention_bias=False, use_sliding_window=False, sliding_window=None,
                       max_window_layers=28, tie_word_embeddings=True),
    "Qwen3-8B": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=36,
                     tie_word_embeddings=False),
    "Gemma-2-2B": dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                       num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                       hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192, rms_norm_eps=1e-6,
                       query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0, rope_theta=10000.0),
    "Gemma-2-9B": dict(model_type="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                       num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                       hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192, rms_norm_eps=1e-6,
                       query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0, rope_theta=10000.0),
    "Gemma-3-1B": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                       num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                       hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768, rms_norm_eps=1e-6,
                       query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
                       rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None,
                       attn_logit_softcapping=None, final_logit_softcapping=None),
    # a multimodal config: the count is of its text model (Gemma3ForCausalLM on text_config)
    "Gemma-3-4B (text)": dict(model_type="gemma3", text_config=dict(
        model_type="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240,
        num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
        query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, rope_scaling={"factor": 8.0, "rope_type": "linear"})),
    "OLMo-2-0425-1B": dict(model_type="olmo2", vocab_size=100352, hidden_size=2048, intermediate_size=8192,
                           num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                           max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=500000.0,
                           attention_bias=False, tie_word_embeddings=False),
    "OLMo-2-1124-7B": dict(model_type="olmo2", vocab_size=100352, hidden_size=4096, intermediate_size=11008,
                           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                           max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=500000.0,
                           attention_bias=False, tie_word_embeddings=False),
    "GPT-2 (124M)": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                         activation_function="gelu_new", layer_norm_epsilon=1e-5),
    "GPT-2 XL (1.5B)": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=1600, n_layer=48,
                            n_head=25, activation_function="gelu_new", layer_norm_epsilon=1e-5),
    "GPT-J-6B": dict(model_type="gptj", vocab_size=50400, n_positions=2048, n_embd=4096, n_layer=28, n_head=16,
                     rotary_dim=64, n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                     tie_word_embeddings=False),
    "Pythia-160M": dict(model_type="gpt_neox", vocab_size=50304, hidden_size=768, intermediate_size=3072,
                        num_hidden_layers=12, num_attention_heads=12, rotary_pct=0.25, rotary_emb_base=10000,
                        max_position_embeddings=2048, layer_norm_eps=1e-5, use_parallel_residual=True,
                        hidden_act="gelu", tie_word_embeddings=False),
    "Pythia-1.4B": dict(model_type="gpt_neox", vocab_size=50304, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=24, num_attention_heads=16, rotary_pct=0.25, rotary_emb_base=10000,
                        max_position_embeddings=2048, layer_norm_eps=1e-5, use_parallel_residual=True,
                        hidden_act="gelu", tie_word_embeddings=False),
    "Pythia-6.9B": dict(model_type="gpt_neox", vocab_size=50432, hidden_size=4096, intermediate_size=16384,
                        num_hidden_layers=32, num_attention_heads=32, rotary_pct=0.25, rotary_emb_base=10000,
                        max_position_embeddings=2048, layer_norm_eps=1e-5, use_parallel_residual=True,
                        hidden_act="gelu", tie_word_embeddings=False),
    "GPT-NeoX-20B": dict(model_type="gpt_neox", vocab_size=50432, hidden_size=6144, intermediate_size=24576,
                         num_hidden_layers=44, num_attention_heads=64, rotary_pct=0.25, rotary_emb_base=10000,
                         max_position_embeddings=2048, layer_norm_eps=1e-5, use_parallel_residual=True,
                         hidden_act="gelu", tie_word_embeddings=False),
    "Phi-1.5": dict(model_type="phi", vocab_size=51200, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=24, num_attention_heads=32, partial_rotary_factor=0.5,
                    max_position_embeddings=2048, layer_norm_eps=1e-5, hidden_act="gelu_new", qk_layernorm=False),
    "Phi-2": dict(model_type="phi", vocab_size=51200, hidden_size=2560, intermediate_size=10240,
                  num_hidden_layers=32, num_attention_heads=32, partial_rotary_factor=0.4,
                  max_position_embeddings=2048, layer_norm_eps=1e-5, hidden_act="gelu_new", qk_layernorm=False),
    # mixtures of experts (quantization_config and auto_map left out: the count is of the unquantized model)
    "Mixtral-8x7B-v0.1": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                              num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
                              rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
                              router_aux_loss_coef=0.02, tie_word_embeddings=False),
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
                          attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=48,
                          router_aux_loss_coef=0.001, tie_word_embeddings=False),
    "Qwen3-235B-A22B": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                            max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                            rope_scaling=None, attention_bias=False, use_sliding_window=False, sliding_window=None,
                            max_window_layers=94, router_aux_loss_coef=0.001, tie_word_embeddings=False),
    # the count leaves out the multi-token-prediction layer (model.layers.61.*, num_nextn_predict_layers):
    # DeepseekV3ForCausalLM does not build it, and ignores its weights on loading
    "DeepSeek-V3": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
                        num_experts_per_tok=8, n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid",
                        norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=3, moe_layer_freq=1,
                        aux_loss_alpha=0.001, seq_aux=True, num_nextn_predict_layers=1,
                        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
                        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
                        attention_bias=False, tie_word_embeddings=False),
    "gpt-oss-20b": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        num_local_experts=32, num_experts_per_tok=4, experts_per_token=4,
                        layer_types=["sliding_attention", "full_attention"] * 12, sliding_window=128,
                        attention_bias=True, swiglu_limit=7.0, max_position_embeddings=131072,
                        initial_context_length=4096, rms_norm_eps=1e-5, rope_theta=150000,
                        rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                      "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
                        router_aux_loss_coef=0.9, tie_word_embeddings=False),
    "gpt-oss-120b": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                         num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                         num_local_experts=128, num_experts_per_tok=4, experts_per_token=4,
                         layer_types=["sliding_attention", "full_attention"] * 18, sliding_window=128,
                         attention_bias=True, swiglu_limit=7.0, max_position_embeddings=131072,
                         initial_context_length=4096, rms_norm_eps=1e-5, rope_theta=150000,
                         rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "rope_type": "yarn",
                                       "original_max_position_embeddings": 4096, "truncate": False},
                         router_aux_loss_coef=0.9, tie_word_embeddings=False),
    # a multimodal config: the count is of its text model (Llama4ForCausalLM on text_config); config.json spells
    # attn_temperature_tuning 4, which transformers reads as true (its config now takes only a bool)
    "Llama-4-Scout-17B-16E (text)": dict(
        model_type="llama4_text", vocab_size=202048, hidden_size=5120, intermediate_size=8192,
        intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
        head_dim=128, num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1,
        moe_layers=list(range(48)), no_rope_layers=[1, 1, 1, 0] * 12, attention_chunk_size=8192, use_qk_norm=True,
        attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1, max_position_embeddings=262144,
        rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        attention_bias=False, router_aux_loss_coef=0.001, router_jitter_noise=0.0, tie_word_embeddings=False),
}

# Tiny configurations: every family with its switches (GQA, biases, windows, softcaps, ...).
# The same dicts make the golden checkpoints.
TINY_V = 128
TINY = {
    "llama": dict(model_type="llama", vocab_size=TINY_V, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-5, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "llama_bias_linear": dict(model_type="llama", vocab_size=TINY_V, hidden_size=32, intermediate_size=48,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                              attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                              rope_scaling={"type": "linear", "factor": 2.0}),
    "llama_yarn": dict(model_type="llama", vocab_size=TINY_V, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "mistral": dict(model_type="mistral", vocab_size=TINY_V, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                    max_position_embeddings=128),
    "qwen2": dict(model_type="qwen2", vocab_size=TINY_V, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0,
                  use_sliding_window=False, max_position_embeddings=128),
    "qwen2_window": dict(model_type="qwen2", vocab_size=TINY_V, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, use_sliding_window=True,
                         sliding_window=8, max_window_layers=1, max_position_embeddings=128),
    "qwen3": dict(model_type="qwen3", vocab_size=TINY_V, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=128),
    "gemma2": dict(model_type="gemma2", vocab_size=TINY_V, hidden_size=32, intermediate_size=64,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   query_pre_attn_scalar=12, sliding_window=8, attn_logit_softcapping=4.0,
                   final_logit_softcapping=10.0, max_position_embeddings=128),
    "gemma3": dict(model_type="gemma3_text", vocab_size=TINY_V, hidden_size=32, intermediate_size=64,
                   num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                   query_pre_attn_scalar=8, sliding_window=8, sliding_window_pattern=3,
                   rope_theta=1000000.0, rope_local_base_freq=10000.0,
                   rope_scaling={"rope_type": "linear", "factor": 4.0}, max_position_embeddings=128),
    "olmo2": dict(model_type="olmo2", vocab_size=TINY_V, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                  max_position_embeddings=128),
    "gpt2": dict(model_type="gpt2", vocab_size=TINY_V, n_positions=64, n_embd=32, n_layer=2, n_head=4),
    "gpt_neox": dict(model_type="gpt_neox", vocab_size=TINY_V, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.5, max_position_embeddings=128),
    "gpt_neox_sequential": dict(model_type="gpt_neox", vocab_size=TINY_V, hidden_size=32, intermediate_size=48,
                                num_hidden_layers=2, num_attention_heads=2, rotary_pct=0.25,
                                use_parallel_residual=False, attention_bias=False, max_position_embeddings=128),
    "gptj": dict(model_type="gptj", vocab_size=TINY_V, n_positions=128, n_embd=32, n_layer=2, n_head=4,
                 rotary_dim=4, n_inner=64),
    "phi": dict(model_type="phi", vocab_size=TINY_V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, partial_rotary_factor=0.5, max_position_embeddings=128),
    "phi_qk_layernorm": dict(model_type="phi", vocab_size=TINY_V, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=2, qk_layernorm=True,
                             partial_rotary_factor=0.25, max_position_embeddings=128),
    # mixtures of experts, with dense layers among them where the family has any (see ROUTER_MARGIN)
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=TINY_V, hidden_size=32, intermediate_size=64,
                      moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                      rope_theta=1000000.0, max_position_embeddings=128),
    "qwen3_moe_unnormalized": dict(model_type="qwen3_moe", vocab_size=TINY_V, hidden_size=32, intermediate_size=48,
                                   moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=8, num_experts=6, num_experts_per_tok=2,
                                   norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True,
                                   max_position_embeddings=128),
    "mixtral": dict(model_type="mixtral", vocab_size=TINY_V, hidden_size=32, intermediate_size=48,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=8, rope_theta=1000000.0, max_position_embeddings=128),
    "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=TINY_V, hidden_size=32, intermediate_size=64,
                        moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                        num_nextn_predict_layers=0, rope_theta=10000.0, max_position_embeddings=64,
                        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}),
    # swiglu_limit low enough (7.0 when published) that the clamps act on a good share of activations
    "gpt_oss": dict(model_type="gpt_oss", vocab_size=TINY_V, hidden_size=32, intermediate_size=32,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"] * 2, swiglu_limit=1.0,
                    rope_theta=150000.0, max_position_embeddings=64,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 16}),
    # RoPE and chunked attention on layers 0 and 3, NoPE, full attention and temperature tuning on 1 and 2;
    # MoE on 1 and 3 (interleave_moe_layer_step); the tuning's scale steps up every floor_scale positions
    "llama4_text": dict(model_type="llama4_text", vocab_size=TINY_V, hidden_size=32, intermediate_size=32,
                        intermediate_size_mlp=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2,
                        no_rope_layers=[1, 0, 0, 1], attention_chunk_size=8, use_qk_norm=True,
                        attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                        max_position_embeddings=128),
}
for _config in TINY.values():  # token ids inside the tiny vocabulary
    _config.update(bos_token_id=1, eos_token_id=2, pad_token_id=None)
SHARDED = {"qwen2"}  # saved as several safetensors files with model.safetensors.index.json
BF16 = {"llama_bf16": "llama"}  # the same tiny model also saved in bfloat16


def hf_config(config: dict):
    config = dict(config)
    model_type = config.pop("model_type")
    if model_type == "gemma3":  # the text model of a multimodal config
        text = dict(config.pop("text_config"))
        model_type = text.pop("model_type")
        config = text
    return AutoConfig.for_model(model_type, **config)


def param_count(config: dict) -> tuple[int, int, int, str]:
    """The model's parameters (tied weights once); those one token uses, the embedding and the head included:
    all but the routed experts it is not sent to (num_experts - num_experts_per_tok of each mixture's experts,
    stacked [E, ...] in a module named *Experts); and those of the multi-token-prediction layers the config
    names (num_nextn_predict_layers), which the model itself leaves out."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(config))
        text = model.config.get_text_config()
        idle = 0
        for module in model.modules():
            if type(module).__name__.endswith("Experts"):
                per_expert = sum(p.numel() for p in module.parameters()) // module.num_experts
                idle += (module.num_experts - text.num_experts_per_tok) * per_expert
        mtp = 0
        if getattr(text, "num_mtp_layers", 0):  # as generate(use_mtp=True) would build them
            layer_cls, norm_cls = type(model.model.layers[-1]), type(model.model.norm)
            for k in range(text.num_mtp_layers):
                layer = MtpLayer(text, layer_cls, norm_cls, text.num_hidden_layers + k)
                mtp += sum(p.numel() for p in layer.parameters())
    total = sum(p.numel() for p in model.parameters())
    return total, total - idle, mtp, type(model).__name__


def make_counts(out: Path) -> None:
    entries = []
    for group, configs in (("published", PUBLISHED), ("tiny", TINY)):
        for name, config in configs.items():
            count, active, mtp, cls = param_count(config)
            entry = {"name": name, "group": group, "model_class": cls, "count": count, "config": config}
            if active != count:
                entry["active_count"] = active
            if mtp:
                entry["mtp_count"] = mtp
            entries.append(entry)
            print(f"{name:28s} {cls:28s} {count:>16,d} {active:>16,d}" + (f"  (+{mtp:,d} MTP)" if mtp else ""))
    payload = {"transformers": transformers.__version__, "torch": torch.__version__, "entries": entries}
    (out / "param_counts.json").write_text(json.dumps(payload, indent=1) + "\n")


# ----- tiny checkpoints ---------------------------------------------------------------

PROMPT_LEN, NEW_TOKENS, BATCH = 12, 32, 2


TRANSPOSED_EXPERTS = {"gpt_oss", "llama4_text"}  # stacked experts [E, in, out]; the others' are [E, out, in]


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights of O(1) effect so logits are well separated: matrices ~ N(0, 1/fan_in), vectors
    (norm scales, biases, gpt-oss's per-expert biases [E, ...]) perturbed by N(0, 0.1) around their init,
    embeddings ~ N(0, 1), or N(0, 0.25) when the head is tied (else a token's own embedding dominates
    its logits and greedy decoding only repeats it). gpt-oss's attention sinks ~ N(0, 1), so that some
    heads give the sink a real share; DeepSeek's routing bias (a buffer, e_score_correction_bias)
    ~ N(0, 0.2), of the order of the sigmoid scores it shifts."""
    g = torch.Generator().manual_seed(seed)
    text = model.config.get_text_config()
    embed_std = 0.25 if text.tie_word_embeddings else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("sinks"):
                p.copy_(noise)
            elif p.ndim == 1 or name.endswith("_bias"):
                p.add_(0.1 * noise)
            elif "emb" in name or name.endswith(("wte.weight", "wpe.weight")):
                p.copy_(embed_std * noise)
            elif p.ndim == 3:  # a mixture's stacked experts
                p.copy_(noise / p.shape[1 if text.model_type in TRANSPOSED_EXPERTS else 2] ** 0.5)
            else:  # torch Linear [out, in]; GPT-2's Conv1D (c_attn, c_fc, c_proj) [in, out]
                p.copy_(noise / (p.shape[0] if ".c_" in name else p.shape[-1]) ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))


def _gap(scores: torch.Tensor, k: int) -> float:
    """The smallest gap, over rows, between the k-th and the (k+1)-th largest score."""
    if k >= scores.shape[-1]:
        return float("inf")
    top = scores.topk(k + 1, dim=-1).values
    return float((top[:, k - 1] - top[:, k]).min())


def _routing(router: torch.nn.Module, logits: torch.Tensor) -> tuple[float, torch.Tensor]:
    """A router's choice from its logits [tokens, E]: the smallest margin of any choice it made, in the
    scores it ranks, and the experts it picked [tokens, k]."""
    scores = logits.float()
    margin = float("inf")
    if hasattr(router, "e_score_correction_bias"):  # DeepSeek: the topk_group groups first, by their top two
        scores = scores.sigmoid() + router.e_score_correction_bias
        groups = scores.view(len(scores), router.num_group, -1).topk(2, dim=-1).values.sum(-1)
        margin = _gap(groups, router.topk_group)
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(router.topk_group, dim=-1).indices, 1.0)
        keep = keep.bool().repeat_interleave(router.num_experts // router.num_group, dim=1)
        scores = scores.masked_fill(~keep, float("-inf"))
    return min(margin, _gap(scores, router.top_k)), scores.topk(router.top_k, dim=-1).indices


def watch_routers(model) -> dict:
    """Hooks on each router of a mixture of experts (the modules transformers records router logits from)
    that keep, over every forward pass: `margin`, the smallest gap between the last expert a choice
    picked and the first it left out (a near tie would let float rounding reroute a token), and `picked`,
    the set of experts each router chose."""
    base = getattr(model, "model", model)
    recorder = (getattr(base, "_can_record_outputs", None) or {}).get("router_logits")
    routers = [m for m in model.modules() if isinstance(m, recorder.target_class)] if recorder else []
    stats = {"margin": float("inf"), "picked": [set() for _ in routers],
             "experts": [router.num_experts for router in routers]}

    def hook(i, router, inputs, output):
        margin, picked = _routing(router, output[recorder.index])
        stats["margin"] = min(stats["margin"], margin)
        stats["picked"][i].update(picked.flatten().tolist())

    for i, router in enumerate(routers):
        router.register_forward_hook(functools.partial(hook, i))
    return stats


@torch.no_grad()
def greedy(model, tokens: torch.Tensor, steps: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Greedy continuation with transformers' KV cache: the tokens [B, steps], the logits each
    token was chosen from [B, steps, V], and the smallest top-1 / top-2 logit gap."""
    out = model(tokens, use_cache=True)
    cache, logits = out.cache, out.logits[:, -1]  # a DynamicCache, sliding layers included
    generated, step_logits, margin = [], [], float("inf")
    for _ in range(steps):
        top2 = torch.topk(logits.float(), 2, dim=-1).values
        margin = min(margin, float((top2[:, 0] - top2[:, 1]).min()))
        nxt = logits.argmax(-1, keepdim=True)
        generated.append(nxt)
        step_logits.append(logits.float())
        out = model(nxt, cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1]
    return torch.cat(generated, dim=1).numpy(), torch.stack(step_logits, dim=1).numpy(), margin


MIN_MARGIN = 2e-3  # greedy tokens must not hinge on logit differences near float32 noise
ROUTER_MARGIN = 1e-3  # nor any token's experts on a near tie of router scores


def make_checkpoint(name: str, config: dict, out: Path, seed: int, dtype=torch.float32) -> dict:
    """Save a tiny random model of `config` with its reference outputs; the first seed from `seed`
    whose greedy continuation never has its top two logits closer than MIN_MARGIN, and, for a mixture
    of experts, whose routers never choose by less than ROUTER_MARGIN and each pick at least half
    their experts."""
    directory = out / name
    for seed in range(seed, seed + 100):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config(config), attn_implementation="eager").eval()
        randomise(model, seed)
        shutil.rmtree(directory, ignore_errors=True)
        model.to(dtype).save_pretrained(directory, max_shard_size="40KB" if name in SHARDED else "1GB")
        (directory / "generation_config.json").unlink(missing_ok=True)
        # the reference: transformers loading what it saved, computing in float32
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        routing = watch_routers(model)
        tokens = torch.randint(0, config["vocab_size"], (BATCH, PROMPT_LEN),
                               generator=torch.Generator().manual_seed(seed))
        logits = model(tokens).logits.float().numpy()
        generated, step_logits, margin = greedy(model, tokens, NEW_TOKENS)
        used = [len(picked) for picked in routing["picked"]]
        if (margin >= MIN_MARGIN and routing["margin"] >= ROUTER_MARGIN
                and all(2 * n >= e for n, e in zip(used, routing["experts"]))):
            break
    np.savez_compressed(directory / "reference.npz", tokens=tokens.numpy().astype(np.int32),
                        logits=logits.astype(np.float32), greedy=generated.astype(np.int32),
                        step_logits=step_logits.astype(np.float32))
    files = sorted(p.name for p in directory.iterdir())
    entry = {"name": name, "seed": seed, "dtype": str(dtype).removeprefix("torch."), "greedy_margin": margin,
             "files": files}
    if used:  # per MoE layer, the experts its router picked at least once
        entry.update(router_margin=routing["margin"], experts_used=used)
    print(f"{name:22s} seed {seed:10d}  greedy margin {margin:.4f}  {files}"
          + (f"  router margin {routing['margin']:.4f}, experts used {used}" if used else ""))
    return entry


def make_checkpoints(out: Path, only: list[str] | None) -> None:
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"checkpoints": {}}
    jobs = [(name, config, torch.float32) for name, config in TINY.items()]
    jobs += [(name, TINY[base], torch.bfloat16) for name, base in BF16.items()]
    for name, config, dtype in jobs:
        if only and name not in only:
            continue
        seed = zlib.crc32(name.encode()) % 2**31  # stable per name, whatever else is in TINY
        manifest["checkpoints"][name] = make_checkpoint(name, config, out, seed, dtype)
    manifest.update(transformers=transformers.__version__, torch=torch.__version__,
                    prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS, batch=BATCH)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def make_mtp_fixture(out: Path, seed: int = 7) -> None:
    """The tiny DeepSeek-V3 of TINY with one MTP layer (the module docstring)."""
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpLayer

    config = dict(TINY["deepseek_v3"], num_nextn_predict_layers=1)
    directory, n = out / "deepseek_v3_mtp", config["num_hidden_layers"]
    # one layer more, whose layer n becomes the MTP block (saved under its checkpoint names by transformers)
    torch.manual_seed(seed)
    bigger = AutoModelForCausalLM.from_config(hf_config(dict(config, num_hidden_layers=n + 1)),
                                              attn_implementation="eager").eval()
    randomise(bigger, seed)
    model = AutoModelForCausalLM.from_config(hf_config(config), attn_implementation="eager").eval()
    model.load_state_dict({k: v for k, v in bigger.state_dict().items() if not k.startswith(f"model.layers.{n}.")})
    text = model.config.get_text_config()
    layer = MtpLayer(text, type(model.model.layers[-1]), type(model.model.norm), n).eval()
    randomise(layer, seed + 1)
    layer.mtp_block.load_state_dict(bigger.model.layers[n].state_dict())
    shutil.rmtree(directory, ignore_errors=True)
    bigger.save_pretrained(directory / "bigger")
    block = {k: v for k, v in load_file(directory / "bigger" / "model.safetensors").items()
             if k.startswith(f"model.layers.{n}.")}
    shutil.rmtree(directory / "bigger")
    model.save_pretrained(directory)
    (directory / "generation_config.json").unlink(missing_ok=True)
    tensors = {**load_file(directory / "model.safetensors"), **block}
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):  # DeepSeek-V3's names for the rest of the layer
        tensors[f"model.layers.{n}.{name}"] = layer.get_parameter(name).detach().contiguous()
    tensors[f"model.layers.{n}.shared_head.norm.weight"] = layer.post_norm.weight.detach().contiguous()
    tensors[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})

    tokens = torch.randint(0, config["vocab_size"], (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))
    out_main = model(tokens, output_hidden_states=True)
    h = out_main.hidden_states[-1]  # the final hidden states, after the final norm
    T = PROMPT_LEN - 1
    positions = torch.arange(T)[None].expand(BATCH, T)
    rotary = model.model.rotary_emb(h, position_ids=positions)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(BATCH, 1, T, T)
    # row i: the hidden state of position i and the embedding of token i + 1; predicts token i + 2
    x = layer(model.model.embed_tokens(tokens[:, 1:]), h[:, :T], position_embeddings=rotary, attention_mask=mask,
              position_ids=positions, cache=None)
    mtp_logits = model.lm_head(x).float().numpy()
    np.savez_compressed(directory / "reference.npz", tokens=tokens.numpy().astype(np.int32),
                        mtp_logits=mtp_logits.astype(np.float32), logits=out_main.logits.float().numpy())
    print(f"deepseek_v3_mtp seed {seed}: {sorted(p.name for p in directory.iterdir())}")


def run_reference(directories: list[Path]) -> None:
    """transformers' fp32 logits and greedy tokens for the prompt DIR/tokens.npy on each checkpoint
    directory, written to DIR/transformers.npz: the live test's view of what to_hf wrote."""
    for directory in directories:
        tokens = torch.from_numpy(np.load(directory / "tokens.npy").astype(np.int64))
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        logits = model(tokens).logits.float().numpy()
        generated, step_logits, _ = greedy(model, tokens, NEW_TOKENS)
        np.savez(directory / "transformers.npz", logits=logits, greedy=generated.astype(np.int32),
                 step_logits=step_logits)


NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
           "sixteen seventeen eighteen").split()
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def chat_conversations() -> list[list[dict]]:
    """Sums of two numbers below ten, asked and answered in words, with a system prompt."""
    out = []
    for a in range(1, 10):
        for b in range(1, 10):
            if (a * 7 + b * 3) % 8 == 0 or (a + b) % 5 == 1:
                out.append([{"role": "system", "content": "you are a calculator"},
                            {"role": "user", "content": f"what is {NUMBERS[a]} plus {NUMBERS[b]}"},
                            {"role": "assistant", "content": f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}"}])
    return out


# the chat fixture with every projection's outputs a multiple of 64 (QLoRA's quantization blocks)
WIDE_CHAT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_key_value_heads=4, head_dim=16)


def chat_preferences() -> list[dict]:
    """Each conversation as a DPO pair (TRL's explicit conversational format): the right sum
    chosen, the next number (the one before, past eighteen) rejected."""
    out = []
    for messages in chat_conversations():
        answer = messages[-1]["content"].split()
        n = NUMBERS.index(answer[-1])
        wrong = NUMBERS[n + 1] if n + 1 < len(NUMBERS) else NUMBERS[n - 1]
        out.append({"prompt": messages[:-1], "chosen": [messages[-1]],
                    "rejected": [{"role": "assistant", "content": " ".join(answer[:-1] + [wrong])}]})
    return out


def make_chat_fixture(out: Path, wide: bool = False) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    words = sorted({w for c in chat_conversations() for m in c for w in f"{m['role']} {m['content']}".split()}
                   | set(NUMBERS))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>")
    hf_tok.chat_template = CHATML
    config = dict(TINY["llama"], **(WIDE_CHAT if wide else {}), bos_token_id=None, eos_token_id=2, pad_token_id=3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(config)).eval()
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    hf_tok.save_pretrained(out)
    with open(out / "chat.jsonl", "w") as f:
        for i, messages in enumerate(chat_conversations()):
            f.write(json.dumps({"id": i, "messages": messages}) + "\n")
    with open(out / "preferences.jsonl", "w") as f:
        f.writelines(json.dumps(pair) + "\n" for pair in chat_preferences())
    print(f"{out}: {len(chat_conversations())} conversations, {len(specials) + len(words)} tokens, "
          f"{sorted(p.name for p in out.iterdir())}")


def run_chat_reference(directories: list[Path]) -> None:
    """For each directory with `conversations.json` (lists of messages): transformers' rendering
    of each with the directory's chat template, and its token ids, in `transformers_chat.json`."""
    from transformers import AutoTokenizer

    for directory in directories:
        tok = AutoTokenizer.from_pretrained(directory)
        conversations = json.loads((directory / "conversations.json").read_text())
        texts = [tok.apply_chat_template(c, tokenize=False) for c in conversations]
        ids = [tok(text, add_special_tokens=False)["input_ids"] for text in texts]
        (directory / "transformers_chat.json").write_text(json.dumps({"texts": texts, "ids": ids}))


# ----- PEFT LoRA adapters and TRL's DPO -----------------------------------------------

# the tiny llama and qwen3 (untied / tied head), two layers and a narrower MLP to keep the fixture small
PEFT_FAMILIES = {"llama": dict(TINY["llama"], num_hidden_layers=2, intermediate_size=48),
                 "qwen3": dict(TINY["qwen3"], intermediate_size=48)}
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
LORA_STD = 0.05  # lora_A and lora_B ~ N(0, LORA_STD^2): PEFT's zero B would make the adapter a no-op


def load_hf(directory: Path):
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


def load_peft(base, adapter: Path):
    """`PeftModel.from_pretrained(base, adapter)`, strictly: PEFT only warns about missing adapter keys and says
    nothing of unexpected ones, so both are errors here, and every saved tensor must be what the model now holds."""
    import warnings

    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*missing adapter keys")
        model = PeftModel.from_pretrained(base, adapter).eval()
    saved = load_file(adapter / "adapter_model.safetensors")
    held = get_peft_model_state_dict(model)
    missing, unexpected = sorted(held.keys() - saved.keys()), sorted(saved.keys() - held.keys())
    if missing or unexpected:
        raise SystemExit(f"{adapter}: adapter keys PEFT expects but the file lacks: {missing}; "
                         f"keys in the file PEFT does not use: {unexpected}")
    changed = [k for k in saved if not torch.equal(saved[k].float(), held[k].float())]
    if changed:
        raise SystemExit(f"{adapter}: PEFT did not load these tensors as saved: {changed}")
    return model


def make_peft_fixture(out: Path) -> None:
    """Per family in PEFT_FAMILIES: a random float32 base (`base/`), a LoRA adapter on every projection with random
    A and B (`adapter/`, PeftModel.save_pretrained), and reference.npz: `tokens` [2, 12] and the float32 logits of
    the base, of the PeftModel (adapter loaded back from disk) and of its `merge_and_unload()`."""
    import peft
    from peft import LoraConfig, get_peft_model

    shutil.rmtree(out, ignore_errors=True)
    manifest = {"transformers": transformers.__version__, "torch": torch.__version__, "peft": peft.__version__,
                "lora": LORA, "lora_std": LORA_STD, "families": {}}
    for family, config in PEFT_FAMILIES.items():
        directory, seed = out / family, zlib.crc32(f"peft-{family}".encode()) % 2**31
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config(config), attn_implementation="eager").eval()
        randomise(model, seed)
        model.save_pretrained(directory / "base")
        (directory / "base" / "generation_config.json").unlink(missing_ok=True)

        lora = get_peft_model(load_hf(directory / "base"), LoraConfig(**LORA))
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in lora.named_parameters():
            if ".lora_" in name:
                p.data.copy_(LORA_STD * torch.randn(p.shape, generator=g))
        base_path = directory.resolve() / "base"  # as PEFT writes it, but relative to the repository when inside it
        lora.peft_config["default"].base_model_name_or_path = str(
            base_path.relative_to(ROOT) if base_path.is_relative_to(ROOT) else base_path)
        lora.save_pretrained(directory / "adapter")
        (directory / "adapter" / "README.md").unlink()  # PEFT's model card template
        config_path = directory / "adapter" / "adapter_config.json"  # PEFT writes target_modules, a set, in hash order
        adapter_config = json.loads(config_path.read_text())
        adapter_config["target_modules"] = sorted(adapter_config["target_modules"])
        config_path.write_text(json.dumps(adapter_config, indent=2, sort_keys=True))  # as PEFT's PeftConfig writes

        tokens = torch.randint(0, config["vocab_size"], (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))
        base = load_hf(directory / "base")
        base_logits = base(tokens).logits.float().numpy()
        with_adapter = load_peft(base, directory / "adapter")
        peft_logits = with_adapter(tokens).logits.float().numpy()
        merged_logits = with_adapter.merge_and_unload()(tokens).logits.float().numpy()
        np.savez_compressed(directory / "reference.npz", tokens=tokens.numpy().astype(np.int32),
                            base_logits=base_logits, peft_logits=peft_logits, merged_logits=merged_logits)
        effect = float(np.max(np.abs(peft_logits - base_logits)))
        merge_gap = float(np.max(np.abs(merged_logits - peft_logits)))
        assert effect > 1e-2, f"{family}: the adapter barely changes the logits ({effect})"
        manifest["families"][family] = {"seed": seed, "config": config, "adapter_effect": effect,
                                        "merge_gap": merge_gap}
        print(f"{family}: seed {seed}  max|peft - base| {effect:.4f}  max|merged - peft| {merge_gap:.2e}")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def run_peft_logits(base: Path, adapter: Path, tokens: Path, out: Path) -> None:
    """The logits [B, T, V] PEFT gives with `adapter` on `base` for the ids in `tokens` [B, T] (.npy)."""
    model = load_peft(load_hf(base), adapter)
    ids = torch.from_numpy(np.load(tokens).astype(np.int64))
    np.savez(out, logits=model(ids).logits.float().numpy())


def trl_dpo(policy, ref_model, beta: float, loss_type: str, label_smoothing: float):
    """A DPOTrainer with just what its `_compute_loss` reads, set as its __init__ sets it (TRL 1.16.0): the loss,
    the log-probabilities (the fused LM head it patches onto the models) and the metrics are TRL's own code."""
    from collections import defaultdict

    from accelerate import Accelerator
    from peft import PeftModel
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    args = DPOConfig(report_to="none", use_cpu=True, bf16=False, beta=beta, loss_type=[loss_type],
                     label_smoothing=label_smoothing)  # writes nothing: no output_dir is made until training
    trainer = DPOTrainer.__new__(DPOTrainer)
    trainer.args, trainer.model, trainer.ref_model = args, policy, ref_model
    trainer.accelerator = Accelerator(cpu=True)
    trainer.beta, trainer.precompute_ref_logps = args.beta, args.precompute_ref_log_probs
    trainer.loss_types, trainer.loss_weights = args.loss_type, args.loss_weights or [1.0] * len(args.loss_type)
    trainer.ld_alpha, trainer.f_divergence_type = args.ld_alpha, args.f_divergence_type
    trainer.f_alpha_divergence_coef = args.f_alpha_divergence_coef
    trainer.label_smoothing, trainer.use_weighting = args.label_smoothing, args.use_weighting
    trainer.aux_loss_enabled, trainer._total_train_tokens, trainer._tp_size = False, 0, 1
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
    add_fused_lm_head(policy.get_base_model() if isinstance(policy, PeftModel) else policy, outputs=outputs)
    if ref_model is not None:
        add_fused_lm_head(ref_model)

    def step(inputs: dict) -> tuple[float, dict]:
        trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        loss = trainer._compute_loss(policy, inputs, return_outputs=False)
        return float(loss), {k: v[0] for k, v in trainer._metrics["eval"].items()}

    return step


def run_dpo_reference(model_dir: Path, ref_dir: Path | None, adapter: Path | None, batch: Path, out: Path,
                      beta: float, loss_type: str, label_smoothing: float) -> None:
    """TRL's DPO loss and logged metrics on a batch of preference pairs. batch.npz: `tokens` int [P, 2, T] (chosen,
    rejected) and `weights` [P, 2, T], 1 where the next token (the target) is a completion token. Rows are right-padded
    (attention through each row's last completion token, as TRL's collator). The policy is the model (with the adapter
    through PEFT); the reference is --ref-model, else the policy with its adapter disabled, else the model again.
    TRL's `_compute_loss` runs on the whole batch (the means it logs, `loss`) and on each pair (the per-pair arrays);
    a plain transformers forward (log_softmax of the logits) must agree with it."""
    import trl

    with np.load(batch) as z:
        tokens, weights = z["tokens"].astype(np.int64), z["weights"].astype(np.float32)
    n_pairs, _, length = tokens.shape
    if tokens.shape != weights.shape or tokens.shape[1] != 2:
        raise SystemExit(f"{batch}: tokens {tokens.shape} and weights {weights.shape} must both be [P, 2, T]")
    if np.any(weights[..., -1] != 0) or not np.all(np.isin(weights, (0, 1))) or np.any(weights.sum(-1) == 0):
        raise SystemExit(f"{batch}: weights must be 0/1, 0 at the last position, with a completion token per row")
    ids = torch.from_numpy(np.concatenate([tokens[:, 0], tokens[:, 1]]))  # [2P, T]: the chosen rows, then the rejected
    shift = torch.from_numpy(np.concatenate([weights[:, 0], weights[:, 1]]))  # [2P, T]
    completion = torch.zeros_like(ids)
    completion[:, 1:] = shift[:, :-1].long()
    last = length - 1 - completion.flip(1).argmax(1)  # each row's last completion token
    attention = (torch.arange(length)[None] <= last[:, None]).long()
    inputs = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}

    policy = load_hf(model_dir)
    if adapter is not None:
        policy = load_peft(policy, adapter)
    ref_model = load_hf(ref_dir) if ref_dir is not None else None if adapter is not None else load_hf(model_dir)

    def plain_logps(model) -> torch.Tensor:  # [2P]
        logits = model(input_ids=ids, attention_mask=attention).logits.float()
        per_token = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        return (per_token * shift[:, :-1]).sum(1)

    pol = plain_logps(policy)
    if ref_model is not None:
        ref = plain_logps(ref_model)
    else:
        with policy.disable_adapter():
            ref = plain_logps(policy)
    step = trl_dpo(policy, ref_model, beta, loss_type, label_smoothing)
    loss, means = step(inputs)
    pairs = [step({k: v[[p, n_pairs + p]] for k, v in inputs.items()}) for p in range(n_pairs)]

    chosen_ratio, rejected_ratio = (pol - ref).chunk(2)
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":  # TRL 1.16.0 DPOTrainer._compute_loss: `-F.logsigmoid(self.beta * delta_score)`
        plain_losses = -torch.nn.functional.logsigmoid(beta * delta)
    else:  # ipo, TRL 1.16.0: the log-ratios averaged over each row's completion tokens
        n_chosen, n_rejected = completion.sum(1).chunk(2)
        plain_losses = (chosen_ratio / n_chosen - rejected_ratio / n_rejected - 1 / (2 * beta)) ** 2
    result = {
        "policy_chosen_logps": np.array([m["logps/chosen"] for _, m in pairs]),
        "policy_rejected_logps": np.array([m["logps/rejected"] for _, m in pairs]),
        "ref_chosen_logps": ref.chunk(2)[0].numpy(), "ref_rejected_logps": ref.chunk(2)[1].numpy(),
        "chosen_rewards": np.array([m["rewards/chosen"] for _, m in pairs]),
        "rejected_rewards": np.array([m["rewards/rejected"] for _, m in pairs]),
        "reward_accuracies": np.array([m["rewards/accuracies"] for _, m in pairs]),
        "reward_margins": np.array([m["rewards/margins"] for _, m in pairs]),
        "losses": np.array([loss for loss, _ in pairs]), "loss": np.array(loss),
        **{name.replace("/", "_"): np.array(means[name]) for name in
           ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected")},
    }
    if loss_type == "sigmoid":  # conservative DPO: TRL < 1's sigmoid with label smoothing (1.16.0 ignores it there)
        smoothed = (-torch.nn.functional.logsigmoid(beta * delta) * (1 - label_smoothing)
                    - torch.nn.functional.logsigmoid(-beta * delta) * label_smoothing)
        result.update(losses_label_smoothed=smoothed.numpy(), loss_label_smoothed=smoothed.mean().numpy())
    plain = {"policy_chosen_logps": pol.chunk(2)[0], "policy_rejected_logps": pol.chunk(2)[1],
             "chosen_rewards": beta * chosen_ratio, "rejected_rewards": beta * rejected_ratio,
             "reward_margins": beta * delta, "losses": plain_losses}
    for name, value in plain.items():  # TRL's fused head and per-pair batches vs one plain forward
        np.testing.assert_allclose(result[name], value.numpy(), rtol=1e-5, atol=1e-4, err_msg=name)
    np.testing.assert_allclose(result["loss"], result["losses"].mean(), rtol=1e-5, atol=1e-6)
    for key, per_pair in (("rewards_chosen", "chosen_rewards"), ("rewards_rejected", "rejected_rewards"),
                          ("rewards_accuracies", "reward_accuracies"), ("rewards_margins", "reward_margins"),
                          ("logps_chosen", "policy_chosen_logps"), ("logps_rejected", "policy_rejected_logps")):
        np.testing.assert_allclose(result[key], result[per_pair].mean(), rtol=1e-5, atol=1e-5, err_msg=key)
    result = {k: np.asarray(v, np.float32) for k, v in result.items()}
    np.savez(out, **result, beta=np.float32(beta), label_smoothing=np.float32(label_smoothing),
             loss_type=np.array(loss_type), trl_version=np.array(trl.__version__))
    print(f"DPO ({loss_type}, beta {beta}, label smoothing {label_smoothing}, TRL {trl.__version__}): loss {loss:.6f}, "
          + ", ".join(f"{k} {float(result[k]):.4f}" for k in ("rewards_chosen", "rewards_rejected",
                                                               "rewards_accuracies", "rewards_margins")))


# ----- TRL's GRPO -------------------------------------------------------------------------

PEFT_LLAMA = FIXTURES.parent / "hf_peft" / "llama"
GRPO_G, GRPO_PROMPT_LEN, GRPO_C, GRPO_EOS, GRPO_PAD = 4, 5, 6, 2, 0  # two prompts of G completions: B = 8 rows
# each row's completion length (the eos included) and whether it ends with the eos; the others are truncated
# (length C, last token not the eos). Row 2 ends with the eos exactly at C, row 5 is the eos alone.
GRPO_LENGTHS = (3, 6, 6, 4, 6, 1, 5, 6)
GRPO_ENDS_EOS = (True, False, True, True, False, True, True, False)
GRPO_REWARD_FUNCS, GRPO_REWARD_WEIGHTS = ("correct", "format"), (1.0, 0.5)
_NAN = float("nan")  # a reward function that returned None for that row
GRPO_REWARDS = ((1.0, 0.5), (0.0, _NAN), (_NAN, 1.0), (1.0, 0.25),  # weighted sums 1.25, 0, 0.5, 1.125
                (1.0, 0.0), (1.0, 0.0), (_NAN, 2.0), (1.0, 0.0))    # all 1.0: the second group's std is 0
GRPO_UNSCORABLE_ROW = 1  # `rewards_unscorable`: GRPO_REWARDS with every function None for this row
GRPO_TEMPERATURE, GRPO_LOGP_NOISE = 0.7, 0.3
GRPO_BASE = dict(loss_type="grpo", beta=0.04, epsilon=0.2, epsilon_high=0.28, temperature=GRPO_TEMPERATURE,
                 importance_sampling_level="token", scale_rewards="group", mask_truncated_completions=False,
                 use_bias_correction_kl=True, use_old_logps=True, rewards="rewards")
GRPO_SETTINGS = {
    "grpo": {}, "bnpo": dict(loss_type="bnpo"), "dr_grpo": dict(loss_type="dr_grpo"), "dapo": dict(loss_type="dapo"),
    "gspo": dict(importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),  # as the GSPO paper
    "scale_batch": dict(scale_rewards="batch"), "scale_none": dict(scale_rewards="none"),
    "mask_truncated": dict(mask_truncated_completions=True),
    "kl_uncorrected": dict(use_bias_correction_kl=False),
    "unscorable": dict(rewards="rewards_unscorable"),
    "on_policy": dict(beta=0.0, use_old_logps=False),  # ratios 1: GRPO's loss is then minus the mean advantage
    "on_policy_dapo": dict(beta=0.0, use_old_logps=False, loss_type="dapo"),
}


def grpo_tokenizer(vocab_size: int):
    """Word-level: id i is the word `w<i>` (0 `<pad>`, 1 `<s>`, 2 `</s>`), so a prompt's text is its ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def trl_grpo(model_dir: Path, adapter: Path, setting: dict, batch: dict, rewards, workdir: Path):
    """TRL 1.16.0's GRPOTrainer, built by its own constructor on CPU, with only its generation replaced: it returns
    the batch's completions. The policy is `adapter` on `model_dir`, given to the trainer as a new LoRA (the base and
    `peft_config`) whose weights are then set to the adapter's, so that the reference is the base (adapter disabled)
    as in a LoRA run; a PeftModel with a trained adapter would make TRL's reference a frozen copy of that adapter.
    The reward functions `correct` and `format` return `rewards` [B, F] (None where NaN)."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file
    from trl import GRPOConfig, GRPOTrainer

    prompt_ids, completion_ids, lengths = batch["prompt_ids"], batch["completion_ids"], batch["completion_lengths"]
    completion_lists = [row[:n].tolist() for row, n in zip(completion_ids, lengths)]
    tokenizer = grpo_tokenizer(AutoConfig.from_pretrained(model_dir).vocab_size)
    texts = [" ".join(f"w{i}" for i in row) for row in prompt_ids[::GRPO_G]]

    def reward_func(name: str, column: np.ndarray):
        def func(prompts, completions, completion_ids, **kwargs):  # TRL's keywords
            if completion_ids != completion_lists:
                raise SystemExit(f"reward {name}: TRL passed other completions than the batch's")
            return [None if np.isnan(r) else float(r) for r in column]

        func.__name__ = name
        return func

    args = GRPOConfig(
        output_dir=str(workdir), report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
        disable_dropout=True, seed=0, per_device_train_batch_size=len(prompt_ids), num_generations=GRPO_G,
        max_completion_length=completion_ids.shape[1], reward_weights=list(map(float, batch["reward_weights"])),
        num_iterations=2 if setting["use_old_logps"] else 1,  # TRL keeps the old log-probabilities when > 1
        **{k: setting[k] for k in ("loss_type", "beta", "epsilon", "epsilon_high", "temperature",
                                   "importance_sampling_level", "scale_rewards", "mask_truncated_completions",
                                   "use_bias_correction_kl")})
    trainer = GRPOTrainer(
        model=load_hf(model_dir), reward_funcs=[reward_func(n, rewards[:, i]) for i, n in enumerate(GRPO_REWARD_FUNCS)],
        args=args, train_dataset=Dataset.from_dict({"prompt": texts}), processing_class=tokenizer,
        peft_config=LoraConfig.from_pretrained(adapter))
    saved = load_file(adapter / "adapter_model.safetensors")
    set_peft_model_state_dict(trainer.model, saved)
    held = get_peft_model_state_dict(trainer.model)
    if held.keys() != saved.keys() or any(not torch.equal(saved[k], held[k]) for k in saved):
        raise SystemExit(f"{adapter}: the trainer's LoRA does not hold the adapter as saved")
    if trainer.eos_token_ids != [GRPO_EOS] or tokenizer.pad_token_id != GRPO_PAD:
        raise SystemExit(f"TRL's eos ids {trainer.eos_token_ids}, pad id {tokenizer.pad_token_id}")

    def generate_single_turn(prompt_ids_list, images, multimodal_fields, num_generations, has_tool_images=False):
        if prompt_ids_list != prompt_ids.tolist() or num_generations != GRPO_G:
            raise SystemExit(f"TRL tokenized the prompts as {prompt_ids_list}, not {prompt_ids.tolist()}")
        return [list(c) for c in completion_lists], None

    trainer._generate_single_turn = generate_single_turn
    trainer.current_gradient_accumulation_steps = 1  # as the training loop sets it, one micro-batch a step
    trainer.model.train()  # the metrics of a training step ("train"); no dropout (LoRA's is 0, disable_dropout)
    return trainer, [{"prompt": texts[row // GRPO_G]} for row in range(len(prompt_ids))]


def grpo_attention(batch: dict) -> torch.Tensor:
    """[B, P + C]: every prompt token, then each row's completion tokens (right padding off)."""
    prompt, lengths = batch["prompt_ids"], torch.from_numpy(batch["completion_lengths"]).long()
    completion = (torch.arange(batch["completion_ids"].shape[1])[None] < lengths[:, None]).long()
    return torch.cat([torch.ones(prompt.shape, dtype=torch.long), completion], dim=1)


def make_grpo_batch(model_dir: Path, adapter: Path, workdir: Path) -> dict:
    """The fixed batch (see run_grpo_reference), seeded; `old_logps` are TRL's own per-token log-probabilities of
    the policy at GRPO_TEMPERATURE plus N(0, GRPO_LOGP_NOISE^2) noise on the completion tokens (0 past them)."""
    rng = np.random.default_rng(zlib.crc32(b"grpo-batch"))
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    n_prompts, rows = 2, len(GRPO_LENGTHS)
    prompts = rng.integers(3, vocab, (n_prompts, GRPO_PROMPT_LEN))
    completion_ids = np.full((rows, GRPO_C), GRPO_PAD)
    for row, (n, eos) in enumerate(zip(GRPO_LENGTHS, GRPO_ENDS_EOS)):
        completion_ids[row, :n] = rng.integers(3, vocab, n)
        if eos:
            completion_ids[row, n - 1] = GRPO_EOS
    rewards = np.array(GRPO_REWARDS, np.float32)
    unscorable = rewards.copy()
    unscorable[GRPO_UNSCORABLE_ROW] = np.nan
    batch = {"prompt_ids": np.repeat(prompts, GRPO_G, axis=0).astype(np.int32),
             "completion_ids": completion_ids.astype(np.int32),
             "completion_lengths": np.array(GRPO_LENGTHS, np.int32), "rewards": rewards,
             "rewards_unscorable": unscorable, "reward_weights": np.array(GRPO_REWARD_WEIGHTS, np.float32)}
    trainer, _ = trl_grpo(model_dir, adapter, GRPO_BASE, batch, rewards, workdir)
    ids = torch.from_numpy(np.concatenate([batch["prompt_ids"], completion_ids], 1)).long()
    logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, grpo_attention(batch), GRPO_C)
    mask = grpo_attention(batch)[:, GRPO_PROMPT_LEN:].numpy()
    noise_rng = np.random.default_rng(zlib.crc32(b"grpo-old-logps-9"))  # a seed under which some ratios clip on
    noise = noise_rng.normal(0.0, GRPO_LOGP_NOISE, logps.shape) * mask  # both sides, per token and per sequence
    batch["old_logps"] = ((logps.numpy() + noise) * mask).astype(np.float32)
    batch.update(num_generations=np.int32(GRPO_G), temperature=np.float32(GRPO_TEMPERATURE),
                 eos_id=np.int32(GRPO_EOS), pad_id=np.int32(GRPO_PAD), reward_funcs=np.array(GRPO_REWARD_FUNCS))
    return batch


def plain_grpo(setting: dict, rewards, weights, logps, old, ref, mask, max_completion_length: int) -> dict:
    """GRPO as the formulas in TRL 1.16.0's docs and code state it, in float64, to check the trainer's numbers."""
    r = np.nansum(rewards * weights, axis=1)
    r[np.isnan(rewards).all(axis=1)] = np.nan  # unscorable: out of the baseline, advantage 0
    grouped = r.reshape(-1, GRPO_G)
    mean = np.repeat(np.nanmean(grouped, 1), GRPO_G)
    std = (np.full_like(r, np.nanstd(r, ddof=1)) if setting["scale_rewards"] == "batch"
           else np.repeat(np.nanstd(grouped, 1, ddof=1), GRPO_G))
    advantages = r - mean if setting["scale_rewards"] == "none" else (r - mean) / (std + 1e-4)
    advantages = np.nan_to_num(advantages, nan=0.0)
    old = logps if old is None else old
    log_ratio = logps - old
    if setting["importance_sampling_level"] == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / np.maximum(mask.sum(-1), 1))[:, None]
    ratio, a = np.exp(log_ratio), advantages[:, None]
    clipped = np.clip(ratio, 1 - setting["epsilon"], 1 + setting["epsilon_high"])
    per_token = -np.minimum(ratio * a, clipped * a)
    metrics = {}
    if setting["beta"] != 0:
        kl = np.exp(ref - logps) - (ref - logps) - 1
        kl = kl * ratio if setting["use_bias_correction_kl"] else kl
        per_token = per_token + setting["beta"] * kl
        metrics["kl"] = (kl * mask).sum() / mask.sum()
    per_token = per_token * mask
    loss = {"grpo": (per_token.sum(-1) / np.maximum(mask.sum(-1), 1)).mean(),
            "bnpo": per_token.sum() / mask.sum(), "dapo": per_token.sum() / mask.sum(),
            "dr_grpo": per_token.sum() / (len(mask) * max_completion_length)}[setting["loss_type"]]
    low = np.broadcast_to((ratio < 1 - setting["epsilon"]) & (a < 0), mask.shape) * mask
    high = np.broadcast_to((ratio > 1 + setting["epsilon_high"]) & (a > 0), mask.shape) * mask
    if setting["importance_sampling_level"] == "token":
        metrics.update({"clip_ratio/low_mean": low.sum() / mask.sum(), "clip_ratio/high_mean": high.sum() / mask.sum()})
    return {"advantages": advantages, "loss": loss, **metrics}


def run_grpo_reference(model_dir: Path, adapter: Path, batch_path: Path | None, out: Path) -> None:
    """TRL's GRPO on one fixed batch, per setting in GRPO_SETTINGS (GRPO_BASE with one change), into `out`.

    `batch.npz` (made here unless --batch names one; B = 8 rows, P = 5, C = 6, F = 2 reward functions):
    `prompt_ids` int32 [B, P] (a group's G = `num_generations` rows adjacent and sharing their prompt, no padding),
    `completion_ids` int32 [B, C] right-padded with `pad_id`, `completion_lengths` int32 [B] (the eos `eos_id`
    counted; a completion of length C that does not end with it is truncated), `rewards` float32 [B, F] of the
    reward functions `reward_funcs` (NaN: it returned None), `rewards_unscorable` the same with one row all NaN,
    `reward_weights` float32 [F], `old_logps` float32 [B, C] (see make_grpo_batch) and their `temperature`.

    `<name>.npz`: `loss`, what `_compute_loss` returns on the whole batch (one micro-batch, gradient accumulation 1,
    one process); `advantages` [B]; `per_token_logps` and `entropies` [B, C] of the policy at the temperature, and
    `ref_per_token_logps` [B, C] of the reference when beta != 0, all 0 where `completion_mask` [B, C] (TRL's, after
    mask_truncated_completions) is; `num_items_in_batch`, that mask's sum; `rewards`, the batch's array the setting
    uses; `metrics`, a JSON string of every metric TRL logs for the step under its own name (`reward`,
    `rewards/correct/mean`, `completions/clipped_ratio`, `kl`, `entropy`, `clip_ratio/low_mean`, ...); the setting
    (`loss_type`, `beta`, `epsilon`, `epsilon_high`, `temperature`, `importance_sampling_level`, `scale_rewards`,
    `mask_truncated_completions`, `use_bias_correction_kl`, `use_old_logps`, `max_completion_length`,
    `num_generations`, `num_iterations`, `reward_weights`) and `trl_version`.

    TRL's own `_generate_and_score_completions` (rewards, advantages, the reward and length metrics, the reference's
    log-probabilities) and `_compute_loss` run on the batch, the old log-probabilities replaced by the batch's
    `old_logps` where the setting uses them; a plain transformers forward (log_softmax(logits / T)) and the formulas
    (plain_grpo) must agree with them."""
    import tempfile

    import trl

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        if batch_path is None:
            batch = make_grpo_batch(model_dir, adapter, Path(workdir))
            np.savez(out / "batch.npz", **batch)
        else:
            with np.load(batch_path) as z:
                batch = dict(z)
        rows, C = batch["completion_ids"].shape
        P = batch["prompt_ids"].shape[1]
        ids = torch.from_numpy(np.concatenate([batch["prompt_ids"], batch["completion_ids"]], 1)).long()
        truncated = ~np.array([row[n - 1] == GRPO_EOS for row, n in
                               zip(batch["completion_ids"], batch["completion_lengths"])])
        policy = load_peft(load_hf(model_dir), adapter)
        summary = []
        for name, change in GRPO_SETTINGS.items():
            setting = dict(GRPO_BASE, **change)
            assert np.float32(setting["temperature"]) == batch["temperature"], "the old log-probabilities' temperature"
            rewards = batch[setting["rewards"]]
            trainer, inputs = trl_grpo(model_dir, adapter, setting, batch, rewards, Path(workdir))
            calls = []
            spied = trainer._get_per_token_logps_and_entropies

            def spy(*args, **kwargs):
                calls.append(spied(*args, **kwargs))
                return calls[-1]

            trainer._get_per_token_logps_and_entropies = spy
            scored = trainer._generate_and_score_completions(inputs)
            if setting["use_old_logps"] != ("old_per_token_logps" in scored):
                raise SystemExit(f"{name}: TRL's old log-probabilities are not as the setting says")
            trl_old = scored.pop("old_per_token_logps", None)
            if setting["use_old_logps"]:
                scored["old_per_token_logps"] = torch.from_numpy(batch["old_logps"])
            calls.clear()
            loss = trainer._compute_loss(trainer.model, scored)
            (logps, entropies, _), = calls
            metrics = {k: float(v[0]) for k, v in trainer._metrics["train"].items()}
            assert all(len(v) == 1 for v in trainer._metrics["train"].values()), trainer._metrics["train"]
            mask = scored["completion_mask"]
            attention = torch.cat([scored["prompt_mask"], mask], 1)

            T = setting["temperature"]  # transformers' logits at the temperature, masked as TRL masks
            with torch.no_grad():
                logits = policy(input_ids=ids, attention_mask=attention).logits.float()[:, P - 1:-1] / T
                plain = logits.log_softmax(-1)
                with policy.disable_adapter():
                    plain_ref = (policy(input_ids=ids, attention_mask=attention).logits.float()[:, P - 1:-1] / T
                                 ).log_softmax(-1).gather(-1, ids[:, P:, None])[..., 0] * mask
            plain_logps = plain.gather(-1, ids[:, P:, None])[..., 0] * mask
            plain_entropy = -(plain.exp() * plain).sum(-1) * mask
            np.testing.assert_allclose(logps.numpy(), plain_logps.numpy(), atol=1e-5, err_msg=f"{name}: logps")
            np.testing.assert_allclose(entropies.numpy(), plain_entropy.numpy(), atol=1e-5, err_msg=f"{name}: entropy")
            if trl_old is not None:  # TRL's own old log-probabilities: the policy's, before the replacement
                np.testing.assert_allclose(trl_old.numpy(), logps.numpy(), atol=1e-6, err_msg=f"{name}: old logps")
            ref = scored.get("ref_per_token_logps")
            if (ref is not None) != (setting["beta"] != 0):
                raise SystemExit(f"{name}: TRL's reference log-probabilities are not as beta says")
            if ref is not None:
                np.testing.assert_allclose(ref.numpy(), plain_ref.numpy(), atol=1e-5, err_msg=f"{name}: ref logps")

            m = mask.numpy().astype(np.float64)
            check = plain_grpo(setting, rewards.astype(np.float64), batch["reward_weights"].astype(np.float64),
                               logps.double().numpy(), batch["old_logps"].astype(np.float64)
                               if setting["use_old_logps"] else None,
                               None if ref is None else ref.double().numpy(), m, C)
            np.testing.assert_allclose(scored["advantages"].numpy(), check["advantages"], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name}: advantages")
            np.testing.assert_allclose(float(loss), check["loss"], rtol=1e-5, atol=1e-7, err_msg=f"{name}: loss")
            for key in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean"):
                if key in check:
                    np.testing.assert_allclose(metrics[key], check[key], rtol=1e-5, atol=1e-7, err_msg=f"{name}: {key}")
            lengths = batch["completion_lengths"]
            expected = {"completions/mean_length": lengths.mean(), "completions/clipped_ratio": truncated.mean(),
                        "completions/mean_terminated_length": lengths[~truncated].mean(),
                        "num_tokens": batch["prompt_ids"].size + lengths.sum()}
            for key, value in expected.items():
                np.testing.assert_allclose(metrics[key], value, rtol=1e-6, err_msg=f"{name}: {key}")
            if setting["use_old_logps"]:
                assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0, metrics

            result = {
                "loss": np.float32(loss), "advantages": scored["advantages"].numpy(),
                "per_token_logps": logps.numpy(), "entropies": entropies.numpy(),
                "completion_mask": mask.numpy().astype(np.int32), "rewards": rewards,
                "num_items_in_batch": np.int32(scored["num_items_in_batch"]),
                "metrics": np.array(json.dumps(metrics, sort_keys=True)),
                "max_completion_length": np.int32(C), "num_generations": np.int32(GRPO_G),
                "num_iterations": np.int32(trainer.num_iterations),
                "reward_weights": batch["reward_weights"], "trl_version": np.array(trl.__version__),
                **{k: np.array(v) for k, v in setting.items() if k != "rewards"},
            }
            if ref is not None:
                result["ref_per_token_logps"] = ref.numpy()
            np.savez(out / f"{name}.npz", **{k: np.asarray(v) for k, v in result.items()})
            summary.append(f"{name}: loss {float(loss):.6f}  reward {metrics['reward']:.4f}  "
                           f"frac_zero_std {metrics['frac_reward_zero_std']:.2f}  entropy {metrics['entropy']:.4f}  "
                           + ("" if ref is None else f"kl {metrics['kl']:.5f}  ")
                           + f"clip low/high {metrics['clip_ratio/low_mean']:.3f}/"
                           f"{metrics['clip_ratio/high_mean']:.3f}")
    print(f"TRL {trl.__version__} GRPO on {rows} rows ({out}):")
    for name, line in zip(GRPO_SETTINGS, summary):
        with np.load(out / f"{name}.npz") as z:
            json.loads(str(z["metrics"]))
        print("  " + line)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", choices=("all", "counts", "checkpoints", "reference", "chat",
                                                    "chat-wide", "chat-reference", "peft", "peft-logits",
                                                    "dpo-reference", "grpo-reference", "mtp"),
                        default="all")
    parser.add_argument("directories", nargs="*", type=Path, help="reference: checkpoint directories")
    parser.add_argument("--out", type=Path, default=FIXTURES)
    parser.add_argument("--only", nargs="*", help="checkpoint names to (re)make")
    parser.add_argument("--base", type=Path, help="peft-logits: the base checkpoint")
    parser.add_argument("--adapter", type=Path,
                        help="peft-logits, dpo-reference, grpo-reference: a PEFT adapter directory")
    parser.add_argument("--tokens", type=Path, help="peft-logits: token ids [B, T] (.npy)")
    parser.add_argument("--model", type=Path, help="dpo-reference, grpo-reference: the policy's checkpoint")
    parser.add_argument("--ref-model", type=Path, help="dpo-reference: the reference's checkpoint")
    parser.add_argument("--batch", type=Path, help="dpo-reference: tokens and weights [P, 2, T] (.npz); "
                        "grpo-reference: a batch.npz to use instead of making one")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--loss-type", choices=("sigmoid", "ipo"), default="sigmoid")
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.what == "peft":
        make_peft_fixture(FIXTURES.parent / "hf_peft" if args.out == FIXTURES else args.out)
        return
    if args.what in ("peft-logits", "dpo-reference") and args.out == FIXTURES:
        parser.error(f"{args.what} needs --out FILE.npz")
    if args.what == "peft-logits":
        if None in (args.base, args.adapter, args.tokens):
            parser.error("peft-logits needs --base, --adapter and --tokens")
        run_peft_logits(args.base, args.adapter, args.tokens, args.out)
        return
    if args.what == "dpo-reference":
        if None in (args.model, args.batch):
            parser.error("dpo-reference needs --model and --batch")
        run_dpo_reference(args.model, args.ref_model, args.adapter, args.batch, args.out, args.beta,
                          args.loss_type, args.label_smoothing)
        return
    if args.what == "grpo-reference":
        run_grpo_reference(args.model or PEFT_LLAMA / "base", args.adapter or PEFT_LLAMA / "adapter", args.batch,
                           PEFT_LLAMA / "grpo" if args.out == FIXTURES else args.out)
        return
    if args.what == "reference":
        run_reference(args.directories)
        return
    if args.what == "chat-reference":
        run_chat_reference(args.directories)
        return
    if args.what in ("chat", "chat-wide"):
        name = "hf_chat" if args.what == "chat" else "hf_chat_wide"
        make_chat_fixture(FIXTURES.parent / name if args.out == FIXTURES else args.out, wide=args.what == "chat-wide")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "mtp":
        make_mtp_fixture(args.out)
        return
    if args.what in ("all", "counts"):
        make_counts(args.out)
    if args.what in ("all", "checkpoints"):
        make_checkpoints(args.out, args.only)


if __name__ == "__main__":
    sys.exit(main())
