"""AdamW, or Muon for the hidden projections and AdamW for the rest, with global-norm clipping, a
warmup + cosine / WSD / constant schedule and a weight-decay mask (by default no decay on
embeddings, norms and biases).

Muon (`train.optimizer: muon`; Jordan's, as `torch.optim.Muon` computes it) moves each matrix of
a hidden projection by its orthogonalised Nesterov momentum:

    B  = mu B + (1 - mu) g                  one momentum buffer a matrix (mu: `muon_momentum`)
    O  = NS_5((1 - mu) g + mu B)            Newton-Schulz: the quintic (3.4445, -4.7750, 2.0315), 5 steps
    W <- W - lr wd W - lr s O               weight decay decoupled, on W before the step
    s  = 0.2 sqrt(max(m, n))                `match_rms_adamw` (Moonlight: AdamW's lr and wd carry over)
       | sqrt(max(1, n / m))                `original` (Jordan's), m = inputs, n = outputs of the matrix

Which weights are matrices, and how, comes from the projections themselves (`muon_dimensions`): a
kernel `[lead..., in..., out...]` is one matrix `prod(in) x prod(out)` per index of its leading
axes, so a stack's layers and a mixture's experts are orthogonalised one by one. The projections
of `train.muon_groups` (default attention, mlp, experts) take Muon; everything else (the
embedding, the output head, norms, biases, sinks, the routers) takes AdamW with the same learning
rate, betas and weight decay.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from modern_jax.layers.linear import Proj
from modern_jax.layers.moe import ExpertProj, MoE
from modern_jax.model import Transformer
from modern_jax.training.config import TrainConfig

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic, as torch.optim.Muon and optax use it
NS_EPS = 1e-7  # the Frobenius norm the iteration divides by is at least this (torch.optim.Muon's)


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup to `lr`, then cosine to `lr * min_lr_ratio`, or WSD: flat until the last
    `decay_fraction` of the steps, then linear down to `lr * min_lr_ratio`."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        warmup = optax.linear_schedule(0.0, peak, max(cfg.warmup_steps, 1))
        return optax.join_schedules([warmup, optax.constant_schedule(peak)], [cfg.warmup_steps])
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, cfg.warmup_steps, cfg.steps, end_value=floor)
    decay_steps = max(1, int(round(cfg.steps * cfg.decay_fraction)))
    stable_steps = max(0, cfg.steps - cfg.warmup_steps - decay_steps)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, max(cfg.warmup_steps, 1)),
         optax.constant_schedule(peak),
         optax.linear_schedule(peak, floor, decay_steps)],
        [cfg.warmup_steps, cfg.warmup_steps + stable_steps])


def parameter_group(path: tuple) -> str:
    """`embedding`, `norm`, `bias` or `weight`, from a parameter's path in the model."""
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    leaf = names[-1]
    if leaf in ("embed_tokens", "embed_positions"):
        return "embedding"
    if leaf == "bias" or leaf == "sinks":
        return "bias"
    if any("norm" in n for n in names):
        return "norm"
    return "weight"


def decay_mask(params, no_decay: tuple[str, ...]):
    """True where weight decay applies."""
    return jax.tree_util.tree_map_with_path(lambda path, _: parameter_group(path) not in no_decay, params)


def is_frozen(path: tuple) -> bool:
    """A router's selection bias: model state that no optimiser step moves (the trainer's
    auxiliary-loss-free balancing does, `Transformer.balance_routers`)."""
    return str(getattr(path[-1], "key", path[-1])) == "selection_bias"


