"""GRPO: the loss and every logged metric against TRL itself, the per-token figures against a naive
forward, the rollouts, the run file and the loop (training.objectives.grpo, training.rewards,
data.prompts, training.loss.token_logps).

The reference values (tests/fixtures/hf_peft/llama/grpo) were made by TRL 1.16.0's own
`GRPOTrainer` (`_generate_and_score_completions` with the generation replaced by the fixed
completions, then `_compute_loss`), the policy the PEFT adapter on the tiny Llama, the reference
its base:

    python scripts/make_hf_fixtures.py grpo-reference
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx import traversals

from modern_jax.config import ModelConfig
from modern_jax.convert import from_hf
from modern_jax.convert.peft import peft_targets, read_peft, read_peft_config
from modern_jax.model import Transformer
from modern_jax.training import TrainConfig, Trainer
from modern_jax.training.converters import LoRA
from modern_jax.training.loss import token_logps
from modern_jax.training.objectives.grpo import GRPO, GRPOConfig

from common import one_device

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "hf_peft" / "llama"
SETTINGS = ("grpo", "bnpo", "dr_grpo", "dapo", "gspo", "scale_batch", "scale_none", "mask_truncated",
            "kl_uncorrected", "unscorable", "on_policy", "on_policy_dapo")
REWARDS = '''
def correct(prompts, completions, **kwargs):
    return [None] * len(completions)


def format(prompts, completions, **kwargs):
    return [None] * len(completions)
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "fixed.py"
    path.write_text(REWARDS)
    return path


def trl_rows(batch: dict, rewards_NF, old_logps=None, seq_len: int = 12) -> dict:
    """Our `[1, B, T]` batch of TRL's rows: the prompt, then the completion (its <eos> included), the
    completion's targets weighted; each row's rewards and whether it ended carried at every token."""
    prompt, completion, lengths = batch["prompt_ids"], batch["completion_ids"], batch["completion_lengths"]
    B, P = prompt.shape
    C, T = completion.shape[1], seq_len
    out = {k: np.zeros((B, T), np.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
    out.update({k: np.zeros((B, T), np.float32) for k in ("weights", "completion", "old_logps")})
    eos = int(batch["eos_id"])
    ended = np.asarray([completion[b, lengths[b] - 1] == eos for b in range(B)], np.float32)
    for b in range(B):
        sequence = np.concatenate([prompt[b], completion[b, :lengths[b]]])
        n = len(sequence)
        out["inputs"][b, :n - 1], out["targets"][b, :n - 1] = sequence[:-1], sequence[1:]
        out["positions"][b, :n] = np.arange(n)
        out["segment_ids"][b, :n] = 1
        out["completion"][b, P - 1:n - 1] = 1.0
        if old_logps is not None:
            out["old_logps"][b, P - 1:n - 1] = old_logps[b, :lengths[b]]
    out["weights"] = out["completion"].copy()
    if old_logps is None:
        del out["old_logps"]
    row = lambda x: np.broadcast_to(np.asarray(x, np.float32)[:, None], (B, T))  # noqa: E731
    out.update(ended=row(ended), real=row(np.ones(B)),
               **{f"reward_{f}": row(rewards_NF[:, f]) for f in range(rewards_NF.shape[1])})
    return {k: np.ascontiguousarray(v)[None] for k, v in out.items()}


def lora_trainer(config: GRPOConfig, seq_len: int = 12):
    cfg, base = from_hf(FIXTURE / "base")
    adapter = FIXTURE / "adapter"
    lora = dataclasses.replace(read_peft_config(adapter), targets=peft_targets(adapter, base, "llama"))
    tc = TrainConfig(batch_size=8, eval_batch_size=8, seq_len=seq_len, warmup_steps=0, lr=1e-3)
    trainer = Trainer(cfg, tc, one_device(), converter=LoRA(lora), objective=GRPO(config, tc))
    state = trainer.init_state(0)
    params = traversals.flatten_mapping(jax.device_get(state["params"]))
    params.update(traversals.flatten_mapping(jax.device_get(nnx.to_pure_dict(nnx.state(base, nnx.Param)))))
    params.update(traversals.flatten_mapping(read_peft(adapter, trainer.model(state["params"]), "llama")))
    return trainer, dict(state, params=jax.device_put(traversals.unflatten_mapping(params)))


def setting(name: str, reward_file) -> tuple[GRPOConfig, dict, dict]:
    with np.load(FIXTURE / "grpo" / f"{name}.npz") as z:
        want = dict(z)
    scalar = lambda k: want[k].item()  # noqa: E731
    config = GRPOConfig(rewards=(f"{reward_file}:correct", f"{reward_file}:format"),
                        reward_weights=tuple(want["reward_weights"].tolist()), num_generations=scalar("num_generations"),
                        max_completion_length=scalar("max_completion_length"), temperature=scalar("temperature"),
                        beta=scalar("beta"), epsilon=scalar("epsilon"), epsilon_high=scalar("epsilon_high"),
                        loss_type=str(want["loss_type"]), importance_sampling_level=str(want["importance_sampling_level"]),
                        num_iterations=scalar("num_iterations"), scale_rewards=str(want["scale_rewards"]),
                        mask_truncated_completions=bool(want["mask_truncated_completions"]),
                        use_bias_correction_kl=bool(want["use_bias_correction_kl"]))
    with np.load(FIXTURE / "grpo" / "batch.npz") as z:
        batch = trl_rows(dict(z), want["rewards"], z["old_logps"] if bool(want["use_old_logps"]) else None)
    if config.mask_truncated_completions:  # TRL's mask after masking truncated completions
        batch["weights"] = batch["weights"] * batch["ended"]
    return config, batch, want


@pytest.mark.parametrize("name", SETTINGS)
def test_the_loss_and_every_logged_metric_equal_trl_on_a_fixed_batch(name, reward_file):
    """Loss type, GSPO's sequence ratios, reward scaling, truncated completions, the KL's
    correction, an unscorable row and the on-policy case: the step's loss and every metric TRL
    logs (its `num_tokens` running count aside) within 1e-5 of TRL's, and the advantages."""
    config, batch, want = setting(name, reward_file)
    trainer, state = lora_trainer(config)
    placed = trainer.batches.put(batch)
    advantages = np.asarray(trainer.objective.complete(placed)["advantages"])[0, :, 0]
    np.testing.assert_allclose(advantages, want["advantages"], rtol=1e-5, atol=1e-6)
    _, metrics = trainer.train_step(state, placed)
    metrics = jax.device_get(metrics)
    np.testing.assert_allclose(metrics["loss"], want["loss"], rtol=1e-5, atol=1e-7)
    theirs = {k: v for k, v in json.loads(str(want["metrics"])).items() if k != "num_tokens"}
    assert set(theirs) <= set(trainer.objective.named), sorted(set(theirs) - set(trainer.objective.named))
    for key, value in theirs.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_per_token_log_probabilities_and_entropy_equal_trl_and_a_naive_softmax(reward_file):
    """`token_logps` at the temperature, in vocabulary chunks of 48 (128 rows: three chunks), equals
    TRL's per-token log-probabilities and entropies and a whole-vocabulary log-softmax."""
    config, batch, want = setting("grpo", reward_file)
    trainer, state = lora_trainer(config)
    model = trainer.model(state["params"])
    rows = {k: jnp.asarray(v[0]) for k, v in batch.items()}
    logps, entropy, _ = token_logps(model, rows, chunk=48, temperature=config.temperature, entropy=True)
    logits = model(rows["inputs"], positions=rows["positions"], segment_ids=rows["segment_ids"]) / config.temperature
    naive = jax.nn.log_softmax(logits, -1)
    np.testing.assert_allclose(logps, jnp.take_along_axis(naive, rows["targets"][..., None], -1)[..., 0], atol=2e-5)
    np.testing.assert_allclose(entropy, -jnp.sum(jnp.exp(naive) * naive, -1), atol=2e-5)
    lengths = np.load(FIXTURE / "grpo" / "batch.npz")["completion_lengths"]
    for b, n in enumerate(lengths):  # TRL's, at the completion's targets
        np.testing.assert_allclose(np.asarray(logps)[b, 4:4 + n], want["per_token_logps"][b, :n], atol=2e-5)
        np.testing.assert_allclose(np.asarray(entropy)[b, 4:4 + n], want["entropies"][b, :n], atol=2e-5)
