"""Next-token cross-entropy plus z-loss, over vocabulary chunks.

Letters (the package legend): B batch, T length, D model, V vocabulary (a chunk of it is V too).

    lse    = logsumexp_v z[b, t, v]                     z = the output logits
    ce     = sum_{b,t} w[b, t] (lse - z[b, t, target])   w: 1 on real targets, 0 on padding
    z_loss = sum_{b,t} w[b, t] lse^2                     (PaLM; weighted by beta_z ~ 1e-4)
    loss   = (ce + beta_z z_loss) / sum w

The logits are made `chunk` vocabulary entries at a time: a running max and sum give the
logsumexp (the online softmax), the target's logit is picked from the chunk that holds
it, and the chunk body is rematerialised in the backward pass, so the float32 logits of
the whole batch (`B T V` numbers) never exist at once. The same pass records
max |logit| (an instability diagnostic).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from modern_jax import execution
from modern_jax.ops import vocab


def _chunk(h_BTD, head: vocab.Head, first, targets_BT, temperature: float = 1.0, entropy: bool = False):
    """Max, sum of exp(z - max), the target's logit (0 if not in this chunk) and max |z| over
    the rows of `head`, whose global ids start at `first`; with `entropy`, also the sum of
    exp(z - max) z (for the entropy `lse - that / sum`). `z` is the logits over `temperature`
    (max |z| is the logits' own).

    Without a soft-cap the logits are written in the compute dtype (accumulated in float32 by the
    matmul, rounded once, as the head's gradient is): the statistics are float32. The target's
    logit is picked by comparing ids, in the same pass over the logits as the max and the sum
    (no gather reading them again)."""
    rows = head.w_VD.shape[0]
    z_BTV = head.logits(h_BTD, first, dtype=jnp.float32 if head.softcap is not None else h_BTD.dtype)
    real_V = head.real(first)  # chunk padding, and the model's padding rows
    z_BTV = z_BTV.astype(jnp.float32)
    max_abs = jnp.max(jnp.where(real_V[None, None, :], jnp.abs(z_BTV), 0.0))
    if temperature != 1.0:
        z_BTV = z_BTV / temperature
    # a stabiliser: lse = m + log sum exp(z - m) for any m, so no gradient needs to flow through it
    m_BT = jax.lax.stop_gradient(jnp.max(z_BTV, axis=-1))
    e_BTV = jnp.exp(z_BTV - m_BT[..., None])
    s_BT = jnp.sum(e_BTV, axis=-1)
    target_BTV = (jnp.arange(rows)[None, None, :] == (targets_BT - first)[..., None]) & real_V[None, None, :]
    z_target_BT = jnp.sum(jnp.where(target_BTV, z_BTV, 0.0), axis=-1)
    if not entropy:
        return m_BT, s_BT, z_target_BT, max_abs
    ez_BT = jnp.sum(jnp.where(real_V[None, None, :], e_BTV * z_BTV, 0.0), axis=-1)  # padding rows: z is -inf there
    return m_BT, s_BT, z_target_BT, max_abs, ez_BT


def vocab_parts(h_BTD, head: vocab.Head, targets_BT, first, *, chunk: int = 8192, temperature: float = 1.0,
                entropy: bool = False):
    """`_chunk`'s figures over the rows of `head`, whose global ids start at `first`, made in
    `n = ceil(rows / chunk)` equal chunks of at most `chunk` rows (so at most n - 1 rows of padding)."""
    rows = head.w_VD.shape[0]
    head = head.replace(w_VD=head.w_VD.astype(h_BTD.dtype))  # sliced in the compute dtype
    if rows <= chunk:
        return _chunk(h_BTD, head, first, targets_BT, temperature, entropy)
    n = -(-rows // chunk)
    chunk = -(-rows // n)
    w_pad_VD = jnp.pad(head.w_VD, ((0, n * chunk - rows), (0, 0)))
    b_pad_V = None if head.b_V is None else jnp.pad(head.b_V, (0, n * chunk - rows))
    # rows past this shard's own are chunk padding: mask them as if they were past the vocabulary
    real = jnp.minimum(head.vocab_size, first + rows)

    def chunk_i(i):
        w_chunk_VD = jax.lax.dynamic_slice_in_dim(w_pad_VD, i * chunk, chunk)
        b_chunk_V = None if b_pad_V is None else jax.lax.dynamic_slice_in_dim(b_pad_V, i * chunk, chunk)
        chunk_head = head.replace(w_VD=w_chunk_VD, b_V=b_chunk_V, vocab_size=real)
        return _chunk(h_BTD, chunk_head, first + i * chunk, targets_BT, temperature, entropy)

    @jax.checkpoint
    def body(carry, i):
        new = chunk_i(i)
        m_new = jnp.maximum(carry[0], new[0])
        old_scale, new_scale = jnp.exp(carry[0] - m_new), jnp.exp(new[0] - m_new)
        combined = (m_new, carry[1] * old_scale + new[1] * new_scale, carry[2] + new[2], jnp.maximum(carry[3], new[3]))
        if entropy:  # the sum of exp(z - m) z rescales as the sum does
            combined += (carry[4] * old_scale + new[4] * new_scale,)
        return combined, None

    # the first chunk starts the running values (so they carry the inputs' sharding types)
    return jax.lax.scan(body, jax.checkpoint(chunk_i)(0), jnp.arange(1, n), unroll=not execution.current().scan_layers)[0]


def loss_sums(h_BTD, w_VD, b_V, targets_BT, weights_BT, *, softcap=None, chunk: int = 8192,
              vocab_size: int | None = None) -> dict:
    """Sums over the batch: `ce`, `z_loss` (sum of w lse^2), `weight`, and `max_abs_logit`, for
    the output head `w[V, D]`, bias `b[V]` or None and final `softcap` (`ops.vocab.Head`).

    `vocab_size`: the real vocabulary when `w` has padding rows after it. Under a mesh that
    splits the vocabulary, each device works on its own rows (`ops.vocab.split_parts`).
    """
    head = vocab.Head(w_VD, b_V, softcap, w_VD.shape[0] if vocab_size is None else vocab_size)
    lse_BT, z_target_BT, max_abs = _target_parts(h_BTD, head, targets_BT, chunk)
    w_BT = weights_BT.astype(jnp.float32)
    return {
        "ce": jnp.sum(w_BT * (lse_BT - z_target_BT)),
        "z_loss": jnp.sum(w_BT * jnp.square(lse_BT)),
        "weight": jnp.sum(w_BT),
        "max_abs_logit": jax.lax.stop_gradient(max_abs),
    }


def _target_parts(h_BTD, head: vocab.Head, targets_BT, chunk: int):
    """`(lse, target logit, max |z|)`, `[B, T]` each but the last, over the vocabulary chunks (and shards)."""
    parts = functools.partial(vocab_parts, chunk=chunk)
    m_BT, s_BT, z_target_BT, max_abs = vocab.split_parts(parts, h_BTD, head, targets_BT)
    return m_BT + jnp.log(s_BT), z_target_BT, max_abs


@jax.named_scope("logps")
def token_logps(model, batch: dict, *, chunk: int = 8192, temperature: float = 1.0, entropy: bool = False,
                dropout_rng=None, diagnostics: bool = False) -> tuple:
    """`(logps[B, T], entropy[B, T] or None, max |logit|)`: each target's log-probability under
    the model's next-token distribution at `temperature` (softmax of the logits over it), and with
    `entropy` that distribution's entropy (in nats; no gradient)."""
    h_BTD, _ = model.hidden_states(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                                   dropout_rng=dropout_rng, diagnostics=diagnostics)
    parts = functools.partial(vocab_parts, chunk=chunk, temperature=temperature, entropy=entropy)
    m_BT, s_BT, z_target_BT, max_abs, *ez = vocab.split_parts(parts, h_BTD, model.head(), batch["targets"])
    lse_BT = m_BT + jnp.log(s_BT)
    entropy_BT = jax.lax.stop_gradient(lse_BT - ez[0] / s_BT) if entropy else None
    return z_target_BT - lse_BT, entropy_BT, jax.lax.stop_gradient(max_abs)


def per_sequence(x_BT, sequence_BT, S: int):
    """`[S]`: the sums of `x` over each sequence's tokens, sequence s being the tokens whose
    `sequence` is s (a packed batch's rows hold several; a sequence no token names sums to 0)."""
    return jax.ops.segment_sum(x_BT.reshape(-1), sequence_BT.reshape(-1), num_segments=S)


@jax.named_scope("loss")
def model_loss_sums(model, batch: dict, *, chunk: int = 8192, dropout_rng=None, diagnostics: bool = False,
                    mtp: bool = True) -> dict:
    """Forward a packed batch (`[B, T]` arrays) and return the `loss_sums` (`diagnostics`: the
    model also sows its max attention logit, see `Transformer.hidden_states`); with `mtp` and a model
    with multi-token-prediction modules, also `mtp_ce_{k}`, module k's `ce` (`mtp_sums`)."""
    h_BTD, _ = model.hidden_states(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                                   dropout_rng=dropout_rng, diagnostics=diagnostics)
    head = model.head()
    sums = loss_sums(h_BTD, head.w_VD, head.b_V, batch["targets"], batch["weights"], softcap=head.softcap,
                     chunk=chunk, vocab_size=head.vocab_size)
    if mtp and getattr(model, "mtp", None) is not None:
        sums.update(mtp_sums(model, h_BTD, batch, chunk=chunk, dropout_rng=dropout_rng, diagnostics=diagnostics))
    return sums


def mtp_targets(batch: dict, k: int) -> tuple:
    """`(targets, weights)` `[B, T]` of MTP module k: row i predicts `targets[i + k]` (token i + k + 1), weighted
    as that target is when it lies in the batch and in row i's document (a packed window's next document
    is not predicted), else 0."""
    T = batch["targets"].shape[1]
    ahead = lambda x: jnp.roll(x, -k, axis=1)  # noqa: E731
    inside_BT = (jnp.arange(T) < T - k)[None] & (ahead(batch["segment_ids"]) == batch["segment_ids"])
    return ahead(batch["targets"]), jnp.where(inside_BT, ahead(batch["weights"]), 0)


def mtp_sums(model, h_BTD, batch: dict, *, chunk: int = 8192, dropout_rng=None, diagnostics: bool = False) -> dict:
    """`{mtp_ce_k: sum_i w_k[i] CE(module k's logits at row i, targets[i + k])}` for k = 1 .. D (DeepSeek-V3's
    L_MTP^k times the batch's weight), from the main model's final hidden states `h` (`Transformer.mtp_states`)."""
    states, _ = model.mtp_states(h_BTD, batch["inputs"], batch["positions"], batch["segment_ids"],
                                 dropout_rng=dropout_rng, diagnostics=diagnostics)
    head, out = model.head(), {}
    for k, h_k_BTD in enumerate(states, 1):
        targets_BT, weights_BT = mtp_targets(batch, k)
        out[f"mtp_ce_{k}"] = loss_sums(h_k_BTD, head.w_VD, head.b_V, targets_BT, weights_BT, softcap=head.softcap,
                                       chunk=chunk, vocab_size=head.vocab_size)["ce"]
    return out
