"""Compile every Pallas kernel, forward and backward, for TPU v5e / v5p / v6e and GPU sm_90a / sm_80, on a CPU.

    .venv/bin/python scripts/check_kernels_compile.py                 # the whole grid (about 3.5 min on 2 cores)
    .venv/bin/python scripts/check_kernels_compile.py --quick         # one case per kernel family (35 s)
    .venv/bin/python scripts/check_kernels_compile.py --platform gpu --kernel attention --case h128

Kernels: flash attention (forward, dq, dk/dv), the fused norm (forward, backward), and the
MoE grouped matmul (megablox: gmm forward, gmm for dx, tgmm for dw; TPU only: on GPU the
grouped matmul is XLA's `ragged_dot`, no Pallas kernel). Each kernel is traced with the
default tiles its wrapper picks, as a training step would call it, through the kernel dispatch
with the implementation named explicitly (so nothing falls back silently).

- TPU: libtpu compiles deviceless for one chip of a topology (`sharding.devices`); Mosaic
  rejects a kernel whose blocks do not fit VMEM, so a compiled program proves they fit. A
  program compiles as a whole: each of its kernels gets a line, all ok or the error.
- GPU: `modern_jax.kernels.gpu_compile` compiles each Triton kernel to a cubin with the
  `triton` package and reports registers, spill bytes and shared memory against the
  architecture's limits (a kernel that spills or does not fit fails).

Compiling proves the kernels lower and fit the hardware; it says nothing of their speed
or of faults at run time. One line per kernel, then `compiled: N ok, M failed`; exit 1 on
any failure.
"""

from __future__ import annotations

import os

# before jax starts: host CPU devices only (TPUs and GPUs are compile targets; topology_devices
# quiets libtpu itself)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from modern_jax.kernels import (  # noqa: E402
    AttentionSpec,
    Visibility,
    add_norm,
    attention,
    gpu_compile,
    norm,
    pallas_interpret,
)
from modern_jax.sharding.devices import ARCHS, compiling_for  # noqa: E402
from modern_jax.kernels.grouped import grouped_matmul  # noqa: E402
from modern_jax.sharding.devices import topology_devices  # noqa: E402

TPU_CHIPS = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
GPU_ARCHS = tuple(ARCHS)
F32, BF16 = "float32", "bfloat16"


# ----- the grid ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionCase:
    """One attention call: q[B, T, K, G, H] against T keys (a ragged T: not a multiple of any tile)."""

    name: str
    H: int
    dtype: str
    K: int
    G: int
    T: int = 1000
    causal: bool = True
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    segments: bool = False
    max_logit: bool = False  # the training step's diagnostic: the forward keeps one more running max
    B: int = 2


# Every head dim x dtype; the heavy case of each (`_all`) carries every feature (the most registers),
# the light one another group size and masking. K=1 is MQA; lengths are ragged (1000, 777, 515, 300).
ATTENTION = [
    AttentionCase("h64_bf16_mha_causal", 64, BF16, K=4, G=1),
    AttentionCase("h64_bf16_gqa4_all", 64, BF16, K=2, G=4, T=777, window=256, softcap=30.0, sinks=True,
                  segments=True, max_logit=True),
    AttentionCase("h64_f32_gqa2_window", 64, F32, K=2, G=2, T=515, window=128),
    AttentionCase("h64_f32_mqa_all", 64, F32, K=1, G=8, window=256, softcap=30.0, sinks=True, segments=True,
                  max_logit=True),
    AttentionCase("h128_bf16_mqa_noncausal_sinks", 128, BF16, K=1, G=8, T=300, causal=False, sinks=True),
    AttentionCase("h128_bf16_gqa2_all", 128, BF16, K=2, G=2, window=256, softcap=50.0, sinks=True, segments=True,
                  max_logit=True),
    AttentionCase("h128_f32_gqa4_softcap_segments", 128, F32, K=2, G=4, T=777, softcap=30.0, segments=True),
    AttentionCase("h128_f32_mha_all", 128, F32, K=2, G=1, T=515, window=128, softcap=30.0, sinks=True,
                  segments=True, max_logit=True),
    AttentionCase("h256_bf16_gqa8_window_sinks", 256, BF16, K=2, G=8, T=515, window=64, sinks=True),
    AttentionCase("h256_bf16_gqa2_all", 256, BF16, K=2, G=2, window=256, softcap=30.0, sinks=True, segments=True,
                  max_logit=True),
    AttentionCase("h256_f32_mqa_noncausal_softcap", 256, F32, K=1, G=4, T=300, causal=False, softcap=30.0),
    AttentionCase("h256_f32_gqa4_all", 256, F32, K=2, G=4, T=777, window=128, softcap=30.0, sinks=True,
                  segments=True, max_logit=True),
]


@dataclass(frozen=True)
class NormCase:
    """One norm of `rows` rows over D features, as a model's residual stream (or qk-norm) calls it."""

    name: str
    kind: str
    D: int
    dtype: str
    fused_add: bool = False
    bias: bool = False
    rows: int = 1000


