"""Reinforcement learning with verifiable rewards (the `grpo:` section): GRPO and its variants
(Dr. GRPO, DAPO, BNPO; GSPO's sequence-level ratios), as TRL 1.16's `GRPOTrainer` computes them.

A step's batch is made by the model itself (`placed`): `batch_size / num_generations`
prompts (`data.prompts`), each sampled `num_generations` times (a group) from the current
weights with the KV cache, compiled once per prompt width, on the run's mesh and in every
process (`generate.decode`); the reward functions (`training.rewards`) score each process's
completions on its host. A row is a prompt and its completion, the completion's tokens
weighted (and with `mask_truncated_completions` none of a completion that reached
`max_completion_length` without `<eos>`). Then, over the step's whole batch and per row i of
a group g (letters: B rows, T tokens):

    r_i    = sum_f w_f r_f,i       (a function's None is left out; a row none scores is unscorable)
    A_i    = (r_i - mean_g r) / (std + 1e-4)    std: the group's (scale_rewards: group), the
             batch's (batch); none: no division; an unscorable row's A is 0
    rho    = pi(y_t) / pi_old(y_t) per token, or for the row (importance_sampling_level:
             sequence, GSPO) exp of its tokens' mean log-ratio
    kl_t   = exp(ref - logp) - (ref - logp) - 1, times rho (use_bias_correction_kl)
    l_i,t  = -min(rho A_i, clip(rho, 1 - epsilon, 1 + epsilon_high) A_i) + beta kl_t
    loss   grpo: the mean over rows of each row's token mean; bnpo: each micro-batch's token
           mean, averaged over them; dr_grpo: the sum / (rows x max_completion_length); dapo:
           the sum / the weighted tokens of the whole batch

with log-probabilities at the sampling `temperature`. `pi_old` is the sampling weights': with
`num_iterations` > 1 each batch serves that many steps, its log-probabilities kept from when it
was sampled (so a run saves and stops only between batches); with `overlap` the batch of step
t + 1 is sampled while step t trains, from the weights step t starts with (one step off-policy),
and `pi_old` is those weights', kept by the rollout program; else the current ones without
gradient (rho = 1). Each pass runs over the batch's own width (`BatchPlacement.width`: its
longest prompt and completion, bucketed), not `train.seq_len`. The reference `ref` (beta > 0)
is the base with the adapters off (LoRA) or a frozen copy of the start. The metrics are TRL's,
over the step's whole batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from modern_jax.configfile import fail
from modern_jax.data.corpora import build_tokenizer
from modern_jax.data.prompts import prompt_eval_batches, prompt_iterator, read_prompts, split_prompts
from modern_jax.generate import cut_at_eos, decode, left_padded
from modern_jax.training.loss import token_logps
from modern_jax.training.metrics import Shown
from modern_jax.training.placement import rows_sharding
from modern_jax.training.objectives import base
from modern_jax.training.rewards import Rewards

LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo")
LEVELS = ("token", "sequence")
SCALES = ("group", "batch", "none")
COMPLETIONS = ("completions/mean_length", "completions/min_length", "completions/max_length",
               "completions/clipped_ratio", "completions/mean_terminated_length",
               "completions/min_terminated_length", "completions/max_terminated_length")
CLIPS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
         "clip_ratio/high_max")
SAMPLING, EVALUATION = 0x524F4C4C, 0x4556414C  # the rollouts' keys: the step's key folded with one of these


def _number(value, low: float, *, above: bool = False, high: float | None = None) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and (value > low if above else value >= low) \
        and (high is None or value <= high)


def _count(value, low: int = 1) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


@dataclasses.dataclass(frozen=True)
class GRPOConfig(base.Config):
    """The `grpo:` section (docs/training.md, Reinforcement learning): the module docstring's loss."""

    section = "grpo"
    rewards: tuple[str, ...] = ()  # 'path/to/file.py:function' or 'package.module:function' each
    reward_weights: tuple[float, ...] | None = None  # one per reward function (default 1 each)
    num_generations: int = 8  # completions per prompt (a group)
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    beta: float = 0.0  # the KL penalty's weight; 0 keeps no reference model
    epsilon: float = 0.2
    epsilon_high: float | None = None  # DAPO's clip-higher (default: epsilon)
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    num_iterations: int = 1  # optimiser steps per batch of rollouts
    scale_rewards: str = "group"
    mask_truncated_completions: bool = False
    use_bias_correction_kl: bool = True
    completions_per_log: int = 8  # rows of each log step's batch written to completions.jsonl (0: none)
    overlap: bool = False  # sample step t + 1's batch while step t trains, from the weights step t starts with

    def __post_init__(self):
        fail_ = functools.partial(fail, "GRPOConfig")
        rewards = [self.rewards] if isinstance(self.rewards, str) else self.rewards
        if not isinstance(rewards, (list, tuple)) or not rewards or not all(isinstance(r, str) for r in rewards):
            fail_("rewards", self.rewards, "expected a list of reward functions, 'path/to/file.py:function' or "
                                           "'package.module:function' each")
        object.__setattr__(self, "rewards", tuple(rewards))
        if self.reward_weights is not None:
            weights = self.reward_weights
            if not isinstance(weights, (list, tuple)) or len(weights) != len(rewards) or \
                    not all(_number(w, float("-inf"), above=True) and math.isfinite(w) for w in weights):
                fail_("reward_weights", weights, f"expected {len(rewards)} finite numbers, one per reward function")
            object.__setattr__(self, "reward_weights", tuple(float(w) for w in weights))
        if not _count(self.num_generations, 2):
            fail_("num_generations", self.num_generations, "expected an integer >= 2 (a group's rewards are compared "
                                                           "with each other)")
        if not _count(self.max_completion_length):
            fail_("max_completion_length", self.max_completion_length, "expected a positive integer")
        if not _number(self.temperature, 0, above=True) or not math.isfinite(self.temperature):
            fail_("temperature", self.temperature, "expected a finite number > 0")
        if not _number(self.top_p, 0, above=True, high=1.0):
            fail_("top_p", self.top_p, "expected a number in (0, 1] (1: off)")
        if not _count(self.top_k, 0):
            fail_("top_k", self.top_k, "expected an integer >= 0 (0: off)")
        if not _number(self.beta, 0):
            fail_("beta", self.beta, "expected a number >= 0 (0: no reference model)")
        if not _number(self.epsilon, 0, above=True):
            fail_("epsilon", self.epsilon, "expected a number > 0")
        if self.epsilon_high is not None and not _number(self.epsilon_high, 0, above=True):
            fail_("epsilon_high", self.epsilon_high, "expected a number > 0, or null (epsilon)")
        for name, choices in (("loss_type", LOSSES), ("importance_sampling_level", LEVELS),
                              ("scale_rewards", SCALES)):
            if getattr(self, name) not in choices:
                fail_(name, getattr(self, name), f"expected one of {', '.join(choices)}")
        if not _count(self.num_iterations):
            fail_("num_iterations", self.num_iterations, "expected a positive integer")
        for name in ("mask_truncated_completions", "use_bias_correction_kl", "overlap"):
            if not isinstance(getattr(self, name), bool):
                fail_(name, getattr(self, name), "expected true or false")
        if not _count(self.completions_per_log, 0):
            fail_("completions_per_log", self.completions_per_log, "expected an integer >= 0")
        if self.overlap and self.num_iterations > 1:
            fail_("overlap", self.overlap, f"samples each batch one step ahead for one step, and num_iterations="
                                           f"{self.num_iterations} reuses a batch: set one of them off (false, 1)")

    def check_model(self, model) -> None:
        if self.top_k > model.vocab_size:
            raise ValueError(f"grpo.top_k={self.top_k} exceeds the model's vocabulary of {model.vocab_size:,} tokens, "
                             f"so it would keep every token: give at most {model.vocab_size:,}, or 0 (off)")

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def check(self, train, where: str) -> None:
        G, mu = self.num_generations, self.num_iterations
        for name in ("batch_size", "eval_batch_size"):
            rows = getattr(train, name) // (train.grad_accum if name == "batch_size" else 1)
            if rows % G:
                what = f"{name} / grad_accum = {rows} rows" if name == "batch_size" else f"{name}={rows} rows"
                raise ValueError(f"{where}: train.{what}, and a GRPO group is grpo.num_generations={G} of them: make "
                                 f"it a multiple of {G}")
        if train.seq_len <= self.max_completion_length:
            raise ValueError(f"{where}: train.seq_len={train.seq_len} holds a prompt and its completion, so it must "
                             f"exceed grpo.max_completion_length={self.max_completion_length}")
        for name in ("steps", "checkpoint_every"):
            if getattr(train, name) % mu:
                raise ValueError(f"{where}: train.{name}={getattr(train, name)}, but each batch of rollouts serves "
                                 f"grpo.num_iterations={mu} steps and a run saves only between batches: make it a "
                                 f"multiple of {mu}")

    def to_dict(self):
        d = dataclasses.asdict(self)
        return {**d, "rewards": list(self.rewards),
                "reward_weights": None if self.reward_weights is None else list(self.reward_weights)}


