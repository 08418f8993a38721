"""modern_jax: the modern decoder-only transformer family as one configurable Flax NNX model.

The names below load on first use, so `import modern_jax.model` brings in no checkpoint,
optimiser or data library.

Letters, in every einsum string and shape suffix (`x_BTD`); a tile, block or chunk of an
axis is written with the letter of the axis it slices (a key tile of a kernel is `S`, a
vocabulary chunk of the loss is `V`):

| letter | meaning | letter | meaning |
|---|---|---|---|
| B | batch | K | key / value heads |
| T | query (input, generated) length | G | query heads per key / value head (N = K G); a router's expert groups |
| S | key length (cache slots) | H | head dim of queries and keys |
| D | model width | U | head dim of values, where it differs from H (MLA) |
| F | FFN width | V | vocabulary |
| N | query heads | L | layers |
| A | micro-batches (gradient accumulation) | E | experts |
| C | MLA latent (d_c) | R | MLA rotary key dim (d_R) |
| Q | MLA query rank | X | MLA's joint latent and rotary projection (C + R) |
| M | rows of a flattened op (every leading axis) | P | programs / blocks of a kernel grid; devices of a mesh axis |
| I, J | query / key block indices of a kernel grid | Y | experts chosen per token (top-k) |
| Z | token-expert assignments (M Y; slots are a chunk of them) | W, O | a projection's input / output width |
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
