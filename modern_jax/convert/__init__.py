"""Checkpoint interop with Hugging Face: config translation and streaming weight conversion.

    cfg, model = from_hf("hf_dir", dtype="bfloat16")     # safetensors -> Transformer
    to_hf(model, "out_dir", model_type="llama")           # Transformer -> safetensors
    convert_from_hf("hf_dir", "ckpt")                     # -> config.yaml + params/ (Orbax)
    convert_to_hf("ckpt", "hf_out")                       # and back
    run, init = finetune_run(run, "hf_dir")               # train(run, init=init) fine-tunes it
"""

from modern_jax.convert.conversions import (convert_from_hf, convert_to_hf, finetune_run, initial_weights,
                                          load_checkpoint)
from modern_jax.training.checkpoint import save_checkpoint
from modern_jax.convert.hf_checkpoint import CheckpointError, from_hf, resolve_hf, to_hf
from modern_jax.convert.hf_config import config_from_hf, config_to_hf
from modern_jax.convert.hf_families import SUPPORTED_MODEL_TYPES

__all__ = [
    "SUPPORTED_MODEL_TYPES", "CheckpointError", "config_from_hf", "config_to_hf", "convert_from_hf",
    "convert_to_hf", "finetune_run", "from_hf", "initial_weights", "load_checkpoint", "resolve_hf",
    "save_checkpoint", "to_hf",
]
