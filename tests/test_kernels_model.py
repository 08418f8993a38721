"""The whole model gives the same logits and gradients with every kernel implementation.

Each config switches on the features the kernels must carry through a real forward and
backward pass: GQA, local/global layers (sliding window), soft-cap, sinks, QK-norm,
packed segments; MLA brings a value head dim different from the key one; Llama 4's chunked
layers (chunks of 5 over packed documents) with the L2 QK-norm and temperature tuning. The Pallas
kernels run in interpret mode. Tolerance: 1e-4 relative to each tensor's largest entry.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from modern_jax import execution
from modern_jax.config import ModelConfig
from modern_jax.execution import ExecutionConfig
from modern_jax.kernels import pallas_interpret
from modern_jax.model import Transformer


BASE = dict(vocab_size=61, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_position_embeddings=64)
CONFIGS = {
    "gemma_like": dict(n_kv_heads=2, norm_placement="sandwich", norm_type="gemma_rmsnorm", qk_norm="head",
                       attn_softcap=20.0, attention_sinks=True, sliding_window=6, attention_pattern="LG"),
    "mla_layernorm": dict(attention_type="mla", mla_kv_rank=16, mla_q_rank=8, mla_rope_dim=8, mla_nope_dim=8,
                          mla_v_dim=8, norm_type="layernorm", norm_bias=True, attention_sinks=True),
    "llama4_chunked": dict(n_kv_heads=2, attention_pattern="CG", attention_chunk_size=5, rope_pattern="RN",
                           qk_norm="l2", attn_temperature_floor=4, attn_temperature_scale=0.5),
}
IMPLS = {  # attention_impl, norm_impl, interpreted platform
    "chunked": ("chunked", "reference", None),
    "pallas_gpu": ("pallas_gpu", "pallas", "gpu"),
    "pallas_tpu": ("pallas_tpu", "pallas", "tpu"),
}


def packed_batch(B=2, T=24, V=61):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    seg = np.zeros((B, T), np.int32)
    seg[0, 9:] = 1
    seg[1, 15:] = 1
    starts = np.array([[0] * 9 + [9] * 15, [0] * 15 + [15] * 9])
    pos = np.arange(T)[None] - starts
    return tokens, jnp.asarray(seg), jnp.asarray(pos, jnp.int32)


def random_model(cfg):
    """The model's graph with random parameters (no initialiser runs: shapes come from eval_shape)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    return graphdef, jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape, np.float32) * 0.2, a.dtype),
                                  abstract)


def logits_and_grads(cfg, run=ExecutionConfig(attention_impl="reference", norm_impl="reference")):
    tokens, seg, pos = packed_batch(V=cfg.vocab_size)
    graphdef, params = random_model(cfg)
    cotangent = jnp.asarray(np.random.default_rng(1).standard_normal((*tokens.shape, cfg.vocab_size)), jnp.float32)

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens, segment_ids=seg, positions=pos)
        return jnp.sum(logits * cotangent), logits

    step = jax.jit(jax.grad(loss, has_aux=True))
    with execution.use(run):
        grads, logits = step.lower(params).compile()(params)
    return logits, grads


def assert_trees_close(got, want, tol=1e-4):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6)
        assert err <= tol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


@functools.cache
def reference(config):
    return logits_and_grads(ModelConfig.from_dict({**BASE, **CONFIGS[config]}))


# MLA's chunked path is the same code as GQA's (the kernel grid covers V != H).
@pytest.mark.parametrize(("config", "impl"), [(config, impl) for config in CONFIGS for impl in IMPLS
                                              if (config, impl) != ("mla_layernorm", "chunked")])
def test_model_matches_reference(config, impl):
    cfg = ModelConfig.from_dict({**BASE, **CONFIGS[config]})
    want = reference(config)
    attention_impl, norm_impl, target = IMPLS[impl]
    with pallas_interpret(target or False):
        got = logits_and_grads(cfg, ExecutionConfig(attention_impl=attention_impl, norm_impl=norm_impl))
    assert_trees_close(got, want)


def test_the_execution_config_names_the_implementations():
    with pytest.raises(ValueError, match="ExecutionConfig.attention_impl='flash' is invalid: .*pallas_gpu"):
        ExecutionConfig(attention_impl="flash")
    with pytest.raises(ValueError, match="ExecutionConfig.norm_impl='fused' is invalid: .*pallas"):
        ExecutionConfig(norm_impl="fused")
    assert ExecutionConfig().attention_impl == ExecutionConfig().norm_impl == "default"
