"""DPO: the loss and TRL's logged rewards against TRL itself, the reference model, and the steps.

The reference values (tests/fixtures/hf_peft/llama/dpo) were made by TRL 1.16.0's own
`DPOTrainer._compute_loss` with transformers' log-probabilities, the policy the PEFT adapter
on the tiny Llama and the reference its base:

    python scripts/make_hf_fixtures.py dpo-reference --model tests/fixtures/hf_peft/llama/base \\
        --adapter tests/fixtures/hf_peft/llama/adapter --batch .../batch.npz --out .../sigmoid.npz \\
        --beta 0.1 --loss-type sigmoid [--label-smoothing 0.1 | --loss-type ipo]

(TRL 1.16's sigmoid loss has no label smoothing; the script also writes the cDPO formula's,
`losses_label_smoothed`, which `label_smoothing` here computes.)
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re

import jax
import numpy as np
import pytest
from flax import nnx
from flax.nnx import traversals

from modern_jax.config import ModelConfig
from modern_jax.convert import from_hf
from modern_jax.convert.peft import peft_targets, read_peft, read_peft_config
from modern_jax.lora_config import LoRAConfig
from modern_jax.training import TrainConfig
from modern_jax.training.config import run_config_from_dict

from modern_jax.training.objectives.dpo import DPO, DPOConfig

from common import make_trainer, one_device

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "hf_peft" / "llama"
TINY = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=128,
                   max_position_embeddings=32)
METRICS = {"rewards/chosen": "rewards_chosen", "rewards/rejected": "rewards_rejected",
           "rewards/accuracies": "rewards_accuracies", "rewards/margins": "rewards_margins",
           "logps/chosen": "logps_chosen", "logps/rejected": "logps_rejected"}


def pair_batch(tokens_P2W, weights_P2W) -> dict:
    """Our `[1, 2P, T]` batch of TRL's rows (`weights[t]`: token t + 1 is a completion token), one
    sequence to a row (`sequence`: the row)."""
    tokens = tokens_P2W.reshape(-1, tokens_P2W.shape[-1])  # rows: chosen, rejected, chosen, ...
    T = tokens.shape[1] - 1
    valid = np.cumsum(tokens[:, ::-1] != 0, axis=1)[:, ::-1][:, :T] > 0
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "positions": np.broadcast_to(np.arange(T), (len(tokens), T)), "segment_ids": valid,
             "weights": weights_P2W.reshape(len(tokens), -1)[:, :T],
             "sequence": np.broadcast_to(np.arange(len(tokens))[:, None], (len(tokens), T))}
    return {k: np.ascontiguousarray(v)[None].astype(np.float32 if k == "weights" else np.int32)
            for k, v in batch.items()}


def random_pairs(P: int, T: int, V: int, seed: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, V, (P, 2, T + 1))
    weights = np.zeros((P, 2, T + 1), np.float32)
    weights[..., 3:T] = 1.0
    return pair_batch(tokens, weights)


@pytest.mark.parametrize("loss_type, smoothing, loss_key", [("sigmoid", 0.0, "loss"),
                                                            ("sigmoid", 0.1, "loss_label_smoothed"),
                                                            ("ipo", 0.0, "loss")])
def test_the_loss_and_every_logged_reward_equal_trl_on_a_fixed_batch(loss_type, smoothing, loss_key):
    name = {"sigmoid": "sigmoid" if not smoothing else "sigmoid_ls0.1", "ipo": "ipo"}[loss_type]
    with np.load(FIXTURE / "dpo" / f"{name}.npz") as z:
        want = dict(z)
    with np.load(FIXTURE / "dpo" / "batch.npz") as z:
        batch = pair_batch(z["tokens"], z["weights"])
    dpo = DPOConfig(beta=float(want["beta"]), loss_type=loss_type, label_smoothing=smoothing)
    trainer, params = trl_policy(dpo, rows=batch["inputs"].shape[1], seq_len=batch["inputs"].shape[2])
    assert_trl_figures(jax.device_get(trainer.eval_step(params, trainer.batches.put(batch), None)), want, loss_key)


def trl_policy(dpo: DPOConfig, rows: int, seq_len: int):
    """`(trainer, params)`: the PEFT adapter on the tiny Llama as the policy, its base the reference."""
    cfg, base = from_hf(FIXTURE / "base")
    adapter = FIXTURE / "adapter"
    lora = dataclasses.replace(read_peft_config(adapter), targets=peft_targets(adapter, base, "llama"))
    tc = TrainConfig(batch_size=rows, eval_batch_size=rows, seq_len=seq_len, warmup_steps=0)
    trainer = make_trainer(cfg, tc, one_device(), lora=lora, objective=DPO(dpo, tc))
    params = traversals.flatten_mapping(jax.device_get(trainer.states.init(0)["params"]))
    params.update(traversals.flatten_mapping(jax.device_get(nnx.to_pure_dict(nnx.state(base, nnx.Param)))))
    params.update(traversals.flatten_mapping(read_peft(adapter, trainer.states.model(trainer.states.init(0)["params"]),
                                                       "llama")))
    return trainer, traversals.unflatten_mapping(params)


def assert_trl_figures(sums: dict, want: dict, loss_key: str = "loss") -> None:
    pairs = float(sums["pairs"])
    assert pairs == 3
    np.testing.assert_allclose(float(sums["dpo_loss"]) / pairs, want[loss_key], rtol=1e-5, atol=1e-6)
    for ours, theirs in METRICS.items():
        np.testing.assert_allclose(float(sums[ours]) / pairs, want[theirs], rtol=1e-5, atol=1e-6, err_msg=ours)


def test_a_batch_is_packed_into_the_fewest_tokens_and_gives_trls_figures():
    """TRL's fixed batch (6 sequences of 7 to 12 tokens) as rows of train.seq_len=32: the objective
    packs it 2 rows x 32 (64 tokens; one sequence to a row would take 6 x 16 = 96), several
    sequences to a row, each its own segment with positions from 0, and gives TRL's loss and
    rewards (1e-5), as the same batch one sequence to a row 32 wide does."""
    with np.load(FIXTURE / "dpo" / "sigmoid.npz") as z:
        want = dict(z)
    with np.load(FIXTURE / "dpo" / "batch.npz") as z:
        padded = {k: np.pad(z[k], ((0, 0), (0, 0), (0, 33 - z[k].shape[-1]))) for k in ("tokens", "weights")}
        lengths = (padded["tokens"] != 0).sum(-1).reshape(1, -1)
    item = pair_batch(padded["tokens"], padded["weights"])
    trainer, params = trl_policy(DPOConfig(beta=float(want["beta"])), rows=6, seq_len=32)
    placed = trainer.objective.place_batch({**item, "lengths": lengths}, trainer=trainer, params=params,
                                           rows=None, step=0, key=None)
    assert sorted(lengths[0]) == [7, 8, 9, 10, 11, 12] and placed["inputs"].shape == (1, 2, 32)
    segments, sequence = np.asarray(placed["segment_ids"][0]), np.asarray(placed["sequence"][0])
    assert (segments.max(-1) >= 2).any()  # a row holds two sequences
    for s in range(6):  # each sequence whole, in one segment, its tokens in order from position 0
        row, cols = np.nonzero((sequence == s) & (segments > 0))
        assert len(set(row)) == 1 and len(set(segments[row, cols])) == 1 and len(cols) == lengths[0, s] - 1
        np.testing.assert_array_equal(np.asarray(placed["positions"][0])[row, cols], np.arange(len(cols)))
        np.testing.assert_array_equal(np.asarray(placed["inputs"][0])[row, cols], item["inputs"][0, s, :len(cols)])
    for batch in (placed, trainer.batches.put(item)):
        assert_trl_figures(jax.device_get(trainer.eval_step(params, batch, None)), want)
    from modern_jax.training.objectives.dpo import laid_out

    whole = laid_out(item, lengths, trainer.batches, 1, staged=True)  # a pipeline's
    assert whole["inputs"].shape == (1, 6, 16)  # one sequence to a row, in order, its L - 1 inputs
    inputs = np.arange(32) < lengths[..., None] - 1
    for key in ("inputs", "segment_ids", "sequence"):
        np.testing.assert_array_equal(whole[key], np.where(inputs, item[key], 0)[..., :16], err_msg=key)


def step_metrics(cfg, tc, lora, dpo, batch, seed: int = 0):
    trainer = make_trainer(cfg, tc, one_device(), lora=lora, objective=DPO(dpo, tc))
    state = trainer.states.init(seed)
    before = jax.device_get(state)
    state, metrics = trainer.train_step(state, trainer.batches.put(batch))
    return trainer, before, jax.device_get(state), jax.device_get(metrics)


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_lora_dpo_starts_at_log_2_with_the_base_as_its_reference(quantize):
    """B = 0: the policy is its reference exactly (a QLoRA one's too: the same NF4 base), so every
    pair's margin is 0 and the loss log 2."""
    tc = TrainConfig(batch_size=4, seq_len=8, steps=3, warmup_steps=0, lr=1e-2, weight_decay=0.0)
    trainer, before, after, metrics = step_metrics(TINY, tc, LoRAConfig(rank=4, quantize=quantize), DPOConfig(),
                                                   random_pairs(2, 8, 64))
    assert "reference" not in after  # no second copy of the weights
    assert float(metrics["loss"]) == np.float32(math.log(2))
    assert float(metrics["rewards/margins"]) == 0.0 and float(metrics["rewards/chosen"]) == 0.0
    assert float(metrics["rewards/accuracies"]) == 0.0  # every pair ties, and a tie is no win (TRL's chosen > rejected)
    assert float(metrics["logps/chosen"]) < 0
    moved = [k for k, v in traversals.flatten_mapping(after["params"]).items()
             if not np.array_equal(v, traversals.flatten_mapping(before["params"])[k])]
    assert moved and all("adapter" in k for k in moved)


def test_full_dpo_keeps_a_frozen_copy_of_its_start_as_the_reference():
    tc = TrainConfig(batch_size=4, seq_len=8, steps=3, warmup_steps=0, lr=1e-2, weight_decay=0.0)
    batch = random_pairs(2, 8, 64)
    trainer, before, after, metrics = step_metrics(TINY, tc, None, DPOConfig(beta=0.5), batch)
    assert float(metrics["loss"]) == np.float32(math.log(2))
    jax.tree.map(np.testing.assert_array_equal, after["reference"], before["params"])  # frozen
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after["params"]),
                                                        jax.tree.leaves(before["params"])))
    state = jax.device_put(after)
    state, second = trainer.train_step(state, trainer.batches.put(batch))
    assert float(second["rewards/margins"]) > 0  # the policy moved from its reference towards the chosen
    assert float(second["loss"]) < math.log(2)


