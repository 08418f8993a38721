"""The fused Pallas norm (GPU and TPU kernels, interpret mode) against the reference.

Tolerances, as max |kernel - reference| / max |reference| per tensor: 1e-5 in float32,
1e-2 in bfloat16 (one bfloat16 rounding of the output; dx is rounded too).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from modern_jax.sharding import devices
from modern_jax.kernels import NormImpl, UnsupportedFeatureError, add_norm, norm, pallas_interpret
from modern_jax.kernels.norm import _Call, _fused, resolve


TOL = {"float32": 1e-5, "bfloat16": 1e-2}

# name: (kind, rows, weight shape, bias, fused residual add, dtype)
CASES = {
    "rmsnorm": ("rmsnorm", 37, (100,), False, False, "float32"),
    "rmsnorm_add_bf16": ("rmsnorm", 50, (128,), False, True, "bfloat16"),
    "gemma_add": ("gemma_rmsnorm", 19, (96,), False, True, "float32"),
    "gemma_bf16": ("gemma_rmsnorm", 1100, (64,), False, False, "bfloat16"),  # several row blocks, ragged
    "layernorm_bias_add": ("layernorm", 33, (80,), True, True, "float32"),
    "layernorm_heads": ("layernorm", 21, (4, 16), False, False, "float32"),  # qk-norm over (heads, head_dim)
}


def make_inputs(kind, rows, shape, bias, fused, dtype):
    rng = np.random.default_rng(rows)
    normal = lambda *s: rng.standard_normal(s, np.float32)  # noqa: E731
    x = jnp.asarray(normal(rows, *shape) * 3 + 1, dtype)
    residual = jnp.asarray(normal(rows, *shape), dtype) if fused else None
    w = jnp.asarray(normal(*shape) * 0.1 + (0.0 if kind == "gemma_rmsnorm" else 1.0))
    b = jnp.asarray(normal(*shape)) if bias else None
    cotangents = (jnp.asarray(normal(rows, *shape), dtype), jnp.asarray(normal(rows, *shape), dtype))
    return (x, residual, w, b), cotangents


def run(impl, kind, fused, args, cotangents):
    def fn(x, residual, w, b):
        if fused:
            return add_norm(x, residual, w, b, kind=kind, eps=1e-5, impl=impl)
        return x, norm(x, w, b, kind=kind, eps=1e-5, impl=impl)

    def outputs_and_grads(*args):
        outs, vjp = jax.vjp(fn, *args)
        return outs, vjp(cotangents)

    return jax.jit(outputs_and_grads).lower(*args).compile()(*args)


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_pallas_norm_matches_reference(case, target):
    kind, _, _, _, fused, dtype = CASES[case]
    args, cotangents = make_inputs(*CASES[case])
    want = run("reference", kind, fused, args, cotangents)
    with pallas_interpret(target):
        got = run("pallas", kind, fused, args, cotangents)
    names = ["h", "y", "dx", "dresidual", "dweight", "dbias"]
    leaves = lambda tree: jax.tree.leaves(tree, is_leaf=lambda x: x is None)  # noqa: E731
    for name, a, b in zip(names, leaves(got), leaves(want), strict=True):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6)
        assert err <= TOL[dtype], f"{name}: relative error {err:.2e}"


@pytest.mark.quick
def test_default_and_explicit_choice():
    with pallas_interpret(False):
        assert resolve("default") is NormImpl.REFERENCE  # CPU
        with pytest.raises(UnsupportedFeatureError, match="GPU or a TPU"):
            resolve("pallas")
    with pallas_interpret("tpu"):
        assert resolve("pallas") is NormImpl.PALLAS
    with pytest.raises(ValueError, match="kind"):
        norm(jnp.ones((2, 4)), jnp.ones(4), kind="batchnorm")


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_pallas_norm_lowers_for_its_platform(platform):
    x = jax.ShapeDtypeStruct((300, 2304), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2304,), jnp.float32)
    call = _Call("layernorm", 1e-6, platform, False)

    def loss(x, r, w, b):
        h, y = _fused(call, x, r, w, b)
        return jnp.sum(h.astype(jnp.float32) ** 2) + jnp.sum(y.astype(jnp.float32))

    traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(x, x, w, w)
    if platform == "tpu":
        assert traced.lower(lowering_platforms=("tpu",)).as_text().count("tpu_custom_call") == 2
        return
    with devices.lowering_for("sm_90a"):  # an abstract H100
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(x, x, w, w).lower(lowering_platforms=("cuda",))
        assert text.as_text().count("__gpu$xla.gpu.triton") == 2