# ----- the batch's figures (independent of the weights) ------------------------------------


def _nanmean(x, axis=None):
    n = jnp.sum(~jnp.isnan(x), axis=axis)
    return jnp.where(n > 0, jnp.nansum(x, axis=axis) / jnp.maximum(n, 1), jnp.nan)


def _nanstd(x, axis=None, keepdims=False):
    """The standard deviation over the values that are not NaN, with Bessel's correction (NaN for
    fewer than two), as TRL's `nanstd`."""
    n = jnp.sum(~jnp.isnan(x), axis=axis, keepdims=True)
    mean = jnp.nansum(x, axis=axis, keepdims=True) / jnp.maximum(n, 1)
    var = jnp.nansum(jnp.square(x - mean), axis=axis, keepdims=True) / jnp.maximum(n - 1, 1)
    std = jnp.where(n > 1, jnp.sqrt(var), jnp.nan)
    return std if keepdims else jnp.squeeze(std, axis)


def row_values(batch: dict, name: str):
    """`[..., B]`: a per-row figure, which a batch carries as `[..., B, T]` (the same at every token)."""
    return batch[name][..., 0]


def advantages(rewards_NF, weights_F, G: int, scale: str):
    """`(advantage[N], reward[N], std[N])` of N rows in groups of G (module docstring): the rows'
    rewards (NaN: unscorable) and the std their advantages were scaled by (for the zero-std count)."""
    unscorable_N = jnp.all(jnp.isnan(rewards_NF), axis=-1)
    rewards_N = jnp.where(unscorable_N, jnp.nan, jnp.nansum(rewards_NF * weights_F[None, :], axis=-1))
    grouped = rewards_N.reshape(-1, G)  # [groups, G]
    mean_N = jnp.repeat(_nanmean(grouped, axis=1), G)
    std_N = jnp.broadcast_to(_nanstd(rewards_N), rewards_N.shape) if scale == "batch" else \
        jnp.repeat(_nanstd(grouped, axis=1), G)
    adv_N = rewards_N - mean_N
    if scale != "none":
        adv_N = adv_N / (std_N + 1e-4)
    return jnp.nan_to_num(adv_N, nan=0.0), rewards_N, std_N


