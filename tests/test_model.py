"""The whole model through its switches: shapes, causality, decoding, scan and remat."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from modern_jax import execution
from modern_jax.config import ModelConfig
from modern_jax.execution import ExecutionConfig
from modern_jax.model import Transformer, plan_stages

BASE = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_position_embeddings=64)

SWITCHES = {
    "llama": dict(n_kv_heads=2),
    "post_layernorm_gelu_learned": dict(norm_placement="post", norm_type="layernorm", norm_bias=True,
                                        ffn_type="mlp", activation="gelu", position_embedding="learned",
                                        qkv_bias=True, out_bias=True, mlp_bias=True, tie_embeddings=True),
    "gpt2_sinusoidal": dict(norm_type="layernorm", ffn_type="mlp", activation="gelu_tanh",
                            position_embedding="sinusoidal", init="xavier"),
    "sandwich_gemma": dict(norm_placement="sandwich", norm_type="gemma_rmsnorm", activation="gelu_tanh",
                           attn_softcap=50.0, final_softcap=30.0, embed_scale=True, n_kv_heads=1,
                           sliding_window=3, attention_pattern="LG", qk_norm="head", rope_local_theta=100.0),
    "olmo2_output": dict(norm_placement="output", qk_norm="full"),
    "parallel_palm_mqa": dict(norm_placement="parallel", n_kv_heads=1, norm_type="layernorm",
                              fused_gate_up=True),
    "parallel_neox": dict(norm_placement="parallel", parallel_shared_norm=False, rope_fraction=0.25,
                          ffn_type="mlp", activation="gelu"),
    "deepnorm": dict(norm_placement="deepnorm", norm_type="layernorm", activation="relu", ffn_type="mlp"),
    "nope_glu_sinks": dict(position_embedding="none", activation="sigmoid", attention_sinks=True),
    "mla": dict(attention_type="mla", mla_kv_rank=16, mla_q_rank=8, mla_rope_dim=4, mla_nope_dim=8,
                mla_v_dim=8, rope_layout="interleaved"),
    "irope_bilinear": dict(n_layers=4, rope_pattern="RRRN", activation="identity",
                           rope_scaling=dict(type="llama3", factor=8.0, original_max_position_embeddings=16)),
    "yarn_reglu": dict(activation="relu", rope_scaling=dict(type="yarn", factor=4.0,
                                                            original_max_position_embeddings=16)),
    # Llama 4's attention: chunks of 3 on the RoPE layers with the L2 QK-norm, a global NoPE layer
    # whose queries are temperature-tuned (floor 2, so positions 1.. are scaled)
    "llama4_chunked": dict(n_layers=4, n_kv_heads=2, attention_pattern="CCCG", attention_chunk_size=3,
                           rope_pattern="RRRN", qk_norm="l2", attn_temperature_floor=2, attn_temperature_scale=0.5,
                           rope_layout="interleaved"),
    # mixtures of experts (dropless grouped dispatch), one per routing family
    "moe_qwen": dict(n_layers=3, n_kv_heads=2, qk_norm="head", ffn_type="moe", n_experts=4, experts_per_token=2,
                     expert_d_ff=16, router_norm_topk=True, moe_first_dense=1),
    "moe_deepseek_mla": dict(attention_type="mla", mla_kv_rank=16, mla_q_rank=8, mla_rope_dim=4, mla_nope_dim=8,
                             mla_v_dim=8, ffn_type="moe", n_experts=8, experts_per_token=2, expert_d_ff=8,
                             router_score="sigmoid", router_norm_topk=True, router_scale=2.5,
                             router_selection_bias=True, router_groups=4, router_topk_groups=2, n_shared_experts=1),
    "moe_gpt_oss": dict(n_layers=2, sliding_window=3, attention_pattern="LG", attention_sinks=True, qkv_bias=True,
                        out_bias=True, ffn_type="moe", n_experts=4, experts_per_token=2, router_score="topk_softmax",
                        router_bias=True, expert_bias=True, expert_swiglu_limit=1.0),
    "moe_llama4": dict(n_layers=4, ffn_type="moe", n_experts=4, experts_per_token=1, router_score="sigmoid",
                       router_on_input=True, n_shared_experts=1, moe_pattern="DE", expert_d_ff=16),
}


def make(name=None, seed=0, **overrides):
    cfg = ModelConfig.from_dict({**BASE, **(SWITCHES[name] if name else {}), **overrides})
    return Transformer(cfg, rngs=nnx.Rngs(seed))


def tokens(B=2, T=10, seed=0, V=97):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, (B, T)), jnp.int32)


@pytest.mark.parametrize("name", list(SWITCHES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shapes_and_dtypes_jit_and_eager(name, dtype):
    model = make(name, dtype=dtype)
    toks = tokens()
    eager = model(toks)
    jitted = nnx.jit(lambda m, t: m(t))(model, toks)
    chex.assert_shape(eager, (2, 10, 97))
    chex.assert_type(eager, jnp.float32)  # logits are produced in float32
    chex.assert_tree_all_finite(eager)
    hidden, _ = model.hidden_states(toks)
    chex.assert_type(hidden, jnp.dtype(dtype))
    tol = 1e-5 if dtype == "float32" else 5e-2
    np.testing.assert_allclose(jitted, eager, atol=tol, rtol=tol)
    if model.cfg.final_softcap:
        assert float(jnp.max(jnp.abs(eager))) < model.cfg.final_softcap


@pytest.mark.parametrize("name", ["llama", "sandwich_gemma", "parallel_neox", "mla", "post_layernorm_gelu_learned",
                                  "llama4_chunked", "moe_qwen", "moe_deepseek_mla", "moe_gpt_oss", "moe_llama4"])
def test_causality_by_gradient(name):
    """d logits[t] / d input[t'] is zero for every t' > t and non-zero for some t' <= t."""
    model = make(name, tie_embeddings=False)
    T = 8
    toks = jnp.arange(T, dtype=jnp.int32)[None] + 3  # distinct tokens: embedding row r <-> position
    grad_of_logit = nnx.jit(lambda m, t: nnx.grad(lambda m: jnp.sum(m(toks)[0, t]))(m)["embed_tokens"][...])
    for t in (0, 3, T - 1):
        grad = grad_of_logit(model, t)
        per_position = np.abs(np.asarray(grad)[np.asarray(toks[0])]).sum(-1)
        assert np.all(per_position[t + 1:] == 0.0), (t, per_position)
        assert np.all(per_position[: t + 1] > 0.0), (t, per_position)


def decode_matches_forward(model, T_prompt=5, T=12, chunks=None):
    toks = tokens(T=T)
    full = jax.jit(lambda m, t: m(t))(model, toks)  # jitted: one compile, not one per operation
    cache = model.init_cache(2, max_len=16)
    step = jax.jit(lambda m, t, c: m(t, cache=c))
    pieces, start = [], 0
    for size in chunks or [T_prompt] + [1] * (T - T_prompt):
        logits, cache = step(model, toks[:, start:start + size], cache)
        pieces.append(logits)
        start += size
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(cache["index"], [T, T])


@pytest.mark.parametrize("name,overrides", [
    ("llama", {}),  # GQA + RoPE
    ("llama", dict(sliding_window=3, attention_pattern="L")),  # window shorter than the sequence
    ("mla", {}),
    ("nope_glu_sinks", dict(position_embedding="rope")),  # sinks
    ("irope_bilinear", {}),  # NoPE / RoPE layer pattern
    ("sandwich_gemma", {}),  # local/global, two RoPE bases, softcaps
    ("post_layernorm_gelu_learned", {}),
    ("llama4_chunked", {}),  # chunk rings of 3 slots, L2 QK-norm, temperature of the true positions
    ("mla", dict(n_layers=4, attention_pattern="CCCG", attention_chunk_size=4, rope_pattern="RRRN",
                 attn_temperature_floor=3)),
    ("moe_qwen", {}), ("moe_deepseek_mla", {}), ("moe_gpt_oss", {}), ("moe_llama4", {}),  # dropless routing
])
def test_cached_decode_equals_full_forward(name, overrides):
    decode_matches_forward(make(name, **overrides))


def test_chunked_prefill_across_a_ring_boundary():
    model = make("llama", sliding_window=4, attention_pattern="LG")
    decode_matches_forward(model, chunks=[3, 5, 2, 1, 1])  # chunks longer than the window's ring


def test_attention_chunk_rings_hold_one_chunk_and_wrap():
    """A chunked layer caches `attention_chunk_size` slots; prefills longer than the ring, starting
    mid-chunk, and decoding past several chunk boundaries equal the full forward pass."""
    model = make("llama4_chunked")
    cache = model.init_cache(2, max_len=16)
    assert [layer["pos"].shape[2] for stage in cache["stages"] for layer in stage] == [3, 16]
    decode_matches_forward(model, chunks=[4, 5, 1, 2])
    decode_matches_forward(model, chunks=[1, 7, 3, 1])
    all_chunked = make("llama4_chunked", attention_pattern="C", rope_pattern="R", attn_temperature_floor=None,
                       attn_temperature_scale=0.1)
    assert all_chunked.cache_length(all_chunked.init_cache(2, max_len=16)) is None  # every layer a ring: it wraps
    decode_matches_forward(all_chunked, chunks=[5, 4, 3])


def test_chunked_layers_see_only_their_own_chunk():
    """Every layer chunked (c = 4): d logits[t] / d input[t'] is non-zero exactly for the positions
    t' of t's own block, t // 4 * 4 <= t' <= t (the blocks line up across layers)."""
    model = make("llama4_chunked", attention_pattern="C", rope_pattern="R", attention_chunk_size=4,
                 attn_temperature_floor=None, attn_temperature_scale=0.1, tie_embeddings=False)
    T = 11
    toks = jnp.arange(T, dtype=jnp.int32)[None] + 3
    grad_of_logit = nnx.jit(lambda m, t: nnx.grad(lambda m: jnp.sum(m(toks)[0, t]))(m)["embed_tokens"][...])
    for t in range(T):
        per_position = np.abs(np.asarray(grad_of_logit(model, t))[np.asarray(toks[0])]).sum(-1)
        np.testing.assert_array_equal(per_position > 0, (np.arange(T) >= t // 4 * 4) & (np.arange(T) <= t), str(t))


def test_scan_equals_unrolled():
    model = make("irope_bilinear", n_layers=8)
    toks = tokens()
    with execution.use(ExecutionConfig(scan_layers=False)):  # the same stacked parameters, a Python loop
        unrolled = model(toks)
    np.testing.assert_allclose(unrolled, model(toks), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy, impl", [("full", "default"), ("dots", "default"), ("dots_no_batch", "default"),
                                          ("save_qkv_out", "default"), ("save_qkv_out", "chunked")])
def test_remat_gives_the_same_gradients(policy, impl):
    """`chunked`: a custom-VJP attention whose saved output and log-sum-exp the policy keeps."""
    model = make("llama", n_layers=3)
    toks = tokens()

    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m(toks))[..., 0])

    with execution.use(ExecutionConfig(attention_impl=impl)):
        g_plain = nnx.jit(nnx.grad(loss))(model)
    with execution.use(ExecutionConfig(remat=policy, attention_impl=impl)):
        g_remat = nnx.jit(nnx.grad(loss))(model)
    chex.assert_trees_all_close(nnx.state(g_remat, nnx.Param), nnx.state(g_plain, nnx.Param), atol=1e-6, rtol=1e-5)


