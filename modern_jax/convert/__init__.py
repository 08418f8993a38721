"""Checkpoint interop with Hugging Face: config translation and weight conversion."""

from modern_jax.convert.hf_config import SUPPORTED_MODEL_TYPES, config_from_hf, config_to_hf

__all__ = ["SUPPORTED_MODEL_TYPES", "config_from_hf", "config_to_hf"]
