"""Attention implementations against the reference: outputs and gradients, dispatch, memory.

The Pallas kernels run in interpret mode on CPU with small tiles, so every case spans
several tiles in both directions and a ragged last tile. The grid is sparse on purpose
(each case mixes several switches) to keep the whole module near a minute.

Tolerances, as max |kernel - reference| / max |reference| per tensor: 2e-5 in float32,
3e-2 in bfloat16 (the reference itself rounds p and the grads to bfloat16).
"""

import dataclasses
import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from modern_jax.sharding import devices
from modern_jax.kernels import (AttentionImpl, AttentionSpec, UnsupportedFeatureError, Visibility, attention,
                                pallas_interpret)
from modern_jax.kernels.attention import attention_reference, resolve
from modern_jax.kernels.chunked import attention_chunked
from modern_jax.kernels.flash_gpu import GpuBlocks, flash_attention_gpu
from modern_jax.kernels.flash_tpu import TpuBlocks, flash_attention_tpu
from modern_jax.kernels.masks import round_up


attention_module = importlib.import_module("modern_jax.kernels.attention")  # the package's `attention` is the function
backend_module = importlib.import_module("modern_jax.kernels.backend")
TOL = {"float32": 2e-5, "bfloat16": 3e-2}

IMPLS = {
    "chunked": lambda *a, **kw: attention_chunked(*a, **kw, block_q=16, block_k=8),
    "pallas_gpu": lambda *a, **kw: flash_attention_gpu(*a, **kw, blocks=GpuBlocks(32, 16, 16, 32), interpret=True),
    "pallas_tpu": lambda *a, **kw: flash_attention_tpu(*a, **kw, blocks=TpuBlocks(16, 32, 32, 16, min_block=8),
                                                       interpret=True),
}

# name: (B, T, S, K, G, H, V, causal, window, softcap, sinks, segments, dtype, positions)
CASES = {
    "mha_causal": (2, 37, 37, 2, 1, 64, 64, True, None, None, False, False, "float32", "arange"),
    "gqa2_window_segments_bf16": (1, 50, 50, 2, 2, 128, 128, True, 9, None, False, True, "bfloat16", "arange"),
    "gqa4_softcap_sinks": (1, 33, 33, 2, 4, 64, 64, True, None, 5.0, True, False, "float32", "arange"),
    "mqa_noncausal_sinks_segments_bf16": (2, 40, 40, 1, 4, 128, 128, False, None, None, True, True, "bfloat16",
                                          "arange"),
    "everything": (1, 45, 45, 2, 2, 64, 64, True, 16, 10.0, True, True, "float32", "arange"),
    "mla_value_dim": (1, 24, 24, 1, 4, 96, 48, True, None, None, True, False, "float32", "arange"),
    "ring_cache_positions": (2, 8, 32, 2, 2, 64, 64, True, 12, None, False, False, "float32", "ring"),
    "noncausal_window_bf16": (1, 29, 29, 2, 1, 64, 64, False, 5, 20.0, False, False, "bfloat16", "arange"),
}


