"""Hugging Face tensor names and layouts, family by family: a rename table plus reshapes.

No family has layer code here. Each of our parameters (named by its path inside the
model, or inside one block for stacked layers) maps to one Hugging Face tensor through a
`Rule`: the tensor's name (`{i}` is the layer index) and the axes of both sides.

Axis letters: V vocab, P positions, D model, N query heads, K kv heads, H head dim,
F ffn width, X any single axis. A Hugging Face layout groups axes in parentheses where
the tensor flattens them, e.g. `q_proj.weight` is `(N H) D` (torch's Linear stores
[out, in]) and our kernel is `D N H`. A digit is a fused axis: GPT-2's `c_attn.weight` is
`D (3 N H)`, and q, k and v are its parts 0, 1 and 2.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Rule:
    hf: str  # the Hugging Face tensor name; "{i}" is the layer index
    hf_layout: str  # its axes, flattened groups in parentheses
    layout: str  # the axes of our parameter (of one layer)
    part: int | None = None  # which slice along the digit axis of a fused tensor

    def axes(self) -> tuple[list[list[str]], list[str]]:
        """`(N H) D` -> ([[N, H], [D]], our axes)."""
        groups = [(inner or single).split() for inner, single in re.findall(r"\(([^)]*)\)|(\S+)", self.hf_layout)]
        return groups, self.layout.split()

    def sizes(self, shape: tuple[int, ...], vocab: int | None = None) -> dict[str, int]:
        """Axis sizes on the Hugging Face side; `vocab`: the true vocabulary when ours is padded."""
        groups, ours = self.axes()
        if len(ours) != len(shape):
            raise ValueError(f"rule for {self.hf}: layout {self.layout!r} does not fit a parameter of shape {shape}")
        sizes = dict(zip(ours, shape))
        sizes.update({a: int(a) for g in groups for a in g if a.isdigit()})
        if vocab is not None and "V" in sizes:
            sizes["V"] = vocab
        return sizes

    def hf_shape(self, shape: tuple[int, ...], vocab: int | None = None) -> tuple[int, ...]:
        """The Hugging Face tensor's shape for our parameter (of one layer) of `shape`."""
        groups, _ = self.axes()
        sizes = self.sizes(shape, vocab)
        return tuple(math.prod(sizes[a] for a in g) for g in groups)

    def to_ours(self, x: np.ndarray, shape: tuple[int, ...], vocab: int | None = None) -> np.ndarray:
        groups, ours = self.axes()
        sizes, flat = self.sizes(shape, vocab), [a for g in groups for a in g]
        x = x.reshape([sizes[a] for a in flat])
        fused = [flat.index(a) for a in flat if a.isdigit()]
        x = x.transpose(fused + [flat.index(a) for a in ours])
        x = x[self.part] if self.part is not None else x
        if x.shape != tuple(shape):  # our vocabulary rows are padded: zeros past the real ones
            x = np.pad(x, [(0, want - have) for have, want in zip(x.shape, shape)])
        return x

    def to_hf(self, parts: list[np.ndarray], vocab: int | None = None) -> np.ndarray:
        """The Hugging Face tensor from our parameter, or from the parts of a fused tensor in order."""
        groups, ours = self.axes()
        flat = [a for g in groups for a in g]
        if vocab is not None and "V" in ours:  # drop the padding rows
            parts = [p[(slice(None),) * ours.index("V") + (slice(0, vocab),)] for p in parts]
        x = np.stack(parts) if self.part is not None else parts[0]
        src = ([a for a in flat if a.isdigit()] if self.part is not None else []) + ours
        sizes = self.sizes(parts[0].shape)
        x = x.transpose([src.index(a) for a in flat])
        return x.reshape([math.prod(sizes[a] for a in g) for g in groups])


@dataclass(frozen=True)
class WeightTable:
    """One family's names: `top` keyed by our parameter path, `layer` by the path inside a block."""

    top: dict[str, Rule]
    layer: dict[str, Rule]
    aliases: tuple[tuple[str, str], ...] = ()  # regex rewrites of checkpoint names into the table's names
    ignore: tuple[str, ...] = ()  # regexes of checkpoint tensors that are buffers, not parameters

    def canonical(self, name: str) -> str:
        for pattern, replacement in self.aliases:
            name = re.sub(pattern, replacement, name)
        return name

    def ignored(self, name: str) -> bool:
        return any(re.search(pattern, name) for pattern in self.ignore)


# ----- building blocks -----------------------------------------------------------------