@pytest.mark.quick
def test_the_accuracy_counts_a_tie_as_no_win():
    """`rewards/accuracies` counts the pairs whose chosen reward is above the rejected one's, strictly
    (TRL's `chosen_rewards > rejected_rewards`): of a win, two exact ties (at 0 and below it), a loss
    and a padding pair, one of the 4 real pairs, as a naive count in NumPy gives."""
    from modern_jax.training.objectives.dpo import preference_sums

    beta = 0.5
    # rows alternate chosen, rejected: pairs win, tie at 0, loss, tie below 0, padding (no tokens)
    pi = np.asarray([-1.0, -2.0, -3.0, -3.0, -2.0, -1.0, -4.0, -5.0, 0.0, 0.0], np.float32)
    ref = np.asarray([-2.0, -2.0, -3.0, -3.0, -2.0, -2.0, -3.0, -4.0, 0.0, 0.0], np.float32)
    count = np.asarray([3, 3, 2, 2, 4, 4, 1, 1, 0, 0], np.float32)
    sums = jax.device_get(preference_sums(pi, ref, count, beta=beta, loss_type="sigmoid"))
    rewards = (beta * (pi - ref)).reshape(-1, 2)
    real = (count.reshape(-1, 2) > 0).all(axis=1)
    assert (rewards[1, 0], rewards[3, 0]) == (rewards[1, 1], rewards[3, 1]) == (0.0, -0.5)  # the ties
    assert float(sums["pairs"]) == real.sum() == 4
    assert float(sums["rewards/accuracies"]) == np.sum(real & (rewards[:, 0] > rewards[:, 1])) == 1