def make_inputs(B, T, S, K, G, H, V, causal, window, softcap, sinks, segments, dtype, positions):
    rng = np.random.default_rng(T * 1000 + S)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)  # noqa: E731
    q, k, v = normal(B, T, K, G, H), normal(B, S, K, H), normal(B, S, K, V)
    if positions == "ring":  # queries 20..27 against a shuffled ring of keys with empty (-1) slots
        q_pos = np.arange(20, 20 + T)[None].repeat(B, 0)
        ring = rng.permutation(np.arange(-4, S - 4))
        k_pos = np.where(ring < 0, -1, ring)[None].repeat(B, 0)
    else:
        q_pos, k_pos = np.arange(T)[None].repeat(B, 0), np.arange(S)[None].repeat(B, 0)
    q_seg = k_seg = None
    if segments:  # three documents per row, boundaries differing across the batch
        cuts = np.array([[T // 3, 2 * T // 3], [T // 4, T // 2]])[:B]
        q_seg = k_seg = jnp.asarray((np.arange(T)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)
    sinks_KG = jnp.asarray(rng.standard_normal((K, G), np.float32)) if sinks else None
    spec = AttentionSpec(scale=H**-0.5, causal=causal, window=window, softcap=softcap)
    vis = Visibility(jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32), q_seg, k_seg)
    return (q, k, v, sinks_KG), spec, vis, normal(B, T, K, G, V)


def outputs_and_grads(fn, args, do, max_logit=False):
    """`o` and the vjp of `do`; with `max_logit`, `fn` returns `(o, max_logit)` and the max's
    cotangent is 1 (it must not change the gradients: the max has none)."""

    def run(q, k, v, sinks_KG, do):
        out, vjp = jax.vjp(fn, q, k, v, sinks_KG)
        if max_logit:
            return out, vjp((do, jnp.ones_like(out[1])))
        return (out, None), vjp(do)

    (o, m), grads = jax.jit(run)(*args, do)
    return {"o": o, "dq": grads[0], "dk": grads[1], "dv": grads[2], "dsinks": grads[3], "max_logit": m}


@functools.cache
def reference_results(case):
    args, spec, vis, do = make_inputs(*CASES[case])

    def fn(q, k, v, sinks_KG):
        return attention_reference(q, k, v, vis.mask(causal=spec.causal, window=spec.window), spec, sinks_KG)

    return outputs_and_grads(fn, args, do)


@functools.cache
def impl_results(case, impl):
    args, spec, vis, do = make_inputs(*CASES[case])
    return outputs_and_grads(lambda q, k, v, s: IMPLS[impl](q, k, v, spec, vis, sinks_KG=s), args, do)


def assert_close(name, got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, name
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6)
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


# The Pallas kernels skip two cases whose switches the others already combine.
PAIRS = [(case, impl) for case in CASES for impl in IMPLS
         if impl == "chunked" or case not in ("mha_causal", "gqa4_softcap_sinks")]


@pytest.mark.parametrize(("case", "impl"), PAIRS)
def test_matches_reference(case, impl):
    got, want = impl_results(case, impl), reference_results(case)
    tol = TOL[CASES[case][12]]
    for name in want:
        if want[name] is None:
            assert got[name] is None
            continue
        assert got[name].dtype == want[name].dtype, name
        assert_close(name, got[name], want[name], tol)


# ----- the max attention logit, measured by each implementation's own pass ---------------------


def dense_max_logit(q, k, vis, spec):
    """max |q.k| * scale over the visible pairs of each head `[K, G]`, in float64 NumPy, one rule at a time."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    x_BTKGS = np.abs(np.einsum("btkgh,bskh->btkgs", q, k)) * spec.scale
    q_pos, k_pos = np.asarray(vis.q_pos)[:, :, None], np.asarray(vis.k_pos)[:, None, :]
    ok = np.broadcast_to(k_pos >= 0, (q.shape[0], q.shape[1], k.shape[1]))
    if spec.causal:
        ok = ok & (k_pos <= q_pos)
    if spec.window is not None:
        ok = ok & (q_pos - k_pos < spec.window)
    if vis.q_seg is not None:
        ok = ok & (np.asarray(vis.q_seg)[:, :, None] == np.asarray(vis.k_seg)[:, None, :])
    return np.max(np.where(ok[:, :, None, None, :], x_BTKGS, 0.0), axis=(0, 1, 4))


MAX_LOGIT_IMPLS = {"reference": lambda q, k, v, spec, vis, **kw: attention(q, k, v, spec, vis, impl="reference",
                                                                           **kw), **IMPLS}
MAX_LOGIT_PAIRS = [(case, "reference") for case in CASES] + PAIRS


@pytest.mark.parametrize(("case", "impl"), MAX_LOGIT_PAIRS)
def test_max_logit_is_exact_and_changes_nothing(case, impl):
    """The returned max of each head equals a dense NumPy max over its visible pairs (before the
    soft-cap), and asking for it leaves the output and every gradient bit for bit as they were."""
    args, spec, vis, do = make_inputs(*CASES[case])
    fn = MAX_LOGIT_IMPLS[impl]
    got = outputs_and_grads(lambda q, k, v, s: fn(q, k, v, spec, vis, sinks_KG=s, return_max_logit=True), args, do,
                            max_logit=True)
    assert got["max_logit"].shape == args[0].shape[2:4] and got["max_logit"].dtype == jnp.float32  # [K, G]
    np.testing.assert_allclose(got["max_logit"], dense_max_logit(args[0], args[1], vis, spec), rtol=1e-5)
    plain = reference_results(case) if impl == "reference" else impl_results(case, impl)
    for name in ("o", "dq", "dk", "dv", "dsinks"):
        if plain[name] is None:
            assert got[name] is None
            continue
        np.testing.assert_array_equal(got[name], plain[name], err_msg=name)


def test_cudnn_cannot_report_the_max_logit(monkeypatch):
    on_gpu(monkeypatch)
    q, k, v, spec, _ = small_call()
    with pytest.raises(UnsupportedFeatureError, match="max attention logit"):
        resolve("cudnn", q, k, v, spec, max_logit=True)
    assert resolve("default", q, k, v, spec, max_logit=True) is AttentionImpl.PALLAS_GPU


# ----- the kernels lower for their platforms (no device needed) ------------------------------


def lower_grad(fn, platform, max_logit=False):
    B, T, K, G, H = 2, 300, 2, 4, 128
    q = jax.ShapeDtypeStruct((B, T, K, G, H), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((B, T), jnp.int32)
    sinks = jax.ShapeDtypeStruct((K, G), jnp.float32)
    spec = AttentionSpec(scale=H**-0.5, window=64, softcap=30.0)

    def loss(q, k, v, pos, seg, sinks):
        out = fn(q, k, v, spec, Visibility(pos, pos, seg, seg), sinks_KG=sinks, return_max_logit=max_logit)
        return out[0].astype(jnp.float32).sum() + out[1].sum() if max_logit else out.astype(jnp.float32).sum()

    traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 5))).trace(q, k, k, pos, pos, sinks)
    return traced.lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("max_logit", [False, True])
def test_pallas_gpu_lowers_to_triton(max_logit):
    with devices.lowering_for("sm_90a"):  # an abstract H100 (jax deprecates Triton for Mosaic GPU: quiet)
        text = lower_grad(flash_attention_gpu, "cuda", max_logit)
    assert text.count("__gpu$xla.gpu.triton") == 3  # forward (with the max logit when asked), dq, dk/dv


@pytest.mark.parametrize("max_logit", [False, True])
def test_pallas_tpu_lowers_to_mosaic(max_logit):
    text = lower_grad(flash_attention_tpu, "tpu", max_logit)
    assert text.count("tpu_custom_call") == 3


# ----- dispatch ---------------------------------------------------------------------------------


def small_call(T=16, dtype=jnp.bfloat16, H=64, V=64, sinks=False, softcap=None):
    q = jnp.zeros((1, T, 1, 2, H), dtype)
    k, v = jnp.zeros((1, T, 1, H), dtype), jnp.zeros((1, T, 1, V), dtype)
    return q, k, v, AttentionSpec(scale=0.1, softcap=softcap), jnp.zeros((1, 2)) if sinks else None


def test_default_resolves_by_platform_and_falls_back():
    q, k, v, spec, _ = small_call()
    assert resolve("default", q, k, v, spec) is AttentionImpl.REFERENCE  # CPU: the oracle
    q1 = q[:, :1]
    assert resolve("default", q1, k, v, spec) is AttentionImpl.CHUNKED  # decoding
    assert resolve("default", q1, k, v, spec, dropout=True) is AttentionImpl.REFERENCE
    with pallas_interpret(False):  # one query (decoding) runs chunked whatever was asked
        assert resolve("pallas_tpu", q1, k, v, spec) is AttentionImpl.CHUNKED
        assert resolve("cudnn", q1, k, v, spec) is AttentionImpl.CHUNKED


@pytest.mark.quick
@pytest.mark.parametrize(("impl", "kwargs", "missing"), [
    ("pallas_tpu", {}, "TPU"),
    ("pallas_gpu", {}, "GPU"),
    ("cudnn", {}, "NVIDIA GPU"),
    ("chunked", {"dropout": True}, "dropout"),
])
def test_explicit_choice_that_cannot_run_raises(impl, kwargs, missing):
    q, k, v, spec, _ = small_call()
    with pallas_interpret(False), pytest.raises(UnsupportedFeatureError, match=missing):
        resolve(impl, q, k, v, spec, **kwargs)


def on_gpu(monkeypatch):
    """Make the dispatch believe it runs on a GPU (it only asks `platform()`)."""
    monkeypatch.setattr(attention_module, "platform", lambda: "gpu")
    monkeypatch.setattr(backend_module, "platform", lambda: "gpu")


@pytest.mark.parametrize(("call", "missing"), [
    (dict(sinks=True), "attention sinks"),
    (dict(softcap=50.0), "soft-cap"),
    (dict(V=32), "different key and value head dims"),
    (dict(dtype=jnp.float32), "float32"),
    (dict(H=72 * 4, V=72 * 4), "head dim"),
])
def test_cudnn_names_the_feature_it_lacks(monkeypatch, call, missing):
    on_gpu(monkeypatch)
    q, k, v, spec, sinks = small_call(**call)
    with pytest.raises(UnsupportedFeatureError, match=missing):
        resolve("cudnn", q, k, v, spec, sinks)
    assert resolve("default", q, k, v, spec, sinks) is AttentionImpl.PALLAS_GPU


def test_cudnn_accepted_when_features_allow(monkeypatch):
    on_gpu(monkeypatch)
    q, k, v, spec, _ = small_call()
    assert resolve("cudnn", q, k, v, spec) is AttentionImpl.CUDNN


def test_dispatch_runs_the_interpreted_kernels():
    args, spec, vis, _ = make_inputs(1, 20, 20, 1, 2, 64, 64, True, 8, 10.0, True, False, "float32", "arange")

    def run(impl):
        fn = lambda q, k, v, s: attention(q, k, v, spec, vis, sinks_KG=s, impl=impl)  # noqa: E731
        return jax.jit(fn)(*args)

    want = run("reference")
    with pallas_interpret():
        for impl in ("pallas_gpu", "pallas_tpu"):
            assert_close(impl, run(impl), want, TOL["float32"])


# ----- chunked memory is linear in T -------------------------------------------------------------


def attention_temp_bytes(impl, T, B=1, K=1, G=2, H=64):
    """Temporary bytes XLA allocates for forward + backward attention (compiled, not run)."""
    q = jax.ShapeDtypeStruct((B, T, K, G, H), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def loss(q, k, v, pos):
        return attention(q, k, v, AttentionSpec(scale=H**-0.5), Visibility(pos, pos),
                         impl=impl).astype(jnp.float32).sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k, pos)
    return compiled.compile().memory_analysis().temp_size_in_bytes


def test_chunked_memory_is_linear_in_length():
    lengths = (2048, 4096, 8192, 16384)
    chunked = [attention_temp_bytes("chunked", T) for T in lengths]
    reference = attention_temp_bytes("reference", 8192)
    assert reference >= 8 * chunked[2], (reference, chunked)
    for small, large in zip(chunked, chunked[1:], strict=False):
        assert large <= 2.1 * small, chunked  # doubling T at most doubles the memory (quadratic would be 4x)


def test_tile_sizes_fit_short_sequences():
    assert GpuBlocks().fit(37, 1).block_q == 64 and GpuBlocks().fit(37, 1).block_k == 16
    assert TpuBlocks().fit(1000, 100).block_k == 128 and TpuBlocks().fit(1000, 100).block_q == 512
    assert math.log2(GpuBlocks().fit(300, 300).block_q).is_integer()


# ----- chunked local attention (Llama 4): every implementation against a dense NumPy rule ------


def chunk_rule(vis, chunk, causal=True):
    """[B, T, S] in NumPy, the rule as stated: a query at p sees the keys of its own block
    `[p // c * c, (p // c + 1) * c)` (at or before p if causal), valid and in its segment."""
    q, k = np.asarray(vis.q_pos)[:, :, None], np.asarray(vis.k_pos)[:, None, :]
    start = (q // chunk) * chunk
    ok = (k >= 0) & (k >= start) & (k < start + chunk)
    if causal:
        ok = ok & (k <= q)
    if vis.q_seg is not None:
        ok = ok & (np.asarray(vis.q_seg)[:, :, None] == np.asarray(vis.k_seg)[:, None, :])
    return ok


def dense_attention(q, k, v, sinks_KG, ok_BTS, scale, cap=None):
    """Softmax attention over a given boolean mask, in float32 jnp (differentiable), no kernel code;
    the output in q's dtype."""
    f32 = jnp.float32
    s_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q.astype(f32), k.astype(f32)) * scale
    if cap is not None:
        s_BKGTS = cap * jnp.tanh(s_BKGTS / cap)
    s_BKGTS = jnp.where(jnp.asarray(ok_BTS)[:, None, None], s_BKGTS, -jnp.inf)
    if sinks_KG is not None:
        sink = jnp.broadcast_to(sinks_KG.astype(f32)[None, :, :, None, None], (*s_BKGTS.shape[:4], 1))
        p_BKGTS = jax.nn.softmax(jnp.concatenate([s_BKGTS, sink], -1), axis=-1)[..., :-1]
    else:
        p_BKGTS = jax.nn.softmax(s_BKGTS, axis=-1)
    return jnp.einsum("bkgts,bskv->btkgv", p_BKGTS, v.astype(f32)).astype(q.dtype)


# name: (chunk, make_inputs(B, T, S, K, G, H, V, causal, window, softcap, sinks, segments, dtype, positions))
CHUNK_CASES = {
    "chunk5_gqa": (5, (2, 37, 37, 2, 2, 64, 64, True, None, None, False, False, "float32", "arange")),
    "chunk12_segments_sinks_mqa": (12, (2, 45, 45, 1, 4, 64, 64, True, None, None, True, True, "float32", "arange")),
    "chunk16_tile_aligned_segments_bf16": (16, (1, 50, 50, 2, 2, 128, 128, True, None, None, False, True, "bfloat16",
                                                "arange")),
    "chunk7_noncausal_softcap": (7, (1, 29, 29, 2, 1, 64, 64, False, None, 5.0, False, False, "float32", "arange")),
    "chunk6_ring_cache": (6, (2, 8, 32, 2, 2, 64, 64, True, None, None, False, False, "float32", "ring")),
}
CHUNK_IMPLS = {"reference": lambda q, k, v, spec, vis, **kw: attention(q, k, v, spec, vis, impl="reference", **kw),
               **IMPLS}


def chunk_inputs(case):
    chunk, args = CHUNK_CASES[case]
    inputs, spec, vis, do = make_inputs(*args)
    return inputs, dataclasses.replace(spec, chunk=chunk), vis, do


@functools.cache
def chunk_oracle(case):
    (q, k, v, sinks), spec, vis, do = chunk_inputs(case)
    ok = chunk_rule(vis, spec.chunk, spec.causal)
    assert ok.any(-1).all()  # every query sees a key: no empty softmax in the oracle

    return outputs_and_grads(lambda q, k, v, s: dense_attention(q, k, v, s, ok, spec.scale, spec.softcap),
                             (q, k, v, sinks), do)


@pytest.mark.parametrize("impl", list(CHUNK_IMPLS))
@pytest.mark.parametrize("case", list(CHUNK_CASES))
def test_chunked_attention_matches_the_numpy_rule(case, impl):
    """Outputs and dq, dk, dv, dsinks of every implementation equal dense attention over the
    NumPy mask (chunks of 5, 6, 7 and 12 are no multiple of the tiles; 16 is), within 2e-5 of
    each tensor's max in float32 and 3e-2 in bfloat16 (the kernels round p to bfloat16)."""
    args, spec, vis, do = chunk_inputs(case)
    fn = CHUNK_IMPLS[impl]
    got = outputs_and_grads(lambda q, k, v, s: fn(q, k, v, spec, vis, sinks_KG=s), args, do)
    want = chunk_oracle(case)
    tol = TOL[CHUNK_CASES[case][1][12]]
    for name in ("o", "dq", "dk", "dv", "dsinks"):
        if want[name] is None:
            assert got[name] is None
            continue
        assert_close(name, got[name], want[name], tol)


@pytest.mark.quick
@pytest.mark.parametrize(("chunk", "block_q", "block_k"), [(5, 8, 8), (12, 16, 8), (16, 16, 32), (7, 32, 16),
                                                           (40, 8, 16)])
def test_chunk_tiles_are_exactly_the_visible_ones(chunk, block_q, block_k):
    """For consecutive positions `Visibility.tiles` marks exactly the tiles holding a visible
    pair of the NumPy rule, so the kernels visit only those; with segments and a shuffled ring
    it may mark more (conservative), never fewer."""
    T = 70
    Tp, Sp = round_up(T, block_q), round_up(T, block_k)
    I, J = Tp // block_q, Sp // block_k
    pos = jnp.asarray(np.arange(T)[None].repeat(2, 0), jnp.int32)
    vis = Visibility(pos, pos).padded(Tp, Sp)
    want_BIJ = chunk_rule(vis, chunk).reshape(2, I, block_q, J, block_k).any((2, 4))
    got_BIJ = np.asarray(vis.tiles(causal=True, window=None, chunk=chunk, block_q=block_q, block_k=block_k))
    np.testing.assert_array_equal(got_BIJ, want_BIJ)
    causal_only = np.asarray(vis.tiles(causal=True, window=None, block_q=block_q, block_k=block_k))
    assert got_BIJ.sum() < causal_only.sum() or chunk >= T  # chunks skip tiles causal attention visits

    rng = np.random.default_rng(chunk)
    seg = jnp.asarray(np.cumsum(rng.random((2, T)) < 0.1, axis=1), jnp.int32)
    ring = jnp.asarray(np.stack([rng.permutation(T) - 3, rng.permutation(T) - 3]).clip(-1), jnp.int32)
    for vis in (Visibility(pos, pos, seg, seg).padded(Tp, Sp), Visibility(pos + 30, ring).padded(Tp, Sp)):
        want_BIJ = chunk_rule(vis, chunk).reshape(2, I, block_q, J, block_k).any((2, 4))
        got_BIJ = np.asarray(vis.tiles(causal=True, window=None, chunk=chunk, block_q=block_q, block_k=block_k))
        assert np.all(got_BIJ >= want_BIJ)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_blocked_implementations_skip_other_chunks(impl):
    """NaN values in the first 8 keys reach every query that visits their tile (p = 0 times NaN
    is NaN); queries of the second chunk (32..63, every tile of every implementation lies inside
    one chunk) never visit it, so their outputs stay finite, while the reference's turn NaN."""
    T, chunk = 64, 32
    (q, k, v, _), spec, vis, _ = make_inputs(1, T, T, 1, 2, 64, 64, True, None, None, False, False, "float32",
                                             "arange")
    spec = dataclasses.replace(spec, chunk=chunk)
    v = v.at[:, :8].set(jnp.nan)
    o = np.asarray(IMPLS[impl](q, k, v, spec, vis))
    assert np.isfinite(o[:, chunk:]).all()
    assert np.isnan(o[:, :chunk]).any()
    assert np.isnan(np.asarray(attention(q, k, v, spec, vis, impl="reference"))[:, chunk:]).all()


def test_cudnn_takes_the_chunk_rule_in_its_dense_mask(monkeypatch):
    """cuDNN gets chunks through its dense position mask (nothing to refuse): the mask it is
    handed equals the NumPy rule, and the result equals dense attention over that rule."""
    on_gpu(monkeypatch)
    (q, k, v, _), spec, vis, _ = make_inputs(1, 40, 40, 2, 2, 64, 64, True, None, None, False, True, "bfloat16",
                                             "arange")
    spec = dataclasses.replace(spec, chunk=9)
    assert resolve("cudnn", q, k, v, spec) is AttentionImpl.CUDNN
    seen, xla = {}, jax.nn.dot_product_attention

    def fake_cudnn(*args, mask, implementation, **kw):  # cuDNN's call, run by XLA on this CPU
        assert implementation == "cudnn"
        seen["mask"] = mask
        return xla(*args, mask=mask, implementation="xla", **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake_cudnn)
    o = attention(q, k, v, spec, vis, impl="cudnn")
    ok = chunk_rule(vis, spec.chunk)
    np.testing.assert_array_equal(np.asarray(seen["mask"])[:, 0], ok)
    assert_close("o", o, dense_attention(q, k, v, None, ok, spec.scale), TOL["bfloat16"])


def test_decoding_reads_only_the_blocks_of_the_cache_the_rows_see():
    """One query a row against a cache of 48 slots in blocks of 8, rows filled to different
    lengths, a left-padded row's pads (negative positions) in the last slots: the output and the
    max logit equal the reference's over the whole cache (window, soft-cap and sinks on), and the
    blocks before the first and past the last that any row sees are never read (NaN there changes
    nothing; a block that is read spreads its NaN)."""
    from modern_jax.kernels.chunked import attention_decode

    B, S, K, G, H = 3, 48, 2, 2, 16
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))  # noqa: E731
    q, k, v = normal(B, 1, K, G, H), normal(B, S, K, H), normal(B, S, K, H)
    filled = np.array([20, 17, 15])  # positions 0 .. filled - 1 in slots 0 .. filled - 1; the rest empty
    k_pos = np.where(np.arange(S)[None] < filled[:, None], np.arange(S)[None], -1)
    k_pos[2, -3:] = [-3, -2, -1]  # a padded prompt's pads
    vis = Visibility(jnp.asarray(filled - 1)[:, None], jnp.asarray(k_pos, jnp.int32))
    spec = AttentionSpec(scale=H**-0.5, window=6, softcap=5.0)
    sinks_KG = normal(K, G)
    want = attention_reference(q, k, v, vis.mask(causal=True, window=6), spec, sinks_KG, return_max_logit=True)
    unread = (np.arange(S) < 8) | (np.arange(S) >= 24)  # the rows see keys 9 .. 19: blocks 1 and 2 only
    k, v = (jnp.where(unread[None, :, None, None], jnp.nan, x) for x in (k, v))
    got = jax.jit(lambda q, k, v: attention_decode(q, k, v, spec, vis, sinks_KG=sinks_KG, block_k=8,
                                                   return_max_logit=True))(q, k, v)
    for name, g, w in zip(("o", "max_logit"), got, want):
        assert_close(name, g, w, TOL["float32"])
