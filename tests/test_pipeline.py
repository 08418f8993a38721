"""Pipeline parallelism on 8 host CPU devices: the layers over the `stage` axis (GPipe, 1F1B and the
interleaved, circular schedule), mixed with data, fsdp, tensor and expert, with DPO, LoRA and
gradient accumulation, against one device; an interleaved mixture's per-layer loads and selection
biases against one device; the stages' shards, refusals, the CLI's losses and a pipelined checkpoint
resumed without stages; host offload's gradients and its placements in pinned host memory."""

import json
import pathlib

import jax
import numpy as np
import pytest

from modern_jax.cli import main
from modern_jax.config import ModelConfig
from modern_jax.execution import ExecutionConfig
from modern_jax.sharding import ParallelConfig, Strategies
from modern_jax.sharding.mesh import make_mesh
from modern_jax.training import TrainConfig, load_run_config, train

from common import assert_step_matches_one_device, make_trainer, one_device, token_batch

REPO = pathlib.Path(__file__).parent.parent
DENSE = ModelConfig(vocab_size=64, d_model=32, n_layers=8, n_heads=4, n_kv_heads=2, d_ff=64, qk_norm="head",
                    max_position_embeddings=32)
MOE = DENSE.replace(n_layers=4, ffn_type="moe", n_experts=8, experts_per_token=2, expert_d_ff=16,
                    router_norm_topk=True)
TC = TrainConfig(batch_size=8, seq_len=16, moe_aux_weight=0.01, moe_router_z_weight=0.01)

