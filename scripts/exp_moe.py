"""Dense vs mixture of experts at equal active parameters, and load balancing, on a character LM.

The model: d=128, 4 heads, 2 blocks, pre-norm RMSNorm, RoPE, tied embeddings. The dense
FFN is SwiGLU of width 340; the mixture has E=8 SwiGLU experts of width 170 with k=2 per
token (so the same active FFN parameters and matmul FLOPs per token, 4x the total), a
DeepSeek-style router (sigmoid scores, the k weights renormalised, a selection bias), and
the dropless grouped dispatch. Three ways to balance the experts:

- none: no balancing term, the selection bias stays at 0;
- aux loss: the Switch / GShard loss `E sum_e f_e P_e`, weight 0.01;
- aux-free: DeepSeek-V3's bias update, `bias_e += rate * sign(mean load - load_e)`, rate 1e-3.

Trained on tinyshakespeare with the char tokenizer through the library's `Trainer` (AdamW
1e-3 constant after a 5% warmup, b2 0.95, weight decay 0.1, clip 1.0, no z-loss), one seed
per run for the initialisation and the data order (every variant sees the same batches).
Reported: the training loss over the 2nd, 4th and 6th sixth of the run, and the load
imbalance `max_e load_e / mean load` (mean over the MoE layers; 1.0 is perfect balance)
over the same windows, mean ± std over the seeds. 600 steps at batch 8 x 64 tokens.

    uv run python scripts/exp_moe.py [--steps 600] [--seeds 2] [--out results/moe]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

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

D, WIDTH, E, K = 128, 340, 8, 2
MOE = dict(ffn_type="moe", n_experts=E, experts_per_token=K, expert_d_ff=WIDTH // K, router_score="sigmoid",
           router_norm_topk=True, router_selection_bias=True)
VARIANTS = {  # name: (model fields, train fields)
    "dense SwiGLU": (dict(d_ff=WIDTH), {}),
    "MoE, no balancing": (MOE, {}),
    "MoE, aux loss": (MOE, dict(moe_aux_weight=0.01)),
    "MoE, aux-free": (MOE, dict(moe_bias_update_rate=1e-3)),
}


def windows(steps: int) -> list[tuple[int, int]]:
    """The 2nd, 4th and 6th sixth of the run as 1-based inclusive step ranges."""
    return [(k * steps // 6 + 1, (k + 1) * steps // 6) for k in (1, 3, 5)]


def run(model_cfg: ModelConfig, train_cfg: TrainConfig, stream, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per step: the training loss, and the max load over the mean (mean over MoE layers; nan if dense)."""
    run_cfg = RunConfig(model_cfg.to_dict(), train_cfg, DataConfig())
    trainer = trainer_for(run_cfg, make_mesh(data=-1, devices=jax.devices()[:1]))
    source = TrainBatches(stream, train_cfg.seq_len, train_cfg.batch_size, seed=seed)
    state = trainer.states.init(seed)
    losses, loads = [], []
    for i in range(train_cfg.steps):
        state, metrics = trainer.train_step(state, trainer.batches.put(source[i]))
        losses.append(metrics["loss"])  # stays on the device; fetched once at the end
        loads.append(metrics.get("moe_load_max", np.full((1,), np.nan)))
    losses, loads = jax.device_get((losses, loads))
    return np.asarray(losses, np.float64), np.asarray([np.mean(x) for x in loads], np.float64)


def mean_std(values) -> str:
    values = np.asarray(values)
    return f"{values.mean():.3f} ± {values.std(ddof=1) if len(values) > 1 else 0.0:.3f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="../shared/data/tinyshakespeare.txt", help="a text file, or 'embedded'")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", default="results/moe")
    args = parser.parse_args()
    tokenizer, stream, _, source = text_or_embedded_splits(None if args.data == "embedded" else args.data)
    if args.data != "embedded" and source != args.data:
        print(f"{args.data} not found: using the {source}")
    spans = windows(args.steps)
    curves, rows = {}, []
    start = time.perf_counter()
    for name, (model_fields, train_fields) in VARIANTS.items():
        model_cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=D, n_layers=2, n_heads=4,
                                tie_embeddings=True, max_position_embeddings=args.seq_len, **model_fields)
        train_cfg = TrainConfig(steps=args.steps, batch_size=args.batch, seq_len=args.seq_len, lr=1e-3,
                                schedule="constant", warmup_steps=args.steps // 20, z_loss_weight=0.0, **train_fields)
        results = [run(model_cfg, train_cfg, stream, seed) for seed in range(args.seeds)]
        curves[name] = tuple(np.stack(r) for r in zip(*results))  # ([seeds, steps] losses, loads)
        counts = param_counts(model_cfg)
        row = {"variant": name, "params": counts["total"], "active": counts["active"]}
        for label, series in (("loss", curves[name][0]), ("max load / mean", curves[name][1])):
            for lo, hi in spans:
                row[f"{label}, {lo}-{hi}"] = ("-" if np.isnan(series).all() else
                                              mean_std(series[:, lo - 1:hi].mean(axis=1)))
        rows.append(row)
        print(" | ".join(str(v) for v in row.values()), f"({time.perf_counter() - start:.0f} s)", flush=True)
    title = (f"Dense vs MoE (E={E}, k={K}, equal active parameters) and balancing: d={D}, 2 blocks, {args.steps} "
             f"steps of AdamW 1e-3, batch {args.batch} x {args.seq_len}, mean ± std over {args.seeds} seeds, {source}")
    print(write_table(rows, args.out, "moe", title=title).read_text())
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    smooth = max(1, args.steps // 30)
    for i, (name, (losses, loads)) in enumerate(curves.items()):  # one colour per variant in both panels
        kernel = np.ones(smooth) / smooth
        steps = np.arange(args.steps - smooth + 1) + smooth
        axes[0].plot(steps, np.convolve(losses.mean(0), kernel, mode="valid"), label=name, color=f"C{i}")
        if not np.isnan(loads).all():
            axes[1].plot(steps, np.convolve(loads.mean(0), kernel, mode="valid"), label=name, color=f"C{i}")
    axes[0].set_ylabel(f"training loss (nats, mean of {args.seeds} seeds, {smooth}-step average)")
    axes[1].set_ylabel("max expert load / mean load (mean over MoE layers)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend()
    fig.suptitle(title, fontsize=8)
    save_figure(fig, f"{args.out}/moe.png")


if __name__ == "__main__":
    main()
