"""The Trainer: a run's objective and converter, and its jitted training and evaluation steps.

A run is three parts: its `Programs` (the mesh, the rules, lower / compile / run,
`training.programs`), its `StateBuilder` (the train state, what trains and what is saved,
`training.state`) and the Trainer, which takes a step:

    t = trainer_for(run, mesh)
    state = t.states.init(seed)
    state, metrics = t.train_step(state, t.batches.put(batch))

`train_step(state, batch) -> (state, metrics)` is one `jax.jit` of a pure function with the
state donated; batch and state carry `NamedSharding`s on a mesh with axes
`('stage', 'data', 'fsdp', 'expert', 'context', 'tensor')` (`sharding.make_mesh`; all 1 on one
CPU). The objective gives the loss (`training.objectives`); the Trainer adds a mixture's
balance and router z-losses, accumulates micro-batches, skips a non-finite update and applies
the optimiser.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from modern_jax.config import LayerSpec
from modern_jax.execution import ExecutionConfig
from modern_jax.layers.moe import AUX_LOSS, DROPPED, LOAD, ROUTER_Z_LOSS
from modern_jax.model import HEAD_LOGITS, abstract_model, expert_loads, head_logits, max_attention_logit, sown_value
from modern_jax.sharding import check_mesh
from modern_jax.training import one_f_one_b
from modern_jax.training.config import RunConfig, TrainConfig
from modern_jax.training.converters import Converter, converter_of
from modern_jax.training.objectives import Objective, objective as objective_of
from modern_jax.training.optimizer import global_norm, learning_rate_schedule, make_optimizer, muon_dimensions
from modern_jax.training.placement import BatchPlacement
from modern_jax.training.programs import programs_of
from modern_jax.training.state import StateBuilder


class Trainer:
    """The steps of one run: `states` (its model, converter and state on its programs' mesh),
    `objective`, trained as `train_cfg` says, its batches placed by `batches`. Build it with
    `trainer_for`."""

    def __init__(self, train_cfg: TrainConfig, states: StateBuilder, objective: Objective, batches: BatchPlacement):
        self.train_cfg, self.states, self.objective, self.batches = train_cfg, states, objective, batches
        self.programs, self.model_cfg = states.programs, states.model_cfg
        self.moe = self.model_cfg.ffn_type == "moe"
        self.uses_dropout = self.model_cfg.attn_dropout > 0 or self.model_cfg.resid_dropout > 0 or \
            bool(states.converter.dropout)
        # 1F1B: the loss inside the stages' loop (`training.one_f_one_b`); the others: autodiff of the model's
        self.loss_in_stages = self.programs.stages > 1 and self.programs.strategies.pipeline_schedule == "1f1b"
        self.schedule = learning_rate_schedule(train_cfg)
        _check_run(self)
        p, sh = self.programs, states.shardings
        p.define("train", self._step, in_shardings=(sh, batches.sharding), out_shardings=(sh, p.replicated),
                 donate_argnums=(0,))
        p.define("eval", self._eval, in_shardings=(sh["params"], batches.sharding, p.replicated,
                                                   sh["params"] if states.keeps_reference else None),
                 out_shardings=p.replicated)

    @property
    def converter(self) -> Converter:
        return self.states.converter

    @property
    def mesh(self) -> Mesh:
        return self.programs.mesh

    # ----- the step ----------------------------------------------------------------

    def _loss(self, params, batch, rng, reference=None):
        """The objective's sums over `batch` (against the `reference` parameters if it needs them)
        and what the layers sowed."""
        cfg, objective, model_of = self.train_cfg, self.objective, self.states.model
        dropout_rng = rng if self.uses_dropout else None
        # the reference's forward, outside the policy's capture
        prepared = objective.prepare(None if reference is None else model_of(reference), batch,
                                     chunk=cfg.loss_vocab_chunk)

        def sums_of(model):
            return objective.sums(model, batch, prepared, chunk=cfg.loss_vocab_chunk, dropout_rng=dropout_rng,
                                  diagnostics=cfg.diagnostics)

        sums, sown = nnx.capture(sums_of, nnx.Intermediate)(model_of(params))
        zero = jnp.zeros((), jnp.float32)
        # what the layers sowed: a mixture of experts' balance and z-losses, drops and loads
        aux = {name: sown_value(sown, name) for name in (AUX_LOSS,) + ((ROUTER_Z_LOSS, DROPPED) if self.moe else ())}
        if self.moe:  # each MoE layer's, then each MTP module's (`expert_loads`)
            aux[LOAD] = expert_loads(sown)
        aux = {name: zero if value is None else value for name, value in aux.items()}
        if cfg.diagnostics:  # sown by the attention layers of this very forward pass
            max_logit = max_attention_logit(sown)
            sums = dict(sums, max_attention_logit=zero if max_logit is None else max_logit)
        if cfg.qk_clip_tau is not None:  # each layer's heads, which QK-clip rescales after the step
            aux[HEAD_LOGITS] = head_logits(sown)
        return sums, aux

    def _grads(self, params, frozen, batch, reference, denom, step_rng):
        """`(loss, sums, aux, grads)` of the step's batch `[A, B, T]`: its micro-batches' added up."""
        cfg, states = self.train_cfg, self.states

        def objective(params, micro, rng):
            sums, aux = self._loss(states.join(params, frozen), micro, rng, reference)
            loss = self.objective.loss(sums, denom) + cfg.moe_aux_weight * aux[AUX_LOSS]
            if self.moe:
                loss = loss + cfg.moe_router_z_weight * aux[ROUTER_Z_LOSS]
            return loss, (sums, aux)

        if self.loss_in_stages:
            def grad_fn(params, micro, rng):
                return one_f_one_b.value_and_grad(self, params, frozen, micro, rng, reference, denom)
        else:
            grad_fn = jax.value_and_grad(objective, has_aux=True)
        n_micro = batch["inputs"].shape[0]
        batch_0 = jax.tree.map(lambda x: x[0], batch)
        if n_micro == 1:
            (loss, (sums, aux)), grads = grad_fn(params, batch_0, step_rng)
            return loss, sums, aux, grads
        # gradient accumulation: the micro-batches' gradients add up to the full batch's
        zero = jnp.zeros((), jnp.float32)
        sums0, aux0 = jax.tree.map(jnp.zeros_like, jax.eval_shape(
            lambda: self._loss(states.join(params, frozen), batch_0, step_rng, reference)))
        init = (zero, sums0, aux0, jax.tree.map(jnp.zeros_like, params))

        def micro_step(carry, xs):
            micro, i = xs
            return _accumulate(carry, grad_fn(params, micro, jax.random.fold_in(step_rng, i)), n_micro,
                               self.objective.max_sums), None

        (loss, sums, aux, grads), _ = jax.lax.scan(micro_step, init, (batch, jnp.arange(n_micro)),
                                                   unroll=not self.programs.execution.scan_layers)
        return loss, sums, aux, grads

    def _step(self, state, batch):
        states = self.states
        params, frozen = states.split(state["params"])  # `params`: what is trained
        reference = states.reference(state["params"], state.get("reference"))
        batch = self.objective.complete(batch)
        denom = self.objective.denominator(batch)
        step_rng = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        loss, sums, aux, grads = self._grads(params, frozen, batch, reference, denom, step_rng)
        grad_norm = global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # the schedule follows the step counter: a skipped step consumes its learning rate as
        # it consumes its batch, and the run ends at the schedule's final value
        lr = self.schedule(state["step"])

        def update(params, opt_state):
            direction, opt_state = states.tx.update(grads, opt_state, params, grad_norm=grad_norm)  # AdamW at lr 1
            params = states.join(optax.apply_updates(params, jax.tree.map(lambda u: u * lr.astype(u.dtype),
                                                                          direction)), frozen)
            return self._after_update(params, aux), opt_state

        # a non-finite step changes nothing (and costs no optimiser update)
        new_params, new_opt_state = jax.lax.cond(finite, update, lambda p, o: (states.join(p, frozen), o), params,
                                                 state["opt_state"])
        new_state = {**state, "params": new_params, "opt_state": new_opt_state, "step": state["step"] + 1,
                     "nonfinite": jnp.where(finite, 0, state["nonfinite"] + 1)}
        return new_state, self._metrics(sums, aux, denom, grad_norm, finite, lr, new_state["nonfinite"])

    def _after_update(self, params, aux):
        """What moves the model after the optimiser, from this step's measurements: auxiliary-loss-free
        balancing (the loads) and QK-clip (each head's max attention logit)."""
        cfg = self.train_cfg
        if not cfg.moe_bias_update_rate and cfg.qk_clip_tau is None:
            return params
        model = self.states.model(params)
        if cfg.moe_bias_update_rate:
            model.balance_routers(aux[LOAD], cfg.moe_bias_update_rate)
        if cfg.qk_clip_tau is not None:
            model.clip_qk(aux[HEAD_LOGITS], cfg.qk_clip_tau)
        return self.states.laid_out(nnx.to_pure_dict(nnx.state(model, nnx.Param)))

    def _metrics(self, sums, aux, denom, grad_norm, finite, lr, streak) -> dict:
        """A step's figures: the objective's, then the optimiser's, the mixture's and the diagnostics'."""
        metrics = {
            **self.objective.metrics(sums, denom),  # `loss`, `z_loss`, then the objective's own names
            "moe_aux_loss": aux[AUX_LOSS],
            "grad_norm": grad_norm,
            "lr": jnp.where(finite, lr, 0.0),  # what was applied: nothing on a skipped step
            "max_abs_logit": sums["max_abs_logit"],
            "finite": finite,
            "nonfinite_streak": streak,
        }
        if self.train_cfg.diagnostics:
            metrics["max_attention_logit"] = sums["max_attention_logit"]
        if self.train_cfg.qk_clip_tau is not None:  # the heads QK-clip rescaled after this step
            metrics["qk_clipped_heads"] = sum(jnp.sum(x > self.train_cfg.qk_clip_tau)
                                              for x in jax.tree.leaves(aux[HEAD_LOGITS])).astype(jnp.float32)
        if self.moe:
            load_LE = aux[LOAD]
            mean_L = jnp.maximum(jnp.mean(load_LE, axis=-1), 1e-9)
            metrics.update({"moe_router_z_loss": aux[ROUTER_Z_LOSS], "moe_dropped": aux[DROPPED],
                            "moe_load_max": jnp.max(load_LE, axis=-1) / mean_L,  # per MoE layer, / the mean load
                            "moe_load_min": jnp.min(load_LE, axis=-1) / mean_L})
        return metrics

    def train_step(self, state, batch):
        """`(state, batch [A, B, T] arrays) -> (new state, metrics)`; `state` is donated."""
        return self.programs.run("train", state, batch)

    # ----- evaluation ----------------------------------------------------------------

    def _eval(self, params, batch, token_bytes, reference):
        micro = jax.tree.map(lambda x: x[0], self.objective.complete(batch))
        reference = self.states.reference(params, reference)
        chunk = self.train_cfg.loss_vocab_chunk
        prepared = self.objective.prepare(None if reference is None else self.states.model(reference), micro,
                                          chunk=chunk)
        return self.objective.eval_sums(self.states.model(params), micro, prepared, token_bytes, chunk=chunk)

    def eval_step(self, params, batch, token_bytes, reference=None):
        """The objective's evaluation sums over one batch (`objective.eval_sums`); `token_bytes`: each
        token id's bytes (bits per byte); `reference`: the state's frozen copy where it keeps one."""
        return self.programs.run("eval", params, batch, token_bytes, reference)

    def compile_eval(self, params, batch, token_bytes, reference=None):
        """The evaluation step compiled for these arguments (abstract ones will do), without running
        it: `eval_step` runs the one compiled last (its `memory_analysis()` is XLA's count)."""
        return self.programs.compile("eval", params, batch, token_bytes, reference)

    def compile(self, state, batch: dict, eval_batch: dict | None = None, token_bytes=None) -> float:
        """Compile the steps for these shapes now (returns seconds), so timing excludes it."""
        start = time.perf_counter()
        self.programs.compile("train", state, batch)
        if eval_batch is not None:
            self.compile_eval(state["params"], eval_batch, token_bytes, state.get("reference"))
        return time.perf_counter() - start


def _check_run(trainer: Trainer) -> None:
    """Refuse what the run's model, mesh and batch cannot train (the errors name the fields)."""
    tc, model_cfg, programs = trainer.train_cfg, trainer.model_cfg, trainer.programs
    trainer.objective.config.check_model(model_cfg)
    if tc.sample_top_k is not None and tc.sample_top_k > model_cfg.vocab_size:
        raise ValueError(f"train.sample_top_k={tc.sample_top_k} exceeds the model's vocabulary of "
                         f"{model_cfg.vocab_size:,} tokens, so it would keep every token: give at most "
                         f"{model_cfg.vocab_size:,}, or null (no top-k)")
    if tc.moe_bias_update_rate and not model_cfg.router_selection_bias:
        raise ValueError(f"train.moe_bias_update_rate={tc.moe_bias_update_rate} balances experts through "
                         f"the router's selection bias, which this model has none of: set "
                         f"model.router_selection_bias=true (and ffn_type=moe), or the rate to 0")
    staged, M = programs.stages > 1, programs.strategies.microbatches
    together = trainer.objective.rows_together if trainer.loss_in_stages else 1
    for name, rows, group in (("train.batch_size / train.grad_accum", tc.batch_size // tc.grad_accum, together),
                              ("train.eval_batch_size", tc.eval_batch_size, 1)):
        if staged and rows % (M * group):
            whole = f"{M}" if group == 1 else f"{M} microbatches x {group} (rows one loss term reads together)"
            raise ValueError(f"{name} = {rows} rows do not split into parallel.microbatches={M}: make it a "
                             f"multiple of {whole}")
    if tc.qk_clip_tau is not None:
        _check_qk_clip(trainer)
    if trainer.loss_in_stages:
        one_f_one_b.check(nnx.merge(trainer.states.graphdef, trainer.states.abstract_params), model_cfg, tc)


def _check_qk_clip(trainer: Trainer) -> None:
    """Refuse QK-clip where rescaling the query and key weights cannot bring the logits down, or
    where the heads' max logits are not measured per layer."""
    tau, model_cfg = trainer.train_cfg.qk_clip_tau, trainer.model_cfg
    if model_cfg.qk_norm != "none":
        raise ValueError(f"train.qk_clip_tau={tau} rescales the query and key weights, which model.qk_norm="
                         f"{model_cfg.qk_norm!r} normalises away (it bounds the logits itself): set qk_clip_tau=null")
    if not trainer.converter.trains_all:
        raise ValueError(f"train.qk_clip_tau={tau} rescales the query and key weights, which a lora: run keeps "
                         f"frozen: set qk_clip_tau=null")
    if trainer.programs.stages > 1:
        raise ValueError(f"train.qk_clip_tau={tau} reads each layer's max logits, which the pipeline's stages do not "
                         f"carry out: set qk_clip_tau=null, or parallel.stage=1")


def trainer_for(run: RunConfig, mesh: Mesh, *, objective: Objective | None = None,
                execution: ExecutionConfig | None = None, layers: tuple[LayerSpec, ...] | None = None,
                optimizer: bool = True) -> Trainer:
    """The one way to build a run's Trainer on `mesh`: its programs, model, converter, state,
    objective and batches, from `run`. `objective`: the run's own, when already made; `execution`:
    another than the run's (the planner's host estimate); `layers`: fewer blocks (the planner's
    counting programs); `optimizer=False`: no optimiser or its state (evaluation, sampling)."""
    programs = programs_of(run, mesh, execution)
    check_mesh(run.model, mesh, programs.rules)
    batches = BatchPlacement(mesh, programs.rules, run.train, run.parallel.context_layout)  # where each batch goes
    objective = objective or objective_of(run.objective, run.train)
    converter = converter_of(run)
    tx = _optimizer(run, converter, layers) if optimizer else None
    states = StateBuilder(run.model, programs, converter, tx=tx, needs_reference=objective.needs_reference,
                          layers=layers)
    return Trainer(run.train, states, objective, batches)


def _optimizer(run: RunConfig, converter: Converter, layers) -> optax.GradientTransformation:
    """The run's optimiser (`training.optimizer.make_optimizer`), Muon's matrices read off its model."""
    tc, muon = run.train, None
    if tc.optimizer == "muon":
        if not converter.trains_all:
            raise ValueError("train.optimizer=muon orthogonalises whole projection matrices, and a lora: run trains "
                             "only low-rank adapters: use train.optimizer=adamw with lora")
        muon = muon_dimensions(abstract_model(run.model, layers), tc.muon_groups)
        if not muon:
            raise ValueError(f"train.muon_groups={list(tc.muon_groups)} selects no matrix of this model, so Muon would "
                             f"move nothing (all of it AdamW): name groups it has (attention, mlp; experts and router "
                             f"in a mixture), or use train.optimizer=adamw")
    return make_optimizer(tc, frozen=run.model.router_selection_bias and converter.trains_all, muon=muon)


_MAXIMA = ("max_abs_logit", "max_attention_logit")


def _accumulate(carry, result, n_micro, maxima=()):
    """Add one micro-batch's loss, sums and gradients (the max |logit|s and the objective's `max_sums`
    take the max; the losses a model sows are means over the micro-batches, its drops and loads sums)."""
    (loss, (sums, aux)), grads = result
    c_loss, c_sums, c_aux, c_grads = carry
    new_sums = {k: (jnp.maximum if k in _MAXIMA + tuple(maxima) else jnp.add)(c_sums[k], sums[k]) for k in c_sums}
    new_aux = {k: jax.tree.map(jnp.maximum, c_aux[k], aux[k]) if k == HEAD_LOGITS else  # each head's max
               c_aux[k] + (aux[k] if k in (DROPPED, LOAD) else aux[k] / n_micro) for k in c_aux}
    return c_loss + loss, new_sums, new_aux, jax.tree.map(jnp.add, c_grads, grads)


__all__ = ["Trainer", "trainer_for"]