def linear(prefix: str, ours: str, hf_out: str, hf_in: str, our_in: str, our_out: str, bias=True) -> dict:
    """A torch Linear `[out, in]` (+ bias `[out]`) <-> our kernel `[in..., out...]` (+ bias `[out...]`)."""
    rules = {f"{ours}.kernel": Rule(f"{prefix}.weight", f"{hf_out} {hf_in}", f"{our_in} {our_out}")}
    if bias:
        rules[f"{ours}.bias"] = Rule(f"{prefix}.bias", hf_out, our_out)
    return rules


def norm(prefix: str, ours: str, layout: str = "D") -> dict:
    """A norm's scale (and bias, where the model has one); `layout` may flatten heads: `(N H)`."""
    ours_layout = layout.replace("(", "").replace(")", "")
    return {f"{ours}.weight": Rule(f"{prefix}.weight", layout, ours_layout),
            f"{ours}.bias": Rule(f"{prefix}.bias", layout, ours_layout)}


def attention(prefix: str, o_name: str = "o_proj") -> dict:
    return {
        **linear(f"{prefix}.q_proj", "self_attn.q_proj", "(N H)", "D", "D", "N H"),
        **linear(f"{prefix}.k_proj", "self_attn.k_proj", "(K H)", "D", "D", "K H"),
        **linear(f"{prefix}.v_proj", "self_attn.v_proj", "(K H)", "D", "D", "K H"),
        **linear(f"{prefix}.{o_name}", "self_attn.o_proj", "D", "(N H)", "N H", "D"),
    }


def gated_mlp(prefix: str) -> dict:
    return {
        **linear(f"{prefix}.gate_proj", "mlp.gate_proj", "F", "D", "D", "F"),
        **linear(f"{prefix}.up_proj", "mlp.up_proj", "F", "D", "D", "F"),
        **linear(f"{prefix}.down_proj", "mlp.down_proj", "D", "F", "F", "D"),
    }


def mlp(prefix: str, fc_in: str, fc_out: str) -> dict:
    return {
        **linear(f"{prefix}.{fc_in}", "mlp.up_proj", "F", "D", "D", "F"),
        **linear(f"{prefix}.{fc_out}", "mlp.down_proj", "D", "F", "F", "D"),
    }


def fused_qkv(prefix: str, hf_layout: str, bias_layout: str) -> dict:
    rules = {}
    for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
        rules[f"self_attn.{name}.kernel"] = Rule(f"{prefix}.weight", hf_layout, "D N H", part)
        rules[f"self_attn.{name}.bias"] = Rule(f"{prefix}.bias", bias_layout, "N H", part)
    return rules


def head(prefix: str = "lm_head", bias: bool = True) -> dict:
    rules = {"lm_head.kernel": Rule(f"{prefix}.weight", "V D", "D V")}
    if bias:
        rules["lm_head.bias"] = Rule(f"{prefix}.bias", "V", "V")
    return rules


# ----- the families ----------------------------------------------------------------------

L = "model.layers.{i}"
ROTARY_BUFFERS = (r"\.rotary_emb\.inv_freq$",)

LLAMA = WeightTable(
    top={
        "embed_tokens": Rule("model.embed_tokens.weight", "V D", "V D"),
        **norm("model.norm", "norm"),
        **head(bias=False),
    },
    layer={
        **norm(f"{L}.input_layernorm", "input_layernorm"),
        **norm(f"{L}.post_attention_layernorm", "pre_feedforward_layernorm"),  # by role: the FFN's input norm
        **attention(f"{L}.self_attn"),
        **norm(f"{L}.self_attn.q_norm", "self_attn.q_norm", "H"),
        **norm(f"{L}.self_attn.k_norm", "self_attn.k_norm", "H"),
        **gated_mlp(f"{L}.mlp"),
    },
    ignore=ROTARY_BUFFERS,
)

GEMMA = WeightTable(
    top=LLAMA.top,
    layer={
        **LLAMA.layer,
        **norm(f"{L}.post_attention_layernorm", "post_attention_layernorm"),
        **norm(f"{L}.pre_feedforward_layernorm", "pre_feedforward_layernorm"),
        **norm(f"{L}.post_feedforward_layernorm", "post_feedforward_layernorm"),
    },
    ignore=ROTARY_BUFFERS,
)

# a multimodal Gemma 3 checkpoint: the text model under another prefix, a vision tower to skip
GEMMA3_MULTIMODAL = WeightTable(
    top=GEMMA.top,
    layer=GEMMA.layer,
    aliases=((r"^language_model\.model\.", "model."), (r"^model\.language_model\.", "model."),
             (r"^language_model\.lm_head\.", "lm_head.")),
    ignore=ROTARY_BUFFERS + (r"^(model\.)?(vision_tower|multi_modal_projector)\.",),
)

