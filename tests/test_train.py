"""Training: the loss against a naive reference, overfitting, exact resume, a hard kill while
saving, the non-finite guard, and the CLI's errors."""

import io
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from flax import nnx

from modern_jax.cli import main
from modern_jax import execution
from modern_jax.config import ModelConfig
from modern_jax.execution import ExecutionConfig
from modern_jax.model import Transformer, abstract_params
from modern_jax.sharding.mesh import make_mesh
from modern_jax.training import TrainConfig, TrainingDiverged, run_config_from_dict, train
from modern_jax.training.checkpoint import Checkpointer
from modern_jax.training.loop import save_if_finite
from modern_jax.training.loss import loss_sums, model_loss_sums
from modern_jax.training.optimizer import decay_mask, learning_rate_schedule

from common import QUICK_FLAG, assert_leaves_match, leaves, make_trainer, probe, step_gradients

REPO = pathlib.Path(__file__).parent.parent


def one_device():
    return make_mesh(data=-1, devices=jax.devices()[:1])
TINY_MODEL = {"vocab_size": "auto", "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64,
              "max_position_embeddings": 32, "qk_norm": "head"}


def naive_loss(z_BTV, targets_BT, weights_BT):
    z = np.asarray(z_BTV, np.float64)
    lse = np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1)) + z.max(-1)
    z_target = np.take_along_axis(z, np.asarray(targets_BT)[..., None], -1)[..., 0]
    w = np.asarray(weights_BT, np.float64)
    return np.sum(w * (lse - z_target)), np.sum(w * lse**2), np.abs(z).max()


@pytest.mark.parametrize("chunk", [64, 16, 7])  # one chunk; four; a last chunk running past V
@pytest.mark.parametrize("softcap, bias", [(None, False), (5.0, True)])
def test_loss_matches_naive_reference_and_chunks_agree(chunk, softcap, bias):
    rng = np.random.default_rng(0)
    B, T, D, V = 2, 5, 8, 50
    h = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(V, D)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(V,)), jnp.float32) if bias else None
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    weights = jnp.asarray(rng.random((B, T)) > 0.3, jnp.float32)
    sums = loss_sums(h, w, b, targets, weights, softcap=softcap, chunk=chunk)
    z = np.einsum("btd,vd->btv", h, w) + (0 if b is None else np.asarray(b))
    if softcap:
        z = softcap * np.tanh(z / softcap)
    ce, zl, max_abs = naive_loss(z, targets, weights)
    np.testing.assert_allclose(sums["ce"], ce, rtol=1e-5)
    np.testing.assert_allclose(sums["z_loss"], zl, rtol=1e-5)
    np.testing.assert_allclose(sums["max_abs_logit"], max_abs, rtol=1e-5)
    assert sums["weight"] == weights.sum()

    def objective(h, w, chunk):
        s = loss_sums(h, w, b, targets, weights, softcap=softcap, chunk=chunk)
        return s["ce"] + 1e-2 * s["z_loss"]

    g_chunked = jax.grad(objective, argnums=(0, 1))(h, w, chunk)
    g_whole = jax.grad(objective, argnums=(0, 1))(h, w, V)
    for a, c in zip(g_chunked, g_whole):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)


@pytest.mark.quick
def test_padding_is_masked():
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(1, 6, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(20, 8)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 20, (1, 6)), jnp.int32)
    weights = jnp.asarray([[1, 1, 1, 1, 0, 0]], jnp.float32)
    full = loss_sums(h, w, None, targets, weights, chunk=8)
    other = loss_sums(h, w, None, targets.at[0, 4:].set(3), weights, chunk=8)  # padding targets change
    cut = loss_sums(h[:, :4], w, None, targets[:, :4], weights[:, :4], chunk=8)
    for k in ("ce", "z_loss", "weight"):
        assert full[k] == pytest.approx(float(other[k])) == pytest.approx(float(cut[k]))


@pytest.mark.parametrize("tie", [True, False])
def test_model_loss_equals_cross_entropy_of_the_model_logits(tie):
    cfg = ModelConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, tie_embeddings=tie, head_bias=not tie,
                      final_softcap=None if tie else 3.0)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(2)
    batch = {"inputs": jnp.asarray(rng.integers(0, 40, (2, 8)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, 40, (2, 8)), jnp.int32),
             "positions": jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1)),
             "segment_ids": jnp.ones((2, 8), jnp.int32), "weights": jnp.ones((2, 8), jnp.float32)}
    sums = nnx.jit(lambda model, batch: model_loss_sums(model, batch, chunk=16))(model, batch)
    logits = nnx.jit(lambda model, tokens: model(tokens))(model, batch["inputs"])
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).sum()
    np.testing.assert_allclose(sums["ce"], expected, rtol=1e-5)
    assert model.head().w_VD.shape == (40, 16)


