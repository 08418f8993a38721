"""How a model runs, apart from what it is: the kernels, the experts' dispatch, remat and scan.

    execution:
      attention_impl: default     # default: the platform's best (Pallas on TPU / GPU, the reference on CPU)
      norm_impl: default          # default: the fused Pallas norm on TPU / GPU, the reference on CPU
      moe_dispatch: grouped       # dropless grouped matmuls | every expert on every token | capacity slots
      moe_capacity_factor: 1.0    # capacity dispatch: slots per expert = factor * tokens * k / E
      moe_grouped_impl: default   # the grouped matmul: megablox on TPU, ragged_dot elsewhere
      remat: none                 # what the backward pass recomputes (REMAT_POLICIES)
      scan_layers: true           # stacked layers run by lax.scan (false: a Python loop, same parameters;
                                  # the loss's chunks and the micro-batches unrolled too: no loop at all)

`ModelConfig` is the architecture (what a checkpoint's config.json maps to); an
`ExecutionConfig` is chosen per run, never written into a converted checkpoint and never
needed to read one. The parallel strategies (the context axis's, the experts' exchange) are
the `parallel:` section's. Code that runs the model enters one (`use(execution)`: the
Trainer, `generate`, the planner), and the layers and ops read `current()`: outside any, the
defaults, which pick the platform's best, so a user who names nothing gets the Pallas kernels
on TPU and GPU and the reference on CPU.

Each list of choices below is the one definition of its names: the kernels and ops that
implement them validate against it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax

from modern_jax.configfile import check_keys, fail

ATTENTION_IMPLS = ("default", "reference", "chunked", "cudnn", "pallas_gpu", "pallas_tpu")
NORM_IMPLS = ("default", "reference", "pallas")
MOE_DISPATCHES = ("grouped", "dense", "capacity")
GROUPED_IMPLS = ("default", "ragged_dot", "megablox")
# execution.remat -> the `jax.checkpoint` policy of each block: what its backward pass keeps (every
# other value is recomputed). The one table: the model applies it (model.py) and `remat` is checked
# against it here, where it lives because imports point down (execution -> ... -> model).
REMAT_POLICIES = {
    "none": jax.checkpoint_policies.everything_saveable,  # everything: no block is wrapped in jax.checkpoint
    "full": None,  # nothing but the block's inputs
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_qkv_out": jax.checkpoint_policies.save_only_these_names(
        "query_proj", "key_proj", "value_proj", "attention_out", "attention_lse"
    ),
    # host offload (MaxText's `offload`): what is kept goes to the host's pinned memory in the forward
    # pass and comes back for the backward, so the device holds none of it between the two
    "offload_input": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_input"],
        offload_src="device", offload_dst="pinned_host"),
    "offload_qkv_out": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], offload_src="device", offload_dst="pinned_host",
        names_which_can_be_offloaded=["layer_input", "query_proj", "key_proj", "value_proj", "attention_out",
                                      "attention_lse"]),
}

_fail = functools.partial(fail, "ExecutionConfig")


@dataclass(frozen=True, slots=True)
class ExecutionConfig:
    """How the model runs (README: Configuration, `execution:`)."""

    attention_impl: str = "default"
    norm_impl: str = "default"
    moe_dispatch: str = "grouped"
    moe_capacity_factor: float = 1.0
    moe_grouped_impl: str = "default"
    remat: str = "none"
    scan_layers: bool = True

    def __post_init__(self):
        for name, choices in (("attention_impl", ATTENTION_IMPLS), ("norm_impl", NORM_IMPLS),
                              ("moe_dispatch", MOE_DISPATCHES), ("moe_grouped_impl", GROUPED_IMPLS),
                              ("remat", REMAT_POLICIES)):
            if getattr(self, name) not in choices:
                _fail(name, getattr(self, name), f"expected one of {', '.join(choices)}")
        if not isinstance(self.scan_layers, bool):
            _fail("scan_layers", self.scan_layers, "expected true or false")
        if isinstance(self.moe_capacity_factor, bool) or not isinstance(self.moe_capacity_factor, (int, float)) \
                or not self.moe_capacity_factor > 0:
            _fail("moe_capacity_factor", self.moe_capacity_factor, "expected a positive factor")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> ExecutionConfig:
        values = dict(values or {})
        check_keys("execution", values, FIELDS)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> ExecutionConfig:
        return dataclasses.replace(self, **changes)


FIELDS = tuple(f.name for f in dataclasses.fields(ExecutionConfig))
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("modern_jax_execution", default=ExecutionConfig())


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar, value):
    """`var` set to `value` inside the block, and back to what it was after (how every setting
    read while tracing, here and in the sharding and kernel layers, is scoped)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


@contextlib.contextmanager
def use(execution: ExecutionConfig | None):
    """Run the model inside with `execution` (None: leave the active one)."""
    if execution is None:
        yield
        return
    with scoped(_ACTIVE, execution):
        yield


def current() -> ExecutionConfig:
    """The active `ExecutionConfig` (the defaults outside any `use`)."""
    return _ACTIVE.get()
