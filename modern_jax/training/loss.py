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
from modern_jax.training.metrics import Shown


def _chunk(h_BTD, head: vocab.Head, first, targets_BT):
    """Max, sum of exp(z - max), the target's logit (0 if not in this chunk) and max |z| over
    the rows of `head`, whose global ids start at `first`.

    Without a soft-cap the logits are written in the compute dtype (accumulated in float32 by the
    matmul, rounded once, as the head's gradient is): the statistics are float32. The target's
    logit is picked by comparing ids, in the same pass over the logits as the max and the sum
    (no gather reading them again)."""
    rows = head.w_VD.shape[0]
    z_BTV = head.logits(h_BTD, first, dtype=jnp.float32 if head.softcap is not None else h_BTD.dtype)
    real_V = head.real(first)  # chunk padding, and the model's padding rows
    # a stabiliser: lse = m + log sum exp(z - m) for any m, so no gradient needs to flow through it
    m_BT = jax.lax.stop_gradient(jnp.max(z_BTV, axis=-1).astype(jnp.float32))
    z_BTV = z_BTV.astype(jnp.float32)
    s_BT = jnp.sum(jnp.exp(z_BTV - m_BT[..., None]), axis=-1)
    target_BTV = (jnp.arange(rows)[None, None, :] == (targets_BT - first)[..., None]) & real_V[None, None, :]
    z_target_BT = jnp.sum(jnp.where(target_BTV, z_BTV, 0.0), axis=-1)
    max_abs = jnp.max(jnp.where(real_V[None, None, :], jnp.abs(z_BTV), 0.0))
    return m_BT, s_BT, z_target_BT, max_abs


def vocab_parts(h_BTD, head: vocab.Head, targets_BT, first, *, chunk: int = 8192):
    """Max, sum of exp(z - max), the target's logit and max |z| over the rows of `head`, whose
    global ids start at `first`, made in `n = ceil(rows / chunk)` equal chunks of at most `chunk`
    rows (so at most n - 1 rows of padding)."""
    rows = head.w_VD.shape[0]
    head = head.replace(w_VD=head.w_VD.astype(h_BTD.dtype))  # sliced in the compute dtype
    if rows <= chunk:
        return _chunk(h_BTD, head, first, targets_BT)
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
        return _chunk(h_BTD, chunk_head, first + i * chunk, targets_BT)

    @jax.checkpoint
    def body(carry, i):
        m_BT, s_BT, z_target_BT, max_abs = carry
        m_c, s_c, zt_c, max_c = chunk_i(i)
        m_new = jnp.maximum(m_BT, m_c)
        s_new = s_BT * jnp.exp(m_BT - m_new) + s_c * jnp.exp(m_c - m_new)
        return (m_new, s_new, z_target_BT + zt_c, jnp.maximum(max_abs, max_c)), None

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
def sequence_logps(model, batch: dict, *, chunk: int = 8192, dropout_rng=None, diagnostics: bool = False) -> tuple:
    """`(logps[B], count[B], max |logit|)`: each row's summed log-probability of its weighted
    targets (a completion's tokens), and how many there are."""
    h_BTD, _ = model.hidden_states(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                                   dropout_rng=dropout_rng, diagnostics=diagnostics)
    lse_BT, z_target_BT, max_abs = _target_parts(h_BTD, model.head(), batch["targets"], chunk)
    w_BT = batch["weights"].astype(jnp.float32)
    return jnp.sum(w_BT * (z_target_BT - lse_BT), axis=-1), jnp.sum(w_BT, axis=-1), jax.lax.stop_gradient(max_abs)


def real_pairs(count_B):
    """`[pairs]` 1.0 for each pair (rows 2p, 2p + 1) whose completions both have a weighted token, 0.0
    for padding, from each row's count of them."""
    return jnp.all(count_B.reshape(-1, 2) > 0, axis=-1).astype(jnp.float32)


def preference_sums(logps_B, ref_B, count_B, *, beta: float, loss_type: str, label_smoothing: float = 0.0) -> dict:
    """Sums over the pairs of a batch whose rows alternate chosen, rejected (B = 2 pairs), with
    TRL's metrics: the DPO or IPO loss (`training.config.DPOConfig`), the rewards `beta (log pi -
    log ref)` of the chosen and rejected, how often the chosen's is higher, their margin, the
    policy's log-probabilities, and `pairs` (a pair with an empty completion, padding, counts 0)."""
    # [pairs, 2] (pairs have no letter): each pair's chosen and rejected rows side by side
    pi, ref, n = (x.reshape(-1, 2) for x in (logps_B, jax.lax.stop_gradient(ref_B), count_B))
    real = real_pairs(count_B)  # [pairs], as are `loss` and `delta`
    ratio = pi - ref
    if loss_type == "ipo":
        avg = ratio / jnp.maximum(n, 1.0)
        loss = jnp.square(avg[:, 0] - avg[:, 1] - 1.0 / (2.0 * beta))
    else:
        delta = ratio[:, 0] - ratio[:, 1]
        loss = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * delta) \
            - label_smoothing * jax.nn.log_sigmoid(-beta * delta)
    rewards = jax.lax.stop_gradient(beta * ratio)
    total = lambda x: jnp.sum(real * x)  # noqa: E731
    return {"dpo_loss": total(loss), "rewards/chosen": total(rewards[:, 0]),
            "rewards/rejected": total(rewards[:, 1]),
            "rewards/accuracies": total((rewards[:, 0] > rewards[:, 1]).astype(jnp.float32)),
            "rewards/margins": total(rewards[:, 0] - rewards[:, 1]),
            "logps/chosen": total(jax.lax.stop_gradient(pi[:, 0])),
            "logps/rejected": total(jax.lax.stop_gradient(pi[:, 1])), "pairs": jnp.sum(real)}


PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                      "logps/rejected")  # TRL's names: means over the pairs

# what the console and the plot show of each objective (`metrics.Shown`)
NEXT_TOKEN_SHOWN = Shown("loss (nats / token)", console=(("bpb", "bpb"),))


def preference_shown(loss_type: str, label_smoothing: float = 0.0) -> Shown:
    """DPO's: its loss per pair, the margin and accuracy on each line, and a panel of the rewards
    (chosen, rejected, their margin) and one of the accuracy."""
    loss = {"sigmoid": "cDPO loss (nats / pair)" if label_smoothing else "DPO loss (nats / pair)",
            "ipo": "IPO loss (per pair)"}[loss_type]
    return Shown(loss, console=(("rewards/margins", "margin"), ("rewards/accuracies", "accuracy")),
                 panels=(("reward: beta x log(policy / reference)", (("rewards/chosen", "chosen"),
                                                                     ("rewards/rejected", "rejected"),
                                                                     ("rewards/margins", "margin"))),
                         ("accuracy: pairs with chosen > rejected", (("rewards/accuracies", "accuracy"),))))


@jax.named_scope("loss")
def model_loss_sums(model, batch: dict, *, chunk: int = 8192, dropout_rng=None, diagnostics: bool = False) -> dict:
    """Forward a packed batch (`[B, T]` arrays) and return the `loss_sums` (`diagnostics`: the
    model also sows its max attention logit, see `Transformer.hidden_states`)."""
    h_BTD, _ = model.hidden_states(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                                   dropout_rng=dropout_rng, diagnostics=diagnostics)
    head = model.head()
    return loss_sums(h_BTD, head.w_VD, head.b_V, batch["targets"], batch["weights"], softcap=head.softcap,
                     chunk=chunk, vocab_size=head.vocab_size)
