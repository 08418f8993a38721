"""Under shard_map every device runs the kernels on its own batch rows and heads.

On the 8 host CPU devices that tests/conftest.py sets.

Interpret mode evaluates the kernel bodies under shard_map's varying-axes typing, which
jax 0.12 rejects for a kernel's own constants, so the interpreted kernels run with
`check_vma=False`; compiled kernels never see their bodies typed that way, and the TPU
lowering check below runs with `check_vma=True`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from modern_jax import execution
from modern_jax.kernels import AttentionSpec, Visibility, add_norm, attention, pallas_interpret
from modern_jax.kernels.flash_tpu import flash_attention_tpu
from modern_jax.ops import norm as ops_norm
from modern_jax.sharding import logical_rules, make_mesh


B, T, K, G, H = 2, 24, 4, 2, 64
HEADS, BATCH = P("data", None, "model"), P("data")  # batch over "data", kv heads over "model"
SPEC = AttentionSpec(scale=H**-0.5, window=7, softcap=20.0)


def inputs():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s, np.float32)) for s in [(B, T, K, G, H), (B, T, K, H), (B, T, K, H)])
    sinks = jnp.asarray(rng.standard_normal((K, G), np.float32))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    return q, k, v, sinks, pos, (pos >= 10).astype(jnp.int32)


def mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def attention_loss_and_grads(impl, sharded, check_vma=True):
    def f(q, k, v, sinks, pos, seg):
        return attention(q, k, v, SPEC, Visibility(pos, pos, seg, seg), sinks_KG=sinks, impl=impl)

    if sharded:  # the sinks are shared by the batch shards: their gradient sums over "data"
        f = jax.shard_map(f, mesh=mesh(), in_specs=(HEADS, HEADS, HEADS, P("model"), BATCH, BATCH), out_specs=HEADS,
                          check_vma=check_vma)
    args = inputs()
    step = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2, 3)))
    return step.lower(*args).compile()(*args)


def norm_loss_and_grads(impl, sharded, check_vma=True):
    q, k, _, sinks, _, _ = inputs()
    x, residual = q.reshape(B * T, -1)[:, :64], k.reshape(B * T, -1)[:, :64]
    w = jnp.linspace(-0.5, 0.5, 64)

    def f(x, residual, w):
        return add_norm(x, residual, w, kind="gemma_rmsnorm", impl=impl)

    if sharded:  # rows over both axes, the weight replicated
        rows = P(("data", "model"))
        f = jax.shard_map(f, mesh=mesh(), in_specs=(rows, rows, P()), out_specs=rows, check_vma=check_vma)
    return jax.jit(jax.value_and_grad(lambda *a: sum(jnp.sum(o**2) for o in f(*a)), argnums=(0, 1, 2)))(x, residual, w)


def assert_trees_close(got, want, what, atol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol, err_msg=what)


def test_attention_under_shard_map():
    want = attention_loss_and_grads("reference", sharded=False)
    with pallas_interpret():
        for impl, check_vma in [("chunked", True), ("pallas_gpu", False), ("pallas_tpu", False)]:
            assert_trees_close(attention_loss_and_grads(impl, True, check_vma), want, impl, atol=1e-4)


def test_norm_under_shard_map():
    want = norm_loss_and_grads("reference", sharded=False)
    for target in ("gpu", "tpu"):
        with pallas_interpret(target):
            assert_trees_close(norm_loss_and_grads("pallas", True, check_vma=False), want, target, atol=1e-3)


def test_pallas_tpu_lowers_under_shard_map():
    def f(q, k, v, sinks, pos, seg):
        return flash_attention_tpu(q, k, v, SPEC, Visibility(pos, pos, seg, seg), sinks_KG=sinks)

    f = jax.shard_map(f, mesh=mesh(), in_specs=(HEADS, HEADS, HEADS, P("model"), BATCH, BATCH), out_specs=HEADS)
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2, 3)))
    assert grad.trace(*inputs()).lower(lowering_platforms=("tpu",)).as_text().count("tpu_custom_call") == 3


@pytest.mark.quick
def test_the_model_norm_runs_the_kernel_per_device_under_the_rules():
    """`ops.norm.add_norm`, as the layers call it, on a (data=2, tensor=4) mesh with the Pallas
    norm (interpret mode): wrapped in a shard_map, each device normalises its own rows, equal
    to the reference norm on one device."""
    rng = np.random.default_rng(0)
    x, residual = (jnp.asarray(rng.standard_normal((2, 8, 64), np.float32)) for _ in range(2))
    w = jnp.linspace(-0.5, 0.5, 64)
    want = add_norm(x, residual, w, kind="rmsnorm", impl="reference")
    f = jax.jit(lambda *a: ops_norm.add_norm(*a, kind="rmsnorm"))
    with (logical_rules(make_mesh(data=2, tensor=4)), execution.use(execution.ExecutionConfig(norm_impl="pallas")),
          pallas_interpret()):
        traced = f.trace(x, residual, w)
        assert "shard_map" in str(traced.jaxpr)
        got = traced.lower().compile()(x, residual, w)
    assert_trees_close(got, want, "add_norm", atol=1e-5)
