"""Expert parallelism on 8 host CPU devices: the experts split over the `expert` axis, tokens
exchanged all-to-all (or all-gathered), against one device; the HLO's collectives, the expert
shards, checkpoints across meshes, and dropped-token accounting against NumPy."""

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from modern_jax.cli import main
from modern_jax.config import ModelConfig
from modern_jax.layers.moe import MoE
from modern_jax.model import Transformer
from modern_jax.sharding.mesh import make_mesh
from modern_jax.sharding import Strategies, check_mesh, logical_rules, state_shardings
from modern_jax.training import TrainConfig, load_run_config, train
from modern_jax.training.checkpoint import Checkpointer

from common import assert_step_matches_one_device, make_trainer, one_device, token_batch

REPO = pathlib.Path(__file__).parent.parent
CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, ffn_type="moe",
                  n_experts=8, experts_per_token=2, expert_d_ff=16, n_shared_experts=1, router_score="sigmoid",
                  router_selection_bias=True, router_norm_topk=True, max_position_embeddings=32)
MESHES = {"data2_expert4": dict(data=2, expert=4), "expert8": dict(data=1, expert=8),
          "fsdp2_expert2_tensor2": dict(fsdp=2, expert=2, tensor=2)}


def batch(B=8, T=16, V=64, seed=5):
    return token_batch(1, B, T, V, seed)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, axis_index_groups=None):
    """`jax.lax.ragged_all_to_all` as its docstring defines it, from all_gathers (XLA:CPU has no
    ragged_all_to_all): source s's rows `[input_offsets[me], + send_sizes[me])` land in this
    device's `output` at `output_offsets[me]` of source s."""
    me = jax.lax.axis_index(axis_name)
    rows, starts, sizes, dests = (jax.lax.all_gather(a, axis_name) for a in
                                  (operand, input_offsets, send_sizes, output_offsets))
    r = jnp.arange(operand.shape[0])
    for source in range(rows.shape[0]):
        start, size, dest = starts[source, me], sizes[source, me], dests[source, me]
        into = jnp.where((r >= start) & (r < start + size), dest + r - start, output.shape[0])
        output = output.at[into].set(rows[source], mode="drop")
    return output


@pytest.fixture
def ragged_on_cpu(monkeypatch):
    import modern_jax.ops.moe as moe_ops

    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    monkeypatch.setattr(moe_ops, "platform", lambda: "tpu")  # let the exchange be chosen on this CPU


TC = TrainConfig(batch_size=8, seq_len=16, moe_aux_weight=0.01, moe_router_z_weight=0.01, moe_bias_update_rate=0.01)


@pytest.mark.parametrize("exchange", ["all_to_all", "all_gather"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_a_training_step_with_experts_split_equals_one_device(mesh_name, exchange):
    """Loss, balance and router z-losses, per-layer loads and every gradient leaf (the router's
    included) equal the single-device step (the loads are global: the aux-free bias moves alike)."""
    many, one = assert_step_matches_one_device(CFG, TC, make_mesh(**MESHES[mesh_name]), batch(),
                                               strategies=Strategies(moe_exchange=exchange))
    np.testing.assert_allclose(many["moe_aux_loss"], one["moe_aux_loss"], rtol=1e-5)
    np.testing.assert_allclose(many["moe_router_z_loss"], one["moe_router_z_loss"], rtol=1e-5)
    np.testing.assert_array_equal(many["moe_load_max"], one["moe_load_max"])
    assert float(many["moe_dropped"]) == 0.0


def sharded_forward(model, mesh, tokens):
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, state_shardings(state, mesh))
    with logical_rules(mesh):
        forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
        return forward(state, tokens), forward.lower(state, tokens).compile().as_text(), state


def test_the_hlo_exchanges_tokens_and_never_gathers_expert_weights():
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 12)), jnp.int32)
    mesh = make_mesh(data=2, expert=4)
    logits, hlo, state = sharded_forward(model, mesh, tokens)
    np.testing.assert_allclose(logits, model(tokens), atol=1e-6, rtol=1e-6)
    assert "all-to-all" in hlo
    gathered = [line for line in hlo.splitlines() if " all-gather(" in line or " all-gather-start(" in line]
    E, D, F = 8, 32, 16
    for line in gathered:  # no gather returns an expert weight (whole or one layer of it)
        shape = line.split("=")[1].split("all-gather")[0]
        assert not any(f"[{dims}]" in shape for dims in (f"{E},{D},{F}", f"{E},{F},{D}", f"2,{E},{D},{F}")), line
    # the expert weight shards: device at expert index j holds experts 2j, 2j + 1 of every layer
    up = state["stages"][0]["blocks"][0]["mlp"]["experts"]["up_proj"]["kernel"].get_value()
    full = np.asarray(model.stages[0].blocks[0].mlp.experts.up_proj.kernel[...])
    expert_axis = list(mesh.axis_names).index("expert")
    for shard in up.addressable_shards:
        j = int(np.argwhere(mesh.devices == shard.device)[0][expert_axis])
        np.testing.assert_array_equal(np.asarray(shard.data), full[:, 2 * j:2 * j + 2])