CASES = {  # mesh, microbatches, schedule, stages a device, remat
    "gpipe_stage2_fsdp2_tensor2_remat": (dict(stage=2, data=1, fsdp=2, tensor=2), 4, "gpipe", 1, "full"),
    "interleaved_stage2x2_data2_tensor2": (dict(stage=2, data=2, tensor=2), 2, "interleaved", 2, "full"),
    "interleaved_stage4x2_fsdp2_m8": (dict(stage=4, data=1, fsdp=2), 8, "interleaved", 2, "none"),
    "1f1b_stage2_data2_fsdp2_m4": (dict(stage=2, data=2, fsdp=2), 4, "1f1b", 1, "none"),
    "1f1b_stage4_tensor2_m8_remat": (dict(stage=4, data=1, tensor=2), 8, "1f1b", 1, "full"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_pipelined_step_equals_one_device(case):
    """The loss (1e-5) and every gradient leaf of a step with the layers over the stages equal the
    one-device step's, for each schedule, mixed with the other axes."""
    sizes, M, schedule, repeats, remat = CASES[case]
    strategies = Strategies(microbatches=M, pipeline_schedule=schedule, stage_repeats=repeats)
    assert_step_matches_one_device(DENSE, TC, make_mesh(**sizes), token_batch(1, 8, 16, 64),
                                   strategies=strategies, execution=ExecutionConfig(remat=remat))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_moe_over_stage_and_expert_equals_one_device_with_its_balance_losses(schedule):
    """GPipe: the batch's balance loss is rebuilt from the microbatches' loads and scores; 1F1B
    (whose loss runs per microbatch): the per-sequence balance loss is their mean; the router
    z-loss is their mean: both, the loads and every gradient equal one device's."""
    model = MOE.replace(moe_aux_per_sequence=schedule == "1f1b")
    many, one = assert_step_matches_one_device(model, TC, make_mesh(stage=2, data=2, expert=2),
                                               token_batch(1, 8, 16, 64),
                                               strategies=Strategies(microbatches=2, pipeline_schedule=schedule))
    for name in ("moe_aux_loss", "moe_router_z_loss"):
        np.testing.assert_allclose(many[name], one[name], rtol=1e-5)
    np.testing.assert_array_equal(many["moe_load_max"], one["moe_load_max"])


def test_an_interleaved_moe_balances_each_layers_selection_bias_as_one_device():
    """Interleaved, 2 stages a device of one layer each: device s runs layers s and 2 + s, and what
    a stage sows (its experts' load) is its layer's. The forward pass's load of each layer, and each
    layer's selection bias after auxiliary-loss-free balancing by them (as a training step moves it),
    equal one device's (layers 1 and 2, which a stage and a round mixed up would swap, move apart)."""
    from flax import nnx

    from modern_jax.layers.moe import LOAD
    from modern_jax.model import Transformer
    from modern_jax.sharding import logical_rules, state_shardings

    rate = 0.01
    graphdef, state = nnx.split(Transformer(MOE.replace(router_score="sigmoid", router_selection_bias=True),
                                            rngs=nnx.Rngs(0)))
    tokens = np.random.default_rng(0).integers(0, 64, (8, 16)).astype(np.int32)

    def balanced(state, tokens):  # [layers, experts]: each layer's load, and its selection bias balanced by it
        model = nnx.merge(graphdef, state)
        _, sown = nnx.capture(lambda m: m.hidden_states(tokens), nnx.Intermediate)(model)
        load_LE = next(v.get_value()[0] for path, v in nnx.to_flat_state(sown) if LOAD in map(str, path))
        model.balance_routers(load_LE, rate)
        return load_LE, model.stages[0].blocks[0].mlp.router.selection_bias[...]

    load, bias = jax.device_get(jax.jit(balanced)(state, tokens))
    mesh = make_mesh(stage=2, data=4)
    with logical_rules(mesh, strategies=Strategies(microbatches=2, pipeline_schedule="interleaved", stage_repeats=2)):
        got_load, got_bias = jax.device_get(jax.jit(balanced)(jax.device_put(state, state_shardings(state, mesh)),
                                                               tokens))
    assert load.shape == (4, 8) and (load.sum(axis=1) == 8 * 16 * 2).all()  # every token's 2 experts, each layer
    assert np.abs(bias[1] - bias[2]).max() >= 2 * rate - 1e-6
    np.testing.assert_allclose(got_bias, bias, atol=1e-7)
    np.testing.assert_array_equal(got_load, load)


def test_lora_dpo_with_gradient_accumulation_under_1f1b_equals_one_device():
    """1F1B runs each microbatch's loss inside the stages' loop: DPO's pairs stay whole in their
    microbatch, LoRA's frozen base rides along undifferentiated, and 2 accumulated micro-batches
    of 4 pairs over stage 2 x fsdp 2 x tensor 2 give one device's loss, rewards and adapter
    gradients."""
    from flax.nnx import traversals

    from common import assert_leaves_match, probe, step_gradients
    from modern_jax.lora_config import LoRAConfig
    from modern_jax.training.objectives.dpo import DPO, DPOConfig
    from test_dpo import random_pairs

    tc = probe(TrainConfig(batch_size=16, seq_len=8, steps=2, warmup_steps=0, grad_accum=2))
    batch = {k: v.reshape(2, 8, *v.shape[2:]) for k, v in random_pairs(8, 8, 64).items()}
    results = {}
    for name, mesh, strategies in (("one", one_device(), Strategies()),
                                   ("many", make_mesh(stage=2, fsdp=2, tensor=2),
                                    Strategies(microbatches=2, pipeline_schedule="1f1b"))):
        trainer = make_trainer(DENSE.replace(n_layers=2), tc, mesh, strategies=strategies,
                          lora=LoRAConfig(rank=4), objective=DPO(DPOConfig(beta=0.5), tc))
        state = trainer.states.init(0)
        params = traversals.flatten_mapping(jax.device_get(state["params"]))
        for i, k in enumerate(sorted(k for k in params if k[-1] == "lora_b")):  # B moved: not the reference
            params[k] = 0.1 * np.random.default_rng(i).standard_normal(params[k].shape).astype(np.float32)
        state["params"] = jax.tree.map(lambda x, like: jax.device_put(x, like.sharding),
                                       traversals.unflatten_mapping(params), state["params"])
        results[name] = step_gradients(trainer, state, batch)
    (got, many), (want, one) = results["many"], results["one"]
    for key in ("loss", "rewards/margins", "rewards/accuracies"):
        np.testing.assert_allclose(many[key], one[key], rtol=1e-5, atol=1e-6, err_msg=key)
    adapters = lambda g: {"/".join(map(str, k)): v for k, v in traversals.flatten_mapping(g).items()  # noqa: E731
                          if k[-1] in ("lora_a", "lora_b")}
    assert len(adapters(want)) == 14  # A and B of the 7 projections, stacked over the layers
    assert_leaves_match(adapters(got), adapters(want), rtol=1e-4)


def test_each_stage_holds_its_own_layers():
    """With stage=4 each device holds 2 of the 8 layers (the `layers` rule), in order."""
    trainer = make_trainer(DENSE, TC, make_mesh(stage=4, data=2), strategies=Strategies(microbatches=2))
    kernel = trainer.states.init(0)["params"]["stages"][0]["blocks"][0]["self_attn"]["q_proj"]["kernel"]
    stage = trainer.mesh.axis_names.index("stage")
    for shard in kernel.addressable_shards:
        position = next(i for i, d in np.ndenumerate(trainer.mesh.devices) if d == shard.device)[stage]
        assert shard.data.shape[0] == 2 and shard.index[0] == slice(2 * position, 2 * position + 2)


def test_depths_and_settings_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match=r"the stack of layers 0 .. 5: its 6 units do not split over parallel.stage=4 "
                                         r"x stage_repeats=1 = 4 stages: stage x stage_repeats must divide 6 "
                                         r"\(1, 2, 3, 6\)"):
        make_trainer(DENSE.replace(n_layers=6), TC, make_mesh(stage=4, data=2), strategies=Strategies(microbatches=4))
    interleaved = Strategies(microbatches=4, pipeline_schedule="interleaved", stage_repeats=3)
    with pytest.raises(ValueError, match=r"the stack of layers 0 .. 7: its 8 units do not split over parallel.stage=2 x stage_repeats=3 = 6 "
                                         r"stages: stage x stage_repeats must divide 8 \(1, 2, 4, 8\)"):
        make_trainer(DENSE, TC, make_mesh(stage=2, data=4), strategies=interleaved)
    with pytest.raises(ValueError, match=r"train.batch_size / train.grad_accum = 8 rows do not split into "
                                         r"parallel.microbatches=3: make it a multiple of 3"):
        make_trainer(DENSE, TC, make_mesh(stage=2, data=4), strategies=Strategies(microbatches=3))
    one_f_one_b = Strategies(microbatches=2, pipeline_schedule="1f1b")
    with pytest.raises(ValueError, match=r"the batch's balance loss \(train.moe_aux_weight=0.01\) needs every "
                                         r"microbatch's expert counts first: set model.moe_aux_per_sequence=true"):
        make_trainer(MOE, TC, make_mesh(stage=2, data=4), strategies=one_f_one_b)
    from modern_jax.training.objectives.dpo import DPO, DPOConfig

    dpo = TrainConfig(batch_size=4, seq_len=16)
    with pytest.raises(ValueError, match=r"train.batch_size / train.grad_accum = 4 rows do not split into "
                                         r"parallel.microbatches=4: make it a multiple of 4 microbatches x 2"):
        make_trainer(DENSE, dpo, make_mesh(stage=2, data=4), objective=DPO(DPOConfig(), dpo),
                strategies=Strategies(microbatches=4, pipeline_schedule="1f1b"))
    for values, message in [
        (dict(microbatches=2), r"ParallelConfig.microbatches=2 .*need stage > 1"),
        (dict(stage=2, pipeline_schedule="1F1B"), r"pipeline_schedule='1F1B' .*expected one of gpipe, 1f1b, "
                                                  r"interleaved"),
        (dict(stage=2, stage_repeats=2), r"stage_repeats=2 .*gpipe runs each stage once: use "
                                         r"pipeline_schedule=interleaved"),
        (dict(stage=2, pipeline_schedule="1f1b", stage_repeats=2), r"1f1b runs each stage once"),
        (dict(stage=2, pipeline_schedule="interleaved", stage_repeats=1), r"interleaved needs at least 2"),
        (dict(stage=4, microbatches=2, pipeline_schedule="interleaved", stage_repeats=2),
         r"microbatches=2 .*give at least stage=4"),
        (dict(stage=0), r"ParallelConfig.stage=0"),
    ]:
        with pytest.raises(ValueError, match=message):
            ParallelConfig.from_dict(values)


def cli_overrides(tmp_path) -> list[str]:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(np.random.default_rng(0).choice(["alpha", "beta", "gamma", "\n"], 2000)))
    small = {"d_model": 32, "n_layers": 4, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64, "max_position_embeddings": 32,
             "vocab_size": "auto"}
    settings = {"batch_size": 8, "seq_len": 16, "warmup_steps": 1, "log_every": 1, "eval_every": 0, "eval_windows": 8,
                "eval_batch_size": 8, "final_eval_windows": 8, "samples": 0, "progress": False, "plot": False,
                "tensorboard": False, "lr": 1e-2}
    return ["data.tokenizer=char", f"data.path={corpus}"] + [f"model.{k}={v}" for k, v in small.items()] + \
        [f"train.{k}={json.dumps(v)}" for k, v in settings.items()]


