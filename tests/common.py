"""What the test files share: the compile level, one device, and a mesh against one
device, gradient leaf by gradient leaf (of a forward pass, or of a whole training step).

A training step's gradient is read back from its AdamW update: at the first step Adam's
bias-corrected moments are `g` and `g^2`, so with no clipping and no weight decay the step
moves each parameter by `lr * d`, `d = g / (|g| + eps)`, and `g = eps d / (1 - |d|)` exactly.
`PROBE` sets that up (eps = 1 keeps `d` proportional to `g` for small gradients, lr = 1e3
makes the move large against the parameter it is added to), so the gradient is compared
itself, not the nearly sign-like step of the default eps.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
from flax import nnx

from modern_jax.sharding.mesh import make_mesh

QUICK_FLAG = "--xla_backend_optimization_level=0"  # every program here is tiny (tests/conftest.py)
DEFAULT_LEVEL = {"xla_backend_optimization_level": 3}  # XLA's own default, for the test that checks it


@contextlib.contextmanager
def default_compiles():
    """The trainer's steps compiled at XLA's default optimisation level while inside, not at the
    suite's level 0."""
    from modern_jax.training import programs

    before, programs.COMPILER_OPTIONS = programs.COMPILER_OPTIONS, DEFAULT_LEVEL
    try:
        yield
    finally:
        programs.COMPILER_OPTIONS = before


def make_trainer(model_cfg, train_cfg, mesh, rules=None, *, strategies=None, context_layout: str = "two_chunk",
                 execution=None, lora=None, objective=None, optimizer: bool = True):
    """A Trainer of these parts through `trainer_for` (the one way to build one): the run config
    they make on `mesh` (`rules`: a whole rules table; `strategies`: a `sharding.Strategies`;
    `lora`: a LoRAConfig; `objective`: an objective already made, else next-token)."""
    from modern_jax.data.config import DataConfig
    from modern_jax.execution import ExecutionConfig
    from modern_jax.sharding import ParallelConfig, Strategies
    from modern_jax.training import RunConfig, trainer_for

    strategies = strategies or Strategies()
    fields = {f.name: getattr(strategies, f.name) for f in dataclasses.fields(Strategies)}
    if mesh.shape.get("stage", 1) == 1:  # a pipeline's strategies mean nothing without stages (a baseline's mesh)
        fields.update(microbatches=1, pipeline_schedule="gpipe", stage_repeats=1)
    parallel = ParallelConfig(stage=mesh.shape.get("stage", 1), rules=tuple(rules or ()),
                              context_layout=context_layout, **fields)
    run = RunConfig(model_cfg.to_dict(), train_cfg, DataConfig(), parallel, execution or ExecutionConfig(), lora=lora)
    return trainer_for(run, mesh, objective=objective, optimizer=optimizer)


PROBE = dict(lr=1e3, eps=1.0, weight_decay=0.0, clip_norm=None, warmup_steps=0, schedule="constant")


def one_device():
    return make_mesh(devices=jax.devices()[:1])


def leaves(tree) -> dict[str, np.ndarray]:
    """`{path: array}` of a pytree or an nnx State."""
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in flat}


def assert_leaves_match(got, want, *, rtol: float = 1e-4, atol: float = 1e-9, what: str = "gradient"):
    """Each leaf of `got` within `rtol` of the same leaf of `want`, in norm: `|g - w| <= atol +
    rtol |w|`, so one leaf scaled by 2 (or a sign flipped) fails even when it is small next to
    the others."""
    got, want = leaves(got), leaves(want)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    bad = {path: float(np.linalg.norm(got[path] - w) / max(np.linalg.norm(w), 1e-30)) for path, w in want.items()
           if got[path].shape != w.shape or not np.linalg.norm(got[path] - w) <= atol + rtol * np.linalg.norm(w)}
    assert not bad, f"{what} leaves off by more than {rtol:g} of their norm (relative errors): {bad}"


def probe(tc):
    """`tc` set up so that one training step reveals its gradient (`step_gradients`)."""
    return dataclasses.replace(tc, **PROBE)


def step_gradients(trainer, state, batch) -> tuple[dict, dict]:
    """`(gradient, metrics)` of one training step from `state` on `batch` (host arrays), read
    back from the update; the trainer's config must be `probe(...)`'d."""
    cfg = trainer.train_cfg
    assert (cfg.eps, cfg.weight_decay, cfg.clip_norm) == (1.0, 0.0, None), "make the train config with probe()"
    before = jax.device_get(state["params"])
    new_state, metrics = trainer.train_step(state, trainer.batches.put(batch))
    metrics = jax.device_get(metrics)
    assert bool(metrics["finite"]), metrics

    def gradient(old, new):
        d = (np.asarray(old, np.float64) - np.asarray(new, np.float64)) / float(metrics["lr"])
        return cfg.eps * d / (1.0 - np.abs(d))

    after = jax.device_get(new_state["params"])
    model = trainer.states.model_params  # the model's layout (a run may hold its stacks for an interleaved pipeline)
    return jax.tree.map(gradient, model(before), model(after)), metrics


def train_step_gradients(model_cfg, tc, mesh, batch, rules=None, seed: int = 0, **trainer) -> tuple[dict, dict]:
    """`step_gradients` of a fresh Trainer on `mesh` (initialised from `seed`); `trainer`: its
    `execution=` and `strategies=`."""
    trainer = make_trainer(model_cfg, probe(tc), mesh, rules, **trainer)
    return step_gradients(trainer, trainer.states.init(seed), batch)


def assert_step_matches_one_device(model_cfg, tc, mesh, batch, *, rules=None, rtol: float = 1e-4,
                                   **trainer) -> tuple[dict, dict]:
    """One training step on `mesh` against one device from the same state and batch, both with
    the `trainer` settings (`execution=`, `strategies=`): the loss (1e-5 relative) and every
    gradient leaf (`assert_leaves_match`). Returns both metrics."""
    want, one = train_step_gradients(model_cfg, tc, one_device(), batch, **trainer)
    got, many = train_step_gradients(model_cfg, tc, mesh, batch, rules, **trainer)
    np.testing.assert_allclose(many["loss"], one["loss"], rtol=1e-5)
    assert_leaves_match(got, want, rtol=rtol)
    return many, one


def token_batch(A: int, B: int, T: int, V: int, seed: int = 5) -> dict:
    """`A` micro-batches of `B` random rows of `T` tokens: a training batch (`[A, B, T]` arrays)."""
    tokens = np.random.default_rng(seed).integers(0, V, (A, B, T + 1))
    return {"inputs": tokens[..., :-1].astype(np.int32), "targets": tokens[..., 1:].astype(np.int32),
            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (A, B, T)).copy(),
            "segment_ids": np.ones((A, B, T), np.int32), "weights": np.ones((A, B, T), np.float32)}


def lora_model(cfg, lora, seed: int = 0):
    """`Transformer(cfg)` converted by LoRA `lora`, its adapters drawn from the same seed's stream
    right after the base's (as a LoRA run's `init` draws them)."""
    from modern_jax.model import Transformer
    from modern_jax.training.converters import LoRA

    rngs = nnx.Rngs(seed)
    return LoRA(lora).convert(Transformer(cfg, rngs=rngs), rngs)
