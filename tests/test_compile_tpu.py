"""The TPU compiler on this CPU host (libtpu, deviceless): the dispatch picks the TPU kernels
for a TPU mesh, the kernels and a small model's full training step compile for real chips,
and the planner reads the chip's own memory analysis."""

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from modern_jax.cli import main
from modern_jax.config import ModelConfig
from modern_jax.data.config import DataConfig
from modern_jax.execution import ExecutionConfig
from modern_jax.kernels.attention import AttentionSpec, attention
from modern_jax.kernels.backend import recording_kernels
from modern_jax.sharding.devices import compiling_for, platform
from modern_jax.kernels.grouped import grouped_matmul
from modern_jax.kernels.masks import Visibility
from modern_jax.kernels.norm import add_norm
from modern_jax.model import Transformer
from modern_jax.sharding.mesh import make_mesh
from modern_jax.sharding.devices import CHIPS, chip, topology_devices
from modern_jax.planner import plan
from modern_jax.sharding import Strategies
from modern_jax.training.config import RunConfig, TrainConfig
from common import make_trainer

GiB = 1024**3
TINY = dict(vocab_size=256, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=512, head_dim=128,
            dtype="bfloat16")  # the kernels: the execution defaults, the platform's best


def one_chip(name):
    devices = topology_devices(name)
    return devices, NamedSharding(jax.sharding.Mesh(np.asarray(devices[:1]), ("x",)), PartitionSpec())


def test_topologies_name_their_chips():
    for name, kind, count in (("v5e:2x2", "TPU v5 lite", 4), ("v5p:2x2x2", "TPU v5", 8), ("v6e:2x2", "TPU v6 lite", 4)):
        devices = topology_devices(name)
        assert len(devices) == count and devices[0].platform == "tpu" and devices[0].device_kind == kind
        assert chip(devices) is CHIPS[kind]
    assert [CHIPS[k].hbm_gib for k in ("TPU v5 lite", "TPU v5", "TPU v6 lite")] == [16, 95, 32]  # Cloud TPU docs


def test_bad_topology_and_missing_libtpu_are_named(monkeypatch):
    with pytest.raises(ValueError, match=r"--topology 'v5e:3x3': libtpu refuses it .*expected GENERATION:SHAPE"):
        topology_devices("v5e:3x3")
    monkeypatch.setitem(sys.modules, "libtpu", None)
    with pytest.raises(ValueError, match=r"needs libtpu: `uv sync --extra tpu`"):
        topology_devices("v5e:2x2")


def test_dispatch_resolves_for_the_devices_compiled_for():
    devices = topology_devices("v5e:2x2")
    assert platform() == "cpu"
    with compiling_for(make_mesh(fsdp=4, devices=devices)):
        assert platform() == "tpu"
    with compiling_for(jax.devices()[:1]):
        assert platform() == "cpu"
    with pytest.raises(ValueError, match="mix platforms"):
        with compiling_for([devices[0], jax.devices()[0]]):
            pass


def test_a_mesh_that_splits_physical_axes_is_built_and_says_so():
    devices = topology_devices("v5p:4x4x4")  # 64 chips; 8 is not a product of the 4 x 4 x 4 axes
    with pytest.warns(UserWarning, match="splits the topology's physical axes"):
        mesh = make_mesh(fsdp=8, tensor=8, devices=devices)
    assert mesh.devices.shape == (1, 1, 8, 1, 1, 8) and len({d.id for d in mesh.devices.flat}) == 64
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 16 x 4 matches whole axes: no warning
        make_mesh(fsdp=16, tensor=4, devices=devices)


def test_multi_slice_meshes_put_the_slices_on_the_stage_axis_or_else_the_data_axis():
    devices = topology_devices("v5p:2x2x2", slices=2)
    mesh = make_mesh(data=2, fsdp=8, devices=devices)
    assert [d.slice_index for d in mesh.devices[0, :, 0, 0, 0, 0]] == [0, 1]
    assert all(len({d.slice_index for d in mesh.devices[0, i].flat}) == 1 for i in range(2))
    with pytest.raises(ValueError, match="make data a multiple of 2"):
        make_mesh(fsdp=16, devices=devices)
    mesh = make_mesh(stage=2, data=2, fsdp=4, devices=devices)  # the stages over the slower links
    assert [d.slice_index for d in mesh.devices[:, 0, 0, 0, 0, 0]] == [0, 1]
    assert all(len({d.slice_index for d in mesh.devices[i].flat}) == 1 for i in range(2))