def test_cli_pipelined_runs_give_the_one_device_losses_and_resume_without_stages(tmp_path, capsys):
    """Steps with stage 2 x data 2 x fsdp 2 give the one-device losses: interleaved (2 stages a
    device) for 2 steps, then resumed on a mesh without stages for the last 2 (the uninterrupted
    run's losses); 1F1B (4 microbatches) for all 4, and its final evaluation's (the forward-only
    passes run as GPipe)."""
    overrides, config = cli_overrides(tmp_path), str(REPO / "configs/tiny.yaml")
    one = train(load_run_config(config, overrides + ["train.steps=4", "train.checkpoint_every=0",
                                                     f"train.output_dir={tmp_path / 'one'}"]),
                mesh=one_device(), log=lambda *_: None)
    pipelined = ["--mesh", "stage=2,data=2,fsdp=2", "parallel.microbatches=2", "parallel.pipeline_schedule=interleaved",
                 "parallel.stage_repeats=2"]
    # the interleaved run: 2 steps, saved, then resumed on a mesh without stages for the last 2
    assert main(["train", "--config", config, *pipelined, *overrides, "train.steps=2", "train.checkpoint_every=2",
                 f"train.output_dir={tmp_path / 'pipe'}"]) == 0, capsys.readouterr().err
    assert main(["train", "--config", config, "--mesh", "data=4,fsdp=2", *overrides, "train.steps=4",
                 "train.checkpoint_every=2", f"train.output_dir={tmp_path / 'pipe'}"]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "pipe/metrics.jsonl").read_text().splitlines()]
    want = [h["loss"] for h in one.history]
    np.testing.assert_allclose([r["loss"] for r in rows if r["split"] == "train"], want, rtol=1e-5)

    assert main(["train", "--config", config, "--mesh", "stage=2,data=2,fsdp=2", "parallel.microbatches=4",
                 "parallel.pipeline_schedule=1f1b", *overrides, "train.steps=4", "train.checkpoint_every=0",
                 f"train.output_dir={tmp_path / '1f1b'}"]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "1f1b/metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([r["loss"] for r in rows if r["split"] == "train"], want, rtol=1e-5)
    final = [r for r in rows if r["split"] != "train"]
    assert final, rows[-1]
    np.testing.assert_allclose(final[-1]["loss"], one.val_loss, rtol=1e-5)


def test_a_checkpoint_restores_into_another_stack_layout(tmp_path):
    """A run without stages saves its stacks as `[N, ...]`; an interleaved run holds them as
    `[R, N / R, ...]` over the stages: it restores the same parameters and optimizer moments."""
    from modern_jax.training.checkpoint import Checkpointer

    plain = make_trainer(DENSE, TC, make_mesh(data=8))
    state, _ = plain.train_step(plain.states.init(0), plain.batches.put(token_batch(1, 8, 16, 64)))
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep=1, async_save=False)
    checkpointer.save(state, {"step": 1})
    checkpointer.close()
    interleaved = make_trainer(DENSE, TC, make_mesh(stage=2, data=4), strategies=Strategies(
        microbatches=2, pipeline_schedule="interleaved", stage_repeats=2))
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep=1, async_save=False)
    restored, _ = checkpointer.restore(interleaved.states.abstract(), 1)
    checkpointer.close()
    kernel = restored["params"]["stages"][0]["blocks"][0]["mlp"]["down_proj"]["kernel"]
    assert kernel.shape == (2, 4, 64, 32) and kernel.sharding.spec[:2] == (None, "stage")
    got = jax.device_get(interleaved.states.model_params(restored["params"]))
    for path, want in jax.tree_util.tree_flatten_with_path(jax.device_get(state["params"]))[0]:
        np.testing.assert_array_equal(dict(jax.tree_util.tree_flatten_with_path(got)[0])[path], want)
    mu = restored["opt_state"][1][0].mu["stages"][0]["blocks"][0]["mlp"]["down_proj"]["kernel"]
    want_mu = state["opt_state"][1][0].mu["stages"][0]["blocks"][0]["mlp"]["down_proj"]["kernel"]
    np.testing.assert_array_equal(np.asarray(mu).reshape(want_mu.shape), np.asarray(want_mu))


