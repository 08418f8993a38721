"""Hugging Face tensor names and layouts: a rename table plus reshapes.

No family has layer code, and no family is here (they are in `hf_families.py`): this is
the machinery their tables are written in. Each of our parameters (named by its path
inside the model, or inside one block for stacked layers) maps to Hugging Face tensors
through a `Rule`: a name template and the axes of both sides.

The template's variables index our parameter's leading axes, one axis each, in the order
they appear: `model.layers.{i}.mlp.down_proj.weight` is one tensor per layer of a stacked
`[layers, F, D]` parameter, `model.layers.{i}.mlp.experts.{e}.down_proj.weight` one per
layer and expert of a `[layers, E, F, D]` one, and a tensor holding all the experts of a
layer (`model.layers.{i}.mlp.experts.down_proj`, `E F D`) has only `{i}`. `{i}` is
numbered by the model's layer (a stage's slot k is some layer i); any other variable
counts from 0.

Axis letters (the package legend): V vocab, T positions (a learned table's rows), D model, N
query heads, K kv heads, H head dim (U: MLA's value head dim), F ffn width, E experts, Q MLA's
query latent, C its key / value latent, X the latent with the rotary key (C + R) and W an MTP
module's joined input (2 D). A Hugging Face layout groups axes in parentheses where the tensor
flattens them, e.g. `q_proj.weight` is `(N H) D` (torch's Linear stores [out, in]) and our
kernel is `D N H`. A digit is a fused axis: GPT-2's
`c_attn.weight` is `D (3 N H)`, and q, k and v are its parts 0, 1 and 2; gate and up
interleaved on the last axis (gpt-oss's `gate_up_proj`, `E D (F 2)`) are parts 0 and 1.
"""

from __future__ import annotations

import itertools
import math
import re
import string
from collections.abc import Callable, Sequence
import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Rule:
    hf: str  # the Hugging Face tensor name; its variables ("{i}" layer, "{e}" expert) index our leading axes
    hf_layout: str  # its axes, flattened groups in parentheses
    layout: str  # the axes of our parameter past the indexed ones (of one layer, or one expert)
    part: int | None = None  # which slice along the digit axis of a fused tensor

    def variables(self) -> tuple[str, ...]:
        """The template's variables in order: `model.layers.{i}.mlp.experts.{e}.up_proj.weight` -> (i, e)."""
        return tuple(v for _, v, _, _ in string.Formatter().parse(self.hf) if v is not None)

    def tensors(self, shape: tuple[int, ...], **numbering: Sequence[int]) -> list[tuple[str, tuple[int, ...]]]:
        """The Hugging Face tensors that hold our parameter of `shape`: each one's name and the index
        of the slice it holds (`()`: the whole parameter; the slice's shape is the rest of `shape`).

        The template's variables index the leading axes in order; `numbering[v]` is the number
        each index along `v`'s axis stands for (a stage's layers), given for the leading ones;
        any other variable counts from 0.
        """
        variables = self.variables()
        if len(variables) > len(shape) or tuple(numbering) != variables[:len(numbering)] or any(
                len(numbers) != n for numbers, n in zip(numbering.values(), shape)):
            raise ValueError(f"rule for {self.hf}: cannot index a parameter of shape {shape} by {variables} "
                             f"with its leading axes numbered by {', '.join(numbering) or 'nothing'}")
        axes = [numbering.get(v, range(n)) for v, n in zip(variables, shape)]
        return [(self.hf.format(**{v: axis[k] for v, axis, k in zip(variables, axes, slot)}), slot)
                for slot in itertools.product(*(range(len(axis)) for axis in axes))]

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
        """The Hugging Face tensor's shape for the slice of our parameter of `shape` it holds."""
        groups, _ = self.axes()
        sizes = self.sizes(shape, vocab)
        return tuple(math.prod(sizes[a] for a in g) for g in groups)

    def read(self, index: tuple[slice, ...], shape: tuple[int, ...], vocab: int | None,
             read: Callable[[tuple[slice, ...]], np.ndarray]) -> np.ndarray:
        """Slice `index` (concrete bounds, one per axis) of our parameter's slot of `shape`, from the
        Hugging Face tensor's slices `read(hf_index)` gives: along each flattened group, the rows of its
        outer axis that the slice touches (an inner axis is cut after reading: heads are split, a head's
        dimension never is); of a fused tensor, only the part's rows; past the true vocabulary, zeros."""
        groups, ours = self.axes()
        sizes, flat = self.sizes(shape, vocab), [a for g in groups for a in g]
        want = dict(zip(ours, index))
        if self.part is not None:
            want.update({a: slice(self.part, self.part + 1) for a in flat if a.isdigit()})
        have = {a: slice(min(s.start, sizes[a]), min(s.stop, sizes[a])) for a, s in want.items()}  # V: true rows
        hf_index = tuple(slice(have[g[0]].start * math.prod(sizes[a] for a in g[1:]),
                               have[g[0]].stop * math.prod(sizes[a] for a in g[1:])) for g in groups)
        x = read(hf_index).reshape([len(range(have[a].start, have[a].stop)) if a == g[0] else sizes[a]
                                    for g in groups for a in g])
        x = x[tuple(slice(None) if a in (g[0] for g in groups) else have[a] for a in flat)]
        fused = [flat.index(a) for a in flat if a.isdigit()]
        x = x.transpose(fused + [flat.index(a) for a in ours])
        x = x[0] if self.part is not None else x
        lengths = [s.stop - s.start for s in (want[a] for a in ours)]
        if x.shape != tuple(lengths):  # our vocabulary rows are padded: zeros past the real ones
            x = np.pad(x, [(0, want - have) for have, want in zip(x.shape, lengths)])
        return x

    def to_ours(self, x: np.ndarray, shape: tuple[int, ...], vocab: int | None = None) -> np.ndarray:
        """Our parameter's slot of `shape` from the whole Hugging Face tensor `x`: `read` of it all."""
        return self.read(tuple(slice(0, n) for n in shape), shape, vocab, lambda index: x[index])

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
    # multi-token-prediction modules (`model.MTPLayer`), numbered as layers past the last: their own parameters
    # by the path inside a module (the block's are `layer`'s), and the copies of shared tensors each layer of
    # the checkpoint holds (the copy's template -> the shared tensor's name): skipped on reading, written back
    mtp: dict[str, Rule] = dataclasses.field(default_factory=dict)
    mtp_copies: dict[str, str] = dataclasses.field(default_factory=dict)

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


