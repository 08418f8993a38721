"""Multi-token prediction (`model.MTPLayer`, `training.loss.mtp_sums`, `generate.mtp_decode`): the loss and
its gradients against a naive implementation of DeepSeek-V3's equations, the modules on a mesh, and
self-speculative greedy decoding against plain greedy decoding. (Its Hugging Face weights:
tests/test_convert_hf.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from common import make_trainer, one_device, token_batch
from modern_jax.config import ModelConfig
from modern_jax.model import Transformer
from modern_jax.sharding.mesh import make_mesh
from modern_jax.training import TrainConfig
from modern_jax.training.loss import model_loss_sums
from modern_jax.training.objectives import next_token

V, D, T = 13, 16, 8
DENSE = ModelConfig(vocab_size=V, d_model=D, n_layers=1, n_heads=2, d_ff=24, mtp_depth=2)


def packed_batch(B: int = 2) -> dict:
    """Two rows of `T` tokens, the second packing two documents (segments 1 and 2), one target unweighted."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, V, (B, T + 1)).astype(np.int32)
    seg = np.ones((B, T), np.int32)
    seg[1, 5:] = 2
    pos = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    pos[1, 5:] = np.arange(T - 5)
    weights = np.ones((B, T), np.float32)
    weights[0, 6] = 0.0
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": pos, "segment_ids": seg,
            "weights": weights}


# ----- the paper's equations, written out naively ---------------------------------------------

def rms(x, w, eps=1e-5):
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w.reshape((1,) * (x.ndim - 1) + (-1,))


def rope_half(x, pos, theta=10000.0):
    H = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, H, 2) / H)
    ang = jnp.asarray(pos, jnp.float32)[..., None, None] * inv.reshape(1, 1, 1, -1)  # [B, T, 1, H/2]
    x1, x2 = x[..., : H // 2], x[..., H // 2:]
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], -1)


def naive_block(p, x, pos, seg):
    """A pre-norm block: causal attention within each document (RoPE on half-split heads), then a SwiGLU FFN."""
    h = rms(x, p["input_layernorm"]["weight"])
    a = p["self_attn"]
    q = rope_half(jnp.einsum("btd,dnh->btnh", h, a["q_proj"]["kernel"]), pos)
    k = rope_half(jnp.einsum("btd,dnh->btnh", h, a["k_proj"]["kernel"]), pos)
    v = jnp.einsum("btd,dnh->btnh", h, a["v_proj"]["kernel"])
    s = jnp.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(q.shape[-1])
    Tn = x.shape[1]
    ok = (np.arange(Tn)[:, None] >= np.arange(Tn)[None])[None, None] & (seg[:, :, None] == seg[:, None, :])[:, None]
    s = jnp.where(ok, s, -jnp.inf)
    o = jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(s, -1), v)
    x = x + jnp.einsum("bqnh,nhd->bqd", o, a["o_proj"]["kernel"])
    h = rms(x, p["pre_feedforward_layernorm"]["weight"])
    m = p["mlp"]
    f = jax.nn.silu(h @ m["gate_proj"]["kernel"]) * (h @ m["up_proj"]["kernel"])
    return x + f @ m["down_proj"]["kernel"]


def naive_loss(params, model_h, batch, lam):
    """DeepSeek-V3 (21)-(25): h'^k_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)] (the checkpoint's order),
    h^k = TRM_k(h'^k), P^k_{i+k+1} = OutHead(h^k_i); L = L_main + lam / D sum_k L^k, each L the mean CE over the
    weighted targets of the batch (a target outside the window or row i's document is not one of module k's)."""
    emb, head = params["embed_tokens"], params["lm_head"]["kernel"]
    tokens, targets, w, seg, pos = (batch[n] for n in ("inputs", "targets", "weights", "segment_ids", "positions"))
    B, Tn = tokens.shape
    n = jnp.sum(w)

    def ce(h, tgt, weight):
        logits = h @ head
        lp = jax.nn.log_softmax(logits, -1)
        return -jnp.sum(weight * jnp.take_along_axis(lp, tgt[..., None], -1)[..., 0])

    h = model_h  # the main model's final hidden states (after its final norm)
    total, per_k = ce(h, targets, w) / n, []
    depth = params["mtp"]["eh_proj"]["kernel"].shape[0]
    for k in range(1, depth + 1):
        p = jax.tree.map(lambda a: a[k - 1], params["mtp"])
        rows, tgt_k, w_k = [], np.zeros((B, Tn), np.int32), np.zeros((B, Tn), np.float32)
        ahead = np.zeros((B, Tn), np.int32)
        for b in range(B):
            for i in range(Tn):
                if i + k < Tn:
                    ahead[b, i] = tokens[b, i + k]
                    if seg[b, i + k] == seg[b, i]:
                        tgt_k[b, i], w_k[b, i] = targets[b, i + k], w[b, i + k]
        e = emb[ahead]
        joined = jnp.concatenate([rms(e, p["enorm"]["weight"]), rms(h, p["hnorm"]["weight"])], -1)
        h = naive_block(p["block"], joined @ p["eh_proj"]["kernel"], pos, seg)
        per_k.append(ce(rms(h, p["head_norm"]["weight"]), tgt_k, w_k) / n)
    return total + lam / depth * sum(per_k), per_k


