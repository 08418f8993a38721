"""Benchmark the training step: compile time, step time, tokens/s and MFU.

    uv run python scripts/bench_train.py              # everything (~10 min on 2 CPU cores)
    uv run python scripts/bench_train.py --quick      # skip the 30-layer unrolled compile

Rows:
  - configs/tiny.yaml at its training batch, configs/stack_100m.yaml at a small batch;
  - compile time against depth: the Stack-100M block (every layer RoPE, so one block
    repeats) at 2, 8 and 30 layers, scanned (`execution.scan_layers: true`) and unrolled (a
    Python loop over the same stacked weights).
It also times a 2048^3 matmul in float32 and bfloat16 in the same process, and reports
each step's model FLOP/s (accounting FLOPs per token x tokens/s) against that measured
fp32 peak (MFU). Steps run through the same `Trainer` as `modern-jax train`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from modern_jax.execution import ExecutionConfig
from modern_jax.accounting import flops_per_token, param_counts  # noqa: E402
from modern_jax.config import model_config_from_file  # noqa: E402
from modern_jax.sharding.mesh import make_mesh  # noqa: E402
from modern_jax.data.config import DataConfig  # noqa: E402
from modern_jax.training import RunConfig, TrainConfig, load_run_config, trainer_for  # noqa: E402


def matmul_peak(dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an n^3 matmul (best of `repeats`)."""
    a = jnp.ones((n, n), dtype)
    b = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def synthetic_batch(cfg, batch: int, seq: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (1, batch, seq + 1))
    return {"inputs": tokens[..., :-1].astype(np.int32), "targets": tokens[..., 1:].astype(np.int32),
            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (1, batch, seq)).copy(),
            "segment_ids": np.ones((1, batch, seq), np.int32), "weights": np.ones((1, batch, seq), np.float32)}


def bench(name: str, cfg, batch: int, seq: int, steps: int, peak: float, time_steps: bool = True,
          run: ExecutionConfig = ExecutionConfig()) -> dict:
    tc = TrainConfig(batch_size=batch, seq_len=seq, steps=1000, warmup_steps=10)
    run_cfg = RunConfig(cfg.to_dict(), tc, DataConfig(), execution=run)
    trainer = trainer_for(run_cfg, make_mesh(data=-1, devices=jax.devices()[:1]))
    state = trainer.states.init(0)
    data = trainer.batches.put(synthetic_batch(cfg, batch, seq))
    compile_s = trainer.compile(state, data)
    row = {"name": name, "params": param_counts(cfg)["total"], "layers": cfg.n_layers, "scan": run.scan_layers,
           "batch": f"{batch}x{seq}", "compile_s": compile_s}
    if time_steps:
        state, metrics = trainer.train_step(state, data)  # warm-up
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = trainer.train_step(state, data)
        jax.block_until_ready(metrics)
        step_s = (time.perf_counter() - start) / steps
        tokens_per_s = batch * seq / step_s
        flops = flops_per_token(cfg, seq)["total"] * tokens_per_s
        row |= {"step_ms": 1e3 * step_s, "tokens_per_s": tokens_per_s, "gflops": flops / 1e9, "mfu": flops / peak}
    print(_format(row), flush=True)
    return row


HEADER = "| model | params | layers | scanned | batch x seq | compile (s) | step (ms) | tokens/s | GFLOP/s | MFU |"


def _format(r: dict) -> str:
    timed = "step_ms" in r
    cells = [r["name"], f"{r['params'] / 1e6:.1f}M", str(r["layers"]), "yes" if r["scan"] else "no", r["batch"],
             f"{r['compile_s']:.1f}",
             f"{r['step_ms']:.1f}" if timed else "-", f"{r['tokens_per_s']:,.0f}" if timed else "-",
             f"{r['gflops']:.1f}" if timed else "-", f"{100 * r['mfu']:.1f}%" if timed else "-"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip the 30-layer unrolled compile")
    parser.add_argument("--steps", type=int, default=20, help="timed steps for the small models")
    args = parser.parse_args()

    print(f"devices: {jax.devices()}")
    fp32, bf16 = matmul_peak(jnp.float32), matmul_peak(jnp.bfloat16)
    print(f"matmul 2048^3: float32 {fp32 / 1e9:.1f} GFLOP/s, bfloat16 {bf16 / 1e9:.1f} GFLOP/s "
          f"(MFU below is against the float32 figure)\n")
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    tiny = model_config_from_file(ROOT / "configs/tiny.yaml")
    shakespeare_run = load_run_config(ROOT / "configs/shakespeare_char_cpu.yaml").with_vocab(67)
    stack = model_config_from_file(ROOT / "configs/stack_100m.yaml")
    rows = [
        bench("tiny.yaml", tiny, 16, 128, args.steps, fp32),
        bench("tiny.yaml unrolled", tiny, 16, 128, args.steps, fp32, run=ExecutionConfig(scan_layers=False)),
        bench("shakespeare_char_cpu", shakespeare_run.model, 12, 64, args.steps, fp32, run=shakespeare_run.execution),
        bench("stack_100m.yaml", stack, 2, 256, 3, fp32),
    ]
    for layers in (2, 8, 30):
        for scan in (True, False):
            if args.quick and layers == 30 and not scan:
                continue
            cfg = stack.replace(n_layers=layers, rope_pattern="R")  # one repeated block
            rows.append(bench(f"stack_100m L={layers}", cfg, 2, 256, 2, fp32, time_steps=layers < 30,
                              run=ExecutionConfig(scan_layers=scan)))
    compile_of = {(r["layers"], r["scan"]): r["compile_s"] for r in rows[4:]}
    ratio = compile_of[(30, True)] / compile_of[(2, True)]
    print(f"\nscanned compile time, 30 layers / 2 layers: {ratio:.2f}x")
    if (30, False) in compile_of:
        print(f"unrolled compile time, 30 layers / 2 layers: {compile_of[(30, False)] / compile_of[(2, False)]:.2f}x")


if __name__ == "__main__":
    main()
