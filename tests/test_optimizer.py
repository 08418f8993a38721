"""Muon (`training.optimizer`): against `torch.optim.Muon` on fixed gradients, the matrices read off
the projections, its state, and a refused LoRA run.

`tests/fixtures/muon/torch_muon.npz` is torch 2.13's Muon over three steps (`scripts/make_muon_fixture.py`);
torch's weights are `[out, in]`, the project's kernels `[in, out]`, so each is the other's transpose.
"""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

from modern_jax.config import ModelConfig
from modern_jax.lora_config import LoRAConfig
from modern_jax.model import abstract_model
from modern_jax.training import TrainConfig
from modern_jax.training.optimizer import make_optimizer, muon_dimensions

from modern_jax.sharding.mesh import make_mesh

from common import assert_leaves_match, make_trainer, one_device, token_batch

FIXTURE = np.load(Path(__file__).parent / "fixtures/muon/torch_muon.npz")
NAMES = ("wide", "tall", "square")
MATRIX = MuonDimensionNumbers(reduction_axis=(-2,), output_axis=(-1,))


def train_config(adjust: str, **changes) -> TrainConfig:
    return TrainConfig(optimizer="muon", muon_adjust_lr=adjust, lr=float(FIXTURE["lr"]),
                       weight_decay=float(FIXTURE["weight_decay"]), muon_momentum=float(FIXTURE["momentum"]),
                       clip_norm=None, warmup_steps=0, schedule="constant", **changes)


def muon_steps(params: dict, grads: dict, dims: dict, tc: TrainConfig) -> list[dict]:
    """The parameters after each step, the direction at rate 1 scaled by lr as the Trainer does."""
    tx = make_optimizer(tc, muon=dims)
    state, out = tx.init(params), []
    for step in range(len(next(iter(grads.values())))):
        direction, state = tx.update({k: g[step] for k, g in grads.items()}, state, params)
        params = optax.apply_updates(params, jax.tree.map(lambda u: u * tc.lr, direction))
        out.append(params)
    return out


def relative(got, want) -> float:
    return float(np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_three_steps_equal_torch_muon(adjust):
    """Each matrix after each step within 1e-5 (in norm, relative) of torch's with its Newton-Schulz
    iteration in float32, as ours runs; and within bfloat16's precision of torch as shipped."""
    params = {n: jnp.asarray(FIXTURE[f"{n}/param"].T) for n in NAMES}
    grads = {n: jnp.asarray(FIXTURE[f"{n}/grads"].transpose(0, 2, 1)) for n in NAMES}
    steps = muon_steps(params, grads, {(n,): MATRIX for n in NAMES}, train_config(adjust))
    for n in NAMES:
        f32, bf16 = FIXTURE[f"{n}/{adjust}/f32"], FIXTURE[f"{n}/{adjust}/bf16"]
        assert relative(bf16[-1], f32[-1]) > 1e-6  # torch's two runs differ: its float32 one is no copy
        for step, after in enumerate(steps):
            got = np.asarray(after[n]).T
            assert relative(got, f32[step]) < 1e-5, (n, step, relative(got, f32[step]))
            assert relative(got, bf16[step]) < 1e-3, (n, step, relative(got, bf16[step]))
            moved = got - FIXTURE[f"{n}/param"]  # and the step itself, not only the parameter
            assert relative(moved, f32[step] - FIXTURE[f"{n}/param"]) < 2e-5


def test_stacked_and_split_kernels_are_orthogonalised_matrix_by_matrix():
    """A stack of matrices `[layers, in, out]` moves as each matrix alone (torch's, per matrix), and a
    kernel with two input dims (`o_proj`'s `[N, H, D]`) as its `[N H, D]` matrix."""
    adjust = "match_rms_adamw"
    square = FIXTURE["square/param"].T
    stacked = {"stack": jnp.asarray(np.stack([square, FIXTURE["wide/param"][:, :8].T @ np.eye(6, 8)])),
               "split": jnp.asarray(FIXTURE["wide/param"].T.reshape(2, 5, 6))}
    grads = {"stack": jnp.asarray(np.stack([FIXTURE["square/grads"].transpose(0, 2, 1)] * 2, axis=1)),
             "split": jnp.asarray(FIXTURE["wide/grads"].transpose(0, 2, 1).reshape(3, 2, 5, 6))}
    grads["stack"] = grads["stack"].at[:, 1].multiply(-3.0)  # the second layer's gradients differ
    dims = {("stack",): MATRIX, ("split",): MuonDimensionNumbers(reduction_axis=(-3, -2), output_axis=(-1,))}
    after = muon_steps(stacked, grads, dims, train_config(adjust))[-1]
    f32 = FIXTURE[f"square/{adjust}/f32"][-1]
    assert relative(np.asarray(after["stack"][0]).T, f32) < 1e-5
    assert relative(np.asarray(after["split"]).reshape(10, 6).T, FIXTURE[f"wide/{adjust}/f32"][-1]) < 1e-5
    # the second layer: its own matrix and gradients (-3 g orthogonalises as -g), not the stack's
    single = muon_steps({"m": stacked["stack"][1]}, {"m": grads["stack"][:, 1]}, {("m",): MATRIX},
                        train_config(adjust))[-1]["m"]
    assert relative(after["stack"][1], single) < 1e-6


MOE = ModelConfig(vocab_size=48, d_model=32, d_ff=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_type="moe",
                  n_experts=4, experts_per_token=2, n_shared_experts=1, max_position_embeddings=32)


def test_the_matrices_come_from_the_projections():
    """Stacked layers and experts are batch axes; each kernel reduces over its module's inputs; the
    routers, embedding, head, norms and biases stay on AdamW unless `muon_groups` says otherwise."""
    model = abstract_model(MOE)
    dims = {".".join(map(str, path[4:-1])): d for path, d in muon_dimensions(model, ("attention", "mlp", "experts"))
            .items()}
    assert dims["self_attn.q_proj"] == MuonDimensionNumbers((-3,), (-2, -1))  # [layers, D, N, H]
    assert dims["self_attn.o_proj"] == MuonDimensionNumbers((-3, -2), (-1,))  # [layers, N, H, D]
    assert dims["mlp.experts.gate_proj"] == MuonDimensionNumbers((-2,), (-1,))  # [layers, experts, D, F]
    assert "mlp.shared_experts.down_proj" in dims and "mlp.router.proj" not in dims
    assert set(dims) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         *(f"mlp.{part}.{p}" for part in ("experts", "shared_experts")
                           for p in ("gate_proj", "up_proj", "down_proj"))}
    routers = muon_dimensions(model, ("router",))
    assert [path[4:] for path in routers] == [("mlp", "router", "proj", "kernel")]