def test_mtp_loss_and_gradients_match_the_papers_equations():
    """On a fixed packed batch: the objective's loss (main + lambda / D sum_k CE_k), each CE_k and the gradient
    of every parameter equal a naive implementation of DeepSeek-V3's MTP equations within 1e-5."""
    model = Transformer(DENSE, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    batch = {k: jnp.asarray(v) for k, v in packed_batch().items()}
    host = {k: np.asarray(v) for k, v in batch.items()}
    objective = next_token.Objective(next_token.Config(), TrainConfig(mtp_loss_weight=0.3, z_loss_weight=0.0))

    def ours(params):
        sums = model_loss_sums(nnx.merge(graphdef, params), batch)
        denom = objective.denominator(batch)
        return objective.loss(sums, denom), objective.metrics(sums, denom)

    def theirs(params):
        m = nnx.merge(graphdef, params)
        h, _ = m.hidden_states(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"])
        return naive_loss(nnx.to_pure_dict(params), h, host, 0.3)

    (loss, metrics), grads = jax.value_and_grad(ours, has_aux=True)(params)
    (want, per_k), want_grads = jax.value_and_grad(theirs, has_aux=True)(params)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose([metrics["mtp_loss_1"], metrics["mtp_loss_2"]], per_k, rtol=1e-5)
    flat, want_flat = nnx.to_flat_state(grads), dict(nnx.to_flat_state(want_grads))
    for path, g in flat:
        w = np.asarray(want_flat[path][...])
        assert np.linalg.norm(np.asarray(g[...]) - w) <= 1e-5 * max(np.linalg.norm(w), 1e-3), path
    assert np.linalg.norm(np.asarray(grads["mtp"]["eh_proj"]["kernel"][...])) > 0


MOE = ModelConfig(vocab_size=16, d_model=16, n_layers=2, n_heads=2, d_ff=32, ffn_type="moe", n_experts=4,
                  experts_per_token=2, expert_d_ff=8, moe_first_dense=1, mtp_depth=2, vocab_pad_to=8)


def test_mtp_with_muon_on_a_mesh_equals_one_device_over_10_steps():
    """A model with a dense and a mixture layer and two MTP modules (mixtures too), trained by Muon with
    auxiliary-loss-free balancing on fsdp x expert x tensor: each of 10 steps' loss and MTP losses equal
    one device's within 1e-5."""
    cfg = MOE.replace(router_score="sigmoid", router_selection_bias=True)
    tc = TrainConfig(batch_size=4, seq_len=8, optimizer="muon", lr=0.02, warmup_steps=0, schedule="constant",
                     moe_bias_update_rate=0.01)
    batches = [token_batch(1, 4, 8, 16)] * 10  # one batch: the loss falls

    def losses(mesh):
        trainer = make_trainer(cfg, tc, mesh)
        state, out = trainer.states.init(0), []
        for batch in batches:
            state, metrics = trainer.train_step(state, trainer.batches.put(batch))
            out.append([float(metrics[name]) for name in ("loss", "mtp_loss_1", "mtp_loss_2")])
        return np.array(out)

    one, many = losses(one_device()), losses(make_mesh(fsdp=2, expert=2, tensor=2))
    assert one[-1, 0] < one[0, 0] - 0.05, one  # it learns
    np.testing.assert_allclose(many, one, rtol=1e-5)


def test_mtp_mixtures_are_balanced_and_their_heads_clipped_like_the_models_layers():
    """A step with auxiliary-loss-free balancing and QK-clip, at a learning rate too small to move the
    weights itself: each MTP module's selection bias moves by `rate * sign(mean load - load)` of its own
    block's loads (the modules chained here by hand), re-centred; each MTP head over tau comes to tau."""
    from modern_jax.layers.attention import MAX_LOGIT
    from modern_jax.layers.moe import LOAD
    from modern_jax.model import head_logits, sown_value

    cfg = MOE.replace(router_score="sigmoid", router_selection_bias=True, init_std=0.3)
    batch = token_batch(1, 4, 8, 16)
    rows = {k: jnp.asarray(v[0]) for k, v in batch.items()}

    def per_head(sown):  # [N]: what the attention layer sowed, each head's max logit
        [heads_N] = [leaf for path, v in nnx.to_flat_state(sown) if MAX_LOGIT in map(str, path)
                     for leaf in jax.tree.leaves(v)]
        return np.asarray(heads_N)

    def mtp_heads(model):  # [D, N]: each module's max attention logit of each head
        _, sown = nnx.capture(lambda m: model_loss_sums(m, rows, diagnostics=True), nnx.Intermediate)(model)
        return np.asarray(head_logits(sown)["mtp"][0])

    def start(tau):
        tc = TrainConfig(batch_size=4, seq_len=8, lr=1e-9, warmup_steps=0, schedule="constant", z_loss_weight=0.0,
                         moe_bias_update_rate=0.01, qk_clip_tau=tau)
        trainer = make_trainer(cfg, tc, one_device())
        return trainer, trainer.states.init(0)

    trainer, state = start(None)
    before = trainer.states.model(state["params"])
    heads = mtp_heads(before)
    tau = float(np.median(heads))
    trainer, state = start(tau)
    state, _ = trainer.train_step(state, trainer.batches.put(batch))
    after = trainer.states.model(state["params"])

    # the reference: each module's loads and heads, the modules chained as DeepSeek-V3 section 2.2 chains them;
    # the heads after the step measured on the same inputs (a module's input moves when those before it are clipped)
    graphdef, stacked = nnx.split(before.mtp)
    _, stacked_after = nnx.split(after.mtp)
    h = before.hidden_states(rows["inputs"], positions=rows["positions"], segment_ids=rows["segment_ids"])[0]
    for k in (1, 2):
        e = before.embed(jnp.roll(rows["inputs"], -k, axis=1))
        run = lambda weights, h: nnx.capture(nnx.merge(graphdef, jax.tree.map(lambda w: w[k - 1], weights)),  # noqa: E731
                                             nnx.Intermediate)(h, e, rows["positions"], rows["segment_ids"], None,
                                                               None, True)
        (h_next, _), sown = run(stacked, h)
        _, sown_after = run(stacked_after, h)
        h = h_next
        load = np.asarray(sown_value(sown, LOAD))
        moved = 0.01 * np.sign(load.mean() - load)
        assert np.any(moved != 0), load
        np.testing.assert_allclose(np.asarray(after.mtp.block.mlp.router.selection_bias[...][k - 1]),
                                   moved - moved.mean(), atol=1e-7, err_msg=f"module {k}")
        np.testing.assert_allclose(per_head(sown), heads[k - 1], rtol=1e-5)
        np.testing.assert_allclose(per_head(sown_after), np.minimum(heads[k - 1], tau), rtol=1e-5,
                                   err_msg=f"module {k}")
    assert (heads > tau * 1.01).sum() >= 1 and (heads < tau).sum() >= 1, heads


@pytest.mark.quick
def test_the_flops_of_a_token_count_the_mtp_modules_as_they_run():
    """Each module adds 6 x its matmul weights (eh_proj 2D x D, a block: q k v o, the gated FFN, its two
    norms; enorm, hnorm, head_norm), 6 x one more pass through the shared head (V x D), and one block's
    attention (6 N (d_qk + d_v) T, and causally (T + 1) / 2 keys)."""
    from modern_jax.accounting import flops_per_token

    T, F, heads = 8, 24, 2
    block = 4 * D * D + 3 * D * F + 2 * D
    module = 2 * D * D + block + 3 * D
    with_mtp, without = flops_per_token(DENSE, T), flops_per_token(DENSE.replace(mtp_depth=0), T)
    assert with_mtp["weights"] - without["weights"] == 6 * 2 * (module + V * D)
    assert with_mtp["attention"] - without["attention"] == 2 * 6 * heads * 2 * D // heads * T
    assert with_mtp["causal_total"] - without["causal_total"] == 6 * 2 * (module + V * D) + 2 * 6 * 2 * D * (T + 1) / 2


def test_self_speculative_greedy_equals_plain_greedy():
    """Drafting with MTP module 1 and keeping a draft only where the main model agrees gives plain greedy
    decoding's tokens, row by row, with drafts both kept and rejected along the way."""
    from modern_jax.generate import generate, generate_mtp

    cfg = ModelConfig(vocab_size=5, d_model=16, n_layers=2, n_heads=2, d_ff=24, mtp_depth=2)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(1)))
    prompt = np.random.default_rng(0).integers(0, 5, (3, 5)).astype(np.int32)
    want = generate(graphdef, params, prompt, max_new_tokens=20, temperature=0.0)
    got, stats = generate_mtp(graphdef, params, prompt, max_new_tokens=20)
    np.testing.assert_array_equal(got, want)
    assert 0 < stats["accepted"] < stats["steps"], stats


@pytest.mark.quick
@pytest.mark.parametrize("parallel, message", [
    ({"stage": 2}, r"model.mtp_depth=1 with parallel.stage=2: the pipeline schedules do not run"),
    ({"context": 2}, r"model.mtp_depth=1 with parallel.context=2 and parallel.context_layout=two_chunk: that layout "
                     r"reorders .* use parallel.context_layout=contiguous"),
])
def test_mtp_is_refused_where_its_modules_would_not_run_or_read_the_wrong_tokens(parallel, message):
    from modern_jax.training import run_config_from_dict

    with pytest.raises(ValueError, match=message):
        run_config_from_dict({"model": {"vocab_size": 64, "mtp_depth": 1}, "parallel": parallel})
    run_config_from_dict({"model": {"vocab_size": 64, "mtp_depth": 1},
                          "parallel": {"context": 2, "context_layout": "contiguous"}})
