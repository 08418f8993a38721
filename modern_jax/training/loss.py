"""Next-token cross-entropy plus z-loss, over vocabulary chunks.

Letters: B batch, T length, D model, V vocab, C vocabulary chunk.

    lse    = logsumexp_v z[b, t, v]                     z = the output logits (float32)
    ce     = sum_{b,t} w[b, t] (lse - z[b, t, target])   w: 1 on real targets, 0 on padding
    z_loss = sum_{b,t} w[b, t] lse^2                     (PaLM; weighted by beta_z ~ 1e-4)
    loss   = (ce + beta_z z_loss) / sum w

The logits are made `C` vocabulary entries at a time: a running max and sum give the
logsumexp (the online softmax), the target's logit is picked from the chunk that holds
it, and the chunk body is rematerialised in the backward pass, so the float32 logits of
the whole batch (`B T V` numbers) never exist at once. The same pass records
max |logit| (an instability diagnostic).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from modern_jax.ops import vocab

NEG = jnp.finfo(jnp.float32).min


def output_head(model):
    """`(w[V, D], bias[V] or None, final softcap)` of the model's output head (V may include
    padding rows past `cfg.vocab_size`; the loss masks them)."""
    if model.lm_head is None:
        return model.embed_tokens[...], None, model.cfg.final_softcap
    bias = None if model.lm_head.bias is None else model.lm_head.bias[...]
    return model.lm_head.kernel[...].T, bias, model.cfg.final_softcap


def _chunk(h_BTD, w_CD, b_C, first, targets_BT, softcap, vocab_size):
    """Max, sum of exp(z - max), the target's logit (0 if not in this chunk) and max |z|."""
    C = w_CD.shape[0]
    z_BTC = jnp.einsum("BTD,CD->BTC", h_BTD, w_CD.astype(h_BTD.dtype), preferred_element_type=jnp.float32)
    if b_C is not None:
        z_BTC = z_BTC + b_C.astype(jnp.float32)
    if softcap is not None:
        z_BTC = softcap * jnp.tanh(z_BTC / softcap)
    real_C = first + jnp.arange(C) < vocab_size  # chunk padding, and the model's padding rows
    z_BTC = jnp.where(real_C, z_BTC, NEG)
    m_BT = jnp.max(z_BTC, axis=-1)
    s_BT = jnp.sum(jnp.exp(z_BTC - m_BT[..., None]), axis=-1)
    local_BT = targets_BT - first
    here_BT = (local_BT >= 0) & (local_BT < C) & (targets_BT < vocab_size)  # not in padding rows
    z_target_BT = jnp.take_along_axis(z_BTC, jnp.clip(local_BT, 0, C - 1)[..., None], axis=-1)[..., 0]
    z_target_BT = jnp.where(here_BT, z_target_BT, 0.0)
    max_abs = jnp.max(jnp.where(real_C, jnp.abs(z_BTC), 0.0))
    return m_BT, s_BT, z_target_BT, max_abs


def vocab_parts(h_BTD, w_VD, b_V, targets_BT, first, *, softcap=None, chunk: int = 8192, vocab_size: int):
    """Max, sum of exp(z - max), the target's logit and max |z| over the rows of `w`, whose
    global ids start at `first`, made `chunk` rows at a time (rows >= `vocab_size` are padding)."""
    if w_VD.shape[0] <= chunk:
        return _chunk(h_BTD, w_VD, b_V, first, targets_BT, softcap, vocab_size)
    n = -(-w_VD.shape[0] // chunk)
    w_PD = jnp.pad(w_VD, ((0, n * chunk - w_VD.shape[0]), (0, 0)))
    b_P = None if b_V is None else jnp.pad(b_V, (0, n * chunk - w_VD.shape[0]))
    # rows past this shard's own are chunk padding: mask them as if they were past the vocabulary
    real = jnp.minimum(vocab_size, first + w_VD.shape[0])

    def chunk_i(i):
        w_CD = jax.lax.dynamic_slice_in_dim(w_PD, i * chunk, chunk)
        b_C = None if b_P is None else jax.lax.dynamic_slice_in_dim(b_P, i * chunk, chunk)
        return _chunk(h_BTD, w_CD, b_C, first + i * chunk, targets_BT, softcap, real)

    @jax.checkpoint
    def body(carry, i):
        m_BT, s_BT, z_target_BT, max_abs = carry
        m_c, s_c, zt_c, max_c = chunk_i(i)
        m_new = jnp.maximum(m_BT, m_c)
        s_new = s_BT * jnp.exp(m_BT - m_new) + s_c * jnp.exp(m_c - m_new)
        return (m_new, s_new, z_target_BT + zt_c, jnp.maximum(max_abs, max_c)), None

    # the first chunk starts the running values (so they carry the inputs' sharding types)
    return jax.lax.scan(body, jax.checkpoint(chunk_i)(0), jnp.arange(1, n))[0]


def loss_sums(h_BTD, w_VD, b_V, targets_BT, weights_BT, *, softcap=None, chunk: int = 8192,
              vocab_size: int | None = None) -> dict:
    """Sums over the batch: `ce`, `z_loss` (sum of w lse^2), `weight`, and `max_abs_logit`.

    `vocab_size`: the real vocabulary when `w` has padding rows after it. Under a mesh that
    splits the vocabulary, each device works on its own rows (`ops.vocab.split_parts`).
    """
    V = w_VD.shape[0] if vocab_size is None else vocab_size
    parts = functools.partial(vocab_parts, softcap=softcap, chunk=chunk, vocab_size=V)
    m_BT, s_BT, z_target_BT, max_abs = vocab.split_parts(parts, h_BTD, w_VD, b_V, targets_BT)
    lse_BT = m_BT + jnp.log(s_BT)
    w_BT = weights_BT.astype(jnp.float32)
    return {
        "ce": jnp.sum(w_BT * (lse_BT - z_target_BT)),
        "z_loss": jnp.sum(w_BT * jnp.square(lse_BT)),
        "weight": jnp.sum(w_BT),
        "max_abs_logit": jax.lax.stop_gradient(max_abs),
    }


def model_loss_sums(model, batch: dict, *, chunk: int = 8192, dropout_rng=None) -> dict:
    """Forward a packed batch (`[B, T]` arrays) and return the `loss_sums`."""
    h_BTD, _ = model.hidden_states(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                                   dropout_rng=dropout_rng)
    w_VD, b_V, softcap = output_head(model)
    return loss_sums(h_BTD, w_VD, b_V, batch["targets"], batch["weights"], softcap=softcap, chunk=chunk,
                     vocab_size=model.cfg.vocab_size)
