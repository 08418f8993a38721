"""A mixture of experts: a router picks k of E gated FFNs per token (README: Mixture of experts).

Letters (the package legend): B batch, T length, M tokens (B T), D model, F expert width,
E experts, Y experts chosen per token; the router's groups of experts have no letter.

    z      = x W_r [+ b_r]                                    router logits, float32
    s      = softmax(z) | sigmoid(z)                          scores
    chosen = top-k of (s + bias_sel) within the top groups    (bias_sel: selection only; k = Y)
    w      = s[chosen] [/ sum]  * router_scale                the combine weights
             (topk_softmax: chosen = top-k of z, w = softmax(z[chosen]))
    y      = sum_y w_y Expert_{chosen_y}(x)  [+ Shared(x)]    (router_on_input: Expert(w x))
    Expert(x) = W_down (act(W_gate x) * W_up x)
              | gpt-oss: W_down ((clip(up) + 1) * g sigmoid(alpha g)), g = min(gate, limit)

Groups (DeepSeek-V3): the E experts form `router_groups` groups; a group's score is the sum of its two
best `s + bias_sel`, the best `router_topk_groups` groups stay, and the top-k is taken
among their experts.

The layer sows, for the trainer: `moe_aux_loss` (Switch / GShard balance,
`E sum_e f_e P_e`, f_e the fraction of the M Y assignments routed to e, P_e the mean
normalised score of e; over the batch or per sequence), `moe_router_z_loss`
(mean of logsumexp(z)^2), `moe_load` (assignments per expert), `moe_dropped`, and `moe_scores`
(the scores summed over the tokens, from which with `moe_load` the pipeline stages rebuild the
batch's balance loss out of its microbatches').

Its stages run in named scopes (`router`, `dispatch`, `experts`, `combine`) and their outputs
carry `checkpoint_name`s a remat policy can save or drop: `router_logits`, `moe_dispatched`
(the rows sorted to their experts), `expert_gate`, `expert_up`, `expert_down` and
`moe_combined`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from modern_jax.config import ACTIVATIONS, ModelConfig
from modern_jax.layers.ffn import FFN
from modern_jax.layers.linear import Proj, Quantized, init_std, param, weight
from modern_jax.ops.moe import dispatch

AUX_LOSS, ROUTER_Z_LOSS, LOAD, DROPPED = "moe_aux_loss", "moe_router_z_loss", "moe_load", "moe_dropped"
SCORES = "moe_scores"  # the normalised scores summed over the tokens, [E]: with LOAD, the balance of a split batch


class SelectionBias(nnx.Param):
    """The router's selection-only bias (DeepSeek-V3's `e_score_correction_bias`): not trained by
    the optimiser nor decayed; the trainer's auxiliary-loss-free balancing updates it."""


def route(cfg: ModelConfig, z_ME, bias_E=None):
    """`(experts[M, Y], weights[M, Y] float32, normalised scores[M, E])` from router logits z."""
    Y = cfg.experts_per_token
    if cfg.router_score == "topk_softmax":
        choice_ME = z_ME if bias_E is None else z_ME + bias_E[None, :]
        _, experts_MY = jax.lax.top_k(_group_limit(cfg, choice_ME), Y)
        weights_MY = jax.nn.softmax(jnp.take_along_axis(z_ME, experts_MY, axis=-1), axis=-1)
        probs_ME = jax.nn.softmax(z_ME, axis=-1)
    else:
        s_ME = jax.nn.softmax(z_ME, axis=-1) if cfg.router_score == "softmax" else jax.nn.sigmoid(z_ME)
        choice_ME = s_ME if bias_E is None else s_ME + bias_E[None, :]
        _, experts_MY = jax.lax.top_k(_group_limit(cfg, choice_ME), Y)
        weights_MY = jnp.take_along_axis(s_ME, experts_MY, axis=-1)
        if cfg.router_norm_topk:
            weights_MY = weights_MY / (jnp.sum(weights_MY, axis=-1, keepdims=True) + 1e-20)
        probs_ME = s_ME / jnp.sum(s_ME, axis=-1, keepdims=True)
    return experts_MY, weights_MY * cfg.router_scale, probs_ME


