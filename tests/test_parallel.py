"""Sharded vs single-device on 8 host CPU devices: meshes, KV-head placement, HLO, resharding."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from modern_jax import execution
from modern_jax.config import ModelConfig
from modern_jax.execution import ExecutionConfig
from modern_jax.model import Transformer
from modern_jax.sharding import create_sharded, make_mesh, parse_mesh
from modern_jax.sharding import check_mesh, logical_rules, state_shardings

from common import assert_leaves_match, assert_step_matches_one_device, default_compiles, make_trainer, token_batch

CFG = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, d_ff=128, qk_norm="head",
                  attention_sinks=True, sliding_window=6, attention_pattern="LG")
# data, fsdp x tensor and tensor alone; fsdp alone and data x tensor are the training-step meshes below
MESHES = [(8, 1, 1), (1, 2, 4), (1, 1, 8)]


def tokens(B=8, T=16, V=128):
    return jnp.asarray(np.random.default_rng(0).integers(0, V, (B, T)), jnp.int32)


def loss_fn(model, toks):
    logits = model(toks[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], -1))


def sharded(cfg, mesh_shape):
    mesh = make_mesh(*mesh_shape)
    return mesh, create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)


@pytest.fixture(scope="module")
def reference():
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    toks = tokens()
    loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, toks)
    return model(toks), loss, nnx.state(grads, nnx.Param)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=["x".join(map(str, m)) for m in MESHES])
def test_logits_loss_and_gradients_match_single_device(mesh_shape, reference):
    want_logits, want_loss, want_grads = reference
    mesh, model = sharded(CFG, mesh_shape)
    toks = jax.device_put(tokens(), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"))))
    with logical_rules(mesh):
        logits = nnx.jit(lambda m, t: m(t))(model, toks)
        loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, toks)
    np.testing.assert_allclose(logits, want_logits, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_leaves_match(nnx.state(grads, nnx.Param), want_grads)
    # parameters really are sharded as the rules say
    q = model.stages[0].blocks[0].self_attn.q_proj.kernel[...]
    expected = state_shardings(nnx.state(model), mesh)["stages"][0]["blocks"][0]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.is_equivalent_to(expected, q.ndim)
    if mesh_shape[2] > 1:
        assert q.addressable_shards[0].data.shape[2] == 8 // mesh_shape[2]  # query heads split over tensor


def kv_heads(n_kv, tp):
    """The KV heads each device should hold on a (8/tp, 1, tp) mesh, by its tensor coordinate:
    n_kv / tp whole heads in order along the tensor axis, or every (small) head when there are
    fewer heads than tensor devices."""
    mesh = make_mesh(8 // tp, 1, tp)
    tensor = mesh.axis_names.index("tensor")
    coordinate = {d: index[tensor] for index, d in np.ndenumerate(mesh.devices)}
    per = n_kv // tp
    return mesh, {d: list(range(t * per, (t + 1) * per)) if n_kv >= tp else list(range(n_kv))
                  for d, t in coordinate.items()}


def kv_config(n_kv):
    return ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=8, n_kv_heads=n_kv, d_ff=64)


@pytest.mark.parametrize("n_kv", [8, 4, 2, 1])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_kv_heads_are_placed_along_the_tensor_axis(n_kv, tp):
    """Where the rules put each KV head, for every n_kv x tensor pair (no compile: the shardings
    of the abstract model, the ones `create_sharded` and the Trainer place parameters with)."""
    mesh, want = kv_heads(n_kv, tp)
    state = nnx.state(nnx.eval_shape(lambda: Transformer(kv_config(n_kv), rngs=nnx.Rngs(0))))
    k_proj = state["stages"][0]["blocks"][0]["self_attn"]["k_proj"]["kernel"]  # [layers, D, K, H]
    sharding = state_shardings(state, mesh)["stages"][0]["blocks"][0]["self_attn"]["k_proj"]["kernel"]
    got = {d: list(range(n_kv)[index[2]]) for d, index in sharding.devices_indices_map(k_proj.shape).items()}
    assert got == want


@pytest.mark.parametrize("n_kv, tp", [(8, 2), (2, 2), (2, 4), (1, 8)])
def test_sharded_kv_heads_and_their_cache_decode_as_one_device(n_kv, tp):
    """Placed for real, on the four kinds of split (several heads, one head, a head replicated
    twice, one head on all): the weights' and the decoding cache's shards hold the heads above,
    and the logits with the cache equal one device's."""
    mesh, want = kv_heads(n_kv, tp)
    _, model = sharded(kv_config(n_kv), (8 // tp, 1, tp))
    k_proj = model.stages[0].blocks[0].self_attn.k_proj.kernel[...]
    assert {s.device: list(range(n_kv)[s.index[2]]) for s in k_proj.addressable_shards} == want
    toks = tokens(B=8, T=8, V=64)
    graphdef, state = nnx.split(model)  # the same weights, gathered onto one device
    want_logits = nnx.jit(lambda m, t: m(t))(nnx.merge(graphdef, jax.device_get(state)), toks)
    with logical_rules(mesh):
        got, cache = nnx.jit(lambda m, t: m(t, cache=m.init_cache(8, 8)))(model, toks)
    np.testing.assert_allclose(got, want_logits, atol=2e-5, rtol=2e-5)
    k_cache = cache["stages"][0][0]["k"]  # [layers, B, S, K, H]: sharded like the heads
    assert {s.data.shape[3] for s in k_cache.addressable_shards} == {len(next(iter(want.values())))}


def test_no_kv_all_gather_in_attention_hlo():
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=8, n_kv_heads=4, d_ff=64)
    mesh, model = sharded(cfg, (2, 1, 4))
    attn = model.stages[0].blocks[0]
    x = jax.device_put(jnp.ones((4, 16, 64)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    pos = jnp.tile(jnp.arange(16), (4, 1))

    def layer(block, x):
        state = nnx.state(block)
        one = nnx.merge(nnx.graphdef(block), jax.tree.map(lambda a: a[0], state))
        return one.self_attn(x, pos)[0]

    with logical_rules(mesh):
        hlo = nnx.jit(layer).lower(attn, x).compile().as_text()
    assert "all-gather" not in hlo, "K/V must stay on the devices that own their heads"
    assert "all-reduce" in hlo  # the row-parallel output projection sums over the tensor axis


def test_checkpoint_restores_onto_another_mesh(tmp_path):
    import orbax.checkpoint as ocp

    mesh_a, model_a = sharded(CFG, (2, 1, 4))
    toks = tokens()
    with logical_rules(mesh_a):
        want = nnx.jit(lambda m, t: m(t))(model_a, toks)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", nnx.to_pure_dict(nnx.state(model_a)))
    checkpointer.wait_until_finished()
    mesh_b = make_mesh(1, 8, 1)
    abstract = nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(1)))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh_b)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nnx.to_pure_dict(abstract_state), nnx.to_pure_dict(shardings))
    nnx.replace_by_pure_dict(abstract_state, checkpointer.restore(tmp_path / "ckpt", target))
    restored = nnx.merge(graphdef, abstract_state)
    embed = restored.embed_tokens[...]
    assert embed.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")  # resharded for mesh B
    with logical_rules(mesh_b):
        got = nnx.jit(lambda m, t: m(t))(restored, toks)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_bad_meshes_are_named():
    with pytest.raises(ValueError, match="needs 12 devices but 8 are available"):
        make_mesh(2, 2, 3)
    with pytest.raises(ValueError, match="only one axis may be -1"):
        make_mesh(-1, -1, 2)
    with pytest.raises(ValueError, match="bad mesh entry 'pipe=2'"):
        parse_mesh("data=2,pipe=2")
    assert parse_mesh("data=2, tensor=-1") == {"data": 2, "tensor": -1}
    six_heads = ModelConfig(vocab_size=64, d_model=48, n_layers=1, n_heads=6, d_ff=64)
    mesh = make_mesh(2, 1, 4)
    with pytest.raises(ValueError, match=r"model.n_heads=6 is not divisible by the mesh's tensor=4"):
        check_mesh(six_heads, mesh)
    with pytest.raises(ValueError, match=r"self_attn/o_proj/kernel: dimension 1 \(q_heads\) of size 6 is not"):
        sharded(six_heads, (2, 1, 4))  # the parameter-level check, should one slip through
    odd_vocab = ModelConfig(vocab_size=50, d_model=64, n_layers=1, n_heads=8, d_ff=64)
    with pytest.raises(ValueError, match=r"model.vocab_size=50 .* set model.vocab_pad_to=4 \(pads 2 rows"):
        check_mesh(odd_vocab, mesh)
    with pytest.raises(ValueError, match=r"embed_tokens: dimension 0 \(vocab\) of size 50 .* model.vocab_pad_to"):
        sharded(odd_vocab, (2, 1, 4))
    check_mesh(ModelConfig(vocab_size=64, d_model=48, n_heads=24, n_kv_heads=3, head_dim=8), make_mesh(1, 1, 8))
    mesh, padded = sharded(odd_vocab.replace(vocab_pad_to=4), (2, 1, 4))
    with logical_rules(mesh):
        logits = nnx.jit(lambda m, t: m(t))(padded, tokens(V=50))
    assert logits.shape[-1] == 52 and float(logits[..., 50:].max()) < -1e38  # pad logits are masked


