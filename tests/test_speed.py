"""The planner's estimated step time: the TPU compiler's cost model (libtpu, deviceless) with the
loops it counts once (scanned layers, loss chunks, micro-batches) counted as often as they run,
the kernels' declared costs in it, and the search that ranks plans by it."""

import json
import re

import jax
import numpy as np
import pytest

from modern_jax import planner
from modern_jax.accounting import causal_keys, flops_per_token
from modern_jax.cli import main
from modern_jax.sharding.mesh import make_mesh
from modern_jax.sharding.devices import topology_devices
from modern_jax.training.config import load_run_config
from modern_jax.training import trainer_for

SMALL = ["model.vocab_size=512", "model.d_model=128", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=256",
         "model.head_dim=128", "model.max_position_embeddings=512", "model.dtype=bfloat16", "train.batch_size=8",
         "train.eval_batch_size=8", "train.seq_len=512"]


def small_run(*overrides):
    return load_run_config("configs/tiny.yaml", [*SMALL, *overrides])


def test_the_counted_step_equals_the_whole_program_unrolled():
    """Two stages (one global layer, then four local ones), two micro-batches and four loss chunks:
    the counting programs (3 and 4 layers, extrapolated) give the cost of all 5 layers unrolled
    (no loop left for the cost model to count once)."""
    run = small_run("model.n_layers=5", "model.attention_pattern=GLLLL", "model.sliding_window=128",
                    "train.seq_len=256", "train.grad_accum=2", "train.loss_vocab_chunk=128",
                    "execution.remat=full")
    mesh = make_mesh(fsdp=4, devices=topology_devices("v5p:2x2x1"))
    base, variants = planner.counting_layers(run.model)
    assert len(base) == 3 and [(more, len(layers)) for more, layers in variants] == [(2, 4)]
    counted = planner.step_cost(run, mesh)
    whole = planner.step_cost(run, mesh, layers=run.model.layer_specs())
    assert counted["optimal_seconds"] == pytest.approx(whole["optimal_seconds"], rel=0.02)
    assert counted["flops"] == pytest.approx(whole["flops"], rel=0.005)


def test_a_pipelined_step_counted_equals_its_whole_program_unrolled():
    """An interleaved pipeline of 2 stages x 4 rounds x 1 layer, 2 microbatches: the counting
    programs (2 and 3 rounds, extrapolated) give the cost of its whole step unrolled (9 iterations
    of a layer on each stage)."""
    run = small_run("model.n_layers=8", "train.seq_len=256", "execution.remat=full", "parallel.stage=2",
                    "parallel.fsdp=2", "parallel.data=1", "parallel.microbatches=2",
                    "parallel.pipeline_schedule=interleaved", "parallel.stage_repeats=4")
    mesh = make_mesh(stage=2, fsdp=2, devices=topology_devices("v5p:2x2x1"))
    counted = planner.step_cost(run, mesh)
    whole = planner.step_cost(run, mesh, layers=run.model.layer_specs())
    # the flops are linear in the rounds; this small model's time is its bytes, of which each round
    # adds a little less than the one before (0.8% over the extrapolation here)
    assert counted["optimal_seconds"] == pytest.approx(whole["optimal_seconds"], rel=0.02)
    assert counted["flops"] == pytest.approx(whole["flops"], rel=0.005)
    # an iteration: a round's cost over its M microbatches (the weights' own work, linear in the
    # rounds, included); the bubble is S - 1 of them
    assert counted["bubble_seconds"] == pytest.approx(counted["iteration"]["optimal_seconds"])


def test_the_estimate_includes_the_kernels_declared_costs_and_its_mfu_is_6n_plus_causal_attention(capsys):
    overrides = [*SMALL, "model.n_layers=2", "execution.remat=none"]
    assert main(["plan", "--config", "configs/tiny.yaml", "--topology", "v5e:2x2", "--mesh", "fsdp=4", "--batch", "8",
                 "--seq", "512", *overrides]) == 0
    printed = re.search(r"estimated step time: ([\d.]+) s \(([\d.]+) s without the Pallas kernels\)",
                        capsys.readouterr().out)
    run = small_run("model.n_layers=2", "execution.remat=none")
    mesh = make_mesh(fsdp=4, devices=topology_devices("v5e:2x2"))
    speed = planner.estimate_speed(run, mesh)  # the plan's compiles, from the cache
    io_only = planner.step_cost(run, mesh, kernel_costs=False)
    assert speed["seconds_io_kernels"] == io_only["optimal_seconds"] < speed["seconds"]
    assert printed and float(printed[1]) == pytest.approx(speed["seconds"], rel=1e-4)
    assert float(printed[2]) == pytest.approx(io_only["optimal_seconds"], rel=1e-4)
    # what the kernels add: their matmuls, at least causal attention's forward and backward, at most 3x that
    # (whole tiles up to every tile, 2x; the backward recomputes the scores: 9 matmuls of T x S, not 6)
    tokens, T, heads, dims = 8 * 512, 512, 2, 128 + 128
    attention = 2 * 6 * heads * dims * (T + 1) / 2 * tokens  # 2 layers, 6 (fwd + bwd) x 2 flops a multiply-add
    added = speed["compiler_flops"] - io_only["flops"] * mesh.size
    assert attention <= added <= 3 * attention
    # 6 N: the gated FFN, q o, k v, the norms (2 a block, q and k heads', the final) and the tied head
    weights = 6 * (2 * (3 * 128 * 256 + 2 * 128 * 256 + 2 * 128 * 128 + 2 * 128 + 2 * 128) + 128 + 512 * 128)
    assert flops_per_token(run.model, T)["causal_total"] == weights + attention / tokens
    assert speed["mfu"] == pytest.approx(weights * tokens / (speed["seconds"] * 4 * 197e12)
                                         + attention / (speed["seconds"] * 4 * 197e12))
    assert speed["tokens_per_s_per_chip"] == pytest.approx(tokens / speed["seconds"] / 4)


