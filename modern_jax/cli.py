"""The `modern-jax` command.

    modern-jax info --config configs/llama3_8b.yaml [model.n_layers=4 ...] [--context 8192]
    modern-jax info --hf-config path/to/config.json
"""

from __future__ import annotations

import argparse
import json
import sys


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.2f} {unit}" if unit != "B" else f"{int(n):,} B"
        n /= 1024
    raise AssertionError


def _load_model_config(args):
    from modern_jax.config import model_config_from_file

    if args.hf_config:
        from modern_jax.convert.hf_config import config_from_hf

        with open(args.hf_config) as f:
            return config_from_hf(json.load(f))
    if not args.config:
        raise ValueError("give --config FILE (a configs/*.yaml preset) or --hf-config config.json")
    return model_config_from_file(args.config, args.overrides)


def cmd_info(args) -> None:
    from modern_jax.accounting import flops_per_token, kv_cache_bytes, kv_cache_bytes_per_token, param_counts

    cfg = _load_model_config(args)
    counts = param_counts(cfg)
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[args.kv_dtype]
    print(f"parameters: {counts['total']}")
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
    per_token = kv_cache_bytes_per_token(cfg, dtype_bytes)
    print(f"kv cache per token ({args.kv_dtype}): {per_token} ({_size(per_token)})")
    context = args.context or cfg.max_position_embeddings
    total = kv_cache_bytes(cfg, context, dtype_bytes)
    print(f"kv cache at {context} tokens: {total} ({_size(total)}) per sequence")
    seq = args.seq_len or min(context, 4096)
    flops = flops_per_token(cfg, seq)
    print(f"training flops per token at seq_len {seq}: {flops['total']:.4e} "
          f"(6N = {flops['weights']:.4e}, attention = {flops['attention']:.4e})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modern-jax", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="parameters, KV-cache bytes and FLOPs of a config, without weights")
    info.add_argument("--config", help="a YAML config with a model: section")
    info.add_argument("--hf-config", help="a Hugging Face config.json")
    info.add_argument("--context", type=int, help="context length for the KV-cache total (default: max positions)")
    info.add_argument("--seq-len", type=int, help="training sequence length for the FLOPs (default: min(context, 4096))")
    info.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    info.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.n_layers=4")
    info.set_defaults(func=cmd_info)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:
        print(f"modern-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
