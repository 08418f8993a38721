"""modern_jax: the modern decoder-only transformer family as one configurable Flax NNX model.

The names below load on first use, so `import modern_jax.model` brings in no checkpoint,
optimiser or data library.

The letters of every einsum string and shape suffix (`x_BTD`), one meaning each (the one legend: a
module's docstring names the letters it uses, in these meanings). A tile, block or chunk of an axis takes the
letter of the axis it slices (a key tile of a kernel is `S`, a vocabulary chunk of the loss `V`,
an expert's capacity slots `Z`); a digit is an axis of that size (`1` a broadcast axis, `2` a
pair: a fused projection's gate and up, a preference pair's chosen and rejected); an axis with
no letter here is named in words (the router's groups of experts, a data set's preference
pairs). `tests/test_architecture.py` checks every einsum string of the package against it.

| letter | meaning |
|---|---|
| A | micro-batches (gradient accumulation) |
| B | batch: rows of tokens (a host's or a device's rows are a chunk of them) |
| C | MLA's key / value latent (`mla_kv_rank`, d_c) |
| D | model width: a token's features (a norm kernel's row, whatever it normalises) |
| E | experts |
| F | FFN width (an expert's too) |
| G | query heads per key / value head (N = K G) |
| H | head dim of queries and keys |
| I | blocks of a kernel grid along its rows: query blocks, a norm kernel's row blocks |
| J | key blocks of a kernel grid |
| K | key / value heads |
| L | layers |
| M | rows of a flattened op: every leading axis (tokens: B T) |
| N | query heads |
| O | output width of a matmul that serves several projections (an expert's gate, up, down) |
| P | devices of a mesh axis |
| Q | MLA's query latent (`mla_q_rank`, d_c') |
| R | rotary features: those RoPE rotates, MLA's decoupled rotary key (d_R) |
| S | key length (cache slots) |
| T | query length: input, generated (a packed window before the shift holds T + 1 tokens) |
| U | head dim of values, where it differs from H (MLA) |
| V | vocabulary |
| W | input width of a matmul that serves several projections (as O; MTP's `eh_proj`: an embedding and a hidden state side by side) |
| X | MLA's latent and rotary key side by side (C + R) |
| Y | experts chosen per token (top-k) |
| Z | token-expert assignments (M Y) |
"""

import importlib

_EXPORTS = {
    "ModelConfig": "modern_jax.config",
    "RopeScaling": "modern_jax.config",
    "model_config_from_file": "modern_jax.config",
    "Transformer": "modern_jax.model",
    "from_hf": "modern_jax.convert",
    "to_hf": "modern_jax.convert",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'modern_jax' has no attribute {name!r}")