def test_fused_kernels_run_per_device_under_the_mesh():
    """Pallas attention and norm (interpret mode) on a 2 x 4 mesh equal the single-device reference."""
    from modern_jax.kernels import pallas_interpret

    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=8, n_kv_heads=2, d_ff=64, qk_norm="head")
    toks = tokens(B=4, T=8, V=64)
    want = Transformer(cfg, rngs=nnx.Rngs(0))(toks)
    mesh, model = sharded(cfg, (2, 1, 4))
    fused = ExecutionConfig(attention_impl="pallas_gpu", norm_impl="pallas")
    with pallas_interpret(), logical_rules(mesh), execution.use(fused):
        got = nnx.jit(lambda m, t: m(t))(model, toks)
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5)


def test_training_step_matches_single_device():
    """The trainer's step, compiled at XLA's default optimisation level (the rest of the suite
    compiles at level 0, tests/conftest.py): the loss and every gradient leaf equal one device's."""
    from modern_jax.training import TrainConfig

    with default_compiles():
        assert_step_matches_one_device(CFG, TrainConfig(batch_size=8, seq_len=16), make_mesh(2, 1, 4),
                                       token_batch(1, 8, 16, 128))


DROPOUT_MESHES = [(2, 1, 4), (1, 4, 2)]


@pytest.mark.parametrize("mesh_shape", DROPOUT_MESHES, ids=["x".join(map(str, m)) for m in DROPOUT_MESHES])
def test_dropout_on_a_mesh_drops_what_one_device_drops(mesh_shape):
    """Attention and residual dropout (0.1 each) in a training step: from the same key, every
    device drops exactly its share of the one-device masks, so the loss and every gradient leaf
    equal one device's (a mask drawn per device, from its own key or from a shared one, does
    not). Tensor=4 replicates each of the 2 KV heads twice; tensor=2 does not."""
    from modern_jax.training import TrainConfig

    cfg = CFG.replace(attn_dropout=0.1, resid_dropout=0.1)
    assert_step_matches_one_device(cfg, TrainConfig(batch_size=8, seq_len=16), make_mesh(*mesh_shape),
                                   token_batch(1, 8, 16, 128))


