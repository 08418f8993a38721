"""The `parallel:` section of a run file: the mesh and overrides of the logical-axis rules.

    parallel:
      data: -1          # -1: every device left over (one axis at most)
      fsdp: 1
      expert: 1         # splits a mixture's experts; data parallelism everywhere else
      tensor: 4
      rules:            # entries replacing those of `sharding.RULES`
        embed: null     #   e.g. no FSDP of the model dimension
        mlp: [fsdp, tensor]

`modern-jax train --mesh data=2,tensor=4` and dotted overrides (`parallel.tensor=4`,
`parallel.rules.embed=null`) set the same fields.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field

from modern_jax.configfile import check_keys, fail
from modern_jax.parallel.mesh import AXES, make_mesh
from modern_jax.sharding import RULES


_fail = functools.partial(fail, "ParallelConfig")


@dataclass(frozen=True)
class ParallelConfig:
    """Mesh sizes (`data` x `fsdp` x `expert` x `tensor`) and rule overrides (logical name -> mesh axes)."""

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    rules: tuple[tuple[str, str | tuple[str, ...] | None], ...] = field(default=())

    def __post_init__(self):
        sizes = {"data": self.data, "fsdp": self.fsdp, "expert": self.expert, "tensor": self.tensor}
        for name, size in sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                _fail(name, size, "expected a positive integer or -1 (fill with the remaining devices)")
        if sum(size == -1 for size in sizes.values()) > 1:
            _fail("data", self.data, "only one of data, fsdp, expert, tensor may be -1")
        known = dict(RULES)
        for name, axes in self.rules:
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
        check_keys("parallel", values, ["data", "fsdp", "expert", "tensor", "rules"])
        rules = values.pop("rules", None) or {}
        if not isinstance(rules, dict):
            _fail("rules", rules, "expected a mapping of logical axis -> mesh axes")
        frozen = tuple((str(k), tuple(v) if isinstance(v, list) else v) for k, v in rules.items())
        return cls(**values, rules=frozen)

    def to_dict(self) -> dict:
        rules = {name: list(axes) if isinstance(axes, tuple) else axes for name, axes in self.rules}
        return {"data": self.data, "fsdp": self.fsdp, "expert": self.expert, "tensor": self.tensor, "rules": rules}

    def rules_table(self) -> tuple:
        """`sharding.RULES` with this config's entries replaced."""
        overrides = dict(self.rules)
        return tuple((name, overrides.get(name, axes)) for name, axes in RULES)

    def mesh(self, devices=None):
        return make_mesh(self.data, self.fsdp, self.tensor, devices=devices, expert=self.expert)
