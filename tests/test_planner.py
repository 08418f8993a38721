"""The memory planner (`modern_jax/planner.py`): it plans the run it is given, objective and
adapters included, and its arithmetic. Its step-time estimate is tested in test_speed.py, its
TPU compiles in test_compile_tpu.py.

Each plan here compiles a tiny model's training step for the host CPU (one device unless named):
- a full-weight DPO run keeps a frozen reference copy (bytes equal to the parameters, and at
  least that much more at the peak than plain training); a LoRA DPO run keeps none;
- a LoRA run's optimiser state is its adapters' (AdamW's two moments of each, counted by hand
  from the shapes), and a QLoRA run's base is stored quantized; a Muon run's holds one buffer of
  each hidden matrix (counted by hand) where AdamW holds two;
- shards on a mesh, the compiler's out-of-memory message, and `plan`'s own command line.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from modern_jax.cli import main
from modern_jax.config import ModelConfig
from modern_jax.model import Transformer
from modern_jax.planner import plan
from modern_jax.sharding.mesh import make_mesh
from modern_jax.training import load_run_config

REPO = pathlib.Path(__file__).resolve().parent.parent
ONE = {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
# configs/tiny.yaml at 2 layers: d 128, 4 query heads and 2 KV heads of 32, d_ff 384, vocab 260
SMALL = ["model.n_layers=2", "train.batch_size=4", "train.eval_batch_size=4", "train.seq_len=64"]
LORA = ["lora.rank=4", "lora.targets=[q_proj,v_proj]"]


def _plan(*overrides: str) -> dict:
    return plan(load_run_config(REPO / "configs" / "tiny.yaml", [*SMALL, *overrides]), ONE)


def test_a_full_weight_dpo_plan_counts_its_frozen_reference_and_a_lora_one_keeps_none():
    """A planner that builds the step without the run's objective plans plain training for both."""
    plain, dpo = _plan(), _plan("dpo.beta=0.1")
    assert plain["reference"] is None
    assert dpo["reference"] == plain["parameters"] == dpo["parameters"]  # a whole second copy
    assert dpo["peak"] - plain["peak"] >= plain["parameters"]
    lora, lora_dpo = _plan(*LORA), _plan(*LORA, "dpo.beta=0.1")
    assert lora_dpo["reference"] is None  # the base with its adapters off
    assert lora_dpo["parameters"] == lora["parameters"] and lora_dpo["optimizer"] == lora["optimizer"]
    assert lora_dpo["peak"] - lora["peak"] < lora["parameters"] / 4  # the reference's forward, no copy


def test_a_lora_plan_keeps_optimizer_state_for_its_adapters_only():
    """AdamW keeps two float32 moments of every trained value: for rank-4 adapters on q and v, L r
    ((d + Nq H) + (d + Nkv H)) values; the frozen base has none."""
    L, r, d, Nq, Nkv, H = 2, 4, 128, 4, 2, 32
    adapters = L * r * ((d + Nq * H) + (d + Nkv * H))
    plain, lora = _plan(), _plan(*LORA)
    assert 0 <= lora["optimizer"] - 2 * 4 * adapters <= 16  # + AdamW's step count
    assert lora["parameters"] == plain["parameters"] + 4 * adapters
    assert plain["optimizer"] > 2 * plain["parameters"] - 16  # whole-model AdamW, for comparison


def test_a_muon_plan_keeps_one_buffer_for_its_matrices():
    """Muon keeps one float32 momentum buffer of each matrix it moves, AdamW two moments of the rest:
    against whole-model AdamW, the optimiser state shrinks by one copy of the L (attention + FFN)
    matrices, L (D Nq H + 2 D Nkv H + Nq H D + 3 D F) values."""
    L, d, Nq, Nkv, H, F = 2, 128, 4, 2, 32, 384
    matrices = L * (d * Nq * H + 2 * d * Nkv * H + Nq * H * d + 3 * d * F)
    adamw, muon = _plan(), _plan("train.optimizer=muon")
    assert muon["parameters"] == adamw["parameters"]
    assert adamw["optimizer"] - muon["optimizer"] == 4 * matrices
    assert muon["peak"] < adamw["peak"]


def test_a_qlora_plan_holds_its_base_quantized():
    """NF4 stores each block projection in about half a byte a weight (with its block scales); the
    embeddings, norms and adapters stay float32."""
    L, d, Nq, Nkv, H, F = 2, 128, 4, 2, 32, 384
    projections = L * (d * Nq * H * 2 + d * Nkv * H * 2 + 3 * d * F)  # q, o, k, v, gate, up, down
    plain, qlora = _plan(*LORA), _plan(*LORA, "lora.quantize=nf4")
    saved = plain["parameters"] - qlora["parameters"]
    assert 0.8 * 4 * projections <= saved <= (4 - 0.5) * projections  # at most 3.5 of each weight's 4 bytes
    assert qlora["optimizer"] == plain["optimizer"]


def test_memory_planner_counts_sharded_state():
    cfg = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
    from modern_jax.data.config import DataConfig
    from modern_jax.training.config import RunConfig, TrainConfig

    run = RunConfig(model_dict=cfg.to_dict(), train=TrainConfig(batch_size=8, seq_len=16), data=DataConfig())
    replicated = plan(run, {"data": 8, "fsdp": 1, "tensor": 1})
    sharded = plan(run, {"data": 1, "fsdp": 2, "tensor": 4}, hbm_gib=1.0)
    n_params = sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)))
    assert replicated["parameters"] == 4 * n_params  # fp32, every device holds everything
    assert sharded["parameters"] < replicated["parameters"] / 4  # embed over fsdp, heads/mlp/vocab over tensor
    assert sharded["optimizer"] < replicated["optimizer"] / 4
    assert sharded["temporaries"] > 0 and sharded["fits"] is True


