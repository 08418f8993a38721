"""Preference tuning (the `dpo:` section): DPO and its variants, TRL's losses and metrics.

Each batch holds pairs, chosen and rejected as alternate sequences (S = 2 pairs), packed several
to a row where they fit (`laid_out`), only the completions' tokens weighted. A pair's margin is
`delta = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))`,
log-probabilities summed over the completion's tokens:
- sigmoid: `-(1 - s) log sigmoid(beta delta) - s log sigmoid(-beta delta)` (DPO; with
  `label_smoothing` s > 0, the conservative cDPO of noisy labels);
- ipo: `(delta' - 1 / (2 beta))^2`, delta' with each log-probability averaged over its
  completion's tokens (IPO, length-normalised as TRL computes it).
The reference is the run's base with its adapters off in a LoRA run (no second copy of the
weights), else a frozen copy of the starting weights kept beside them. The loss is a mean over
the batch's real pairs (a pair with an empty completion is padding).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from modern_jax.configfile import fail
from modern_jax.data.corpora import build_tokenizer
from modern_jax.data.preference import packed, pair_eval_batches, pair_iterator, read_pairs, split_pairs
from modern_jax.training.loss import per_sequence, token_logps
from modern_jax.training.metrics import Shown
from modern_jax.training.objectives import base

LOSSES = ("sigmoid", "ipo")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")  # TRL's names: means over the pairs


@dataclasses.dataclass(frozen=True)
class DPOConfig(base.Config):
    """The `dpo:` section (README: Preference tuning (DPO)): the module docstring's loss."""

    section = "dpo"
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0

    def __post_init__(self):
        fail_ = functools.partial(fail, "DPOConfig")
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not self.beta > 0:
            fail_("beta", self.beta, "expected a number > 0")
        if self.loss_type not in LOSSES:
            fail_("loss_type", self.loss_type, f"expected one of {', '.join(LOSSES)}")
        if isinstance(self.label_smoothing, bool) or not isinstance(self.label_smoothing, (int, float)) or \
                not 0 <= self.label_smoothing < 0.5:
            fail_("label_smoothing", self.label_smoothing, "expected a number in [0, 0.5)")
        if self.label_smoothing and self.loss_type != "sigmoid":
            fail_("label_smoothing", self.label_smoothing, f"smooths the sigmoid loss only; with loss_type="
                                                           f"{self.loss_type} set it to 0")

    def check(self, train, where: str) -> None:
        if train.batch_size % (2 * train.grad_accum):
            raise ValueError(f"{where}: train.batch_size={train.batch_size} counts sequences, and a DPO pair is two "
                             f"(chosen and rejected) in each of train.grad_accum={train.grad_accum} micro-batches: "
                             f"make it a multiple of {2 * train.grad_accum}")
        if train.eval_batch_size % 2:
            raise ValueError(f"{where}: train.eval_batch_size={train.eval_batch_size} counts sequences, and a DPO "
                             f"pair is two: make it even")


def real_pairs(count_S):
    """`[pairs]` 1.0 for each pair (sequences 2p, 2p + 1) whose completions both have a weighted
    token, 0.0 for padding, from each sequence's count of them."""
    return jnp.all(count_S.reshape(-1, 2) > 0, axis=-1).astype(jnp.float32)