def test_a_muon_step_keeps_one_buffer_per_matrix_and_adamw_for_the_rest():
    """The state: a trace (one buffer) of each Muon matrix, AdamW's two moments of the rest; the step
    runs and learns."""
    tc = TrainConfig(batch_size=4, seq_len=16, warmup_steps=0, schedule="constant", optimizer="muon", lr=0.02)
    trainer = make_trainer(MOE, tc, one_device())
    state = trainer.states.init(0)
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    muon = muon_dimensions(abstract_model(MOE), tc.muon_groups)
    flat = {tuple(getattr(k, "key", k) for k in p): v for p, v in jax.tree_util.tree_flatten_with_path(
        state["params"])[0]}
    n_muon = sum(flat[path].size for path in muon)
    assert count(state["opt_state"]) == n_muon + 2 * (count(state["params"]) - n_muon) + 1  # + Adam's count
    batch = token_batch(1, 4, 16, 48)
    losses = []
    for _ in range(4):
        state, metrics = trainer.train_step(state, trainer.batches.put(batch))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.05, losses


def test_muon_with_lora_is_refused_in_one_line():
    tc = TrainConfig(batch_size=4, seq_len=16, warmup_steps=0, optimizer="muon")
    with pytest.raises(ValueError, match=r"train.optimizer=muon .* lora: run trains only low-rank adapters"):
        make_trainer(ModelConfig(vocab_size=48, d_model=32, d_ff=64, n_layers=1, n_heads=2,
                                 max_position_embeddings=32), tc, one_device(), lora=LoRAConfig())


@pytest.mark.parametrize("field, value, message", [
    ("optimizer", "sgd", "expected one of adamw, muon"),
    ("muon_groups", ("attention", "embedding"), "expected a list of groups from attention, mlp, experts, router"),
    ("muon_adjust_lr", "none", "expected one of match_rms_adamw, original"),
    ("muon_momentum", 1.0, r"expected a decay rate in \[0, 1\)"),
    ("muon_ns_steps", 0, "expected a positive integer"),
])
def test_muon_fields_are_validated(field, value, message):
    with pytest.raises(ValueError, match=rf"TrainConfig.{field}=.* is invalid: {message}"):
        dataclasses.replace(TrainConfig(), **{field: value})


