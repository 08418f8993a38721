"""Mixture of experts: each router against NumPy, the dispatches against the dense oracle
(values and gradients), capacity drops counted, the balance losses, auxiliary-loss-free
balancing, the layer pattern through the scan, accounting and the config's errors."""

import json
import math
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from modern_jax import execution
from modern_jax.accounting import param_counts
from modern_jax.cli import main
from modern_jax.config import ModelConfig
from modern_jax.execution import ExecutionConfig
from modern_jax.kernels import grouped
from modern_jax.kernels.backend import pallas_interpret
from modern_jax.kernels.grouped import grouped_matmul
from modern_jax.layers.moe import MoE, balance_loss, route
from modern_jax.model import Transformer
from modern_jax.sharding.mesh import make_mesh
from modern_jax.training import TrainConfig, run_config_from_dict, train
from modern_jax.training.checkpoint import load_params

from common import assert_step_matches_one_device, make_trainer, token_batch


REPO = pathlib.Path(__file__).parent.parent

BASE = dict(vocab_size=61, d_model=16, n_layers=2, n_heads=2, d_ff=24, ffn_type="moe", n_experts=8,
            experts_per_token=2, expert_d_ff=12, max_position_embeddings=64)

ROUTERS = {
    "softmax_then_topk": dict(),  # Qwen3-MoE, norm_topk_prob false
    "softmax_renormalised": dict(router_norm_topk=True),  # Qwen3-MoE, norm_topk_prob true
    "topk_then_softmax": dict(router_score="topk_softmax", router_bias=True),  # Mixtral, gpt-oss
    "sigmoid_groups_bias": dict(router_score="sigmoid", router_norm_topk=True, router_scale=2.5,
                                router_selection_bias=True, router_groups=4, router_topk_groups=2),  # DeepSeek-V3
    "sigmoid_top1_on_input": dict(router_score="sigmoid", experts_per_token=1, router_on_input=True),  # Llama 4
}


def config(**overrides):
    return ModelConfig.from_dict({**BASE, **overrides})