def test_one_stage_a_process_over_two_processes_launched_as_slurm_gives_one_process_losses(tmp_path, capsys):
    """2 processes x 4 devices as `srun` starts them, stage 2 outermost (each process one stage, its
    activations crossing between them) x data 2 x fsdp 2, interleaved, fed by a mixture of two
    directories of token shards (each process reading its rows of every batch from them): every
    step's loss equals one process's on the same mesh (1e-5)."""
    from processes import Launch, records

    sources = []
    for k, (name, weight) in enumerate((("web", 0.7), ("code", 0.3))):
        ids = np.random.default_rng(k).integers(0, 64, 3000).astype(np.uint16)
        ids[::50] = 258  # <eos>: documents of 50 tokens
        (tmp_path / name).mkdir()
        for i, part in enumerate(np.split(ids, [1000, 2200])):  # three shards each
            (tmp_path / name / f"part-{i}.bin").write_bytes(part.tobytes())
        sources.append(f"{{path: {tmp_path / name}, weight: {weight}}}")
    overrides = [o for o in cli_overrides(tmp_path) if not o.startswith("data.")] + [
        f"data.sources=[{', '.join(sources)}]", "data.doc_separator_id=258", "train.steps=3", "train.checkpoint_every=0"]
    run = ["train", "--config", str(REPO / "configs/tiny.yaml"), "--mesh", "stage=2,data=2,fsdp=2",
           "parallel.microbatches=2", "parallel.pipeline_schedule=interleaved", "parallel.stage_repeats=2", *overrides]
    assert main([*run, f"train.output_dir={tmp_path / 'one'}"]) == 0, capsys.readouterr().err
    launch = Launch([*run, f"train.output_dir={tmp_path / 'two'}"], n=2, devices=4, logdir=tmp_path)
    assert launch.wait() == [0, 0], launch.log(0)[-3000:] + launch.log(1)[-3000:]
    one, two = ([r["loss"] for r in records(tmp_path / name)] for name in ("one", "two"))
    assert len(two) == 3
    np.testing.assert_allclose(two, one, rtol=1e-5)
    shares = records(tmp_path / "two", "data")[-1]  # each source's share of the tokens, logged by process 0
    assert shares["share/web"] > shares["share/code"] > 0, shares


