"""Feed-forward layers: plain MLP `W2 act(W1 x)` and gated `W_down(act(W_gate x) * W_up x)`.

Letters (the package legend): B batch, T length, D model, F ffn width; 2 the fused gate and up.
GLU = gated + sigmoid, ReGLU = gated + relu, GEGLU = gated + gelu, SwiGLU = gated + silu,
bilinear = gated + identity.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name
from flax import nnx

from modern_jax.config import ACTIVATIONS, ModelConfig
from modern_jax.layers.linear import Proj
from modern_jax.sharding import constrain


class FFN(nnx.Module):
    """The dense FFN of width `d_ff` (`width`: another width, e.g. a mixture's shared experts)."""

    def __init__(self, cfg: ModelConfig, *, width: int | None = None, rngs: nnx.Rngs):
        D, F, bias = cfg.d_model, cfg.ffn_width if width is None else width, cfg.mlp_bias
        self.act, self.gated, self.fused = ACTIVATIONS[cfg.activation], cfg.ffn_type != "mlp", cfg.fused_gate_up
        if self.fused:  # gate and up as one GEMM
            self.gate_up_proj = Proj(cfg, (D, 2, F), ("embed", None, "mlp"), role="in", bias=bias, rngs=rngs)
        else:
            self.gate_proj = Proj(cfg, (D, F), ("embed", "mlp"), role="in", bias=bias, rngs=rngs) if self.gated else None
            self.up_proj = Proj(cfg, (D, F), ("embed", "mlp"), role="in", bias=bias, rngs=rngs)
        self.down_proj = Proj(cfg, (F, D), ("mlp", "embed"), role="out", bias=bias, rngs=rngs)

    @jax.named_scope("ffn")
    def __call__(self, x_BTD):
        if self.fused:
            # the kernel's [2, F] (gate and up) ride on `...`: an einsum has no letter for a digit
            gate_up_BT2F = self.gate_up_proj("BTD,D...->BT...", x_BTD)
            h_BTF = self.act(gate_up_BT2F[:, :, 0]) * gate_up_BT2F[:, :, 1]
        elif self.gated:
            h_BTF = self.act(self.gate_proj("BTD,DF->BTF", x_BTD)) * self.up_proj("BTD,DF->BTF", x_BTD)
        else:
            h_BTF = self.act(self.up_proj("BTD,DF->BTF", x_BTD))
        h_BTF = checkpoint_name(constrain(h_BTF, ("activation_batch", "activation_length", "activation_mlp")),
                                "mlp_hidden")
        return self.down_proj("BTF,FD->BTD", h_BTF)