def _group_limit(cfg: ModelConfig, choice_ME):
    """Keep the experts of each token's `router_topk_groups` best groups (the others can not be
    chosen); a group scores the sum of its two best experts."""
    groups = cfg.router_groups
    if groups == 1:
        return choice_ME
    M, E = choice_ME.shape
    by_group = choice_ME.reshape(M, groups, E // groups)  # [M, groups, E / groups]: a group's experts are a chunk of E
    group_score = jnp.sum(jax.lax.top_k(by_group, 2)[0], axis=-1)  # [M, groups]
    _, top_groups = jax.lax.top_k(group_score, cfg.router_topk_groups)
    keep = jnp.sum(jax.nn.one_hot(top_groups, groups, dtype=jnp.int32), axis=1) > 0  # [M, groups]
    return jnp.where(keep[:, :, None], by_group, -jnp.inf).reshape(M, E)


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.proj = Proj(cfg, (cfg.d_model, cfg.n_experts), ("embed", None), role="in", bias=cfg.router_bias,
                         rngs=rngs)
        self.selection_bias = (SelectionBias(jnp.zeros((cfg.n_experts,), jnp.float32), out_sharding=(None,),
                                             eager_sharding=False) if cfg.router_selection_bias else None)

    @jax.named_scope("router")
    def __call__(self, x_MD):
        """`(experts[M, Y], weights[M, Y], normalised scores[M, E], logits[M, E])`, all in float32."""
        z_ME = jnp.einsum("MD,DE->ME", x_MD.astype(jnp.float32), self.proj.weight(jnp.float32))
        if self.proj.bias is not None:
            z_ME = z_ME + self.proj.bias[...].astype(jnp.float32)[None, :]
        z_ME = checkpoint_name(z_ME, "router_logits")
        bias_E = None if self.selection_bias is None else self.selection_bias[...].astype(jnp.float32)
        return (*route(self.cfg, z_ME, bias_E), z_ME)


class ExpertProj(nnx.Module):
    """E stacked projections `kernel[E, I, O]` (+ `bias[E, O]`), applied by the dispatch's matmul."""

    def __init__(self, cfg: ModelConfig, E: int, I: int, O: int, axes, *, role: str, bias: bool, rngs: nnx.Rngs):
        self.reduces = axes[0] == "mlp"  # contracts the expert width (split over `tensor`): partial sums
        dtype = jnp.dtype(cfg.param_dtype)
        std = init_std(cfg, role, I, O)
        self.kernel = param(rngs, jax.nn.initializers.normal(std), (E, I, O), ("experts", *axes), dtype)
        self.bias = param(rngs, jax.nn.initializers.zeros, (E, O), ("experts", axes[1]), dtype) if bias else None
        self.in_dims, self.out_dims = 1, 1

    def weight(self, dtype):
        """The kernel as it acts, in `dtype` (dequantized)."""
        return weight(self.kernel, dtype)

    def acting(self, dtype):
        """What the matmul gets: the kernel as stored (the dispatch casts it where it measured best,
        `ops.moe`), or in `dtype` where it is stored quantized."""
        return self.weight(dtype) if isinstance(self.kernel, Quantized) else self.kernel[...]

    def __call__(self, x, matmul):
        return matmul(x, self.acting(x.dtype), None if self.bias is None else self.bias[...], reduce=self.reduces)


class Experts(nnx.Module):
    """E gated FFNs with stacked weights; the dispatch decides which rows meet which expert."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        E, D, F, bias = cfg.n_experts, cfg.d_model, cfg.expert_width, cfg.expert_bias
        self.act, self.limit, self.alpha = ACTIVATIONS[cfg.activation], cfg.expert_swiglu_limit, cfg.expert_swiglu_alpha
        self.gate_proj = ExpertProj(cfg, E, D, F, ("embed", "mlp"), role="in", bias=bias, rngs=rngs)
        self.up_proj = ExpertProj(cfg, E, D, F, ("embed", "mlp"), role="in", bias=bias, rngs=rngs)
        self.down_proj = ExpertProj(cfg, E, F, D, ("mlp", "embed"), role="out", bias=bias, rngs=rngs)

    @jax.named_scope("experts")
    def __call__(self, x, matmul):
        gate = checkpoint_name(self.gate_proj(x, matmul), "expert_gate")
        up = checkpoint_name(self.up_proj(x, matmul), "expert_up")
        if self.limit is None:
            h = self.act(gate) * up
        else:  # gpt-oss: clamped, with the up branch shifted by one
            gate = jnp.minimum(gate, self.limit)
            up = jnp.clip(up, -self.limit, self.limit)
            h = (up + 1) * (gate * jax.nn.sigmoid(self.alpha * gate))
        return checkpoint_name(self.down_proj(h, matmul), "expert_down")


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.router = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs)
        self.shared_experts = FFN(cfg, width=cfg.shared_width, rngs=rngs) if cfg.n_shared_experts else None

    @jax.named_scope("moe")
    def __call__(self, x_BTD):
        cfg = self.cfg
        B, T, D = x_BTD.shape
        x_MD = x_BTD.reshape(B * T, D)
        experts_MY, weights_MY, probs_ME, z_ME = self.router(x_MD)
        y_MD, dropped = dispatch(x_MD, experts_MY, weights_MY, self.experts, n_experts=cfg.n_experts,
                                 on_input=cfg.router_on_input, batch=B)
        y_BTD = y_MD.reshape(B, T, D).astype(x_BTD.dtype)
        if self.shared_experts is not None:
            y_BTD = y_BTD + self.shared_experts(x_BTD)

        load_E = jnp.sum(jax.nn.one_hot(experts_MY, cfg.n_experts, dtype=jnp.float32), axis=(0, 1))
        sown = {AUX_LOSS: balance_loss(experts_MY, probs_ME, cfg.n_experts, B if cfg.moe_aux_per_sequence else 1),
                ROUTER_Z_LOSS: jnp.mean(jnp.square(jax.nn.logsumexp(z_ME, axis=-1))),
                LOAD: jax.lax.stop_gradient(load_E), DROPPED: dropped.astype(jnp.float32),
                SCORES: jnp.sum(probs_ME, axis=0)}
        for name, value in sown.items():  # read by the stages (`nnx.capture`); nothing outside one
            self.sow(nnx.Intermediate, name, value, capture_noop=True)
        return y_BTD


def balance_loss(experts_MY, probs_ME, E: int, n_groups: int = 1):
    """`E sum_e f_e P_e`, averaged over `n_groups` equal runs of tokens (1: the batch; B: per
    sequence): f_e the fraction of the group's assignments that chose e, P_e its mean score.
    The groups are the B of `chosen_BTYE`, their tokens the T."""
    M, Y = experts_MY.shape
    chosen_BTYE = jax.nn.one_hot(experts_MY, E, dtype=jnp.float32).reshape(n_groups, M // n_groups, Y, E)
    f_BE = jnp.mean(jnp.sum(chosen_BTYE, axis=2), axis=1) / Y
    P_BE = jnp.mean(probs_ME.reshape(n_groups, M // n_groups, E), axis=1)
    return E * jnp.mean(jnp.sum(f_BE * P_BE, axis=-1))