def _completion_figures(length_N, ended_N, real_N) -> dict:
    """TRL's completion-length metrics over the real rows."""
    real, ended = real_N > 0, (ended_N > 0) & (real_N > 0)
    big = jnp.float32(jnp.inf)
    n, n_ended = jnp.maximum(jnp.sum(real), 1), jnp.sum(ended)
    pick = lambda mask, fill: jnp.where(mask, length_N, fill)  # noqa: E731
    some = n_ended > 0  # none ended: TRL reports zeros
    return {"completions/mean_length": jnp.sum(pick(real, 0.0)) / n,
            "completions/min_length": jnp.min(pick(real, big)), "completions/max_length": jnp.max(pick(real, -big)),
            "completions/clipped_ratio": jnp.sum(real & ~ended) / n,
            "completions/mean_terminated_length": jnp.where(some, jnp.sum(pick(ended, 0.0)) / jnp.maximum(n_ended, 1),
                                                            0.0),
            "completions/min_terminated_length": jnp.where(some, jnp.min(pick(ended, big)), 0.0),
            "completions/max_terminated_length": jnp.where(some, jnp.max(pick(ended, -big)), 0.0)}


def batch_rewards(batch, weights, config: GRPOConfig):
    """`(rewards[N, F], advantages(...))` of a batch's rows: each function's, then their weighted sums."""
    rewards_NF = jnp.stack([row_values(batch, f"reward_{f}").reshape(-1) for f in range(len(weights))], -1)
    return rewards_NF, advantages(rewards_NF, jnp.asarray(weights), config.num_generations, config.scale_rewards)


def warn_untrained(config: GRPOConfig, scores_NF, ended_N, real_N, step: int, said_truncated: bool) -> bool:
    """Warn, as TRL does, of completions no reward function scored (each step), and say once a run
    (`said_truncated`: said already; returned: said now or before) that every completion was cut
    and so masked out (`mask_truncated_completions`): the step trains nothing."""
    unscored = np.all(np.isnan(scores_NF), axis=1) & real_N
    if unscored.any():
        none = ", and the step's reward is nan" if unscored.sum() == real_N.sum() else ""
        warnings.warn(f"step {step}: every reward function returned None for {unscored.sum()} of the {real_N.sum()} "
                      f"completions: they train with advantage 0{none}; make at least one reward function return a "
                      f"number for each completion")
    if said_truncated or not config.mask_truncated_completions or not real_N.any() or (ended_N & real_N).any():
        return said_truncated
    warnings.warn(f"step {step}: every completion reached grpo.max_completion_length={config.max_completion_length} "
                  f"without <eos>, and grpo.mask_truncated_completions leaves such completions out of the loss: the "
                  f"step trains nothing (loss 0, grad norm 0); raise grpo.max_completion_length, or set "
                  f"grpo.mask_truncated_completions=false (said once a run; completions/clipped_ratio counts them at "
                  f"every step)")
    return True


def for_rewards(prompt, text: str):
    """`(prompt, completion)` as the reward functions receive them (TRL's): a text's completion is
    its text; a conversation's an assistant message, which takes in the prompt's final assistant
    message where the completion continues one (`data.prompts`)."""
    if not isinstance(prompt, list):
        return prompt, text
    if prompt[-1]["role"] == "assistant":
        return prompt[:-1], [{"role": "assistant", "content": prompt[-1]["content"] + text}]
    return prompt, [{"role": "assistant", "content": text}]


