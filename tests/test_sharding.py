"""The one rules table: every logical name a parameter or a `constrain(...)` uses is in it, an
unknown name is a ValueError naming it, and the fused QK-norm keeps q/k head-sharded."""

import ast
import contextlib
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from modern_jax import execution
from modern_jax.config import ModelConfig, model_config_from_file
from modern_jax.execution import ExecutionConfig
from modern_jax.kernels import UnsupportedFeatureError, pallas_interpret
from modern_jax.model import Transformer
from modern_jax.sharding import ParallelConfig, create_sharded, make_mesh
from modern_jax.sharding import RULES, constrain, logical_rules, logical_to_spec, mesh_axes, state_shardings

from common import assert_leaves_match

REPO = pathlib.Path(__file__).parent.parent
PRESETS = sorted((REPO / "configs").glob("*.yaml"))
BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_position_embeddings=32)
TINY = {  # the switches that add or rename parameters
    "mla_q_rank": dict(attention_type="mla", mla_kv_rank=16, mla_q_rank=8, mla_rope_dim=4, mla_nope_dim=8,
                       mla_v_dim=8),
    "mla_full_rank_sinks": dict(attention_type="mla", mla_kv_rank=16, mla_rope_dim=4, mla_nope_dim=8, mla_v_dim=8,
                                attention_sinks=True),
    "qk_norm_head_tied": dict(qk_norm="head", tie_embeddings=True, n_kv_heads=2),
    "qk_norm_full_sinks": dict(qk_norm="full", attention_sinks=True, norm_placement="output"),
    "biases_learned_layernorm": dict(norm_type="layernorm", norm_bias=True, ffn_type="mlp", qkv_bias=True,
                                     out_bias=True, mlp_bias=True, head_bias=True, position_embedding="learned",
                                     norm_placement="post"),
    "sandwich_local_global": dict(norm_placement="sandwich", sliding_window=4, attention_pattern="LG",
                                  final_softcap=30.0, embed_scale=True),
    "parallel_fused_gate_up": dict(norm_placement="parallel", parallel_shared_norm=False, fused_gate_up=True),
    "moe_every_router_part": dict(ffn_type="moe", n_experts=4, experts_per_token=2, n_shared_experts=1,
                                  router_bias=True, router_selection_bias=True, expert_bias=True, moe_pattern="DE"),
}


def grid():
    """Every preset (cut to one repeat of its layer patterns after any first dense layers, at least 2
    layers) and every tiny
    switch config, by name."""
    configs = {}
    for path in PRESETS:
        cfg = model_config_from_file(path, ["model.vocab_size=256"])  # some say "auto" (the tokenizer's)
        layers = max(2, len(cfg.attention_pattern), len(cfg.rope_pattern), cfg.moe_first_dense + len(cfg.moe_pattern))
        configs[path.stem] = cfg.replace(n_layers=layers)
    configs.update({name: ModelConfig(**BASE, **switches) for name, switches in TINY.items()})
    return configs


def parameter_names(cfg) -> set:
    """The logical axis names on every parameter of `cfg`'s model (no memory: eval_shape)."""
    state = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    names = set()
    for _, var in nnx.to_flat_state(state):
        axes = var.get_metadata().get("out_sharding")
        assert axes is not None and len(axes) == len(var.shape), "every parameter carries its logical axes"
        names.update(a for a in axes if a is not None)
    return names


def constrained_names() -> set:
    """The logical names in every `constrain(x, axes)` call of the package (each must be a literal)."""
    names, calls = set(), 0
    for path in (REPO / "modern_jax").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "constrain":
                calls += 1
                axes = node.args[1] if len(node.args) > 1 else None
                assert isinstance(axes, ast.Tuple), f"{path.name}:{node.lineno}: constrain axes must be a literal tuple"
                for element in axes.elts:
                    assert isinstance(element, ast.Constant), f"{path.name}:{node.lineno}: a non-literal axis name"
                    if element.value is not None:
                        names.add(element.value)
    assert calls >= 4, f"found only {calls} constrain(...) calls: the scan is broken"
    return names