@pytest.mark.quick
def test_weight_decay_mask_and_schedules():
    cfg = ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, qk_norm="head", qkv_bias=True)
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param))
    flat = {"/".join(str(getattr(k, "key", k)) for k in p): m for p, m in
            jax.tree_util.tree_flatten_with_path(decay_mask(params, ("embedding", "norm", "bias")))[0]}
    decayed = {k for k, m in flat.items() if m}
    assert decayed and all(k.endswith("kernel") for k in decayed)
    assert not flat["embed_tokens"] and not flat["norm/weight"]
    assert not any(m for k, m in flat.items() if "q_norm" in k or k.endswith("bias"))
    for schedule in ("cosine", "wsd"):
        lr = learning_rate_schedule(TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1,
                                                schedule=schedule, decay_fraction=0.2))
        assert float(lr(0)) == 0.0 and float(lr(10)) == pytest.approx(1.0) and float(lr(100)) == pytest.approx(0.1)
        if schedule == "wsd":
            assert float(lr(79)) == pytest.approx(1.0) and 0.1 < float(lr(90)) < 1.0


def _batch(rng, A, B, T, V):
    tokens = rng.integers(0, V, (A, B, T + 1))
    return {"inputs": tokens[..., :-1].astype(np.int32), "targets": tokens[..., 1:].astype(np.int32),
            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (A, B, T)).copy(),
            "segment_ids": np.ones((A, B, T), np.int32), "weights": np.ones((A, B, T), np.float32)}


@pytest.mark.parametrize("scan, remat", [(True, "full"), (False, "none")])
def test_moe_aux_loss_sown_by_layers_joins_the_loss(monkeypatch, scan, remat):
    """A layer that sows `moe_aux_loss` (as a mixture-of-experts router does): the stages carry
    it through the scan and the trainer adds moe_aux_weight x its sum to the objective. Here each
    FFN sows ||W_up||^2, so the reference is computed from the parameters alone."""
    from modern_jax.layers.ffn import FFN
    from modern_jax.training.optimizer import global_norm

    original = FFN.__call__

    def sowing(self, x_BTD):
        self.sow(nnx.Intermediate, "moe_aux_loss", jnp.sum(jnp.square(self.up_proj.kernel[...])))
        return original(self, x_BTD)

    monkeypatch.setattr(FFN, "__call__", sowing)
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=3, n_heads=2, d_ff=64)
    tc = TrainConfig(steps=10, batch_size=4, seq_len=16, warmup_steps=0, moe_aux_weight=0.5)
    trainer = make_trainer(cfg, tc, one_device(), execution=ExecutionConfig(scan_layers=scan, remat=remat))
    state = trainer.states.init(0)
    data = _batch(np.random.default_rng(0), 1, 4, 16, 32)
    micro = jax.tree.map(lambda x: jnp.asarray(x[0]), data)

    def up_norms(params):  # the stacked [layers, D, F] up projections
        return sum(jnp.sum(jnp.square(stage["blocks"][0]["mlp"]["up_proj"]["kernel"])) for stage in params["stages"].values())

    def reference(params):
        sums, _ = nnx.capture(lambda model: model_loss_sums(model, micro), nnx.Intermediate)(trainer.states.model(params))
        return (sums["ce"] + tc.z_loss_weight * sums["z_loss"]) / sums["weight"] + 0.5 * up_norms(params)

    params = jax.device_get(state["params"])
    want_aux, want_norm = float(up_norms(params)), float(global_norm(jax.grad(reference)(params)))
    _, metrics = trainer.train_step(state, trainer.batches.put(data))
    assert float(metrics["moe_aux_loss"]) == pytest.approx(want_aux, rel=1e-6)
    assert float(metrics["grad_norm"]) == pytest.approx(want_norm, rel=1e-5)


