"""Model converters: what turns the plain `Transformer` into the model a run trains.

A converter is given a plain model (`convert`, in place) and says what that changes for a run:
which parameters train (`trains`; the rest are frozen, with no gradient and no optimiser
state), whether checkpoints hold the whole model or the trained parameters only
(`saves_base`), the model with its additions off (`off`: an objective's reference), how its
additions merge into a plain model of the same config (`merged`), and which of them a dropout
does not reach (`undropped`). The model and its layers know nothing of any converter.

LoRA (the `lora:` section, `modern_jax.lora_config.LoRAConfig`; QLoRA is LoRA with `quantize`) gives
each projection that `targets` names an adapter, `W x + (alpha / r) B A dropout(x)`, with A
`[in..., r]` and B `[r, out...]` initialised as PEFT does (B zero: the converted model equals its
base), and with `quantize` stores every projection in the blocks quantized (`layers.linear.
Quantized`; routers excepted). A mixture's experts (and routers) take their adapter into the
weight itself, as PEFT does for experts, which has no input of its own to drop out. An adapted
projection is its plain class's subclass (`AdaptedProj`, `AdaptedExpertProj`) with an
`adapter`: the parameters keep their paths, and the adapter's are `...q_proj.adapter.lora_a`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import traversals

from modern_jax.layers.linear import Proj, Quantized, module_dropout_key
from modern_jax.layers.moe import ExpertProj
from modern_jax.lora_config import LoRAConfig
from modern_jax.model import Transformer, abstract_params, projections
from modern_jax.ops import quant


class LoRAParam(nnx.Param):
    """An adapter's weight: what a LoRA run trains (every other `nnx.Param` stays frozen)."""


def _axes(variable) -> tuple:
    return tuple(variable.get_metadata()["out_sharding"])


