"""Sequence parallelism (the residual stream split along T over `tensor`) and context parallelism
(every activation's sequence split over `context`) on 8 host CPU devices, against one device."""

import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from modern_jax import execution
from modern_jax.config import ModelConfig
from modern_jax.execution import ExecutionConfig
from modern_jax.kernels.backend import recording_kernels
from modern_jax.model import Transformer
from modern_jax.sharding import create_sharded, make_mesh
from modern_jax.sharding.config import ParallelConfig, layout_order
from modern_jax.sharding import RULES, Strategies, logical_rules
from modern_jax.training.loss import loss_sums

from common import assert_leaves_match, leaves, one_device

B, T = 4, 32
# packing (3 documents per row), a window on the local layers, sinks, soft-caps, GQA 8 / 2,
# a vocabulary split over tensor: every mask rule and both vocabulary shard_maps
CFG = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, d_ff=128, qk_norm="head",
                  attention_sinks=True, sliding_window=6, attention_pattern="LG", attn_softcap=20.0,
                  final_softcap=30.0, tie_embeddings=False)
RUN = ExecutionConfig(attention_impl="chunked")  # the blocked kernel (the platform's default on TPU / GPU is flash)


def packed_batch(V=128):
    rng = np.random.default_rng(3)
    toks = rng.integers(0, V, (B, T + 1))
    starts = [0, 11, 20]  # three documents per row, positions restart at each
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    for i, s in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else T
        seg[:, s:end], pos[:, s:end] = i + 1, np.arange(end - s)
    return {"inputs": toks[:, :-1].astype(np.int32), "targets": toks[:, 1:].astype(np.int32), "positions": pos,
            "segment_ids": seg, "weights": (rng.random((B, T)) > 0.1).astype(np.float32)}


def objective(model, batch):
    """The loss (CE + z-loss over the vocab-parallel head), its sums and the logits, in one pass."""
    h_BTD, _ = model.hidden_states(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    head = model.head()
    sums = loss_sums(h_BTD, head.w_VD, head.b_V, batch["targets"], batch["weights"], softcap=head.softcap, chunk=48,
                     vocab_size=head.vocab_size)
    return (sums["ce"] + 1e-2 * sums["z_loss"]) / sums["weight"], (sums, model.logits(h_BTD))


GRAD = nnx.value_and_grad(objective, has_aux=True)


@pytest.fixture(scope="module")
def reference():
    batch = packed_batch()
    with execution.use(RUN):
        (loss, (sums, logits)), grads = nnx.jit(GRAD)(Transformer(CFG, rngs=nnx.Rngs(0)), batch)
    return np.asarray(logits), loss, sums, leaves(nnx.state(grads, nnx.Param))


def run_sharded(cfg, sizes, rules=RULES, layout="two_chunk", hlo=False, strategies=None, run=RUN):
    """Logits, loss, sums and gradients on a mesh of `sizes`, the batch laid out for its context axis."""
    mesh = make_mesh(**sizes)
    model = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh, rules)
    order = layout_order(T, sizes.get("context", 1), layout)
    batch = {k: v if order is None else v[:, order] for k, v in packed_batch().items()}
    batch = jax.device_put(batch, NamedSharding(mesh, P(("data", "fsdp", "expert"), "context")))
    with logical_rules(mesh, rules, strategies), execution.use(run), recording_kernels() as kernels:
        step = nnx.jit(GRAD)
        (loss, (sums, logits)), grads = step(model, batch)
        text = step.lower(model, batch).compile().as_text() if hlo else None
    logits = np.asarray(logits)
    if order is not None:  # back to the sequence's own order
        logits = logits[:, np.argsort(order)]
    return logits, loss, sums, leaves(nnx.state(grads, nnx.Param)), kernels, text


def assert_matches(got, want):
    logits, loss, sums, grads = got[:4]
    want_logits, want_loss, want_sums, want_grads = want
    np.testing.assert_allclose(logits, want_logits, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-6)
    for key in ("ce", "z_loss", "weight", "max_abs_logit"):
        np.testing.assert_allclose(sums[key], want_sums[key], rtol=2e-6, err_msg=key)
    assert_leaves_match(grads, want_grads)


