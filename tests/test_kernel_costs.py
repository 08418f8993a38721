"""The costs the Pallas kernels declare (`pl.CostEstimate`, `kernels/costs.py`), against XLA's count.

A kernel's declared cost is read from the traced program (its `pallas_call`'s `cost_estimate`)
and set against XLA's count of the same math written in plain jnp for CPU:
`jit(f).lower(...).cost_analysis()`, the unoptimised program, every operation counted once
(the optimised one may repeat elementwise work that fusion duplicates).

Attention (B 1, T = S 1024, K 2, G 2, H = U 128, bfloat16, each kernel's own tiles):
- forward: einsum scores, softmax, p v;
- dq: the vjp of that einsum attention in q alone: the scores again (the kernel recomputes
  them, and p, from the saved log-sum-exp), dp = do v^T, dq = ds k (jax drops p v, unused):
  the dq kernel's three products;
- dk / dv: its vjp in k and v: the scores again, dv = p^T do, dp, dk = ds^T q: the dk / dv
  kernel's four.
The kernels declare matmul flops only: the einsums' few elementwise flops per score (against
2 (H + U) and more of matmul) keep the two within 3 %. Under a mask the einsum still computes
every score, the kernels only the tiles they visit: the einsum's count is scaled by the
visited fraction, found here by a loop over the tile pairs.

The TPU compiler adds a declared cost to its own (`compiled.cost_analysis()`); jax's Triton
lowering drops it, so on GPU the declared values are what is tested.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from modern_jax.kernels import AttentionSpec, Visibility, gpu_compile
from modern_jax.kernels.flash_gpu import default_blocks, flash_attention_gpu
from modern_jax.kernels.flash_tpu import TpuBlocks, flash_attention_tpu
from modern_jax.kernels.grouped import grouped_matmul
from modern_jax.kernels.masks import MASK_VALUE, softcap
from modern_jax.kernels.norm import _Call, _fused, norm_reference
from modern_jax.kernels.norm_rows import rows_backward
from modern_jax.sharding.devices import compiling_for, lowering_for, topology_devices

B, T, K, G, H = 1, 1024, 2, 2, 128
DTYPE = jnp.bfloat16
MASKS = {"none": AttentionSpec(scale=H**-0.5, causal=False),
         "causal": AttentionSpec(scale=H**-0.5, causal=True),
         "window_softcap": AttentionSpec(scale=H**-0.5, causal=True, window=200, softcap=30.0),
         "chunk": AttentionSpec(scale=H**-0.5, causal=True, chunk=300)}
TPU_TILES = TpuBlocks().fit(T, T)
GPU_TILES = default_blocks(H, DTYPE).fit(T, T)
# kernel: (function, {pass: its (tile_t, tile_s)})
KERNELS = {
    "tpu": (flash_attention_tpu, {"fwd": (TPU_TILES.block_q, TPU_TILES.block_k),
                                  "dq": (TPU_TILES.block_q_bwd, TPU_TILES.block_k_bwd),
                                  "dkdv": (TPU_TILES.block_q_bwd, TPU_TILES.block_k_bwd)}),
    "gpu": (flash_attention_gpu, {"fwd": (GPU_TILES.block_q, GPU_TILES.block_k),
                                  "dq": (GPU_TILES.block_q_bwd, GPU_TILES.block_k_bwd),
                                  "dkdv": (GPU_TILES.block_q_bwd, GPU_TILES.block_k_bwd)}),
}


def shapes(sharding=None):
    S = lambda *shape: jax.ShapeDtypeStruct(shape, DTYPE, sharding=sharding)  # noqa: E731
    return S(B, T, K, G, H), S(B, T, K, H), S(B, T, K, H), S(B, T, K, G, H)  # q, k, v, do


def declared(fn, *args) -> list:
    """`(name, declared CostEstimate, bytes of its operands and results)` of each pallas_call of `fn`."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                io = sum(v.aval.size * v.aval.dtype.itemsize for v in (*eqn.invars, *eqn.outvars))
                found.append((eqn.params["name"], eqn.params["cost_estimate"], io))
                continue
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
                        walk(getattr(sub, "jaxpr", sub))

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def xla_cost(fn, *args) -> dict:
    """XLA's flops and transcendentals of `fn` on CPU, before optimisation."""
    cost = jax.jit(fn).lower(*args).cost_analysis()
    return {"flops": cost["flops"], "transcendentals": cost.get("transcendentals", 0.0)}


def with_vjp(fn):
    """`fn`'s outputs and its vjp of the given cotangents: the forward and the backward, no loss around them."""

    def run(*args_and_cotangent):
        out, pullback = jax.vjp(fn, *args_and_cotangent[:-1])
        return out, pullback(args_and_cotangent[-1])

    return run


def kernel_attention(kernel, spec):
    def attend(q, k, v):
        pos = jnp.broadcast_to(jnp.arange(T), (B, T))
        return KERNELS[kernel][0](q, k, v, spec, Visibility(pos, pos))

    return attend