class Adapter(nnx.Module):
    """`(alpha / r) B A x`: A `[lead..., in..., r]`, B `[lead..., r, out...]` (lead: stacked layers,
    experts), initialised as PEFT does: A uniform in +-1/sqrt(in) (torch's Linear default), B zero,
    so an adapted model starts equal to its base."""

    def __init__(self, kernel, in_dims: int, out_dims: int, lora: LoRAConfig, salt: int, rngs: nnx.Rngs):
        shape, axes = tuple(kernel.shape), _axes(kernel)
        lead = len(shape) - in_dims - out_dims
        ins, outs = slice(lead, lead + in_dims), slice(lead + in_dims, None)
        bound = 1.0 / math.sqrt(math.prod(shape[ins]))
        a_shape, b_shape = (*shape[:lead], *shape[ins], lora.rank), (*shape[:lead], lora.rank, *shape[outs])
        self.lora_a = LoRAParam(jax.random.uniform(rngs.params(), a_shape, jnp.float32, -bound, bound),
                                out_sharding=(*axes[:lead], *axes[ins], None), eager_sharding=False)
        self.lora_b = LoRAParam(jnp.zeros(b_shape, jnp.float32), out_sharding=(*axes[:lead], None, *axes[outs]),
                                eager_sharding=False)
        self.scale, self.dropout, self.salt, self.in_dims = lora.scale, lora.dropout, salt, in_dims

    def delta(self, dtype):
        """`scale A B`, the adapter as a weight `[lead..., in..., out...]` in `dtype`."""
        a, b = self.lora_a[...], self.lora_b[...]
        a = a.reshape(*a.shape[:a.ndim - 1 - self.in_dims], -1, a.shape[-1])  # [lead..., in, r]
        lead = a.shape[:-2]
        b2 = b.reshape(*lead, b.shape[len(lead)], -1)  # [lead..., r, out]
        w = jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b2.astype(jnp.float32)) * self.scale
        return w.reshape(*self.lora_a.shape[:-1], *b.shape[len(lead) + 1:]).astype(dtype)

    def __call__(self, equation: str, x):
        """`scale B A dropout(x)` for a projection applied as `equation` (`x, kernel -> y`)."""
        key = module_dropout_key()
        if self.dropout and key is not None:
            keep = jax.random.bernoulli(jax.random.fold_in(key, self.salt), 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
        ins, out = equation.split("->")
        x_letters, w_letters = ins.split(",")
        contracted, kept = w_letters[:self.in_dims], w_letters[self.in_dims:]
        rows = x_letters[:-len(contracted)]  # batch, tokens
        if not (x_letters.endswith(contracted) and out == rows + kept and rows.isalpha()):
            raise ValueError(f"an adapter reads its projection's equation as rows, then the contracted dims, "
                             f"giving rows, then the kept dims; {equation!r} is not such an equation")
        a, b = self.lora_a[...].astype(x.dtype), self.lora_b[...].astype(x.dtype)
        # the rows as one axis: the backward's products A^T x and (A x)^T g then contract over one axis,
        # and XLA does not transpose x and g (a row-sized copy each) for them
        x_NI = x.reshape(-1, a.size // a.shape[-1])
        h_NR = (x_NI @ a.reshape(-1, a.shape[-1])) * jnp.asarray(self.scale, x.dtype)
        return (h_NR @ b.reshape(b.shape[0], -1)).reshape(*x.shape[:len(rows)], *b.shape[1:])


class AdaptedProj(Proj):
    """A projection with an adapter on its input: `W x + scale B A dropout(x)`."""

    adapter: Adapter

    def weight(self, dtype):
        """The kernel as it acts (for layers that read the weight itself: a router, MLA's absorbed
        `kv_b_proj`): dequantized, plus `scale A B`."""
        return super().weight(dtype) + self.adapter.delta(dtype)

    def apply(self, equation: str, x):
        return super().apply(equation, x) + self.adapter(equation, x)


class AdaptedExpertProj(ExpertProj):
    """A mixture's stacked expert projections with an adapter per expert, added to the weight."""

    adapter: Adapter

    def weight(self, dtype):
        return super().weight(dtype) + self.adapter.delta(dtype)

    def acting(self, dtype):
        return self.weight(dtype)


ADAPTED = {Proj: AdaptedProj, ExpertProj: AdaptedExpertProj}
MERGED_SITES = (ExpertProj,)  # adapters added to the weight itself (no input to drop out)


class Converter:
    """The interface of a model converter (the module docstring), and the plain model's: nothing
    is converted, everything trains, checkpoints hold the whole model."""

    trains_all: bool = True  # every parameter trains (no frozen base)
    saves_base: bool = True  # checkpoints hold the whole model, not the trained parameters only
    dropout: float = 0.0  # a dropout of the converter's own additions

    def convert(self, model: Transformer, rngs: nnx.Rngs) -> Transformer:
        """`model` converted, in place; returns it."""
        return model

    def trains(self, variable) -> bool:
        """Whether the parameter `variable` trains (the others stay frozen)."""
        return True

    def off(self, trained: dict) -> dict:
        """The trained parameters of the model with its additions off (an objective's reference)."""
        raise NotImplementedError("the plain model has no additions to turn off")

    def merged(self, model: Transformer) -> Transformer:
        """The model as a plain one of its config (what `convert --to-hf` writes)."""
        return model

    def sampling(self, model: Transformer) -> Transformer:
        """The model that samples for `model` (an objective's rollouts): the same function, in the
        fewest operations a token."""
        return model

    def notes(self, model: Transformer) -> list[str]:
        """What a run should be told of how `model` was converted."""
        return []


PLAIN = Converter()


class LoRA(Converter):
    """The LoRA / QLoRA converter of a `lora:` section (the module docstring)."""

    trains_all = False

    def __init__(self, config: LoRAConfig):
        self.config = config

    @property
    def saves_base(self) -> bool:
        """Whether checkpoints hold the frozen base too (`lora.save_base`), or the adapters only."""
        return self.config.save_base

    @property
    def dropout(self) -> float:
        return self.config.dropout

    @staticmethod
    def trains(variable) -> bool:
        return isinstance(variable, LoRAParam)

    def convert(self, model: Transformer, rngs: nnx.Rngs) -> Transformer:
        """Give the projections `lora.targets` names adapters (B zero: the model is unchanged) and,
        with `lora.quantize`, store every projection in the blocks quantized (routers excepted: the
        choice of experts stays in the base's precision). In place; returns `model`."""
        lora = self.config
        names = sorted({name for name, *_ in projections(model)})
        for target in lora.targets:
            if not any(LoRAConfig(targets=(target,)).matches(name) for name in names):
                raise ValueError(f"lora.targets: {target!r} names no projection of this model (its projections: "
                                 f"{', '.join(names)}; or all-linear)")
        for salt, (name, module, _, _) in enumerate(projections(model)):
            router = isinstance(module, Proj) and name.endswith("router.proj")
            if lora.matches(name):
                merged_site = isinstance(module, MERGED_SITES) or router
                # its adapter is added to the weight: no input of its own to drop out. A target that names it by
                # its path asked for that dropout, and is refused; a name every family shares, or all-linear,
                # gives the dropout to the projections it can reach (`undropped` names the others)
                named = [t for t in lora.targets if "." in t and LoRAConfig(targets=(t,)).matches(name)]
                if lora.dropout and merged_site and named:
                    raise ValueError(f"lora.dropout={lora.dropout} cannot apply to {name} (lora.targets names it: "
                                     f"{named[0]!r}): its adapter is added to the weight itself (as PEFT does for "
                                     f"experts), which has no input of its own to drop out: set lora.dropout=0, or "
                                     f"leave it out of lora.targets")
                adapter = Adapter(module.kernel, module.in_dims, module.out_dims,
                                  dataclasses.replace(lora, dropout=0.0) if merged_site else lora, salt, rngs)
                module.__class__ = ADAPTED[next(c for c in ADAPTED if isinstance(module, c))]
                module.adapter = adapter
            if lora.quantize != "none" and not router:
                out = math.prod(module.kernel.shape[module.kernel.ndim - module.out_dims:])
                if out % quant.BLOCK:
                    raise ValueError(f"lora.quantize={lora.quantize!r} quantizes each projection's outputs in blocks "
                                     f"of {quant.BLOCK}, and {name} has {out}: use lora.quantize=none for this model")
                module.kernel = Quantized(module.kernel, module.out_dims, lora.quantize)
        return model

    @staticmethod
    def off(trained: dict) -> dict:
        """The trained parameters of the model with its adapters off (every one zero: `B A` = 0),
        so that joined to the frozen ones they make the base (an objective's reference)."""
        return jax.tree.map(jnp.zeros_like, trained)

    @staticmethod
    def adapted(model: Transformer):
        """`(name inside its block, module, stage, block index)` of every adapted projection."""
        return [(name, module, s, j) for name, module, s, j in projections(model)
                if isinstance(module, tuple(ADAPTED.values()))]

    def merged(self, model: Transformer) -> Transformer:
        """The model as a plain one of its config: each adapter added into its (dequantized) weight,
        in `param_dtype` (what `convert --to-hf` of a LoRA run writes)."""
        graphdef, _ = abstract_params(model.cfg)
        flat = traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        plain = {k: v for k, v in flat.items() if k[0] != "stages" or ("adapter" not in k and "kernel" not in k)}
        dtype = jnp.dtype(model.cfg.param_dtype)
        for name, module, s, j in projections(model):
            plain[("stages", s, "blocks", j, *name.split("."), "kernel")] = module.weight(dtype)
        return nnx.merge(graphdef, traversals.unflatten_mapping(plain))

    def sampling(self, model: Transformer) -> Transformer:
        """`merged`: each adapter in its weight, so that a decoding step runs the plain model's products
        (about 0.87x the rollouts' time of a 24M model, docs/benchmarks.md); a quantized base stays as it
        is (merged, it would be held again in `param_dtype`)."""
        return model if self.config.quantize != "none" else self.merged(model)

    def undropped(self, model: Transformer) -> list[str]:
        """The adapted projections that `lora.dropout` does not reach: a mixture's experts and
        routers, whose adapters are added to their weights."""
        if not self.config.dropout:
            return []
        return sorted({name for name, module, _, _ in self.adapted(model) if not module.adapter.dropout})

    def notes(self, model: Transformer) -> list[str]:
        skipped = self.undropped(model)
        if not skipped:
            return []
        return [f"lora.dropout={self.config.dropout}: on the inputs of the adapted projections but "
                f"{', '.join(skipped)}, whose adapters are added to their weights (no input of their own to drop out)"]


def converter_of(run) -> Converter:
    """The converter a run (a RunConfig) asks for: its `lora:` section's, else the plain model's."""
    return PLAIN if run.lora is None else LoRA(run.lora)


def saved_converter(raw: dict) -> Converter:
    """The converter of a saved run, from its run file's contents (`config.yaml`)."""
    lora = LoRAConfig.of_run(raw)
    return PLAIN if lora is None else LoRA(lora)


def abstract_converted(cfg, converter: Converter, layers=None) -> tuple:
    """`(graphdef, parameters as ShapeDtypeStructs)` of the converted model of `cfg`."""
    model = nnx.eval_shape(lambda: converter.convert(Transformer(cfg, rngs=nnx.Rngs(0), layers=layers),
                                                     nnx.Rngs(0)))
    return nnx.split(model, nnx.Param)


def resume_changes(saved: dict, run) -> list[str]:
    """What keeps a run (a RunConfig) from resuming checkpoints saved under the run file `saved`
    (its contents): another converter, or the same with another meaning (every `lora:` field but
    dropout may change); none if nothing."""
    there, here = saved.get("lora"), None if run.lora is None else run.lora.to_dict()
    if isinstance(there, dict) and here is not None:
        return [f"lora.{k} is {v!r} there, {here.get(k)!r} here" for k, v in there.items()
                if k != "dropout" and here.get(k) != v]
    return [] if (there is None) == (here is None) else [
        "a lora: section there, none here" if here is None else "no lora: section there, one here"]


def with_adapter_config(run, found: LoRAConfig, adapter) -> LoRAConfig:
    """The `lora:` section of a run that starts from the PEFT adapter `adapter` (its config `found`,
    its targets mapped already): the adapter's rank, alpha and projections, the run's dropout and
    quantization; a rank or alpha of the run's own that disagrees is refused."""
    if run.lora is None:
        return found
    for name in ("rank", "alpha"):
        if getattr(run.lora, name) != getattr(found, name):
            raise ValueError(f"lora.{name}={getattr(run.lora, name)} disagrees with the adapter --init-adapter "
                             f"{adapter} ({name} {getattr(found, name)}): remove lora.{name}, or give the "
                             f"adapter's")
    return dataclasses.replace(found, dropout=run.lora.dropout, quantize=run.lora.quantize)