def make_optimizer(cfg: TrainConfig, frozen: bool = False,
                   muon: dict[tuple, MuonDimensionNumbers] | None = None) -> optax.GradientTransformation:
    """Clipping and AdamW (or Muon and AdamW) at learning rate 1: the update direction, decoupled
    weight decay included. The train step scales it by `learning_rate_schedule(cfg)` at its step
    counter (optax's own count advances only on applied updates, so it would fall behind after a
    skipped non-finite step). `frozen`: the model has selection biases (`is_frozen`), which
    get neither updates nor weight decay. `muon` (with `cfg.optimizer` muon): the matrices Muon
    moves, `{path: dimension numbers}` (`muon_dimensions`); every other parameter takes AdamW."""
    adamw = optax.adamw(1.0, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=lambda params: decay_mask(params, cfg.no_decay))
    if cfg.optimizer == "muon":
        if muon is None:
            raise ValueError("train.optimizer=muon needs the model's matrices (`muon_dimensions`)")
        labels = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
            lambda path, _: "muon" if _key(path) in muon else "adamw", params)
        adamw = optax.partition({"muon": muon_direction(cfg, muon), "adamw": adamw}, labels)
    tx = adamw if cfg.clip_norm is None else optax.chain(clip_by_global_norm(cfg.clip_norm), adamw)
    if not frozen:
        return tx
    frozen_mask = lambda params: jax.tree_util.tree_map_with_path(lambda path, _: is_frozen(path), params)  # noqa: E731
    return optax.chain(tx, optax.masked(optax.set_to_zero(), frozen_mask))  # their gradient is zero anyway


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax's `clip_by_global_norm` (the same state, the same arithmetic) taking the norm the step
    already computed, `update(..., grad_norm=)`: the gradients are read once for it, not twice."""

    def update(updates, state, params=None, *, grad_norm=None, **extra_args):
        norm = global_norm(updates) if grad_norm is None else grad_norm
        keep = norm < max_norm
        return jax.tree.map(lambda t: jnp.where(keep, t, (t / norm.astype(t.dtype)) * max_norm), updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


# ----- Muon ---------------------------------------------------------------------------


def projection_groups(model: Transformer):
    """`(path in the parameters, module, group)` of every projection in the blocks, its group
    `attention`, `mlp` (a dense FFN, a mixture's shared experts), `experts` or `router`, told by
    the module it belongs to."""
    for s, stack in enumerate(model.stages):
        for j, block in enumerate(stack.blocks):
            router = block.mlp.router.proj if isinstance(block.mlp, MoE) else None
            for part, group in (("self_attn", "attention"), ("mlp", "mlp")):
                for path, module in nnx.iter_graph(getattr(block, part)):
                    if isinstance(module, (Proj, ExpertProj)):
                        kind = "router" if module is router else "experts" if isinstance(module, ExpertProj) else group
                        yield ("stages", s, "blocks", j, part, *path, "kernel"), module, kind


def muon_dimensions(model: Transformer, groups: tuple[str, ...]) -> dict[tuple, MuonDimensionNumbers]:
    """`{path: dimension numbers}` of the kernels Muon moves: those of the projections of `groups`,
    each `[lead..., in..., out...]` reducing over its module's `in_dims` inputs into its
    `out_dims` outputs, every leading axis (stacked `layers`, `experts`) a batch axis. The axes
    count from the end, so a pipeline's layout of the stacks (`training.layout`) reads the same."""
    dims = {}
    for path, module, group in projection_groups(model):
        if group in groups:
            out = module.out_dims
            dims[path] = MuonDimensionNumbers(reduction_axis=tuple(range(-out - module.in_dims, -out)),
                                              output_axis=tuple(range(-out, 0)))
    return dims


def _key(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def _matrices(x, dims: MuonDimensionNumbers):
    """`(x as [batch, in, out] matrices, the function back to x's shape)`."""
    rank = x.ndim
    ins, outs = [a % rank for a in dims.reduction_axis], [a % rank for a in dims.output_axis]
    lead = [a for a in range(rank) if a not in ins + outs]
    order = lead + ins + outs
    size = lambda axes: math.prod(x.shape[a] for a in axes)  # noqa: E731
    shape = tuple(x.shape[a] for a in order)
    back = [order.index(a) for a in range(rank)]
    return (jnp.transpose(x, order).reshape(size(lead), size(ins), size(outs)),
            lambda m: jnp.transpose(m.reshape(shape), back))


def newton_schulz(matrices, steps: int):
    """Each matrix of `matrices` (`[batch, rows, columns]`) orthogonalised: Jordan's quintic
    Newton-Schulz iteration `X <- a X + (b A + c A A) X`, `A = X X^T`, from `X / |X|_F`, on the
    wider orientation (a tall matrix is transposed and back), as `torch.optim.Muon` computes it
    (here in float32)."""
    a, b, c = NS_COEFFICIENTS
    x = matrices.astype(jnp.float32)
    tall = x.shape[1] > x.shape[2]
    if tall:
        x = jnp.swapaxes(x, 1, 2)
    x = x / jnp.maximum(jnp.linalg.norm(x, axis=(1, 2), keepdims=True), NS_EPS)
    for _ in range(steps):
        gram = x @ jnp.swapaxes(x, 1, 2)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return jnp.swapaxes(x, 1, 2) if tall else x


def adjusted_scale(fan_in: int, fan_out: int, how: str) -> float:
    """Muon's update scale for a `fan_in x fan_out` matrix (`torch.optim.Muon`'s `adjust_lr_fn`,
    whose rows A are a torch weight's outputs): `match_rms_adamw`, Moonlight's `0.2 sqrt(max(A, B))`
    (an update of AdamW's RMS, so AdamW's learning rate and weight decay carry over), or
    `original`, Jordan's `sqrt(max(1, A / B))`."""
    if how == "match_rms_adamw":
        return 0.2 * math.sqrt(max(fan_in, fan_out))
    return math.sqrt(max(1.0, fan_out / fan_in))


def orthogonalize(dims: dict[tuple, MuonDimensionNumbers], steps: int, adjust_lr: str) -> optax.GradientTransformation:
    """Each update (a Muon parameter's, path in `dims`) as matrices, orthogonalised
    (`newton_schulz`) and scaled by `adjusted_scale`."""

    def one(path, u):
        matrices, back = _matrices(u, dims[_key(path)])
        scale = adjusted_scale(matrices.shape[1], matrices.shape[2], adjust_lr)
        return back(newton_schulz(matrices, steps) * scale).astype(u.dtype)

    def update(updates, state, params=None):
        return jax.tree_util.tree_map_with_path(one, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def muon_direction(cfg: TrainConfig, dims: dict[tuple, MuonDimensionNumbers]) -> optax.GradientTransformation:
    """Muon's direction at learning rate 1, `-(s O + wd W)` (the module docstring). The momentum is
    optax's `trace` (`B' = mu B' + g`, Nesterov `g + mu B'`): torch's `(1 - mu) g + mu B` over
    `1 - mu`, the same matrix up to a scale the Newton-Schulz iteration divides out (one buffer
    a matrix; optax's `scale_by_muon` bias-corrects its two terms apart, which turns the direction)."""
    return optax.chain(
        optax.trace(decay=cfg.muon_momentum, nesterov=True),
        orthogonalize(dims, cfg.muon_ns_steps, cfg.muon_adjust_lr),
        optax.add_decayed_weights(cfg.weight_decay, mask=lambda params: decay_mask(params, cfg.no_decay)),
        optax.scale(-1.0))