def test_dropped_assignments_under_a_tight_bound_match_numpy():
    """`moe_exchange_factor` bounds each (source device, destination device) pair to
    C = ceil(factor * local assignments / P) slots, filled in token order."""
    factor, P = 0.5, 4
    cfg = CFG.replace(n_shared_experts=0)
    layer = MoE(cfg, rngs=nnx.Rngs(3))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 6, 32)), jnp.float32)
    mesh = make_mesh(data=2, expert=P)
    with logical_rules(mesh, strategies=Strategies(moe_exchange_factor=factor)):  # jitted: one compile
        _, sown = nnx.jit(lambda layer, x: nnx.capture(layer, nnx.Intermediate)(x))(layer, x)
    dropped = int([v.get_value()[0] for p, v in nnx.to_flat_state(sown) if "moe_dropped" in map(str, p)][0])
    experts, _, _, _ = layer.router(x.reshape(-1, 32))
    experts = np.asarray(experts).reshape(8, 6 * 2)  # rows of one sequence: its 6 tokens x k
    devices = 2 * P  # the batch is split over data x expert: one sequence per device
    per_device = experts.reshape(devices, -1)
    C = math.ceil(factor * per_device.shape[1] / P)
    want = sum(max(0, int(np.sum(row // 2 == dest)) - C) for row in per_device for dest in range(P))
    assert dropped == want > 0


@pytest.mark.parametrize("mesh_name", ["data2_expert4", "fsdp2_expert2_tensor2"])
def test_the_ragged_exchange_equals_one_device(mesh_name, ragged_on_cpu):
    """`ragged_all_to_all` (emulated by its documented semantics): the offsets and sizes the
    exchange computes send every assignment to its expert's device and back, so the step
    (loss, loads, every gradient leaf) is one device's."""
    many, one = assert_step_matches_one_device(CFG, TC, make_mesh(**MESHES[mesh_name]), batch(),
                                               strategies=Strategies(moe_exchange="ragged_all_to_all"))
    assert many["moe_dropped"] == 0
    np.testing.assert_array_equal(many["moe_load_max"], one["moe_load_max"])


def test_the_ragged_exchange_drops_what_overflows_a_receive_buffer_as_numpy_counts(ragged_on_cpu):
    """With `moe_exchange_factor`, each device receives at most R = ceil(factor * local
    assignments) rows; what its expert group sends past that is dropped: per destination,
    max(0, rows sent to it - R)."""
    factor, P = 0.75, 4
    cfg = CFG.replace(n_shared_experts=0)
    layer = MoE(cfg, rngs=nnx.Rngs(3))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 6, 32)), jnp.float32)
    ragged = Strategies(moe_exchange="ragged_all_to_all", moe_exchange_factor=factor)
    with logical_rules(make_mesh(data=2, expert=P), strategies=ragged):  # jitted: one compile, not one per op
        _, sown = nnx.jit(lambda layer, x: nnx.capture(layer, nnx.Intermediate)(x))(layer, x)
    dropped = int([v.get_value()[0] for p, v in nnx.to_flat_state(sown) if "moe_dropped" in map(str, p)][0])
    experts, _, _, _ = layer.router(x.reshape(-1, 32))
    per_device = np.asarray(experts).reshape(2 * P, 6 * 2)  # one sequence per device, data-major
    R = math.ceil(factor * per_device.shape[1])
    want = sum(max(0, int(np.sum(per_device[g * P:(g + 1) * P] // 2 == dest)) - R) for g in range(2) for dest in range(P))
    assert dropped == want > 0


def test_the_ragged_exchange_is_refused_on_cpu():
    from modern_jax.kernels import UnsupportedFeatureError

    layer = MoE(CFG, rngs=nnx.Rngs(0))
    ragged = Strategies(moe_exchange="ragged_all_to_all")
    with logical_rules(make_mesh(data=2, expert=4), strategies=ragged), pytest.raises(UnsupportedFeatureError,
                                                                    match="XLA:CPU does not implement it"):
        layer(jnp.ones((8, 4, 32)))


def test_a_checkpoint_saved_on_expert4_restores_on_expert2_and_one_device(tmp_path):
    tc = TrainConfig(batch_size=8, seq_len=16, warmup_steps=0, lr=1e-2)
    trainer = make_trainer(CFG, tc, make_mesh(data=2, expert=4))
    state, _ = trainer.train_step(trainer.states.init(0), trainer.batches.put(batch()))
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep=1, async_save=False)
    checkpointer.save(state, {"step": 1})
    checkpointer.close()
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (8, 12)), jnp.int32)
    logits = []
    for sizes in (dict(data=2, expert=4), dict(data=4, expert=2), dict(devices=jax.devices()[:1])):
        other = make_trainer(CFG, tc, make_mesh(**sizes))
        checkpointer = Checkpointer(tmp_path / "checkpoints", keep=1, async_save=False)
        restored, _ = checkpointer.restore(other.states.abstract(), 1)
        checkpointer.close()
        model = other.states.model(restored["params"])
        with logical_rules(other.mesh):
            logits.append(np.asarray(jax.jit(lambda m, t: m(t))(model, tokens)))
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(logits[2], logits[0], atol=1e-6, rtol=1e-6)


def test_cli_train_on_data2_expert4_gives_the_one_device_losses(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(np.random.default_rng(0).choice(["alpha", "beta", "gamma", "\n"], 2000)))
    small = {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64, "expert_d_ff": 16,
             "max_position_embeddings": 32, "vocab_size": "auto"}
    settings = {"steps": 3, "batch_size": 8, "seq_len": 16, "warmup_steps": 1, "log_every": 1, "eval_every": 0,
                "eval_windows": 8, "eval_batch_size": 8, "final_eval_windows": 8, "checkpoint_every": 0,
                "samples": 0, "progress": False, "plot": False, "tensorboard": False}
    overrides = ["data.tokenizer=char", f"data.path={corpus}"] + [f"model.{k}={v}" for k, v in small.items()]
    overrides += [f"train.{k}={json.dumps(v)}" for k, v in settings.items()]
    config = str(REPO / "configs/moe_tiny.yaml")
    one = train(load_run_config(config, overrides + [f"train.output_dir={tmp_path / 'one'}"]),
                mesh=one_device(), log=lambda *_: None)
    assert main(["train", "--config", config, "--mesh", "data=2,expert=4", *overrides,
                 f"train.output_dir={tmp_path / 'split'}"]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "split/metrics.jsonl").read_text().splitlines()]
    losses = [[h["loss"] for h in one.history], [r["loss"] for r in rows if r["split"] == "train"]]
    assert len(losses[1]) == 3
    np.testing.assert_allclose(losses[1], losses[0], rtol=2e-5)


def test_experts_the_expert_axis_does_not_divide_are_refused_before_compiling():
    with pytest.raises(ValueError, match=r"model.n_experts=6 is not divisible by the mesh's expert=4"):
        check_mesh(CFG.replace(n_experts=6), make_mesh(data=2, expert=4))
