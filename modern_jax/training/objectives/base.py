"""The interface every training objective implements (`Objective`), and its section's config.

A run trains for one objective. Each is a module of this package named after the run-file
section that chooses it (`dpo:`; none: `next_token`) and holds two classes: `Config`, the
section's fields, validated at construction, and `Objective`, what the Trainer, the loop and
the planner call:

    data      `read` -> (tokenizer, train split, validation split), `read_all` -> every record as one
              split (`evaluate --data`); `train_batches`,
              `eval_batches` `[A, B, T]` dicts of inputs, targets, positions, segment_ids,
              weights; `unit`, what the splits' `len` counts; `eval_size` and `eval_unit`: how many
              of what an evaluation of the validation split can score
    batches   `place_batch`: a data batch on the mesh as the step takes it (GRPO samples its
              completions there first, from the current weights), or `BatchFailed` naming what
              of the run's own code failed; `steps_per_batch`: how many steps each serves (a run
              saves and stops only between batches); `begin_batch`: the same in two parts, the work
              on the mesh started, then finished; `ahead`: the loop begins each next batch before
              the step runs, from the weights that step starts with (GRPO's overlap)
    the step  `complete`: what each micro-batch needs from the whole step's batch (GRPO's
              advantages); `prepare` (a forward of the frozen reference, outside the policy's
              gradient), `sums` of one micro-batch (they add up over micro-batches; those named
              in `max_sums` take the max), `denominator` of the whole batch (the loss's divisor,
              and any figure of the batch the metrics need), `loss` from both
    figures   `metrics` of a step (`loss` first, then the objective's own names), `eval_values`
              of an evaluation's summed `eval_sums`, and `display`: what the console and the plot
              show (`metrics.Shown`); `samples`: rows of the last batch made to write beside
              the metrics (GRPO's completions)
    rows      `rows_together`: how many consecutive rows of a batch one term of the loss reads
              (a preference pair's two), which a pipeline's microbatches keep together
    needs     `needs_reference`: a frozen model besides the trained one (a LoRA run's base with
              its adapters off, else a copy of the starting weights kept in the state)

Nothing outside an objective's module asks which objective runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from modern_jax.training.metrics import Shown
from modern_jax.training.placement import FIELDS


class BatchFailed(ValueError):
    """A batch `place_batch` could not make because of the run's own code (a GRPO reward function
    that raised, or returned something else than rewards): the loop adds what the run keeps."""


@dataclasses.dataclass(frozen=True)
class Config:
    """An objective's section (`dpo:`): its fields, validated at construction."""

    section: ClassVar[str | None] = None  # the run-file section (None: the default, next-token)

    def check(self, train, where: str) -> None:
        """Refuse `train:` settings this objective cannot run (`train` a TrainConfig)."""

    def check_model(self, model) -> None:
        """Refuse settings this objective cannot run on `model` (a ModelConfig)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Objective:
    """What a run minimises, on what data, and what it reports (the module docstring)."""

    unit: ClassVar[str] = "tokens"  # what the splits' sizes count
    eval_unit: ClassVar[str] = "window"  # what an evaluation scores, one at a time
    needs_reference: bool = False
    metric_names: tuple[str, ...] = ()  # its own figures in `metrics`, besides `loss` and `z_loss`
    max_sums: tuple[str, ...] = ()  # sums that take the max over micro-batches, besides `max_abs_logit`
    steps_per_batch: int = 1
    ahead: bool = False  # the next batch begins before the step, from the weights the step starts with
    rows_together: int = 1  # consecutive rows of a batch that one loss term reads (a DPO pair), kept together
    display: Shown  # what the console and the plot show of its figures

    def __init__(self, config: Config, train):
        self.config, self.train = config, train

    # ----- data ------------------------------------------------------------------

    def read(self, run, tokenizer, shared):
        """`(tokenizer, train split, validation split)` of `run.data`, tokenized by `tokenizer`
        (None: the one `data:` describes); `shared`: where the processes of a launch write together."""
        raise NotImplementedError

    def read_all(self, run, tokenizer):
        """Every record of `run.data` as one split, tokenized by `tokenizer` (`evaluate --data`)."""
        raise NotImplementedError

    def train_batches(self, split, *, rows: slice, data, state: dict | None):
        """A grain iterator of this process's `rows` of each step's `[A, B / A, T]` batch; `state`
        (its `get_state()`) resumes it exactly."""
        raise NotImplementedError

    def eval_batches(self, split, *, max_windows: int | None, rows: slice):
        """`data.batches.Batches` of `[1, eval_batch_size, T]` over `split` (the validation split, or
        the one `evaluate` scores)."""
        raise NotImplementedError

    def eval_size(self, split) -> int:
        """How many `eval_unit`s of at most `train.seq_len` tokens an evaluation can score (by default
        the split's records: pairs, prompts)."""
        return len(split)

    def place_batch(self, item: dict, *, trainer, params, rows: int | None, step: int | None, key) -> dict:
        """`item` (a batch of `train_batches` or `eval_batches`: this process's rows of one with
        `rows` rows, None: one process) as global arrays on `trainer`'s mesh, for `step` (None: an
        evaluation's) with `params` the current weights and `key` its random key."""
        return trainer.batches.put(item, rows)

    def begin_batch(self, item: dict, *, trainer, params, rows: int | None, step: int | None, key):
        """`place_batch` in two parts: what runs on the mesh started now, then the function that
        finishes it (by default everything is done now)."""
        placed = self.place_batch(item, trainer=trainer, params=params, rows=rows, step=step, key=key)
        return lambda: placed

    def fields(self) -> dict:
        """The arrays of a step's batch and their dtypes (what the planner's abstract batch holds)."""
        return dict(FIELDS)

    def programs(self, trainer, params) -> dict:
        """`{name: (fn, args)}`: the objective's own programs of a step besides the Trainer's (GRPO's
        rollouts), with `params` abstract parameters, for the planner to compile and count."""
        return {}

    def samples(self) -> list[dict]:
        """Rows of the last batch `place_batch` made, to write beside the metrics (then forgotten)."""
        return []

    # ----- the step --------------------------------------------------------------

    def complete(self, batch: dict) -> dict:
        """The step's batch `[A, B, T]` with what each micro-batch needs from the whole of it."""
        return batch

    def prepare(self, reference, batch: dict, *, chunk: int):
        """What the frozen `reference` model (None unless `needs_reference`) gives the loss."""
        return None

    def sums(self, model, batch: dict, prepared, *, chunk: int, dropout_rng, diagnostics: bool) -> dict:
        """Sums over one micro-batch, `max_abs_logit` (the largest output logit) among them."""
        raise NotImplementedError

    def denominator(self, batch: dict):
        """What the summed loss is divided by, with any figure of the whole batch the metrics need (a
        pytree; `batch`: the step's, `[A, B, T]`, `complete`d)."""
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