def shown(config: GRPOConfig) -> Shown:
    """The loss, the mean reward and the completions' length on each line; a panel of the reward and
    one of the KL and the entropy."""
    name = {"grpo": "GRPO", "bnpo": "BNPO", "dr_grpo": "Dr. GRPO", "dapo": "DAPO"}[config.loss_type]
    return Shown(f"{name} loss", console=(
        ("reward", "reward"), ("reward_std", "reward_std"), ("completions/mean_length", "length")) +
        ((("kl", "kl"),) if config.beta else ()),
        panels=(("reward (the rewards' weighted sum)", (("reward", "mean"), ("reward_std", "std"))),
                ("nats / token", (("entropy", "entropy"),) + ((("kl", "kl to the reference"),) if config.beta else ()))))


def old_logps(model_of, params, batch, *, chunk: int, temperature: float):
    """`[A, B, T]` log-probabilities of a batch's targets under the sampling weights `params`
    (`model_of(params)` is their model), kept for the steps a batch serves (`num_iterations`)."""
    flat = {k: v.reshape(-1, v.shape[-1]) for k, v in batch.items()}
    logps, _, _ = token_logps(model_of(params), flat, chunk=chunk, temperature=temperature)
    return logps.reshape(batch["inputs"].shape)


def completion_width(tokens, eos: int | None) -> int:
    """The most tokens a completion of `tokens` `[..., max_completion_length]` holds, its <eos> included."""
    tokens = np.asarray(tokens).reshape(-1, np.shape(tokens)[-1])
    if eos is None or not tokens.size:
        return tokens.shape[-1]
    ended = tokens == eos
    return int(np.max(np.where(ended.any(-1), ended.argmax(-1) + 1, tokens.shape[-1])))


