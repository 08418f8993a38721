"""Rollout tokens/s of GRPO's sampler beside transformers' `generate` on the same model, prompts,
lengths and CPU, side by side, with their ratio.

    uv run python scripts/bench_rollouts.py --hf-python .hfvenv/bin/python
    uv run python scripts/bench_rollouts.py --hf-python .hfvenv/bin/python --model tests/fixtures/hf_chat \\
        --prompts 8 --generations 8 --new-tokens 32 --repeats 3

Both sides sample `--prompts` x `--generations` rows (prompts of 6 to 14 random tokens,
left-padded, each repeated once per generation, as a GRPO step's batch) for exactly
`--new-tokens` tokens each (no early stop: the same work on both sides) at temperature 1 with
the KV cache: ours is `generate.decode` as the rollouts call it (one jit-compiled program: each
prompt prefilled once for its group, then a `lax.scan` of single-token steps reading the filled
part of the cache), theirs transformers' `generate(do_sample=True)` in
float32 eager PyTorch. Compilation and the first call are left out; the best of `--repeats` of
each is printed. The reference interpreter needs torch and transformers (see
scripts/make_hf_fixtures.py); `--threads` sets PyTorch's threads (XLA uses every core; the
default is this machine's count, so both use all of them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

REFERENCE = r"""
import json, sys, time
import torch
from transformers import AutoModelForCausalLM
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32).eval()
ids = torch.tensor(args["rows"])
mask = torch.tensor(args["mask"])
best = float("inf")
with torch.no_grad():
    for i in range(args["repeats"] + 1):
        torch.manual_seed(i)
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=args["new"], min_new_tokens=args["new"], pad_token_id=args["pad"])
        wall = time.perf_counter() - start
        if i:
            best = min(best, wall)
assert out.shape[1] == ids.shape[1] + args["new"], out.shape
print(json.dumps({"seconds": best}))
"""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-python", required=True, help="an interpreter with torch and transformers")
    parser.add_argument("--model", default=str(ROOT / "tests" / "fixtures" / "hf_chat"), help="a Hugging Face directory")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="PyTorch's threads")
    args = parser.parse_args(argv)
    for name in ("prompts", "generations", "new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    from modern_jax.sharding.devices import no_tpu_runtime_without_chips

    no_tpu_runtime_without_chips()  # libtpu (for compiling to TPU topologies) stays quiet on this CPU host
    import jax
    from flax import nnx

    from modern_jax.convert import from_hf
    from modern_jax.generate import decode, left_padded

    cfg, model = from_hf(args.model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, min(cfg.vocab_size, 32), rng.integers(6, 15)).tolist() for _ in range(args.prompts)]
    rows = [p for p in prompts for _ in range(args.generations)]
    width = max(map(len, rows))
    pad = 0
    padded, lengths = left_padded(rows, width, pad)
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def rollout(params, prompt, length, key):
        return decode(nnx.merge(graphdef, params), prompt, key, max_new_tokens=args.new_tokens, temperature=1.0,
                      top_k=None, top_p=None, eos_id=None, length_B=length, group=args.generations)

    best = float("inf")
    for i in range(args.repeats + 1):
        start = time.perf_counter()
        jax.block_until_ready(rollout(params, padded, lengths, jax.random.key(i)))
        wall = time.perf_counter() - start
        if i:
            best = min(best, wall)
    mask = (np.arange(width)[None] >= (width - lengths)[:, None]).astype(np.int64)
    spec = {"model": str(Path(args.model).resolve()), "rows": padded.tolist(), "mask": mask.tolist(),
            "new": args.new_tokens, "pad": pad, "repeats": args.repeats, "threads": args.threads}
    done = subprocess.run([args.hf_python, "-c", REFERENCE, json.dumps(spec)], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"transformers' generate failed:\n{done.stderr[-3000:]}")
    theirs = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
    tokens = len(rows) * args.new_tokens
    cpu = platform.processor() or platform.machine()
    print(f"model {args.model} | {len(rows)} rows ({args.prompts} prompts x {args.generations}) of {width}-token "
          f"prompts, {args.new_tokens} new tokens each | {args.threads} threads on {cpu}")
    print(f"ours (generate.decode, jit):        {tokens / best:10,.0f} tokens/s ({best * 1e3:.1f} ms)")
    print(f"transformers generate (PyTorch):    {tokens / theirs:10,.0f} tokens/s ({theirs * 1e3:.1f} ms)")
    print(f"ratio ours / transformers: {theirs / best:.2f}x")


if __name__ == "__main__":
    main()