def test_every_term_of_the_objective_against_a_hand_computation(monkeypatch):
    """The step's objective, term by term, recomputed here from the model's logits and each MoE
    layer's router logits z (an unscanned copy of the same parameters records them):

        (CE + z_loss_weight z-loss) / sum w  +  moe_aux_weight sum_layers E sum_e f_e P_e
                                             +  moe_router_z_weight sum_layers mean lse(z)^2

    The reported terms equal the hand ones (1e-5), and the step's gradient (read back from its
    update, `common.step_gradients`) equals the gradient of the hand objective leaf by leaf;
    without any one term the hand gradient moves by far more than that tolerance."""
    from modern_jax.layers.moe import Router

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, ffn_type="moe", n_experts=4,
                      experts_per_token=2, expert_d_ff=16)
    tc = probe(TrainConfig(batch_size=4, seq_len=8, z_loss_weight=0.1, moe_aux_weight=0.5, moe_router_z_weight=0.1))
    trainer = make_trainer(cfg, tc, one_device())
    state = trainer.states.init(0)
    params = jax.device_get(state["params"])
    data = _batch(np.random.default_rng(1), 1, 4, 8, 64)
    data["weights"] = (np.random.default_rng(2).random((1, 4, 8)) > 0.25).astype(np.float32)  # some padding
    micro = jax.tree.map(lambda x: jnp.asarray(x[0]), data)
    graphdef, _ = abstract_params(cfg)
    router_logits = []
    recorded = Router.__call__

    def recording(self, x_MD):
        out = recorded(self, x_MD)
        router_logits.append(out[3])  # z[M, E]
        return out

    def terms(params):
        router_logits.clear()
        with monkeypatch.context() as patch:
            patch.setattr(Router, "__call__", recording)
            z_BTV = nnx.merge(graphdef, params)(micro["inputs"])
        lse_BT = jax.nn.logsumexp(z_BTV, axis=-1)
        z_target_BT = jnp.take_along_axis(z_BTV, micro["targets"][..., None], axis=-1)[..., 0]
        w_BT = micro["weights"]
        balance, router_z = 0.0, 0.0
        for z_ME in router_logits:
            s_ME = jax.nn.softmax(z_ME, axis=-1)
            chosen_ME = jax.nn.one_hot(jnp.argsort(-s_ME, axis=-1)[:, :2], 4).sum(axis=1)  # the top 2
            f_E, P_E = chosen_ME.mean(axis=0) / 2, s_ME.mean(axis=0)
            balance = balance + 4 * jnp.sum(f_E * P_E)
            router_z = router_z + jnp.mean(jax.nn.logsumexp(z_ME, axis=-1) ** 2)
        return {"ce": jnp.sum(w_BT * (lse_BT - z_target_BT)) / jnp.sum(w_BT),
                "z": jnp.sum(w_BT * lse_BT**2) / jnp.sum(w_BT), "balance": balance, "router_z": router_z}

    names = ("ce", "z", "balance", "router_z")
    with execution.use(ExecutionConfig(scan_layers=False)):  # layer by layer: each MoE layer's own router call
        hand, term_grads = jax.jit(lambda p: (terms(p), {k: jax.grad(lambda p: terms(p)[k])(p) for k in names}))(params)
    assert len(router_logits) == 2  # one per MoE layer
    grads, metrics = step_gradients(trainer, state, data)
    for metric, term in [("loss", "ce"), ("z_loss", "z"), ("moe_aux_loss", "balance"), ("moe_router_z_loss", "router_z")]:
        assert float(metrics[metric]) == pytest.approx(float(hand[term]), rel=1e-5), metric
    weights = {"ce": 1.0, "z": tc.z_loss_weight, "balance": tc.moe_aux_weight, "router_z": tc.moe_router_z_weight}
    weighted = {term: jax.tree.map(lambda g: weights[term] * g, term_grads[term]) for term in names}
    want = jax.tree.map(lambda *g: sum(g), *weighted.values())
    assert_leaves_match(grads, want)
    for term in names:  # each term moves the gradient well past the tolerance: dropping it fails
        part = leaves(weighted[term])
        moved = max(np.linalg.norm(part[k]) / max(np.linalg.norm(w), 1e-30) for k, w in leaves(want).items())
        assert moved > 1e-2, (term, moved)


def test_tiny_model_overfits_one_batch():
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    tc = TrainConfig(steps=80, batch_size=4, seq_len=16, lr=1e-2, warmup_steps=5, weight_decay=0.0)
    trainer = make_trainer(cfg, tc, one_device())
    state = trainer.states.init(0)
    batch = trainer.batches.put(_batch(np.random.default_rng(0), 1, 4, 16, 32))
    losses = []
    for _ in range(tc.steps):
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[0] > 3.0  # ~ln 32 at init
    assert losses[-1] < 0.2, losses[-10:]  # 64 random tokens memorised


