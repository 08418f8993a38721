"""The interface every training objective implements (`Objective`), and its section's config.

A run trains for one objective. Each is a module of this package named after the run-file
section that chooses it (`dpo:`; none: `next_token`) and holds two classes: `Config`, the
section's fields, validated at construction, and `Objective`, what the Trainer, the loop and
the planner call:

    data      `read` -> (tokenizer, train split, validation split); `train_batches`,
              `eval_batches` `[A, B, T]` dicts of inputs, targets, positions, segment_ids,
              weights; `unit`, what the splits' `len` counts; `eval_size` and `eval_unit`: how many
              of what an evaluation of the validation split can score
    the step  `prepare` (a forward of the frozen reference, outside the policy's gradient),
              `sums` of one micro-batch (they add up over micro-batches; `max_abs_logit` is a
              max), `denominator` of the whole batch, `loss` from both
    figures   `metrics` of a step (`loss` first, then the objective's own names), `eval_values`
              of an evaluation's summed `eval_sums`, and `shown`: what the console and the plot
              show (`metrics.Shown`)
    needs     `needs_reference`: a frozen model besides the trained one (a LoRA run's base with
              its adapters off, else a copy of the starting weights kept in the state)

Nothing outside an objective's module asks which objective runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from modern_jax.training.metrics import Shown


@dataclasses.dataclass(frozen=True)
class Config:
    """An objective's section (`dpo:`): its fields, validated at construction."""

    section: ClassVar[str | None] = None  # the run-file section (None: the default, next-token)

    def check(self, train, where: str) -> None:
        """Refuse `train:` settings this objective cannot run (`train` a TrainConfig)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Objective:
    """What a run minimises, on what data, and what it reports (the module docstring)."""

    unit: ClassVar[str] = "tokens"  # what the splits' sizes count
    eval_unit: ClassVar[str] = "window"  # what an evaluation scores, one at a time
    needs_reference: ClassVar[bool] = False
    named: tuple[str, ...] = ()  # its own figures in `metrics`, besides `loss` and `z_loss`
    shown: Shown

    def __init__(self, config: Config, train):
        self.config, self.train = config, train

    # ----- data ------------------------------------------------------------------

    def read(self, run, tokenizer, shared):
        """`(tokenizer, train split, validation split)` of `run.data`, tokenized by `tokenizer`
        (None: the one `data:` describes); `shared`: where the processes of a launch write together."""
        raise NotImplementedError

    def train_batches(self, split, *, rows: slice, data, state: dict | None):
        """A grain iterator of this process's `rows` of each step's `[A, B / A, T]` batch; `state`
        (its `get_state()`) resumes it exactly."""
        raise NotImplementedError

    def eval_batches(self, split, *, max_windows: int | None, rows: slice):
        """`data.pipeline.Batches` of `[1, eval_batch_size, T]` over the validation split."""
        raise NotImplementedError

    def eval_size(self, split) -> int:
        """How many `eval_unit`s of at most `train.seq_len` tokens an evaluation can score."""
        raise NotImplementedError

    # ----- the step --------------------------------------------------------------

    def prepare(self, reference, batch: dict, *, chunk: int):
        """What the frozen `reference` model (None unless `needs_reference`) gives the loss."""
        return None

    def sums(self, model, batch: dict, prepared, *, chunk: int, dropout_rng, diagnostics: bool) -> dict:
        """Sums over one micro-batch, `max_abs_logit` (the largest output logit) among them."""
        raise NotImplementedError

    def denominator(self, batch: dict):
        """What the summed loss is divided by (`batch`: the step's, `[A, B, T]`)."""
        raise NotImplementedError

    def loss(self, sums: dict, denominator):
        """The objective's loss from the step's sums (the mixture's losses are the Trainer's)."""
        raise NotImplementedError

    def metrics(self, sums: dict, denominator) -> dict:
        """A step's figures: `loss` and `z_loss` first, then the objective's own names."""
        raise NotImplementedError

    def eval_sums(self, model, batch: dict, prepared, token_bytes, *, chunk: int) -> dict:
        """Sums over one evaluation batch (`[B, T]` arrays)."""
        return self.sums(model, batch, prepared, chunk=chunk, dropout_rng=None, diagnostics=False)

    def eval_values(self, totals: dict) -> dict:
        """An evaluation's figures (host floats) from its summed `eval_sums`."""
        raise NotImplementedError