def np_route(cfg, z, bias):
    """The routing written out row by row in float64."""
    z = np.asarray(z, np.float64)
    M, E = z.shape
    K, G = cfg.experts_per_token, cfg.router_groups
    bias = np.zeros(E) if bias is None else np.asarray(bias, np.float64)
    softmax = lambda v: np.exp(v - v.max()) / np.exp(v - v.max()).sum()  # noqa: E731
    experts, weights = np.zeros((M, K), int), np.zeros((M, K))
    for m in range(M):
        if cfg.router_score == "topk_softmax":
            s = z[m]
        elif cfg.router_score == "softmax":
            s = softmax(z[m])
        else:
            s = 1 / (1 + np.exp(-z[m]))
        choice = s + bias
        if G > 1:
            groups = choice.reshape(G, E // G)
            group_score = np.sort(groups, axis=1)[:, -2:].sum(1)
            kept = np.argsort(-group_score)[: cfg.router_topk_groups]
            choice = np.where(np.isin(np.arange(E) // (E // G), kept), choice, -np.inf)
        chosen = np.argsort(-choice, kind="stable")[:K]
        w = softmax(z[m][chosen]) if cfg.router_score == "topk_softmax" else s[chosen]
        if cfg.router_norm_topk:
            w = w / w.sum()
        experts[m], weights[m] = chosen, w * cfg.router_scale
    return experts, weights


@pytest.mark.quick
@pytest.mark.parametrize("name", list(ROUTERS))
def test_each_router_matches_numpy(name):
    cfg = config(**ROUTERS[name])
    rng = np.random.default_rng(0)
    z = jnp.asarray(rng.normal(size=(64, cfg.n_experts)) * 2, jnp.float32)
    bias = jnp.asarray(rng.normal(size=cfg.n_experts) * 0.3, jnp.float32) if cfg.router_selection_bias else None
    experts, weights, probs = route(cfg, z, bias)
    want_experts, want_weights = np_route(cfg, z, bias)
    np.testing.assert_array_equal(experts, want_experts)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.sum(probs, -1), 1.0, rtol=1e-6)


def test_selection_bias_changes_the_choice_not_the_weights():
    cfg = config(**ROUTERS["sigmoid_groups_bias"])
    rng = np.random.default_rng(1)
    z = jnp.asarray(rng.normal(size=(256, cfg.n_experts)), jnp.float32)
    bias = jnp.zeros(cfg.n_experts).at[3].set(2.0)  # expert 3 is made attractive
    plain, _, _ = route(cfg, z, None)
    biased, weights, _ = route(cfg, z, bias)
    assert np.mean(np.any(np.asarray(biased) == 3, -1)) > np.mean(np.any(np.asarray(plain) == 3, -1)) + 0.3
    s = jax.nn.sigmoid(z)
    chosen = jnp.take_along_axis(s, biased, -1)  # the weights are the unbiased scores of the chosen
    np.testing.assert_allclose(weights, chosen / chosen.sum(-1, keepdims=True) * cfg.router_scale, rtol=1e-6)


def layer_and_input(seed=0, **overrides):
    cfg = config(**overrides)
    layer = MoE(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for path, p in nnx.to_flat_state(nnx.state(layer, nnx.Param)):  # off the zero / identity init
        p.set_value(jnp.asarray(rng.normal(size=p.shape) * (0.5 if "proj" in map(str, path) else 0.3), p.dtype))
    x = jnp.asarray(rng.normal(size=(2, 12, cfg.d_model)), jnp.float32)
    return cfg, layer, x


def run_layer(layer, x, **run):
    """The layer on `x` with the execution settings `run` (moe_dispatch, moe_capacity_factor, ...)."""
    with execution.use(ExecutionConfig(**run)):
        y, sown = nnx.capture(layer, nnx.Intermediate)(x)
    return y, {str(path[0]): v.get_value()[0] for path, v in nnx.to_flat_state(sown)}


@pytest.mark.parametrize("name", list(ROUTERS) + ["gpt_oss_clamped_with_biases", "shared_experts"])
def test_dropless_grouped_dispatch_equals_the_dense_oracle_values_and_gradients(name):
    extra = {"gpt_oss_clamped_with_biases": dict(router_score="topk_softmax", router_bias=True, expert_bias=True,
                                                 expert_swiglu_limit=1.5),
             "shared_experts": dict(n_shared_experts=2, shared_expert_d_ff=8)}
    cfg, layer, x = layer_and_input(**ROUTERS.get(name, extra.get(name)))

    def loss(layer, x, kind):
        y, _ = run_layer(layer, x, moe_dispatch=kind)
        return jnp.sum(jnp.sin(y))

    dense_y, _ = run_layer(layer, x, moe_dispatch="dense")
    for kind, changes in (("grouped", {}), ("capacity", dict(moe_capacity_factor=cfg.n_experts))):
        y, sown = run_layer(layer, x, moe_dispatch=kind, **changes)
        np.testing.assert_allclose(y, dense_y, rtol=1e-5, atol=1e-5)
        assert float(sown["moe_dropped"]) == 0.0  # capacity for every token: nothing dropped
    g_dense = nnx.grad(loss, argnums=(0, 1))(layer, x, "dense")
    g_grouped = nnx.grad(loss, argnums=(0, 1))(layer, x, "grouped")
    chex.assert_trees_all_close(nnx.state(g_grouped[0], nnx.Param), nnx.state(g_dense[0], nnx.Param),
                                atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(g_grouped[1], g_dense[1], atol=1e-5, rtol=1e-4)
    router_grad = nnx.state(g_grouped[0], nnx.Param)["router"]["proj"]["kernel"].get_value()
    assert float(jnp.max(jnp.abs(router_grad))) > 1e-4  # the router learns through the weights


def test_capacity_drops_the_assignments_past_each_experts_slots_and_counts_them():
    cfg, layer, x = layer_and_input(seed=3)
    factor = 0.5
    y, sown = run_layer(layer, x, moe_dispatch="capacity", moe_capacity_factor=factor)
    x_MD = x.reshape(-1, cfg.d_model)
    M, K, E = x_MD.shape[0], cfg.experts_per_token, cfg.n_experts
    experts, weights, _, _ = layer.router(x_MD)
    experts, weights = np.asarray(experts), np.asarray(weights)
    C = math.ceil(factor * M * K / E)
    taken, kept = np.zeros(E, int), np.zeros((M, K), bool)
    for m in range(M):  # token order decides who gets a slot
        for k in range(K):
            e = experts[m, k]
            kept[m, k] = taken[e] < C
            taken[e] += 1
    assert int(sown["moe_dropped"]) == int((~kept).sum()) > 0
    def matmul(x_EMI, w_EIO, b_EO=None, reduce=False):  # every expert on every token, as the dense oracle
        y_EMO = jnp.einsum("EMI,EIO->EMO", x_EMI, w_EIO)
        return y_EMO if b_EO is None else y_EMO + b_EO[:, None]

    each = np.asarray(layer.experts(jnp.broadcast_to(x_MD, (E, M, cfg.d_model)), matmul))
    want = np.zeros_like(np.asarray(x_MD))
    for m in range(M):
        for k in range(K):
            if kept[m, k]:
                want[m] += weights[m, k] * each[experts[m, k], m]
    np.testing.assert_allclose(np.asarray(y).reshape(M, -1), want, rtol=1e-5, atol=1e-5)


STAGES = ("router_logits", "moe_dispatched", "expert_gate", "expert_up", "expert_down", "moe_combined")


@pytest.mark.parametrize("kind", ["grouped", "dense"])
def test_a_remat_policy_that_saves_a_named_stage_of_the_experts_saves_it(kind, capsys):
    _, layer, x = layer_and_input()
    graphdef, state = nnx.split(layer)

    def loss(state, x):
        with execution.use(ExecutionConfig(moe_dispatch=kind)):
            return jnp.sum(jnp.sin(nnx.merge(graphdef, state)(x)))

    for name in STAGES:
        policy = jax.checkpoint_policies.save_only_these_names(name)
        jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(loss, policy=policy), state, x)
        saved = capsys.readouterr().out
        assert f"named '{name}'" in saved, (name, saved)
        assert not any(f"named '{other}'" in saved for other in STAGES if other != name)


@pytest.mark.parametrize("sizes, W, O", [([20, 0, 13, 17], 32, 24),  # one tile: the whole small dimensions
                                          ([300, 0, 250, 150], 640, 1024)])  # 2 x 5 x 2 tiles, rows padded
def test_megablox_in_interpret_mode_equals_ragged_dot_forward_and_backward(sizes, W, O):
    rng = np.random.default_rng(0)
    Z = sum(sizes)
    x = jnp.asarray(rng.normal(size=(Z, W)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, W, O)), jnp.float32) / np.sqrt(W)
    ends = np.cumsum(sizes)
    want = np.concatenate([np.asarray(x[a:b]) @ np.asarray(w[e]) for e, (a, b) in enumerate(zip(ends - sizes, ends))])
    if Z > 512:  # float32: rows in tiles of 512, widths in the widest multiple of 128 up to 512 that divides them
        assert grouped._Tiling(512, 512)(1024, W, O) == (512, 128, 512)
    sizes = jnp.asarray(sizes, jnp.int32)

    def loss(x, w, impl):
        return jnp.sum(jnp.sin(grouped_matmul(x, w, sizes, impl=impl)))

    with pallas_interpret("tpu"):
        y = grouped_matmul(x, w, sizes, impl="megablox")
        g = jax.grad(loss, argnums=(0, 1))(x, w, "megablox")
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grouped_matmul(x, w, sizes, impl="ragged_dot"), want, rtol=1e-5, atol=1e-5)
    g_ref = jax.grad(loss, argnums=(0, 1))(x, w, "ragged_dot")
    chex.assert_trees_all_close(g, g_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("per_sequence", [False, True])
def test_balance_and_router_z_losses_match_numpy(per_sequence):
    cfg, layer, x = layer_and_input(moe_aux_per_sequence=per_sequence)
    _, sown = run_layer(layer, x)
    B, T, D = x.shape
    experts, _, probs, z = layer.router(x.reshape(-1, D))
    experts, probs, z = np.asarray(experts), np.asarray(probs, np.float64), np.asarray(z, np.float64)
    groups = np.arange(B * T) // T if per_sequence else np.zeros(B * T, int)
    losses = []
    for g in np.unique(groups):
        rows = groups == g
        f = np.array([(experts[rows] == e).sum() for e in range(cfg.n_experts)]) / (rows.sum() * cfg.experts_per_token)
        losses.append(cfg.n_experts * np.sum(f * probs[rows].mean(0)))
    np.testing.assert_allclose(sown["moe_aux_loss"], np.mean(losses), rtol=1e-6)
    lse = np.log(np.exp(z).sum(-1))
    np.testing.assert_allclose(sown["moe_router_z_loss"], np.mean(lse**2), rtol=1e-6)
    np.testing.assert_array_equal(sown["moe_load"], np.bincount(experts.ravel(), minlength=cfg.n_experts))
    uniform = balance_loss(jnp.asarray(np.arange(64).reshape(32, 2) % 8), jnp.full((32, 8), 1 / 8), 8)
    assert float(uniform) == pytest.approx(1.0)  # perfectly balanced: exactly 1


def test_a_dense_first_pattern_is_scanned_and_remat_changes_nothing():
    assert [s.moe for s in config(n_layers=5, moe_pattern="DE").layer_specs()] == [False, True, False, True, False]
    cfg = config(n_layers=5, moe_first_dense=2, n_shared_experts=1)  # DeepSeek's first-k dense
    assert [s.moe for s in cfg.layer_specs()] == [False, False, True, True, True]
    scanned = Transformer(cfg, rngs=nnx.Rngs(0))
    assert [(len(stage.unit), stage.repeats) for stage in scanned.stages] == [(1, 2), (1, 3)]
    assert [layer for layer, *_ in scanned.moe_layers()] == [2, 3, 4]
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 61, (2, 10)), jnp.int32)

    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m(toks))[..., 0])

    grads = {}
    for name, run in (("scan", ExecutionConfig()), ("unrolled_remat", ExecutionConfig(scan_layers=False, remat="full"))):
        with execution.use(run):  # jitted (traced under `run`): one compile, not one per operation
            grads[name] = nnx.jit(lambda m: (m(toks), nnx.state(nnx.grad(loss)(m), nnx.Param)))(scanned)
    np.testing.assert_allclose(grads["unrolled_remat"][0], grads["scan"][0], atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(grads["unrolled_remat"][1], grads["scan"][1], atol=1e-6, rtol=1e-5)
    dense_ffn = scanned.stages[0].blocks[0].mlp
    assert dense_ffn.up_proj.kernel.shape == (2, 16, 24)  # two stacked dense layers keep d_ff


def test_active_parameters_count_k_of_the_routed_experts():
    cfg = config(n_layers=3, moe_first_dense=1, n_shared_experts=1, shared_expert_d_ff=10, router_bias=True,
                 expert_bias=True, expert_swiglu_limit=7.0)
    counts = param_counts(cfg)
    D, E, K, F, V = 16, 8, 2, 12, 61
    attention = 4 * D * D
    norms = 2 * D
    expert = 3 * D * F + 2 * F + D  # gate, up, down and their biases
    router = D * E + E
    shared = 3 * D * 10
    dense_layer = attention + norms + 3 * D * 24
    moe_layer = attention + norms + router + E * expert + shared
    total = 2 * V * D + D + dense_layer + 2 * moe_layer
    assert counts["total"] == total
    assert counts["active"] == total - 2 * (E - K) * expert


def test_auxiliary_loss_free_balancing_moves_only_the_selection_bias():
    cfg = config(**ROUTERS["sigmoid_groups_bias"])
    mesh = make_mesh(data=-1, devices=jax.devices()[:1])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 61, (1, 4, 17))
    batch = {"inputs": tokens[..., :-1].astype(np.int32), "targets": tokens[..., 1:].astype(np.int32),
             "positions": np.broadcast_to(np.arange(16, dtype=np.int32), (1, 4, 16)).copy(),
             "segment_ids": np.ones((1, 4, 16), np.int32), "weights": np.ones((1, 4, 16), np.float32)}
    rate = 0.01
    states = {}
    for name, r in (("frozen", 0.0), ("balanced", rate)):
        trainer = make_trainer(cfg, TrainConfig(batch_size=4, seq_len=16, warmup_steps=0, weight_decay=0.5,
                                           moe_bias_update_rate=r), mesh)
        state = trainer.states.init(0)
        before = jax.device_get(state["params"])
        model = trainer.states.model(before)
        _, sown = nnx.capture(lambda m: m(jnp.asarray(batch["inputs"][0])), nnx.Intermediate)(model)
        loads = np.asarray([v.get_value()[0] for p, v in nnx.to_flat_state(sown) if "moe_load" in map(str, p)][0])
        after, metrics = trainer.train_step(state, trainer.batches.put(batch))
        states[name] = (before, jax.device_get(after["params"]), loads, metrics)
    before, after, loads, metrics = states["frozen"]
    bias_path = lambda p: p["stages"][0]["blocks"][0]["mlp"]["router"]["selection_bias"]  # noqa: E731
    np.testing.assert_array_equal(bias_path(after), bias_path(before))  # no optimiser, no weight decay
    assert not np.allclose(after["stages"][0]["blocks"][0]["mlp"]["router"]["proj"]["kernel"],
                           before["stages"][0]["blocks"][0]["mlp"]["router"]["proj"]["kernel"])
    before, after, loads, metrics = states["balanced"]
    for layer in range(cfg.n_layers):
        step = rate * np.sign(loads[layer].mean() - loads[layer])
        np.testing.assert_allclose(bias_path(after)[layer], step - step.mean(), atol=1e-7)
    np.testing.assert_allclose(metrics["moe_load_max"], loads.max(-1) / loads.mean(-1), rtol=1e-6)
    np.testing.assert_allclose(metrics["moe_load_min"], loads.min(-1) / loads.mean(-1), rtol=1e-6)