def test_packed_segments_equal_separate_sequences():
    model = make("llama")
    a, b = tokens(B=1, T=6, seed=1), tokens(B=1, T=4, seed=2)
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.array([[1] * 6 + [2] * 4])
    pos = jnp.array([list(range(6)) + list(range(4))])
    out = model(packed, segment_ids=seg, positions=pos)
    np.testing.assert_allclose(out[:, :6], model(a), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out[:, 6:], model(b), atol=1e-5, rtol=1e-5)


def test_dropout_only_with_an_rng():
    model = make("llama", attn_dropout=0.1, resid_dropout=0.1)
    toks = tokens()
    forward = nnx.jit(lambda m, rng: m(toks, dropout_rng=rng))
    plain = nnx.jit(lambda m: m(toks))(model)
    np.testing.assert_allclose(plain, make("llama")(toks), atol=1e-6)  # no key: dropout is off
    dropped = forward(model, jax.random.key(0))
    assert float(jnp.max(jnp.abs(dropped - plain))) > 1e-3
    np.testing.assert_array_equal(dropped, forward(model, jax.random.key(0)))
    assert float(jnp.max(jnp.abs(forward(model, jax.random.key(1)) - dropped))) > 1e-3


@pytest.mark.parametrize("which", ["resid_dropout", "attn_dropout"])
def test_dropout_draws_its_own_mask_for_every_row(which):
    """Four copies of one sequence: without dropout the rows' logits are equal; with it (rate 0.3)
    every row differs from every other, and dropped units differ between rows. A mask drawn once
    and repeated over the batch (every data shard dropping the same units) makes the rows equal,
    which the mesh tests cannot see: they compare a mesh with one device, wrong alike."""
    model = make("llama", **{which: 0.3})
    rows = jnp.tile(tokens(B=1), (4, 1))
    plain = nnx.jit(lambda m: m(rows))(model)
    np.testing.assert_allclose(plain, jnp.broadcast_to(plain[:1], plain.shape), atol=1e-6)
    dropped = nnx.jit(lambda m, rng: m(rows, dropout_rng=rng))(model, jax.random.key(0))
    for i in range(4):
        for j in range(i):
            assert float(jnp.max(jnp.abs(dropped[i] - dropped[j]))) > 1e-2, (which, i, j)


