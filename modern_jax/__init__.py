"""modern_jax: the modern decoder-only transformer family as one configurable Flax NNX model.

The names below load on first use, so `import modern_jax.model` brings in no checkpoint,
optimiser or data library.

Letters, in every einsum string and shape suffix (`x_BTD`):

| letter | meaning | letter | meaning |
|---|---|---|---|
| B | batch | K | key / value heads |
| T | query (input) length | G | query heads per key / value head (N = K G) |
| S | key length (cache slots) | H | head dim of queries and keys |
| D | model width | V | vocabulary |
| F | FFN width | A | micro-batches (gradient accumulation) |
| N | query heads | L | layers |
| C | MLA latent (d_c) | R | MLA rotary key dim (d_R) |
| Q | MLA query rank | E | experts |

The value head dim is H too (every family here has equal query and value head dims),
except MLA's `mla_v_dim`, written `H` in its value projection's own einsums; a vocabulary
chunk of the loss is `V` of its slice.
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