def visible(spec):
    """The dense mask `[T, S]` of positions 0 .. T - 1, from the rule itself."""
    q, k = np.arange(T)[:, None], np.arange(T)[None, :]
    mask = np.ones((T, T), bool)
    if spec.causal:
        mask &= k <= q
    if spec.window is not None:
        mask &= q - k < spec.window
    if spec.chunk is not None:
        mask &= q // spec.chunk == k // spec.chunk
    return mask


def visited_fraction(mask, tile_t, tile_s):
    """The share of all scores lying in (query tile, key tile) pairs that hold any visible one."""
    hits = sum(mask[i:i + tile_t, j:j + tile_s].any() for i in range(0, T, tile_t) for j in range(0, T, tile_s))
    return hits * tile_t * tile_s / mask.size


@functools.cache
def einsum_costs(mask_name):
    """XLA's count of the einsum attention under the mask, and of its vjps in q and in (k, v)."""
    spec, mask = MASKS[mask_name], visible(MASKS[mask_name])

    def attend(q, k, v):
        s = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32) * spec.scale
        p = jax.nn.softmax(jnp.where(mask, softcap(s, spec.softcap), MASK_VALUE), axis=-1)
        return jnp.einsum("BKGTS,BSKU->BTKGU", p.astype(v.dtype), v).astype(q.dtype)

    def vjp_in(argnums):
        def grads(q, k, v, do):
            _, pullback = jax.vjp(attend, q, k, v)
            return [pullback(do)[i] for i in argnums]

        return grads

    q, k, v, do = shapes()
    return {"fwd": xla_cost(attend, q, k, v), "dq": xla_cost(vjp_in((0,)), q, k, v, do),
            "dkdv": xla_cost(vjp_in((1, 2)), q, k, v, do)}


def attention_declared(kernel, mask_name):
    q, k, v, do = shapes()
    found = declared(with_vjp(kernel_attention(kernel, MASKS[mask_name])), q, k, v, do)
    assert [name for name, _, _ in found] == [f"flash_attention_{kernel}_{p}" for p in ("fwd", "dq", "dkdv")]
    return {name.rsplit("_", 1)[1]: (cost, io) for name, cost, io in found}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_attention_kernels_declare_the_einsums_cost_over_the_tiles_they_visit(kernel, mask):
    """Forward, dq and dk / dv: flops and transcendentals (exps, and tanhs under the soft-cap)
    within 5 % of the einsum's times the visited fraction (see the module docstring); bytes are
    the call's operands and results. Causal, each pass costs its visited fraction of the
    unmasked one: a half plus the diagonal tiles."""
    got, want = attention_declared(kernel, mask), einsum_costs(mask)
    full = attention_declared(kernel, "none")
    for name, (cost, io) in got.items():
        fraction = visited_fraction(visible(MASKS[mask]), *KERNELS[kernel][1][name])
        assert cost.flops == pytest.approx(want[name]["flops"] * fraction, rel=0.05), name
        assert cost.transcendentals == pytest.approx(want[name]["transcendentals"] * fraction, rel=0.05), name
        assert cost.bytes_accessed == io, name
        if mask == "causal":
            assert cost.flops / full[name][0].flops == pytest.approx(fraction) and 0.5 < fraction <= 0.75, name


def one_tpu_chip():
    devices = topology_devices("v5e:1x1")
    return NamedSharding(jax.sharding.Mesh(np.asarray(devices[:1]), ("x",)), PartitionSpec())


def tpu_cases(sharding):
    """family: (function, arguments and cotangent) for a TPU chip."""
    S = lambda *shape, dtype=DTYPE: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    call = _Call("layernorm", 1e-6, "tpu", False)
    sizes = np.array([100, 0, 156, 256])
    return {
        "attention": (kernel_attention("tpu", MASKS["causal"]), shapes(sharding)),
        "norm": (lambda x, r, w, b: _fused(call, x, r, w, b),
                 (S(512, 1024), S(512, 1024), S(1024, dtype=jnp.float32), S(1024, dtype=jnp.float32),
                  (S(512, 1024), S(512, 1024)))),
        "megablox": (lambda x, w: grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), impl="megablox"),
                     (S(512, 256), S(4, 256, 512), S(512, 512))),
    }


@pytest.mark.parametrize("family", ["attention", "norm", "megablox"])
def test_the_tpu_compiler_counts_the_declared_flops(family):
    """The forward and backward kernels compiled for one v5e chip (deviceless): the program's
    flops hold what the calls declare, within 5 % (the rest: a few small XLA ops). Megablox
    (jax's own gmm, tgmm) declares 2 Z W O per call: y = x w, dx = dy w^T, dw = x^T dy."""
    fn, args = tpu_cases(one_tpu_chip())[family]
    with compiling_for("tpu"):
        calls = declared(with_vjp(fn), *args)
        compiled = jax.jit(with_vjp(fn)).lower(*args).compile().cost_analysis()
    total = sum(cost.flops for _, cost, _ in calls)
    assert len(calls) == {"attention": 3, "norm": 2, "megablox": 3}[family]
    assert total <= compiled["flops"] <= 1.05 * total, calls
    if family == "megablox":
        Z, W, O = 512, 256, 512
        assert [cost.flops for _, cost, _ in calls] == [pytest.approx(2 * Z * W * O, rel=0.05)] * 3


