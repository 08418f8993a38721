"""AdamW vs Muon on a character LM: validation loss at equal steps and at equal wall time.

The model and recipe of `configs/shakespeare_char_cpu.yaml` (d=128, 4 blocks, 4 heads, pre-norm
RMSNorm, SwiGLU 384, RoPE, QK-norm, untied head), context 64, batch 12, on tinyshakespeare with
the char tokenizer, through the library's `Trainer`: warmup over the first 5% of steps, cosine to
0.1 x lr, weight decay 0.1, clip 1.0, b2 0.99, the same seed (initialisation and batches) for
every run. The variants:

- AdamW at lr 1e-3 (the recipe's) and at 3e-3;
- Muon (`train.optimizer: muon`, `muon_adjust_lr: match_rms_adamw`) at the same learning rates and
  weight decay, which Moonlight's scale is meant to carry over; the embedding, head and norms on
  AdamW.

The runs advance in turn, `--eval-every` steps each, so a load on the machine falls on all of
them alike; each chunk's training is timed alone (compilation and evaluation excluded), and
after it each run's validation loss is measured on the same `--eval-batches` batches of
validation windows.

    uv run python scripts/exp_muon.py [--steps 600] [--eval-every 50] [--out results/muon]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from modern_jax.config import ModelConfig
from modern_jax.data.batches import TrainBatches
from modern_jax.data.config import DataConfig
from modern_jax.data.corpora import text_or_embedded_splits
from modern_jax.execution import ExecutionConfig
from modern_jax.report import pyplot, save_figure, write_table
from modern_jax.sharding.mesh import make_mesh
from modern_jax.training.config import RunConfig, TrainConfig
from modern_jax.training.evaluation import evaluate_batches
from modern_jax.training.trainer import trainer_for

VARIANTS = {  # name: train fields
    "AdamW 1e-3": dict(lr=1e-3),
    "AdamW 3e-3": dict(lr=3e-3),
    "Muon 1e-3": dict(lr=1e-3, optimizer="muon"),
    "Muon 3e-3": dict(lr=3e-3, optimizer="muon"),
}


class Run:
    """One variant's trainer, state and measurements."""

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, stream, seed: int = 0):
        run_cfg = RunConfig(model_cfg.to_dict(), train_cfg, DataConfig(),
                            execution=ExecutionConfig(scan_layers=False, remat="dots_no_batch"))
        self.trainer = trainer_for(run_cfg, make_mesh(data=-1, devices=jax.devices()[:1]))
        self.source = TrainBatches(stream, train_cfg.seq_len, train_cfg.batch_size, seed=seed)
        self.state = self.trainer.states.init(seed)
        self.step, self.seconds = 0, 0.0
        self.trainer.compile(self.state, self.trainer.batches.put(self.source[0]))
        self.curve = []  # (step, training seconds, validation loss)

    def advance(self, steps: int) -> None:
        batches = [self.trainer.batches.put(self.source[self.step + i]) for i in range(steps)]
        start = time.perf_counter()
        for batch in batches:
            self.state, metrics = self.trainer.train_step(self.state, batch)
        jax.block_until_ready(metrics["loss"])
        self.seconds += time.perf_counter() - start
        self.step += steps

    def evaluate(self, batches, token_bytes) -> float:
        loss = evaluate_batches(self.trainer, self.state["params"], batches, token_bytes)["loss"]
        self.curve.append((self.step, self.seconds, float(loss)))
        return float(loss)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="../shared/data/tinyshakespeare.txt", help="a text file, or 'embedded'")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8, help="validation batches of 64 windows")
    parser.add_argument("--out", default="results/muon")
    args = parser.parse_args()
    tokenizer, stream, val_stream, source = text_or_embedded_splits(None if args.data == "embedded" else args.data)
    if args.data != "embedded" and source != args.data:
        print(f"{args.data} not found: using the {source}")
    batch, seq_len = 12, 64
    model_cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=128, n_layers=4, n_heads=4, d_ff=384,
                            max_position_embeddings=seq_len, qk_norm="head")
    runs = {name: Run(model_cfg, TrainConfig(steps=args.steps, batch_size=batch, seq_len=seq_len, b2=0.99,
                                             warmup_steps=args.steps // 20, schedule="cosine", min_lr_ratio=0.1,
                                             eval_batch_size=64, **fields), stream)
            for name, fields in VARIANTS.items()}
    val = TrainBatches(val_stream, seq_len, 64, seed=1)
    val_batches = [val[i] for i in range(args.eval_batches)]
    token_bytes = np.ones((tokenizer.vocab_size,), np.float32)  # (bits per byte are not reported)
    for r in runs.values():
        r.evaluate(val_batches, token_bytes)  # at initialisation: step 0, 0 s
    start = time.perf_counter()
    while min(r.step for r in runs.values()) < args.steps:
        for name, r in runs.items():
            r.advance(min(args.eval_every, args.steps - r.step))
            loss = r.evaluate(val_batches, token_bytes)
            print(f"{name}: step {r.step}, {r.seconds:.1f} s training, val loss {loss:.4f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    budget = min(r.seconds for r in runs.values())  # the slowest run's training time, for equal wall time
    rows = []
    for name, r in runs.items():
        steps_, seconds, losses = map(np.asarray, zip(*r.curve))
        rows.append({"variant": name, "val loss at the last step": round(float(losses[-1]), 4),
                     "training s": round(r.seconds, 1), "ms / step": round(1000 * r.seconds / r.step, 1),
                     f"val loss at {budget:.0f} s": round(float(np.interp(budget, seconds, losses)), 4),
                     "best val loss": round(float(losses.min()), 4)})
    title = (f"AdamW vs Muon: d=128, 4 blocks, {args.steps} steps at batch {batch} x {seq_len}, cosine, "
             f"val loss on {args.eval_batches} x 64 windows, {source}")
    print(write_table(rows, args.out, "muon", title=title).read_text())
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, r in runs.items():
        steps_, seconds, losses = zip(*r.curve)
        axes[0].plot(steps_, losses, "o-", ms=3, label=name)
        axes[1].plot(seconds, losses, "o-", ms=3, label=name)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training time (s; compilation and evaluation excluded)")
    for ax in axes:
        ax.set_ylabel("validation loss (nats / char)")
        ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
        ax.legend()
    fig.suptitle(title, fontsize=8)
    save_figure(fig, f"{args.out}/muon.png")


if __name__ == "__main__":
    main()