def test_a_loop_of_a_few_bytes_stays_in_the_counting_program_and_a_larger_one_stops_the_estimate(tmp_path,
                                                                                                 monkeypatch):
    """megablox finds each tile's expert by a binary search (a while loop on vectors of E): a mixture's
    counting program keeps it and is costed; a stack of layers left scanned is refused by name."""
    monkeypatch.setenv(planner.CACHE_ENV, str(tmp_path))
    moe = ["model.n_layers=2", "model.ffn_type=moe", "model.n_experts=4", "model.experts_per_token=2",
           "train.seq_len=256", "execution.remat=full"]
    mesh = make_mesh(fsdp=4, devices=topology_devices("v5e:2x2"))

    def trainer(scan):
        run = small_run(*moe, f"execution.scan_layers={str(scan).lower()}")
        return trainer_for(run, mesh)

    seen, real = [], planner.loops_that_count
    monkeypatch.setattr(planner, "loops_that_count", lambda text: seen.append(text) or real(text))
    assert planner.counting_cost(trainer(False))["optimal_seconds"] > 0
    [text] = seen  # the compiled counting program
    assert "searchsorted" in text and " while(" in text and real(text) == []
    with pytest.raises(planner.CostModelFault, match=r"still holds a while loop.*carrying [\d,]+ B"):
        planner.counting_cost(trainer(True))


