"""Normalisation cost: LayerNorm vs RMSNorm (reference, and Pallas where the platform has it).

On a (64, 512, 1024) tensor: time per call, achieved GB/s counting one read and one
write of the tensor, and the ratio to a 2x elementwise baseline (`x * 2`: exactly one
read and one write), i.e. how many passes over the data each norm effectively makes.

    uv run python scripts/exp_norm_cost.py [--dtype bfloat16] [--out results/norm_cost]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from modern_jax.sharding.devices import platform
from modern_jax.kernels.norm import norm
from modern_jax.report import pyplot, save_figure, write_table


def bench(fn, *args, repeats=20):
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="64,512,1024")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--out", default="results/norm_cost")
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    dtype = jnp.dtype(args.dtype)
    x = jax.random.normal(jax.random.key(0), shape, dtype)
    w, b = jnp.ones(shape[-1], jnp.float32), jnp.zeros(shape[-1], jnp.float32)
    nbytes = 2 * x.size * dtype.itemsize  # one read + one write
    impls = ["reference"] + (["pallas"] if platform() in ("gpu", "tpu") else [])
    baseline = bench(lambda x: x * 2, x)
    rows = [{"op": "x * 2 (baseline)", "impl": "xla", "ms": baseline * 1e3, "GB/s": nbytes / baseline / 1e9,
             "passes": 1.0}]
    for impl in impls:
        for kind, bias in (("layernorm", b), ("rmsnorm", None)):
            seconds = bench(lambda x, kind=kind, bias=bias, impl=impl: norm(x, w, bias, kind=kind, eps=1e-5,
                                                                               impl=impl), x)
            rows.append({"op": kind, "impl": impl, "ms": seconds * 1e3, "GB/s": nbytes / seconds / 1e9,
                         "passes": seconds / baseline})
    title = f"Normalisation cost on {shape} {args.dtype}, {jax.devices()[0].device_kind}"
    print(write_table(rows, args.out, f"norm_cost_{args.dtype}", title=title).read_text())
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([f"{r['op']}\n{r['impl']}" for r in rows], [r["GB/s"] for r in rows])
    ax.set_ylabel("achieved GB/s (1 read + 1 write)")
    ax.set_title(title, fontsize=9)
    save_figure(fig, f"{args.out}/norm_cost_{args.dtype}.png")


if __name__ == "__main__":
    main()
