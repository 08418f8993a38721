"""Benchmark the norm implementations: runtime and achieved memory bandwidth vs the device peak.

    uv run python scripts/bench_norm.py           # full grid on a GPU / TPU
    uv run python scripts/bench_norm.py --small   # small shapes (automatic on CPU)
    uv run python scripts/bench_norm.py --check   # interpret-mode errors of the Pallas kernels vs the reference

A norm moves data and does little arithmetic, so bandwidth is the figure of merit. Bytes
count the traffic a fused kernel cannot avoid: forward reads x (and the residual) and
writes y (and the new residual h); backward reads h and dy (and dh) and writes dx. The
peak is the datasheet HBM bandwidth of the device; on CPU it is a measured copy
(`x + 1` read once, written once), so the CPU column says how close to a streaming copy
XLA gets. Pallas on CPU runs only in interpret mode, far too slowly to time.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from modern_jax.kernels import add_norm, norm, pallas_interpret
from modern_jax.sharding.devices import platform
from modern_jax.report import median_seconds

FULL = dict(rows=(4096, 32768), width=(2048, 4096, 8192))
SMALL = dict(rows=(2048,), width=(1024, 4096))
PEAK_BYTES_PER_S = {  # datasheet HBM bandwidth by device_kind prefix
    "NVIDIA H200": 4.8e12,
    "NVIDIA H100": 3.35e12,
    "NVIDIA A100-SXM4-80GB": 2.04e12,
    "NVIDIA A100": 1.56e12,
    "TPU v6 lite": 1.64e12,
    "TPU v5 lite": 8.19e11,
    "TPU v5": 2.77e12,
    "TPU v4": 1.23e12,
}


def peak_bandwidth(repeats: int) -> tuple[float, str]:
    kind = jax.devices()[0].device_kind
    for prefix, peak in PEAK_BYTES_PER_S.items():
        if kind.startswith(prefix):
            return peak, f"{kind} datasheet"
    x = jnp.ones((64 * 2**20 // 4,), jnp.float32)
    seconds = median_seconds(jax.jit(lambda x: x + 1), x, repeats=repeats)
    return 2 * x.nbytes / seconds, f"{kind}: measured copy of 64 MiB"


def bench(impl, fused, M, D, dtype, repeats):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((M, D), np.float32), dtype)
    residual = jnp.asarray(rng.standard_normal((M, D), np.float32), dtype)
    w = jnp.zeros((D,), jnp.float32)

    def forward(x, residual, w):
        if fused:
            return add_norm(x, residual, w, kind="gemma_rmsnorm", impl=impl)
        return norm(x, w, kind="gemma_rmsnorm", impl=impl)

    def loss(x, residual, w):
        return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(forward(x, residual, w)))

    fwd = median_seconds(jax.jit(forward), x, residual, w, repeats=repeats)
    fwd_bwd = median_seconds(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), x, residual, w, repeats=repeats)
    itemsize = jnp.dtype(dtype).itemsize
    fwd_bytes = M * D * itemsize * (4 if fused else 2)
    bwd_bytes = M * D * itemsize * (4 if fused else 3)
    return fwd, fwd_bytes / fwd, fwd_bwd, (fwd_bytes + bwd_bytes) / fwd_bwd


def run_grid(grid, impls, repeats):
    peak, source = peak_bandwidth(repeats)
    print(f"peak {peak / 1e9:.0f} GB/s ({source})\n")
    print("| impl | residual add | rows | D | fwd us | fwd GB/s | % peak | fwd+bwd us | fwd+bwd GB/s | % peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for M, D, fused in itertools.product(grid["rows"], grid["width"], (False, True)):
        for impl in impls:
            fwd, fwd_bw, fwd_bwd, fwd_bwd_bw = bench(impl, fused, M, D, jnp.bfloat16, repeats)
            print(f"| {impl} | {'yes' if fused else 'no'} | {M} | {D} | {fwd * 1e6:.0f} | {fwd_bw / 1e9:.0f} | "
                  f"{100 * fwd_bw / peak:.0f} | {fwd_bwd * 1e6:.0f} | {fwd_bwd_bw / 1e9:.0f} | "
                  f"{100 * fwd_bwd_bw / peak:.0f} |", flush=True)


def relative_error(got, want) -> float:
    """max |got - want| / max |want| (0 when both are all zeros)."""
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def case_errors(dtype, kind, M, D, fused):
    """Errors of the GPU and the TPU kernel (interpret mode) over h, y, dx, dresidual, dweight, dbias."""
    rng = np.random.default_rng(M)
    x, residual, dy, dh = (jnp.asarray(rng.standard_normal((M, D), np.float32), dtype) for _ in range(4))
    w, b = (jnp.asarray(rng.standard_normal(D, np.float32)) for _ in range(2))
    b = b if kind == "layernorm" else None

    def outputs_and_grads(impl):
        def f(x, residual, w, b):
            if fused:
                return add_norm(x, residual, w, b, kind=kind, impl=impl)
            return x, norm(x, w, b, kind=kind, impl=impl)

        def run(*a):
            outs, vjp = jax.vjp(f, *a)
            return outs, vjp((dh, dy))

        return [np.asarray(a, np.float32) for a in jax.tree.leaves(jax.jit(run)(x, residual, w, b))]

    want = outputs_and_grads("reference")
    errors = []
    for target in ("gpu", "tpu"):
        with pallas_interpret(target):
            got = outputs_and_grads("pallas")
        errors.append(max(relative_error(a, b) for a, b in zip(got, want, strict=True)))
    return errors


def check():
    """Max error of the Pallas kernels (interpret mode, both lowerings) against the reference."""
    print("max |pallas - reference| / max |reference| over h, y, dx, dresidual, dweight, dbias\n")
    print("| dtype | kind | rows x D | residual add | gpu kernel | tpu kernel |")
    print("|---|---|---|---|---|---|")
    for dtype, kind, M, D, fused in [
        (jnp.float32, "rmsnorm", 300, 100, False), (jnp.float32, "layernorm", 77, 256, True),
        (jnp.bfloat16, "gemma_rmsnorm", 1500, 64, True), (jnp.bfloat16, "layernorm", 129, 384, False),
    ]:
        gpu, tpu = case_errors(dtype, kind, M, D, fused)
        print(f"| {jnp.dtype(dtype).name} | {kind} | {M} x {D} | {'yes' if fused else 'no'} | {gpu:.1e} | "
              f"{tpu:.1e} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="small shapes (the default on CPU)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--check", action="store_true", help="print interpret-mode errors against the reference")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {platform()}, device {jax.devices()[0].device_kind}\n")
    if args.check:
        check()
        return
    on_accelerator = platform() in ("gpu", "tpu")
    impls = ["reference", "pallas"] if on_accelerator else ["reference"]
    run_grid(FULL if on_accelerator and not args.small else SMALL, impls, args.repeats)


if __name__ == "__main__":
    main()
