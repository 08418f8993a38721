"""How a run holds its layer stacks: as the model has them, or laid out for an interleaved pipeline.

A stack's weights are `[N, ...]`, split over the `stage` axis along N (the `layers` rule): device s
holds a contiguous block of N / S units. The interleaved schedule (`ops.pipeline`, R stages a
device) needs device s to hold units `(r S + s) P + p` for every round r: R blocks, one a round,
which no split of one axis gives. So a run with R > 1 holds each stack as `[R, N / R, ...]`,
split over `stage` along its second axis: row-major the same order, so the model's `[N, ...]` is
a reshape away, and the two reshapes the step makes (to `[N]`, then to `[R, S, P]` in
`ops.pipeline`) fold into one that moves nothing.

The Trainer's state, its optimizer state and its checkpoints hold this layout; `StateBuilder.model`
gives the model's. A checkpoint restores into another layout (another `stage_repeats`, or none)
by reading each stack as saved and reshaping it (`training.checkpoint`).
"""

from __future__ import annotations

import math

import jax
from flax import nnx
from flax.nnx import traversals


def stacked(abstract) -> set[tuple]:
    """The paths (pure-dict keys) of the parameters stacked along a `layers` axis."""
    return {tuple(path) for path, v in nnx.to_flat_state(abstract)
            if (v.get_metadata().get("out_sharding") or (None,))[0] == "layers"}


def laid_out(abstract, rounds: int):
    """`abstract` (an `nnx.State` of ShapeDtypeStructs) with each stack as `[rounds, N / rounds, ...]`,
    its `layers` axis second."""
    if rounds == 1:
        return abstract

    def one(v):
        axes = v.get_metadata().get("out_sharding")
        if not axes or axes[0] != "layers":
            return v
        shape = (rounds, v.shape[0] // rounds) + tuple(v.shape[1:])
        return v.replace(value=jax.ShapeDtypeStruct(shape, v.dtype), out_sharding=(None,) + tuple(axes))

    return nnx.from_flat_state([(path, one(v)) for path, v in nnx.to_flat_state(abstract)])


def _map(params: dict, paths: set[tuple], fn) -> dict:
    flat = traversals.flatten_mapping(params)
    return traversals.unflatten_mapping({k: fn(v) if k in paths else v for k, v in flat.items()})


def to_layout(params: dict, paths: set[tuple], rounds: int) -> dict:
    """The model's parameters (a pure dict) in the run's layout."""
    if rounds == 1:
        return params
    return _map(params, paths, lambda a: a.reshape(rounds, a.shape[0] // rounds, *a.shape[1:]))


def to_model(params: dict, paths: set[tuple], rounds: int) -> dict:
    """The run's parameters in the model's layout."""
    if rounds == 1:
        return params
    return _map(params, paths, lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]))


def leading(saved: tuple, want: tuple) -> tuple[int, int] | None:
    """How many leading layer dimensions an array saved as `saved` and one of shape `want` have,
    `(saved's, want's)`, when they are the same stack in two layouts (`[N, ...]`, `[R, N / R, ...]`)
    and the one is the other reshaped; None otherwise (the same shape included)."""
    if saved == want or math.prod(saved) != math.prod(want):
        return None
    if saved[1:] == want[2:]:
        return 1, 2
    if saved[2:] == want[1:]:
        return 2, 1
    if len(saved) == len(want) and saved[2:] == want[2:]:
        return 2, 2
    return None


def same_stack(saved: tuple, want: tuple) -> bool:
    """Whether an array saved as `saved` is, reshaped, one of shape `want`: the same stack in another
    layout."""
    return leading(saved, want) is not None