def preference_sums(logps_S, ref_S, count_S, *, beta: float, loss_type: str, label_smoothing: float = 0.0) -> dict:
    """Sums over the pairs of a batch whose sequences alternate chosen, rejected (S = 2 pairs), with
    TRL's metrics: the DPO or IPO loss, the rewards `beta (log pi - log ref)` of the chosen and
    rejected, how often the chosen's is higher, their margin, the policy's log-probabilities,
    and `pairs` (a pair with an empty completion, padding, counts 0)."""
    # [pairs, 2] (pairs have no letter): each pair's chosen and rejected rows side by side
    pi, ref, n = (x.reshape(-1, 2) for x in (logps_S, jax.lax.stop_gradient(ref_S), count_S))
    real = real_pairs(count_S)  # [pairs], as are `loss` and `delta`
    ratio = pi - ref
    if loss_type == "ipo":
        avg = ratio / jnp.maximum(n, 1.0)
        loss = jnp.square(avg[:, 0] - avg[:, 1] - 1.0 / (2.0 * beta))
    else:
        delta = ratio[:, 0] - ratio[:, 1]
        loss = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * delta) \
            - label_smoothing * jax.nn.log_sigmoid(-beta * delta)
    rewards = jax.lax.stop_gradient(beta * ratio)
    total = lambda x: jnp.sum(real * x)  # noqa: E731
    return {"dpo_loss": total(loss), "rewards/chosen": total(rewards[:, 0]),
            "rewards/rejected": total(rewards[:, 1]),
            "rewards/accuracies": total((rewards[:, 0] > rewards[:, 1]).astype(jnp.float32)),
            "rewards/margins": total(rewards[:, 0] - rewards[:, 1]),
            "logps/chosen": total(jax.lax.stop_gradient(pi[:, 0])),
            "logps/rejected": total(jax.lax.stop_gradient(pi[:, 1])), "pairs": jnp.sum(real)}


def laid_out(batch: dict, lengths, placement, shards: int, *, staged: bool = False) -> dict:
    """The sequences of `batch` (`[A, R, T]`, one to a row, of `lengths` `[A, R]` tokens) packed
    (`preference.packed`) into the rows x width of fewest tokens: widths from the placement's
    (`BatchPlacement.widths`: a step compiles once per rows x width) and row counts likewise
    (powers of two and 1.5 times them, below R, that split over the `shards` data shards; and R). TRL pads
    each batch to its longest sequence; here short sequences also share a row. A pipeline
    (`staged`) keeps one sequence to a row: its microbatches split the rows, and a pair must stay
    in one."""
    R = lengths.shape[1]
    slots = np.maximum(lengths - 1, 0)  # a sequence's inputs (its last token is a target only)
    longest, most = max(int(slots.max()), 1), int(slots.sum(-1).max())  # of one micro-batch
    counts = [R] if staged else sorted({n for k in range(R.bit_length()) for n in (1 << k, 3 << k >> 1)
                                        if n < R and n % shards == 0} | {R})
    best, laid = None, None
    for count in counts:
        for width in placement.widths():
            if width < longest or count * width < most:
                continue
            if best is not None and count * width >= best:
                break
            if (fits := packed(batch, lengths, count, width)) is not None:
                best, laid = count * width, fits
                break
    return laid


def shown(config: DPOConfig) -> Shown:
    """Its loss per pair, the margin and accuracy on each line, and a panel of the rewards (chosen,
    rejected, their margin) and one of the accuracy."""
    loss = {"sigmoid": "cDPO loss (nats / pair)" if config.label_smoothing else "DPO loss (nats / pair)",
            "ipo": "IPO loss (per pair)"}[config.loss_type]
    return Shown(loss, console=(("rewards/margins", "margin"), ("rewards/accuracies", "accuracy")),
                 panels=(("reward: beta x log(policy / reference)", (("rewards/chosen", "chosen"),
                                                                     ("rewards/rejected", "rejected"),
                                                                     ("rewards/margins", "margin"))),
                         ("accuracy: pairs with chosen > rejected", (("rewards/accuracies", "accuracy"),))))


