"""AdamW with global-norm clipping, a warmup + cosine / WSD / constant schedule and a
weight-decay mask (by default no decay on embeddings, norms and biases)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from modern_jax.training.config import TrainConfig


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


def make_optimizer(cfg: TrainConfig, frozen: bool = False) -> optax.GradientTransformation:
    """Clipping and AdamW at learning rate 1: the update direction, decoupled weight decay
    included. The train step scales it by `learning_rate_schedule(cfg)` at its step counter
    (optax's own count advances only on applied updates, so it would fall behind after a
    skipped non-finite step). `frozen`: the model has selection biases (`is_frozen`), which
    get neither updates nor weight decay."""
    adamw = optax.adamw(1.0, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=lambda params: decay_mask(params, cfg.no_decay))
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
