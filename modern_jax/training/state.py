"""A run's train state: built fresh, abstract (to restore a checkpoint into), from a base model,
with a starting point; and which of its parameters train and which a checkpoint saves.

The train state is a plain pytree of arrays:

    params     the model's parameters as a pure dict (`nnx.to_pure_dict`), float32 masters, in the
               run's layout (`training.layout`: an interleaved pipeline's rounds)
    opt_state  optax's state over the trained parameters (absent where nothing trains)
    step       int32, optimiser steps taken (skipped non-finite steps included)
    rng        uint32[2], the run's base key; step `s` uses `fold_in(rng, s)`
    nonfinite  int32, non-finite steps in a row
    reference  a frozen copy of the starting parameters, where the objective compares against
               one and the converter has no other (LoRA's is its base with the adapters off)

Parameter shardings come from each parameter's logical axes through the rules table
(`sharding.state_shardings`). The programs that make the state (`init`, `convert`, `copy`,
`finite`) compile on the run's `Programs`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx import traversals

from modern_jax.config import LayerSpec, ModelConfig
from modern_jax.model import Transformer, abstract_params
from modern_jax.ops import pipeline
from modern_jax.sharding import logical_rules, state_shardings
from modern_jax.training import layout
from modern_jax.training.converters import Converter, abstract_converted
from modern_jax.training.programs import Programs


class StateBuilder:
    """The train state of one converted model on one `Programs`' mesh (the module docstring).

    `tx`: the optimiser (None: a state without optimiser state, to evaluate or sample);
    `needs_reference`: the objective compares against a frozen model; `layers`: the blocks built
    (default: the config's; the planner's counting programs build fewer)."""

    def __init__(self, model_cfg: ModelConfig, programs: Programs, converter: Converter, *, tx=None,
                 needs_reference: bool = False, layers: tuple[LayerSpec, ...] | None = None):
        self.model_cfg, self.programs, self.converter, self.tx, self.layers = \
            model_cfg, programs, converter, tx, layers
        self.graphdef, abstract = abstract_converted(model_cfg, converter, layers)
        self.abstract_params = abstract  # the converted model's parameters, as ShapeDtypeStructs
        # the stacks as the run holds them: laid out for an interleaved pipeline's rounds (`layout`)
        self.rounds = programs.strategies.stage_repeats if programs.stages > 1 else 1
        with logical_rules(programs.mesh, programs.rules, programs.strategies):  # the stacks over the stages, if any
            for stack in nnx.merge(self.graphdef, abstract).stages:
                pipeline.check_depth(stack.repeats, f"the stack of layers {stack.first} .. "
                                                    f"{stack.first + stack.repeats * len(stack.unit) - 1}")
        self.stacked = layout.stacked(abstract)
        # a converted model trains what its converter says (LoRA: the adapters); the rest is frozen,
        # with no gradient and no optimiser state
        self.trained = None if converter.trains_all else {path for path, v in nnx.to_flat_state(abstract)
                                                          if converter.trains(v)}
        self.needs_reference = needs_reference
        self.keeps_reference = needs_reference and converter.trains_all  # else the converter's `off`
        replicated = programs.replicated
        abstract = layout.laid_out(abstract, self.rounds)
        params_sh = nnx.to_pure_dict(state_shardings(abstract, programs.mesh, programs.rules))
        self.shardings = {"params": params_sh, "step": replicated, "rng": replicated, "nonfinite": replicated}
        if tx is not None:
            opt_abstract = jax.eval_shape(tx.init, self.split(nnx.to_pure_dict(abstract))[0])
            # each copy of the parameters in it sharded as they are (a partition's masked ones stay masked)
            self.shardings["opt_state"] = optax.tree_map_params(
                tx, lambda v, s: v if isinstance(v, optax.MaskedNode) else s, opt_abstract, self.split(params_sh)[0],
                transform_non_params=lambda _: replicated, is_leaf=lambda v: isinstance(v, optax.MaskedNode))
        if self.keeps_reference:
            self.shardings["reference"] = params_sh
        programs.define("init", self._init, out_shardings=self.shardings)
        programs.define("convert", self._convert, out_shardings=params_sh)
        programs.define("copy", lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=params_sh)
        programs.define("finite", lambda tree: jnp.all(jnp.stack([jnp.isfinite(x).all()
                                                                  for x in jax.tree.leaves(tree)])))

    # ----- building --------------------------------------------------------------

    def _init(self, key_data):
        rngs = nnx.Rngs(jax.random.wrap_key_data(key_data))
        model = self.converter.convert(Transformer(self.model_cfg, rngs=rngs, layers=self.layers), rngs)
        params = self.laid_out(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        state = {"params": params, "step": jnp.zeros((), jnp.int32), "rng": key_data,
                 "nonfinite": jnp.zeros((), jnp.int32)}
        if self.tx is not None:
            state["opt_state"] = self.tx.init(self.split(params)[0])
        if self.keeps_reference:
            state["reference"] = jax.tree.map(jnp.copy, params)
        return state

    def init(self, seed: int) -> dict:
        """Fresh parameters and optimiser state, created directly with their shardings."""
        return self.programs.run("init", jax.random.key_data(jax.random.key(seed)))

    def abstract(self) -> dict:
        """ShapeDtypeStructs (with shardings) of the train state, to restore a checkpoint into."""
        shapes = jax.eval_shape(self._init, jax.random.key_data(jax.random.key(0)))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                            self.shardings)

    def with_start(self, state: dict, params: dict) -> dict:
        """`state` starting from `params` (a fine-tune's initial weights): the frozen reference too."""
        state = dict(state, params=params)
        if self.keeps_reference:
            state["reference"] = self.programs.run("copy", params)
        return state

    def _convert(self, base, key_data):
        model = nnx.merge(abstract_params(self.model_cfg)[0], base)
        self.converter.convert(model, nnx.Rngs(jax.random.wrap_key_data(key_data)))
        return self.laid_out(nnx.to_pure_dict(nnx.state(model, nnx.Param)))

    def abstract_base(self) -> dict:
        """ShapeDtypeStructs (with shardings) of the base model's parameters: what a fine-tune
        starts from (the whole model, or a converted model's plain base: LoRA's before its adapters
        and quantization)."""
        _, abstract = abstract_params(self.model_cfg)
        shardings = nnx.to_pure_dict(state_shardings(abstract, self.programs.mesh, self.programs.rules))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            nnx.to_pure_dict(abstract), shardings)

    def from_base(self, base: dict, seed: int) -> dict:
        """The run's parameters from its base's (placed as `abstract_base`), converted: LoRA adds its
        adapters (B zero: the model starts equal to its base) and quantizes the frozen projections."""
        if self.converter.trains_all and self.rounds == 1:
            return base
        return self.programs.run("convert", base, jax.random.key_data(jax.random.key(seed)))

    def all_finite(self, tree) -> bool:
        return bool(self.programs.run("finite", tree))

    # ----- what trains, what is saved ---------------------------------------------

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

    def saved(self, state: dict) -> dict:
        """What a checkpoint of `state` holds (abstract states too): all of it, or, where the
        converter leaves the frozen base out (`lora.save_base: false`), the trained parameters in
        place of all of them."""
        return state if self.converter.saves_base else {**state, "params": self.split(state["params"])[0]}

    def reference(self, params: dict, kept: dict | None = None) -> dict | None:
        """The parameters of the objective's reference model: a converted model's with its additions
        off (LoRA: its base), else `kept`, the frozen copy in the state; None if it needs none."""
        if not self.needs_reference:
            return None
        if self.keeps_reference:
            return kept
        trained, frozen = self.split(params)
        return self.join(self.converter.off(trained), frozen)

    # ----- the model of a state -----------------------------------------------------

    def model(self, params) -> Transformer:
        """The model of `params` (the run's state's: its stacks in the model's layout again)."""
        return nnx.merge(self.graphdef, self.model_params(params))

    def sampling_model(self, params) -> Transformer:
        """The model that samples for `params` (`Converter.sampling`: a LoRA run's adapters merged)."""
        return self.converter.sampling(self.model(params))

    def model_params(self, params: dict) -> dict:
        """The run's parameters in the model's layout (`training.layout`)."""
        return layout.to_model(params, self.stacked, self.rounds)

    def laid_out(self, params: dict) -> dict:
        """The model's parameters (a pure dict) as the run holds them (`training.layout`)."""
        return layout.to_layout(params, self.stacked, self.rounds)


__all__ = ["StateBuilder"]