class DPO(base.Objective):
    unit, eval_unit = "pairs", "pair"
    needs_reference = True
    metric_names = METRICS
    rows_together = 2  # a pair's chosen and rejected

    def __init__(self, config: DPOConfig, train):
        super().__init__(config, train)
        self.display = shown(config)
        self.sequences = max(train.batch_size // train.grad_accum, train.eval_batch_size)  # most in a micro-batch

    def read(self, run, tokenizer, shared):
        if tokenizer is None:
            if not (run.data.tokenizer_path or run.data.tokenizer == "byte"):
                raise ValueError(f"a DPO run's tokenizer is its model's (--init-from-hf), data.tokenizer_path or "
                                 f"data.tokenizer=byte, not one built from the pairs (data.tokenizer="
                                 f"{run.data.tokenizer!r}): start from a model with --init-from-hf, or set one of "
                                 f"them")
            tokenizer = build_tokenizer(run.data, [], [], run.vocab_size)
        return (tokenizer, *split_pairs(self.read_all(run, tokenizer), run.data.val_fraction))

    def read_all(self, run, tokenizer):
        return read_pairs(run.data, None, tokenizer, self.train.seq_len)

    def train_batches(self, split, *, rows, data, state):
        tc = self.train
        return pair_iterator(split, batch_size=tc.batch_size, grad_accum=tc.grad_accum, seed=tc.seed, state=state)

    def eval_batches(self, split, *, max_windows, rows):
        return pair_eval_batches(split, batch_size=self.train.eval_batch_size, max_pairs=max_windows)

    def place_batch(self, item, *, trainer, params, rows, step, key):
        """The batch's sequences packed into the fewest tokens (`laid_out`), each process passing
        its own rows of them."""
        lengths, batch = item["lengths"], {k: v for k, v in item.items() if k != "lengths"}
        if lengths.shape[1] > self.sequences:  # `per_sequence` would drop the ones beyond
            raise ValueError(f"a DPO batch of {lengths.shape[1]} sequences, beyond the {self.sequences} this "
                             f"objective was made for (train.batch_size / grad_accum, eval_batch_size)")
        laid = laid_out(batch, lengths, trainer.batches, trainer.programs.data_shards,
                        staged=trainer.programs.stages > 1)
        count, width = laid["inputs"].shape[1:]
        mine, _ = trainer.batches.local_slices(count, width)
        return trainer.batches.put({k: v[:, mine] for k, v in laid.items()}, count)

    def fields(self):
        return {**super().fields(), "sequence": jnp.int32}

    def per_sequence(self, x_BT, batch):
        """`[S]`: `x` summed over each sequence's tokens (`batch["sequence"]`)."""
        return per_sequence(x_BT, batch["sequence"], self.sequences)

    def prepare(self, reference, batch, *, chunk):
        """The reference's log-probability of each weighted target, by token (row-shaped, so a
        pipeline's microbatches split it as they split the rows)."""
        return batch["weights"] * token_logps(reference, batch, chunk=chunk)[0]

    def sums(self, model, batch, prepared, *, chunk, dropout_rng, diagnostics):
        logps_BT, _, max_abs = token_logps(model, batch, chunk=chunk, dropout_rng=dropout_rng, diagnostics=diagnostics)
        w_BT = batch["weights"].astype(jnp.float32)
        logps_S, ref_S, count_S = (self.per_sequence(x, batch) for x in (w_BT * logps_BT, prepared, w_BT))
        c = self.config
        return {**preference_sums(logps_S, ref_S, count_S, beta=c.beta, loss_type=c.loss_type,
                                  label_smoothing=c.label_smoothing), "max_abs_logit": max_abs}

    def denominator(self, batch):
        return jnp.maximum(jnp.sum(real_pairs(self.per_sequence(batch["weights"], batch))), 1.0)

    def loss(self, sums, denominator):
        return sums["dpo_loss"] / denominator

    def metrics(self, sums, denominator):
        return {"loss": sums["dpo_loss"] / denominator, "z_loss": jnp.zeros((), jnp.float32),
                **{name: sums[name] / denominator for name in METRICS}}

    def eval_values(self, totals):
        pairs = max(float(totals["pairs"]), 1.0)
        return {"loss": float(totals["dpo_loss"]) / pairs, **{k: float(totals[k]) / pairs for k in METRICS},
                "pairs": int(totals["pairs"])}


Config, Objective = DPOConfig, DPO