NORM = [
    NormCase("rmsnorm_d4096_bf16", "rmsnorm", 4096, BF16),
    NormCase("rmsnorm_add_d8192_bf16", "rmsnorm", 8192, BF16, fused_add=True),
    NormCase("rmsnorm_add_d16384_bf16", "rmsnorm", 16384, BF16, fused_add=True),
    NormCase("rmsnorm_d128_f32", "rmsnorm", 128, F32, rows=4000),  # qk-norm over one head
    NormCase("gemma_rmsnorm_add_d3072_f32", "gemma_rmsnorm", 3072, F32, fused_add=True),
    NormCase("layernorm_bias_d1000_f32", "layernorm", 1000, F32, bias=True),  # D not a power of two
    NormCase("layernorm_bias_add_d8192_f32", "layernorm", 8192, F32, fused_add=True, bias=True),
    NormCase("layernorm_bias_add_d16384_bf16", "layernorm", 16384, BF16, fused_add=True, bias=True),
    NormCase("layernorm_add_d2048_bf16", "layernorm", 2048, BF16, fused_add=True),
]


@dataclass(frozen=True)
class GmmCase:
    """x[X, I] sorted into E groups against w[E, I, O] (X ragged: not a multiple of the row tile)."""

    name: str
    X: int
    I: int  # noqa: E741
    O: int  # noqa: E741
    E: int
    dtype: str


GMM = [
    GmmCase("x1000_i1024_o2048_e8_bf16", 1000, 1024, 2048, 8, BF16),
    GmmCase("x300_i512_o768_e4_f32", 300, 512, 768, 4, F32),
    GmmCase("x2050_i2048_o1408_e64_bf16", 2050, 2048, 1408, 64, BF16),  # DeepSeek-like widths, many experts
    GmmCase("x4096_i4096_o14336_e8_bf16", 4096, 4096, 14336, 8, BF16),  # Mixtral's: whole 512 x 1024 x 1024 tiles
    GmmCase("x1024_i1024_o1024_e8_f32", 1024, 1024, 1024, 8, F32),  # whole float32 tiles, 512 x 512 x 512
]

QUICK = {"h128_bf16_gqa2_all", "rmsnorm_add_d8192_bf16", "x1000_i1024_o2048_e8_bf16"}


# ----- one traced program per case: a scalar and its gradient, so forward and backward kernels -----


def attention_program(case: AttentionCase, impl: str, sharding):
    struct = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    B, T, K, G, H = case.B, case.T, case.K, case.G, case.H
    q, kv = struct((B, T, K, G, H), case.dtype), struct((B, T, K, H), case.dtype)
    pos, sinks = struct((B, T), jnp.int32), struct((K, G), jnp.float32)
    spec = AttentionSpec(scale=H**-0.5, causal=case.causal, window=case.window, softcap=case.softcap)

    def loss(q, k, v, pos, sinks_KG):
        seg = pos // 300 if case.segments else None  # documents of 300 tokens
        out = attention(q, k, v, spec, Visibility(pos, pos, seg, seg), sinks_KG=sinks_KG if case.sinks else None,
                        impl=impl, return_max_logit=case.max_logit)
        o, max_logit = out if case.max_logit else (out, 0.0)
        return o.astype(jnp.float32).sum() + jnp.sum(max_logit)

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 4)), (q, kv, kv, pos, sinks)


def norm_program(case: NormCase, sharding):
    struct = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    x, w = struct((case.rows, case.D), case.dtype), struct((case.D,), jnp.float32)
    b = struct((case.D,), jnp.float32) if case.bias else None

    def loss(x, residual, w, b):
        if case.fused_add:
            h, y = add_norm(x, residual, w, b, kind=case.kind, impl="pallas")
            return (h.astype(jnp.float32) * y.astype(jnp.float32)).sum()
        return jnp.square(norm(x, w, b, kind=case.kind, impl="pallas").astype(jnp.float32)).sum()

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3) if case.bias else (0, 1, 2)), (x, x, w, b)


def gmm_program(case: GmmCase, sharding):
    struct = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    x, w = struct((case.X, case.I), case.dtype), struct((case.E, case.I, case.O), case.dtype)

    def loss(x, w, sizes_E):
        return grouped_matmul(x, w, sizes_E, impl="megablox").astype(jnp.float32).sum()

    return jax.value_and_grad(loss, argnums=(0, 1)), (x, w, struct((case.E,), jnp.int32))


# ----- compiling -------------------------------------------------------------------------------------


@dataclass
class Tally:
    ok: int = 0
    failed: list[str] = field(default_factory=list)

    def report(self, line: str, ok: bool):
        print(f"{line}  {'ok' if ok else 'FAILED'}", flush=True)
        if ok:
            self.ok += 1
        else:
            self.failed.append(line)


def _error(e: Exception) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:600]}"


TPU_LABELS = {"attention": ("flash_attention_tpu_fwd", "flash_attention_tpu_dq", "flash_attention_tpu_dkdv"),
              "norm": ("norm_tpu_fwd", "norm_tpu_bwd"),
              "gmm": ("gmm_fwd", "gmm_dx", "tgmm_dw")}  # megablox names its kernels "kernel": by program order