def test_every_logical_name_in_use_is_in_the_rules_table():
    known = set(dict(RULES))
    configs = grid()
    assert len(configs) >= len(PRESETS) + len(TINY) and len(PRESETS) >= 10
    used = {}
    for name, cfg in configs.items():
        for axis in parameter_names(cfg):
            used.setdefault(axis, name)
    assert {"vocab", "embed", "layers", "q_heads", "kv_heads", "head_dim", "mlp", "experts", "norm", "q_latent",
            "kv_latent"} <= set(used), f"the grid misses parameter axes: {sorted(used)}"
    for axis in constrained_names():
        used.setdefault(axis, "constrain(...)")
    assert {"activation_batch", "activation_length", "activation_embed", "activation_kv_heads",
            "activation_vocab"} <= set(used)
    missing = {axis: where for axis, where in used.items() if axis not in known}
    assert not missing, f"logical names not in sharding.RULES (name: first config using it): {missing}"


@pytest.mark.parametrize("axes", [dict(fsdp=8), dict(expert=8), dict(context=8), dict(fsdp=2, expert=2, tensor=2)],
                         ids=lambda axes: "x".join(f"{a}{n}" for a, n in axes.items()))
def test_no_large_parameter_of_a_preset_is_replicated_over_a_weight_axis(axes):
    """Every matrix of a full-size preset over 1M entries is split over every mesh axis that is
    not `data`: 8 ways on these 8-device meshes. A weight replicated over one (MLA's q_b / kv_b
    over fsdp, 12 GiB per chip of DeepSeek-V3 on 512 chips; every weight outside the experts over
    `expert`, 1.7 GiB per chip of Mixtral on fsdp 8 x expert 4) wastes that axis's memory.
    The exceptions: MLA's down projections to its latents, shared by every head, and a mixture's
    router, whose scores every token needs whole, are whole over `tensor` (as in Megatron), and
    so are the key and value projections of fewer KV heads than `tensor` (each device keeps
    whole heads). Shapes only: nothing is built."""
    mesh = make_mesh(**axes)
    whole_over_tensor = {"q_a_proj", "kv_a_proj_with_mqa", "router"}
    for path in PRESETS:
        cfg = model_config_from_file(path, ["model.vocab_size=131072"])
        layers = max(2, len(cfg.attention_pattern), len(cfg.rope_pattern), cfg.moe_first_dense + len(cfg.moe_pattern))
        state = nnx.state(nnx.eval_shape(lambda: Transformer(cfg.replace(n_layers=layers), rngs=nnx.Rngs(0))),
                          nnx.Param)
        shardings = dict(nnx.to_flat_state(state_shardings(state, mesh)))
        for key, var in nnx.to_flat_state(state):
            if var.size > 2**20:
                shard = shardings[key].shard_shape(var.shape)
                whole = whole_over_tensor | ({"k_proj", "v_proj"} if cfg.num_kv_heads % axes.get("tensor", 1) else set())
                ways = 8 // (axes.get("tensor", 1) if whole & set(map(str, key)) else 1)
                assert np.prod(shard) * ways == var.size, f"{path.stem}: {'/'.join(map(str, key))} {var.shape} -> {shard}"


@pytest.mark.quick
def test_an_unknown_logical_name_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"logical axis 'expert_groups' is not in the sharding rules"):
        mesh_axes("expert_groups", RULES)
    without_vocab = tuple((name, axes) for name, axes in RULES if name != "vocab")
    with pytest.raises(ValueError, match=r"'vocab'"):  # a rules table missing a name the model uses
        logical_to_spec(("vocab", "embed"), without_vocab)
    assert mesh_axes(None, RULES) == ()  # None: replicated, never looked up


