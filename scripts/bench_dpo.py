"""DPO steps over packed rows against one sequence to a row, side by side in one run.

    uv run python scripts/bench_dpo.py                       # 32 sequences of 64 to 512 tokens a step
    uv run python scripts/bench_dpo.py --min-length 32 --max-length 256 --sequences 64

Random pairs (lengths uniform in [--min-length, --max-length], `seq_len` = --max-length) on a
small Llama-shaped model, full weights (the reference a frozen copy). Each step's batch is laid
out twice: packed as a DPO run packs it (`objectives.dpo.laid_out`: several sequences to a row,
the rows x width of fewest tokens) and one sequence to a row at the least width that holds the
longest (as TRL pads each batch to its longest). Both run the same compiled train step per shape
(every shape compiled before the clock starts); printed: tokens and seconds a step, each the
median over --steps batches, and their ratios (packed / one to a row).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from modern_jax.config import ModelConfig
from modern_jax.data.config import DataConfig
from modern_jax.execution import ExecutionConfig
from modern_jax.sharding import ParallelConfig
from modern_jax.sharding.mesh import make_mesh
from modern_jax.training import RunConfig, TrainConfig, trainer_for
from modern_jax.training.objectives.dpo import DPO, DPOConfig, laid_out


def pairs_batch(rng, sequences: int, seq_len: int, lo: int, hi: int, vocab: int) -> tuple[dict, np.ndarray]:
    """`[1, R, T]` rows of random sequences, one to a row (chosen, rejected, ...), and their lengths."""
    T = seq_len
    lengths = rng.integers(lo, hi + 1, (1, sequences))
    tokens = rng.integers(1, vocab, (sequences, T + 1))
    valid = np.arange(T) < lengths[0, :, None] - 1
    prompt = lengths[0, :, None] // 4
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": np.where(valid, np.arange(T), 0),
             "segment_ids": valid.astype(np.int32), "weights": (valid & (np.arange(T) >= prompt)).astype(np.float32),
             "sequence": np.where(valid, np.arange(sequences)[:, None], 0)}
    return {k: v[None].astype(np.float32 if k == "weights" else np.int32) for k, v in batch.items()}, lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=32, help="sequences a step (two a pair)")
    parser.add_argument("--min-length", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=512, help="also the run's seq_len")
    parser.add_argument("--steps", type=int, default=6, help="batches timed (the median is printed)")
    args = parser.parse_args()

    model = ModelConfig(vocab_size=1024, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=384,
                        max_position_embeddings=args.max_length + 1)
    train = TrainConfig(batch_size=args.sequences, eval_batch_size=args.sequences, seq_len=args.max_length,
                        warmup_steps=0)
    run = RunConfig(model.to_dict(), train, DataConfig(), ParallelConfig(), ExecutionConfig())
    trainer = trainer_for(run, make_mesh(devices=jax.devices()[:1]), objective=DPO(DPOConfig(), train))
    rng = np.random.default_rng(0)
    batches = [pairs_batch(rng, args.sequences, args.max_length, args.min_length, args.max_length, 1024)
               for _ in range(args.steps)]
    layouts = {"packed": lambda b, n: laid_out(b, n, trainer.batches, trainer.programs.data_shards),
               "one to a row": lambda b, n: {k: v[..., :trainer.batches.width(int(n.max()) - 1)] for k, v in b.items()}}
    state = trainer.states.init(0)
    figures = {}
    for name, lay in layouts.items():
        placed = [trainer.batches.put(lay(b, n)) for b, n in batches]
        for batch in placed:  # every shape compiled (and run once) before the clock starts
            state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics)
        seconds, tokens = [], []
        for batch in placed:
            start = time.perf_counter()
            state, metrics = trainer.train_step(state, batch)
            jax.block_until_ready(metrics)
            seconds.append(time.perf_counter() - start)
            tokens.append(batch["inputs"].size)
        figures[name] = statistics.median(tokens), statistics.median(seconds)
        shapes = sorted({b["inputs"].shape[1:] for b in placed})
        print(f"{name}: {figures[name][0]:,.0f} tokens a step, {figures[name][1] * 1e3:.1f} ms a step "
              f"(rows x width: {', '.join(f'{r} x {w}' for r, w in shapes)})")
    (pt, ps), (ot, os_) = figures["packed"], figures["one to a row"]
    print(f"ratio (packed / one to a row): tokens {pt / ot:.2f}, step time {ps / os_:.2f}")


if __name__ == "__main__":
    main()
