"""Evaluation of a run's state: the objective's evaluation sums over batches, added up on the
device and fetched once (`evaluate_batches`), as the loop's periodic and final evaluations and
`modern-jax evaluate` run it."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax

from modern_jax.training.trainer import Trainer


def _summed(step, batches, advance) -> dict:
    """The sums of `step(batch)` over `batches`, fetched to the host at once; with `advance`, called
    as each batch's are computed (the next batch is made and sent while the device computes one)."""
    totals, computing = None, None
    for batch in batches:
        sums = step(batch)
        totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
        if advance is not None:
            if computing is not None:
                jax.block_until_ready(computing)
                advance()
            computing = totals
    if totals is None:
        raise ValueError("nothing to evaluate: the split is empty")
    totals = jax.device_get(totals)
    if advance is not None:
        advance()
    return totals


def evaluate_batches(trainer: Trainer, params, batches, token_bytes, rows: int | None = None,
                     advance: Callable[[], None] | None = None, reference=None) -> dict:
    """The objective's evaluation over `batches` (`objective.eval_values`: next-token's loss in nats
    / token, bits per byte and tokens; DPO's loss and TRL's means over the pairs), one host fetch;
    `rows`: the global rows of a batch whose local share each process passes (None: one process);
    `advance`: called once a batch (a progress bar's); `reference`: the state's frozen copy, if any."""
    count = itertools.count()
    totals = _summed(lambda batch: trainer.eval_step(params, eval_batch(trainer, params, batch, rows, next(count)),
                                                   token_bytes, reference), batches, advance)
    return trainer.objective.eval_values(totals)


def eval_batch(trainer: Trainer, params, batch: dict, rows: int | None, index: int) -> dict:
    """Evaluation batch `index` on the mesh, as the objective places it (GRPO samples its completions
    from `params`, with a key of `train.seed` and the index: every evaluation samples the same)."""
    key = jax.random.fold_in(jax.random.key(trainer.train_cfg.seed), index)
    return trainer.objective.place_batch(batch, trainer=trainer, params=params, rows=rows, step=None, key=key)
