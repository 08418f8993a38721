"""A stack of layers over the `stage` mesh axis: microbatches through pipeline stages.

Letters: S stages (the `stage` axis), R stages a device (`stage_repeats`), P units a stage, N = R S P
units in the stack, M microbatches of b rows (B = M b), T length, D model width.

The stack's weights `[N, ...]` are split over `stage` (the `layers` rule): unit
`u = (r S + s) P + p` is unit p of stage s in round r, so device s holds stages s, S + s, ...
With R = 1 (`gpipe`) that is the contiguous block of N / S units the `layers` axis gives device s;
with R > 1 (`interleaved`, MaxText's circular pipeline) a device holds R blocks of P units, one a
round (the run holds the stack as `[R, N / R, ...]` for that: `training.layout`), and each block
picks its round's weights inside its remat checkpoint.

At iteration t every stage works at once (the stage axis is vmapped, `spmd_axis_name="stage"`):
stage s takes microbatch `m = (t - s) mod M` of round `r = (t - s) div M`, where `0 <= t - s < R M`;
otherwise it idles (its result is discarded and its sown values masked). Its input is stage s - 1's
output of iteration t - 1 (one `roll` along `stage`: a collective permute), and stage 0's is the
microbatch itself in round 0 and its last stage's output (kept in `circ[m]`, M >= S) in later rounds.
The last stage writes microbatch m's output into `circ[m]`, which after the last round is the
stack's output. Iterations: R M + S - 1, of which each stage idles S - 1: the bubble
`(S - 1) / (R M + S - 1)` of the step's layer time.

The backward pass is the loop's, in reverse (autodiff of the scan): what it keeps per iteration
is what the blocks' remat policy keeps of their inputs, so GPipe's memory (every microbatch's
layer inputs on its stage) and no more: the buffers move by linear updates and are not saved, and
every activation the loop holds is split as the residual stream between layers.
A microbatch is every M-th row (`b = B / M` rows strided), so each keeps the batch's split over
the data axes and stays on its devices.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from modern_jax.sharding.context import active, strategies
from modern_jax.sharding.rules import logical_to_spec


def stages() -> int:
    """The size of the active mesh's `stage` axis (1 outside a mesh)."""
    state = active()
    return 1 if state is None else state[0].shape.get("stage", 1)


def pipelined() -> bool:
    """Whether the active mesh splits the layers over stages."""
    return stages() > 1


def check_depth(units: int, what: str) -> None:
    """Refuse a stack of `units` the active stages (x stage_repeats) do not split, naming the counts that do."""
    S = stages()
    R = strategies().stage_repeats if S > 1 else 1
    if units % (S * R):
        fits = [n for n in range(1, units + 1) if units % n == 0]
        raise ValueError(f"{what}: its {units} units do not split over parallel.stage={S} x stage_repeats={R} = "
                         f"{S * R} stages: stage x stage_repeats must divide {units} ({', '.join(map(str, fits))})")


def _place(x, dim: int):
    """`x` with dimension `dim` over the `stage` axis, the others left to the compiler."""
    mesh = active()[0]
    spec = [PartitionSpec.UNCONSTRAINED] * x.ndim
    spec[dim] = "stage"
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


def _place_rows(x_XbTD, stage: bool | None, whole: int = 0):
    """Activations `[S or M, b, T, D]` (or one microbatch's `[b, T, D]`, `stage=None`) split as the
    residual stream is between layers (the rows over the data axes, the sequence over context x
    tensor), a first axis over `stage` or whole, then `whole` more axes whole (1F1B's stash): what
    the backward pass keeps of every stage's input, so split as finely as the layers' own (the
    compiler, left to itself, may gather them)."""
    mesh, rules = active()
    lead = (() if stage is None else ("stage" if stage else None,)) + (None,) * whole
    spec = logical_to_spec(("activation_batch", "activation_norm_length", "activation_embed"), rules, mesh,
                           x_XbTD.shape[len(lead):], where="the pipeline's activations")
    return jax.lax.with_sharding_constraint(x_XbTD, NamedSharding(mesh, PartitionSpec(*lead, *spec)))


