"""TPU topologies without a TPU: libtpu's compiler, deviceless.

    devices = topology_devices("v5p:2x2x2")          # 8 compile-only v5p chips
    mesh = make_mesh(fsdp=8, devices=devices)
    jax.jit(step, in_shardings=...).lower(abstract args).compile()   # the TPU compiler

`libtpu` (`uv sync --extra tpu`, or the dev group) describes any topology it knows
(`v4:2x2x1`, `v5e:4x4`, `v5p:4x4x4`, `v6e:4x4`, ...; `slices=2` for multi-slice) and
compiles for it on a CPU host: lowering, VMEM fit and HBM fit are the chip's own, nothing
runs. The chip kinds, their memory per chip and the dimensions of their slices are in
`CHIPS`; a name is checked against them before libtpu sees it (libtpu stops the process on
some malformed names, e.g. a dimension of 0).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class Chip:
    name: str  # the generation as topologies spell it
    hbm_gib: float  # high-bandwidth memory per chip
    dims: int  # the dimensions of its slices' shapes: 2 (v5e:4x4) or 3 (v5p:4x4x4)


CHIPS = {  # jax's device_kind -> the chip
    "TPU v4": Chip("v4", 32, 3),
    "TPU v5 lite": Chip("v5e", 16, 2),
    "TPU v5": Chip("v5p", 95, 3),
    "TPU v6 lite": Chip("v6e", 32, 2),
}
EXPECTED = "expected GENERATION:SHAPE such as v5e:2x2, v6e:4x4, v5p:2x2x2, v4:2x2x1"
_TOPOLOGY = re.compile(r"(?P<generation>[^:]*):(?P<shape>[^_]*)(?P<twist>_twisted|_untwisted)?")

# libtpu looks for a TPU VM's metadata when it loads; these say there is none (no warnings). It
# also takes a lockfile meant for processes that share chips: compile-only processes share none.
_QUIET = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v5p-8", "TF_CPP_MIN_LOG_LEVEL": "3",
          "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def check_topology(name: str) -> None:
    """A ValueError naming what is wrong with TPU topology `name` unless it is GENERATION:SHAPE with a
    known generation and as many positive dimensions as its slices have (`_twisted` may follow)."""
    chips = {c.name: c for c in CHIPS.values()}
    match = _TOPOLOGY.fullmatch(name)
    if match is None:
        problem = "not a topology name"
    elif match["generation"] not in chips:
        problem = f"unknown generation {match['generation']!r} (known: {', '.join(chips)})"
    else:
        chip, dims = chips[match["generation"]], match["shape"].split("x")
        if not all(d.isdigit() and int(d) > 0 for d in dims):
            problem = f"every dimension of the shape {match['shape']!r} must be a positive integer"
        elif len(dims) != chip.dims:
            problem = f"{chip.name} slices have {chip.dims} dimensions, {match['shape']!r} has {len(dims)}"
        else:
            return
    raise ValueError(f"--topology {name!r}: {problem}; {EXPECTED}")


def topology_devices(name: str, slices: int = 1) -> list:
    """The compile-only devices of TPU topology `name` (e.g. "v5p:2x2x2"), over `slices` slices."""
    check_topology(name)
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise ValueError(f"--topology {name}: compiling for a TPU needs libtpu: `uv sync --extra tpu` "
                         f"(or `pip install 'jax[tpu]'`); without it, --mesh alone gives the host-CPU "
                         f"estimate") from None
    if not isinstance(slices, int) or slices < 1:
        raise ValueError(f"slices={slices!r}: expected a positive integer")
    for key, value in _QUIET.items():
        os.environ.setdefault(key, value)
    import jax
    from jax.experimental import topologies

    kwargs = {"num_slices": slices} if slices > 1 else {}
    try:
        return list(topologies.get_topology_desc(topology_name=name, platform="tpu", **kwargs).devices)
    except jax.errors.JaxRuntimeError as e:
        reason = str(e).split("\n")[0].removeprefix("INVALID_ARGUMENT: ")
        raise ValueError(f"--topology {name!r}: libtpu refuses it ({reason}); {EXPECTED}") from None


def chip(devices) -> Chip | None:
    """The chip of a list of TPU devices (None for a kind not in `CHIPS`)."""
    return CHIPS.get(devices[0].device_kind)
