"""The device mesh: named axes `stage`, `data`, `fsdp`, `expert`, `context`, `tensor`, one process or many.

    mesh = make_mesh(data=-1, fsdp=1, tensor=4)   # -1 fills with the remaining devices
    mesh = make_mesh(data=2, expert=4)            # experts split in 4, the batch over all 8

`expert` splits a mixture's routed experts (`experts` in the rules table); everywhere else
it acts as data parallelism (the batch is split over data x fsdp x expert). `context` splits
every activation's sequence (context parallelism: attention gathers keys and values over it,
`ops.attention`) and, like `fsdp`, the weights. `stage` splits the layers into pipeline stages
(`ops.pipeline`): it sends one microbatch's activations a step, the least traffic of all, so it
is outermost (across hosts or slices). The axes are laid out in this order, `context` and
`tensor` innermost (the fastest links: both communicate inside every layer).

Many processes (TPU pod slices, multi-node GPU): the commands join them by themselves
(`multihost.distributed`); in Python call `initialize_distributed()` first, in every process,
before any other JAX call. `make_mesh` then spans all processes' devices.
"""

from __future__ import annotations

import math
import warnings

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("stage", "data", "fsdp", "expert", "context", "tensor")


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None, *, expert: int = 1,
              context: int = 1, stage: int = 1) -> Mesh:
    """A `(stage, data, fsdp, expert, context, tensor)` mesh over `devices` (default: all); one size may be -1."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"stage": stage, "data": data, "fsdp": fsdp, "expert": expert, "context": context, "tensor": tensor}
    for name, size in sizes.items():
        if not isinstance(size, int) or (size < 1 and size != -1):
            raise ValueError(f"mesh {name}={size!r}: expected a positive integer or -1 (fill)")
    fill = [name for name, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ValueError(f"mesh: only one axis may be -1 (fill), got {', '.join(fill)}")
    known = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if len(devices) % known:
            given = {k: v for k, v in sizes.items() if v > 1}
            named = " x ".join(given)
            product = " x ".join(f"{k}={v}" for k, v in given.items()) + (f" = {known}" if len(given) > 1 else "")
            raise ValueError(f"mesh {product} with {fill[0]}=-1 (fill): {len(devices)} devices do not split into "
                             f"{known} x a whole {fill[0]}: make {named} a divisor of {len(devices)}")
        sizes[fill[0]] = len(devices) // known
    total = math.prod(sizes.values())
    if total != len(devices):
        shape = " x ".join(f"{k}={v}" for k, v in sizes.items())
        raise ValueError(f"mesh {shape} needs {total} devices but {len(devices)} are available; "
                         f"make the product equal {len(devices)} or use -1 for one axis")
    shape = tuple(sizes[a] for a in AXES)
    auto = (AxisType.Auto,) * len(AXES)  # GSPMD propagates shardings from the constraints
    return Mesh(_layout(shape, sizes, devices), AXES, axis_types=auto)


def _layout(shape: tuple[int, ...], sizes: dict[str, int], devices: list) -> np.ndarray:
    """The devices arranged as `shape`: by the physical topology where JAX knows it (TPU, GPU)."""
    from jax.experimental import mesh_utils

    slices = sorted({getattr(d, "slice_index", 0) or 0 for d in devices})
    if len(slices) > 1:  # multi-slice: the slower links between slices carry the stages, else the data axis
        across = "stage" if sizes["stage"] > 1 else "data"
        if sizes[across] % len(slices):
            raise ValueError(f"mesh {across}={sizes[across]}: the devices span {len(slices)} slices, and "
                             f"{'the pipeline stages cross' if across == 'stage' else 'data parallelism crosses'} "
                             f"them: make {across} a multiple of {len(slices)}")
        dcn = tuple(len(slices) if a == across else 1 for a in AXES)
        ici = tuple(size // len(slices) if a == across else size for a, size in zip(AXES, shape))
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
    try:
        return mesh_utils.create_device_mesh(shape, devices)
    except NotImplementedError:  # no axis of the mesh matches a product of physical axes
        layout = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        warnings.warn(f"mesh {' x '.join(f'{k}={v}' for k, v in sizes.items())} splits the topology's physical axes "
                      f"(some mesh axes do not match whole physical axes); collectives on them use part of a ring",
                      stacklevel=3)
        return layout
    except ValueError:  # devices the topology helper cannot lay out (host CPU devices): keep their order
        return np.asarray(devices).reshape(shape)


def parse_mesh(text: str) -> dict[str, int]:
    """`"data=2,expert=4"` -> `{"data": 2, "expert": 4}` (names from AXES)."""
    sizes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in AXES:
            raise ValueError(f"bad mesh entry {item!r}: expected NAME=SIZE with NAME in {', '.join(AXES)}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"bad mesh entry {item!r}: SIZE must be an integer (or -1)") from None
    return sizes
