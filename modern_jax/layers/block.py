"""One transformer block; the norm placement is a field and each reads as its formula.

| placement | per sublayer F                      |
|-----------|-------------------------------------|
| post      | x = Norm(x + F(x))                  |
| pre       | x = x + F(Norm(x))                  |
| sandwich  | x = x + Norm_out(F(Norm_in(x)))     |
| output    | x = x + Norm(F(x))                  |
| deepnorm  | x = Norm(alpha * x + F(x))          |
| parallel  | x = x + Attn(Norm(x)) + FFN(Norm(x)) |

Norm names follow Gemma 2's checkpoints: `input_layernorm` (before attention),
`post_attention_layernorm` (after it), `pre_feedforward_layernorm`,
`post_feedforward_layernorm`.

Attention and the FFN run as the tensor-parallel regions (`sharding.sequence.region`): under
sequence parallelism the norms, residual adds and dropout between them run on the residual
stream's sequence shard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from modern_jax.config import LayerSpec, ModelConfig
from modern_jax.layers.attention import Attention, MLAttention
from modern_jax.layers.ffn import FFN
from modern_jax.layers.linear import module_dropout
from modern_jax.layers.moe import MoE
from modern_jax.layers.norms import Norm
from modern_jax.sharding.sequence import region

# which norms each placement owns: (before attention, after attention, before FFN, after FFN)
NORMS = {
    "pre": (True, False, True, False),
    "post": (False, True, False, True),
    "deepnorm": (False, True, False, True),
    "sandwich": (True, True, True, True),
    "output": (False, True, False, True),
    "parallel": (True, False, False, False),
}


def dropout(x, rate, rng):
    if rate == 0.0 or rng is None:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, rngs: nnx.Rngs):
        self.placement, self.resid_dropout = cfg.norm_placement, cfg.resid_dropout
        self.alpha = (2 * cfg.n_layers) ** 0.25  # DeepNet's residual scale (deepnorm only)
        self.self_attn = (MLAttention if cfg.attention_type == "mla" else Attention)(cfg, spec, rngs=rngs)
        self.mlp = MoE(cfg, rngs=rngs) if spec.moe else FFN(cfg, rngs=rngs)
        attn_in, attn_out, ffn_in, ffn_out = NORMS[cfg.norm_placement]
        if cfg.norm_placement == "parallel" and not cfg.parallel_shared_norm:
            ffn_in = True  # GPT-NeoX: a second norm for the FFN branch
        self.input_layernorm = Norm(cfg, rngs=rngs) if attn_in else None
        self.post_attention_layernorm = Norm(cfg, rngs=rngs) if attn_out else None
        self.pre_feedforward_layernorm = Norm(cfg, rngs=rngs) if ffn_in else None
        self.post_feedforward_layernorm = Norm(cfg, rngs=rngs) if ffn_out else None

    def sublayer(self, x, f, norm_in, norm_out, rng):
        f_dropped = lambda h: dropout(f(h), self.resid_dropout, rng)  # noqa: E731
        match self.placement:
            case "post":
                return norm_out(x + f_dropped(x))
            case "sandwich":
                return x + norm_out(f_dropped(norm_in(x)))
            case "output":
                return x + norm_out(f_dropped(x))
            case "deepnorm":
                return norm_out(self.alpha * x + f_dropped(x))
        raise AssertionError(self.placement)

    @jax.named_scope("block")
    def __call__(self, x_BTD, pos_BT, seg_BT=None, cache=None, rng=None, diagnostics: bool = False):
        rngs = [None] * 4 if rng is None else list(jax.random.split(rng, 4))
        with module_dropout(rngs[3]):  # the dropout of modules a converter adds to the blocks
            return self._forward(x_BTD, pos_BT, seg_BT, cache, rngs, diagnostics)

    def _forward(self, x_BTD, pos_BT, seg_BT, cache, rngs, diagnostics):
        new_cache = cache

        def self_attn(h_BTD):
            nonlocal new_cache
            out_BTD, new_cache = self.self_attn(h_BTD, pos_BT, seg_BT, cache, rngs[0], diagnostics=diagnostics)
            return out_BTD

        attn = lambda h_BTD: region(self_attn, h_BTD)  # noqa: E731
        mlp = lambda h_BTD: region(self.mlp, h_BTD)  # noqa: E731

        if self.placement == "parallel":
            h_attn_BTD = self.input_layernorm(x_BTD)
            h_ffn_BTD = h_attn_BTD if self.pre_feedforward_layernorm is None else self.pre_feedforward_layernorm(x_BTD)
            x_BTD = (x_BTD + dropout(attn(h_attn_BTD), self.resid_dropout, rngs[1])
                     + dropout(mlp(h_ffn_BTD), self.resid_dropout, rngs[2]))
            return x_BTD, new_cache
        if self.placement == "pre":  # the residual add between the sublayers runs fused into the FFN's norm
            a_BTD = dropout(attn(self.input_layernorm(x_BTD)), self.resid_dropout, rngs[1])
            x_BTD, h_BTD = self.pre_feedforward_layernorm.add_norm(a_BTD, x_BTD)  # x + a, Norm(x + a)
            return x_BTD + dropout(mlp(h_BTD), self.resid_dropout, rngs[2]), new_cache
        x_BTD = self.sublayer(x_BTD, attn, self.input_layernorm, self.post_attention_layernorm, rngs[1])
        x_BTD = self.sublayer(x_BTD, mlp, self.pre_feedforward_layernorm, self.post_feedforward_layernorm, rngs[2])
        return x_BTD, new_cache
