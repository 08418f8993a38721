"""modern_jax: the modern decoder-only transformer family as one configurable Flax NNX model."""

from modern_jax.config import ModelConfig, RopeScaling, model_config_from_file
from modern_jax.convert import from_hf, to_hf
from modern_jax.model import Transformer

__all__ = ["ModelConfig", "RopeScaling", "Transformer", "from_hf", "model_config_from_file", "to_hf"]