OLMO2 = WeightTable(
    top=LLAMA.top,
    layer={
        **{k: v for k, v in LLAMA.layer.items() if "layernorm" not in k},
        **norm(f"{L}.post_attention_layernorm", "post_attention_layernorm"),
        **norm(f"{L}.post_feedforward_layernorm", "post_feedforward_layernorm"),
        **norm(f"{L}.self_attn.q_norm", "self_attn.q_norm", "(N H)"),
        **norm(f"{L}.self_attn.k_norm", "self_attn.k_norm", "(K H)"),
    },
    ignore=ROTARY_BUFFERS,
)

T = "transformer.h.{i}"
GPT2 = WeightTable(
    top={
        "embed_tokens": Rule("transformer.wte.weight", "V D", "V D"),
        "embed_positions": Rule("transformer.wpe.weight", "P D", "P D"),
        **norm("transformer.ln_f", "norm"),
        **head(bias=False),
    },
    layer={
        **norm(f"{T}.ln_1", "input_layernorm"),
        **norm(f"{T}.ln_2", "pre_feedforward_layernorm"),
        **fused_qkv(f"{T}.attn.c_attn", "D (3 N H)", "(3 N H)"),  # Conv1D: [in, out]
        "self_attn.o_proj.kernel": Rule(f"{T}.attn.c_proj.weight", "(N H) D", "N H D"),
        "self_attn.o_proj.bias": Rule(f"{T}.attn.c_proj.bias", "D", "D"),
        "mlp.up_proj.kernel": Rule(f"{T}.mlp.c_fc.weight", "D F", "D F"),
        "mlp.up_proj.bias": Rule(f"{T}.mlp.c_fc.bias", "F", "F"),
        "mlp.down_proj.kernel": Rule(f"{T}.mlp.c_proj.weight", "F D", "F D"),
        "mlp.down_proj.bias": Rule(f"{T}.mlp.c_proj.bias", "D", "D"),
    },
    aliases=((r"^(h\.\d+\.|wte\.|wpe\.|ln_f\.)", r"transformer.\1"),),  # the hub's gpt2 has no prefix
    ignore=(r"\.attn\.(masked_)?bias$",),  # causal-mask buffers of old checkpoints
)

X = "gpt_neox.layers.{i}"
GPT_NEOX = WeightTable(
    top={
        "embed_tokens": Rule("gpt_neox.embed_in.weight", "V D", "V D"),
        **norm("gpt_neox.final_layer_norm", "norm"),
        **head("embed_out", bias=False),
    },
    layer={
        **norm(f"{X}.input_layernorm", "input_layernorm"),
        **norm(f"{X}.post_attention_layernorm", "pre_feedforward_layernorm"),  # by role: the FFN's input norm
        **fused_qkv(f"{X}.attention.query_key_value", "(N 3 H) D", "(N 3 H)"),  # per head: q, k, v
        **linear(f"{X}.attention.dense", "self_attn.o_proj", "D", "(N H)", "N H", "D"),
        **mlp(f"{X}.mlp", "dense_h_to_4h", "dense_4h_to_h"),
    },
    ignore=(r"\.attention\.(masked_)?bias$", r"\.rotary_emb\.inv_freq$"),
)

GPTJ = WeightTable(
    top={
        "embed_tokens": Rule("transformer.wte.weight", "V D", "V D"),
        **norm("transformer.ln_f", "norm"),
        **head(),
    },
    layer={
        **norm(f"{T}.ln_1", "input_layernorm"),
        **attention(f"{T}.attn", o_name="out_proj"),
        **mlp(f"{T}.mlp", "fc_in", "fc_out"),
    },
    ignore=(r"\.attn\.(masked_)?bias$",),
)

PHI = WeightTable(
    top={
        "embed_tokens": Rule("model.embed_tokens.weight", "V D", "V D"),
        **norm("model.final_layernorm", "norm"),
        **head(),
    },
    layer={
        **norm(f"{L}.input_layernorm", "input_layernorm"),
        **attention(f"{L}.self_attn", o_name="dense"),
        **norm(f"{L}.self_attn.q_layernorm", "self_attn.q_norm", "H"),
        **norm(f"{L}.self_attn.k_layernorm", "self_attn.k_norm", "H"),
        **mlp(f"{L}.mlp", "fc1", "fc2"),
    },
    ignore=ROTARY_BUFFERS,
)

TABLES = {
    "llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA, "gemma2": GEMMA, "gemma3_text": GEMMA,
    "gemma3": GEMMA3_MULTIMODAL, "olmo2": OLMO2, "gpt2": GPT2, "gpt_neox": GPT_NEOX, "gptj": GPTJ, "phi": PHI,
}