@pytest.mark.parametrize("name", ["v5e:2x2", "v6e:2x2"])
def test_attention_norm_and_grouped_kernels_compile_for_tpu(name):
    """Forward and backward of the Pallas attention (window, soft-cap, sinks, segments, GQA 4,
    ragged length), the fused add + norm, and megablox: Mosaic custom calls the TPU compiler
    accepts (lowering and VMEM fit)."""
    _, sharding = one_chip(name)
    B, T, K, G, H = 1, 1000, 2, 4, 128
    S = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    spec = AttentionSpec(scale=H**-0.5, window=256, softcap=30.0)

    def loss(q, k, v, sinks, x, r, w, xe, we):
        pos = jnp.broadcast_to(jnp.arange(T), (B, T))
        seg = (pos >= 300).astype(jnp.int32)
        o = attention(q, k, v, spec, Visibility(pos, pos, seg, seg), sinks_KG=sinks, impl="default")
        h, y = add_norm(x, r, w, impl="default")
        g = grouped_matmul(xe, we, jnp.array([100, 0, 156, 256], jnp.int32))
        return sum(jnp.sum(jnp.square(a.astype(jnp.float32))) for a in (o, h, y, g))

    args = (S((B, T, K, G, H)), S((B, T, K, H)), S((B, T, K, H)), S((K, G), jnp.float32), S((T, 512)), S((T, 512)),
            S((512,), jnp.float32), S((512, 256)), S((4, 256, 512)))
    with compiling_for("tpu"), recording_kernels() as seen:
        lowered = jax.jit(jax.grad(loss, argnums=tuple(range(9)))).lower(*args)
    assert seen == {"attention": {"pallas_tpu"}, "norm": {"pallas"}, "moe_grouped": {"megablox"}}
    # attention: forward, dq, dk/dv; norm: forward, backward; megablox: x @ w, dx, dw
    assert lowered.as_text().count("tpu_custom_call") == 3 + 2 + 3
    memory = lowered.compile().memory_analysis()
    assert 0 < memory.temp_size_in_bytes < 1 * GiB