def test_megablox_tiles_read_the_experts_weights_and_rows_a_few_times_not_once_a_128_tile():
    """Mixtral's up projection for 4096 rows routed to 8 experts (bfloat16): every tile of rows
    reads its expert's weight, every tile of columns the rows. The bytes megablox declares for the
    forward and backward (its own count of what its tiles read) stay within 3x of reading every
    operand and writing every result once (2.2x at most here); 128 x 128 tiles read 7.7x."""
    E, Z, W, O = 8, 4096, 4096, 14336
    S = lambda *shape: jax.ShapeDtypeStruct(shape, DTYPE, sharding=one_tpu_chip())  # noqa: E731
    sizes = jnp.full((E,), Z // E, jnp.int32)
    with compiling_for("tpu"):
        calls = declared(with_vjp(lambda x, w: grouped_matmul(x, w, sizes, impl="megablox")),
                         S(Z, W), S(E, W, O), S(Z, O))
    once = 2 * (Z * W + E * W * O + Z * O)  # x w, dy w^T, x^T dy: each reads two of x, w, dy and writes the third
    read = [cost.bytes_accessed for _, cost, _ in calls]
    assert len(read) == 3 and all(once <= r <= 3 * once for r in read), read


def test_only_the_tpu_lowering_carries_the_estimate():
    """Mosaic writes the estimate into its custom call's backend config; the Triton custom call
    holds the kernel's IR, name, grid and launch settings only (jax 0.12), so XLA:GPU's cost model
    sees no flops in a Pallas GPU kernel. When that changes, so does docs/kernels.md."""
    q, k, v, _ = shapes()
    fn = kernel_attention("tpu", MASKS["none"])
    [(_, cost, _)] = declared(fn, q, k, v)
    assert f'\\22flops\\22:{cost.flops},' in jax.jit(fn).trace(q, k, v).lower(lowering_platforms=("tpu",)).as_text()
    with lowering_for("sm_90a"):
        text = gpu_compile.lower(kernel_attention("gpu", MASKS["none"]), q, k, v).as_text()
    assert "__gpu$xla.gpu.triton" in text and "flops" not in text


# kind, fused residual add, bias
NORMS = [("rmsnorm", True, False), ("gemma_rmsnorm", False, False), ("layernorm", True, True)]


@pytest.mark.parametrize(("kind", "fused", "bias"), NORMS)
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_norm_kernels_declare_their_row_math(platform, kind, fused, bias):
    """Forward: flops and rsqrts within 5 % of XLA's count of the reference norm (+ the residual
    add) in float32 (in bfloat16 XLA counts each dtype cast as a flop, which the kernels do in
    registers). Backward: autodiff of the reference takes another route (layernorm: 17 flops an
    element against the kernels' 16), so it is compared with XLA's count of the kernels' own row
    math, `norm_rows.rows_backward`, with the dw and db sums over rows and dx + dh. Bytes: the
    calls' operands and results (M 512 bfloat16 rows of D 1024)."""
    M, D = 512, 1024
    X, V = jax.ShapeDtypeStruct((M, D), DTYPE), jax.ShapeDtypeStruct((D,), jnp.float32)
    X32 = jax.ShapeDtypeStruct((M, D), jnp.float32)
    call = _Call(kind, 1e-6, platform, False)
    args = (X, X if fused else None, V, V if bias else None, (X, X))
    got = {name: (cost, io) for name, cost, io in declared(with_vjp(lambda x, r, w, b: _fused(call, x, r, w, b)),
                                                            *args)}

    def forward(x, r, w, b):
        return norm_reference(x + r if fused else x, w, b if bias else None, kind=kind)

    def backward(h, w, dy, dh):
        dx, dw = rows_backward(h, w, dy, kind, 1e-6, D)
        return dx + dh if fused else dx, dw.sum(0), dy.sum(0)

    want = {"fwd": xla_cost(forward, X32, X32, V, V),
            "bwd": xla_cost(backward, X32, jax.ShapeDtypeStruct((1, D), jnp.float32), X32, X32)}
    for name in ("fwd", "bwd"):
        cost, io = got[f"norm_{platform}_{name}"]
        assert cost.flops == pytest.approx(want[name]["flops"], rel=0.05), name
        assert cost.transcendentals == pytest.approx(want[name]["transcendentals"], rel=0.05) == M, name
        assert cost.bytes_accessed == io, name
