"""Training objectives: what a run's batches hold, the loss it minimises and what it reports.

    next_token   the default: next-token cross-entropy with z-loss, on packed text or chats
    dpo          a `dpo:` section: preference tuning on pairs (DPO, cDPO, IPO; TRL's metrics)
    grpo         a `grpo:` section: reinforcement learning from rewards on completions the model
                 samples (GRPO, Dr. GRPO, DAPO, BNPO, GSPO; TRL's metrics)

A run file names at most one objective's section. Each objective is the module of this
package named after its section, holding `Config` and `Objective` (`base`); adding one is that
module and its section's name in `configfile.OBJECTIVES`.
"""

from __future__ import annotations

import dataclasses
import importlib

from modern_jax.configfile import OBJECTIVES, check_keys
from modern_jax.training.objectives.base import Config, Objective

DEFAULT = "next_token"


def _module(name: str):
    return importlib.import_module(f"modern_jax.training.objectives.{name}")


def config_of(raw: dict, train, where: str) -> Config:
    """The objective a run file's contents choose (its section, validated against `train`, a
    TrainConfig), or next-token's."""
    named = [name for name in OBJECTIVES if name in raw]
    if len(named) > 1:
        raise ValueError(f"{where}: sections {', '.join(named)} each choose a training objective; a run trains "
                         f"for one: keep one of them")
    if not named:
        return _module(DEFAULT).Config()
    cls, values = _module(named[0]).Config, dict(raw[named[0]] or {})
    check_keys(named[0], values, [f.name for f in dataclasses.fields(cls)])
    config = cls(**values)
    config.check(train, where)
    return config


def objective(config: Config, train) -> Objective:
    """The objective of `config` (from `config_of`) for a run trained as `train` says."""
    return _module(config.section or DEFAULT).Objective(config, train)


__all__ = ["Config", "Objective", "config_of", "objective"]
