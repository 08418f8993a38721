"""Sizing a model without weights: parameters, KV-cache bytes and training FLOPs.

Parameter counts come from the abstract model itself (`nnx.eval_shape`), so they are
exact for every switch by construction and cost no memory, even for a 70B config.
"""

from __future__ import annotations

import math
from functools import lru_cache

import jax
from flax import nnx

from modern_jax.config import ModelConfig


@lru_cache(maxsize=64)
def param_counts(cfg: ModelConfig) -> dict:
    """Exact counts: total, embedding, head, final_norm, per_block (one per layer), and active.

    `active`: the parameters one token uses: all of them less, in each mixture-of-experts
    layer, the E - k routed experts it is not sent to (router and shared experts included)."""
    from modern_jax.layers.moe import SelectionBias
    from modern_jax.model import Transformer

    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
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
    total = size(model)
    assert total == embedding + head + final_norm + sum(per_block)
    return {"total": total, "embedding": embedding, "head": head, "final_norm": final_norm, "per_block": per_block,
            "active": total - unused}


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
    counted as for full (non-causal) attention.
    """
    counts = param_counts(cfg)
    n_matmul = counts["active"] - counts["embedding"]
    if cfg.tie_embeddings:
        n_matmul += cfg.vocab_size * cfg.d_model
    if cfg.attention_type == "mla":
        d_qk, d_v = cfg.mla_nope_dim + cfg.mla_rope_dim, cfg.mla_v_dim
    else:
        d_qk = d_v = cfg.head_size
    attention = sum(
        6 * cfg.n_heads * (d_qk + d_v) * (seq_len if s.span is None else min(seq_len, s.span))
        for s in cfg.layer_specs()
    )
    return {"weights": 6 * n_matmul, "attention": attention, "total": 6 * n_matmul + attention,
            "matmul_params": n_matmul}
