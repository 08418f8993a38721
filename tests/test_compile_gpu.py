"""The Pallas GPU kernels compile to sm_90a machine code on this CPU host (`kernels/gpu_compile.py`):
the attention and norm kernels and a small model's full training step, each kernel within
an H100's limits: at most 255 registers a thread, no spills, at most 227 KiB of shared memory.
"""

import collections
import sys

import jax
import jax.numpy as jnp
import pytest

from modern_jax.config import ModelConfig
from modern_jax.sharding import devices
from modern_jax.kernels import AttentionSpec, Visibility, add_norm, attention, gpu_compile, pallas_interpret
from modern_jax.kernels.flash_gpu import GpuBlocks, flash_attention_gpu
from modern_jax.training.config import TrainConfig
from common import make_trainer

from common import one_device

H100_SHARED_BYTES = 227 * 1024
FLASH = ["flash_attention_gpu_fwd", "flash_attention_gpu_dq", "flash_attention_gpu_dkdv"]


def assert_fits_h100(report):
    assert report.arch == "sm_90a"
    assert 0 < report.registers <= 255, report.line()
    assert report.spill_stores == 0 and report.spill_loads == 0, report.line()
    assert 0 <= report.shared_bytes <= H100_SHARED_BYTES, report.line()
    assert report.ok


def attention_grad(H=128, dtype=jnp.bfloat16, T=300, blocks=None):
    """The gradient of attention with every feature on (soft-cap, window, sinks, segments, max logit)."""
    B, K, G = 1, 2, 4
    q, kv = jax.ShapeDtypeStruct((B, T, K, G, H), dtype), jax.ShapeDtypeStruct((B, T, K, H), dtype)
    pos, sinks = jax.ShapeDtypeStruct((B, T), jnp.int32), jax.ShapeDtypeStruct((K, G), jnp.float32)
    spec = AttentionSpec(scale=H**-0.5, window=128, softcap=30.0)

    def loss(q, k, v, pos, sinks_KG):
        vis = Visibility(pos, pos, pos // 100, pos // 100)
        if blocks is None:  # through the dispatch, as a layer calls it
            o, max_logit = attention(q, k, v, spec, vis, sinks_KG=sinks_KG, impl="pallas_gpu", return_max_logit=True)
        else:
            o, max_logit = flash_attention_gpu(q, k, v, spec, vis, sinks_KG=sinks_KG, blocks=blocks,
                                               return_max_logit=True)
        return o.astype(jnp.float32).sum() + max_logit.sum()

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 4)), (q, kv, kv, pos, sinks)


def test_flash_attention_compiles_for_sm90a():
    fn, args = attention_grad()
    with pallas_interpret(False):
        calls = gpu_compile.triton_kernels(gpu_compile.lower(fn, *args, arch="sm_90a"))
    assert [call.name for call in calls] == FLASH
    for call in calls:
        assert call.num_warps in (4, 8) and call.num_stages >= 1
        assert "tt.func" in gpu_compile.triton_ir_text(call)
        assert_fits_h100(gpu_compile.compile_triton(call, "sm_90a"))


def test_norm_compiles_for_sm90a():
    x = jax.ShapeDtypeStruct((300, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096,), jnp.float32)

    def loss(x, residual, w):
        h, y = add_norm(x, residual, w, kind="rmsnorm", impl="pallas")
        return (h.astype(jnp.float32) * y.astype(jnp.float32)).sum()

    with pallas_interpret(False):
        calls = gpu_compile.triton_kernels(gpu_compile.lower(jax.value_and_grad(loss, (0, 1, 2)), x, x, w))
    assert [call.name for call in calls] == ["norm_gpu_fwd", "norm_gpu_bwd"]
    for call in calls:
        assert_fits_h100(gpu_compile.compile_triton(call, "sm_90a"))


def test_training_step_compiles_for_sm90a():
    """Lowered for cuda from the CPU mesh: the dispatch picks the Triton kernels, and each compiles."""
    cfg = ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=512)  # kernels: default
    trainer = make_trainer(cfg, TrainConfig(batch_size=4, seq_len=256), one_device())
    with pallas_interpret(False):
        lowered = trainer.programs.lower("train", trainer.states.abstract(), trainer.batches.abstract(), platform="cuda")
    calls = gpu_compile.triton_kernels(lowered)
    # the layers are scanned, so each call site lowers once: attention, and three norms (before
    # attention, before the MLP, the final one), each forward and backward
    assert collections.Counter(call.name for call in calls) == {
        "flash_attention_gpu_fwd": 1, "flash_attention_gpu_dq": 1, "flash_attention_gpu_dkdv": 1,
        "norm_gpu_fwd": 3, "norm_gpu_bwd": 3}
    for call in calls:
        assert_fits_h100(gpu_compile.compile_triton(call, "sm_90a"))


def test_oversized_tiles_are_reported():
    """The check can fail: float32 tiles of 128 x 64 at head dim 256 ask for more shared memory than an H100 has."""
    fn, args = attention_grad(H=256, dtype=jnp.float32, blocks=GpuBlocks(128, 64, 64, 64))
    calls = gpu_compile.triton_kernels(gpu_compile.lower(fn, *args, arch="sm_90a"))
    report = gpu_compile.compile_triton(calls[0], "sm_90a")
    assert calls[0].name == "flash_attention_gpu_fwd"
    assert report.shared_bytes > H100_SHARED_BYTES and not report.ok


def test_an_unknown_arch_is_refused():
    with pytest.raises(ValueError, match="sm_90a, sm_80"):
        devices.lowering_for("sm_70").__enter__()


def test_missing_triton_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    call = gpu_compile.TritonCall("k", b"", 4, 1)
    with pytest.raises(ImportError, match=r"uv sync.*pip install triton==3\.9\.0"):
        gpu_compile.compile_triton(call, "sm_90a")