@pytest.mark.quick
def test_bad_inputs_are_named():
    model = make("llama")
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=97\); got values in \[0, 97\]"):
        model(jnp.array([[0, 97]]))
    with pytest.raises(ValueError, match="tokens must be integers"):
        model(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="segment_ids"):
        model(tokens(), segment_ids=jnp.ones((2, 10), jnp.int32), cache=model.init_cache(2, 16))
    with pytest.raises(ValueError, match="positions must have the tokens' shape"):
        model(tokens(), positions=jnp.zeros((2, 3), jnp.int32))


def test_layer_plan_scans_repeating_units():
    cfg = ModelConfig(n_layers=26, sliding_window=8, attention_pattern="LLLLLG", rope_local_theta=10.0)
    plan = plan_stages(cfg.layer_specs())
    assert [(len(unit), repeats) for unit, repeats in plan] == [(6, 4), (1, 2)]
    cfg = ModelConfig(n_layers=30, rope_pattern="RRRN")
    assert [(len(u), r) for u, r in plan_stages(cfg.layer_specs())] == [(4, 7), (1, 2)]
    model = Transformer(ModelConfig(n_layers=5, d_model=32, d_ff=32, vocab_size=8), rngs=nnx.Rngs(0))
    assert model.stages[0].blocks[0].mlp.down_proj.kernel.shape[0] == 5  # one stacked stage
    assert model.stages[0].blocks[0].mlp.down_proj.kernel.get_metadata()["out_sharding"] == ("layers", "mlp", "embed")


def test_every_parameter_has_logical_axes():
    model = make("sandwich_gemma", tie_embeddings=False)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        axes = var.get_metadata().get("out_sharding")
        assert axes is not None and len(axes) == var.ndim, path


def test_residual_projection_init_scaled():
    model = make("llama", n_layers=8, d_model=128, n_heads=4, d_ff=128)
    block = model.stages[0].blocks[0]
    std_q = float(jnp.std(block.self_attn.q_proj.kernel[...]))
    std_o = float(jnp.std(block.self_attn.o_proj.kernel[...]))
    std_down = float(jnp.std(block.mlp.down_proj.kernel[...]))
    assert std_q == pytest.approx(0.02, rel=0.02)
    assert std_o == pytest.approx(0.02 / 4, rel=0.02) and std_down == pytest.approx(0.02 / 4, rel=0.02)
