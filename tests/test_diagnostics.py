"""`train.diagnostics`: the max attention logit comes from the training step's own attention.

Every attention layer sows what its kernel measured while computing the softmax; the stages
carry the max through the scan (and remat), the model sows the max over its layers, and the
step reports it (max over micro-batches). Checked against a dense NumPy max over the q and k
that each layer of an eager, unscanned copy of the model passes to its attention, and for its
memory: it must not bring back the `[T, S]` scores that `chunked` never materialises.

QK-clip (`train.qk_clip_tau`) reads the same measurement per layer and per head: each head's max
on a mesh equals one device's, `clip_qk` brings each head over tau to tau and leaves the others
(GQA, MLA), and a step with it leaves no logit over tau.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import modern_jax.layers.attention as attention_layers
from modern_jax import execution
from modern_jax.config import ModelConfig
from modern_jax.execution import ExecutionConfig
from modern_jax.sharding.mesh import make_mesh
from modern_jax.training import TrainConfig, run_config_from_dict, train
from modern_jax.model import abstract_params

from common import make_trainer, one_device


def packed_batch(A, B, T, V, seed=0):
    """`A` micro-batches of `B` rows, each row two documents (positions restart at the cut)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, (A, B, T + 1))
    cut = T // 2 + 1
    seg = np.where(np.arange(T) < cut, 1, 2)
    pos = np.where(np.arange(T) < cut, np.arange(T), np.arange(T) - cut)
    return {"inputs": tokens[..., :-1].astype(np.int32), "targets": tokens[..., 1:].astype(np.int32),
            "positions": np.broadcast_to(pos, (A, B, T)).astype(np.int32).copy(),
            "segment_ids": np.broadcast_to(seg, (A, B, T)).astype(np.int32).copy(),
            "weights": np.ones((A, B, T), np.float32)}


def dense_max_logit(q_BTKGH, k_BSKH, spec, vis) -> float:
    """max |q.k| * scale over the visible pairs, float64, straight from the masking rules."""
    q, k = np.asarray(q_BTKGH, np.float64), np.asarray(k_BSKH, np.float64)
    x = np.abs(np.einsum("btkgh,bskh->btkgs", q, k)) * spec.scale
    q_pos, k_pos = np.asarray(vis.q_pos)[:, :, None], np.asarray(vis.k_pos)[:, None, :]
    ok = (k_pos >= 0) & (k_pos <= q_pos)
    if spec.window is not None:
        ok &= q_pos - k_pos < spec.window
    if vis.q_seg is not None:
        ok &= np.asarray(vis.q_seg)[:, :, None] == np.asarray(vis.k_seg)[:, None, :]
    return float(np.max(np.where(ok[:, :, None, None, :], x, 0.0)))


def reference_max_logit(cfg, params, batch, monkeypatch) -> tuple[float, int]:
    """Over the micro-batches and every layer of an eager unscanned model: (max, attention calls)."""
    graphdef, _ = abstract_params(cfg)
    from flax import nnx

    model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))
    found = []
    original = attention_layers.attention

    def recording(q, k, v, spec, vis, **kw):  # test-only: look at the inputs, compute elsewhere
        found.append(dense_max_logit(q, k, spec, vis))
        return original(q, k, v, spec, vis, **kw)

    monkeypatch.setattr(attention_layers, "attention", recording)
    with execution.use(ExecutionConfig(scan_layers=False, attention_impl="reference")):  # eager, layer by layer
        for a in range(batch["inputs"].shape[0]):
            model.hidden_states(jnp.asarray(batch["inputs"][a]), positions=jnp.asarray(batch["positions"][a]),
                                segment_ids=jnp.asarray(batch["segment_ids"][a]))
    monkeypatch.setattr(attention_layers, "attention", original)
    return max(found), len(found)