def test_gradient_accumulation_equals_the_full_batch_and_nonfinite_steps_are_skipped():
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    mesh = one_device()
    data = _batch(np.random.default_rng(3), 1, 4, 8, 32)
    results = []
    for accum in (1, 2):
        trainer = make_trainer(cfg, TrainConfig(batch_size=4, seq_len=8, grad_accum=accum, warmup_steps=0), mesh)
        batch = {k: v.reshape(accum, 4 // accum, 8) for k, v in data.items()}
        results.append(trainer.train_step(trainer.states.init(0), trainer.batches.put(batch)))
    (s1, m1), (s2, m2) = results
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s2["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

    trainer = make_trainer(cfg, TrainConfig(batch_size=4, seq_len=8, warmup_steps=0), mesh)
    state = trainer.states.init(0)
    before = jax.tree.map(np.asarray, state["params"])
    bad = dict(data, weights=np.full_like(data["weights"], np.nan))
    state, metrics = trainer.train_step(state, trainer.batches.put(bad))
    assert not bool(metrics["finite"]) and int(state["nonfinite"]) == 1 and int(state["step"]) == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state["params"])):
        np.testing.assert_array_equal(a, b)  # the update was skipped
    state, metrics = trainer.train_step(state, trainer.batches.put(data))
    assert bool(metrics["finite"]) and int(state["nonfinite"]) == 0


def _tiny_run(tmp_path, **train):
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        rng = np.random.default_rng(0)
        words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "\n"]
        corpus.write_text(" ".join(rng.choice(words, 4000)))
    settings = {"steps": 8, "batch_size": 4, "seq_len": 16, "warmup_steps": 2, "log_every": 1, "eval_every": 4,
                "eval_windows": 8, "eval_batch_size": 4, "final_eval_windows": 8, "checkpoint_every": 4,
                "samples": 1, "sample_tokens": 8, "progress": False, "plot": False, "async_checkpoints": True,
                "output_dir": str(tmp_path / "run"), **train}
    return run_config_from_dict({"model": TINY_MODEL, "train": settings,
                                 "data": {"path": str(corpus), "tokenizer": "char"}})


def test_resume_is_exact(tmp_path):
    """8 steps straight vs 4, stop, resume for 4: the same losses bit for bit (tolerance 0) on
    the same batches (the data iterator's position is in the checkpoint)."""
    quiet = {"mesh": one_device(), "log": lambda *_: None}
    straight = train(_tiny_run(tmp_path, output_dir=str(tmp_path / "a")), **quiet)
    first = train(_tiny_run(tmp_path, output_dir=str(tmp_path / "b")), stop_after=4, **quiet)
    assert first.interrupted and first.step == 4
    meta = json.loads((tmp_path / "b/checkpoints/4/meta/metadata").read_text())
    assert meta["step"] == 4 and meta["data"]["next_index"] == 4
    second = train(_tiny_run(tmp_path, output_dir=str(tmp_path / "b")), **quiet)
    losses = [h["loss"] for h in straight.history]
    resumed = [h["loss"] for h in first.history + second.history]
    assert [h["step"] for h in first.history + second.history] == list(range(1, 9))
    assert resumed == losses
    assert second.val_loss == straight.val_loss
    assert (tmp_path / "b/metrics.jsonl").exists() and (tmp_path / "b/samples.txt").exists()


def test_sigterm_saves_a_checkpoint_and_stops(tmp_path):
    def log(message):  # the loop is about to start: deliver SIGTERM to ourselves
        if message.startswith("model:"):
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    result = train(_tiny_run(tmp_path, checkpoint_every=100), mesh=one_device(), log=log)
    assert result.interrupted and result.step == 1
    assert Checkpointer(tmp_path / "run/checkpoints").latest_step() == 1
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is removed again


@pytest.mark.quick
def test_a_run_with_harness_tasks_and_no_benchmarks_is_refused_before_writing(tmp_path):
    """Training does not import the harness: `train` is given what scores train.harness_tasks
    (`modern-jax train` passes `harness.Benchmarks`). Without it such a run is refused in one line
    naming the field and the fix, before the run directory is made."""
    run = _tiny_run(tmp_path, harness_tasks=["sums_choice"])
    with pytest.raises(ValueError, match=r"^train\.harness_tasks=\['sums_choice'\] needs .*"
                                         r"benchmarks=modern_jax\.harness\.Benchmarks") as refused:
        train(run, mesh=one_device(), log=lambda *_: None)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()