@pytest.mark.quick
def test_the_planner_counts_one_devices_shards_and_reads_the_compilers_refusal():
    """The planner's arithmetic without compiling a step: a device holds its shards' bytes, and
    the TPU compiler's out-of-memory message gives the peak and the HBM it names."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from modern_jax.planner import _HBM_OOM, _bytes, format_plan, shard_bytes

    mesh = make_mesh(2, 1, 4)
    tree = {"w": jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", "tensor"))),
            "b": jax.ShapeDtypeStruct((64,), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
            "host": jax.ShapeDtypeStruct((3,), jnp.int32)}
    assert shard_bytes(tree) == 4 * 16 * 4 + 64 * 2 + 3 * 4
    error = ("RESOURCE_EXHAUSTED: CompileTimeHbmOom: Ran out of memory in memory space hbm: the total memory "
             "required for HLO temporaries (211.22G) exceeds available HBM (95.73G)")
    oom = _HBM_OOM.search(error)
    peak, hbm = _bytes(*oom.group(1, 2)), _bytes(*oom.group(3, 4))
    assert (peak, hbm) == (int(211.22 * 2**30), int(95.73 * 2**30)) and _bytes("512", "") == 512
    text = format_plan({"device_kind": "TPU v5p", "compiler": "TPU", "mesh": {"data": 2}, "devices": 2,
                        "kernels": {"attention": ["pallas_tpu"]}, "parameters": 2**30, "optimizer": 2 * 2**30,
                        "batch": 0, "temporaries": None, "peak": peak, "hbm": hbm, "fits": False,
                        "compiler_refused": True})
    assert "parameters: 1.00 GiB (1073741824 B)" in text and "attention: pallas_tpu" in text
    assert "211.22 GiB by the compiler's count, more than the chip's 95.73 GiB" in text
    assert text.endswith("does NOT fit in 96 GiB of device memory")


def test_plan_re_runs_the_arguments_it_was_given(monkeypatch):
    calls = []
    monkeypatch.setattr(subprocess, "call", lambda argv, env: calls.append((argv, env)) or 0)
    argv = ["plan", "--config", str(REPO / "configs" / "tiny.yaml"), "--mesh", "data=2", "--batch", "4",
            "--seq", "64", "model.n_layers=1"]
    monkeypatch.setattr(sys, "argv", ["modern-jax", "something", "else"])
    assert main(argv) == 0
    (command, env), = calls
    assert command[1:] == ["-m", "modern_jax.cli", *argv]
    assert "--xla_force_host_platform_device_count=2" in env["XLA_FLAGS"]


def test_plan_sizes_the_evaluation_batch_by_its_batch():
    """`plan` compiles only the training step: a --batch that the mesh splits is enough, whatever
    the config's train.eval_batch_size (64 does not split over 6 data shards)."""
    argv = ["plan", "--config", str(REPO / "configs" / "tiny.yaml"), "--mesh", "data=6", "--batch", "6",
            "--seq", "32", "model.n_layers=1"]
    assert subprocess.run([sys.executable, "-m", "modern_jax.cli", *argv], capture_output=True, text=True,
                          timeout=300).returncode == 0
    given = subprocess.run([sys.executable, "-m", "modern_jax.cli", *argv, "train.eval_batch_size=64"],
                           capture_output=True, text=True, timeout=300)
    assert given.returncode == 2 and "train.eval_batch_size gives 64 rows, not divisible by the 6 data shards" in \
        given.stderr


def test_a_grpo_plan_counts_its_rollouts_kv_cache_and_its_reference():
    """A GRPO step's batch is sampled between steps, with the whole state held: the plan compiles the
    rollouts of the step's whole batch at the longest prompts too, whose KV cache (2 layers x (k, v) x
    4 rows x seq_len slots x 2 KV heads x 32, float32) is among its temporaries; a full-weight run
    with beta > 0 keeps its frozen reference, which the rollouts' peak and the plan's count beside
    the rest of the state (at least its bytes above beta = 0's)."""
    grpo = ["grpo.rewards=[configs/rewards.py:exact_answer]", "grpo.num_generations=2"]
    short, long = (_plan(*grpo, f"grpo.max_completion_length={n}") for n in (8, 40))
    (name, rollout), = short["programs"].items()
    assert name == "grpo_rollout_56" and short["peak"] >= rollout["peak"]  # prompts of 64 - 8 tokens
    cache = 2 * 2 * 4 * 64 * 2 * 32 * 4
    assert rollout["temporaries"] >= cache and long["programs"]["grpo_rollout_24"]["temporaries"] >= cache
    assert rollout["peak"] >= cache + short["parameters"] + short["optimizer"]
    kl = _plan(*grpo, "grpo.max_completion_length=8", "grpo.beta=0.04")
    assert short["reference"] is None and kl["reference"] == short["parameters"]
    # the rollouts run beside the whole state, the reference included, as the step does
    assert kl["programs"][name]["peak"] - rollout["peak"] >= kl["reference"]
    assert kl["peak"] - short["peak"] >= kl["reference"]
