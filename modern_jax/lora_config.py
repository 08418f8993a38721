"""Low-rank adapters (LoRA) and the frozen base they train on (QLoRA): the `lora:` section (the
converter that applies it is `training.converters.LoRA`).

    lora:
      rank: 8               # r: each adapted projection W gains B A, A [in, r], B [r, out]
      alpha: 16             # the update is scaled by alpha / r (PEFT's lora_alpha)
      dropout: 0.0          # on the adapter's input (PEFT's lora_dropout); experts and routers have none
      targets: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]
      quantize: none        # the frozen base's projections: none | int8 | nf4
      save_base: true       # false: checkpoints hold the adapters (and their optimiser state) only

A run with a `lora:` section trains only the adapters: every other parameter is frozen and
has no optimiser state. `targets` name projections as PEFT's `target_modules` do: an entry
matches a projection whose name inside a block ends with it at a dot (`q_proj` matches
`self_attn.q_proj`; `experts.gate_proj` only a mixture's experts, `mlp.gate_proj` only a
dense FFN's), or is `all-linear` (every projection in the blocks, routers included). The
output head and the embeddings are never adapted. `dropout` drops out each adapted projection's
input, as PEFT's `lora_dropout` does; a mixture's experts and routers take none, their adapters
being added to their weights (the run names them), and a target naming
one of them by its path (`experts.gate_proj`) with a dropout is refused. `quantize` stores every
projection in the blocks (adapted or not) quantized and dequantizes it in the compute dtype as it
runs (`ops.quant`): int8 blockwise, or NF4 with double quantization as QLoRA defines it.
With `save_base: false` a run's checkpoints leave the frozen base out: it is read again from
where the run started (`--init-from-hf`, recorded in the run's `base.json` with the size and
CRC-32 of each of its weight files) to resume, evaluate, sample or convert, and refused by name
if those files have changed.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import Any


from modern_jax.configfile import check_keys, fail

QUANTIZE = ("none", "int8", "nf4")  # none, or a kind ops/quant.py stores the base as (its KINDS are these)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"

_fail = functools.partial(fail, "LoRAConfig")


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Which projections gain adapters, of what rank and scale (README: Fine-tune with LoRA / QLoRA)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    quantize: str = "none"
    save_base: bool = True

    def __post_init__(self):
        if isinstance(self.targets, list):
            object.__setattr__(self, "targets", tuple(self.targets))
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            _fail("rank", self.rank, "expected an integer >= 1")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            _fail("alpha", self.alpha, "expected a number > 0")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            _fail("dropout", self.dropout, "expected a number in [0, 1)")
        if not isinstance(self.targets, tuple) or not self.targets or not all(
                isinstance(t, str) and t for t in self.targets):
            _fail("targets", self.targets, f"expected a non-empty list of projection names, e.g. "
                                           f"[{', '.join(DEFAULT_TARGETS[:2])}], or [{ALL_LINEAR}]")
        if self.quantize not in QUANTIZE:
            _fail("quantize", self.quantize, f"expected one of {', '.join(QUANTIZE)}")
        if not isinstance(self.save_base, bool):
            _fail("save_base", self.save_base, "expected true or false")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def matches(self, name: str) -> bool:
        """Whether the projection at `name` (its path inside a block, e.g. `self_attn.q_proj`) is adapted."""
        return any(t == ALL_LINEAR or re.search(rf"(^|\.){re.escape(t)}$", name) for t in self.targets)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> LoRAConfig | None:
        """The `lora:` section; None (no section) trains every parameter."""
        if values is None:
            return None
        if not isinstance(values, dict):
            raise ValueError(f"lora: expected a mapping of LoRAConfig fields, got {values!r}"[:300])
        check_keys("lora", values, [f.name for f in dataclasses.fields(cls)])
        values = dict(values)
        if isinstance(values.get("alpha"), int) and not isinstance(values.get("alpha"), bool):
            values["alpha"] = float(values["alpha"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "targets": list(self.targets)}

    @classmethod
    def of_run(cls, raw: dict) -> LoRAConfig | None:
        """The `lora:` section of a run file's contents (present, even empty: LoRA on), or None."""
        return cls.from_dict(raw["lora"] or {}) if "lora" in raw else None