def _loss_batch(V, B=8, T=16):
    rng = np.random.default_rng(1)
    toks = rng.integers(0, V, (B, T + 1))
    return {"inputs": jnp.asarray(toks[:, :-1], jnp.int32), "targets": jnp.asarray(toks[:, 1:], jnp.int32),
            "positions": jnp.tile(jnp.arange(T, dtype=jnp.int32), (B, 1)),
            "segment_ids": jnp.ones((B, T), jnp.int32),
            "weights": jnp.asarray(rng.random((B, T)) > 0.2, jnp.float32)}  # some padding targets


@pytest.mark.parametrize("mesh_shape", [(2, 1, 4), (1, 1, 8)], ids=["2x1x4", "1x1x8"])
def test_vocab_parallel_loss_matches_and_never_gathers_the_vocabulary(mesh_shape):
    """CE + z-loss with the vocabulary split over `tensor`: same sums and gradients as one device,
    and the compiled per-device program has no array with the full (padded) vocabulary dimension:
    no full logits, no gathered head or embedding table."""
    from modern_jax.training.loss import model_loss_sums

    # 500 real rows padded to 504 (8 x 63); chunk 48 does not divide a shard's 126 or 63 rows
    cfg = ModelConfig(vocab_size=500, vocab_pad_to=8, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, d_ff=128,
                      tie_embeddings=False, final_softcap=30.0)
    batch = _loss_batch(500)

    def objective(model, batch):
        sums = model_loss_sums(model, batch, chunk=48)
        return sums["ce"] + 1e-2 * sums["z_loss"], sums

    grad_fn = nnx.value_and_grad(objective, has_aux=True)
    (want, want_sums), want_grads = nnx.jit(grad_fn)(Transformer(cfg, rngs=nnx.Rngs(0)), batch)
    mesh, model = sharded(cfg, mesh_shape)
    with logical_rules(mesh):
        step = nnx.jit(grad_fn)
        (got, got_sums), got_grads = step(model, batch)
        hlo = step.lower(model, batch).compile().as_text()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for key in ("ce", "z_loss", "weight", "max_abs_logit"):
        np.testing.assert_allclose(got_sums[key], want_sums[key], rtol=1e-6, err_msg=key)
    assert_leaves_match(nnx.state(got_grads, nnx.Param), nnx.state(want_grads, nnx.Param))
    full_vocab = re.findall(r"\w+\[[\d,]*\b504\b[\d,]*\]", hlo)
    assert not full_vocab, f"full-vocabulary arrays on a device: {sorted(set(full_vocab))[:5]}"
    rows = 504 // mesh_shape[2]
    assert re.search(rf"\[[\d,]*\b{rows}\b[\d,]*\]", hlo), f"each device holds its {rows} vocabulary rows"


