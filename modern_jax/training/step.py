"""The jitted training and evaluation steps, placed on a device mesh.

The train state is a plain pytree of arrays:

    params     the model's parameters as a pure dict (`nnx.to_pure_dict`), float32 masters
    opt_state  optax's state over the same tree
    step       int32, optimiser steps taken (skipped non-finite steps included)
    rng        uint32[2], the run's base key; step `s` uses `fold_in(rng, s)`
    nonfinite  int32, non-finite steps in a row

`train_step(state, batch) -> (state, metrics)` is one `jax.jit` of a pure function with the
state donated; batch and state carry `NamedSharding`s on a mesh with axes
`('data', 'fsdp', 'expert', 'context', 'tensor')` (`sharding.make_mesh`; all 1 on one CPU). Parameter
shardings come from each parameter's logical axes through the rules table
(`sharding.state_shardings`), so the sharding layer only has to supply rules.
"""

from __future__ import annotations

import contextlib
import hashlib

import jax
import jax.numpy as jnp
import optax
from flax.nnx import traversals
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from modern_jax.config import LayerSpec, ModelConfig
from modern_jax.execution import ExecutionConfig
from modern_jax.execution import use as use_execution
from modern_jax.kernels.backend import recording_kernels
from modern_jax.layers.moe import AUX_LOSS, DROPPED, LOAD, ROUTER_Z_LOSS
from modern_jax.model import Transformer, abstract_params, max_attention_logit, sown_value
from modern_jax.ops import pipeline
from modern_jax.sharding import RULES, Strategies, check_mesh, logical_rules, state_shardings
from modern_jax.sharding.devices import compiling_for, lowering_for
from modern_jax.training import layout
from modern_jax.training import staged as staged_grads
from modern_jax.training.config import RunConfig, TrainConfig
from modern_jax.training.converters import LoRA, abstract_converted, converted, converter_of
from modern_jax.training.objectives import Objective, config_of, objective as objective_of
from modern_jax.training.optimizer import global_norm, learning_rate_schedule, make_optimizer
from modern_jax.training.placement import BatchPlacement

# XLA options for the compiled steps (over those of XLA_FLAGS). Initialisation always compiles at
# level 0: it runs once.
COMPILER_OPTIONS: dict = {}
_EXECUTABLES: dict = {}  # compiled steps shared by Trainers whose lowered programs are identical