def microbatches(x, M: int, group: int = 1):
    """`[B, ...]` -> `[M, B / M, ...]`: microbatch m is rows m, m + M, m + 2M, ..., or with `group`
    g, the groups of g rows numbered so (rows that belong together, as a preference pair's)."""
    x = x.reshape(x.shape[0] // (M * group), M, group, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape(M, -1, *x.shape[3:])


def unmicrobatch(x, group: int = 1):
    """The inverse of `microbatches`."""
    M = x.shape[0]
    x = jnp.swapaxes(x.reshape(M, -1, group, *x.shape[2:]), 0, 1)
    return x.reshape(-1, *x.shape[3:])


def _check_rows(B: int, M: int, group: int) -> None:
    if B % (M * group):
        whole = f"{M}" if group == 1 else f"{M} x {group} (the objective's rows that go together)"
        raise ValueError(f"a batch of {B} rows does not split into parallel.microbatches={M}: make the batch "
                         f"(per step, after train.grad_accum) a multiple of {whole}")


def _mask(valid_S, v_S):
    """`v_S` where the stage worked, zero where it idled."""
    return jnp.where(valid_S.reshape((-1,) + (1,) * (v_S.ndim - 1)), v_S, jnp.zeros((), v_S.dtype))


def _fold(reduced, per_unit, reduced_S, per_unit_S, valid_S, first_S, P: int, combine):
    """The stages' sown values of one iteration added to the totals: `reduced` folded by `combine`,
    `per_unit` (`[N, ...]`) at each stage's P units from `first_S`; an idle stage adds nothing."""
    for s in range(valid_S.shape[0]):
        reduced = combine(reduced, jax.tree.map(lambda v_S: _mask(valid_S, v_S)[s], reduced_S))
    units_SP = first_S[:, None] + jnp.arange(P)[None, :]
    per_unit = jax.tree.map(lambda total, v_S: total.at[units_SP].add(_mask(valid_S, v_S)), per_unit, per_unit_S)
    return reduced, per_unit


def _unit_totals(shapes, N: int):
    """Zeros `[N, ...]` for each `[S, P, ...]` per-unit value of the vmapped stages (`shapes`)."""
    return jax.tree.map(lambda v: jnp.zeros((N,) + v.shape[2:], v.dtype), shapes)


def run(stage_fn, x_BTD, per_row, weights, reduced, combine, whole, loop):
    """The stack over the stages: `(x_BTD, reduced, per_unit)`.

    `stage_fn(x_bTD, per_row_b, weights_P, first[, round]) -> (x_bTD, reduced, per_unit)` applies P
    units, the first being unit `first`, to one microbatch: with R = 1 `weights_P` are the stage's
    `[P, ...]`; with R > 1 its `[R, P, ...]`, of which round `round` runs. `per_row` is a pytree of `[B, ...]` arrays
    (positions, segment ids) split with the activations; `weights` a pytree of `[N, ...]` arrays.
    `reduced` is a pytree of float32 values that `combine(total, value)` (pytrees) folds over the
    units and microbatches (starting from the given zeros, which an idle stage adds); `per_unit` a pytree of
    `[P, ...]` values per unit, added up over the microbatches into `[N, ...]`. `loop(body, carry,
    n)` runs the iterations (a scan, or unrolled as the execution says)."""
    S, M, R = stages(), strategies().microbatches, strategies().stage_repeats
    N = jax.tree.leaves(weights)[0].shape[0]
    check_depth(N, "the layer stack")
    B = x_BTD.shape[0]
    _check_rows(B, M, 1)
    P = N // (S * R)
    # [N, ...] -> [R, S, P, ...] with S over the stage axis
    weights = jax.tree.map(lambda w: _place(w.reshape(R, S, P, *w.shape[1:]), 1), weights)
    x_MbTD = _place_rows(microbatches(x_BTD, M), stage=False)
    rows = jax.tree.map(lambda a: microbatches(a, M), per_row)
    s_S = jnp.arange(S)
    # each stage its weights: with R = 1 its [P, ...] block; with R > 1 its [R, P, ...] blocks and the
    # round it runs, which the blocks pick inside their checkpoint (a gathered copy would be kept
    # for the backward pass at every iteration)
    vmapped = jax.vmap(stage_fn, in_axes=(0, 0, 0 if R == 1 else 1, 0) + (() if R == 1 else (0,)),
                       spmd_axis_name="stage")

    def iteration(carry, t):
        h_SbTD, circ_MbTD, reduced, per_unit = carry
        k_S = t - s_S  # the work index of each stage: round k // M, microbatch k % M
        valid_S = (k_S >= 0) & (k_S < R * M)
        k_S = jnp.clip(k_S, 0, R * M - 1)
        m_S, r_S = k_S % M, k_S // M
        first_in = _place_rows(jnp.where(r_S[0] == 0, _place_rows(x_MbTD[m_S[0]], None),
                                         _place_rows(circ_MbTD[m_S[0]], None)), None)
        inputs = _place_rows(jnp.roll(h_SbTD, 1, axis=0).at[0].set(first_in), stage=True)
        first_S = (r_S * S + s_S) * P
        rows_S = jax.tree.map(lambda a: a[m_S], rows)
        if R == 1:
            out_SbTD, reduced_S, per_unit_S = vmapped(inputs, rows_S, jax.tree.map(lambda w: w[0], weights), first_S)
        else:
            out_SbTD, reduced_S, per_unit_S = vmapped(inputs, rows_S, weights, first_S, r_S)
        out_SbTD = _place_rows(out_SbTD, stage=True)
        last = S - 1
        kept = _place_rows(jnp.where(valid_S[last], _place_rows(out_SbTD[last], None),
                                     _place_rows(circ_MbTD[m_S[last]], None)), None)
        circ_MbTD = _place_rows(circ_MbTD.at[m_S[last]].set(kept), stage=False)
        reduced, per_unit = _fold(reduced, per_unit, reduced_S, per_unit_S, valid_S, first_S, P, combine)
        return (out_SbTD, circ_MbTD, reduced, per_unit), None

    h = _place_rows(jnp.zeros((S,) + x_MbTD.shape[1:], x_BTD.dtype), stage=True)
    per_unit = _unit_totals(jax.eval_shape(lambda: vmapped(h, jax.tree.map(lambda a: a[jnp.zeros(S, int)], rows),
                                                           *((jax.tree.map(lambda w: w[0], weights), s_S) if R == 1
                                                             else (weights, s_S, s_S)))[2]), N)
    carry = (h, _place_rows(jnp.zeros_like(x_MbTD), stage=False), reduced, per_unit)
    (_, circ_MbTD, reduced, per_unit), _ = loop(iteration, carry, R * M + S - 1)
    return unmicrobatch(circ_MbTD), whole(reduced, per_unit, M, B * x_BTD.shape[1]), per_unit


def one_f_one_b(stage_fn, post_fn, x_BTD, per_row, weights, fixed, post_params, post_rows, reduced, reduced_cot,
                combine, post_combine, loop, group: int = 1):
    """The stack and the loss after it under the 1F1B schedule, with their gradients: `(loss, sums,
    reduced, per_unit, dx_BTD, dweights, dpost)`.

    Each microbatch goes forward through the stages, through `post_fn` (the head and the loss) as soon
    as the last stage has it, and back through the stages from there, so a stage alternates one
    forward and one backward once the first microbatch has come back (one forward and one backward
    of every stage at each iteration of the steady phase), and holds at most `2 S - 1` microbatches
    in flight, not all M as GPipe does.

    At iteration t, stage s runs microbatch `t - s` forward and microbatch `t - (2 S - 2) + s`
    backward (each where it exists); the last stage runs microbatch `t - S + 1` forward, through
    `post_fn`, and back in the same iteration. The loop has three phases: S - 1 iterations of
    forwards only, M of both, S - 1 of backwards only: every stage idles S - 1 forward and S - 1
    backward slots, the bubble `(S - 1) / (M + S - 1)` as GPipe's. A stage keeps each microbatch's
    input from its forward until its backward (`stash`, a slot per iteration, `K = min(M, 2 S - 1)`
    slots) and its backward recomputes its forward from there (`jax.vjp` of the stage), its blocks'
    remat policy applying inside.

    `stage_fn(x_bTD, per_row_b, weights_P, fixed_P, first) -> (x_bTD, reduced, per_unit)` is `run`'s,
    its weights split into `weights` (differentiated) and `fixed` (not: a frozen base), pytrees of
    `[N, ...]`. `post_fn(post_params, y_bTD, post_rows_b) -> (loss, sums)`: the loss of one
    microbatch (they add up to the batch's) from the stack's output, differentiated in `post_params`
    and `y`; `post_rows` a pytree of `[B, ...]` arrays; `post_combine(total, sums)` folds the sums.
    `reduced_cot`: the loss's derivative in each `reduced` value of a microbatch (its weight in the
    loss). `group`: rows that go into one microbatch together (`microbatches`)."""
    S, M = stages(), strategies().microbatches
    N = jax.tree.leaves((weights, fixed))[0].shape[0]
    check_depth(N, "the layer stack")
    _check_rows(x_BTD.shape[0], M, group)
    P = N // S
    split = lambda w: _place(w.reshape(S, P, *w.shape[1:]), 0)  # noqa: E731
    schedule = _OneFOneB(
        S=S, M=M, K=min(M, 2 * S - 1), P=P, s_S=jnp.arange(S), first_S=jnp.arange(S) * P,
        x_MbTD=_place_rows(microbatches(x_BTD, M, group), stage=False),
        rows=jax.tree.map(lambda a: microbatches(a, M, group), per_row),
        post_rows=jax.tree.map(lambda a: microbatches(a, M, group), post_rows),
        w_S=jax.tree.map(split, weights), f_S=jax.tree.map(split, fixed), stage_fn=stage_fn, post_fn=post_fn,
        post_params=post_params, reduced_cot=reduced_cot, combine=combine, post_combine=post_combine)
    carry = schedule.start(reduced)
    for start, n, fwd, bwd in ((0, S - 1, True, False), (S - 1, M, True, True), (M + S - 1, S - 1, False, True)):
        carry, _ = loop(lambda c, i, start=start, fwd=fwd, bwd=bwd: schedule.tick(c, start + i, fwd, bwd), carry, n)
    dw = jax.tree.map(lambda d: d.reshape(N, *d.shape[2:]), carry.dw)
    return carry.loss, carry.sums, carry.red, carry.per_unit, unmicrobatch(carry.dx_MbTD, group), dw, carry.dpost


class _InFlight(NamedTuple):
    """What 1F1B's iterations carry."""

    h_SbTD: jax.Array  # each stage's forward output of the last iteration
    g_SbTD: jax.Array  # each stage's backward output (its input's gradient) of the last iteration
    stash: jax.Array  # [S, K, b, T, D]: each stage's inputs, kept from their forward until their backward
    dx_MbTD: jax.Array  # the stack's input gradient, per microbatch
    dw: Any  # the weights' gradient, [S, P, ...]
    dpost: Any  # post_fn's parameters' gradient
    loss: jax.Array
    sums: Any  # post_fn's sums, folded by post_combine
    red: Any  # the stages' reduced values, folded by combine
    per_unit: Any  # the stages' per-unit values, [N, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class _OneFOneB:
    """One 1F1B step (`one_f_one_b`): the microbatches, each stage's weights and the functions, and
    what one iteration does with them."""

    S: int  # stages
    M: int  # microbatches
    K: int  # the stash's slots
    P: int  # units a stage
    s_S: jax.Array  # each stage's index
    first_S: jax.Array  # each stage's first unit
    x_MbTD: jax.Array
    rows: Any  # per_row, [M, b, ...]
    post_rows: Any  # [M, b, ...]
    w_S: Any  # [S, P, ...]
    f_S: Any  # [S, P, ...]
    stage_fn: Callable
    post_fn: Callable
    post_params: Any
    reduced_cot: Any
    combine: Callable
    post_combine: Callable

    def start(self, reduced) -> _InFlight:
        """The carry before the first iteration: zeros, and the given `reduced`."""
        S = self.S
        h = _place_rows(jnp.zeros((S,) + self.x_MbTD.shape[1:], self.x_MbTD.dtype), stage=True)
        rows_0 = jax.tree.map(lambda a: a[jnp.zeros(S, int)], self.rows)
        forward = jax.vmap(self.stage_fn, spmd_axis_name="stage")
        per_unit = _unit_totals(jax.eval_shape(lambda: forward(h, rows_0, self.w_S, self.f_S, self.first_S)[2]),
                                S * self.P)
        sums = jax.eval_shape(lambda: self.post_fn(self.post_params, h[0],
                                                   jax.tree.map(lambda a: a[0], self.post_rows))[1])
        sums = jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype), sums)
        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
        stash = _place_rows(jnp.zeros((S, self.K) + self.x_MbTD.shape[1:], self.x_MbTD.dtype), stage=True, whole=1)
        return _InFlight(h, h, stash, _place_rows(jnp.zeros_like(self.x_MbTD), stage=False), zeros(self.w_S),
                         zeros(self.post_params), jnp.zeros((), jnp.float32), sums, reduced, per_unit)

    def tick(self, c: _InFlight, t, fwd: bool, bwd: bool):
        """Iteration t: every stage's forward (`fwd`); in the steady phase (both) the last stage's
        microbatch through the loss; every stage's backward (`bwd`)."""
        dy_bTD = jnp.zeros(c.h_SbTD.shape[1:], c.h_SbTD.dtype)
        if fwd:
            c = self.forward(c, t)
            if bwd:
                c, dy_bTD = self.through_loss(c, t)
        if bwd:
            c = self.backward(c, t, dy_bTD)
        return c, None

    def work(self, m_S):
        """Each stage's microbatch (clipped) and whether it exists."""
        return jnp.clip(m_S, 0, self.M - 1), (m_S >= 0) & (m_S < self.M)

    def forward(self, c: _InFlight, t) -> _InFlight:
        """Stage s runs microbatch t - s forward, its input stashed in slot t mod K."""
        m_S, valid_S = self.work(t - self.s_S)
        first_in = _place_rows(self.x_MbTD[m_S[0]], None)
        inputs = _place_rows(jnp.roll(c.h_SbTD, 1, axis=0).at[0].set(first_in), stage=True)
        slot = t % self.K
        kept = jax.lax.dynamic_index_in_dim(c.stash, slot, 1, keepdims=False)
        kept = _place_rows(jnp.where(valid_S[:, None, None, None], inputs, kept), stage=True)
        stash = _place_rows(jax.lax.dynamic_update_index_in_dim(c.stash, kept, slot, 1), stage=True, whole=1)
        forward = jax.vmap(self.stage_fn, spmd_axis_name="stage")
        h_SbTD, red_S, unit_S = forward(inputs, jax.tree.map(lambda a: a[m_S], self.rows), self.w_S, self.f_S,
                                        self.first_S)
        h_SbTD = _place_rows(h_SbTD, stage=True)
        red, per_unit = _fold(c.red, c.per_unit, red_S, unit_S, valid_S, self.first_S, self.P, self.combine)
        return c._replace(h_SbTD=h_SbTD, stash=stash, red=red, per_unit=per_unit)

    def through_loss(self, c: _InFlight, t) -> tuple[_InFlight, jax.Array]:
        """The last stage's microbatch of iteration t through `post_fn` and back: the carry with its
        loss, sums and parameters' gradient added, and its output's gradient `dy_bTD`."""
        m = t - (self.S - 1)
        y_bTD = _place_rows(c.h_SbTD[self.S - 1], None)
        rows_m = jax.tree.map(lambda a: a[m], self.post_rows)
        loss_m, vjp, sums_m = jax.vjp(lambda p, y: self.post_fn(p, y, rows_m), self.post_params, y_bTD, has_aux=True)
        dp, dy_bTD = vjp(jnp.ones((), loss_m.dtype))
        return c._replace(loss=c.loss + loss_m, sums=self.post_combine(c.sums, sums_m),
                          dpost=jax.tree.map(jnp.add, c.dpost, dp)), dy_bTD

    def backward(self, c: _InFlight, t, dy_bTD) -> _InFlight:
        """Stage s runs microbatch t - (2 S - 2) + s backward, from the input its forward stashed at
        iteration t - 2 (S - 1 - s); the last stage's output gradient is `dy_bTD`."""
        S = self.S
        m_S, valid_S = self.work(t - (2 * S - 2) + self.s_S)
        pick = jax.vmap(lambda stash_K, i: jax.lax.dynamic_index_in_dim(stash_K, i, 0, keepdims=False),
                        spmd_axis_name="stage")
        x_in = _place_rows(pick(c.stash, (t - 2 * (S - 1 - self.s_S)) % self.K), stage=True)
        g_in = _mask(valid_S, _place_rows(jnp.roll(c.g_SbTD, -1, axis=0).at[S - 1].set(dy_bTD), stage=True))
        cot = jax.tree.map(lambda v: jnp.where(valid_S, v, 0.0).astype(jnp.float32), self.reduced_cot)
        backward = jax.vmap(functools.partial(_stage_vjp, self.stage_fn), spmd_axis_name="stage")
        dx_SbTD, dw_S = backward(x_in, jax.tree.map(lambda a: a[m_S], self.rows), self.w_S, self.f_S, self.first_S,
                                 g_in, cot)
        g_SbTD = _place_rows(dx_SbTD, stage=True)
        done = _place_rows(jnp.where(valid_S[0], _place_rows(g_SbTD[0], None),
                                     _place_rows(c.dx_MbTD[m_S[0]], None)), None)
        return c._replace(g_SbTD=g_SbTD, dx_MbTD=_place_rows(c.dx_MbTD.at[m_S[0]].set(done), stage=False),
                          dw=jax.tree.map(jnp.add, c.dw, dw_S))


def _stage_vjp(stage_fn, x_bTD, rows_b, w_P, f_P, first, g_bTD, cot):
    """A stage's forward recomputed from its input, and its gradients in the input and the weights
    given its output's (`g_bTD`) and its reduced values' (`cot`)."""
    _, vjp = jax.vjp(lambda x, w: stage_fn(x, rows_b, w, f_P, first)[:2], x_bTD, w_P)
    return vjp((g_bTD, cot))