GPU_LABELS = {"attention": ("flash_attention_gpu_fwd", "flash_attention_gpu_dq", "flash_attention_gpu_dkdv"),
              "norm": ("norm_gpu_fwd", "norm_gpu_bwd")}


def _program(family: str, case, platform: str, sharding):
    if family == "attention":
        return attention_program(case, "pallas_tpu" if platform == "tpu" else "pallas_gpu", sharding)
    if family == "norm":
        return norm_program(case, sharding)
    return gmm_program(case, sharding)


def compile_tpu(family: str, case, chip: str, device, tally: Tally):
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh([device], ("x",)), jax.sharding.PartitionSpec())
    labels = TPU_LABELS[family]
    head = f"tpu {chip:6s} {family:9s} {{:26s}} {case.name:34s}"
    start = time.perf_counter()
    try:
        with compiling_for("tpu"):
            fn, args = _program(family, case, "tpu", sharding)
            lowered = jax.jit(fn).lower(*args)
        found = lowered.as_text().count("tpu_custom_call(")
        if found != len(labels):
            raise AssertionError(f"expected {len(labels)} Mosaic kernels, found {found}")
        named = re.findall(r'kernel_name = "([^"]*)"', lowered.as_text())
        lowered.compile()
    except Exception as e:  # noqa: BLE001 - every failure is reported, the run goes on
        tally.report(head.format("+".join(labels)) + f" {_error(e)}", False)
        return
    seconds = time.perf_counter() - start
    for label, name in zip(labels, named, strict=True):
        if family != "gmm" and name != label:
            tally.report(head.format(label) + f" found kernel {name!r}", False)
        else:
            tally.report(head.format(label) + f" VMEM fits ({seconds:.1f} s for the program)", True)


def compile_gpu(family: str, case, arch: str, tally: Tally):
    labels = GPU_LABELS[family]
    head = f"gpu {arch:6s} {family:9s} {{:26s}} {case.name:34s}"
    try:
        fn, args = _program(family, case, "gpu", None)
        calls = gpu_compile.triton_kernels(gpu_compile.lower(fn, *args, arch=arch))
        names = tuple(call.name for call in calls)
        if names != labels:
            raise AssertionError(f"expected Triton kernels {labels}, found {names}")
    except Exception as e:  # noqa: BLE001
        tally.report(head.format("+".join(labels)) + f" {_error(e)}", False)
        return
    for call in calls:
        try:
            report = gpu_compile.compile_triton(call, arch)
        except Exception as e:  # noqa: BLE001
            tally.report(head.format(call.name) + f" {_error(e)}", False)
            continue
        tally.report(head.format(call.name) + f" {report.line()}", report.ok)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one case per kernel family: " + ", ".join(sorted(QUICK)))
    parser.add_argument("--platform", choices=("tpu", "gpu"), action="append", help="only this platform (repeatable)")
    parser.add_argument("--chip", choices=tuple(TPU_CHIPS), action="append", help="only this TPU (repeatable)")
    parser.add_argument("--arch", choices=GPU_ARCHS, action="append", help="only this GPU arch (repeatable)")
    parser.add_argument("--kernel", choices=("attention", "norm", "gmm"), action="append",
                        help="only this kernel family (repeatable)")
    parser.add_argument("--case", help="only cases whose name contains this")
    args = parser.parse_args(argv)

    platforms = args.platform or ["tpu", "gpu"]
    families = args.kernel or ["attention", "norm", "gmm"]
    grid = {"attention": ATTENTION, "norm": NORM, "gmm": GMM}

    def cases(family):
        chosen = [c for c in grid[family] if (not args.quick or c.name in QUICK)]
        return [c for c in chosen if args.case is None or args.case in c.name]

    tally = Tally()
    start = time.perf_counter()
    with pallas_interpret(False):
        if "tpu" in platforms:
            for chip in args.chip or TPU_CHIPS:
                device = topology_devices(TPU_CHIPS[chip])[0]
                print(f"# tpu {chip}: {device.device_kind}, deviceless (libtpu)", flush=True)
                for family in families:
                    for case in cases(family):
                        compile_tpu(family, case, chip, device, tally)
        if "gpu" in platforms:
            for arch in args.arch or GPU_ARCHS:
                print(f"# gpu {arch}: {ARCHS[arch].device_kind}, triton (the MoE grouped matmul is "
                      "XLA's ragged_dot on GPU: no Pallas kernel)", flush=True)
                for family in families:
                    if family in GPU_LABELS:
                        for case in cases(family):
                            compile_gpu(family, case, arch, tally)
    print(f"compiled: {tally.ok} ok, {len(tally.failed)} failed  ({time.perf_counter() - start:.0f} s)")
    for line in tally.failed:
        print(f"FAILED: {line}")
    return 1 if tally.failed else 0


if __name__ == "__main__":
    sys.exit(main())