class Trainer:
    """Builds, places and compiles the steps of one (model, train config, mesh).

    Steps compile ahead of time on first use (or `compile()`); an executable is shared by
    every Trainer that lowers the same program (the key is the lowered StableHLO itself, so
    whatever the step closes over that changes it gives a new executable).
    """

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: Mesh, rules=RULES,
                 context_layout: str = "two_chunk", *, strategies: Strategies | None = None,
                 execution: ExecutionConfig | None = None, converter: LoRA | None = None,
                 objective: Objective | None = None, layers: tuple[LayerSpec, ...] | None = None,
                 optimizer: bool = True):
        check_mesh(model_cfg, mesh, rules)
        self.batches = BatchPlacement(mesh, rules, train_cfg, context_layout)  # where each batch goes
        if train_cfg.moe_bias_update_rate and not model_cfg.router_selection_bias:
            raise ValueError(f"train.moe_bias_update_rate={train_cfg.moe_bias_update_rate} balances experts through "
                             f"the router's selection bias, which this model has none of: set "
                             f"model.router_selection_bias=true (and ffn_type=moe), or the rate to 0")
        self.model_cfg, self.cfg, self.mesh, self.rules = model_cfg, train_cfg, mesh, tuple(rules)
        self.strategies, self.execution = strategies or Strategies(), execution or ExecutionConfig()
        self.kernels: dict[str, set[str]] = {}  # what each dispatch resolved to, as the steps were traced
        self.moe = model_cfg.ffn_type == "moe"
        self.converter = converter  # what turns the plain model into the one trained (LoRA's adapters), if any
        # what the loss is and the data hold (next-token cross-entropy unless the run names another)
        self.objective = objective_of(config_of({}, train_cfg, ""), train_cfg) if objective is None else objective
        self.shown = self.objective.shown  # what the console and the plot show of it
        self.layers = layers  # the blocks built (default: the config's; the planner's counting programs build fewer)
        self.graphdef, abstract = abstract_converted(model_cfg, converter, layers)
        # the stacks as the run holds them: laid out for an interleaved pipeline's rounds (`layout`)
        staged = mesh.shape.get("stage", 1) > 1
        self.rounds = self.strategies.stage_repeats if staged else 1
        self.stacked = layout.stacked(abstract)
        M = self.strategies.microbatches
        # 1F1B: the loss inside the stages' loop (`training.staged`); the others: autodiff of the model's
        self.one_f_one_b = staged and self.strategies.pipeline_schedule == "1f1b"
        together = self.objective.rows_together if self.one_f_one_b else 1
        for name, rows, group in (("train.batch_size / train.grad_accum", train_cfg.batch_size // train_cfg.grad_accum,
                                   together), ("train.eval_batch_size", train_cfg.eval_batch_size, 1)):
            if staged and rows % (M * group):
                whole = f"{M}" if group == 1 else f"{M} microbatches x {group} (rows one loss term reads together)"
                raise ValueError(f"{name} = {rows} rows do not split into parallel.microbatches={M}: make it a "
                                 f"multiple of {whole}")
        model = nnx.merge(self.graphdef, abstract)
        if self.one_f_one_b:
            staged_grads.check(model, model_cfg, train_cfg)
        with logical_rules(mesh, rules, self.strategies):  # the stacks over the pipeline stages, if any
            for stack in model.stages:
                pipeline.check_depth(stack.repeats, f"the stack of layers {stack.first} .. "
                                                    f"{stack.first + stack.repeats * len(stack.unit) - 1}")
        # a converted model trains what its converter says (LoRA: the adapters); the rest is frozen,
        # with no gradient and no optimiser state
        self.trained = None if converter is None else {path for path, v in nnx.to_flat_state(abstract)
                                                       if converter.trains(v)}
        # the optimiser and its state (none for a Trainer that evaluates or samples only)
        self.tx = make_optimizer(train_cfg, frozen=model_cfg.router_selection_bias and converter is None) if optimizer \
            else None
        self.schedule = learning_rate_schedule(train_cfg)
        replicated = NamedSharding(mesh, PartitionSpec())
        abstract = layout.laid_out(abstract, self.rounds)
        params_sh = nnx.to_pure_dict(state_shardings(abstract, mesh, rules))
        self.state_shardings = {"params": params_sh, "step": replicated, "rng": replicated, "nonfinite": replicated}
        if optimizer:
            opt_abstract = jax.eval_shape(self.tx.init, self.split(nnx.to_pure_dict(abstract))[0])
            self.state_shardings["opt_state"] = optax.tree_map_params(
                self.tx, lambda _, s: s, opt_abstract, self.split(params_sh)[0], transform_non_params=lambda _: replicated)
        # an objective's frozen reference: a converted model with its additions off (LoRA's base);
        # otherwise a copy of the start
        self.keeps_reference = self.objective.needs_reference and converter is None
        if self.keeps_reference:
            self.state_shardings["reference"] = params_sh
        self.replicated = replicated
        self.uses_dropout = model_cfg.attn_dropout > 0 or model_cfg.resid_dropout > 0 or \
            bool(converter and converter.config.dropout)
        self._jitted = {
            "init": jax.jit(self._init, out_shardings=self.state_shardings),
            "convert": jax.jit(self._convert, out_shardings=params_sh),
            "train": jax.jit(self._step, in_shardings=(self.state_shardings, self.batches.sharding),
                             out_shardings=(self.state_shardings, replicated), donate_argnums=(0,)),
            "eval": jax.jit(self._eval, in_shardings=(params_sh, self.batches.sharding, replicated,
                                                      params_sh if self.keeps_reference else None),
                            out_shardings=replicated),
            "copy": jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=params_sh),
            "finite": jax.jit(lambda tree: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))),
        }
        self._executables: dict = {}
        self._programs: dict = {}  # an objective's own programs, compiled per name and argument types
        self.compilations: dict[str, int] = {}  # programs compiled by this Trainer, per name

    def _executable(self, name: str, *args):
        """The compiled `name` for these arguments (each distinct program compiled once per process)."""
        options = {"xla_backend_optimization_level": 0} if name == "init" else COMPILER_OPTIONS
        lowered = self.lower(name, *args)
        key = (hashlib.sha256(lowered.as_text().encode()).hexdigest(), tuple(sorted(options.items())))
        if key not in _EXECUTABLES:
            _EXECUTABLES[key] = lowered.compile(compiler_options=dict(options) or None)
            self.compilations[name] = self.compilations.get(name, 0) + 1
        return _EXECUTABLES[key]

    def program(self, name: str, fn, *args, out_shardings=None):
        """`fn(*args)` compiled for the mesh (its rules, strategies and kernels), once per `name` and
        argument types: an objective's own programs (GRPO's rollouts, one per prompt width) and the
        benchmarks' (`harness`); `out_shardings` as `jax.jit` takes them (None: as the compiler lays
        them out)."""
        leaves = jax.tree.leaves(args)
        key = (name, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
        if key not in self._programs:
            self._jitted.setdefault(name, jax.jit(fn, out_shardings=out_shardings))
            self._programs[key] = self._executable(name, *args)
        return self._programs[key](*args)

    def lower_program(self, name: str, fn, *args, platform: str | None = None):
        """`fn(*args)` lowered as `program` compiles it (abstract arguments will do): the planner's."""
        self._jitted.setdefault(name, jax.jit(fn))
        return self.lower(name, *args, platform=platform)

    def lower(self, name: str, *args, platform: str | None = None):
        """Trace and lower step `name` (or a `program`) for the mesh's devices (their platform picks the
        kernels), or for `platform` ('cuda', 'tpu') with no such device here (lowered only: compile it with that
        platform's compiler); on a multi-device mesh the rules shape every activation."""
        program = self._jitted[name]
        with compiling_for(platform or self.mesh), use_execution(self.execution), recording_kernels() as seen, \
                contextlib.ExitStack() as stack:
            stack.callback(lambda: [self.kernels.setdefault(k, set()).update(v) for k, v in seen.items()])
            if self.mesh.size > 1:
                stack.enter_context(logical_rules(self.mesh, self.rules, self.strategies))
            if platform is None:
                return program.lower(*args)
            if platform == "cuda":  # the Triton lowering asks for a GPU: name one (an H100; the IR is the same)
                stack.enter_context(lowering_for("sm_90a", self.mesh))
            return program.trace(*args).lower(lowering_platforms=(platform,))

    def _run(self, name: str, *args):
        executable = self._executables.get(name)
        if executable is None:
            executable = self._executables[name] = self._executable(name, *args)
        return executable(*args)

    # ----- state ---------------------------------------------------------------

    def _init(self, key_data):
        key = jax.random.wrap_key_data(key_data)
        rngs = nnx.Rngs(key)
        model = converted(Transformer(self.model_cfg, rngs=rngs, layers=self.layers), self.converter, rngs)
        params = self.laid_out(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        state = {"params": params, "step": jnp.zeros((), jnp.int32), "rng": key_data,
                 "nonfinite": jnp.zeros((), jnp.int32)}
        if self.tx is not None:
            state["opt_state"] = self.tx.init(self.split(params)[0])
        if self.keeps_reference:
            state["reference"] = jax.tree.map(jnp.copy, params)
        return state

    def with_start(self, state: dict, params: dict) -> dict:
        """`state` starting from `params` (a fine-tune's initial weights): the frozen reference too."""
        state = dict(state, params=params)
        if self.keeps_reference:
            state["reference"] = self._run("copy", params)
        return state

    def reference(self, params: dict, kept: dict | None = None) -> dict | None:
        """The parameters of the objective's reference model: a converted model's with its additions
        off (LoRA: its base), else `kept`, the frozen copy in the state; None if it needs none."""
        if not self.objective.needs_reference:
            return None
        if self.keeps_reference:
            return kept
        trained, frozen = self.split(params)
        return self.join(self.converter.off(trained), frozen)

    @property
    def saves_base(self) -> bool:
        """Whether checkpoints hold the frozen base too, or the trained parameters only (a
        converter's choice: `lora.save_base`)."""
        return self.converter is None or self.converter.saves_base

    def saved(self, state: dict) -> dict:
        """What a checkpoint of `state` holds (abstract states too): all of it, or without its frozen
        base (`lora.save_base: false`) the trained parameters in place of all of them."""
        return state if self.saves_base else {**state, "params": self.split(state["params"])[0]}

    def split(self, params) -> tuple[dict, dict]:
        """`(trained, frozen)`: the parameters the optimiser moves (all but a converted model's frozen
        base), and the rest."""
        if self.trained is None:
            return params, {}
        flat = traversals.flatten_mapping(params)
        pick = lambda keep: traversals.unflatten_mapping(  # noqa: E731
            {k: v for k, v in flat.items() if (k in self.trained) == keep})
        return pick(True), pick(False)

    @staticmethod
    def join(trained: dict, frozen: dict) -> dict:
        """The whole parameter tree from `split`'s two parts."""
        if not frozen:
            return trained
        return traversals.unflatten_mapping({**traversals.flatten_mapping(frozen),
                                                 **traversals.flatten_mapping(trained)})

    def _convert(self, base, key_data):
        model = nnx.merge(abstract_params(self.model_cfg)[0], base)
        if self.converter is not None:
            self.converter.convert(model, nnx.Rngs(jax.random.wrap_key_data(key_data)))
        return self.laid_out(nnx.to_pure_dict(nnx.state(model, nnx.Param)))

    def abstract_base(self) -> dict:
        """ShapeDtypeStructs (with shardings) of the base model's parameters: what a fine-tune
        starts from (the whole model, or a converted model's plain base: LoRA's before its adapters
        and quantization)."""
        _, abstract = abstract_params(self.model_cfg)
        shardings = nnx.to_pure_dict(state_shardings(abstract, self.mesh, self.rules))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            nnx.to_pure_dict(abstract), shardings)

    def from_base(self, base: dict, seed: int) -> dict:
        """The run's parameters from its base's (placed as `abstract_base`), converted: LoRA adds its
        adapters (B zero: the model starts equal to its base) and quantizes the frozen projections."""
        if self.converter is None and self.rounds == 1:
            return base
        return self._run("convert", base, jax.random.key_data(jax.random.key(seed)))

    def init_state(self, seed: int) -> dict:
        """Fresh parameters and optimiser state, created directly with their shardings."""
        return self._run("init", jax.random.key_data(jax.random.key(seed)))

    def abstract_state(self) -> dict:
        """ShapeDtypeStructs (with shardings) of the train state, to restore a checkpoint into."""
        shapes = jax.eval_shape(self._init, jax.random.key_data(jax.random.key(0)))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                            self.state_shardings)

    def model(self, params) -> Transformer:
        """The model of `params` (the run's state's: its stacks in the model's layout again)."""
        return nnx.merge(self.graphdef, self.model_params(params))

    def model_params(self, params: dict) -> dict:
        """The run's parameters in the model's layout (`training.layout`)."""
        return layout.to_model(params, self.stacked, self.rounds)

    def laid_out(self, params: dict) -> dict:
        """The model's parameters (a pure dict) as the run holds them (`training.layout`)."""
        return layout.to_layout(params, self.stacked, self.rounds)

    def all_finite(self, tree) -> bool:
        return bool(self._jitted["finite"](tree))

    # ----- steps ---------------------------------------------------------------

    def _loss(self, params, batch, rng, reference=None):
        """The objective's sums over `batch` (against the `reference` parameters if it needs them)
        and what the layers sowed."""
        cfg, objective = self.cfg, self.objective
        dropout_rng = rng if self.uses_dropout else None
        # the reference's forward, outside the policy's capture
        prepared = objective.prepare(None if reference is None else self.model(reference), batch,
                                     chunk=cfg.loss_vocab_chunk)

        def sums_of(model):
            return objective.sums(model, batch, prepared, chunk=cfg.loss_vocab_chunk, dropout_rng=dropout_rng,
                                  diagnostics=cfg.diagnostics)

        sums, sown = nnx.capture(sums_of, nnx.Intermediate)(self.model(params))
        zero = jnp.zeros((), jnp.float32)
        # what the layers sowed: a mixture of experts' balance and z-losses, drops and loads
        aux = {name: sown_value(sown, name) for name in (AUX_LOSS,) + ((ROUTER_Z_LOSS, DROPPED, LOAD) if self.moe
                                                                       else ())}
        aux = {name: zero if value is None else value for name, value in aux.items()}
        if cfg.diagnostics:  # sown by the attention layers of this very forward pass
            max_logit = max_attention_logit(sown)
            sums = dict(sums, max_attention_logit=zero if max_logit is None else max_logit)
        return sums, aux

    def _step(self, state, batch):
        cfg = self.cfg
        params, frozen = self.split(state["params"])  # `params`: what is trained
        reference = self.reference(state["params"], state.get("reference"))
        batch = self.objective.complete(batch)
        denom = self.objective.denominator(batch)
        step_rng = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])

        def objective(params, micro, rng):
            sums, aux = self._loss(self.join(params, frozen), micro, rng, reference)
            loss = self.objective.loss(sums, denom) + cfg.moe_aux_weight * aux[AUX_LOSS]
            if self.moe:
                loss = loss + cfg.moe_router_z_weight * aux[ROUTER_Z_LOSS]
            return loss, (sums, aux)

        if self.one_f_one_b:
            def grad_fn(params, micro, rng):
                return staged_grads.value_and_grad(self, params, frozen, micro, rng, reference, denom)
        else:
            grad_fn = jax.value_and_grad(objective, has_aux=True)
        n_micro = batch["inputs"].shape[0]
        batch_0 = jax.tree.map(lambda x: x[0], batch)
        if n_micro == 1:
            (loss, (sums, aux)), grads = grad_fn(params, batch_0, step_rng)
        else:  # gradient accumulation: the micro-batches' gradients add up to the full batch's
            zero = jnp.zeros((), jnp.float32)
            sums0, aux0 = jax.tree.map(jnp.zeros_like, jax.eval_shape(
                lambda: self._loss(self.join(params, frozen), batch_0, step_rng, reference)))
            init = (zero, sums0, aux0, jax.tree.map(jnp.zeros_like, params))

            def micro_step(carry, xs):
                micro, i = xs
                return _accumulate(carry, grad_fn(params, micro, jax.random.fold_in(step_rng, i)), n_micro,
                                   self.objective.maxima), None

            (loss, sums, aux, grads), _ = jax.lax.scan(micro_step, init, (batch, jnp.arange(n_micro)),
                                                       unroll=not self.execution.scan_layers)

        grad_norm = global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        # the schedule follows the step counter: a skipped step consumes its learning rate as
        # it consumes its batch, and the run ends at the schedule's final value
        lr = self.schedule(state["step"])

        def update(params, opt_state):
            direction, opt_state = self.tx.update(grads, opt_state, params, grad_norm=grad_norm)  # AdamW at lr 1
            params = self.join(optax.apply_updates(params, jax.tree.map(lambda u: u * lr.astype(u.dtype), direction)),
                               frozen)
            if cfg.moe_bias_update_rate:  # auxiliary-loss-free balancing, from this step's loads
                model = self.model(params)
                model.balance_routers(aux[LOAD], cfg.moe_bias_update_rate)
                params = self.laid_out(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
            return params, opt_state

        # a non-finite step changes nothing (and costs no optimiser update)
        new_params, new_opt_state = jax.lax.cond(finite, update, lambda p, o: (self.join(p, frozen), o), params,
                                                 state["opt_state"])
        new_state = {
            **state,
            "params": new_params,
            "opt_state": new_opt_state,
            "step": state["step"] + 1,
            "nonfinite": jnp.where(finite, 0, state["nonfinite"] + 1),
        }
        metrics = {
            **self.objective.metrics(sums, denom),  # `loss`, `z_loss`, then the objective's own names
            "moe_aux_loss": aux[AUX_LOSS],
            "grad_norm": grad_norm,
            "lr": jnp.where(finite, lr, 0.0),  # what was applied: nothing on a skipped step
            "max_abs_logit": sums["max_abs_logit"],
            "finite": finite,
            "nonfinite_streak": new_state["nonfinite"],
        }
        if cfg.diagnostics:
            metrics["max_attention_logit"] = sums["max_attention_logit"]
        if self.moe:
            load_LE = aux[LOAD]
            mean_L = jnp.maximum(jnp.mean(load_LE, axis=-1), 1e-9)
            metrics.update({"moe_router_z_loss": aux[ROUTER_Z_LOSS], "moe_dropped": aux[DROPPED],
                            "moe_load_max": jnp.max(load_LE, axis=-1) / mean_L,  # per MoE layer, / the mean load
                            "moe_load_min": jnp.min(load_LE, axis=-1) / mean_L})
        return new_state, metrics

    def train_step(self, state, batch):
        """`(state, batch [A, B, T] arrays) -> (new state, metrics)`; `state` is donated."""
        return self._run("train", state, batch)

    def _eval(self, params, batch, token_bytes, reference):
        micro = jax.tree.map(lambda x: x[0], self.objective.complete(batch))
        reference = self.reference(params, reference)
        prepared = self.objective.prepare(None if reference is None else self.model(reference), micro,
                                          chunk=self.cfg.loss_vocab_chunk)
        return self.objective.eval_sums(self.model(params), micro, prepared, token_bytes,
                                        chunk=self.cfg.loss_vocab_chunk)

    def eval_step(self, params, batch, token_bytes, reference=None):
        """The objective's evaluation sums over one batch (`objective.eval_sums`); `token_bytes`: each
        token id's bytes (bits per byte); `reference`: the state's frozen copy where it keeps one."""
        return self._run("eval", params, batch, token_bytes, reference)

    def eval_executable(self, params, batch, token_bytes, reference=None):
        """The evaluation step compiled for these arguments (abstract ones will do), without running
        it: `eval_step` runs the one compiled last (its `memory_analysis()` is XLA's count)."""
        self._executables["eval"] = self._executable("eval", params, batch, token_bytes, reference)
        return self._executables["eval"]

    def compile(self, state, batch: dict, eval_batch: dict | None = None, token_bytes=None) -> float:
        """Compile the steps for these shapes now (returns seconds), so timing excludes it."""
        import time

        start = time.perf_counter()
        self._executables["train"] = self._executable("train", state, batch)
        if eval_batch is not None:
            self.eval_executable(state["params"], eval_batch, token_bytes, state.get("reference"))
        return time.perf_counter() - start


def trainer_for(run: RunConfig, mesh: Mesh, *, objective: Objective | None = None, execution: ExecutionConfig | None = None,
                layers: tuple[LayerSpec, ...] | None = None, optimizer: bool = True) -> Trainer:
    """The one way to build a run's Trainer on `mesh`: its model, objective, adapters, rules and
    strategies, from `run`. `objective`: the run's own, when already made; `execution`: another
    than the run's (the planner's host estimate); `layers`: fewer blocks (the planner's counting
    programs); `optimizer=False`: no optimiser or its state (evaluation, sampling)."""
    return Trainer(run.model, run.train, mesh, rules=run.parallel.rules_table(),
                   context_layout=run.parallel.context_layout, strategies=run.parallel,
                   execution=execution or run.execution, converter=converter_of(run.lora),
                   objective=objective or objective_of(run.objective, run.train), layers=layers, optimizer=optimizer)


def describe_kernels(kernels: dict[str, set[str]]) -> str:
    """`attention pallas_tpu, norm pallas, moe_grouped megablox`: what the dispatches chose."""
    return ", ".join(f"{kind} {'/'.join(sorted(impls))}" for kind, impls in sorted(kernels.items())) or "none"


_MAXIMA = ("max_abs_logit", "max_attention_logit")


def _accumulate(carry, result, n_micro, maxima=()):
    """Add one micro-batch's loss, sums and gradients (the max |logit|s and the objective's `maxima`
    take the max; the losses a model sows are means over the micro-batches, its drops and loads sums)."""
    (loss, (sums, aux)), grads = result
    c_loss, c_sums, c_aux, c_grads = carry
    new_sums = {k: (jnp.maximum if k in _MAXIMA + tuple(maxima) else jnp.add)(c_sums[k], sums[k]) for k in c_sums}
    new_aux = {k: c_aux[k] + (aux[k] if k in (DROPPED, LOAD) else aux[k] / n_micro) for k in c_aux}
    return c_loss + loss, new_sums, new_aux, jax.tree.map(jnp.add, c_grads, grads)


__all__ = ["Trainer", "describe_kernels", "trainer_for"]
