"""Benchmark the attention implementations side by side: runtime and achieved TFLOP/s.

    uv run python scripts/bench_attention.py            # full grid on a GPU / TPU
    uv run python scripts/bench_attention.py --small    # a few small shapes (automatic on CPU)
    uv run python scripts/bench_attention.py --memory   # chunked vs reference temp bytes (XLA, compile only)
    uv run python scripts/bench_attention.py --check    # interpret-mode errors of every kernel vs the reference

Letters as in `modern_jax.kernels.attention`. FLOPs count the visible (query, key) pairs
only, so a causal mask counts half of the full square and a window less still:
forward `2 * pairs * N * (H + V)`, backward 2.5x the forward (five matmuls to two).
Implementations that cannot run a shape (missing feature, out of memory) are reported
with the reason instead of a time.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from modern_jax.kernels import AttentionSpec, UnsupportedFeatureError, Visibility, attention, pallas_interpret
from modern_jax.kernels.attention import DEFAULTS, attention_reference, resolve
from modern_jax.sharding.devices import platform
from modern_jax.report import median_seconds

FULL = dict(batch=(2, 8), length=(1024, 4096, 16384), head_dim=(64, 128), group=(4, 8))
SMALL = dict(batch=(2,), length=(256, 1024), head_dim=(64,), group=(4,))
VARIANTS = {  # name: (window, softcap, sinks)
    "causal": (None, None, False),
    "window": (512, None, False),
    "softcap+sinks": (None, 30.0, True),
}
KV_HEADS = 2


def visible_pairs(T: int, causal: bool, window: int | None) -> int:
    """How many (query, key) pairs the mask keeps, for positions 0..T-1."""
    t = np.arange(T)
    lo = np.maximum(0, t - window + 1) if window else np.zeros_like(t)
    hi = t + 1 if causal else np.full_like(t, T)
    return int(np.sum(hi - lo))


def make(B, T, K, G, H, window, softcap, sinks, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, K, G, H), np.float32), dtype)
    k = jnp.asarray(rng.standard_normal((B, T, K, H), np.float32), dtype)
    v = jnp.asarray(rng.standard_normal((B, T, K, H), np.float32), dtype)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    sinks_KG = jnp.asarray(rng.standard_normal((K, G), np.float32)) if sinks else None
    return (q, k, v, sinks_KG), pos, AttentionSpec(scale=H**-0.5, window=window, softcap=softcap)


def bench_one(impl, args, pos, spec, repeats):
    q, k, v, sinks = args
    try:
        resolve(impl, q, k, v, spec, sinks)
    except UnsupportedFeatureError as e:
        return None, None, str(e).split("needs ")[-1]

    def forward(q, k, v, sinks):
        return attention(q, k, v, spec, Visibility(pos, pos), sinks_KG=sinks, impl=impl)

    def loss(q, k, v, sinks):
        return jnp.sum(forward(q, k, v, sinks).astype(jnp.float32))

    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    try:
        fwd = median_seconds(jax.jit(forward), *args, repeats=repeats)
        fwd_bwd = median_seconds(jax.jit(jax.grad(loss, argnums=argnums)), *args, repeats=repeats)
    except Exception as e:  # out of memory, a compiler limit: report and go on
        return None, None, type(e).__name__ + ": " + str(e).splitlines()[0][:80]
    return fwd, fwd_bwd, None


def run_grid(grid, impls, repeats):
    print("| impl | B | T | H | G | variant | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for B, T, H, G in itertools.product(grid["batch"], grid["length"], grid["head_dim"], grid["group"]):
        for variant, (window, softcap, sinks) in VARIANTS.items():
            window = None if window is None else min(window, T // 2)
            args, pos, spec = make(B, T, KV_HEADS, G, H, window, softcap, sinks)
            flops = 2 * visible_pairs(T, True, window) * B * KV_HEADS * G * (H + H)
            for impl in impls:
                fwd, fwd_bwd, why = bench_one(impl, args, pos, spec, repeats)
                if why is not None:
                    print(f"| {impl} | {B} | {T} | {H} | {G} | {variant} | - | - | - | {why} |")
                    continue
                print(f"| {impl} | {B} | {T} | {H} | {G} | {variant} | {fwd * 1e3:.2f} | {flops / fwd / 1e12:.3f} "
                      f"| {fwd_bwd * 1e3:.2f} | {3.5 * flops / fwd_bwd / 1e12:.3f} |", flush=True)


def memory_table(lengths=(2048, 4096, 8192, 16384), B=1, K=1, G=2, H=64):
    """Temporary bytes of forward + backward attention from XLA's compiled memory analysis."""
    print(f"temp bytes of jit(grad(attention)), bf16, B={B}, K={K}, G={G}, H={H}, causal (compiled on "
          f"{platform()}, not run)\n")
    print("| T | reference MiB | chunked MiB | reference / chunked |")
    print("|---|---|---|---|")
    for T in lengths:
        sizes = {}
        for impl in ("reference", "chunked"):
            q = jax.ShapeDtypeStruct((B, T, K, G, H), jnp.bfloat16)
            k = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16)
            pos = jax.ShapeDtypeStruct((B, T), jnp.int32)

            def loss(q, k, v, pos, impl=impl):
                o = attention(q, k, v, AttentionSpec(scale=H**-0.5), Visibility(pos, pos), impl=impl)
                return jnp.sum(o.astype(jnp.float32))

            compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k, pos).compile()
            sizes[impl] = compiled.memory_analysis().temp_size_in_bytes
        print(f"| {T} | {sizes['reference'] / 2**20:.1f} | {sizes['chunked'] / 2**20:.1f} "
              f"| {sizes['reference'] / sizes['chunked']:.0f}x |", flush=True)