def test_what_dpo_refuses():
    base = {"model": TINY.to_dict(), "dpo": {}}
    with pytest.raises(ValueError, match=r"train.batch_size=6 counts sequences, .* multiple of 4"):
        run_config_from_dict({**base, "train": {"batch_size": 6, "grad_accum": 2}})
    with pytest.raises(ValueError, match=r"train.eval_batch_size=5 counts sequences"):
        run_config_from_dict({**base, "train": {"batch_size": 4, "eval_batch_size": 5}})
    with pytest.raises(ValueError, match=r"DPOConfig.label_smoothing=0.1 is invalid: smooths the sigmoid loss only"):
        DPOConfig(loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"DPOConfig.loss_type='hinge' is invalid: expected one of sigmoid, ipo"):
        DPOConfig(loss_type="hinge")
    with pytest.raises(ValueError, match=r"unknown key dpo.betta; did you mean beta"):
        run_config_from_dict({**base, "dpo": {"betta": 0.1}})


def test_lora_dpo_on_a_mesh_equals_one_device():
    """fsdp 2 x tensor 2: DPO's loss, rewards and every adapter gradient as on one device (pairs split
    over the data shards stay pairs: the loss reads the global batch)."""
    from common import probe, step_gradients
    from modern_jax.sharding.mesh import make_mesh

    tc = probe(TrainConfig(batch_size=8, seq_len=8, steps=2, warmup_steps=0))
    batch = random_pairs(4, 8, 64)
    results = {}
    for name, mesh in (("one", one_device()), ("many", make_mesh(fsdp=2, tensor=2, devices=jax.devices()[:4]))):
        trainer = make_trainer(TINY, tc, mesh, lora=LoRAConfig(rank=4), objective=DPO(DPOConfig(beta=0.5), tc))
        state = trainer.states.init(0)
        params = traversals.flatten_mapping(jax.device_get(state["params"]))
        for i, k in enumerate(sorted(k for k in params if k[-1] == "lora_b")):
            params[k] = 0.1 * np.random.default_rng(i).standard_normal(params[k].shape).astype(np.float32)
        state["params"] = jax.tree.map(lambda x, like: jax.device_put(x, like.sharding),
                                       traversals.unflatten_mapping(params), state["params"])
        results[name] = step_gradients(trainer, state, batch)
    (got, many), (want, one) = results["many"], results["one"]
    assert float(one["loss"]) != np.float32(math.log(2))  # B moved: the policy is not its reference
    for key in ("loss", *METRICS):
        np.testing.assert_allclose(many[key], one[key], rtol=1e-5, atol=2e-6, err_msg=key)  # rewards: beta x a difference of two ~-30s
    flat = lambda g: {"/".join(map(str, k)): v for k, v in traversals.flatten_mapping(g).items()  # noqa: E731
                      if "adapter" in k}
    from common import assert_leaves_match

    assert_leaves_match(flat(got), flat(want), rtol=1e-4)


