"""GELU MLP vs gated FFNs (SwiGLU, GEGLU, ReGLU, bilinear) at matched parameters, on a character LM.

The model: d=128, 4 heads, 2 blocks, pre-norm RMSNorm, RoPE, tied embeddings; the FFN is
a GELU MLP of width 4d (2 * 128 * 512 = 131,072 weights per block) or a gated FFN of width
round(8d/3) = 341 (3 * 128 * 341 = 130,944). Trained on tinyshakespeare with the char
tokenizer (the embedded corpus when the file is missing) through the library's `Trainer`:
AdamW at a constant 1e-3 after a linear warmup over the first 5% of steps (b2 0.95, weight
decay 0.1, clip 1.0, no z-loss), random windows from `TrainBatches`, one seed per run for
both the initialisation and the data order (so every variant sees the same batches).
Reported: the training loss averaged over steps 101-200, 301-400 and 501-600 (the same
sixths of the run when --steps changes), mean +- std over three seeds.

The published protocol is 600 steps at batch 64 x 128 (`--full`, 2-3 hours on 2 CPU cores
at about 1 s per step). The default keeps the 600 steps, the windows and the three seeds but
shrinks the batch to 8 x 64 tokens (16x fewer tokens per step): about 8 minutes on 2 cores.

    uv run python scripts/exp_ffn.py [--full] [--data PATH] [--out results/ffn]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from modern_jax.execution import ExecutionConfig
from modern_jax.accounting import param_counts
from modern_jax.config import ModelConfig
from modern_jax.data.corpora import text_or_embedded_splits
from modern_jax.data.batches import TrainBatches
from modern_jax.sharding.mesh import make_mesh
from modern_jax.report import pyplot, save_figure, write_table
from modern_jax.training.config import TrainConfig
from modern_jax.data.config import DataConfig
from modern_jax.training.config import RunConfig
from modern_jax.training.trainer import trainer_for

D = 128
GATED_WIDTH = round(8 * D / 3)  # 341
VARIANTS = {
    "GELU (4d)": dict(ffn_type="mlp", activation="gelu", d_ff=4 * D),
    "SwiGLU": dict(ffn_type="gated", activation="silu", d_ff=GATED_WIDTH),
    "GEGLU": dict(ffn_type="gated", activation="gelu", d_ff=GATED_WIDTH),
    "ReGLU": dict(ffn_type="gated", activation="relu", d_ff=GATED_WIDTH),
    "bilinear": dict(ffn_type="gated", activation="identity", d_ff=GATED_WIDTH),
}


def windows(steps: int) -> list[tuple[int, int]]:
    """The 2nd, 4th and 6th sixth of the run as 1-based inclusive step ranges (101-200, ... at 600)."""
    return [(k * steps // 6 + 1, (k + 1) * steps // 6) for k in (1, 3, 5)]


def train_losses(model_cfg: ModelConfig, train_cfg: TrainConfig, stream, seed: int) -> np.ndarray:
    """The training loss of every step of one run."""
    run_cfg = RunConfig(model_cfg.to_dict(), train_cfg, DataConfig(),
                        execution=ExecutionConfig(scan_layers=False, remat="dots_no_batch"))
    trainer = trainer_for(run_cfg, make_mesh(data=-1, devices=jax.devices()[:1]))
    source = TrainBatches(stream, train_cfg.seq_len, train_cfg.batch_size, seed=seed)
    state = trainer.states.init(seed)
    losses = []
    for i in range(train_cfg.steps):
        state, metrics = trainer.train_step(state, trainer.batches.put(source[i]))
        losses.append(metrics["loss"])  # stays on the device; fetched once at the end
    return np.asarray(jax.device_get(losses), np.float64)


def mean_std(values) -> str:
    values = np.asarray(values)
    return f"{values.mean():.4f} ± {values.std(ddof=1) if len(values) > 1 else 0.0:.4f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="../shared/data/tinyshakespeare.txt", help="a text file, or 'embedded'")
    parser.add_argument("--full", action="store_true", help="the published batch, 64 x 128 (hours on a CPU)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; --full 64)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 64; --full 128)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="results/ffn")
    args = parser.parse_args()
    batch = args.batch or (64 if args.full else 8)
    seq_len = args.seq_len or (128 if args.full else 64)
    tokenizer, stream, _, source = text_or_embedded_splits(None if args.data == "embedded" else args.data)
    if args.data != "embedded" and source != args.data:
        print(f"{args.data} not found: using the {source}")
    train_cfg = TrainConfig(steps=args.steps, batch_size=batch, seq_len=seq_len, lr=1e-3, schedule="constant",
                            warmup_steps=args.steps // 20, z_loss_weight=0.0)
    spans = windows(args.steps)
    curves, rows, seed_rows = {}, [], []
    start = time.perf_counter()
    for name, ffn in VARIANTS.items():
        model_cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=D, n_layers=2, n_heads=4,
                                norm_type="rmsnorm", norm_placement="pre", tie_embeddings=True,
                                max_position_embeddings=seq_len, **ffn)
        curves[name] = np.stack([train_losses(model_cfg, train_cfg, stream, seed) for seed in range(args.seeds)])
        means = np.stack([curves[name][:, lo - 1 : hi].mean(axis=1) for lo, hi in spans], axis=1)  # [seeds, 3]
        counts = param_counts(model_cfg)
        row = {"variant": name, "d_ff": model_cfg.ffn_width, "block_params": counts["per_block"][0],
               "params": counts["total"]}
        row |= {f"steps {lo}-{hi}": mean_std(means[:, j]) for j, (lo, hi) in enumerate(spans)}
        gelu = curves["GELU (4d)"][:, spans[-1][0] - 1 : spans[-1][1]].mean(axis=1)
        row[f"vs GELU, {spans[-1][0]}-{spans[-1][1]}"] = mean_std(means[:, -1] - gelu)  # paired by seed
        rows.append(row)
        seed_rows += [{"variant": name, "seed": s} | {f"steps_{lo}_{hi}": float(means[s, j])
                                                      for j, (lo, hi) in enumerate(spans)}
                      for s in range(args.seeds)]
        print(" | ".join(str(v) for v in row.values()), f"({time.perf_counter() - start:.0f} s)", flush=True)
    protocol = "published protocol" if (batch, seq_len) == (64, 128) and args.steps == 600 else (
        f"shrunk from 64 x 128 to {batch} x {seq_len} tokens per step")
    title = (f"Training loss, mean ± std over {args.seeds} seeds: d={D}, 2 blocks, {args.steps} steps of "
             f"AdamW 1e-3, batch {batch} x {seq_len} ({protocol}), {source}")
    print(write_table(rows, args.out, "ffn", title=title).read_text())
    write_table(seed_rows, args.out, "ffn_seeds", title="Window means per seed")
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    smooth = max(1, args.steps // 30)
    for name, losses in curves.items():
        per_seed = np.stack([np.convolve(run, np.ones(smooth) / smooth, mode="valid") for run in losses])
        mean, std = per_seed.mean(axis=0), per_seed.std(axis=0)
        steps = np.arange(len(mean)) + smooth  # the last step of each averaged span
        late = steps > args.steps // 6
        axes[0].plot(steps, mean, label=name)
        (line,) = axes[1].plot(steps[late], mean[late], label=name)
        axes[1].fill_between(steps[late], (mean - std)[late], (mean + std)[late], color=line.get_color(),
                             alpha=0.2, lw=0)
    for ax in axes:
        for lo, hi in spans:
            ax.axvspan(lo, hi, color="0.9", zorder=0)
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (nats, mean of {args.seeds} seeds, {smooth}-step average)")
    axes[0].set_title("whole run (shaded: the averaging windows)", fontsize=9)
    axes[1].set_title(f"after step {args.steps // 6} (bands: ± std over the seeds)", fontsize=9)
    axes[1].legend()
    fig.suptitle(title, fontsize=8)
    save_figure(fig, f"{args.out}/ffn.png")


if __name__ == "__main__":
    main()