def block_sized(hlo: str, op: str, b: int, t: int, d: int = 64) -> list[str]:
    """The `op` instructions of `hlo` whose result is a [b, t, d] array (a block's activation)."""
    return [line for line in hlo.splitlines()
            if re.search(rf"= \w+\[{b},{t},{d}\]\{{[^}}]*\}} {op}\(", line)]


# ----- sequence parallelism -----------------------------------------------------------------

@pytest.mark.parametrize("sizes", [dict(tensor=8), dict(data=2, tensor=4)], ids=["1x1x8", "2x1x4"])
def test_sequence_parallelism_matches_one_device(sizes, reference):
    assert_matches(run_sharded(CFG, sizes), reference)


def collectives(hlo: str, b: int, t: int, d: int, tp: int) -> dict[str, int]:
    """The collectives of a compiled TPU program over block-sized arrays, by kind: `reduce-scatter`
    from [b, t, d] to [b, t / tp, d] (the TPU compiler's all-reduce-scatter fusions, or plain),
    `all-reduce` of a whole [b, t, d] (outside such a fusion) and `all-gather` to [b, t, d]."""
    whole, part = (rf"\w+\[{b},{n},{d}\]" for n in (t, t // tp))
    counts, computation = {"reduce-scatter": 0, "all-reduce": 0, "all-gather": 0}, ""
    for line in hlo.splitlines():
        if line and not line.startswith(" "):  # a computation's header
            computation = line
            counts["reduce-scatter"] += bool(re.match(rf"%all-reduce-scatter\S* \(\S+ {whole}\) -> {part} ", line))
            continue
        fused = computation.startswith("%all-reduce-scatter")
        counts["reduce-scatter"] += bool(re.search(rf"= {part}\{{[^}}]*\}} reduce-scatter\(", line))
        counts["all-reduce"] += bool(re.search(rf"= {whole}\{{[^}}]*\}} all-reduce(-start)?\(", line)) and not fused
        counts["all-gather"] += bool(re.search(rf"= {whole}\{{[^}}]*\}} all-gather(-start)?\(", line))
    return counts


def test_sequence_parallelism_reduce_scatters_block_outputs():
    """On by default with tensor > 1, compiled by the TPU compiler for 8 v5p chips (data=2 x
    tensor=4): the block outputs leave attention and the FFN by reduce-scatters along T (forward,
    and the gradients entering them backward), the sequence enters them by all-gathers, and no
    block-sized [B, T, D] all-reduce is left; turned off in the rules, they are all-reduced whole."""
    from modern_jax.sharding.devices import topology_devices
    from modern_jax.training.config import TrainConfig
    from common import make_trainer

    cfg = ModelConfig(vocab_size=256, d_model=256, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=512, head_dim=128,
                      dtype="bfloat16")  # the TPU's kernels: the execution defaults
    mesh = make_mesh(data=2, tensor=4, devices=topology_devices("v5p:2x2x2"))
    tc = TrainConfig(batch_size=4, seq_len=512)

    def compiled(rules):
        trainer = make_trainer(cfg, tc, mesh, rules)
        return collectives(trainer.programs.lower("train", trainer.states.abstract(), trainer.batches.abstract()).compile()
                           .as_text(), 2, 512, 256, 4)

    on = compiled(RULES)
    off = compiled(ParallelConfig(rules=(("activation_norm_length", "context"),)).rules_table())
    # per scanned layer: attention and FFN outputs forward, their inputs' gradients backward
    assert on["reduce-scatter"] >= 4 and on["all-gather"] >= 2 and on["all-reduce"] == 0, on
    assert off["all-reduce"] >= 4 and off["all-gather"] == 0, off


def test_sequence_parallelism_splits_the_saved_residual_stream():
    """The residual stream carried between the scanned layers is 1/TP of the sequence per device."""
    mesh = make_mesh(data=2, tensor=4)
    model = create_sharded(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), mesh)
    batch = jax.device_put(packed_batch(), NamedSharding(mesh, P(("data", "fsdp", "expert"))))
    with logical_rules(mesh):
        h = nnx.jit(lambda m, b: m.hidden_states(b["inputs"], positions=b["positions"],
                                                 segment_ids=b["segment_ids"])[0])(model, batch)
    assert {s.data.shape for s in h.addressable_shards} == {(B // 2, T // 4, 64)}


# ----- context parallelism ------------------------------------------------------------------

CONTEXT_MESHES = [dict(data=2, context=4), dict(data=2, context=2, tensor=2)]


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("sizes", CONTEXT_MESHES, ids=["context4", "context2xtensor2"])
def test_context_parallelism_matches_one_device(sizes, strategy, reference):
    got = run_sharded(CFG, sizes, strategies=Strategies(context_strategy=strategy))
    assert_matches(got, reference)
    assert got[4]["attention"] == ({"ring"} if strategy == "ring" else {"chunked"})  # what ran per device


@pytest.mark.parametrize("layout", ["contiguous", "striped"])
def test_causal_load_balancing_changes_nothing(layout, reference):
    """The layouts reorder the tokens along the sequence (two_chunk is the default, above)."""
    assert_matches(run_sharded(CFG, dict(data=2, context=4), layout=layout), reference)


def test_layouts_balance_the_causal_work():
    """Each device's share of the causal (query, key) pairs: two_chunk and striped even it out."""
    n, c = 64, 4

    def work(order):
        pos = np.arange(n) if order is None else order
        return [int(np.sum(pos[i * n // c:(i + 1) * n // c] + 1)) for i in range(c)]

    contiguous, two_chunk, striped = (work(layout_order(n, c, x)) for x in ("contiguous", "two_chunk", "striped"))
    assert max(contiguous) / min(contiguous) > 5
    assert max(two_chunk) == min(two_chunk)
    assert max(striped) / min(striped) < 1.1
    assert sorted(layout_order(n, c, "two_chunk")) == list(range(n))
    with pytest.raises(ValueError, match="train.seq_len=20 .* 2 x parallel.context=8"):
        layout_order(20, 4, "two_chunk")


def test_context_parallelism_never_gathers_the_queries():
    """Under context=4 the keys and values are all-gathered along the sequence; the queries
    (8 heads of 16, or 2 KV heads x 4) are never gathered to the whole sequence."""
    cfg = CFG.replace(head_dim=16)
    *_, hlo = run_sharded(cfg, dict(data=2, context=4), hlo=True,
                          run=ExecutionConfig(attention_impl="reference", norm_impl="reference"))
    gathers = [line for line in hlo.splitlines() if re.search(r" all-gather(-start)?\(", line)]
    kv = [g for g in gathers if re.search(rf"\[{B // 2},{T},2,16\]", g)]
    q = [g for g in gathers if re.search(rf"\[{B // 2},{T},(8,16|2,4,16)\]", g)]
    assert kv, "keys and values gathered along the sequence"
    assert not q, q[:2]


def test_ring_refuses_what_it_cannot_run():
    from modern_jax.kernels.backend import UnsupportedFeatureError

    with pytest.raises(UnsupportedFeatureError, match="parallel.context_strategy='ring'"):
        run_sharded(CFG, dict(data=2, context=4), strategies=Strategies(context_strategy="ring"),
                    run=ExecutionConfig(attention_impl="pallas_gpu"))


def test_a_checkpoint_saved_with_context_4_restores_with_context_1(tmp_path):
    """Two steps on data=2 x context=4, saved, then a third on one device: the same losses as
    three steps on one device (the state restored onto the other mesh is the state saved)."""
    from modern_jax.training import train
    from modern_jax.training.config import load_run_config

    def run(out, steps, *extra):
        overrides = [f"train.output_dir={out}", f"train.steps={steps}", "train.checkpoint_every=2",
                     "train.batch_size=4", "train.seq_len=32", "train.eval_every=0", "train.samples=0",
                     "train.warmup_steps=0", "train.schedule=constant", "model.n_layers=1", *extra]
        return load_run_config(REPO / "configs" / "tiny.yaml", overrides)

    one = one_device()
    quiet = lambda *_: None  # noqa: E731
    want = train(run(tmp_path / "one", 3), mesh=one, log=quiet).history
    first = train(run(tmp_path / "cp", 2, "parallel.data=2", "parallel.context=4"), log=quiet)
    second = train(run(tmp_path / "cp", 3), mesh=one, log=quiet)
    assert first.step == 2 and second.step == 3 and second.history[0]["step"] == 3
    got = first.history + second.history
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-5)


REPO = __import__("pathlib").Path(__file__).resolve().parents[1]