def test_a_dpo_run_shows_its_margin_and_accuracy_and_plots_its_rewards(tmp_path, monkeypatch, capsys):
    """The console's step and validation lines carry DPO's margin and accuracy beside its loss, the
    run ends with them, and loss.png labels its loss per pair with a panel of the rewards and one of
    the accuracy (the objective's `Shown`: the loop and the plot never ask which objective runs)."""
    from modern_jax.convert import finetune_run
    from modern_jax.training import load_run_config, loop, train
    from modern_jax.training.metrics import read_metrics

    chat = pathlib.Path(__file__).parent / "fixtures" / "hf_chat"
    run = load_run_config(pathlib.Path(__file__).parent.parent / "configs" / "dpo.yaml", [
        f"train.output_dir={tmp_path / 'dpo'}", f"data.path={chat / 'preferences.jsonl'}", "train.steps=3",
        "train.seq_len=32", "train.lr=5e-3", "train.warmup_steps=0", "train.log_every=1", "train.eval_every=2",
        "train.tensorboard=false"])
    run, init = finetune_run(run, chat)
    figures = []
    plot = loop.plot_losses
    monkeypatch.setattr(loop, "plot_losses", lambda *a, **k: figures.append(plot(*a, **k)))
    result = train(run, init=init, log=lambda *_: None)
    lines = capsys.readouterr().err.splitlines()  # not a terminal: the step bar's plain lines
    steps = [line for line in lines if line.startswith("step ") and "/3 |" in line]
    assert len(steps) == 3 and all(re.match(r"step \d/3 \| loss \d\.\d{4} \| margin -?\d\.\d{4} \| accuracy "
                                            r"\d\.\d{4} \| ", line) for line in steps), steps
    assert any(re.fullmatch(r"step 2: val_loss \d\.\d{4} \| val_margin -?\d\.\d{4} \| val_accuracy \d\.\d{4}", line)
               for line in lines), lines
    assert list(result.val_shown) == ["margin", "accuracy"]

    records = read_metrics(tmp_path / "dpo" / "metrics.jsonl")
    loss_ax, rewards_ax, accuracy_ax = figures[0].axes
    assert (loss_ax.get_ylabel(), loss_ax.get_title()) == ("DPO loss (nats / pair)", str(tmp_path / "dpo"))
    assert [t.get_text() for t in loss_ax.get_legend().get_texts()] == ["train", "validation"]
    assert rewards_ax.get_ylabel() == "reward: beta x log(policy / reference)"
    assert [t.get_text() for t in rewards_ax.get_legend().get_texts()] == [
        "chosen", "chosen (validation)", "rejected", "rejected (validation)", "margin", "margin (validation)"]
    train_margins = [r["rewards/margins"] for r in records if r["split"] == "train"]
    np.testing.assert_allclose(rewards_ax.lines[4].get_ydata(), train_margins)
    assert accuracy_ax.get_ylabel() == "accuracy: pairs with chosen > rejected"
    assert accuracy_ax.get_xlabel() == "step"  # the panels share it
