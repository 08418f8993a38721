"""A step's loss and gradients under the 1F1B pipeline schedule (`parallel.pipeline_schedule: 1f1b`).

GPipe and the interleaved schedule run the stacks' loop inside the model's forward pass and the
loss after it, and the gradients are autodiff of the whole. 1F1B starts a microbatch's backward
pass as soon as its forward pass has left the last stage, so the loss runs inside the loop
(`ops.pipeline.one_f_one_b`), and this module cuts the step into the three parts it needs:

    before   the embedding and any earlier stacks (each over the stages as GPipe runs it), on the
             whole batch, differentiated by `jax.vjp` once the loop has given its input's gradient
    stack    the model's last stack, over the stages, each microbatch forward and back
    after    the final norm, the head and the objective's `sums` and `loss` of one microbatch
             (`model.Resumed`): the objective's own code, which adds up over microbatches as it
             does over `train.grad_accum`'s

and gives what `jax.value_and_grad` of the Trainer's loss gives: `((loss, (sums, aux)), grads)`.
The mixture's losses of the last stack enter each microbatch's backward pass with their weight
in the loss (the router z-loss and a per-sequence balance loss are means over the microbatches);
the batch's balance loss `E sum_e f_e P_e` is not a sum over microbatches (f counts the whole
batch), so a run with it in the last stack is refused (`check`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from modern_jax.layers.moe import AUX_LOSS, DROPPED, LOAD, MoE, ROUTER_Z_LOSS
from modern_jax.layers.attention import MAX_LOGIT
from modern_jax.model import Resumed, fold_sown, loop_count
from modern_jax.ops import pipeline
from modern_jax.sharding.context import strategies


def check(model, model_cfg, cfg) -> None:
    """Refuse what 1F1B cannot run of `model` (abstract will do) with train config `cfg`: the batch's
    balance loss in the last stack."""
    if any(isinstance(block.mlp, MoE) for block in model.stages[-1].blocks) and cfg.moe_aux_weight and \
            not model_cfg.moe_aux_per_sequence:
        raise ValueError(f"parallel.pipeline_schedule=1f1b computes each microbatch's loss as it leaves the last "
                         f"stage, and the batch's balance loss (train.moe_aux_weight={cfg.moe_aux_weight}) needs "
                         f"every microbatch's expert counts first: set model.moe_aux_per_sequence=true (a sum "
                         f"over sequences), train.moe_aux_weight=0, or use pipeline_schedule gpipe or interleaved")


def _parts(tree: dict, k: int) -> tuple[dict, dict, dict]:
    """`(outer, early, last)`: `tree` (a pure dict of the model's parameters, or a part) without its
    stacks, its stacks before stack k, and stack k."""
    stacks = dict(tree.get("stages", {}))
    last = stacks.pop(k, {})
    return {n: v for n, v in tree.items() if n != "stages"}, stacks, last


def _whole(outer: dict, early: dict, last: dict, k: int) -> dict:
    """The inverse of `_parts`."""
    stacks = {**early, **({k: last} if last else {})}
    return {**outer, **({"stages": stacks} if stacks else {})}


def value_and_grad(trainer, params: dict, frozen: dict, micro: dict, rng, reference, denom):
    """`((loss, (sums, aux)), grads)` of one micro-batch of the Trainer's step (`Trainer._loss` and
    its objective): `params` the trained parameters, `frozen` the rest."""
    cfg, objective = trainer.train_cfg, trainer.objective
    dropout_rng = rng if trainer.uses_dropout else None
    chunk, diagnostics = cfg.loss_vocab_chunk, cfg.diagnostics
    prepared = objective.prepare(None if reference is None else trainer.states.model(reference), micro, chunk=chunk)
    model = trainer.states.model(trainer.states.join(params, frozen))
    k = len(model.stages) - 1
    outer, early, last = _parts(params, k)
    _, _, last_frozen = _parts(frozen, k)
    stop = jax.lax.stop_gradient
    M = strategies().microbatches
    weight = {AUX_LOSS: cfg.moe_aux_weight, ROUTER_Z_LOSS: cfg.moe_router_z_weight if trainer.moe else 0.0}

    def weighted(reduced):  # what sown values add to the loss
        return sum((weight.get(name, 0.0) * value for name, value in reduced.items()), jnp.zeros((), jnp.float32))

    def model_of(outer, early, last):
        return trainer.states.model(trainer.states.join(_whole(outer, early, last, k), frozen))

    def before(outer, early):
        m = model_of(outer, early, stop(last))
        x_BTD, pos_BT = m.enter(micro["inputs"], positions=micro["positions"], segment_ids=micro["segment_ids"])
        x_BTD, _, reduced, loads = m.through(x_BTD, pos_BT, micro["segment_ids"], None, dropout_rng, diagnostics,
                                             range(k))
        return (x_BTD, weighted(reduced)), (pos_BT, reduced, loads)

    (x_BTD, added), before_vjp, (pos_BT, reduced_before, loads_before) = jax.vjp(before, outer, early,
                                                                                  has_aux=True)

    stack = model.stages[k]
    units, zeros, _ = stack.parts(dropout_rng, diagnostics)
    stage_fn = stack.stage_function(units)

    def stage(x_bTD, rows_b, w_P, f_P, first):
        blocks = [trainer.states.join(w_P.get("blocks", {}).get(j, {}), f_P.get("blocks", {}).get(j, {}))
                  for j in range(len(stack.unit))]
        return stage_fn(x_bTD, rows_b, blocks, first)

    def after(outer, y_bTD, rows_b):
        batch_b, prepared_b = rows_b
        sums = objective.sums(Resumed(model_of(outer, stop(early), stop(last)), y_bTD), batch_b, prepared_b,
                              chunk=chunk, dropout_rng=dropout_rng, diagnostics=diagnostics)
        return objective.loss(sums, denom), sums

    maxima = ("max_abs_logit",) + tuple(objective.max_sums)

    def combine_sums(total, sums):
        return {n: (jnp.maximum if n in maxima else jnp.add)(total[n], sums[n]) for n in total}

    cot = {name: weight.get(name, 0.0) / M for name in zeros}
    loss, sums, reduced, per_unit, dx_BTD, d_last, d_outer = pipeline.one_f_one_b(
        stage, after, x_BTD, (pos_BT, micro["segment_ids"]), last, last_frozen, outer, (micro, prepared), zeros,
        cot, fold_sown, combine_sums, loop_count, group=objective.rows_together)
    d_outer_before, d_early = before_vjp((dx_BTD, jnp.ones((), jnp.float32)))
    grads = _whole(jax.tree.map(jnp.add, d_outer_before, d_outer), d_early, d_last, k)

    # the batch's values of what the layers sowed, as the model's own forward pass gives them
    B, T = micro["inputs"].shape
    reduced = stack.whole_batch(reduced, per_unit, M, B * T)
    loss = loss + added + weighted(reduced)
    reduced = fold_sown(reduced, reduced_before)
    zero = jnp.zeros((), jnp.float32)
    aux = {AUX_LOSS: reduced[AUX_LOSS]}
    if trainer.moe:
        loads = loads_before + [[None if pair is None else pair[0] for pair in per_unit]]
        aux.update({ROUTER_Z_LOSS: reduced[ROUTER_Z_LOSS], DROPPED: reduced[DROPPED], LOAD: model.layer_loads(loads)})
    if diagnostics:
        sums = dict(sums, max_attention_logit=reduced.get(MAX_LOGIT, zero))
    return (loss, (sums, aux)), grads
