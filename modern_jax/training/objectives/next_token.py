"""Next-token cross-entropy, the default objective (a run file without an objective's section).

    loss = (ce + train.z_loss_weight z_loss) / sum w      (`training.loss.loss_sums`)
           + train.mtp_loss_weight / D sum_k mtp_ce_k / sum w   (a model with D MTP modules: `mtp_sums`)

over packed windows of `train.seq_len` tokens (documents, or conversations with only the
assistant's tokens weighted); the evaluation also gives bits per byte.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from modern_jax.data.corpora import load_splits, load_stream
from modern_jax.data.batches import eval_batches, n_eval_windows, train_iterator
from modern_jax.training.loss import model_loss_sums
from modern_jax.training.metrics import Shown
from modern_jax.training.objectives import base


def mtp_names(sums: dict) -> list[str]:
    """The multi-token-prediction modules' sums, `mtp_ce_1` .. `mtp_ce_D` (none without them)."""
    return sorted((name for name in sums if name.startswith("mtp_ce_")), key=lambda name: int(name[7:]))


class NextTokenConfig(base.Config):
    """No section: every setting is `train:`'s (`z_loss_weight`, `loss_vocab_chunk`)."""


class NextToken(base.Objective):
    unit, eval_unit = "tokens", "window"
    display = Shown("loss (nats / token)", console=(("bpb", "bpb"),))

    def read(self, run, tokenizer, shared):
        return load_splits(run.data, tokenizer, run.vocab_size, shared=shared)

    def read_all(self, run, tokenizer):
        return load_stream(run.data, tokenizer)

    def train_batches(self, split, *, rows, data, state):
        tc = self.train
        return train_iterator(split, seq_len=tc.seq_len, batch_size=tc.batch_size, grad_accum=tc.grad_accum,
                              seed=tc.seed, rows=rows, num_threads=data.num_threads, prefetch=data.prefetch,
                              state=state)

    def eval_batches(self, split, *, max_windows, rows):
        tc = self.train
        return eval_batches(split, seq_len=tc.seq_len, batch_size=tc.eval_batch_size, max_windows=max_windows,
                            rows=rows)

    def eval_size(self, split) -> int:
        return n_eval_windows(split, self.train.seq_len)

    def sums(self, model, batch, prepared, *, chunk, dropout_rng, diagnostics):
        return model_loss_sums(model, batch, chunk=chunk, dropout_rng=dropout_rng, diagnostics=diagnostics)

    def denominator(self, batch):
        return jnp.maximum(jnp.sum(batch["weights"]), 1.0)  # a mean over all real targets

    def loss(self, sums, denominator):
        loss = (sums["ce"] + self.train.z_loss_weight * sums["z_loss"]) / denominator
        mtp = mtp_names(sums)
        if mtp:  # DeepSeek-V3's lambda / D sum_k L_MTP^k
            loss = loss + self.train.mtp_loss_weight / len(mtp) * sum(sums[name] for name in mtp) / denominator
        return loss

    def metrics(self, sums, denominator):
        return {"loss": sums["ce"] / denominator, "z_loss": sums["z_loss"] / denominator,
                **{name.replace("_ce_", "_loss_"): sums[name] / denominator for name in mtp_names(sums)}}

    def eval_sums(self, model, batch, prepared, token_bytes, *, chunk):
        sums = model_loss_sums(model, batch, chunk=chunk, mtp=False)
        n_bytes = jnp.sum(token_bytes[batch["targets"]] * batch["weights"])
        return {"ce": sums["ce"], "weight": sums["weight"], "bytes": n_bytes}

    def eval_values(self, totals):
        ce, weight, n_bytes = float(totals["ce"]), float(totals["weight"]), float(totals["bytes"])
        return {"loss": ce / max(weight, 1.0), "bpb": ce / math.log(2) / max(n_bytes, 1.0), "tokens": int(weight)}


Config, Objective = NextTokenConfig, NextToken