class GRPO(base.Objective):
    unit, eval_unit = "prompts", "prompt"

    def __init__(self, config: GRPOConfig, train):
        super().__init__(config, train)
        self.rewards = Rewards(config.rewards, config.reward_weights)
        self.needs_reference = config.beta > 0
        self.steps_per_batch = config.num_iterations
        self.ahead = config.overlap
        self.display = shown(config)
        functions = tuple(f"rewards/{name}/{stat}" for name in self.rewards.names for stat in ("mean", "std"))
        self.metric_names = (("kl",) if config.beta else ()) + ("entropy",) + CLIPS + (
            "reward", "reward_std") + functions + ("frac_reward_zero_std",) + COMPLETIONS
        self.max_sums = ("clip_ratio/high_max", "clip_ratio/low_min")  # kept as 1 - the min
        self.splits: dict[str, object] = {}  # the prompts the batches index: train, and the evaluated split
        self.tokenizer = None
        self._kept: tuple[int, dict] | None = None  # (step, batch) of the rollouts that serve several steps
        self._samples: list[dict] = []
        self._said_truncated = False  # every completion masked out, said once a run

    # ----- data ------------------------------------------------------------------

    def read(self, run, tokenizer, shared):
        if tokenizer is None:
            if not (run.data.tokenizer_path or run.data.tokenizer == "byte"):
                raise ValueError(f"a GRPO run's tokenizer is its model's (--init-from-hf), data.tokenizer_path or "
                                 f"data.tokenizer=byte, not one built from the prompts (data.tokenizer="
                                 f"{run.data.tokenizer!r}): start from a model with --init-from-hf, or set one of them")
            tokenizer = build_tokenizer(run.data, [], [], run.vocab_size)
        prompts = self.read_all(run, tokenizer)
        self.splits["train"], validation = split_prompts(prompts, run.data.val_fraction)
        return tokenizer, self.splits["train"], validation

    def read_all(self, run, tokenizer):
        self.tokenizer = tokenizer  # the rollouts stop at its <eos> and are scored as its text
        return read_prompts(run.data, tokenizer, self.train.seq_len - self.config.max_completion_length)

    def train_batches(self, split, *, rows, data, state):
        tc, c = self.train, self.config
        return prompt_iterator(split, batch_size=tc.batch_size, generations=c.num_generations,
                               grad_accum=tc.grad_accum, seed=tc.seed, rows=rows, repeat=c.num_iterations, state=state)

    def eval_batches(self, split, *, max_windows, rows):
        self.splits["evaluated"] = split  # the prompts an evaluation's batches index
        return prompt_eval_batches(split, batch_size=self.train.eval_batch_size,
                                   generations=self.config.num_generations, max_prompts=max_windows, rows=rows)

    # ----- rollouts --------------------------------------------------------------

    def place_batch(self, item, *, trainer, params, rows, step, key):
        """Sample the completions of `item`'s prompts from `params` on the mesh (the module
        docstring), score them, and place the rows; a batch that serves `num_iterations` steps is
        sampled at the first."""
        return self.begin_batch(item, trainer=trainer, params=params, rows=rows, step=step, key=key)()

    def begin_batch(self, item, *, trainer, params, rows, step, key):
        """`place_batch` in two parts: the rollouts started on the mesh now, and the function that
        waits for them, scores them and places the rows. With `overlap` a training batch also keeps
        each completion token's log-probability under `params`, the sampling weights (`old_logps`)."""
        c = self.config
        evaluation = "real" in item
        if not evaluation and self._kept is not None and step // c.num_iterations == self._kept[0]:
            return lambda: self._kept[1]
        prompts = self.splits["evaluated" if evaluation else "train"]
        index = np.asarray(item["index"])  # [A, R]: this process's rows of each micro-batch
        A, R = index.shape
        room = self.train.seq_len - c.max_completion_length
        width = min(room, 1 << max(int(item["width"]) - 1, 7).bit_length())  # a few widths: each compiles once
        prompt_NW, length_N = left_padded([prompts.ids[i] for i in index.reshape(-1)], width)
        prompt_AR, length_AR = prompt_NW.reshape(A, R, width), length_N.reshape(A, R)
        sampled = self._sample(trainer, params, prompt_AR, length_AR, rows, jax.random.fold_in(
            key, EVALUATION if evaluation else SAMPLING), scored=c.overlap and not evaluation)  # every process's rows

        def finish():
            tokens, logps = (np.asarray(x) for x in sampled) if isinstance(sampled, tuple) else (np.asarray(sampled),
                                                                                                 None)
            # the rows' width: the longest prompt and completion of every process's rows, bucketed
            width = trainer.batches.width(int(item["width"]) + completion_width(tokens, self.tokenizer.eos_id))
            if rows is not None:
                tokens = tokens[:, trainer.batches.local_slices(rows)[0]]
                logps = None if logps is None else logps[:, trainer.batches.local_slices(rows)[0]]
            real = np.asarray(item["real"], bool) if evaluation else np.ones((A, R), bool)
            batch = self._rows(prompts, index, tokens, real, None if evaluation else step + 1, width, logps)
            placed = trainer.batches.put(batch, rows)
            if c.num_iterations > 1 and not evaluation:  # the sampling weights' log-probabilities, kept for the steps
                placed["old_logps"] = trainer.programs.program("grpo_old_logps", functools.partial(
                    old_logps, trainer.states.model, chunk=self.train.loss_vocab_chunk, temperature=c.temperature),
                                                      params, placed)
                self._kept = (step // c.num_iterations, placed)
            return placed

        return finish

    def _sample(self, trainer, params, prompt_AR, length_AR, rows, key, scored: bool = False):
        """`[A, rows, max_completion_length]` tokens sampled after the prompts (all rows of the step
        sampled at once, on the mesh; every process passes its prompts and receives every row), still
        on the way; `scored`: `(tokens, logps)`, each token's log-probability under `params` too."""
        mesh = trainer.mesh
        A, R = length_AR.shape
        shape = (A, rows if rows is not None else R)

        def put(x):  # rows split as the batch's are
            return jax.make_array_from_process_local_data(rows_sharding(mesh, trainer.programs.rules, x.ndim), x,
                                                          shape + x.shape[2:])

        name, rollout = rollout_program(self, scored)
        return trainer.programs.program(f"{name}_{prompt_AR.shape[-1]}",
                                        functools.partial(rollout, trainer.states), params, put(prompt_AR),
                                        put(length_AR), key, out_shardings=trainer.programs.replicated)

    def _rows(self, prompts, index, tokens, real, first_step: int | None, width: int | None = None,
              logps=None) -> dict:
        """The `[A, R, width]` rows (prompt, completion, padding; None: `seq_len` wide) of this process's
        rollouts, scored (a few kept for completions.jsonl, with `first_step`, the first step they
        train; None: an evaluation's); `logps` `[A, R, C]`: each sampled token's log-probability under
        the sampling weights, kept as the rows' `old_logps`."""
        c, eos, T = self.config, self.tokenizer.eos_id, width or self.train.seq_len
        A, R = index.shape
        completions = [cut_at_eos(row, eos) for row in tokens.reshape(A * R, -1)]  # without the <eos>
        ended = np.asarray([len(ids) < tokens.shape[-1] for ids in completions])  # it sampled an <eos>
        ids = [np.concatenate([ids, [eos]]).astype(np.int32) if done and eos is not None else ids.astype(np.int32)
               for ids, done in zip(completions, ended)]  # a completion's tokens, its <eos> included
        texts = [self.tokenizer.decode(ids) for ids in completions]
        flat = index.reshape(-1)
        asked, given = zip(*(for_rewards(prompts.prompts[i], text) for i, text in zip(flat, texts)))
        columns = {k: [v[i] for i in flat] for k, v in prompts.columns.items()}
        when = f"step {first_step}" if first_step is not None else "a validation batch"
        try:
            scores = self.rewards.score(list(asked), list(given), [x.tolist() for x in ids], columns)  # [N, F]
        except ValueError as e:
            raise base.BatchFailed(f"{e}, scoring {when}'s completions") from None
        scores[~real.reshape(-1)] = np.nan  # rows that fill up an evaluation batch count for nothing
        if first_step is not None:
            self._said_truncated = warn_untrained(c, scores, ended, real.reshape(-1), first_step, self._said_truncated)
        N = A * R
        inputs, targets = np.zeros((N, T), np.int32), np.zeros((N, T), np.int32)
        completion, sampled = np.zeros((N, T), np.float32), np.zeros((N, T), np.float32)
        valid = np.zeros((N, T), bool)
        for n, (i, done) in enumerate(zip(flat, ended)):
            sequence = np.concatenate([prompts.ids[i], ids[n]])
            inputs[n, :len(sequence) - 1], targets[n, :len(sequence) - 1] = sequence[:-1], sequence[1:]
            valid[n, :len(sequence)] = True
            completion[n, len(prompts.ids[i]) - 1:len(sequence) - 1] = 1.0
            if logps is not None:
                sampled[n, len(prompts.ids[i]) - 1:len(sequence) - 1] = logps.reshape(N, -1)[n, :len(ids[n])]
        keep = real.reshape(-1) & (ended | (not c.mask_truncated_completions))
        row = lambda x: np.broadcast_to(np.asarray(x, np.float32)[:, None], (N, T))  # noqa: E731
        batch = {"inputs": inputs, "targets": targets, "positions": np.where(valid, np.arange(T), 0).astype(np.int32),
                 "segment_ids": valid.astype(np.int32), "weights": completion * keep[:, None],
                 "completion": completion, "ended": row(ended), "real": row(real.reshape(-1)),
                 **{f"reward_{f}": row(scores[:, f]) for f in range(scores.shape[1])},
                 **({"old_logps": sampled} if logps is not None else {})}
        if self.config.completions_per_log and first_step is not None:
            self._samples = [{"step": first_step, "prompt": asked[n], "completion": given[n],
                              **{name: None if np.isnan(scores[n, f]) else float(scores[n, f])
                                 for f, name in enumerate(self.rewards.names)}}
                             for n in range(min(N, self.config.completions_per_log)) if real.reshape(-1)[n]]
        return {k: np.ascontiguousarray(v).reshape(A, R, T) for k, v in batch.items()}

    def fields(self) -> dict:
        rows = {name: jnp.float32 for name in ("completion", "ended", "real")}
        rows.update({f"reward_{f}": jnp.float32 for f in range(len(self.rewards.names))})
        kept = self.config.num_iterations > 1 or self.config.overlap  # the sampling weights' log-probabilities
        return {**super().fields(), **rows, **({"old_logps": jnp.float32} if kept else {})}

    def programs(self, trainer, params):
        """The rollouts of a step's whole batch at the longest prompts (`seq_len - max_completion_length`)."""
        mesh, tc = trainer.mesh, self.train
        A, W = tc.grad_accum, tc.seq_len - self.config.max_completion_length
        rows = lambda n: rows_sharding(mesh, trainer.programs.rules, n)  # noqa: E731
        prompts = jax.ShapeDtypeStruct((A, tc.batch_size // A, W), jnp.int32, sharding=rows(3))
        lengths = jax.ShapeDtypeStruct((A, tc.batch_size // A), jnp.int32, sharding=rows(2))
        name, rollout = rollout_program(self, self.config.overlap)
        return {f"{name}_{W}": (functools.partial(rollout, trainer.states),
                                (params, prompts, lengths, jax.random.key(0)))}

    def samples(self) -> list[dict]:
        """The first rows of the last batch sampled for training, to write to completions.jsonl."""
        taken, self._samples = self._samples, []
        return taken

    # ----- the step --------------------------------------------------------------

    def complete(self, batch):
        """Each row's advantage, from the rewards of the whole step's batch `[A, B, T]`."""
        _, (adv_N, _, _) = batch_rewards(batch, self.rewards.weights, self.config)
        shape = batch["inputs"].shape
        return {**batch, "advantages": jnp.broadcast_to(adv_N.reshape(shape[:-1])[..., None], shape)}

    def denominator(self, batch):
        """The loss's divisor for `loss_type`, and the batch's reward and completion figures."""
        c = self.config
        rewards_NF, (_, rewards_N, std_N) = batch_rewards(batch, self.rewards.weights, self.config)
        real_N = row_values(batch, "real").reshape(-1)
        rows = jnp.maximum(jnp.sum(real_N), 1.0)
        divisor = {"grpo": rows, "bnpo": jnp.float32(batch["inputs"].shape[0]),
                   "dr_grpo": rows * c.max_completion_length,
                   "dapo": jnp.maximum(jnp.sum(batch["weights"]), 1.0)}[c.loss_type]
        figures = {"reward": _nanmean(rewards_N), "reward_std": _nanstd(rewards_N),
                   "frac_reward_zero_std": jnp.sum((std_N <= 1e-8) * real_N) / rows}
        for f, name in enumerate(self.rewards.names):
            figures[f"rewards/{name}/mean"] = _nanmean(rewards_NF[:, f])
            figures[f"rewards/{name}/std"] = _nanstd(rewards_NF[:, f])
        length_N = jnp.sum(batch["completion"], axis=-1).reshape(-1)
        figures.update(_completion_figures(length_N, row_values(batch, "ended").reshape(-1), real_N))
        return {"divisor": divisor, "rows": rows, "figures": figures}

    def prepare(self, reference, batch, *, chunk):
        if reference is None:
            return None
        return jax.lax.stop_gradient(token_logps(reference, batch, chunk=chunk, temperature=self.config.temperature)[0])

    def sums(self, model, batch, prepared, *, chunk, dropout_rng, diagnostics):
        c = self.config
        logps_BT, entropy_BT, max_abs = token_logps(model, batch, chunk=chunk, temperature=c.temperature,
                                                    entropy=True, dropout_rng=dropout_rng, diagnostics=diagnostics)
        mask_BT = batch["weights"].astype(jnp.float32)
        count_B = jnp.sum(mask_BT, axis=-1)
        adv_B1 = batch["advantages"][:, :1]
        old_BT = batch["old_logps"] if "old_logps" in batch else jax.lax.stop_gradient(logps_BT)
        log_ratio_BT = logps_BT - old_BT
        if c.importance_sampling_level == "sequence":  # GSPO: one ratio a row, [B, 1]
            log_w = jnp.sum(log_ratio_BT * mask_BT, axis=-1, keepdims=True) / jnp.maximum(count_B, 1.0)[:, None]
        else:
            log_w = log_ratio_BT
        ratio = jnp.exp(log_w)
        clipped = jnp.clip(ratio, 1.0 - c.epsilon, 1.0 + c.clip_high)
        loss_BT = -jnp.minimum(ratio * adv_B1, clipped * adv_B1) * jnp.ones_like(mask_BT)
        sums = {}
        if c.beta:
            delta_BT = prepared - logps_BT
            kl_BT = jnp.exp(delta_BT) - delta_BT - 1.0
            if c.use_bias_correction_kl:
                kl_BT = kl_BT * ratio
            loss_BT = loss_BT + c.beta * kl_BT
            sums["kl"] = jnp.sum(jax.lax.stop_gradient(kl_BT) * mask_BT)
        masked_B = jnp.sum(loss_BT * mask_BT, axis=-1)
        sums["policy"] = {"grpo": jnp.sum(masked_B / jnp.maximum(count_B, 1.0)),
                          "bnpo": jnp.sum(masked_B) / jnp.maximum(jnp.sum(count_B), 1.0)}.get(c.loss_type,
                                                                                               jnp.sum(masked_B))
        ratio = jax.lax.stop_gradient(ratio)
        low = ((ratio < 1.0 - c.epsilon) & (adv_B1 < 0)).astype(jnp.float32)
        high = ((ratio > 1.0 + c.clip_high) & (adv_B1 > 0)).astype(jnp.float32)
        region = jnp.maximum(low, high)
        if c.importance_sampling_level == "sequence":  # means over the rows, the ratio one a row
            real_B1 = batch["real"][:, :1]
            per_row = lambda x: x[:, 0]  # noqa: E731
            total = lambda x: jnp.sum(x * real_B1)  # noqa: E731
            has_B = batch["real"][:, 0] > 0
        else:
            per_row = lambda x: jnp.sum(x * mask_BT, axis=-1) / jnp.maximum(count_B, 1.0)  # noqa: E731
            total = lambda x: jnp.sum(x * mask_BT)  # noqa: E731
            has_B = count_B > 0
        sums.update({
            "entropy": jnp.sum(entropy_BT * mask_BT), "tokens": jnp.sum(count_B),
            "clip_ratio/low_mean": total(low), "clip_ratio/high_mean": total(high),
            "clip_ratio/region_mean": total(region),
            # the rows' extremes (a row without tokens has none): maxima over micro-batches, the min as 1 - it
            "clip_ratio/high_max": jnp.max(jnp.where(has_B, per_row(high), 0.0)),
            "clip_ratio/low_min": jnp.max(jnp.where(has_B, 1.0 - per_row(low), 0.0)),
            "max_abs_logit": max_abs})
        return sums

    def loss(self, sums, denominator):
        return sums["policy"] / denominator["divisor"]

    def metrics(self, sums, denominator):
        c = self.config
        tokens = jnp.maximum(sums["tokens"], 1.0)
        clip_count = denominator["rows"] if c.importance_sampling_level == "sequence" else tokens
        out = {"loss": sums["policy"] / denominator["divisor"], "z_loss": jnp.zeros((), jnp.float32)}
        if c.beta:
            out["kl"] = sums["kl"] / tokens
        out["entropy"] = sums["entropy"] / tokens
        out.update({name: sums[name] / clip_count for name in CLIPS[:3]})
        out["clip_ratio/low_min"] = 1.0 - sums["clip_ratio/low_min"]
        out["clip_ratio/high_max"] = sums["clip_ratio/high_max"]
        return {**out, **denominator["figures"]}

    def eval_sums(self, model, batch, prepared, token_bytes, *, chunk):
        sums = self.sums(model, batch, prepared, chunk=chunk, dropout_rng=None, diagnostics=False)
        totals = self.denominator({k: v[None] for k, v in batch.items()})
        real = jnp.sum(batch["real"][:, 0])
        rewards, reward_N = totals["figures"], batch_rewards(batch, self.rewards.weights, self.config)[1][1]
        scored = ~jnp.isnan(reward_N)  # a fill-up row's rewards are NaN too
        # sums over the batches: an evaluation's figures are the means over all its rows (the reward's
        # over the rows a reward function scored)
        return {"policy": self.loss(sums, totals) * real,
                "rows": real, "tokens": sums["tokens"], "entropy": sums["entropy"],
                **({"kl": sums["kl"]} if self.config.beta else {}),
                "reward": jnp.sum(jnp.where(scored, reward_N, 0.0)), "scored": jnp.sum(scored),
                "completions/mean_length": rewards["completions/mean_length"] * real,
                "completions/clipped_ratio": rewards["completions/clipped_ratio"] * real}

    def eval_values(self, totals):
        rows, tokens = max(float(totals["rows"]), 1.0), max(float(totals["tokens"]), 1.0)
        out = {"loss": float(totals["policy"]) / rows, "entropy": float(totals["entropy"]) / tokens,
               "reward": float(totals["reward"]) / float(totals["scored"]) if totals["scored"] else float("nan"),
               "completions/mean_length": float(totals["completions/mean_length"]) / rows,
               "completions/clipped_ratio": float(totals["completions/clipped_ratio"]) / rows,
               "prompts": int(rows) // self.config.num_generations}
        if "kl" in totals:
            out["kl"] = float(totals["kl"]) / tokens
        return out


Config, Objective = GRPOConfig, GRPO

__all__ = ["GRPO", "GRPOConfig", "advantages"]


def rollout_program(objective: "GRPO", scored: bool):
    """`(name, f(states, params, prompt_ABW, length_AB, key))` of the program that samples a step's
    completions (`rollout`), or with `scored` also keeps each token's log-probability (`scored_rollout`)."""
    c, chunk = objective.config, objective.train.loss_vocab_chunk
    eos_id = None if objective.tokenizer is None else objective.tokenizer.eos_id  # None: a plan's
    if scored:
        return "grpo_scored_rollout", functools.partial(scored_rollout, c, eos_id, chunk)
    return "grpo_rollout", functools.partial(rollout, c, eos_id)


def rollout(c: GRPOConfig, eos_id, states, params, prompt_ABW, length_AB, key):
    """`[A, B, C]` completions sampled after the left-padded prompts, a group's prompt prefilled once, by
    the run's model of `params` as it samples (`States.sampling_model`: a LoRA run's adapters merged)."""
    model = states.sampling_model(params)
    A, B, W = prompt_ABW.shape
    tokens = decode(model, prompt_ABW.reshape(A * B, W), key, max_new_tokens=c.max_completion_length,
                    temperature=c.temperature, top_k=c.top_k or None, top_p=c.top_p if c.top_p < 1 else None,
                    eos_id=eos_id, length_B=length_AB.reshape(A * B), group=c.num_generations)
    return tokens.reshape(A, B, -1)


def scored_rollout(c: GRPOConfig, eos_id, chunk: int, states, params, prompt_ABW, length_AB, key):
    """`rollout`'s tokens `[A, B, C]` and each one's log-probability `[A, B, C]` under `params` at
    the sampling temperature (a forward of the model as it trains over the prompts, left-padded, and
    their completions)."""
    tokens_ABC = rollout(c, eos_id, states, params, prompt_ABW, length_AB, key)
    A, B, W = prompt_ABW.shape
    C = tokens_ABC.shape[-1]
    sequence_NS = jnp.concatenate([prompt_ABW.reshape(A * B, W), tokens_ABC.reshape(A * B, C)], -1)
    index_NS = jnp.broadcast_to(jnp.arange(W + C - 1)[None, :], (A * B, W + C - 1))
    start_N1 = (W - length_AB.reshape(A * B))[:, None]  # a row's first prompt token
    batch = {"inputs": sequence_NS[:, :-1], "targets": sequence_NS[:, 1:],
             "positions": jnp.maximum(index_NS - start_N1, 0),
             "segment_ids": (index_NS >= start_N1).astype(jnp.int32)}
    logps_NS, _, _ = token_logps(states.model(params), batch, chunk=chunk, temperature=c.temperature)
    return tokens_ABC, logps_NS[:, W - 1:].reshape(A, B, C)
