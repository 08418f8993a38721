"""`modern-jax info`: parameters, KV-cache bytes and FLOPs of a config, without weights.

    modern-jax info --config configs/llama3_8b.yaml [model.n_layers=4 ...] [--context 8192]
    modern-jax info --hf-config path/to/config.json
"""

from __future__ import annotations

import pathlib

from modern_jax.cli.shared import _check_flags, _overrides, _positive


def add_parser(subparsers) -> None:
    info = subparsers.add_parser("info", help="parameters, KV-cache bytes and FLOPs of a config, without weights")
    info.add_argument("--config", help="a YAML config with a model: section")
    info.add_argument("--hf-config", help="a Hugging Face config.json")
    info.add_argument("--context", type=int, help="context length for the KV-cache total (default: max positions)")
    info.add_argument("--seq-len", type=int, help="training sequence length for the FLOPs (default: min(context, 4096))")
    info.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    _overrides(info, "model.n_layers=4")
    info.set_defaults(func=run)


def run(args) -> None:
    from modern_jax.accounting import (flops_per_token, format_bytes, kv_cache_bytes, kv_cache_bytes_per_token,
                                       param_counts)

    cfg = _load_model_config(args)
    counts = param_counts(cfg)
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[args.kv_dtype]
    print(f"parameters: {counts['total']}")
    if cfg.ffn_type == "moe":
        print(f"active parameters: {counts['active']}")
        print(f"routed experts per token: {cfg.experts_per_token} of {cfg.n_experts}"
              + (f", plus {cfg.n_shared_experts} shared" if cfg.n_shared_experts else ""))
    print(f"embedding parameters: {counts['embedding']}")
    print(f"head parameters: {counts['head']}" + (" (tied to the embedding)" if cfg.tie_embeddings else ""))
    print(f"non-embedding parameters: {counts['total'] - counts['embedding']}")
    runs, start = [], 0
    blocks = counts["per_block"]
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[start]:
            runs.append(f"layers {start}-{i - 1}: {blocks[start]}" if i - 1 > start else f"layer {start}: {blocks[start]}")
            start = i
    print("parameters per block: " + "; ".join(runs))
    if cfg.mtp_depth:
        print(f"multi-token-prediction parameters ({cfg.mtp_depth} modules): {counts['mtp']}")
    per_token = kv_cache_bytes_per_token(cfg, dtype_bytes)
    print(f"kv cache per token ({args.kv_dtype}): {per_token} ({format_bytes(per_token)})")
    context = args.context or cfg.max_position_embeddings
    total = kv_cache_bytes(cfg, context, dtype_bytes)
    print(f"kv cache at {context} tokens: {total} ({format_bytes(total)}) per sequence")
    seq = args.seq_len or min(context, 4096)
    flops = flops_per_token(cfg, seq)
    print(f"training flops per token at seq_len {seq}: {flops['total']:.4e} "
          f"(6N = {flops['weights']:.4e}, attention = {flops['attention']:.4e})")


def _load_model_config(args):
    from modern_jax.config import ModelConfig, model_config_from_file
    from modern_jax.configfile import apply_overrides, read_json

    _check_flags(args, _positive("--context"), _positive("--seq-len"))
    if args.hf_config and args.config:
        raise ValueError("give one of --config FILE or --hf-config config.json, not both")
    if args.hf_config:
        from modern_jax.convert.hf_config import config_from_hf

        path = pathlib.Path(args.hf_config)
        if path.is_dir() and (path / "config.json").is_file():
            path = path / "config.json"
        hf = read_json(path)
        try:
            cfg = config_from_hf(hf)
        except (ValueError, TypeError) as e:  # TypeError: a value of a type no family default has
            raise ValueError(f"{path}: {e}") from None
        raw = apply_overrides({"model": cfg.to_dict()}, args.overrides, sections=("model",))
        return ModelConfig.from_dict(raw["model"])
    if not args.config:
        raise ValueError("give --config FILE (a configs/*.yaml preset) or --hf-config config.json")
    return model_config_from_file(args.config, args.overrides)