@pytest.mark.quick
def test_a_rule_under_an_old_axis_name_names_the_new_one():
    """MLA's latents were `q_lora` / `kv_lora`, beside LoRA's adapters: a `parallel.rules` override
    under the old name says what the axis is called now."""
    for old, new in (("q_lora", "q_latent"), ("kv_lora", "kv_latent")):
        with pytest.raises(ValueError, match=rf"ParallelConfig.rules.{old}=\('fsdp',\) is invalid: the logical axis "
                                             rf"{old} is now {new}: write parallel.rules.{new}"):
            ParallelConfig.from_dict({"rules": {old: ["fsdp"]}})
        assert dict(ParallelConfig.from_dict({"rules": {new: ["fsdp"]}}).rules_table())[new] == ("fsdp",)

    mesh = make_mesh(2, 1, 4)

    class Odd(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((4, 8)), out_sharding=("embed", "expertz"), eager_sharding=False)

    state = nnx.state(nnx.eval_shape(Odd))
    with pytest.raises(ValueError, match=r"'expertz'"):
        state_shardings(state, mesh)
    with logical_rules(mesh), pytest.raises(ValueError, match=r"'activation_experts'"):
        jax.jit(lambda x: constrain(x, ("activation_batch", "activation_experts"))).lower(jnp.zeros((8, 4)))


# ----- the fused QK-norm under tensor parallelism -------------------------------------------

QK_CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=8, n_kv_heads=4, d_ff=64)


def _gathered(hlo: str) -> list:
    """The result shapes (`f32[...]`) of every all-gather in compiled HLO text."""
    return re.findall(r"= (\w+\[[\d,]*\])\S* all-gather(?:-start)?\(", hlo)


def _whole_heads(shape: str, cfg) -> bool:
    """An array whose last two dimensions are all the q (or k) heads x head_dim: a q/k projection
    kernel `[(layers,) D, N, H]` or a q/k activation or its cotangent `[B, T, N, H]`, gathered."""
    return any(shape.endswith(f",{heads},{cfg.head_size}]") for heads in (cfg.n_heads, cfg.num_kv_heads))


def _loss(model, toks):
    logits = model(toks[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], -1))


def _forward_and_grad(cfg, mesh, norm_impl="reference"):
    """Logits, loss, gradients and the compiled HLO texts of both, on `mesh` (None: one device)."""
    factory = lambda: Transformer(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    model = factory() if mesh is None else create_sharded(factory, mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 9)), jnp.int32)
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t[:, :-1]))
    grad = jax.jit(jax.value_and_grad(lambda p, t: _loss(nnx.merge(graphdef, p), t)))
    run = ExecutionConfig(norm_impl=norm_impl, attention_impl="reference")
    with pallas_interpret(), (contextlib.nullcontext() if mesh is None else logical_rules(mesh)), execution.use(run):
        compiled = [f.lower(params, toks).compile() for f in (forward, grad)]
    logits, (loss, grads) = (c(params, toks) for c in compiled)
    return logits, loss, grads, [c.as_text() for c in compiled]


@pytest.mark.parametrize("qk_norm", ["none", "head", "full"])
@pytest.mark.parametrize("norm_impl", ["reference", "pallas"])
def test_qk_norm_runs_on_the_head_shards_without_gathering_q_or_k(norm_impl, qk_norm):
    """On (data=2, fsdp=1, tensor=4) no all-gather makes a q_proj / k_proj kernel (nor a q/k
    activation) with all its heads, in the forward or the gradient, for every norm
    implementation (Pallas: interpret mode) and QK-norm kind; logits, loss and gradients
    equal one device's. (Before the fix, Pallas with `qk_norm: head` gathered both kernels in
    the forward, and the kernels and the q/k cotangents in the gradient.)"""
    cfg = QK_CFG.replace(qk_norm=qk_norm)
    mesh = make_mesh(2, 1, 4)
    if (norm_impl, qk_norm) == ("pallas", "full"):  # rows span the head shards: refused, not silently replaced
        with pytest.raises(UnsupportedFeatureError, match="cannot run qk_norm='full' with its heads split"):
            _forward_and_grad(cfg, mesh, norm_impl)
        return
    want_logits, want_loss, want_grads, _ = _forward_and_grad(cfg, None, norm_impl)
    logits, loss, grads, hlos = _forward_and_grad(cfg, mesh, norm_impl)
    for what, hlo in zip(("forward", "gradient"), hlos):
        bad = [shape for shape in _gathered(hlo) if _whole_heads(shape, cfg)]
        assert not bad, f"{what}: q/k projections (kernels or activations) all-gathered over their heads: {bad}"
    np.testing.assert_allclose(logits, want_logits, atol=5e-5, rtol=5e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_leaves_match(grads, want_grads)
