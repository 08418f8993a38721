"""QK-norm learning-rate sensitivity (the small-scale protocol of Wortsman et al. 2023).

The model: d=256, 6 blocks, 4 heads (head_dim 64), pre-norm RMSNorm, SwiGLU (d_ff 683),
RoPE, untied head, with QK-norm (`qk_norm="head"`: RMSNorm over head_dim on q and k) and
without. Each is trained through the library's `Trainer` at the learning rates 1e-4,
10^-3.5, ..., 1e-1 (half-decade steps): AdamW (b2 0.95, weight decay 0.1, clip 1.0, z-loss
1e-4), linear warmup over the first 10% of steps, cosine decay to 0.1 x lr, char-level
tinyshakespeare (the embedded corpus when the file is missing), random windows from
`TrainBatches`, the same seed (initialisation and batches) for every run.

Per run: the final loss (the training loss averaged over the last 10% of steps; a run
with a non-finite loss there counts as diverged), the max |attention logit| (the step's
`max_attention_logit` metric, measured by its own attention with `train.diagnostics`) and
the max |output logit| (the step's `max_abs_logit` metric) over training. Per variant, the learning-rate sensitivity
E_lr[min(loss(lr), loss_0) - loss*], with loss_0 the loss at initialisation (the first
step's) and loss* the best final loss of the sweep.

Wortsman et al. train each run for 1e5 steps (5e3 of warmup, cosine to 1e-5, independent
weight decay 1e-4). The default here is 150 steps at batch 4 x 64 tokens, about 10 minutes
for the 14 runs on 2 CPU cores (each run also compiles its own step, ~10 s, since the
learning rate is part of the compiled step); `--full` is 500 steps at 32 x 128, hours on
a CPU.

    uv run python scripts/exp_qknorm_lr.py [--full] [--data PATH] [--out results/qknorm_lr]
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import numpy as np

from modern_jax.execution import ExecutionConfig
from modern_jax.config import ModelConfig
from modern_jax.data.corpora import text_or_embedded_splits
from modern_jax.data.batches import TrainBatches
from modern_jax.sharding.mesh import make_mesh
from modern_jax.report import pyplot, save_figure, write_table
from modern_jax.training.config import TrainConfig
from modern_jax.data.config import DataConfig
from modern_jax.training.config import RunConfig
from modern_jax.training.trainer import trainer_for

LEARNING_RATES = [10 ** (-4 + k / 2) for k in range(7)]  # 1e-4 ... 1e-1
VARIANTS = {"no QK-norm": "none", "QK-norm": "head"}


def run(model_cfg: ModelConfig, train_cfg: TrainConfig, stream, seed: int = 0) -> dict:
    """Train one run; its losses, final loss and the max |attention| / |output| logits."""
    run_cfg = RunConfig(model_cfg.to_dict(), train_cfg, DataConfig(), execution=ExecutionConfig(remat="dots_no_batch"))
    trainer = trainer_for(run_cfg, make_mesh(data=-1, devices=jax.devices()[:1]))
    source = TrainBatches(stream, train_cfg.seq_len, train_cfg.batch_size, seed=seed)
    state = trainer.states.init(seed)
    metrics = []
    for i in range(train_cfg.steps):
        state, step_metrics = trainer.train_step(state, trainer.batches.put(source[i]))
        metrics.append({k: step_metrics[k] for k in ("loss", "max_abs_logit", "max_attention_logit")})
    metrics = jax.device_get(metrics)
    losses = np.array([m["loss"] for m in metrics], np.float64)
    output_logits = np.array([m["max_abs_logit"] for m in metrics], np.float64)
    attention_logits = np.array([m["max_attention_logit"] for m in metrics], np.float64)
    last = losses[-max(1, train_cfg.steps // 10):]
    return {"losses": losses, "final": float(last.mean()) if np.isfinite(last).all() else math.inf,
            "nonfinite_steps": int((~np.isfinite(losses)).sum()),
            "max_attention_logit": float(np.nanmax(np.where(np.isfinite(attention_logits), attention_logits, np.nan))),
            "max_output_logit": float(np.nanmax(np.where(np.isfinite(output_logits), output_logits, np.nan)))}


def lr_sensitivity(finals: list[float], loss_0: float) -> tuple[float, float]:
    """(E_lr[min(loss, loss_0) - loss*], loss*): diverged runs (inf) count as loss_0."""
    capped = np.minimum(np.asarray(finals), loss_0)
    best = float(capped.min())
    return float(np.mean(capped - best)), best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="../shared/data/tinyshakespeare.txt", help="a text file, or 'embedded'")
    parser.add_argument("--full", action="store_true", help="500 steps at 32 x 128 (hours on a CPU)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 150; --full 500)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 4; --full 32)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 64; --full 128)")
    parser.add_argument("--out", default="results/qknorm_lr")
    args = parser.parse_args()
    steps = args.steps or (500 if args.full else 150)
    batch = args.batch or (32 if args.full else 4)
    seq_len = args.seq_len or (128 if args.full else 64)
    tokenizer, stream, _, source = text_or_embedded_splits(None if args.data == "embedded" else args.data)
    if args.data != "embedded" and source != args.data:
        print(f"{args.data} not found: using the {source}")
    results, rows, summary = {}, [], []
    start = time.perf_counter()
    for name, qk_norm in VARIANTS.items():
        model_cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=256, n_layers=6, n_heads=4,
                                norm_type="rmsnorm", norm_placement="pre", ffn_type="gated", activation="silu",
                                qk_norm=qk_norm, max_position_embeddings=seq_len)
        results[name] = []
        for lr in LEARNING_RATES:
            train_cfg = TrainConfig(steps=steps, batch_size=batch, seq_len=seq_len, lr=lr, schedule="cosine",
                                    warmup_steps=steps // 10, min_lr_ratio=0.1)
            result = run(model_cfg, train_cfg, stream)
            results[name].append(result)
            row = {"variant": name, "lr": lr, "final_loss": result["final"],
                   "nonfinite_steps": result["nonfinite_steps"],
                   "max_attention_logit": result["max_attention_logit"],
                   "max_output_logit": result["max_output_logit"]}
            rows.append(row)
            print(" | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()),
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
        loss_0 = float(results[name][0]["losses"][0])  # same init and first batch for every lr
        sensitivity, best = lr_sensitivity([r["final"] for r in results[name]], loss_0)
        summary.append({"variant": name, "loss_0": loss_0, "loss*": best,
                        "best_lr": LEARNING_RATES[int(np.argmin([r["final"] for r in results[name]]))],
                        "lr_sensitivity": sensitivity,
                        "max_attention_logit": max(r["max_attention_logit"] for r in results[name]),
                        "max_output_logit": max(r["max_output_logit"] for r in results[name])})
    protocol = f"{steps} steps at batch {batch} x {seq_len}" + ("" if args.full else " (shrunk)")
    title = f"QK-norm LR sweep: d=256, 6 blocks, {protocol}, {source}"
    print(write_table(rows, args.out, "qknorm_lr", title=title).read_text())
    print(write_table(summary, args.out, "qknorm_lr_summary",
                      title="LR sensitivity E_lr[min(loss, loss_0) - loss*] and max logits over the sweep").read_text())
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for (name, runs), info in zip(results.items(), summary):
        finals = [min(r["final"], info["loss_0"]) for r in runs]
        label = f"{name} (LR sens. {info['lr_sensitivity']:.3f})"
        line, = axes[0].semilogx(LEARNING_RATES, finals, "o-", label=label)
        diverged = [lr for lr, r in zip(LEARNING_RATES, runs) if not math.isfinite(r["final"])]
        axes[0].semilogx(diverged, [info["loss_0"]] * len(diverged), "x", color=line.get_color(), ms=10)
        axes[1].loglog(LEARNING_RATES, [r["max_attention_logit"] for r in runs], "o-", label=name)
        axes[2].loglog(LEARNING_RATES, [r["max_output_logit"] for r in runs], "o-", label=name)
    axes[0].axhline(summary[0]["loss_0"], color="0.6", ls="--", lw=1, label="loss at init")
    labels = ("final loss (min with loss at init; x: diverged)", "max |attention logit| over training",
              "max |output logit| over training")
    for ax, label in zip(axes, labels):
        ax.set_xlabel("learning rate")
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, f"{args.out}/qknorm_lr.png")


if __name__ == "__main__":
    main()
