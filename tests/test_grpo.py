"""GRPO: the loss and every logged metric against TRL itself, the per-token figures against a naive
forward, the rows of fixed rollouts token by token, an evaluation's real rows, the rollouts, the run
file and the loop (training.objectives.grpo, training.rewards, data.prompts, training.loss.token_logps),
and what goes wrong: reward functions that fail or are read from the wrong file, prompts TRL reads
otherwise, steps that train nothing.

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
import re
import types

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
from modern_jax.training import TrainConfig
from modern_jax.training.loss import token_logps
from modern_jax.training.objectives.grpo import GRPO, GRPOConfig

from common import make_trainer, one_device

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


def lora_trainer(config: GRPOConfig, seq_len: int = 12, mesh=None, strategies=None, probed: bool = False):
    """The fixture's base and PEFT adapter as a LoRA GRPO Trainer's state (on one device, or `mesh`
    with `strategies`; `probed`: its train config `common.probe`'d)."""
    from common import probe

    cfg, base = from_hf(FIXTURE / "base")
    adapter = FIXTURE / "adapter"
    lora = dataclasses.replace(read_peft_config(adapter), targets=peft_targets(adapter, base, "llama"))
    tc = TrainConfig(batch_size=8, eval_batch_size=8, seq_len=seq_len, warmup_steps=0, lr=1e-3)
    trainer = make_trainer(cfg, probe(tc) if probed else tc, mesh or one_device(), lora=lora,
                      objective=GRPO(config, tc), strategies=strategies)
    state = trainer.states.init(0)
    params = traversals.flatten_mapping(jax.device_get(state["params"]))
    params.update(traversals.flatten_mapping(jax.device_get(nnx.to_pure_dict(nnx.state(base, nnx.Param)))))
    params.update(traversals.flatten_mapping(read_peft(adapter, trainer.states.model(state["params"]), "llama")))
    params = traversals.unflatten_mapping(params)
    return trainer, dict(state, params=jax.tree.map(lambda x, like: jax.device_put(np.asarray(x), like.sharding),
                                                    params, state["params"]))


def setting(name: str, reward_file, directory: pathlib.Path = FIXTURE / "grpo") -> tuple[GRPOConfig, dict, dict]:
    with np.load(directory / f"{name}.npz") as z:
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
    with np.load(directory / "batch.npz") as z:
        batch = trl_rows(dict(z), want["rewards"], z["old_logps"] if bool(want["use_old_logps"]) else None)
    if config.mask_truncated_completions:  # TRL's mask after masking truncated completions
        batch["weights"] = batch["weights"] * batch["ended"]
    return config, batch, want


def assert_equals_trl(name: str, reward_file, directory: pathlib.Path = FIXTURE / "grpo") -> None:
    """Our step's loss, advantages and every metric TRL logs (its `num_tokens` running count aside)
    on setting `name`'s batch, within 1e-5 of TRL's."""
    config, batch, want = setting(name, reward_file, directory)
    trainer, state = lora_trainer(config)
    placed = trainer.batches.put(batch)
    advantages = np.asarray(trainer.objective.complete(placed)["advantages"])[0, :, 0]
    np.testing.assert_allclose(advantages, want["advantages"], rtol=1e-5, atol=1e-6)
    _, metrics = trainer.train_step(state, placed)
    metrics = jax.device_get(metrics)
    np.testing.assert_allclose(metrics["loss"], want["loss"], rtol=1e-5, atol=1e-7)
    theirs = {k: v for k, v in json.loads(str(want["metrics"])).items() if k != "num_tokens"}
    assert set(theirs) <= set(trainer.objective.metric_names), sorted(set(theirs) - set(trainer.objective.metric_names))
    for key, value in theirs.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_a_grpo_step_under_1f1b_pipelining_equals_one_device(reward_file):
    """GRPO's loss of each microbatch inside the stages' loop (1F1B over stage 2 x data 2 x fsdp 2,
    2 microbatches) on TRL's batch: one device's loss and every adapter gradient (1e-4 in norm)."""
    from common import assert_leaves_match, probe, step_gradients
    from modern_jax.sharding import Strategies
    from modern_jax.sharding.mesh import make_mesh

    config, batch, _ = setting("grpo", reward_file)
    results = {}
    for name, mesh, strategies in (("one", one_device(), Strategies()),
                                   ("staged", make_mesh(stage=2, data=2, fsdp=2),
                                    Strategies(microbatches=2, pipeline_schedule="1f1b"))):
        trainer, state = lora_trainer(config, mesh=mesh, strategies=strategies, probed=True)
        results[name] = step_gradients(trainer, state, batch)
    (got, staged), (want, one) = results["staged"], results["one"]
    np.testing.assert_allclose(staged["loss"], one["loss"], rtol=1e-5)
    adapters = lambda g: {"/".join(map(str, k)): v for k, v in traversals.flatten_mapping(g).items()  # noqa: E731
                          if k[-1] in ("lora_a", "lora_b")}
    assert len(adapters(want)) == 14
    assert_leaves_match(adapters(got), adapters(want), rtol=1e-4)


@pytest.mark.parametrize("name", SETTINGS)
def test_the_loss_and_every_logged_metric_equal_trl_on_a_fixed_batch(name, reward_file):
    """Loss type, GSPO's sequence ratios, reward scaling, truncated completions, the KL's
    correction, an unscorable row and the on-policy case, against the fixtures of TRL's figures."""
    assert_equals_trl(name, reward_file)


def test_live_the_loss_and_every_metric_equal_trl_run_now(tmp_path, reward_file):
    """The same against TRL run now, in the reference interpreter (MODERN_JAX_HF_PYTHON, or torch
    here): scripts/make_hf_fixtures.py grpo-reference makes the batch and TRL's figures afresh."""
    import subprocess

    from test_convert_live import SCRIPT, hf_python

    if hf_python() is None:
        pytest.skip("needs torch, transformers, peft and trl (or MODERN_JAX_HF_PYTHON)")
    done = subprocess.run([hf_python(), str(SCRIPT), "grpo-reference", "--out", str(tmp_path / "grpo")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    for name in SETTINGS:
        assert_equals_trl(name, reward_file, tmp_path / "grpo")


def test_per_token_log_probabilities_and_entropy_equal_trl_and_a_naive_softmax(reward_file):
    """`token_logps` at the temperature, in vocabulary chunks of 48 (128 rows: three chunks), equals
    TRL's per-token log-probabilities and entropies and a whole-vocabulary log-softmax."""
    config, batch, want = setting("grpo", reward_file)
    trainer, state = lora_trainer(config)
    model = trainer.states.model(state["params"])
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


# ----- the run: rollouts, resume, the first step ----------------------------------------------

ROOT = pathlib.Path(__file__).parent.parent
CHAT = pathlib.Path(__file__).parent / "fixtures" / "hf_chat"


def arithmetic(tmp_path) -> pathlib.Path:
    """scripts/make_arithmetic.py's sums of 0 to 5, written once into `tmp_path`."""
    import runpy

    path = tmp_path / "arithmetic.jsonl"
    if not path.exists():
        runpy.run_path(str(ROOT / "scripts" / "make_arithmetic.py"))["main"](["--out", str(path), "--largest", "5"])
    return path


def grpo_run(tmp_path, name: str, *overrides):
    from modern_jax.convert import finetune_run
    from modern_jax.training.config import load_run_config

    run = load_run_config(ROOT / "configs" / "grpo.yaml", [
        f"train.output_dir={tmp_path / name}", f"data.path={arithmetic(tmp_path)}",
        "grpo.rewards=[configs/rewards.py:exact_answer, configs/rewards.py:number_last]", "train.batch_size=16",
        "grpo.num_generations=4", "grpo.max_completion_length=6", "train.seq_len=32", "train.eval_batch_size=16",
        "train.eval_every=0", "train.progress=false", "train.plot=false", "train.log_every=1", *overrides])
    return finetune_run(run, CHAT)


def test_a_lora_grpo_run_starts_at_kl_0_compiles_its_rollouts_once_and_resumes_exactly(tmp_path, monkeypatch):
    """Step 1 of a LoRA run (the adapters' B zero): kl 0 to the base and no ratio clipped. Over 4
    steps of 2 iterations each batch and a final evaluation, the rollouts compile once for the
    steps and once for the evaluation; stopped after 2 steps and resumed, the run logs every figure
    the uninterrupted run logs."""
    from modern_jax.training import loop

    from modern_jax.training import programs

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(programs, "_EXECUTABLES", {})  # counted here, whatever this process compiled before
    made = []
    monkeypatch.setattr(loop, "trainer_for", lambda *a, **k: made.append(step_trainer(*a, **k)) or made[-1])
    overrides = ("grpo.beta=0.04", "grpo.num_iterations=2", "train.steps=4", "train.checkpoint_every=2")
    run, init = grpo_run(tmp_path, "whole", *overrides)
    whole = loop.train(run, init=init)
    first = whole.history[0]
    assert first["kl"] == 0.0 and first["clip_ratio/region_mean"] == 0.0
    assert whole.history[1]["kl"] > 0  # the adapters moved
    rollouts = {k: v for k, v in made[0].programs.compilations.items() if k.startswith("grpo_rollout")}
    assert sum(rollouts.values()) == 2 and made[0].programs.compilations["train"] == 1, made[0].programs.compilations
    assert_resumes_exactly(tmp_path, overrides, whole)
    samples = [json.loads(line) for line in (tmp_path / "whole" / "completions.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 3} and {"prompt", "completion", "exact_answer"} <= set(samples[0])


def test_an_overlapped_run_resumed_from_a_checkpoint_logs_what_the_uninterrupted_one_logs(tmp_path, monkeypatch):
    """grpo.overlap over 4 steps, a checkpoint at 2: the batches of steps 2 and 4 are sampled while
    steps 1 and 3 train, that of step 3 after step 2, from the weights its checkpoint saves; so
    stopped at 2 and resumed, the run logs every figure the uninterrupted one logs."""
    from modern_jax.training import loop
    from modern_jax.training.trainer import Trainer

    monkeypatch.chdir(ROOT)
    trained, begun = [], []  # steps run; (the step a batch is for, the steps run when it was begun)
    step, begin = Trainer.train_step, loop._Session.begin
    monkeypatch.setattr(Trainer, "train_step", lambda self, *a: trained.append(1) or step(self, *a))
    monkeypatch.setattr(loop._Session, "begin", lambda self, batch, rows, k: begun.append((k + 1, len(trained)))
                        or begin(self, batch, rows, k))
    overrides = ("grpo.beta=0.04", "grpo.overlap=true", "train.steps=4", "train.checkpoint_every=2")
    run, init = grpo_run(tmp_path, "whole", *overrides)
    whole = loop.train(run, init=init)
    assert begun[:4] == [(1, 0), (2, 0), (3, 2), (4, 2)], begun  # 2 and 4 ahead; 3 after the checkpoint
    assert_resumes_exactly(tmp_path, overrides, whole)


def assert_resumes_exactly(tmp_path, overrides, whole) -> None:
    """The run of `overrides` (4 steps) stopped after 2 and resumed logs every figure `whole` (the
    uninterrupted run's result) logs."""
    from modern_jax.training import loop

    run, init = grpo_run(tmp_path, "parts", *overrides)
    part = loop.train(run, init=init, stop_after=2)
    assert part.interrupted and part.step == 2
    rest = loop.train(dataclasses.replace(run, train=dataclasses.replace(run.train, resume=True)), init=init)
    resumed = part.history + rest.history
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(whole.history, resumed):
        for key in ("loss", "reward", "kl", "entropy", "grad_norm", "completions/mean_length"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-6, atol=1e-9, err_msg=f"step {a['step']} {key}")


def step_trainer(*args, **kwargs):
    from modern_jax.training.trainer import trainer_for

    return trainer_for(*args, **kwargs)


def test_full_weight_grpo_keeps_a_frozen_reference_and_refuses_what_it_cannot_run(tmp_path, monkeypatch):
    from modern_jax.training.config import run_config_from_dict

    monkeypatch.chdir(ROOT)
    base = {"model": {"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64},
            "train": {"batch_size": 8, "eval_batch_size": 8, "seq_len": 16},
            "grpo": {"rewards": ["configs/rewards.py:exact_answer"], "num_generations": 4, "max_completion_length": 4}}
    run_config_from_dict(base)
    bad = [({"train": {**base["train"], "batch_size": 6}}, r"batch_size / grad_accum = 6 rows.*multiple of 4"),
           ({"train": {**base["train"], "seq_len": 4}}, r"seq_len=4 .* exceed grpo.max_completion_length=4"),
           ({"grpo": {**base["grpo"], "num_iterations": 3}}, r"train.steps=.*multiple of 3"),
           ({"grpo": {**base["grpo"], "loss_type": "ppo"}}, r"loss_type='ppo' is invalid: expected one of grpo"),
           ({"grpo": {**base["grpo"], "rewards": []}}, r"rewards=\[\] is invalid"),
           ({"grpo": {**base["grpo"], "reward_weights": [1, 2]}}, r"reward_weights=\[1, 2\] is invalid: expected 1"),
           ({"grpo": {**base["grpo"], "num_generations": 1}}, r"num_generations=1 is invalid"),
           ({"grpo": {**base["grpo"], "temperature": float("inf")}}, r"temperature=inf is invalid: expected a finite"),
           ({"grpo": {**base["grpo"], "epsilonhigh": 0.3}}, r"unknown key grpo.epsilonhigh; did you mean epsilon_high"),
           ({"dpo": {}}, r"sections dpo, grpo each choose a training objective")]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            run_config_from_dict({**base, **change})
    wide = run_config_from_dict({**base, "grpo": {**base["grpo"], "top_k": 65}})
    with pytest.raises(ValueError, match=r"^grpo.top_k=65 exceeds the model's vocabulary of 64 tokens, so it would keep "
                                         r"every token: give at most 64, or 0 \(off\)$"):
        step_trainer(wide, one_device())
    run = run_config_from_dict({**base, "grpo": {**base["grpo"], "beta": 0.1}})
    trainer = step_trainer(run, one_device())
    assert "reference" in trainer.states.abstract()  # full weights: a frozen copy of the start


def test_reward_functions_are_named_and_checked(tmp_path, monkeypatch):
    from modern_jax.training.rewards import Rewards

    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.py").write_text("def short(completions, **kw):\n    return [1.0] * (len(completions) - 1)\n"
                                   "def strict(prompts, completions):\n    return [0.0] * len(completions)\n"
                                   "def nan(completions, **kw):\n    return [float('nan')] * len(completions)\n"
                                   "def good(completions, answer, **kw):\n    return [None, float(answer[1])]\n")
    for spec, message in (("r.py", "expected 'path/to/file.py:function'"), ("nofile.py:f", "no file 'nofile.py'"),
                          ("r.py:missing", "has no function 'missing'; its functions: good, nan, short, strict"),
                          ("no_such_module:f", "cannot import 'no_such_module'")):
        with pytest.raises(ValueError, match=message):
            Rewards([spec])
    call = lambda spec: Rewards([spec]).score(["p", "q"], ["a", "b"], [[1], [2]], {"answer": [3, 4]})  # noqa: E731
    with pytest.raises(ValueError, match="short returned 1 rewards for 2 completions"):
        call("r.py:short")
    with pytest.raises(ValueError, match=r"strict cannot take the arguments .* answer as keywords; end its parameters"):
        call("r.py:strict")
    with pytest.raises(ValueError, match="nan returned nan for completion 0: return a finite number"):
        call("r.py:nan")
    got = call("r.py:good")
    assert np.isnan(got[0, 0]) and got[1, 0] == 4.0


def test_prompt_batches_repeat_each_prompt_once_per_generation_and_resume(tmp_path):
    from modern_jax.data.config import DataConfig
    from modern_jax.data import ByteTokenizer
    from modern_jax.data.prompts import prompt_iterator, read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n" for i in range(10)))

    prompts = read_prompts(DataConfig(path=str(path)), ByteTokenizer(), room=8)
    assert prompts.columns["answer"][:3] == (0, 1, 2) and len(prompts) == 10
    it = prompt_iterator(prompts, batch_size=8, generations=4, grad_accum=2, seed=1, repeat=2)
    batches = [next(it) for _ in range(4)]
    for b in batches:
        assert b["index"].shape == (2, 4) and (b["index"] == b["index"][:, :1]).all()  # a group per micro-batch
    np.testing.assert_array_equal(batches[0]["index"], batches[1]["index"])  # repeat: one batch for 2 steps
    assert not np.array_equal(batches[1]["index"], batches[2]["index"])
    resumed = prompt_iterator(prompts, batch_size=8, generations=4, grad_accum=2, seed=1, repeat=2, state=it.get_state())
    again = prompt_iterator(prompts, batch_size=8, generations=4, grad_accum=2, seed=1, repeat=2)
    for _ in range(4):
        next(again)
    np.testing.assert_array_equal(next(resumed)["index"], next(again)["index"])
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match="no field 'prompt'.*rename that field to 'prompt'"):
        read_prompts(DataConfig(path=str(tmp_path / "bad.jsonl")), ByteTokenizer(), room=8)
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": "0123456789"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: the prompt is 11 tokens, more than the 8"):
        read_prompts(DataConfig(path=str(tmp_path / "long.jsonl")), ByteTokenizer(), room=8)


def test_the_reinforcement_learning_section_runs_as_written(tmp_path, monkeypatch, capsys):
    """docs/training.md's GRPO commands (the README's too), run as written from a directory holding
    the repository's tests/, configs/ and scripts/: the arithmetic set, then the run, whose mean
    reward rises (the documented figures: 0.198 over steps 1-25, 0.300 over 176-200)."""
    import re
    import runpy
    import shlex

    from modern_jax.cli import main

    def block(page: str, heading: str) -> list[str]:
        text = (ROOT / page).read_text()
        code = re.search(r"```bash\n(.*?)```", text[text.index(heading):], re.S).group(1).replace("\\\n", " ")
        return [line for line in code.splitlines() if line.startswith("uv run")]

    lines = block("docs/training.md", "## Reinforcement learning (GRPO)")
    assert block("README.md", "### Reinforcement learning (GRPO)") == lines
    make, command = (shlex.split(line)[2:] for line in lines)
    assert make[:2] == ["python", "scripts/make_arithmetic.py"] and command[:2] == ["modern-jax", "train"]
    monkeypatch.chdir(tmp_path)
    for name in ("tests", "configs", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    runpy.run_path(make[1])["main"](make[2:])
    assert main(command[1:]) == 0, capsys.readouterr().err
    rewards = [r["reward"] for r in map(json.loads, (tmp_path / "runs/grpo/metrics.jsonl").read_text().splitlines())
               if r["split"] == "train"]
    assert len(rewards) == 8 and rewards[-1] > rewards[0] + 0.05, rewards
    assert (tmp_path / "runs/grpo/completions.jsonl").exists()


def test_two_processes_of_four_devices_give_the_one_process_run(tmp_path, monkeypatch):
    """A GRPO run on a mesh of data 2 x fsdp 2 x tensor 2 (rollouts sampled with sharded weights and
    heads), launched as SLURM launches 2 processes of 4 host devices (each process samples, scores
    and places its own rows of every step's batch; the advantages come from the whole batch on the
    mesh), logs the figures of the same run in one process of 8 devices: the rollouts of a step are
    the same tokens, its loss and rewards the same numbers (1e-5), and so are its final evaluation's."""
    from processes import Launch

    from modern_jax.training import loop

    monkeypatch.chdir(ROOT)
    overrides = ["train.steps=2", "parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2", "grpo.num_iterations=1",
                 "train.checkpoint_every=2"]
    run, init = grpo_run(tmp_path, "one", *overrides)
    one = loop.train(run, init=init)
    argv = ["train", "--config", "configs/grpo.yaml", "--init-from-hf", str(CHAT), "--data",
            str(arithmetic(tmp_path)), "--output-dir", str(tmp_path / "two"), "train.batch_size=16",
            "grpo.num_generations=4", "grpo.max_completion_length=6", "train.seq_len=32", "train.eval_batch_size=16",
            "train.eval_every=0", "train.progress=false", "train.plot=false", "train.log_every=1", *overrides]
    launch = Launch(argv, n=2, devices=4, logdir=tmp_path)
    assert launch.wait() == [0, 0], launch.log(0)[-3000:] + launch.log(1)[-3000:]
    two = [r for r in map(json.loads, (tmp_path / "two" / "metrics.jsonl").read_text().splitlines())
           if r["split"] == "train"]
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(one.history, two):
        for key in ("loss", "reward", "reward_std", "entropy", "completions/mean_length", "grad_norm"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7, err_msg=f"step {a['step']} {key}")

    # the final evaluation, each process sampling and scoring its own rows: the one process's figures
    metrics = lambda name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    [want] = [r for r in metrics("one") if r["split"] != "train"]
    [got] = [r for r in metrics("two") if r["split"] != "train"]
    assert {"loss", "prompts", "reward", "completions/mean_length"} <= want.keys() == got.keys(), (want, got)
    for key, value in want.items():
        if isinstance(value, float):
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-7, err_msg=key)


def test_prompts_read_from_parquet_and_a_saved_dataset_with_their_columns(tmp_path):
    """The other record sources hand over whole records too: the prompt, and every other column."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from modern_jax.data import ByteTokenizer
    from modern_jax.data.config import DataConfig
    from modern_jax.data.prompts import read_prompts

    rows = {"prompt": ["1 + 1 =", "2 + 2 ="], "answer": [2, 4]}
    pq.write_table(pa.table(rows), tmp_path / "p.parquet")
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "p.parquet", tmp_path / "saved"):
        prompts = read_prompts(DataConfig(path=str(path)), ByteTokenizer(), room=16)
        assert prompts.prompts == ("1 + 1 =", "2 + 2 =") and prompts.columns == {"answer": (2, 4)}, path
        assert [len(ids) for ids in prompts.ids] == [8, 8]  # <bos> and 7 bytes


# ----- the rows of fixed rollouts, and an evaluation's real rows -------------------------------

ROWS_REWARDS = '''
def answer(prompts, completions, answer, **kwargs):
    return [float(a) for a in answer]
'''


def fixed_rollouts(tmp_path, **grpo) -> GRPO:
    """A GRPO objective over the byte tokenizer whose one reward is each prompt's `answer`, without
    a model or a Trainer: its rows are built from tokens the test gives."""
    from modern_jax.data import ByteTokenizer

    (tmp_path / "answer.py").write_text(ROWS_REWARDS)
    tc = TrainConfig(batch_size=4, eval_batch_size=8, seq_len=8)
    objective = GRPO(GRPOConfig(rewards=(f"{tmp_path / 'answer.py'}:answer",), num_generations=2,
                                max_completion_length=4, **grpo), tc)
    objective.tokenizer = ByteTokenizer()
    return objective


def byte_prompts(*texts: str, answers=None):
    from modern_jax.data.prompts import Prompts

    bos = 257
    return Prompts(tuple(np.asarray([bos, *map(ord, t)], np.int32) for t in texts), texts,
                   {"answer": tuple(answers or range(len(texts)))}, tuple(f"line {i}" for i in range(len(texts))))


def test_a_step_over_its_bucketed_width_equals_the_full_width(reward_file):
    """TRL's fixed batch (rows of at most 11 tokens) as 16 columns, the bucket that holds it, and as
    train.seq_len=32: the same loss, sums and gradients of the adapters (float32, summed in other
    orders: within 1e-6 relative, or 1e-8 absolute, a millionth of the largest gradient: an AVX-512
    CPU's sums put a gradient of 1e-5 3e-9 off), the reference's forward (beta > 0) included."""
    from modern_jax.training.trainer import Trainer

    config, _, _ = setting("dr_grpo", reward_file)
    with np.load(FIXTURE / "grpo" / "batch.npz") as z:
        rows = {T: trl_rows(dict(z), z["rewards"], seq_len=T) for T in (16, 32)}
    trainer, state = lora_trainer(config, seq_len=32)
    assert trainer.batches.width(11) == 16

    @jax.jit
    def grads(batch):
        params, frozen = trainer.states.split(state["params"])
        reference = trainer.states.reference(state["params"], state.get("reference"))
        batch = trainer.objective.complete(batch)
        denom = trainer.objective.denominator(batch)
        loss, sums, _, grads = Trainer._grads(trainer, params, frozen, batch, reference, denom, jax.random.key(0))
        return loss, sums, grads

    narrow, full = (jax.device_get(grads(trainer.batches.put(rows[T]))) for T in (16, 32))
    assert config.beta > 0 and narrow[1]["kl"] > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8), narrow, full)


def test_rollout_rows_take_the_bucket_that_holds_their_longest_prompt_and_completion(tmp_path):
    """A batch's rows are as wide as the least bucket that holds its longest prompt and completion,
    the <eos> included (13 + 4 tokens: 24 of train.seq_len=64), and equal the full-width rows cut there."""
    from types import SimpleNamespace

    from modern_jax.data import ByteTokenizer
    from modern_jax.sharding import RULES
    from modern_jax.training.placement import BatchPlacement

    eos = 258
    (tmp_path / "answer.py").write_text(ROWS_REWARDS)
    tc = TrainConfig(batch_size=4, eval_batch_size=4, seq_len=64)
    objective = GRPO(GRPOConfig(rewards=(f"{tmp_path / 'answer.py'}:answer",), num_generations=2,
                                max_completion_length=6), tc)
    objective.tokenizer = ByteTokenizer()
    objective.splits["train"] = prompts = byte_prompts("ABCDEFGHIJKL", "C")  # 13 and 2 tokens with <bos>
    tokens = np.asarray([[[10, eos, 0, 0, 0, 0], [16, 17, 18, eos, 0, 0], [11, 12, eos, 0, 0, 0],
                          [eos, 0, 0, 0, 0, 0]]], np.int32)
    objective._sample = lambda *args, scored=False: tokens
    placement = BatchPlacement(one_device(), RULES, tc)
    assert placement.widths() == (16, 24, 32, 48, 64)
    index = np.asarray([[0, 0, 1, 1]])
    placed = objective.place_batch({"index": index, "width": np.asarray(13)}, trainer=SimpleNamespace(
        batches=placement), params=None, rows=None, step=0, key=jax.random.key(0))
    full = objective._rows(prompts, index, tokens, np.ones((1, 4), bool), None)
    assert placed["inputs"].shape == (1, 4, 24)
    assert not full["segment_ids"][..., 24:].any()
    for name, value in full.items():
        np.testing.assert_array_equal(np.asarray(placed[name]), value[..., :24], err_msg=name)


def test_overlap_keeps_each_sampled_tokens_log_probability_under_the_sampling_weights(tmp_path):
    """grpo.overlap trains on rollouts one step old, its ratio against the sampling weights: the
    log-probability of each sampled token that the rollout program keeps (a forward over the
    left-padded prompts and their completions) is a naive log-softmax of the sampling weights'
    logits over the training row at the temperature (within 2e-5), where the row's completion is, and
    0 elsewhere. Reusing a batch too is refused."""
    from modern_jax.generate import left_padded

    with pytest.raises(ValueError, match=r"overlap=True is invalid: samples each batch one step ahead"):
        GRPOConfig(rewards=("a.py:f",), overlap=True, num_iterations=2)
    objective = fixed_rollouts(tmp_path, overlap=True, temperature=0.7)
    cfg = ModelConfig(vocab_size=260, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_position_embeddings=16)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    prompts, index = byte_prompts("AB", "C"), np.asarray([[0, 0, 1, 1]])
    prompt_NW, length_N = left_padded([prompts.ids[i] for i in index[0]], 4)
    from modern_jax.training.objectives.grpo import rollout_program

    _, scored = rollout_program(objective, scored=True)
    model_of = lambda q: nnx.merge(graphdef, q)  # noqa: E731
    states = types.SimpleNamespace(model=model_of, sampling_model=model_of)  # a plain model's (`States`)
    rollout = jax.jit(lambda p, *args: scored(states, p, *args))
    tokens, logps = rollout(params, prompt_NW[None], length_N[None], jax.random.key(0))
    rows = objective._rows(prompts, index, np.asarray(tokens), np.ones((1, 4), bool), None, None, np.asarray(logps))
    batch = {k: jnp.asarray(v[0]) for k, v in rows.items()}
    logits = nnx.merge(graphdef, params)(batch["inputs"], positions=batch["positions"],
                                         segment_ids=batch["segment_ids"]) / 0.7
    naive = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), batch["targets"][..., None], -1)[..., 0]
    assert rows["completion"].sum() >= 4
    np.testing.assert_allclose(rows["old_logps"][0], naive * rows["completion"][0], atol=2e-5)


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_rollout_rows_weight_each_completion_token_and_its_eos_and_no_other(tmp_path, mask_truncated):
    """Fixed sampled tokens (`<eos>` = 258, the byte tokenizer's): a completion that sampled an
    `<eos>` ended, and its targets are its tokens and that `<eos>`; one of all 4 tokens without it
    was truncated and gets none (`mask_truncated_completions`: no weight at all). Checked token by
    token against rows written out by hand, with TRL's clipped ratio and mean length."""
    eos = 258
    objective = fixed_rollouts(tmp_path, mask_truncated_completions=mask_truncated)
    prompts = byte_prompts("AB", "C")
    tokens = np.asarray([[[10, 11, eos, 0],  # ended after 2 tokens (what follows the <eos> is not its)
                          [12, 13, 14, 15],  # truncated: 4 tokens, no <eos>
                          [eos, 0, 0, 0],  # ended at once: the <eos> alone
                          [16, 17, 18, eos]]], np.int32)  # ended at the last slot
    rows = objective._rows(prompts, np.asarray([[0, 0, 1, 1]]), tokens, np.ones((1, 4), bool), None)
    A, B, C, bos = 65, 66, 67, 257
    want_inputs = [[bos, A, B, 10, 11, 0, 0, 0], [bos, A, B, 12, 13, 14, 0, 0],
                   [bos, C, 0, 0, 0, 0, 0, 0], [bos, C, 16, 17, 18, 0, 0, 0]]
    want_targets = [[A, B, 10, 11, eos, 0, 0, 0], [A, B, 12, 13, 14, 15, 0, 0],
                    [C, eos, 0, 0, 0, 0, 0, 0], [C, 16, 17, 18, eos, 0, 0, 0]]
    want_completion = [[0, 0, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 0, 0],
                       [0, 1, 0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 0, 0, 0]]
    want_segments = [[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0],
                     [1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]]
    np.testing.assert_array_equal(rows["inputs"][0], want_inputs)
    np.testing.assert_array_equal(rows["targets"][0], want_targets)
    np.testing.assert_array_equal(rows["completion"][0], want_completion)
    np.testing.assert_array_equal(rows["segment_ids"][0], want_segments)
    np.testing.assert_array_equal(rows["positions"][0], np.asarray(want_segments) * np.arange(8))
    np.testing.assert_array_equal(rows["ended"][0, :, 0], [1, 0, 1, 1])
    kept = np.asarray([1, 0 if mask_truncated else 1, 1, 1])[:, None]
    np.testing.assert_array_equal(rows["weights"][0], np.asarray(want_completion) * kept)
    figures = jax.device_get(jax.jit(objective.denominator)(rows)["figures"])
    assert float(figures["completions/clipped_ratio"]) == 0.25  # 1 of the 4 reached the length without <eos>
    assert float(figures["completions/mean_length"]) == (3 + 4 + 1 + 4) / 4  # <eos> included, as TRL counts


def test_an_evaluation_counts_only_its_real_prompts(tmp_path, monkeypatch):
    """3 prompts (answers 1, 2, 6, each its reward) in a batch of 4 prompts x 2 generations: the
    fourth prompt's rows (prompt 0 again) fill the batch up and count for nothing. The evaluation
    reports 3 prompts, and the mean reward, completion length and clipped ratio over their 6 rows (naive
    means), whatever the fillers sampled."""
    from types import SimpleNamespace

    objective = fixed_rollouts(tmp_path)
    answers = (1.0, 2.0, 6.0)
    prompts = byte_prompts("1+0", "1+1", "3+3", answers=answers)
    items = list(objective.eval_batches(prompts, max_windows=None, rows=None))  # 8 rows: 4 prompts x 2
    assert len(items) == 1
    eos = 258
    lengths = [1, 2, 3, 4, 2, 1, 4, 4]  # each row's completion, its <eos> included (4: truncated); rows 6, 7 fill
    tokens = np.zeros((1, 8, 4), np.int32)
    for r, n in enumerate(lengths):
        tokens[0, r, :n] = 48 + r
        if n < 4:
            tokens[0, r, n - 1] = eos
    monkeypatch.setattr(objective, "_sample", lambda *args, scored=False: tokens)
    trainer = SimpleNamespace(batches=SimpleNamespace(put=lambda batch, rows: batch, width=lambda tokens: 64))
    batch = objective.place_batch(items[0], trainer=trainer, params=None, rows=None, step=0, key=jax.random.key(0))
    cfg = ModelConfig(vocab_size=260, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_position_embeddings=8)

    @jax.jit
    def evaluation(batch):  # as the Trainer's: the rows completed, then one micro-batch's sums
        micro = jax.tree.map(lambda x: x[0], objective.complete(batch))
        return objective.eval_sums(Transformer(cfg, rngs=nnx.Rngs(0)), micro, None, None, chunk=64)

    totals = jax.device_get(evaluation(batch))
    got = objective.eval_values(totals)
    real = [0, 0, 1, 1, 2, 2]  # the prompt of each real row; rows 6 and 7 repeat prompt 0 as fillers
    assert got["prompts"] == 3
    np.testing.assert_allclose(got["reward"], np.mean([answers[p] for p in real]), rtol=1e-6)
    np.testing.assert_allclose(got["completions/mean_length"], np.mean(lengths[:6]), rtol=1e-6)
    np.testing.assert_allclose(got["completions/clipped_ratio"], 1 / 6, rtol=1e-6)


# ----- what goes wrong: reward functions, prompts, steps that train nothing -------------------

FLAKY = '''
calls = 0


def flaky(completions, **kwargs):
    global calls
    calls += 1
    if calls >= 4:  # 1: step 1's batch, 2: the validation batch compiled beside it, 3: step 2's, 4: step 3's
        raise ConnectionError("the grader is down")
    return [0.0] * len(completions)
'''


def test_a_reward_function_that_raises_names_itself_the_step_and_what_the_run_keeps(tmp_path, monkeypatch):
    """A reward function that raises while scoring step 3's completions, then at once as the run
    resumes: one error naming the function, its line, the exception and the step, and the checkpoint
    the run keeps (step 2, which ran before the failure, saved then), from which it resumes."""
    from modern_jax.training import loop
    from modern_jax.training.checkpoint import CHECKPOINTS

    monkeypatch.chdir(ROOT)
    (tmp_path / "flaky.py").write_text(FLAKY)
    run, init = grpo_run(tmp_path, "run", "train.steps=4", "train.checkpoint_every=4",
                         f"grpo.rewards=[{tmp_path / 'flaky.py'}:flaky]", "grpo.reward_weights=null")
    with pytest.raises(ValueError) as raised:
        loop.train(run, init=init)
    message = str(raised.value)
    assert message.startswith(f"reward function flaky raised ConnectionError: the grader is down "
                              f"({tmp_path / 'flaky.py'}, line 9), scoring step 3's completions;"), message
    assert message.endswith("the run keeps its checkpoint of step 2: run the same command again to resume from it")
    assert sorted(int(p.name) for p in (tmp_path / "run" / CHECKPOINTS).iterdir()) == [2]
    resumed = dataclasses.replace(run, train=dataclasses.replace(run.train, resume=True))
    with pytest.raises(ValueError, match=r"line 9\), scoring step 3's completions; the run keeps its checkpoint of "
                                         r"step 2: run the same command"):
        loop.train(resumed, init=init)
    # at its first call: step 1's batch, made before the first step runs; nothing to keep
    (tmp_path / "down.py").write_text("def down(completions, **kwargs):\n    raise RuntimeError('no grader')\n")
    first, init = grpo_run(tmp_path, "first", "train.steps=2", f"grpo.rewards=[{tmp_path / 'down.py'}:down]",
                           "grpo.reward_weights=null")
    with pytest.raises(ValueError) as raised:
        loop.train(first, init=init)
    assert str(raised.value) == (f"reward function down raised RuntimeError: no grader ({tmp_path / 'down.py'}, line 2), "
                                 f"scoring step 1's completions; no checkpoint was written: run the same command "
                                 f"again to start over")


def test_a_reward_function_that_returns_one_number_or_raises_is_named(tmp_path, monkeypatch):
    from modern_jax.training.rewards import Rewards

    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.py").write_text("def one(completions, **kw):\n    return 0.5\n"
                                   "def boom(completions, **kw):\n    raise RuntimeError('no grader')\n"
                                   "def typed(completions, **kw):\n    return [len(c) + 'x' for c in completions]\n")
    call = lambda spec: Rewards([spec]).score(["p", "q"], ["a", "b"], [[1], [2]], {})  # noqa: E731
    with pytest.raises(ValueError, match=r"^reward function one returned float 0.5, not a list: return a list of "
                                         r"2 rewards, a number \(or None\) for each completion$"):
        call("r.py:one")
    with pytest.raises(ValueError) as raised:
        call("r.py:boom")
    assert str(raised.value) == f"reward function boom raised RuntimeError: no grader ({tmp_path / 'r.py'}, line 4)"
    with pytest.raises(ValueError, match=r"^reward function typed raised TypeError: unsupported operand"):
        call("r.py:typed")  # a TypeError of its own, not one of the call's arguments


def test_a_dotted_reward_module_is_read_from_the_working_directory_first_and_named(tmp_path, monkeypatch):
    """`configs.rewards:exact_answer` run from a directory with its own configs/rewards.py reads that
    file, not the checkout's (on sys.path by the editable install), and a note names the file."""
    from modern_jax.training.rewards import Rewards

    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "rewards.py").write_text("def exact_answer(completions, **kw):\n"
                                                     "    return [7.0] * len(completions)\n")
    with pytest.warns(UserWarning) as notes:
        rewards = Rewards(["configs.rewards:exact_answer"])
    assert rewards.score(["p"], ["a"], [[1]], {"answer": ["2"]})[0, 0] == 7.0
    file = tmp_path / "configs" / "rewards.py"
    assert [str(n.message) for n in notes] == [f"reward functions: exact_answer from {file}"]


def test_a_reward_module_that_exits_when_imported_is_refused_naming_it(tmp_path, monkeypatch):
    from modern_jax.training.rewards import Rewards

    monkeypatch.chdir(tmp_path)
    (tmp_path / "script.py").write_text("import sys\n\ndef f(completions, **kw):\n    return [1.0] * len(completions)\n"
                                        "sys.exit(0)\n")
    (tmp_path / "fails.py").write_text("raise RuntimeError('no key')\n")
    for spec, name in (("script.py:f", "script.py"), ("script:f", "script.py")):
        with pytest.raises(ValueError, match=rf"grpo.rewards\[0\]='{spec}': {name} calls sys.exit\(0\) when imported: "
                                             r"a reward module must only define its functions when imported"):
            Rewards([spec])
    with pytest.raises(ValueError, match=r"fails.py fails to import \(RuntimeError: no key\)"):
        Rewards(["fails:f"])


def test_reward_weights_must_be_finite():
    for weights in ([float("inf"), 0.2], [1.0, float("-inf")], [float("nan"), 1.0]):
        with pytest.raises(ValueError, match=r"reward_weights=.* is invalid: expected 2 finite numbers"):
            GRPOConfig(rewards=("a.py:f", "a.py:g"), reward_weights=weights)


def rows_of(tmp_path, rewards: str, tokens, prompts=("q",), **config):
    """A GRPO objective of `rewards` (a reward file's text, functions named `f`...) and `make`,
    which gives the `[1, R, T]` rows `_rows` makes of `tokens` `[R, C]` sampled after `prompts`
    (each repeated R / len times), as for step 5's batch; `(objective, make, the rows of tokens)`."""
    from modern_jax.data import ByteTokenizer
    from modern_jax.data.prompts import Prompts

    path = tmp_path / f"r{len(list(tmp_path.glob('r*.py')))}.py"  # a file a process reads once: a new one each
    path.write_text(rewards)
    names = [line[4:line.index("(")] for line in rewards.splitlines() if line.startswith("def ")]
    tokens = np.asarray(tokens, np.int32)
    R, C = tokens.shape
    cfg = GRPOConfig(rewards=tuple(f"{path}:{n}" for n in names), num_generations=R // len(prompts),
                     max_completion_length=C, **config)
    objective = GRPO(cfg, TrainConfig(batch_size=R, eval_batch_size=R, seq_len=64, warmup_steps=0))
    objective.tokenizer = tokenizer = ByteTokenizer()
    ids = [np.asarray([tokenizer.bos_id, *tokenizer.encode(p if isinstance(p, str) else "q")], np.int32)
           for p in prompts]
    asked = Prompts(tuple(ids), tuple(prompts), {}, tuple(map(str, range(len(prompts)))))
    index = np.repeat(np.arange(len(prompts)), R // len(prompts))[None]
    make = lambda t: objective._rows(asked, index, np.asarray(t, np.int32)[None], np.ones((1, R), bool), 5)  # noqa: E731
    return objective, make, make(tokens)


def test_completions_no_reward_function_scores_are_said_with_the_step_and_validation_shows_nan(tmp_path, reward_file):
    """TRL warns when every reward function returns None for a completion: so do we, naming the
    step; an evaluation none of whose completions is scored says nan, not 0."""
    eos = 258
    with pytest.warns(UserWarning, match=r"^step 5: every reward function returned None for 4 of the 4 completions"):
        rows_of(tmp_path, "def f(completions, **kw):\n    return [None] * len(completions)\n", [[97, eos]] * 4)
    with pytest.warns(UserWarning, match=r"^step 5: every reward function returned None for 1 of the 4 completions"):
        rows_of(tmp_path, "def f(completions, **kw):\n    return [None] + [1.0] * 3\n", [[97, eos]] * 4)
    config, batch, _ = setting("grpo", reward_file)
    batch = {k: np.full_like(v, np.nan) if k.startswith("reward_") else v for k, v in batch.items()}
    trainer, state = lora_trainer(config)
    totals = jax.device_get(trainer.eval_step(state["params"], trainer.batches.put(batch), jnp.ones((300,), jnp.int32)))
    assert np.isnan(trainer.objective.eval_values(totals)["reward"])


def test_every_completion_truncated_and_masked_out_is_said_once_a_run(tmp_path):
    """grpo.mask_truncated_completions with every completion at max_completion_length: the step
    trains nothing (all weights 0), said once a run with the settings that fix it."""
    reward = "def f(completions, **kw):\n    return [1.0] * len(completions)\n"
    with pytest.warns(UserWarning) as notes:
        _, make, batch = rows_of(tmp_path, reward, [[97, 98]] * 4, mask_truncated_completions=True)
        make([[97, 98]] * 4)
    assert not batch["weights"].any()
    said = [str(n.message) for n in notes if "reward functions:" not in str(n.message)]
    assert said == ["step 5: every completion reached grpo.max_completion_length=2 without <eos>, and "
                    "grpo.mask_truncated_completions leaves such completions out of the loss: the step trains "
                    "nothing (loss 0, grad norm 0); raise grpo.max_completion_length, or set "
                    "grpo.mask_truncated_completions=false (said once a run; completions/clipped_ratio counts "
                    "them at every step)"], said


def test_a_prompt_ending_in_another_role_is_refused_and_one_ending_in_an_assistant_message_is_continued(tmp_path):
    """As TRL's `apply_chat_template` renders a prompt: a last message of the user or a tool opens
    the assistant's turn, an assistant's is continued (transformers' `continue_final_message`: the
    text up to the end of its content), any other role is refused naming the record; a reward
    function receives a continued message as the start of the completion (TRL's bootstrap)."""
    from modern_jax.data import ByteTokenizer
    from modern_jax.data.config import DataConfig
    from modern_jax.data.prompts import read_prompts

    def read(*prompts):
        path = tmp_path / "p.jsonl"
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        got = read_prompts(DataConfig(path=str(path)), ByteTokenizer(), room=64)
        return [ByteTokenizer().decode(ids) for ids in got.ids]

    user = {"role": "user", "content": "2 + 3?"}
    assert read([user], [user, {"role": "assistant", "content": "It is"}]) == [
        "<|user|>\n2 + 3?<|end|>\n<|assistant|>\n", "<|user|>\n2 + 3?<|end|>\n<|assistant|>\nIt is"]
    assert read([user, {"role": "tool", "content": "5"}])[0].endswith("<|tool|>\n5<|end|>\n<|assistant|>\n")
    for role in ("robot", "system"):
        with pytest.raises(ValueError, match=rf"p.jsonl, line 2: the prompt's last message has the role '{role}': "
                                             r"a prompt ends with a user or tool message \(the model answers it\) or "
                                             r"an assistant message \(the model continues it\)"):
            read([user], [user, {"role": role, "content": "x"}])
    seen = tmp_path / "seen.json"
    reward = ("import json\n"
              f"def f(prompts, completions, **kw):\n    open({str(seen)!r}, 'w').write(json.dumps([prompts, "
              "completions]))\n    return [1.0] * len(completions)\n")
    started = [user, {"role": "assistant", "content": "It is"}]
    rows_of(tmp_path, reward, [[32, 53, 258]] * 2, prompts=(started,))
    prompts, completions = json.loads(seen.read_text())
    assert prompts == [[user]] * 2 and completions == [[{"role": "assistant", "content": "It is 5"}]] * 2
