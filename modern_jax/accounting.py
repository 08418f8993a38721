"""Sizing a model without weights: parameters, KV-cache bytes and training FLOPs; and
whether a compiled program fits the memory a device has free.

Parameter counts come from the abstract model itself (`nnx.eval_shape`), so they are
exact for every switch by construction and cost no memory, even for a 70B config.

`check_fits` compiles a program (nothing is allocated), takes XLA's own count of what it
holds at its peak (`memory_analysis()`: arguments + outputs - donated + temporaries), and
compares it with what is free: `memory_stats()["bytes_limit"]` less what is in use where a
device reports it (GPU, TPU), the host's `MemAvailable` (/proc/meminfo) on CPU. A program
that does not fit raises `DoesNotFit`, with the largest size that would.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

import jax
import numpy as np
from flax import nnx

from modern_jax.config import ModelConfig


@lru_cache(maxsize=64)
def param_counts(cfg: ModelConfig) -> dict:
    """Exact counts: total, embedding, head, final_norm, per_block (one per layer), mtp (the
    multi-token-prediction modules, 0 without them) and active.

    `active`: the parameters one token uses: all of them less, in each mixture-of-experts
    layer, the E - k routed experts it is not sent to (router and shared experts included)."""
    from modern_jax.layers.moe import SelectionBias
    from modern_jax.model import abstract_model

    model = abstract_model(cfg)
    counted = nnx.All(nnx.Param, nnx.Not(SelectionBias))  # the selection bias is no weight (transformers: a buffer)

    def size(node) -> int:
        return sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(node, counted)))

    per_block = [0] * cfg.n_layers
    unused = 0  # routed-expert parameters a token does not use
    for stage in model.stages:
        for j, block in enumerate(stage.blocks):
            per_layer = size(block) // stage.repeats
            for i in range(stage.repeats):
                per_block[stage.first + i * len(stage.unit) + j] = per_layer
            if hasattr(block.mlp, "experts"):
                per_expert = size(block.mlp.experts) // (stage.repeats * cfg.n_experts)
                unused += stage.repeats * (cfg.n_experts - cfg.experts_per_token) * per_expert
    embedding = math.prod(model.embed_tokens.shape)
    if model.embed_positions is not None:
        embedding += math.prod(model.embed_positions.shape)
    head = 0 if model.lm_head is None else size(model.lm_head)
    final_norm = 0 if model.norm is None else size(model.norm)
    mtp = 0 if model.mtp is None else size(model.mtp)
    if model.mtp is not None and hasattr(model.mtp.block.mlp, "experts"):  # each module's block a mixture too
        per_expert = size(model.mtp.block.mlp.experts) // (cfg.mtp_depth * cfg.n_experts)
        unused += cfg.mtp_depth * (cfg.n_experts - cfg.experts_per_token) * per_expert
    total = size(model)
    assert total == embedding + head + final_norm + sum(per_block) + mtp
    return {"total": total, "embedding": embedding, "head": head, "final_norm": final_norm, "per_block": per_block,
            "mtp": mtp, "active": total - unused}


def kv_bytes_per_token_per_layer(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Cache bytes one token costs in one layer: K and V, or MLA's latent plus rotary key."""
    if cfg.attention_type == "mla":
        return (cfg.mla_kv_rank + cfg.mla_rope_dim) * dtype_bytes
    return 2 * cfg.num_kv_heads * cfg.head_size * dtype_bytes


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """`2 * L * n_kv * d_h * bytes` (MHA/GQA/MQA) or `L * (d_c + d_R) * bytes` (MLA)."""
    return cfg.n_layers * kv_bytes_per_token_per_layer(cfg, dtype_bytes)


def kv_cache_bytes(cfg: ModelConfig, context: int, dtype_bytes: int = 2) -> int:
    """Cache bytes for one sequence of `context` tokens; local (chunked) layers hold at most their
    window (chunk)."""
    per_layer = kv_bytes_per_token_per_layer(cfg, dtype_bytes)
    return sum(per_layer * (context if s.span is None else min(context, s.span)) for s in cfg.layer_specs())


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict:
    """Training FLOPs per token: `6 N` for the weights plus the attention term.

    N counts the parameters one token uses in matmuls (the active ones, less the embedding
    lookups; a tied head's matmul counts). The attention term is `6 * n_heads * (d_qk + d_v) * T_eff`
    per layer (PaLM's `12 L H Q T` when d_qk = d_v = Q), with T_eff = min(T, window or chunk),
    counted as for full (non-causal) attention. MTP modules count as they run in training: their
    parameters, one more pass through the shared head each, and their blocks' attention (each
    block of the last layer's kind).
    """
    counts = param_counts(cfg)
    n_matmul = counts["active"] - counts["embedding"]
    if cfg.tie_embeddings:
        n_matmul += cfg.vocab_size * cfg.d_model
    n_matmul += cfg.mtp_depth * cfg.vocab_size * cfg.d_model  # each MTP module's logits, by the shared head
    specs = cfg.layer_specs() + cfg.layer_specs()[-1:] * cfg.mtp_depth
    if cfg.attention_type == "mla":
        d_qk, d_v = cfg.mla_nope_dim + cfg.mla_rope_dim, cfg.mla_v_dim
    else:
        d_qk = d_v = cfg.head_size
    attention = sum(
        6 * cfg.n_heads * (d_qk + d_v) * (seq_len if s.span is None else min(seq_len, s.span))
        for s in specs
    )
    causal = sum(6 * cfg.n_heads * (d_qk + d_v) * causal_keys(seq_len, s.window, s.chunk) for s in specs)
    return {"weights": 6 * n_matmul, "attention": attention, "total": 6 * n_matmul + attention,
            "causal_attention": causal, "causal_total": 6 * n_matmul + causal, "matmul_params": n_matmul}