def test_causal_keys_count_what_a_query_sees():
    def naive(T, window=None, chunk=None):
        return np.mean([sum(1 for k in range(q + 1) if (window is None or q - k < window)
                            and (chunk is None or q // chunk == k // chunk)) for q in range(T)])

    for kwargs in ({}, {"window": 5}, {"chunk": 4}, {"window": 64}):
        assert causal_keys(37, **kwargs) == pytest.approx(naive(37, **kwargs))


def test_plan_search_ranks_what_fits_by_estimated_speed_and_reuses_its_compiles(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(planner.CACHE_ENV, str(tmp_path))
    args = ["plan", "--config", "configs/tiny.yaml", "--topology", "v5e:2x2", "--mesh", "fsdp=4", "--batch", "8",
            "--seq", "256", "--search", "--search-remat", "full,none", "--search-accum", "1",
            "--search-mesh", "fsdp=4;tensor=4", "--search-chunk", "whole", "model.dtype=bfloat16",
            "model.n_layers=2", "model.d_ff=390"]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "rank" not in line]
    assert len(rows) == 4 and re.search(r"4 configurations on v5e:2x2, 2 fit; searched in \d+ s", out)
    ranked = [r for r in rows if r[0].strip() != "-"]
    speeds = [float(r[8].replace(",", "")) for r in ranked]
    assert [int(r[0]) for r in ranked] == [1, 2] and speeds == sorted(speeds, reverse=True)
    refused = [r for r in rows if r[0].strip() == "-"]
    assert {r[1].strip() for r in refused} == {"tensor=4"} and "d_ff=390 is not divisible" in refused[0][7]
    assert {r[2].strip() for r in ranked} == {"full", "none"}
    assert [r[2].strip() for r in ranked] == ["none", "full"]  # remat none recomputes nothing: faster

    def no_compile(*a, **k):
        raise AssertionError("compiled again")

    monkeypatch.setattr(jax.stages.Lowered, "compile", no_compile)
    assert main(args) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")] == \
        [line for line in out.splitlines() if line.startswith("| ")]


@pytest.mark.parametrize("remat, forwards", [("full", 2), ("save_qkv_out", 1)])
def test_saving_the_attention_output_keeps_the_kernel_forward_from_running_again(remat, forwards):
    """The flash kernels' residuals (output, log-sum-exp) carry the names `save_qkv_out` saves:
    under it the forward kernel runs once a layer, under full remat twice (again in the backward)."""
    run = small_run("model.n_layers=2", "train.seq_len=256", f"execution.remat={remat}", "execution.scan_layers=false")
    mesh = make_mesh(fsdp=4, devices=topology_devices("v5e:2x2"))
    trainer = trainer_for(run, mesh)
    text = trainer.programs.lower("train", trainer.states.abstract(), trainer.batches.abstract()).as_text()
    assert text.count("flash_attention_tpu_fwd") == 2 * forwards
    assert text.count("flash_attention_tpu_dq") == text.count("flash_attention_tpu_dkdv") == 2


def test_a_cost_model_that_gives_no_positive_step_time_is_named_not_printed(capsys, tmp_path, monkeypatch):
    """The TPU compiler's cost analysis can return a negative optimal_seconds (libtpu 0.0.52, Llama 3 8B
    on v6e:16x16): the plan still gives its memory, says why there is no estimate, and prints no time."""
    monkeypatch.setenv(planner.CACHE_ENV, str(tmp_path))
    real = jax.stages.Compiled.cost_analysis

    def faulty(self):
        analysis = real(self)
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        return {**analysis, "optimal_seconds": -19.9}

    monkeypatch.setattr(jax.stages.Compiled, "cost_analysis", faulty)
    assert main(["plan", "--config", "configs/tiny.yaml", "--topology", "v5e:2x2", "--mesh", "fsdp=4", "--batch", "8",
                 "--seq", "256", "model.dtype=bfloat16", "model.n_layers=2"]) == 0
    out = capsys.readouterr().out
    assert "fits in 16 GiB" in out
    assert "estimated step time: not available: the TPU compiler's cost model gave optimal_seconds=-19.9" in out
    assert "tokens/s" not in out and "MFU" not in out


def test_sliced_prefetches_are_off_where_the_v6e_cost_model_counts_them_below_zero():
    """On v6e the compiler prefetches a large enough weight into on-chip memory in slices, and
    libtpu's cost model counts each `ConcatBitcast` that joins them as about -1 s: compiled as it
    would be, a 1024 x 8192 FFN's training step has them and a negative time; the planner's
    counting program has none and a positive one (the 8B preset's plan on v6e likewise)."""
    run = small_run("model.d_model=1024", "model.d_ff=8192", "model.n_heads=8", "model.n_layers=1",
                    "train.batch_size=4", "train.seq_len=128", "execution.scan_layers=false")
    mesh = make_mesh(fsdp=4, devices=topology_devices("v6e:2x2"))
    trainer = trainer_for(run, mesh)
    lowered = trainer.programs.lower("train", trainer.states.abstract(), trainer.batches.abstract())
    sliced = lowered.compile({k: v for k, v in planner.COUNTING_OPTIONS.items() if "sliced" not in k})
    assert sliced.as_text().count("ConcatBitcast") > 0 and sliced.cost_analysis()["optimal_seconds"] < 0
    counted = planner.counting_cost(trainer, kernel_costs=False)
    assert 0 < counted["optimal_seconds"] < 0.01


FILL = """
import sys
from modern_jax import planner
i = int(sys.argv[1])
for j in range(30):
    planner._cached(f"{i}-{j}", lambda: {"v": 100 * i + j})
"""


def test_planners_writing_the_cache_at_once_keep_every_entry(tmp_path, monkeypatch):
    """Two searches at once share the plan cache: neither drops the other's new compiles."""
    import subprocess
    import sys

    monkeypatch.setenv(planner.CACHE_ENV, str(tmp_path))
    processes = [subprocess.Popen([sys.executable, "-c", FILL, str(i)]) for i in range(4)]
    assert [p.wait(timeout=120) for p in processes] == [0] * 4
    table = json.loads((tmp_path / "plan_costs.json").read_text())
    assert table == {f"{i}-{j}": {"v": 100 * i + j} for i in range(4) for j in range(30)}


def test_plan_search_tries_each_pipeline_microbatch_count_on_meshes_with_stages(capsys, monkeypatch):
    """`--search-microbatches` multiplies the meshes with stages only; each candidate run's parallel
    section is its mesh and microbatches (what the Trainer's pipeline reads)."""
    seen = []

    def plan(candidate, mesh_sizes, **kwargs):
        seen.append((dict(mesh_sizes), candidate.parallel.stage, candidate.parallel.fsdp, candidate.parallel.microbatches))
        return {"fits": True, "peak": 1 << 30, "speed": {"seconds": 1.0, "tokens_per_s_per_chip": 100.0 * len(seen),
                                                          "mfu": 0.5}}

    monkeypatch.setattr(planner, "plan", plan)
    args = ["plan", "--config", "configs/tiny.yaml", "--topology", "v5e:2x2", "--mesh", "fsdp=4", "--batch", "8",
            "--seq", "64", "--search", "--search-remat", "full", "--search-accum", "1", "--search-chunk", "whole",
            "--search-mesh", "fsdp=4;stage=2,fsdp=2", "--search-microbatches", "2,4"]
    assert main(args) == 0
    assert [(s[1], s[2], s[3]) for s in seen] == [(1, 4, 1), (2, 2, 2), (2, 2, 4)]
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "rank" not in line]
    assert [(r[1].strip(), r[4].strip()) for r in rows] == [("fsdp=2,stage=2", "4"), ("fsdp=2,stage=2", "2"),
                                                            ("fsdp=4", "1")]