def test_fsdp_gathers_each_layer_inside_the_scan():
    """FSDP over 8 devices with scanned layers: every layer weight is all-gathered inside the
    forward and backward scan bodies, one layer at a time; outside them nothing with the stacked
    `layers` dimension is gathered (the whole model is never resident on one device)."""
    from modern_jax.training import TrainConfig

    cfg = ModelConfig(vocab_size=128, d_model=64, n_layers=3, n_heads=4, d_ff=192)  # scanned (the default)
    trainer = make_trainer(cfg, TrainConfig(batch_size=8, seq_len=16, steps=10, warmup_steps=1), make_mesh(fsdp=8))
    batch = trainer.batches.put(token_batch(1, 8, 16, 128))
    hlo = trainer.programs.lower("train", trainer.states.abstract(), batch).compile().as_text()
    computation, gathers = None, []
    for line in hlo.splitlines():
        if line.startswith(("%", "ENTRY")):
            computation = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
        match = re.search(r"= (\w+\[[\d,]*\])\S* all-gather\(", line)
        if match:
            gathers.append((computation, match.group(1)))
    bodies = {"%" + name for name in re.findall(r"body=%([\w.\-]+)", hlo)}
    inside = [shape for where, shape in gathers if where in bodies]
    outside = [shape for where, shape in gathers if where not in bodies]
    per_layer = {"f32[64,4,16]", "f32[4,16,64]", "f32[64,192]", "f32[192,64]"}  # q/k/v, o, gate/up, down
    assert per_layer <= set(inside), f"per-layer gathers inside the scans: {sorted(set(inside))}"
    assert len(inside) >= 2 * 6, "the forward and the backward scan each gather the block's 6 matrices"
    stacked = [s for s in outside if re.match(r"\w+\[3,", s)]
    assert not stacked, f"stacked layer weights gathered outside the scan: {stacked}"