def causal_keys(seq_len: int, window: int | None = None, chunk: int | None = None) -> float:
    """The keys a query sees on average in a causal sequence of `seq_len` (its own included): (T + 1) / 2
    for global attention, fewer under a sliding `window` or in blocks of `chunk` positions."""
    t = np.arange(seq_len)
    seen = t + 1
    if window is not None:
        seen = np.minimum(seen, window)
    if chunk is not None:
        seen = t % chunk + 1
    return float(seen.mean())


# ----- memory ------------------------------------------------------------------------


def format_bytes(n: float) -> str:
    """`1536` -> `1.50 KiB`; binary units up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.2f} {unit}" if unit != "B" else f"{int(n):,} B"
        n /= 1024
    raise AssertionError


def free_memory(device) -> tuple[int, str] | None:
    """`(bytes free for new arrays, where)`: the device's own count where it reports one (GPU, TPU),
    else the host's available memory (CPU); None where neither is known."""
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"the {device.device_kind}"
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return kib * 1024, "this host"


def program_bytes(compiled) -> int:
    """XLA's count of what a compiled program holds at its peak: arguments + outputs - donated + temporaries."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


class DoesNotFit(ValueError):
    """A program that needs more memory than is free: the sizes it was asked for (in order), the
    one to lower and the largest value of it that fits (None: not estimated), and `smallest`, the
    sizes and need of the smallest request tried when even that does not fit."""

    def __init__(self, program: str, need: int, free: int, where: str, sizes: dict[str, int],
                 lower: str | None = None, fits: int | None = None,
                 smallest: tuple[dict[str, int], int] | None = None):
        self.program, self.need, self.free, self.where = program, need, free, where
        self.sizes, self.lower, self.fits, self.smallest = dict(sizes), lower, fits, smallest
        super().__init__(self.describe())

    def describe(self, names: dict[str, str] | None = None) -> str:
        """The message, each size named `names[size]` (a flag: `--batch-size 8`), else `size=8`."""
        def asked(sizes):
            return " x ".join(f"{names[k]} {v}" if names else f"{k}={v}" for k, v in sizes.items())

        text = (f"{self.program} needs {format_bytes(self.need)} for {asked(self.sizes)} (XLA's count); "
                f"{self.where} has {format_bytes(self.free)} free")
        if self.smallest is not None:
            text += f"; even {asked(self.smallest[0])} needs {format_bytes(self.smallest[1])}"
        if self.lower is not None:
            text += f": lower {names[self.lower] if names else self.lower}"
            text += f" (at most about {self.fits:,} fit)" if self.fits is not None else ""
        return text


def check_fits(program: str, compile_at: Callable, sizes: dict[str, int], *, resident, lower: tuple[str, ...],
               otherwise: str | None = None):
    """`compile_at(**sizes)`, compiled, if XLA's count of its memory fits what its device has free;
    else `DoesNotFit`. `resident`: the arguments already on the device (the parameters), a tree of
    arrays whose bytes are not needed again and whose device the program runs on.

    Then, for each size of `lower` in turn, one more compile with it at 1 (the others as asked)
    says how far to lower it, memory taken as affine in it; the first for which 1 fits is named
    with the largest value that fits. If none does, the error names `otherwise`.
    """
    placed = [x for x in jax.tree.leaves(resident) if isinstance(x, jax.Array)]
    local = [d for d in placed[0].devices() if d.process_index == jax.process_index()] if placed else []
    device = min(local, key=lambda d: d.id) if local else jax.local_devices()[0]  # one this process can ask
    resident = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in placed)  # one device's
    compiled = compile_at(**sizes)
    free = free_memory(device)
    need = program_bytes(compiled) - resident
    if free is None or need <= free[0]:
        return compiled
    available, where = free
    smallest = None
    for key in (k for k in lower if sizes[k] > 1):
        trial = {**sizes, key: 1}
        at_one = program_bytes(compile_at(**trial)) - resident
        if at_one <= available:
            per_unit = max((need - at_one) / (sizes[key] - 1), 1.0)
            fits = min(1 + int((available - at_one) // per_unit), sizes[key] - 1)
            raise DoesNotFit(program, need, available, where, sizes, key, fits)
        smallest = (trial, at_one)
    rest = otherwise if otherwise is not None and sizes[otherwise] > 1 else None
    raise DoesNotFit(program, need, available, where, sizes, rest, smallest=smallest)