def test_bf16_compute_keeps_float32_master_weights():
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=32, dtype="bfloat16")
    trainer = make_trainer(cfg, TrainConfig(batch_size=2, seq_len=8, warmup_steps=0), one_device())
    batch = trainer.batches.put(_batch(np.random.default_rng(4), 1, 2, 8, 32))
    state, metrics = trainer.train_step(trainer.states.init(0), batch)
    assert bool(metrics["finite"]) and 2.5 < float(metrics["loss"]) < 4.5
    assert {x.dtype for x in jax.tree.leaves(state["params"])} == {jnp.dtype(jnp.float32)}


def test_a_run_killed_while_saving_resumes_from_the_previous_complete_checkpoint(tmp_path):
    run = _tiny_run(tmp_path, steps=400, checkpoint_every=3, eval_every=0, log_every=50, samples=0)
    config = tmp_path / "run.yaml"
    import yaml

    config.write_text(yaml.safe_dump(run.to_dict()))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=QUICK_FLAG)
    proc = subprocess.Popen([sys.executable, "-m", "modern_jax.cli", "train", "--config", str(config)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = tmp_path / "run" / "checkpoints"
    deadline, killed_during_save = time.monotonic() + 120, False
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            names = [p.name for p in checkpoints.iterdir()] if checkpoints.exists() else []
            complete = [n for n in names if n.isdigit()]
            if complete and any("tmp" in n for n in names):  # a save is in flight
                proc.send_signal(signal.SIGKILL)
                killed_during_save = True
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert killed_during_save, "never caught a save in flight"
    complete = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert complete, "no complete checkpoint before the kill"
    messages = []
    result = train(_tiny_run(tmp_path, steps=complete[-1] + 2, checkpoint_every=3, eval_every=0, samples=0),
                   mesh=one_device(), log=messages.append)
    assert any(f"at step {complete[-1]}" in m for m in messages), messages
    assert result.step == complete[-1] + 2 and result.history[0]["step"] == complete[-1] + 1
    assert not any("tmp" in p.name for p in checkpoints.iterdir())


def test_nonfinite_steps_in_a_row_stop_the_run(tmp_path, monkeypatch):
    import modern_jax.training.objectives.next_token as next_token
    import modern_jax.training.programs as programs_module

    original = next_token.model_loss_sums
    monkeypatch.setattr(programs_module, "_EXECUTABLES", {})  # compile the patched loss, not a cached step
    monkeypatch.setattr(next_token, "model_loss_sums",
                        lambda *a, **k: dict(original(*a, **k), ce=jnp.float32(np.nan)))
    with pytest.raises(TrainingDiverged, match="3 non-finite steps in a row .* no checkpoint has been written yet\\. "):
        train(_tiny_run(tmp_path, max_nonfinite_steps=3, samples=0), mesh=one_device(), log=lambda *_: None)
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records] == [1, 1, 1]


def test_checkpoint_is_not_written_from_nonfinite_parameters(tmp_path):
    cfg = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, d_ff=16)
    trainer = make_trainer(cfg, TrainConfig(batch_size=2, seq_len=4, warmup_steps=0), one_device())
    state = trainer.states.init(0)
    assert trainer.states.all_finite(state["params"])
    ckpt = Checkpointer(tmp_path / "c", async_save=False)
    assert save_if_finite(ckpt, trainer, state, {"step": 1, "data": {}}, log=lambda *_: None)
    state["params"]["embed_tokens"] = state["params"]["embed_tokens"].at[0, 0].set(jnp.inf)
    messages = []
    assert not save_if_finite(ckpt, trainer, state, {"step": 2, "data": {}}, log=messages.append)
    assert ckpt.latest_step() == 1 and "not finite" in messages[0]
    ckpt.close()


