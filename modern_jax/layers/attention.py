"""Self-attention: MHA / GQA / MQA and DeepSeek's multi-head latent attention (MLA).

Letters (the package legend): B batch, T query length, S key length, D model, N query heads,
K kv heads, G query heads per kv head (N = K * G), H query / key head dim, U value head dim
(MLA), C MLA's key / value latent (d_c), R the rotary dim of MLA's decoupled key (d_R), X the
two side by side (C + R), Q MLA's query latent.

Decoding caches are dicts of arrays `[B, S, ...]` plus `pos[B, S]` (the position held
by each slot, -1 when empty). Local layers keep a ring of `sliding_window` slots, chunked
layers one of `attention_chunk_size` slots: a query at p sees at most the positions
`p - span + 1 .. p` (its window, or its chunk `[p // c * c, p]`), which are the ring's
latest `span` writes; older positions in it are masked by the same rule.

Per layer (`LayerSpec`): `qk_norm` `head` / `full` normalises q and k before RoPE, `l2`
(Llama 4's weightless `x * rsqrt(mean(x^2) + eps)` per head) after it, on the RoPE layers
only; temperature tuning scales the queries of the layers without positions by
`log(floor((pos + 1) / floor) + 1) * scale + 1` of their true positions (the cache's too).

Called with `diagnostics=True`, a layer sows `max_attention_logit` (`nnx.Intermediate`):
max |q.k| * scale over its visible query-key pairs for each query head, `[N]`, measured by the
attention kernel itself while it computes the output (see `kernels.attention`).
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from flax import nnx

from modern_jax.config import LayerSpec, ModelConfig
from modern_jax.kernels import AttentionSpec, Visibility
from modern_jax.ops.attention import attention
from modern_jax.layers.linear import Proj, param
from modern_jax.layers.norms import Norm, l2_norm
from modern_jax.layers.positions import apply_rope, scale_queries, yarn_mscale
from modern_jax.sharding import constrain

MAX_LOGIT = "max_attention_logit"


def attend_with_cache(cache, new, pos_BT, span):
    """Write `new` (dict of [B, T, ...]) into `cache`; return what the queries attend to.

    Returns `(keys, k_pos_BS, updated_cache)`. A ring (a local or chunked layer, `span` its
    window or chunk) that receives several tokens at once attends over the old cache plus the
    new tokens, since writing first could overwrite keys an earlier new query still sees.
    """
    B, T = pos_BT.shape
    S = cache["pos"].shape[1]
    tail = {name: value[:, -S:] for name, value in new.items()}
    pos_tail_BT = pos_BT[:, -S:]
    b_B1 = jnp.arange(B)[:, None]
    slots_BT = pos_tail_BT % S
    updated = {name: cache[name].at[b_B1, slots_BT].set(tail[name].astype(cache[name].dtype)) for name in new}
    updated["pos"] = cache["pos"].at[b_B1, slots_BT].set(pos_tail_BT)
    if span is None or T == 1:
        keys = {name: updated[name] for name in new}
        return keys, updated["pos"], updated
    keys = {name: jnp.concatenate([cache[name], new[name].astype(cache[name].dtype)], axis=1) for name in new}
    return keys, jnp.concatenate([cache["pos"], pos_BT], axis=1), updated


def cache_slots(cfg: ModelConfig, spec: LayerSpec, max_len: int) -> int:
    return max_len if spec.span is None else min(spec.span, max_len)


def sow_max_logit(layer: nnx.Module, out, diagnostics: bool):
    """The attention output; with `diagnostics`, `out` is `(o, max_logit)` (the kernel's, per head)
    and the layer sows the max of each query head, `[N]`."""
    if not diagnostics:
        return out
    o, max_logit = out
    layer.sow(nnx.Intermediate, MAX_LOGIT, max_logit.reshape(-1))  # [K, G] (MLA: [N, 1] or [1, N]) -> [N]
    return o


def clip_factors(max_logit_LN, tau: float):
    """QK-clip's factor of each head (Kimi K2's MuonClip): `gamma = min(1, tau / max logit)`, the
    scale that brings a head's max attention logit down to `tau` (1 for a head at or below it)."""
    return tau / jnp.maximum(max_logit_LN.astype(jnp.float32), tau)


