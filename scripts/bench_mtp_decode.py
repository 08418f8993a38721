"""Self-speculative greedy decoding with an MTP module against plain greedy decoding.

Trains the character model of `configs/shakespeare_char_cpu.yaml` (d=128, 4 blocks) with one
multi-token-prediction module (`model.mtp_depth: 1`, `train.mtp_loss_weight` 0.3) for `--steps`
steps on tinyshakespeare, then decodes `--new-tokens` greedy tokens after `--rows` prompts of the
validation text both ways, in one process, each one jitted program: `generate.decode` at temperature 0 (one
main-model call a token) and `generate.mtp_decode` (MTP module 1 drafts the token after next; one call checks
two). It
checks the tokens are identical and reports the acceptance rate of the drafts, the tokens per
main-model call and the tokens/s of each (the best of `--repeats` timed runs after a compiling one).

    uv run python scripts/bench_mtp_decode.py [--steps 600] [--rows 4] [--new-tokens 256] [--out results/mtp]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from modern_jax.config import ModelConfig
from modern_jax.data.batches import TrainBatches
from modern_jax.data.config import DataConfig
from modern_jax.data.corpora import text_or_embedded_splits
from modern_jax.execution import ExecutionConfig
from modern_jax.generate import decode, mtp_decode
from modern_jax.report import write_table
from modern_jax.sharding.mesh import make_mesh
from modern_jax.training.config import RunConfig, TrainConfig
from modern_jax.training.trainer import trainer_for


def timed(fn, repeats: int):
    """`(result, best seconds)` of `fn()` over `repeats` runs after a first (compiling) one."""
    result, best = fn(), float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return result, best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="../shared/data/tinyshakespeare.txt", help="a text file, or 'embedded'")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results/mtp")
    args = parser.parse_args()
    tokenizer, stream, val_stream, source = text_or_embedded_splits(None if args.data == "embedded" else args.data)
    seq_len = 64
    context = args.prompt_len + 2 * args.new_tokens + 2  # RoPE runs past the trained context; the cache holds this
    model_cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=128, n_layers=4, n_heads=4, d_ff=384,
                            max_position_embeddings=context, qk_norm="head", mtp_depth=1)
    train_cfg = TrainConfig(steps=args.steps, batch_size=12, seq_len=seq_len, b2=0.99, warmup_steps=args.steps // 20,
                            min_lr_ratio=0.1, mtp_loss_weight=0.3)
    run = RunConfig(model_cfg.to_dict(), train_cfg, DataConfig(),
                    execution=ExecutionConfig(scan_layers=False, remat="dots_no_batch"))
    trainer = trainer_for(run, make_mesh(data=-1, devices=jax.devices()[:1]))
    batches, state = TrainBatches(stream, seq_len, 12, seed=0), trainer.states.init(0)
    for step in range(args.steps):
        state, metrics = trainer.train_step(state, trainer.batches.put(batches[step]))
        if (step + 1) % 100 == 0 or step + 1 == args.steps:
            m = jax.device_get(metrics)
            print(f"step {step + 1}: loss {float(m['loss']):.3f}, mtp_loss_1 {float(m['mtp_loss_1']):.3f}", flush=True)
    graphdef, params = nnx.split(trainer.states.model(state["params"]))
    starts = np.linspace(0, len(val_stream) - args.prompt_len - 1, args.rows).astype(int)
    prompt = np.stack([np.asarray(val_stream.tokens[s:s + args.prompt_len], np.int32) for s in starts])
    N = args.new_tokens
    plain_fn = jax.jit(lambda p, x: decode(nnx.merge(graphdef, p), x, jax.random.key(0), max_new_tokens=N,
                                           temperature=0.0, top_k=None, top_p=None, eos_id=None))
    spec_fn = jax.jit(lambda p, x: mtp_decode(nnx.merge(graphdef, p), x, max_new_tokens=N))
    plain, plain_s = timed(lambda: jax.block_until_ready(plain_fn(params, prompt)), args.repeats)
    (spec, accepted, steps), spec_s = timed(lambda: jax.block_until_ready(spec_fn(params, prompt)), args.repeats)
    stats = {"accepted": int(np.sum(accepted)), "steps": int(np.sum(steps))}
    identical = bool(np.array_equal(np.asarray(plain), np.asarray(spec)))
    n = args.rows * args.new_tokens
    rows = [{"decoding": "plain greedy", "tokens / s": round(n / plain_s, 1), "main-model calls / row":
             args.new_tokens - 1, "acceptance": "", "speed-up": 1.0},
            {"decoding": "self-speculative (MTP 1 drafts)", "tokens / s": round(n / spec_s, 1),
             "main-model calls / row": round(stats["steps"] / args.rows, 1),
             "acceptance": round(stats["accepted"] / stats["steps"], 3), "speed-up": round(plain_s / spec_s, 2)}]
    title = (f"greedy decoding of {args.rows} x {args.new_tokens} tokens, d=128 4-block char model trained "
             f"{args.steps} steps with mtp_depth 1 on {source}, {jax.devices()[0].platform}; identical tokens: "
             f"{identical}")
    print(write_table(rows, args.out, "mtp_decode", title=title).read_text())
    if not identical:
        raise SystemExit("the self-speculative tokens differ from plain greedy decoding's")


if __name__ == "__main__":
    main()