def test_cli_train_evaluate_generate(tmp_path, capsys, monkeypatch):
    run = _tiny_run(tmp_path, steps=4, eval_every=0, checkpoint_every=0, batch_size=8, eval_batch_size=8)
    overrides = [f"model.{k}={v}" for k, v in TINY_MODEL.items()]
    keys = ("steps", "batch_size", "seq_len", "warmup_steps", "eval_every", "eval_windows", "eval_batch_size",
            "final_eval_windows", "checkpoint_every", "sample_tokens", "progress", "plot", "output_dir")
    overrides += [f"train.{k}={json.dumps(getattr(run.train, k))}" for k in keys] + ["train.lr=3e-3"]
    code = main(["train", "--config", str(REPO / "configs/tiny.yaml"), "--data", str(tmp_path / "corpus.txt"),
                 "data.tokenizer=char", *overrides])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, captured.err
    lines = out.splitlines()
    val_loss = next(line for line in lines if line.startswith("val_loss: "))
    assert any(line.startswith("tokens_per_s: ") for line in lines)
    # with no flags, evaluate scores the windows of the run's final evaluation (8 of the split's 134), says so
    # first, and its loss is the run's val_loss
    assert main(["evaluate", "--checkpoint", str(tmp_path / "run")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("scored: 8 windows of 16 tokens spread evenly over the 134 of the val split; the windows of the "
                        "run's final evaluation (train.final_eval_windows=8): at its last step, loss is its val_loss")
    assert next(line for line in lines if line.startswith("loss: ")) == val_loss.replace("val_", "")
    assert "bits_per_byte: " in lines[-1]
    assert main(["evaluate", "--checkpoint", str(tmp_path / "run"), "--max-windows", "all"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("scored: all 134 windows of 16 tokens of the val split, end to end; the run's final evaluation "
                        "scored 8 windows of 16 tokens of the val split (train.final_eval_windows=8, "
                        "train.seq_len=16): with no --max-windows, --seq-len, --split or --data, evaluate scores those")
    assert next(line for line in lines if line.startswith("loss: ")) != val_loss.replace("val_", "")
    # the default batch (the run's train.eval_batch_size, 8) lowered to what fits, said so; the same windows
    import modern_jax.accounting as accounting

    fits = accounting.check_fits

    def two_fit(program, compile_at, sizes, **kw):  # a device with room for 2 windows a batch
        if sizes["batch_size"] > 2:
            raise accounting.DoesNotFit(program, 8, 2, "one device", sizes, "batch_size", 2)
        return fits(program, compile_at, sizes, **kw)

    monkeypatch.setattr(accounting, "check_fits", two_fit)
    assert main(["evaluate", "--checkpoint", str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    assert "batches of 2 windows, the most that fit (the default, 8, does not)" in captured.err
    assert next(line for line in captured.out.splitlines() if line.startswith("loss: ")) == \
        val_loss.replace("val_", "")
    assert main(["evaluate", "--checkpoint", str(tmp_path / "run"), "--batch-size", "8"]) == 2  # asked for: refused
    assert "lower --batch-size (at most about 2 fit)" in capsys.readouterr().err
    monkeypatch.undo()
    assert main(["evaluate", "--checkpoint", str(tmp_path / "run/checkpoints/4"), "--data",
                 str(tmp_path / "corpus.txt"), "--max-windows", "4"]) == 0
    assert "loss: " in capsys.readouterr().out
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "alpha", "--greedy",
                 "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("alpha")


@pytest.mark.parametrize("argv, message", [
    (["train", "train.steps"], "bad override 'train.steps'"),
    (["train", "train.stpes=3"], "unknown key train.stpes; did you mean steps"),
    (["train", "trian.steps=3"], "unknown section 'trian'; did you mean train"),
    (["train", "train.steps=-1"], "TrainConfig.steps=-1 is invalid"),
    (["train", "train.lr=fast"], "TrainConfig.lr='fast' is invalid: expected a number"),
    (["train", "--data", "/no/such/file.txt", "train.output_dir=x"], "data.path='/no/such/file.txt' does not exist"),
    (["train", "data.source=text"], "DataConfig.path=None is invalid"),
    (["train", "--config", "/no/such.yaml"], "config file '/no/such.yaml' does not exist"),
    (["evaluate", "--checkpoint", "/no/such/dir"], "is not a directory"),
    (["train", "--mesh", "data=3"],
     "mesh stage=1 x data=3 x fsdp=1 x expert=1 x context=1 x tensor=1 needs 3 devices but 8 are available"),
    (["train", "--mesh", "tensor=two"], "SIZE must be an integer"),
    (["train", "parallel.tensor=0"], "ParallelConfig.tensor=0 is invalid"),
    (["train", "parallel.data=-1", "parallel.fsdp=-1"], "only one of stage, data, fsdp, expert, context, tensor may be -1"),
    (["train", "parallel.rules.embedd=null"], "ParallelConfig.rules.embedd=None is invalid: not a logical axis; did "
                                              "you mean embed"),
    (["train", "parallel.rules.mlp=tensr"], "ParallelConfig.rules.mlp='tensr' is invalid: expected null, a mesh axis"),
])
def test_cli_errors_are_clear(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_cli_train_on_a_yaml_mesh_with_rule_overrides_matches_one_device(tmp_path, capsys):
    """`train --mesh data=2,fsdp=2,tensor=2` with `parallel.rules` from the run file: the rules
    reach the Trainer (the overridden axis is not split) and the losses equal one device's."""
    run = _tiny_run(tmp_path, steps=3, eval_every=0, checkpoint_every=0, batch_size=8, eval_batch_size=8,
                    samples=0, output_dir=str(tmp_path / "one"))
    single = train(run, mesh=one_device(), log=lambda *_: None)
    config = tmp_path / "run.yaml"
    raw = run.to_dict()
    raw["train"]["output_dir"] = str(tmp_path / "mesh")
    raw["parallel"] = {"rules": {"mlp": None}}  # keep the MLP whole on every tensor device
    config.write_text(yaml.safe_dump(raw))
    assert main(["train", "--config", str(config), "--mesh", "data=2,fsdp=2,tensor=2"]) == 0, capsys.readouterr().err
    saved = yaml.safe_load((tmp_path / "mesh/config.yaml").read_text())["parallel"]
    assert saved == {"stage": 1, "data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2,
                     "context_layout": "two_chunk", "context_strategy": "all_gather", "moe_exchange": "all_to_all",
                     "moe_exchange_factor": None, "microbatches": 1, "pipeline_schedule": "gpipe",
                     "stage_repeats": 1, "rules": {"mlp": None}}
    logged = [json.loads(line) for line in (tmp_path / "mesh/metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in logged if r.get("split") == "train"]
    np.testing.assert_allclose(losses, [h["loss"] for h in single.history], rtol=2e-5)

    saved_run = run_config_from_dict(yaml.safe_load((tmp_path / "mesh/config.yaml").read_text()))
    trainer = make_trainer(saved_run.model, saved_run.train, saved_run.parallel.mesh(),
                      rules=saved_run.parallel.rules_table())
    block = trainer.states.shardings["params"]["stages"][0]["blocks"][0]
    assert tuple(block["mlp"]["up_proj"]["kernel"].spec) == (None, "fsdp", None)  # the override: MLP whole
    assert tuple(block["self_attn"]["q_proj"]["kernel"].spec) == (None, "fsdp", "tensor", None)  # default rules


def _tensorboard_scalars(directory) -> dict:
    """`{tag: {step: value}}` from the TensorBoard event files under `directory` (TFRecord framing:
    length, its CRC, an `Event` proto, its CRC)."""
    import struct

    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in sorted(pathlib.Path(directory).glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + n])
            at += 12 + n + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


class _FakeWandb:
    """Stands in for the `wandb` module: records init's arguments and every log call."""

    def __init__(self):
        import importlib.machinery

        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, values, step):
        self.logged.append((step, dict(values)))

    def finish(self):
        self.finished += 1


def test_a_default_run_writes_tensorboard_events_wandb_and_a_labelled_plot(tmp_path, monkeypatch):
    from modern_jax.training.objectives.next_token import NextToken
    from modern_jax.training.metrics import loss_figure, read_metrics

    wandb = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    run = _tiny_run(tmp_path, plot=True, samples=0, wandb_project="tiny-tests")
    assert run.train.tensorboard  # on by default
    train(run, mesh=one_device(), log=lambda *_: None)
    out = tmp_path / "run"
    records = read_metrics(out / "metrics.jsonl")
    train_losses = {r["step"]: r["loss"] for r in records if r["split"] == "train"}
    val_losses = {r["step"]: r["loss"] for r in records if r["split"] == "val"}
    assert sorted(train_losses) == list(range(1, 9)) and sorted(val_losses) == [4, 8]

    events = _tensorboard_scalars(out / "tensorboard")
    assert events["train/loss"] == pytest.approx(train_losses, rel=1e-6)
    assert events["val/loss"] == pytest.approx(val_losses, rel=1e-6)
    assert set(events["train/tokens_per_s"]) == set(train_losses)

    assert [i["project"] for i in wandb.inits] == ["tiny-tests"] and wandb.finished == 1
    assert wandb.inits[0]["config"]["train"]["wandb_project"] == "tiny-tests"
    assert {s: v["train/loss"] for s, v in wandb.logged if "train/loss" in v} == pytest.approx(train_losses)
    assert (out / "wandb_run_id").read_text().strip() == wandb.inits[0]["id"]

    png = (out / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and b"matplotlib" in png[:4096]
    ax = loss_figure(records, NextToken.display, "runs/x").axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("step", "loss (nats / token)", "runs/x")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["train", "validation"]
    np.testing.assert_allclose(ax.lines[0].get_ydata(), [train_losses[s] for s in range(1, 9)])

    # a resumed run logs on to the same W&B run
    train(_tiny_run(tmp_path, steps=10, plot=False, samples=0, wandb_project="tiny-tests"), mesh=one_device(),
          log=lambda *_: None)
    assert wandb.inits[1]["id"] == wandb.inits[0]["id"] and wandb.inits[1]["resume"] == "allow"


def test_wandb_project_without_wandb_installed_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importlib.util.find_spec("wandb") is None
    with pytest.raises(ValueError, match=r"TrainConfig.wandb_project='p' is invalid: W&B logging needs the wandb "
                                         r"package"):
        TrainConfig(wandb_project="p")


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_elsewhere():
    from modern_jax.training.metrics import Progress

    plain = io.StringIO()
    progress = Progress(total=10, start=0, stream=plain)
    progress.update(5, 1.23456, 2048.0)
    progress.message("step 5: val_loss 1.5")
    progress.close()
    lines = plain.getvalue().splitlines()
    assert lines[0].startswith("step 5/10 | loss 1.2346 | 2.0k tok/s | ETA 0:0") and lines[1] == "step 5: val_loss 1.5"
    assert "\x1b" not in plain.getvalue() and "\r" not in plain.getvalue()

    screen = Terminal()
    progress = Progress(total=10, start=0, stream=screen)
    progress.update(5, 1.23456, 2048.0)
    progress.message("saved a checkpoint")
    progress.close()
    text = screen.getvalue()
    assert "\x1b" in text and "5/10" in text and "loss 1.2346 | 2.0k tok/s | ETA" in text
    assert "saved a checkpoint" in text and "━" in text  # rich's bar

    silent = io.StringIO()
    Progress(total=10, start=0, enabled=False, stream=silent).update(5, 1.0, 1.0)
    assert silent.getvalue() == ""


class Terminal(io.StringIO):
    """A stream that says it is a terminal: rich draws its bars into it."""

    def isatty(self):
        return True


def _screen_lines(text: str) -> list[str]:
    """What a terminal showed, line by line, without rich's cursor and colour sequences."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "\n").splitlines()


def test_the_long_parts_of_a_run_and_of_evaluate_show_progress_on_a_terminal(tmp_path, monkeypatch, capsys):
    """On a terminal the data, the compilation, each evaluation and the samples show a line under the
    step bar while they run; an evaluation of N batches moves its bar N times (periodic: 8 windows in 2
    batches, final: 12 in 3), and so does `evaluate`'s. Elsewhere the phases print nothing."""
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    run = _tiny_run(tmp_path, progress=True, final_eval_windows=12)
    train(run, mesh=one_device(), log=lambda *_: None)
    lines = _screen_lines(screen.getvalue())
    for what in ("reading and tokenizing the data", "compiling the training and evaluation steps",
                 "sampling 1 x 8 tokens"):
        assert any(line.startswith(what) for line in lines), what
    for what, n in (("validation", 2), ("final validation", 3)):
        for k in range(1, n + 1):
            assert any(re.match(rf"{what} .* {k}/{n} batches", line) for line in lines), (what, k, lines)
    assert any(re.match(r"step .* 8/8 +loss ", line) for line in lines)

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    assert main(["evaluate", "--checkpoint", str(tmp_path / "run"), "--max-windows", "12", "--batch-size", "4"]) == 0
    lines = _screen_lines(screen.getvalue())
    assert any(line.startswith("compiling the evaluation step") for line in lines)
    assert all(any(re.match(rf"evaluating .* {k}/3 batches", line) for line in lines) for k in (1, 2, 3)), lines

    plain = io.StringIO()
    from modern_jax.training.metrics import Progress

    with Progress(10, stream=plain) as progress, progress.phase("validation", 3, "batches") as advance:
        for _ in range(3):
            advance()
    assert plain.getvalue() == ""