def scale_heads(proj: Proj, f_LXH) -> None:
    """A stack's projection `[L, in, heads, head dim]` (and its bias `[L, heads, head dim]`)
    multiplied by `f_LXH` (broadcast over the head dim where it is 1), in place."""
    proj.kernel[...] = proj.kernel[...] * f_LXH[:, None].astype(proj.kernel.dtype)
    if proj.bias is not None:
        proj.bias[...] = proj.bias[...] * f_LXH.astype(proj.bias.dtype)


class Attention(nnx.Module):
    """Multi-head attention with grouped K/V (MHA when K = N, MQA when K = 1)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, rngs: nnx.Rngs):
        D, N, K, H = cfg.d_model, cfg.n_heads, cfg.num_kv_heads, cfg.head_size
        self.cfg, self.spec = cfg, spec
        self.q_proj = Proj(cfg, (D, N, H), ("embed", "q_heads", "head_dim"), role="qk", bias=cfg.qkv_bias, rngs=rngs)
        self.k_proj = Proj(cfg, (D, K, H), ("embed", "kv_heads", "head_dim"), role="qk", bias=cfg.qkv_bias, rngs=rngs)
        self.v_proj = Proj(cfg, (D, K, H), ("embed", "kv_heads", "head_dim"), role="v", bias=cfg.qkv_bias, rngs=rngs)
        self.o_proj = Proj(cfg, (N, H, D), ("q_heads", "head_dim", "embed"), role="out", in_dims=2,
                           bias=cfg.out_bias, rngs=rngs)
        if spec.qk_norm == "head":  # one gamma over head_dim, shared by all heads
            self.q_norm = Norm(cfg, (H,), ("head_dim",), rngs=rngs)
            self.k_norm = Norm(cfg, (H,), ("head_dim",), rngs=rngs)
        elif spec.qk_norm == "full":  # over the whole projection (OLMo 2)
            self.q_norm = Norm(cfg, (N, H), ("q_heads", "head_dim"), rngs=rngs)
            self.k_norm = Norm(cfg, (K, H), ("kv_heads", "head_dim"), rngs=rngs)
        else:  # none, or l2 (no weight: applied after RoPE in __call__)
            self.q_norm = self.k_norm = None
        self.sinks = param(rngs, jax.nn.initializers.zeros, (N,), ("q_heads",), jnp.float32) if cfg.attention_sinks else None

    def init_cache(self, batch: int, max_len: int, dtype):
        S, K, H = cache_slots(self.cfg, self.spec, max_len), self.cfg.num_kv_heads, self.cfg.head_size
        return {"k": jnp.zeros((batch, S, K, H), dtype), "v": jnp.zeros((batch, S, K, H), dtype),
                "pos": jnp.full((batch, S), -1, jnp.int32)}

    @jax.named_scope("attention")
    def __call__(self, x_BTD, pos_BT, seg_BT=None, cache=None, rng=None, diagnostics: bool = False):
        cfg, spec = self.cfg, self.spec
        B, T, _ = x_BTD.shape
        K, G, H = cfg.num_kv_heads, cfg.n_heads // cfg.num_kv_heads, cfg.head_size
        q_BTNH = checkpoint_name(self.q_proj("BTD,DNH->BTNH", x_BTD), "query_proj")
        k_BTKH = checkpoint_name(self.k_proj("BTD,DKH->BTKH", x_BTD), "key_proj")
        v_BTKH = checkpoint_name(self.v_proj("BTD,DKH->BTKH", x_BTD), "value_proj")
        if self.q_norm is not None:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        if spec.rope is not None:
            q_BTNH, k_BTKH = apply_rope(q_BTNH, pos_BT, spec.rope), apply_rope(k_BTKH, pos_BT, spec.rope)
        if spec.qk_norm == "l2":  # Llama 4: weightless, per head, after RoPE
            q_BTNH, k_BTKH = l2_norm(q_BTNH, cfg.norm_eps), l2_norm(k_BTKH, cfg.norm_eps)
        if spec.temperature is not None:
            q_BTNH = scale_queries(q_BTNH, pos_BT, spec.temperature)
        q_BTKGH = constrain(q_BTNH.reshape(B, T, K, G, H), ("activation_batch", "activation_length",
                                                            "activation_kv_heads", None, None))
        k_pos_BS, k_seg_BS = pos_BT, seg_BT
        if cache is None:
            k_BSKH, v_BSKH = k_BTKH, v_BTKH
        else:
            keys, k_pos_BS, cache = attend_with_cache(cache, {"k": k_BTKH, "v": v_BTKH}, pos_BT, spec.span)
            k_BSKH, v_BSKH = keys["k"].astype(x_BTD.dtype), keys["v"].astype(x_BTD.dtype)
        scale = cfg.attn_scale if cfg.attn_scale is not None else H**-0.5
        sinks_KG = None if self.sinks is None else self.sinks[...].reshape(K, G)
        o_BTKGH = sow_max_logit(self, attention(
            q_BTKGH, k_BSKH, v_BSKH,
            AttentionSpec(scale=scale, window=spec.window, chunk=spec.chunk, softcap=cfg.attn_softcap,
                          dropout_rate=cfg.attn_dropout),
            Visibility(pos_BT, k_pos_BS, seg_BT, k_seg_BS), sinks_KG=sinks_KG, dropout_rng=rng,
            return_max_logit=diagnostics,
        ), diagnostics)
        o_BTNH = constrain(o_BTKGH.reshape(B, T, K * G, H),
                           ("activation_batch", "activation_length", "activation_heads", None))
        o_BTNH = checkpoint_name(o_BTNH, "attention_out")
        return self.o_proj("BTNH,NHD->BTD", o_BTNH), cache

    def clip_qk(self, max_logit_LN, tau: float) -> None:
        """QK-clip of a stack of these layers (weights `[L, ...]`), from each layer's max logit of
        each query head `[L, N]`: head n's logits scale by its `gamma_n` (`clip_factors`). A key head
        serves its group of G query heads, so it takes the square root of the group's mildest
        factor, `sqrt(max_g gamma_g)`, and each query head the rest, `gamma_n / sqrt(max_g gamma_g)`:
        every head's logits scale by exactly its own factor (a head within tau is unchanged), no
        weight grows, and a group clipped alike (with K = N, every head) gets Kimi K2's
        `sqrt(gamma)` on both sides."""
        K, G = self.cfg.num_kv_heads, self.cfg.n_heads // self.cfg.num_kv_heads
        gamma_LKG = clip_factors(max_logit_LN, tau).reshape(-1, K, G)
        k_LK = jnp.sqrt(jnp.max(gamma_LKG, axis=-1))
        scale_heads(self.q_proj, (gamma_LKG / k_LK[..., None]).reshape(-1, K * G)[..., None])
        scale_heads(self.k_proj, k_LK[..., None])


class MLAttention(nnx.Module):
    """Multi-head latent attention: keys and values come from a shared latent c[C].

    The cache holds only `c[C]` and the decoupled rotary key `k_pe[R]` per token. With a
    cache the up-projections are absorbed: queries move into latent space
    (`q_nope @ W_uk`), attention runs as MQA over `[c, k_pe]`, and `W_uv` maps back.
    """

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, rngs: nnx.Rngs):
        D, N, C, R = cfg.d_model, cfg.n_heads, cfg.mla_kv_rank, cfg.mla_rope_dim
        Hn, U, Q = cfg.mla_nope_dim, cfg.mla_v_dim, cfg.mla_q_rank
        self.cfg, self.spec = cfg, spec
        if Q:
            self.q_a_proj = Proj(cfg, (D, Q), ("embed", "q_latent"), role="in", rngs=rngs)
            self.q_a_layernorm = Norm(cfg, (Q,), ("q_latent",), rngs=rngs)
            self.q_b_proj = Proj(cfg, (Q, N, Hn + R), ("q_latent", "q_heads", "head_dim"), role="qk", rngs=rngs)
        else:
            self.q_proj = Proj(cfg, (D, N, Hn + R), ("embed", "q_heads", "head_dim"), role="qk", rngs=rngs)
        self.kv_a_proj_with_mqa = Proj(cfg, (D, C + R), ("embed", "kv_latent"), role="in", rngs=rngs)
        self.kv_a_layernorm = Norm(cfg, (C,), ("kv_latent",), rngs=rngs)
        self.kv_b_proj = Proj(cfg, (C, N, Hn + U), ("kv_latent", "q_heads", "head_dim"), role="v", rngs=rngs)
        self.o_proj = Proj(cfg, (N, U, D), ("q_heads", "head_dim", "embed"), role="out", in_dims=2, rngs=rngs)
        self.sinks = param(rngs, jax.nn.initializers.zeros, (N,), ("q_heads",), jnp.float32) if cfg.attention_sinks else None

    def init_cache(self, batch: int, max_len: int, dtype):
        S = cache_slots(self.cfg, self.spec, max_len)
        return {"c": jnp.zeros((batch, S, self.cfg.mla_kv_rank), dtype),
                "k_pe": jnp.zeros((batch, S, self.cfg.mla_rope_dim), dtype),
                "pos": jnp.full((batch, S), -1, jnp.int32)}

    def scale(self) -> float:
        cfg = self.cfg
        scale = cfg.attn_scale if cfg.attn_scale is not None else (cfg.mla_nope_dim + cfg.mla_rope_dim) ** -0.5
        s = None if self.spec.rope is None else self.spec.rope.scaling
        if s is not None and s.type == "yarn" and s.mscale_all_dim:  # DeepSeek: softmax scale times mscale^2
            scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
        return scale

    @jax.named_scope("mla_attention")
    def __call__(self, x_BTD, pos_BT, seg_BT=None, cache=None, rng=None, diagnostics: bool = False, absorb=None):
        cfg, spec = self.cfg, self.spec
        B, T, _ = x_BTD.shape
        N, C, Hn = cfg.n_heads, cfg.mla_kv_rank, cfg.mla_nope_dim
        if cfg.mla_q_rank:
            q_BTNH = self.q_b_proj("BTQ,QNH->BTNH", self.q_a_layernorm(self.q_a_proj("BTD,DQ->BTQ", x_BTD)))
        else:
            q_BTNH = self.q_proj("BTD,DNH->BTNH", x_BTD)
        if spec.temperature is not None:  # a NoPE layer's queries, both parts
            q_BTNH = scale_queries(q_BTNH, pos_BT, spec.temperature)
        q_nope_BTNH, q_pe_BTNR = q_BTNH[..., :Hn], q_BTNH[..., Hn:]
        ckv_BTX = self.kv_a_proj_with_mqa("BTD,DX->BTX", x_BTD)
        c_BTC = checkpoint_name(self.kv_a_layernorm(ckv_BTX[..., :C]), "key_proj")
        k_pe_BTR = ckv_BTX[..., C:]
        if spec.rope is not None:  # a NoPE layer leaves the decoupled query / key parts unrotated
            q_pe_BTNR = apply_rope(q_pe_BTNR, pos_BT, spec.rope)
            k_pe_BTR = apply_rope(k_pe_BTR[:, :, None], pos_BT, spec.rope)[:, :, 0]
        k_pos_BS, k_seg_BS = pos_BT, seg_BT
        if cache is None:
            c_BSC, k_pe_BSR = c_BTC, k_pe_BTR
        else:
            keys, k_pos_BS, cache = attend_with_cache(cache, {"c": c_BTC, "k_pe": k_pe_BTR}, pos_BT, spec.span)
            c_BSC, k_pe_BSR = keys["c"].astype(x_BTD.dtype), keys["k_pe"].astype(x_BTD.dtype)
        absorb = cache is not None if absorb is None else absorb
        w_uk_CNH, w_uv_CNU = jnp.split(self.kv_b_proj.weight(x_BTD.dtype), [Hn], axis=-1)  # [C, N, Hn + U]
        spec_ = AttentionSpec(scale=self.scale(), window=spec.window, chunk=spec.chunk, softcap=cfg.attn_softcap,
                              dropout_rate=cfg.attn_dropout)
        vis = Visibility(pos_BT, k_pos_BS, seg_BT, k_seg_BS)
        kwargs = dict(dropout_rng=rng, return_max_logit=diagnostics)
        if absorb:  # MQA over the latent: one shared "kv head" of width C + R, N queries per group
            q_lat_BTNC = jnp.einsum("BTNH,CNH->BTNC", q_nope_BTNH, w_uk_CNH)
            q_BT1NX = jnp.concatenate([q_lat_BTNC, q_pe_BTNR], axis=-1)[:, :, None]
            k_BS1X = jnp.concatenate([c_BSC, k_pe_BSR], axis=-1)[:, :, None]
            sinks_1N = None if self.sinks is None else self.sinks[...][None]
            o_BT1NC = sow_max_logit(self, attention(q_BT1NX, k_BS1X, c_BSC[:, :, None], spec_, vis, sinks_KG=sinks_1N,
                                                    **kwargs), diagnostics)
            o_BTNU = jnp.einsum("BTNC,CNU->BTNU", o_BT1NC[:, :, 0], w_uv_CNU)
        else:  # expand the latent into per-head keys and values (training)
            S = c_BSC.shape[1]
            k_nope_BSNH = jnp.einsum("BSC,CNH->BSNH", c_BSC, w_uk_CNH)
            v_BSNU = jnp.einsum("BSC,CNU->BSNU", c_BSC, w_uv_CNU)
            k_BSNH = jnp.concatenate([k_nope_BSNH, jnp.broadcast_to(k_pe_BSR[:, :, None], (B, S, N, k_pe_BSR.shape[-1]))], -1)
            q_BTN1H = jnp.concatenate([q_nope_BTNH, q_pe_BTNR], axis=-1)[:, :, :, None]  # H = Hn + R again
            sinks_N1 = None if self.sinks is None else self.sinks[...][:, None]
            o_BTN1U = sow_max_logit(self, attention(q_BTN1H, k_BSNH, v_BSNU, spec_, vis, sinks_KG=sinks_N1, **kwargs),
                                    diagnostics)
            o_BTNU = o_BTN1U[:, :, :, 0]
        o_BTNU = checkpoint_name(constrain(o_BTNU, ("activation_batch", "activation_length", "activation_heads", None)),
                                 "attention_out")
        return self.o_proj("BTNU,NUD->BTD", o_BTNU), cache

    def clip_qk(self, max_logit_LN, tau: float) -> None:
        """QK-clip of a stack of these layers as Kimi K2 does it for MLA, from each layer's max logit
        of each head `[L, N]`: a head's own query and key parts (`q_nope`, `kv_b_proj`'s key half)
        scale by `sqrt(gamma)`, its rotary query part by `gamma`, the rotary key (shared by the
        heads) not at all, so each head's logits scale by its `gamma` (`clip_factors`)."""
        Hn, R, U = self.cfg.mla_nope_dim, self.cfg.mla_rope_dim, self.cfg.mla_v_dim
        gamma_LN1 = clip_factors(max_logit_LN, tau)[..., None]
        root_LN1 = jnp.sqrt(gamma_LN1)
        ones = lambda n: jnp.ones(gamma_LN1.shape[:-1] + (n,), jnp.float32)  # noqa: E731
        q = self.q_b_proj if self.cfg.mla_q_rank else self.q_proj
        scale_heads(q, jnp.concatenate([root_LN1 * ones(Hn), gamma_LN1 * ones(R)], axis=-1))
        scale_heads(self.kv_b_proj, jnp.concatenate([root_LN1 * ones(Hn), ones(U)], axis=-1))