@pytest.mark.parametrize("field, value, message", [
    ("n_experts", 1, "at least 2 routed experts"),
    ("experts_per_token", 9, "expected 1 .. n_experts=8"),
    ("router_groups", 3, "must divide n_experts=8"),
    ("router_topk_groups", 5, "expected 1 .. router_groups=4"),
    ("router_on_input", True, "experts_per_token=1"),
    ("moe_pattern", "DX", "string of D, E"),
    ("moe_first_dense", 2, "no layer has experts"),
])
def test_bad_moe_fields_are_named(field, value, message):
    changes = {field: value}
    if field == "router_topk_groups":
        changes["router_groups"] = 4
    with pytest.raises(ValueError, match=message) as info:
        config(**changes)
    assert field in str(info.value)
    with pytest.raises(ValueError, match="set ffn_type='moe'"):
        ModelConfig(n_experts=4)


SMALL_MOE = {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64, "expert_d_ff": 16,
             "max_position_embeddings": 32}


def _corpus(tmp_path):
    corpus = tmp_path / "corpus.txt"
    rng = np.random.default_rng(0)
    corpus.write_text(" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "kappa", "\n"], 3000)))
    return corpus


def _run_argv(tmp_path, out, **train):
    settings = {"steps": 4, "batch_size": 8, "seq_len": 16, "warmup_steps": 1, "log_every": 1, "eval_every": 0,
                "eval_windows": 8, "eval_batch_size": 8, "final_eval_windows": 8, "checkpoint_every": 2,
                "samples": 0, "progress": False, "plot": False, "tensorboard": False, "output_dir": str(out), **train}
    return (["--config", str(REPO / "configs/moe_tiny.yaml"), "--data", str(_corpus(tmp_path)), "data.tokenizer=char",
             "model.vocab_size=auto"] + [f"model.{k}={v}" for k, v in SMALL_MOE.items()]
            + [f"train.{k}={json.dumps(v)}" for k, v in settings.items()])


def test_moe_tiny_trains_evaluates_generates_and_reports_its_counts_from_the_cli(tmp_path, capsys):
    assert main(["train", *_run_argv(tmp_path, tmp_path / "run")]) == 0, capsys.readouterr().err
    records = [r for r in map(json.loads, (tmp_path / "run/metrics.jsonl").read_text().splitlines())
               if r["split"] == "train"]
    assert len(records) == 4
    for r in records:  # one figure per MoE layer; the max load is at least the mean, the min at most
        assert len(r["moe_load_max"]) == len(r["moe_load_min"]) == 2
        assert min(r["moe_load_max"]) >= 1.0 >= max(r["moe_load_min"]) >= 0.0
        assert r["moe_aux_loss"] > 0 and r["moe_router_z_loss"] > 0 and r["moe_dropped"] == 0
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(tmp_path / "run"), "--max-windows", "4"]) == 0
    assert "bits_per_byte: " in capsys.readouterr().out
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "alpha", "--greedy",
                 "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("alpha")
    # to transformers' qwen3_moe layout and back: the same logits
    assert main(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf"),
                 "--model-type", "qwen3_moe"]) == 0
    assert json.loads((tmp_path / "hf/config.json").read_text())["model_type"] == "qwen3_moe"
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    capsys.readouterr()
    logits = []
    for path in (tmp_path / "run", tmp_path / "back"):
        cfg, params, _, _ = load_params(path)
        model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))), params)
        logits.append(np.asarray(model(jnp.arange(12, dtype=jnp.int32)[None] % cfg.vocab_size)))
    np.testing.assert_array_equal(logits[0], logits[1])
    assert main(["info", "--config", str(REPO / "configs/moe_tiny.yaml")]) == 0
    out = capsys.readouterr().out
    counts = {line.split(": ")[0]: int(line.split(": ")[1]) for line in out.splitlines()
              if line.split(": ")[0] in ("parameters", "active parameters")}
    D, F, E, K, L = 128, 192, 8, 2, 4
    assert counts["parameters"] - counts["active parameters"] == L * (E - K) * 3 * D * F