@pytest.mark.parametrize("groups", [(), ("experts",)])
def test_muon_groups_that_select_no_matrix_are_refused(groups):
    """No group, or only a mixture's groups for a dense model: Muon would move nothing (was accepted)."""
    tc = TrainConfig(warmup_steps=0, optimizer="muon", muon_groups=groups)
    with pytest.raises(ValueError, match=rf"^train.muon_groups=\[{', '.join(map(repr, groups))}\] selects no matrix "
                                         r"of this model, so Muon would move nothing"):
        make_trainer(DENSE, tc, one_device())


DENSE = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, d_ff=128, max_position_embeddings=32)
EXPERTS = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, ffn_type="moe",
                      n_experts=8, experts_per_token=2, expert_d_ff=16, n_shared_experts=1, router_score="sigmoid",
                      router_selection_bias=True, router_norm_topk=True, max_position_embeddings=32)
ON_MESHES = {"fsdp2_tensor4": (DENSE, dict(fsdp=2, tensor=4)),
             "fsdp2_expert2_tensor2": (EXPERTS, dict(fsdp=2, expert=2, tensor=2))}
MUON_TC = TrainConfig(batch_size=8, seq_len=16, warmup_steps=0, schedule="constant", optimizer="muon", lr=0.02)


def sharded_directions(trainer, grads: list[dict]) -> list[dict]:
    """The optimiser's directions for `grads` in turn, from a fresh state, every array sharded as the
    trainer's state is (the Newton-Schulz iteration runs on the sharded matrices)."""
    sh = trainer.states.shardings
    update = jax.jit(lambda g, s, p: trainer.states.tx.update(g, s, p), in_shardings=(sh["params"], sh["opt_state"],
                     sh["params"]), out_shardings=(sh["params"], sh["opt_state"]))
    state = trainer.states.init(0)
    opt_state, out = state["opt_state"], []
    for g in grads:
        direction, opt_state = update(jax.device_put(g, sh["params"]), opt_state, state["params"])
        out.append(jax.device_get(direction))
    return out


@pytest.mark.parametrize("name", list(ON_MESHES))
def test_muon_on_a_mesh_gives_the_one_device_update(name):
    """FSDP-, tensor- and expert-sharded matrices, orthogonalised where they lie, give the one-device
    direction over three steps of fixed gradients, within 1e-5 of its norm (each leaf: AdamW's
    too). (A whole step's gradients agree within 1e-4, `common.assert_step_matches_one_device`; a
    direction orthogonalised from them agrees within about 2e-5, AdamW's first steps within 2e-4.)"""
    cfg, sizes = ON_MESHES[name]
    mesh = make_mesh(**sizes)
    one, many = make_trainer(cfg, MUON_TC, one_device()), make_trainer(cfg, MUON_TC, mesh)
    rng = np.random.default_rng(0)
    shapes = one.states.abstract()["params"]
    grads = [jax.tree.map(lambda s: rng.normal(0, 1, s.shape).astype(np.float32), shapes) for _ in range(3)]
    for got, want in zip(sharded_directions(many, grads), sharded_directions(one, grads)):
        assert_leaves_match(got, want, rtol=1e-5, what="Muon direction")



def test_a_run_resumes_only_with_the_optimizer_its_checkpoints_hold(tmp_path):
    """The optimiser state of the checkpoints is AdamW's or Muon's (over its groups): a resume with
    another is refused by name; one with the same optimiser and other settings goes on."""
    import yaml

    from modern_jax.data.config import DataConfig
    from modern_jax.training import RunConfig
    from modern_jax.training.checkpoint import check_resume

    def run(**train):
        return RunConfig(DENSE.to_dict(), TrainConfig(**train), DataConfig())

    (tmp_path / "config.yaml").write_text(yaml.safe_dump(run().to_dict()))
    with pytest.raises(ValueError, match=r"hold the optimizer state of train.optimizer=adamw .*, not of "
                                         r"train.optimizer=muon with train.muon_groups=\['attention', 'experts', 'mlp'\]"):
        check_resume(tmp_path, run(optimizer="muon"), print)
    check_resume(tmp_path, run(lr=0.5), print)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(run(optimizer="muon").to_dict()))
    with pytest.raises(ValueError, match=r"muon_groups=\['attention', 'experts', 'mlp'\] .* not of .*muon_groups=\['mlp'\]"):
        check_resume(tmp_path, run(optimizer="muon", muon_groups=("mlp",)), print)
    check_resume(tmp_path, run(optimizer="muon", muon_momentum=0.9), print)
