"""Instability diagnostics that need a look inside the blocks: max |attention logit|.

The model does not expose its attention logits, so this runs one extra forward pass (at
log steps only) of the same parameters through an unscanned copy of the model, with the
attention call wrapped to record `max |q . k| * scale` over the visible query-key pairs
of every layer (before any soft-cap). The training step itself is untouched.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

import modern_jax.layers.attention as attention_layers
from modern_jax.config import ModelConfig
from modern_jax.kernels import attention_mask
from modern_jax.training.step import abstract_model


@contextlib.contextmanager
def _recording_attention(found: list):
    original = attention_layers.attention

    def recorded(q_BTKGH, k_BSKH, v_BSKV, spec, **kw):
        s_BTKGS = jnp.einsum("BTKGH,BSKH->BTKGS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32) * spec.scale
        mask_BTS = attention_mask(kw["q_pos_BT"], kw["k_pos_BS"], kw.get("q_seg_BT"), kw.get("k_seg_BS"),
                                  causal=spec.causal, window=spec.window)
        found.append(jnp.max(jnp.where(mask_BTS[:, :, None, None, :], jnp.abs(s_BTKGS), 0.0)))
        return original(q_BTKGH, k_BSKH, v_BSKV, spec, **kw)

    attention_layers.attention = recorded
    try:
        yield
    finally:
        attention_layers.attention = original


def attention_logit_probe(cfg: ModelConfig):
    """A jitted `(params, batch [B, T]) -> max |attention logit|` for models of `cfg`."""
    from flax import nnx

    graphdef, _ = abstract_model(cfg.replace(scan_layers=False, remat="none"))

    @jax.jit
    def probe(params, batch):
        found: list = []
        with _recording_attention(found):
            nnx.merge(graphdef, params).hidden_states(batch["inputs"], positions=batch["positions"],
                                                      segment_ids=batch["segment_ids"])
        return jnp.max(jnp.stack(found))

    return probe
