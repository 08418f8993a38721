"""The `parallel:` section of a run file: the mesh and overrides of the logical-axis rules.

    parallel:
      data: -1          # -1: every device left over (one axis at most)
      fsdp: 1
      expert: 1         # splits a mixture's experts; data parallelism everywhere else
      context: 1        # splits the sequence (context parallelism) and, like fsdp, the weights
      context_layout: two_chunk   # the sequence's order over the context axis (causal load balance)
      context_strategy: all_gather  # attention over the context axis: keys gathered, or a ring
      moe_exchange: all_to_all    # experts split over `expert`: tokens swapped (slots), all-gathered, or ragged
      moe_exchange_factor: null   # the exchange's room per destination; null: room for all, no drops
      tensor: 4
      stage: 1          # pipeline stages: the layers split over them (outermost: across hosts or slices)
      microbatches: 1   # a batch's microbatches through the stages (at least stage with interleaved)
      pipeline_schedule: gpipe    # gpipe | 1f1b | interleaved (stage_repeats stages a device, MaxText's circular)
      stage_repeats: 1  # interleaved: each device holds this many stages, visited in turn
      rules:            # entries replacing those of `sharding.RULES`
        embed: null     #   e.g. no FSDP of the model dimension
        mlp: [fsdp, tensor]

`modern-jax train --mesh data=2,tensor=4` and dotted overrides (`parallel.tensor=4`,
`parallel.rules.embed=null`) set the same fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass, field

from modern_jax.configfile import check_keys, fail
from modern_jax.sharding.mesh import AXES, make_mesh
from modern_jax.sharding.rules import RENAMED, RULES


_fail = functools.partial(fail, "ParallelConfig")

# How a training sequence is laid out over the context axis (C devices). Causal attention gives
# the later positions more keys, so the contiguous split leaves the last device the most work;
# `two_chunk` cuts the sequence in 2C chunks and gives device i chunks i and 2C - 1 - i,
# `striped` gives device i positions i, i + C, i + 2C, ... Our masks are positions and segment
# ids, so the order of the tokens changes no number (`layout_order`).
CONTEXT_LAYOUTS = ("two_chunk", "striped", "contiguous")

# The strategies of the axes that communicate inside a layer: one name each, read by the op that
# implements it (`ops.attention`, `ops.moe`) from the active `sharding.context.strategies()`.
CONTEXT_STRATEGIES = ("all_gather", "ring")  # attention over a context axis: keys gathered, or a ring
MOE_EXCHANGES = ("all_to_all", "all_gather", "ragged_all_to_all")  # tokens to the devices of their experts
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")  # the order of the microbatches through the stages (`ops.pipeline`)


@dataclass(frozen=True)
class Strategies:
    """How the axes that communicate inside a layer do it: what the ops read. A new strategy is a
    field here (and its op function); `ParallelConfig` is a `Strategies`, so the run file, the
    overrides and the saved `parallel:` section have it too."""

    context_strategy: str = "all_gather"
    moe_exchange: str = "all_to_all"
    moe_exchange_factor: float | None = None  # exchange room per destination; None: room for all, no drops
    microbatches: int = 1  # a batch's microbatches through the pipeline stages
    pipeline_schedule: str = "gpipe"
    stage_repeats: int = 1  # interleaved: stages a device holds, visited in turn

    def __post_init__(self):
        for name, choices in (("context_strategy", CONTEXT_STRATEGIES), ("moe_exchange", MOE_EXCHANGES),
                              ("pipeline_schedule", PIPELINE_SCHEDULES)):
            if getattr(self, name) not in choices:
                _fail(name, getattr(self, name), f"expected one of {', '.join(choices)}")
        for name in ("microbatches", "stage_repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _fail(name, value, "expected a positive integer")
        if self.pipeline_schedule != "interleaved" and self.stage_repeats != 1:
            _fail("stage_repeats", self.stage_repeats, f"{self.pipeline_schedule} runs each stage once: use "
                                                       f"pipeline_schedule=interleaved for several stages a device")
        if self.pipeline_schedule == "interleaved" and self.stage_repeats < 2:
            _fail("stage_repeats", self.stage_repeats, "interleaved needs at least 2 stages a device (1 is gpipe)")
        factor = self.moe_exchange_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0):
            _fail("moe_exchange_factor", factor, "expected a positive factor or null (no drops)")


@dataclass(frozen=True)
class ParallelConfig(Strategies):
    """Mesh sizes (`stage` x `data` x `fsdp` x `expert` x `context` x `tensor`), the context layout,
    rule overrides (logical name -> mesh axes) and the axes' strategies."""

    stage: int = 1
    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    rules: tuple[tuple[str, str | tuple[str, ...] | None], ...] = field(default=())
    context: int = 1
    context_layout: str = "two_chunk"

    def sizes(self) -> dict[str, int]:
        return {"stage": self.stage, "data": self.data, "fsdp": self.fsdp, "expert": self.expert,
                "context": self.context, "tensor": self.tensor}

    def __post_init__(self):
        super().__post_init__()
        sizes = self.sizes()
        for name, size in sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                _fail(name, size, "expected a positive integer or -1 (fill with the remaining devices)")
        if sum(size == -1 for size in sizes.values()) > 1:
            _fail("data", self.data, "only one of stage, data, fsdp, expert, context, tensor may be -1")
        if self.stage == 1 and self.microbatches > 1:
            _fail("microbatches", self.microbatches, "microbatches split a batch between pipeline stages and "
                                                     "need stage > 1 (train.grad_accum accumulates without stages)")
        if self.pipeline_schedule == "interleaved" and self.stage > 1 and self.microbatches < self.stage:
            _fail("microbatches", self.microbatches, f"the interleaved schedule sends each microbatch round the "
                                                     f"{self.stage} stages again: give at least stage={self.stage}")
        if self.context_layout not in CONTEXT_LAYOUTS:
            _fail("context_layout", self.context_layout, f"expected one of {', '.join(CONTEXT_LAYOUTS)}")
        known = dict(RULES)
        for name, axes in self.rules:
            if name in RENAMED:
                _fail(f"rules.{name}", axes, f"the logical axis {name} is now {RENAMED[name]}: write "
                                             f"parallel.rules.{RENAMED[name]}")
            if name not in known:
                close = difflib.get_close_matches(name, known, n=3)
                hint = f"did you mean {', '.join(close)}? " if close else ""
                _fail(f"rules.{name}", axes, f"not a logical axis; {hint}(known: {', '.join(known)})")
            group = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
            bad = [a for a in group if a not in AXES]
            if bad or len(set(group)) != len(group):
                _fail(f"rules.{name}", axes, f"expected null, a mesh axis or a list of distinct mesh axes from "
                                             f"{', '.join(AXES)}")

    @classmethod
    def from_dict(cls, values: dict | None) -> ParallelConfig:
        values = dict(values or {})
        check_keys("parallel", values, [f.name for f in dataclasses.fields(cls)])
        rules = values.pop("rules", None) or {}
        if not isinstance(rules, dict):
            _fail("rules", rules, "expected a mapping of logical axis -> mesh axes")
        frozen = tuple((str(k), tuple(v) if isinstance(v, list) else v) for k, v in rules.items())
        return cls(**values, rules=frozen)

    def to_dict(self) -> dict:
        rules = {name: list(axes) if isinstance(axes, tuple) else axes for name, axes in self.rules}
        strategies = {f.name: getattr(self, f.name) for f in dataclasses.fields(Strategies)}
        return {**self.sizes(), "context_layout": self.context_layout, **strategies, "rules": rules}

    def rules_table(self) -> tuple:
        """`sharding.RULES` with this config's entries replaced."""
        overrides = dict(self.rules)
        return tuple((name, overrides.get(name, axes)) for name, axes in RULES)

    def mesh(self, devices=None):
        return make_mesh(self.data, self.fsdp, self.tensor, devices=devices, expert=self.expert, context=self.context,
                         stage=self.stage)


def layout_order(length: int, context: int, layout: str):
    """The token order along a sequence of `length` laid out over `context` devices: entry j is
    the index in the original sequence of the token placed at j (device i holds entries
    `i * length / context ...`). None when the order is unchanged."""
    import numpy as np

    if context == 1 or layout == "contiguous":
        return None
    if layout == "striped":
        if length % context:
            raise ValueError(f"train.seq_len={length} does not split into parallel.context={context} stripes: "
                             f"make it a multiple of {context}")
        return np.arange(length).reshape(length // context, context).T.reshape(-1)
    if length % (2 * context):
        raise ValueError(f"train.seq_len={length} does not split into 2 x parallel.context={2 * context} chunks "
                         f"(parallel.context_layout=two_chunk): make it a multiple of {2 * context}, or use "
                         f"context_layout=contiguous")
    chunks = np.arange(length).reshape(2 * context, length // (2 * context))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * context - 1 - i]]) for i in range(context)])
