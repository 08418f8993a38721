"""Training: the run config, loss, optimiser, jitted steps on a mesh, Orbax checkpoints and the loop."""

from modern_jax.training.config import RunConfig, TrainConfig, load_run_config, run_config_from_dict
from modern_jax.training.evaluation import evaluate_batches
from modern_jax.training.loop import Initial, TrainingDiverged, TrainResult, train
from modern_jax.training.trainer import Trainer, trainer_for

__all__ = [
    "Initial",
    "RunConfig",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "TrainingDiverged",
    "evaluate_batches",
    "load_run_config",
    "run_config_from_dict",
    "train",
    "trainer_for",
]