MODELS = {
    # GQA, local/global layers, a soft-cap well below the logits (the max is taken before it),
    # sinks; scanned and rematerialised, two micro-batches, the chunked kernel
    "gqa_local_global": (dict(n_heads=4, n_kv_heads=2, sliding_window=5, attention_pattern="LG", n_layers=4,
                              attn_softcap=2.0, attention_sinks=True),
                         ExecutionConfig(scan_layers=True, remat="full", attention_impl="chunked"), 2),
    # MLA (the training path expands the latent into per-head keys), unscanned, the reference kernel
    "mla": (dict(attention_type="mla", mla_kv_rank=16, mla_q_rank=8, mla_rope_dim=4, mla_nope_dim=8, mla_v_dim=8,
                 rope_layout="interleaved"), ExecutionConfig(scan_layers=False, attention_impl="reference"), 1),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_train_step_reports_the_max_attention_logit_of_its_own_forward(name, monkeypatch):
    overrides, run, accum = MODELS[name]
    cfg = ModelConfig(vocab_size=48, d_model=32, d_ff=64, max_position_embeddings=32, init_std=0.3, **overrides)
    tc = TrainConfig(batch_size=4, seq_len=16, grad_accum=accum, warmup_steps=0)
    batch = packed_batch(accum, 4 // accum, 16, 48)
    trainer = make_trainer(cfg, tc, one_device(), execution=run)
    state = trainer.states.init(0)
    params = jax.device_get(state["params"])  # the step donates the state
    _, metrics = trainer.train_step(state, trainer.batches.put(batch))
    want, calls = reference_max_logit(cfg, params, batch, monkeypatch)
    assert calls == cfg.n_layers * accum
    if name == "gqa_local_global":
        assert want > cfg.attn_softcap  # so the max is of the logits before the soft-cap (after it, all < cap)
    np.testing.assert_allclose(float(metrics["max_attention_logit"]), want, rtol=1e-4)

    if name == "mla":  # off (one model is enough): no figure, the same loss
        trainer = make_trainer(cfg, TrainConfig(batch_size=4, seq_len=16, grad_accum=accum, warmup_steps=0,
                                                diagnostics=False), one_device(), execution=run)
        _, quiet = trainer.train_step(trainer.states.init(0), trainer.batches.put(batch))
        assert "max_attention_logit" not in quiet
        np.testing.assert_allclose(float(quiet["loss"]), float(metrics["loss"]), rtol=1e-6)


def test_max_attention_logit_on_a_mesh_equals_one_device():
    """Under the sharded attention (batch over data x fsdp, kv heads over tensor) each device
    measures its own shard and the wrapper takes the max over the devices."""
    cfg = ModelConfig(vocab_size=48, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, max_position_embeddings=32,
                      init_std=0.3)
    tc = TrainConfig(batch_size=8, seq_len=16, warmup_steps=0)
    batch = packed_batch(1, 8, 16, 48, seed=1)
    values = []
    for mesh in (one_device(), make_mesh(2, 2, 2)):
        trainer = make_trainer(cfg, tc, mesh, execution=ExecutionConfig(attention_impl="chunked"))
        _, metrics = trainer.train_step(trainer.states.init(0), trainer.batches.put(batch))
        values.append(float(metrics["max_attention_logit"]))
    np.testing.assert_allclose(values[1], values[0], rtol=1e-5)


def test_the_loop_logs_the_max_over_its_interval(tmp_path):
    """`metrics.jsonl`'s `max_attention_logit` is the max of the steps' own values over each
    logging interval: no probe, no extra pass."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(np.random.default_rng(0).choice(["alpha", "beta", "gamma", "\n"], 2000)))
    run = run_config_from_dict({
        "model": {"vocab_size": "auto", "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64,
                  "max_position_embeddings": 16},
        "train": {"steps": 4, "batch_size": 4, "seq_len": 16, "warmup_steps": 1, "log_every": 2, "eval_every": 0,
                  "eval_windows": 4, "final_eval_windows": 4, "eval_batch_size": 4, "checkpoint_every": 0,
                  "samples": 0, "progress": False, "plot": False, "tensorboard": False,
                  "output_dir": str(tmp_path / "run")},
        "data": {"path": str(corpus), "tokenizer": "char"}})
    result = train(run, mesh=one_device(), log=lambda *_: None)
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    logged = [r["max_attention_logit"] for r in records if r["split"] == "train"]
    steps = [h["max_attention_logit"] for h in result.history]
    assert len(logged) == 2 and all(v > 0 for v in steps)
    assert logged == [max(steps[:2]), max(steps[2:])]


def train_step_temp_bytes(diagnostics: bool, T: int = 4096) -> int:
    """XLA's temporary bytes of the compiled train step (compiled from abstract arrays, not run)."""
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, d_ff=128, max_position_embeddings=T)
    trainer = make_trainer(cfg, TrainConfig(batch_size=1, seq_len=T, warmup_steps=0, diagnostics=diagnostics),
                      one_device(), execution=ExecutionConfig(attention_impl="chunked"))
    batch = {name: jax.ShapeDtypeStruct((1, 1, T), dtype, sharding=trainer.batches.sharding)
             for name, dtype in (("inputs", jnp.int32), ("targets", jnp.int32), ("positions", jnp.int32),
                                 ("segment_ids", jnp.int32), ("weights", jnp.float32))}
    compiled = trainer.programs.lower("train", trainer.states.abstract(), batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_diagnostics_cost_no_score_memory():
    """At T=4096 the dense fp32 scores of one layer would be 128 MiB; the step with diagnostics
    needs at most 10% more temporary memory than without, and the scanned step's memory stays
    linear in T (JAX's scan AD used to hoist every tile's mask out of the layer loop)."""
    off, on = train_step_temp_bytes(False), train_step_temp_bytes(True)
    assert on <= 1.10 * off, (on, off)
    assert off <= 2.1 * train_step_temp_bytes(False, T=2048), off


# ----- QK-clip: each head's max logit, read per layer, rescales that head's query and key weights ------

CLIP_MODELS = {
    "gqa": dict(n_heads=4, n_kv_heads=2, qkv_bias=True),  # a key head shared by two query heads; biases scale too
    "mla": dict(attention_type="mla", mla_kv_rank=16, mla_q_rank=8, mla_rope_dim=4, mla_nope_dim=8, mla_v_dim=8),
    "mla_no_q_latent": dict(attention_type="mla", mla_kv_rank=16, mla_q_rank=0, mla_rope_dim=4, mla_nope_dim=8,
                            mla_v_dim=8),
}


def head_maxima(model, tokens):
    """Each stack's sown max logit of each head (`model.head_logits`), from a forward pass with diagnostics."""
    from flax import nnx

    from modern_jax.model import head_logits

    _, sown = nnx.capture(lambda m: m.hidden_states(tokens, diagnostics=True), nnx.Intermediate)(model)
    return head_logits(sown)


@pytest.mark.parametrize("name", list(CLIP_MODELS))
def test_qk_clip_brings_each_head_over_tau_to_tau_and_leaves_the_others(name):
    """One layer: after `clip_qk`, each head's max logit is min(its max, tau), heads below tau
    keep theirs, and no weight grows (GQA: a key head takes its group's mildest factor, its query
    heads the rest; MLA: Kimi K2's split, the query's rotary part by the whole factor)."""
    from flax import nnx

    from modern_jax.model import Transformer

    cfg = ModelConfig(vocab_size=48, d_model=32, d_ff=64, n_layers=1, max_position_embeddings=32, init_std=0.4,
                      **CLIP_MODELS[name])
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    attn = model.stages[0].blocks[0].self_attn
    for proj in (getattr(attn, "q_proj", None), getattr(attn, "k_proj", None)):
        if proj is not None and proj.bias is not None:  # biases that count (they start at zero)
            proj.bias[...] = jnp.asarray(rng.normal(0, 1.0, proj.bias.shape), jnp.float32)
    weights = lambda: {name: np.asarray(p) for name, p in nnx.to_flat_state(nnx.state(attn, nnx.Param))}  # noqa: E731
    tokens = jnp.asarray(rng.integers(0, 48, (2, 16)), jnp.int32)
    before, weights_before = np.asarray(head_maxima(model, tokens)["stages"][0][0]), weights()  # [layers = 1, N]
    tau = float(np.median(before))  # half the heads over it, half under
    assert (before > tau * 1.01).sum() >= 1 and (before < tau).sum() >= 1, before
    model.clip_qk(head_maxima(model, tokens), tau)
    after = np.asarray(head_maxima(model, tokens)["stages"][0][0])
    np.testing.assert_allclose(after, np.minimum(before, tau), rtol=1e-5)
    for name, w in weights().items():  # every weight shrinks or stays, none grows
        assert np.all(np.abs(w) <= np.abs(weights_before[name]) * (1 + 1e-6)), name


def clip_run(cfg, tau, steps=1):
    """`(each step's metrics, the parameters after them)` of a run with `qk_clip_tau=tau`, at a
    learning rate too small to move the logits itself."""
    tc = TrainConfig(batch_size=4, seq_len=16, grad_accum=2, warmup_steps=0, schedule="constant", lr=1e-7,
                     qk_clip_tau=tau)
    trainer = make_trainer(cfg, tc, one_device(), execution=ExecutionConfig(attention_impl="chunked"))
    state, batch = trainer.states.init(0), trainer.batches.put(packed_batch(2, 2, 16, 48))
    every = []
    for _ in range(steps):
        state, metrics = trainer.train_step(state, batch)
        every.append(jax.device_get(metrics))
    return every, jax.device_get(state["params"])


def test_a_step_with_qk_clip_leaves_no_logit_over_tau():
    """A model with large query and key weights: the step measures logits over tau and clips every
    head; the next measures tau (the largest head brought to it exactly: each head's max is taken
    over the two micro-batches, not added). Off, nothing is clipped."""
    cfg = ModelConfig(vocab_size=48, d_model=32, d_ff=64, n_layers=1, n_heads=4, n_kv_heads=2,
                      max_position_embeddings=32, init_std=0.5)
    (first, second), _ = clip_run(cfg, 5.0, steps=2)
    assert first["max_attention_logit"] > 5.0 * 4 and first["qk_clipped_heads"] == 4, first
    np.testing.assert_allclose(second["max_attention_logit"], 5.0, rtol=1e-5)
    (_, off), _ = clip_run(cfg, None, steps=2)
    assert "qk_clipped_heads" not in off and off["max_attention_logit"] > 5.0 * 4, off


@pytest.mark.parametrize("changes, message", [
    (dict(qk_norm="head"), r"rescales the query and key weights, which model.qk_norm='head' normalises away"),
])
def test_qk_clip_is_refused_where_it_cannot_act(changes, message):
    cfg = ModelConfig(vocab_size=48, d_model=32, d_ff=64, n_layers=1, n_heads=2, max_position_embeddings=32, **changes)
    with pytest.raises(ValueError, match=rf"train.qk_clip_tau=5.0 {message}"):
        make_trainer(cfg, TrainConfig(batch_size=4, seq_len=16, warmup_steps=0, qk_clip_tau=5.0), one_device())
    with pytest.raises(ValueError, match=r"TrainConfig.qk_clip_tau=5.0 is invalid: QK-clip reads .* train.diagnostics"):
        TrainConfig(qk_clip_tau=5.0, diagnostics=False)


def test_each_heads_max_logit_on_a_mesh_equals_one_device():
    """The heads split over `tensor` (4 devices for 2 key heads: each copied twice, its query group
    halved) and the sequence over `context`: each head's max is maxed over the rows and the
    sequence only, and lands back in its own place."""
    from flax import nnx

    from modern_jax.model import Transformer
    from modern_jax.sharding import logical_rules, state_shardings

    cfg = ModelConfig(vocab_size=48, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_layers=2,
                      max_position_embeddings=32, init_std=0.3)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 48, (2, 16)), jnp.int32)
    with execution.use(ExecutionConfig(attention_impl="chunked")):
        want = head_maxima(model, tokens)
        mesh = make_mesh(context=2, tensor=4)
        graphdef, state = nnx.split(model)
        state = jax.device_put(state, state_shardings(state, mesh))
        with logical_rules(mesh):
            got = jax.jit(lambda s, t: head_maxima(nnx.merge(graphdef, s), t))(state, tokens)
    assert np.asarray(want["stages"][0][0]).shape == (2, 4)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5), got, want)