def case_errors(impls, dtype, B, T, K, G, H, window, softcap, sinks, segments):
    """For each impl, max |impl - reference| / max |reference| over o, dq, dk, dv, dsinks."""
    args, pos, spec = make(B, T, K, G, H, window, softcap, sinks, dtype, seed=T)
    seg = ((pos >= T // 3).astype(jnp.int32) + (pos >= T // 2)) if segments else None
    do = jnp.asarray(np.random.default_rng(1).standard_normal(args[0].shape, np.float32), dtype)

    def outputs_and_grads(impl):
        def f(q, k, v, s):
            if impl == "reference":
                mask = Visibility(pos, pos, seg, seg).mask(causal=True, window=window)
                return attention_reference(q, k, v, mask, spec, s)
            return attention(q, k, v, spec, Visibility(pos, pos, seg, seg), sinks_KG=s, impl=impl)

        def run(*a):
            o, vjp = jax.vjp(f, *a)
            return o, vjp(do)

        return [np.asarray(x, np.float32) for x in jax.tree.leaves(jax.jit(run)(*args))]

    want = outputs_and_grads("reference")
    with pallas_interpret():
        return [max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in
                    zip(outputs_and_grads(impl), want, strict=True)) for impl in impls]


def check(impls=("chunked", "pallas_gpu", "pallas_tpu")):
    """Errors of each implementation (Pallas in interpret mode) against the reference."""
    cases = [  # (B, T, K, G, H, window, softcap, sinks, segments)
        (2, 77, 2, 4, 64, None, None, False, False),
        (1, 130, 1, 8, 128, 48, 30.0, True, True),
        (2, 61, 4, 1, 64, 16, None, True, True),
    ]
    print("max |impl - reference| / max |reference| over o, dq, dk, dv, dsinks (causal)\n")
    print("| dtype | case | " + " | ".join(impls) + " |")
    print("|---|---|" + "---|" * len(impls))
    for dtype, case in itertools.product((jnp.float32, jnp.bfloat16), cases):
        errors = case_errors(impls, dtype, *case)
        B, T, K, G, H, window, softcap, sinks, segments = case
        name = f"B={B} T={T} K={K} G={G} H={H} window={window} softcap={softcap} sinks={sinks} segments={segments}"
        print(f"| {jnp.dtype(dtype).name} | {name} | " + " | ".join(f"{e:.1e}" for e in errors) + " |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="small shapes (the default on CPU)")
    parser.add_argument("--impls", default=None, help="comma-separated; default: every implementation that runs here")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory", action="store_true", help="print the chunked vs reference memory table")
    parser.add_argument("--check", action="store_true", help="print interpret-mode errors against the reference")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {platform()}, device {jax.devices()[0].device_kind}\n")
    if args.memory:
        memory_table()
        return
    if args.check:
        check()
        return
    small = args.small or platform() == "cpu"
    impls = args.impls.split(",") if args.impls else ["reference", *DEFAULTS.get(platform(), ())]
    if platform() == "gpu" and not args.impls:
        impls.append("cudnn")
    impls = list(dict.fromkeys(impls))
    run_grid(SMALL if small else FULL, impls, args.repeats)


if __name__ == "__main__":
    main()
