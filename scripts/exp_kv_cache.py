"""KV-cache and parameter tables from the accounting functions, for every preset.

Also MHA / GQA / MQA / MLA variants of one model (Llama 3 8B's shape): parameters,
bf16 KV bytes per token, and the cache of one sequence at 8K / 32K / 128K tokens.

    uv run python scripts/exp_kv_cache.py [--out results/kv_cache]
"""

from __future__ import annotations

import argparse
import pathlib

from modern_jax.accounting import kv_cache_bytes, kv_cache_bytes_per_token, param_counts
from modern_jax.config import model_config_from_file
from modern_jax.configfile import load_config_file
from modern_jax.report import pyplot, save_figure, write_table

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
CONTEXTS = (8 * 1024, 32 * 1024, 128 * 1024)
GiB = 1024**3


def row(name, cfg):
    out = {"model": name, "params": param_counts(cfg)["total"], "kv_bytes_per_token": kv_cache_bytes_per_token(cfg)}
    for context in CONTEXTS:
        out[f"GiB@{context // 1024}K"] = kv_cache_bytes(cfg, context) / GiB
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/kv_cache")
    args = parser.parse_args()
    presets = [row(p.stem, model_config_from_file(p)) for p in sorted(CONFIGS.glob("*.yaml"))
               if isinstance(load_config_file(p).get("model", {}).get("vocab_size"), int)]  # skip data-sized vocabs
    print(write_table(presets, args.out, "presets", title="Presets (bf16 cache, one sequence)").read_text())

    base = model_config_from_file(CONFIGS / "llama3_8b.yaml")
    variants = [
        ("MHA (32 kv heads)", base.replace(n_kv_heads=32)),
        ("GQA (8 kv heads)", base),
        ("MQA (1 kv head)", base.replace(n_kv_heads=1)),
        ("MLA (d_c=512, d_R=64)", base.replace(attention_type="mla", n_kv_heads=None, mla_kv_rank=512,
                                               mla_q_rank=1536, mla_rope_dim=64, mla_nope_dim=128, mla_v_dim=128)),
        ("GQA + window 4096", base.replace(sliding_window=4096, attention_pattern="L")),
    ]
    rows = [row(name, cfg) for name, cfg in variants]
    print(write_table(rows, args.out, "variants", title="Llama-3-8B shape, attention variants").read_text())
    plt = pyplot()
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(15, 5))
    x = np.arange(len(rows))
    for i, context in enumerate(CONTEXTS):
        axes[0].bar(x + (i - 1) * 0.27, [r[f"GiB@{context // 1024}K"] for r in rows], 0.27,
                    label=f"{context // 1024}K tokens")
    axes[0].set_xticks(x, [r["model"] for r in rows], rotation=20, fontsize=8)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("KV cache per sequence (GiB, bf16)")
    axes[0].legend()
    axes[1].barh([r["model"] for r in presets], [r["kv_bytes_per_token"] / 1024 for r in presets])
    axes[1].set_xscale("log")
    axes[1].set_xlabel("KV cache per token (KiB, bf16)")
    axes[1].tick_params(axis="y", labelsize=7)
    save_figure(fig, f"{args.out}/kv_cache.png")


if __name__ == "__main__":
    main()