def test_the_selection_bias_survives_a_resume_exactly(tmp_path):
    """8 steps straight vs 4, stop, resume for 4, with auxiliary-loss-free balancing on: the same
    losses, loads and final selection biases bit for bit."""
    corpus = _corpus(tmp_path)

    def run(out):
        model = dict(yaml.safe_load((REPO / "configs/moe_tiny.yaml").read_text())["model"], **SMALL_MOE,
                     vocab_size="auto", router_score="sigmoid", router_selection_bias=True)
        settings = {"steps": 8, "batch_size": 4, "seq_len": 16, "warmup_steps": 1, "log_every": 1, "eval_every": 0,
                    "eval_windows": 4, "eval_batch_size": 4, "final_eval_windows": 4, "checkpoint_every": 4,
                    "samples": 0, "progress": False, "plot": False, "tensorboard": False, "output_dir": str(out),
                    "moe_bias_update_rate": 0.01}
        return run_config_from_dict({"model": model, "train": settings,
                                     "data": {"path": str(corpus), "tokenizer": "char"}})

    quiet = {"mesh": make_mesh(data=-1, devices=jax.devices()[:1]), "log": lambda *_: None}
    straight = train(run(tmp_path / "a"), **quiet)
    first = train(run(tmp_path / "b"), stop_after=4, **quiet)
    assert first.interrupted and first.step == 4
    second = train(run(tmp_path / "b"), **quiet)
    trace = lambda history: [(h["step"], h["loss"], h["moe_load_max"]) for h in history]  # noqa: E731
    assert trace(first.history + second.history) == trace(straight.history)
    biases = []
    for name in ("a", "b"):
        _, params, _, _ = load_params(tmp_path / name / "checkpoints" / "8")
        biases.append(np.asarray(params["stages"][0]["blocks"][0]["mlp"]["router"]["selection_bias"]))
    assert np.any(biases[0] != 0.0)  # it moved
    np.testing.assert_array_equal(biases[0], biases[1])


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (2, 1, 4)], ids=["2x2x2", "2x1x4"])
def test_a_moe_training_step_on_a_mesh_equals_one_device(mesh_shape):
    """Data, FSDP and tensor parallelism (experts replicated, their width split over `tensor`),
    with shared experts and auxiliary-loss-free balancing: the loss, the loads and every gradient
    leaf (the selection biases' moves included) equal the single-device step."""
    cfg = config(vocab_size=128, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_experts=4, expert_d_ff=32,
                 n_shared_experts=1, router_score="sigmoid", router_selection_bias=True)
    tc = TrainConfig(batch_size=8, seq_len=16, moe_bias_update_rate=0.01)
    many, one = assert_step_matches_one_device(cfg, tc, make_mesh(*mesh_shape), token_batch(1, 8, 16, 128))
    np.testing.assert_allclose(many["moe_load_max"], one["moe_load_max"], rtol=1e-6)


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (shard_map, custom_vjp, scan, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in (param if isinstance(param, (tuple, list)) else [param]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


@pytest.mark.parametrize("mesh_axes, gathered", [(dict(fsdp=8), jnp.bfloat16), (dict(data=2, expert=4), jnp.float32)],
                         ids=["fsdp8", "data2_expert4"])
def test_a_bf16_mixture_writes_no_float32_rows_and_gathers_whole_experts_in_bf16(mesh_axes, gathered):
    """In bfloat16 the grouped matmuls write bfloat16 rows (they accumulate in float32 inside:
    a float32 `[Z, O]` output was 2.4 GiB per chip of Mixtral on 32 v5p), forward and backward;
    with every expert on every device their weights enter the dispatch in bfloat16, so they
    are gathered in it (Mixtral on fsdp 32: 1.75 GiB per chip); split over `expert` they enter in
    float32 (that measured less there). The router's logits stay float32."""
    from modern_jax.sharding import logical_rules

    cfg = config(dtype="bfloat16", d_model=32, n_experts=8, expert_d_ff=16)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = jnp.ones((8, 4, 32), jnp.bfloat16)
    with logical_rules(make_mesh(**mesh_axes)):
        jaxpr = jax.make_jaxpr(jax.grad(lambda m, x: jnp.sum(m(x).astype(jnp.float32))))(moe, x)
    eqns = list(_eqns(jaxpr.jaxpr))
    matmuls = [e for e in eqns if e.primitive.name == "ragged_dot_general"]
    assert len(matmuls) >= 6  # gate, up, down; forward and backward
    assert {str(v.aval.dtype) for e in matmuls for v in e.outvars} == {"bfloat16"}
    dispatch = next(e for e in eqns if e.primitive.name == "shard_map")  # the forward's
    weights = [v.aval for v in dispatch.invars if v.aval.ndim == 3]  # gate, up, down: [E, W, O]
    assert len(weights) == 3 and {w.dtype for w in weights} == {jnp.dtype(gathered)}
    router = [e for e in eqns if e.primitive.name == "dot_general" and e.outvars[0].aval.shape == (32, 8)]
    assert router and all(e.outvars[0].aval.dtype == jnp.float32 for e in router)
