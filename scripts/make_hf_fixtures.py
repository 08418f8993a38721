"""Golden fixtures for the Hugging Face conversion tests, made with transformers (PyTorch, CPU).

Runs in its own Python 3.11 environment (torch is never a dependency of modern_jax):

    /root/.pyenv/versions/3.11.7/bin/python -m venv .hfvenv
    .hfvenv/bin/pip install torch==2.13.0 transformers safetensors
    .hfvenv/bin/python scripts/make_hf_fixtures.py            # everything
    .hfvenv/bin/python scripts/make_hf_fixtures.py counts     # param_counts.json only
    .hfvenv/bin/python scripts/make_hf_fixtures.py checkpoints [--out DIR] [--only NAME ...]
    .hfvenv/bin/python scripts/make_hf_fixtures.py reference DIR ...   # for the live test

Writes under tests/fixtures/hf/:
- `param_counts.json`: for each config (tiny ones and the published sizes of the presets),
  the config dict and transformers' exact parameter count (model built on the `meta`
  device, tied weights counted once).
- `<name>/`: a tiny randomly initialised checkpoint per family as transformers saves it
  (`config.json`, safetensors), and `reference.npz` with the prompt tokens, the fp32
  logits of a forward pass over them, 32 greedily generated tokens (KV cache) and the
  logits each was chosen from.

The tests read only these files, so the default test run needs neither torch nor
transformers. `tests/test_convert_live.py` runs the same comparisons live, through this
script, when torch and transformers import (or MODERN_JAX_HF_PYTHON names an interpreter
that has them, e.g. .hfvenv/bin/python).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import zlib
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

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


def param_count(config: dict) -> tuple[int, str]:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(config))
    return sum(p.numel() for p in model.parameters()), type(model).__name__


def make_counts(out: Path) -> None:
    entries = []
    for group, configs in (("published", PUBLISHED), ("tiny", TINY)):
        for name, config in configs.items():
            count, cls = param_count(config)
            entries.append({"name": name, "group": group, "model_class": cls, "count": count, "config": config})
            print(f"{name:24s} {cls:28s} {count:>16,d}")
    payload = {"transformers": transformers.__version__, "torch": torch.__version__, "entries": entries}
    (out / "param_counts.json").write_text(json.dumps(payload, indent=1) + "\n")


# ----- tiny checkpoints ---------------------------------------------------------------

PROMPT_LEN, NEW_TOKENS, BATCH = 12, 32, 2


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights of O(1) effect so logits are well separated: matrices ~ N(0, 1/fan_in), vectors
    (norm scales, biases) perturbed by N(0, 0.1) around their init, embeddings ~ N(0, 1), or
    N(0, 0.25) when the head is tied (else a token's own embedding dominates its logits and
    greedy decoding only repeats it)."""
    g = torch.Generator().manual_seed(seed)
    embed_std = 0.25 if model.config.get_text_config().tie_word_embeddings else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.add_(0.1 * noise)
            elif "emb" in name or name.endswith(("wte.weight", "wpe.weight")):
                p.copy_(embed_std * noise)
            else:  # torch Linear [out, in]; GPT-2's Conv1D (c_attn, c_fc, c_proj) [in, out]
                p.copy_(noise / (p.shape[0] if ".c_" in name else p.shape[-1]) ** 0.5)


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


def make_checkpoint(name: str, config: dict, out: Path, seed: int, dtype=torch.float32) -> dict:
    """Save a tiny random model of `config` with its reference outputs; the first seed from `seed`
    whose greedy continuation never has its top two logits closer than MIN_MARGIN."""
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
        tokens = torch.randint(0, config["vocab_size"], (BATCH, PROMPT_LEN),
                               generator=torch.Generator().manual_seed(seed))
        logits = model(tokens).logits.float().numpy()
        generated, step_logits, margin = greedy(model, tokens, NEW_TOKENS)
        if margin >= MIN_MARGIN:
            break
    np.savez_compressed(directory / "reference.npz", tokens=tokens.numpy().astype(np.int32),
                        logits=logits.astype(np.float32), greedy=generated.astype(np.int32),
                        step_logits=step_logits.astype(np.float32))
    files = sorted(p.name for p in directory.iterdir())
    print(f"{name:22s} seed {seed:10d}  greedy margin {margin:.4f}  {files}")
    return {"name": name, "seed": seed, "dtype": str(dtype).removeprefix("torch."), "greedy_margin": margin,
            "files": files}


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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", choices=("all", "counts", "checkpoints", "reference"), default="all")
    parser.add_argument("directories", nargs="*", type=Path, help="reference: checkpoint directories")
    parser.add_argument("--out", type=Path, default=FIXTURES)
    parser.add_argument("--only", nargs="*", help="checkpoint names to (re)make")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.what == "reference":
        run_reference(args.directories)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what in ("all", "counts"):
        make_counts(args.out)
    if args.what in ("all", "checkpoints"):
        make_checkpoints(args.out, args.only)


if __name__ == "__main__":
    sys.exit(main())