def latent_attention(prefix: str) -> dict:
    """DeepSeek's multi-head latent attention: the low-rank query (or a full-rank `q_proj`), the
    joint latent and rotary key `kv_a_proj_with_mqa`, and `kv_b_proj` (per head: the key's
    non-rotary part, then the value)."""
    return {
        **linear(f"{prefix}.q_a_proj", "self_attn.q_a_proj", "Q", "D", "D", "Q"),
        **norm(f"{prefix}.q_a_layernorm", "self_attn.q_a_layernorm", "Q"),
        **linear(f"{prefix}.q_b_proj", "self_attn.q_b_proj", "(N H)", "Q", "Q", "N H"),
        **linear(f"{prefix}.q_proj", "self_attn.q_proj", "(N H)", "D", "D", "N H"),
        **linear(f"{prefix}.kv_a_proj_with_mqa", "self_attn.kv_a_proj_with_mqa", "X", "D", "D", "X"),
        **norm(f"{prefix}.kv_a_layernorm", "self_attn.kv_a_layernorm", "C"),
        **linear(f"{prefix}.kv_b_proj", "self_attn.kv_b_proj", "(N H)", "C", "C", "N H"),
        **linear(f"{prefix}.o_proj", "self_attn.o_proj", "D", "(N U)", "N U", "D"),
    }


def gated_mlp(prefix: str, ours: str = "mlp") -> dict:
    """A gated FFN's three torch Linears; `ours`: where it is in a block (a mixture's shared experts)."""
    return {
        **linear(f"{prefix}.gate_proj", f"{ours}.gate_proj", "F", "D", "D", "F"),
        **linear(f"{prefix}.up_proj", f"{ours}.up_proj", "F", "D", "D", "F"),
        **linear(f"{prefix}.down_proj", f"{ours}.down_proj", "D", "F", "F", "D"),
    }


# ----- mixtures of experts ---------------------------------------------------------------

def router(prefix: str) -> dict:
    """A router's torch Linear `[E, D]` (+ bias `[E]`) <-> our `mlp.router.proj`."""
    return linear(prefix, "mlp.router.proj", "E", "D", "D", "E")


def experts(prefix: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> dict:
    """Routed experts saved one torch Linear per expert (`{prefix}.{e}.gate_proj.weight [F, D]`)
    <-> our stacked kernels `[E, D, F]` / `[E, F, D]`: `{e}` indexes the experts axis."""
    return {
        **linear(f"{prefix}.{{e}}.{gate}", "mlp.experts.gate_proj", "F", "D", "D", "F"),
        **linear(f"{prefix}.{{e}}.{up}", "mlp.experts.up_proj", "F", "D", "D", "F"),
        **linear(f"{prefix}.{{e}}.{down}", "mlp.experts.down_proj", "D", "F", "F", "D"),
    }


def fused_experts(prefix: str, gate_up: str) -> dict:
    """Routed experts saved as one `[E, in, out]` tensor per layer and projection, gate and up
    fused on the last axis: `gate_up="(F 2)"` interleaved (gpt-oss: even columns gate), `"(2 F)"`
    in halves (Llama 4: gate first); biases, where the model has them, as `{name}_bias`."""
    rules = {}
    for part, name in enumerate(("gate_proj", "up_proj")):
        rules[f"mlp.experts.{name}.kernel"] = Rule(f"{prefix}.gate_up_proj", f"E D {gate_up}", "E D F", part)
        rules[f"mlp.experts.{name}.bias"] = Rule(f"{prefix}.gate_up_proj_bias", f"E {gate_up}", "E F", part)
    rules["mlp.experts.down_proj.kernel"] = Rule(f"{prefix}.down_proj", "E F D", "E F D")
    rules["mlp.experts.down_proj.bias"] = Rule(f"{prefix}.down_proj_bias", "E D", "E D")
    return rules


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


def top_level(embed: str, final_norm: str, head_prefix: str = "lm_head", head_bias: bool = True) -> dict:
    """The parameters outside the blocks: the token embedding, the final norm and the head."""
    return {"embed_tokens": Rule(f"{embed}.weight", "V D", "V D"), **norm(final_norm, "norm"),
            **head(head_prefix, head_bias)}