@pytest.mark.parametrize("policy", ["offload_input", "offload_qkv_out"])
def test_host_offload_gives_plain_remats_loss_and_gradients(policy):
    """The offload policies keep the layer input (and q, k, v, the attention output) in host memory
    between the passes: the loss equals full remat's (1e-6), and every gradient (1e-5 in norm)."""
    from common import assert_leaves_match, train_step_gradients

    want, plain = train_step_gradients(DENSE, TC, one_device(), token_batch(1, 8, 16, 64),
                                       execution=ExecutionConfig(remat="full"))
    got, offloaded = train_step_gradients(DENSE, TC, one_device(), token_batch(1, 8, 16, 64),
                                          execution=ExecutionConfig(remat=policy))
    np.testing.assert_allclose(offloaded["loss"], plain["loss"], rtol=1e-6)
    assert_leaves_match(got, want, rtol=1e-5)  # in norm: saving q, k, v rounds apart from recomputing them


def test_host_offload_puts_what_it_keeps_in_pinned_host_memory():
    """The offload policies' placements in the backward pass's program, lowered for TPU (XLA:CPU
    lowers a placement to nothing, so the CPU's program of an offload policy is full remat's): the
    layer input goes to `pinned_host` under offload_input, q, k, v and the attention output too
    under offload_qkv_out, and nothing does under full remat or none."""
    import re

    import jax.numpy as jnp
    from flax import nnx

    from modern_jax import execution
    from modern_jax.model import Transformer

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(DENSE.replace(n_layers=2), rngs=nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)

    def placed_on_host(remat: str) -> int:
        with execution.use(ExecutionConfig(remat=remat)):
            grad = jax.jit(jax.grad(lambda state, x: jnp.mean(nnx.merge(graphdef, state)(x))))
            text = grad.trace(abstract, tokens).lower(lowering_platforms=("tpu",)).as_text()
        return len(re.findall(r'_xla_buffer_placement = "pinned_host"', text))

    counts = {remat: placed_on_host(remat) for remat in ("none", "full", "offload_input", "offload_qkv_out")}
    assert counts["none"] == counts["full"] == 0 < counts["offload_input"] < counts["offload_qkv_out"], counts


def test_cli_moe_over_stage_and_expert_gives_the_one_device_losses_for_10_steps(tmp_path, capsys):
    """A mixture of experts with its layers over 2 stages and its experts over 2 devices (x data 2):
    the first 10 losses equal one device's (1e-5), the balance loss joining every gradient."""
    overrides = cli_overrides(tmp_path) + ["model.expert_d_ff=16", "model.n_experts=4", "train.steps=10",
                                           "train.checkpoint_every=0", "train.moe_aux_weight=0.01"]
    config = str(REPO / "configs/moe_tiny.yaml")
    one = train(load_run_config(config, overrides + [f"train.output_dir={tmp_path / 'one'}"]), mesh=one_device(),
                log=lambda *_: None)
    assert main(["train", "--config", config, "--mesh", "stage=2,data=2,expert=2", "parallel.microbatches=2",
                 *overrides, f"train.output_dir={tmp_path / 'pipe'}"]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "pipe/metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([r["loss"] for r in rows if r["split"] == "train"], [h["loss"] for h in one.history],
                               rtol=1e-5)