def test_training_step_compiles_for_a_tpu_mesh_with_the_tpu_kernels():
    """A small model's whole step (data x fsdp x tensor = 2 x 2 x 2 v5p chips): the dispatch picks
    Pallas TPU attention and norm for the target (the host is a CPU), and the planner's bytes are
    the shards of the state plus the TPU compiler's temporaries, within the chip's HBM."""
    run = RunConfig(model_dict=TINY, train=TrainConfig(batch_size=4, seq_len=512), data=DataConfig())
    out = plan(run, {"data": 2, "fsdp": 2, "tensor": 2}, topology="v5p:2x2x2")
    assert out["device_kind"] == "TPU v5 (v5p)" and out["compiler"] == "TPU"
    assert out["kernels"] == {"attention": ["pallas_tpu"], "norm": ["pallas"]}
    abstract = nnx.eval_shape(lambda: Transformer(ModelConfig.from_dict(TINY), rngs=nnx.Rngs(0)))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    n_norm = 256 * (2 * 2 + 1)  # the norm weights are replicated, everything else split 4 ways
    assert out["parameters"] == 4 * ((n_params - n_norm) // 4 + n_norm)  # fp32 master weights
    assert out["arguments"] >= out["parameters"] + out["optimizer"] + out["batch"]
    assert 0 < out["temporaries"] and out["peak"] < 95 * GiB and out["fits"] and out["hbm"] == 95 * GiB


def test_a_qlora_step_compiles_for_one_tpu_chip_holding_nf4_codes_and_the_adapters_state():
    """QLoRA on one v5e chip: the frozen projections as NF4 pieces (4.14 bits a weight: every
    block of 64 values 32 bytes of codes and an int8 scale, a row's two float32s), float32
    adapters and AdamW state for them only; the TPU compiler plans the step."""
    from modern_jax.lora_config import LoRAConfig

    lora = LoRAConfig(rank=8, quantize="nf4")
    run = RunConfig(model_dict=dict(TINY, param_dtype="bfloat16"), train=TrainConfig(batch_size=2, seq_len=256),
                    data=DataConfig(), lora=lora)
    out = plan(run, {"fsdp": 1}, topology="v5e:1x1")
    assert out["compiler"] == "TPU" and out["fits"]
    cfg = ModelConfig.from_dict(TINY)
    D, F, K, N, H, L = 256, 512, 2, 4, 128, 2
    outs = {"q": (D, N * H), "k": (D, K * H), "v": (D, K * H), "o": (N * H, D), "gate": (D, F), "up": (D, F),
            "down": (F, D)}
    quantized = L * sum(i * o * (0.5 + 1 / 64) + i * 8 for i, o in outs.values())  # codes + scales + row pairs
    rest = 2 * (cfg.vocab_size * D * (1 if cfg.tie_embeddings else 2) + D * (2 * L + 1) + (2 * L * H if
                                                                                             cfg.qk_norm != "none" else 0))
    adapters = L * sum(4 * 8 * (i + o) for i, o in outs.values())
    assert out["parameters"] == quantized + rest + adapters
    assert 2 * adapters <= out["optimizer"] <= 2 * adapters + 8


def test_moe_step_compiles_for_tpu_with_megablox_and_the_ragged_exchange():
    """The dropless exchange XLA:CPU lacks: forward and backward compile for TPU chips."""
    moe = dict(TINY, ffn_type="moe", n_experts=4, experts_per_token=2, expert_d_ff=256)
    devices = topology_devices("v5e:2x2")
    trainer = make_trainer(ModelConfig.from_dict(moe), TrainConfig(batch_size=4, seq_len=128),
                      make_mesh(data=2, expert=2, devices=devices), execution=ExecutionConfig(attention_impl="reference"),
                      strategies=Strategies(moe_exchange="ragged_all_to_all"))
    with recording_kernels() as seen:
        lowered = trainer.programs.lower("train", trainer.states.abstract(), trainer.batches.abstract())
    assert seen["moe_grouped"] == {"megablox"} and seen["attention"] == {"reference"}
    # the scanned layer: rows, expert ids and outputs forward; the rows' and outputs' transposes backward
    assert lowered.as_text().count("ragged_all_to_all") == 3 + 2
    assert "ragged-all-to-all" in lowered.compile().as_text()  # the TPU compiler keeps it (async start / done)


def test_plan_command_with_a_topology_prints_the_chip_kernels_and_verdict(capsys):
    """With no kernel named, the plan runs the TPU's (the execution defaults pick the platform's best)."""
    code = main(["plan", "--config", "configs/tiny.yaml", "--topology", "v5e:2x2", "--mesh", "fsdp=2,tensor=2",
                 "--batch", "4", "--seq", "256", "--no-speed"])  # the estimate: tests/test_speed.py
    out = capsys.readouterr().out
    assert code == 0
    assert "device: TPU v5 lite (v5e) (compiled by TPU)" in out and "attention: pallas_tpu" in out
    assert "norm: pallas" in out and "fits in 16 GiB of device memory" in out and "estimated" not in out
    assert main(["plan", "--config", "configs/tiny.yaml", "--topology", "v5e:2x2", "--mesh", "fsdp=8",
                 "--batch", "8", "--seq", "256"]) == 2
    assert "needs 8 devices but 4 are available" in capsys.readouterr().err


def test_a_plan_the_tpu_compiler_refuses_for_hbm_is_a_verdict_not_a_traceback(capsys):
    """Llama 3.2 1B at 32 x 8192 on 4 v5e chips with the reference attention (dense T x T
    scores): the compiler stops at its HBM check, and the planner reports what it counted."""
    code = main(["plan", "--config", "configs/llama3_2_1b.yaml", "--topology", "v5e:2x2", "--mesh", "fsdp=4",
                 "--batch", "32", "--seq", "8192", "model.dtype=bfloat16", "execution.attention_impl=reference"])
    out = capsys.readouterr().out
    assert code == 0 and "does NOT fit in 16 GiB of device memory" in out
    peak = float(out.split("donated + temporaries): ")[1].split(" GiB")[0])
    scores = 32 / 4 * 32 * 8192**2 * 4 / 1024**3  # one layer's fp32 scores, per chip: 8 rows x 32 heads
    assert peak > scores and "by the compiler's count, more than the chip's 15.75 GiB" in out
