"""The decoder-only `Transformer`: every family in the README's Presets is a config of this class.

Letters: B batch, T length, D model, V vocab, L layers, W an MTP module's joined input (2D).

    h = embed(tokens) [* sqrt(D)] [+ positions]
    for each block: h = Block(h)          (stacked and scanned over depth)
    logits = softcap(head(FinalNorm(h)))

What the layers sow (`nnx.Intermediate`) the stacks capture and reduce through the scan, and
the model sows the result as its own, for the trainer to capture:
- summed over layers: a mixture of experts' `moe_aux_loss` (balance; weighted by
  `train.moe_aux_weight`), `moe_router_z_loss` (`train.moe_router_z_weight`), `moe_dropped`;
- the max over layers: `max_attention_logit`, with `hidden_states(..., diagnostics=True)`,
  measured by every attention layer's kernel (`train.diagnostics`);
- per layer: `moe_load`, the assignments per expert of each MoE layer, `[MoE layers, E]` in
  layer order, and `mtp_moe_load` (`MTP_LOAD`), the MTP modules' `[D, E]` when their blocks are
  mixtures, which the metrics and auxiliary-loss-free balancing read (`expert_loads`); and,
  sown by each stack (and the MTP modules) with diagnostics, `attention_head_logits`
  (`HEAD_LOGITS`), the max attention logit of each head of each of its layers, which QK-clip
  reads (`head_logits`, `clip_qk`).

Layers with identical parameter shapes and static choices (window, RoPE) are stacked
along a `layers` axis and run by `jax.lax.scan`. A per-layer pattern (Gemma's local /
global, Llama 4's NoPE layers) becomes a repeating unit of a few blocks, scanned as many
times as it repeats, so compile time does not grow with depth. How they run, scanned or in a
Python loop and what the backward pass recomputes, is the active `execution` (`scan_layers`,
`remat`), as are the kernels the layers' ops call: the model's config is its architecture only.

A negative position is padding (before a left-padded prompt, `generate.left_padded`): no query
sees a key there, and a cache's next position is the one after its last token's.

Ranges (token ids, learned positions, the cache's length and batch) are checked wherever the
values are known: shapes always, values eagerly. Under jit the values are tracers; wrap the
jitted function in `jax.experimental.checkify` inside `checked()` (or with
`MODERN_JAX_CHECKS=1`) to check them there too (see `checked`).
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
from flax import nnx

from modern_jax import execution
from modern_jax.config import LayerSpec, ModelConfig
from modern_jax.layers.attention import MAX_LOGIT
from modern_jax.layers.block import Block
from modern_jax.layers.linear import Proj, param
from modern_jax.layers.moe import AUX_LOSS, DROPPED, LOAD, ROUTER_Z_LOSS, SCORES, ExpertProj, MoE
from modern_jax.layers.norms import Norm
from modern_jax.layers.positions import sinusoidal
from modern_jax.ops import pipeline, vocab
from modern_jax.sharding import constrain
from modern_jax.sharding.sequence import residual

SUMMED = (AUX_LOSS, ROUTER_Z_LOSS, DROPPED)  # what the layers sow, added up over the layers
MAXED = (MAX_LOGIT,)  # ... and what takes the max over them
HEAD_LOGITS = "attention_head_logits"  # what a stack sows of its layers: each head's max attention logit
MTP_LOAD = "mtp_moe_load"  # what the MTP modules sow when their blocks are mixtures: each one's load [D, E]


def _sown(sown, name: str) -> list:
    """The float32 values sown under `name` in captured intermediates (`nnx.capture`)."""
    return [jnp.asarray(leaf, jnp.float32) for path, v in nnx.to_flat_state(sown)
            if name in map(str, path) for leaf in jax.tree.leaves(v)]


def sown_value(sown, name: str):
    """The reduced value sown under `name` (a sum, or the max for `max_attention_logit`; `moe_load`
    as sown), or None if nothing was."""
    values = _sown(sown, name)
    if not values:
        return None
    if name in MAXED:
        return functools.reduce(jnp.maximum, [jnp.max(x) for x in values])
    if name in SUMMED:
        return sum(jnp.sum(x) for x in values)
    return values[0] if len(values) == 1 else values


def fold_sown(total: dict, more: dict) -> dict:
    """`total` with `more` folded in, name by name: a SUMMED value added, a MAXED one maxed, a name
    `total` lacks taken as it is."""
    return {**total, **{name: value if name not in total else (jnp.maximum if name in MAXED else jnp.add)(
        total[name], value) for name, value in more.items()}}


def aux_loss(sown):
    """The sum of the `moe_aux_loss` values in captured intermediates (`nnx.capture`), or None if none."""
    return sown_value(sown, AUX_LOSS)


def max_attention_logit(sown):
    """The max of the `max_attention_logit` values in captured intermediates, or None if none."""
    return sown_value(sown, MAX_LOGIT)


def head_logits(sown) -> dict:
    """What the stacks and MTP modules sowed with diagnostics (`HEAD_LOGITS`): `{"stages": {stack:
    (block j's max attention logit of each head, [repeats, N]) for each block of its unit}}`, and
    with MTP modules `"mtp": (each module's, [D, N])`."""
    found = {"stages": {}}
    for path, v in nnx.to_flat_state(sown):
        if path[-1] == HEAD_LOGITS:
            if path[0] == "mtp":
                found["mtp"] = v.get_value()[0]
            else:
                found["stages"][path[1]] = v.get_value()[0]
    return found


def expert_loads(sown):
    """`moe_load` `[MoE layers (+ MTP modules), E]`: the model's MoE layers in layer order, then its MTP
    modules' when their blocks are mixtures (what `Transformer.balance_routers` reads), or None."""
    loads = [x for x in (sown_value(sown, LOAD), sown_value(sown, MTP_LOAD)) if x is not None]
    return jnp.concatenate(loads) if loads else None


def plan_stages(specs: tuple[LayerSpec, ...]) -> list[tuple[tuple[LayerSpec, ...], int]]:
    """Split the layers into stacks `(unit, repeats)` that cover the most layers per scan."""
    stages, i = [], 0
    while i < len(specs):
        best_period, best_repeats = 1, 1
        for period in range(1, (len(specs) - i) // 2 + 1):
            unit, repeats = specs[i : i + period], 1
            while specs[i + repeats * period : i + (repeats + 1) * period] == unit:
                repeats += 1
            if repeats >= 2 and period * repeats > best_period * best_repeats:
                best_period, best_repeats = period, repeats
        if best_repeats == 1:  # period 1 may still repeat
            while i + best_repeats < len(specs) and specs[i + best_repeats] == specs[i]:
                best_repeats += 1
        stages.append((specs[i : i + best_period], best_repeats))
        i += best_period * best_repeats
    return stages


def stacked_block(cfg: ModelConfig, spec: LayerSpec, repeats: int, rngs: nnx.Rngs) -> Block:
    """`repeats` blocks with parameters stacked on a leading `layers` axis."""

    @nnx.split_rngs(splits=repeats)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
        return Block(cfg, spec, rngs=rngs)

    return make(rngs)


class Stack(nnx.Module):
    """A unit of `period` blocks repeated `repeats` times, layers `first .. first + period * repeats`.

    Its units run in turn (a scan); when the mesh splits the layers over pipeline stages and there
    is no cache to fill (training, scoring), `ops.pipeline` runs them, microbatches through stages."""

    def __init__(self, cfg: ModelConfig, unit: tuple[LayerSpec, ...], repeats: int, first: int, *,
                 rngs: nnx.Rngs | None = None, blocks: list[Block] | None = None):
        """New stacked blocks from `rngs`, or the given `blocks` (each stacked `repeats` deep)."""
        self.cfg, self.unit, self.repeats, self.first = cfg, unit, repeats, first
        self.blocks = nnx.List(blocks if blocks is not None else [stacked_block(cfg, spec, repeats, rngs)
                                                                  for spec in unit])

    def layer_numbers(self, j: int) -> tuple[int, ...]:
        """The model's layer of each slot along the stacked axis of block `j` of the unit."""
        return tuple(self.first + i * len(self.unit) + j for i in range(self.repeats))

    def one_layer_stacks(self) -> list[Stack]:
        """Each of this stack's layers as a stack of its own (a unit of one block, run once), in layer order,
        its weights sliced out of this stack's (a copy)."""
        stacks = []
        for i in range(self.repeats):
            for j, (spec, block) in enumerate(zip(self.unit, self.blocks)):
                graphdef, state = nnx.split(block)
                layer = nnx.merge(graphdef, jax.tree.map(lambda w: w[i:i + 1], state))
                stacks.append(Stack(self.cfg, (spec,), 1, self.first + i * len(self.unit) + j, blocks=[layer]))
        return stacks

    def init_cache(self, batch: int, max_len: int, dtype):
        caches = []
        for block in self.blocks:
            layer = block.self_attn.init_cache(batch, max_len, dtype)
            caches.append(jax.tree.map(lambda a: jnp.repeat(a[None], self.repeats, axis=0), layer))
        return caches

    def parts(self, rng, diagnostics: bool = False):
        """`(units, zeros, sown)`: `units(x_BTD, pos_BT, seg_BT, states, caches, numbers[,
        round_])` runs the units numbered `numbers` (their weights `states`, one pytree a block of the
        unit, leading axis one a unit; with `round_`, an interleaved pipeline stage's `[rounds, units,
        ...]`, of which round `round_` runs) in turn: `(x, reduced, caches, loads, heads)`, `reduced`
        folded by `fold_sown` from `zeros`, `heads[j]` block j's max attention logit of each head
        `[units, N]` (with `diagnostics`, else None); `sown`, filled while tracing, names what some
        block sowed."""
        period, run = len(self.unit), execution.current()
        graphdefs = [nnx.split(block)[0] for block in self.blocks]
        zero = jnp.zeros((), jnp.float32)  # the identity of both the sum and the max (of |logits|)
        moe = [isinstance(block.mlp, MoE) for block in self.blocks]
        sown_names = set()

        def layer(j):
            def apply(x_BTD, weights, where, cache, rng, pos_BT, seg_BT):
                # the block's weights, or where they are in a larger stack: picked inside the checkpoint,
                # which then keeps the stack (held anyway) and the index, not a copy of the weights
                state = weights if where is None else jax.tree.map(lambda w: w[where], weights)
                block = nnx.merge(graphdefs[j], state)
                x_BTD = checkpoint_name(x_BTD, "layer_input")  # what the offload policies keep on the host
                (x_BTD, cache), sown_j = nnx.capture(block, nnx.Intermediate)(x_BTD, pos_BT, seg_BT, cache, rng,
                                                                              diagnostics=diagnostics)
                reduced = {name: sown_value(sown_j, name) for name in SUMMED + MAXED}
                sown_names.update(name for name, value in reduced.items() if value is not None)
                reduced = {name: zero if value is None else value for name, value in reduced.items()}
                heads = _sown(sown_j, MAX_LOGIT)  # with diagnostics: the attention's max logit of each head, [N]
                return (x_BTD, cache, reduced, (sown_value(sown_j, LOAD), sown_value(sown_j, SCORES)) if moe[j] else None,
                        heads[0] if heads else None)

            if run.remat == "none":  # keeps everything: no checkpoint at all
                return apply
            return jax.checkpoint(apply, policy=execution.REMAT_POLICIES[run.remat], prevent_cse=not run.scan_layers)

        layers = [layer(j) for j in range(period)]

        zeros = {name: zero for name in SUMMED + MAXED}

        def units(x_BTD, pos_BT, seg_BT, states, caches, numbers, round_=None):
            def unit(carry, xs):
                x_BTD, reduced = carry
                states_i, caches_i, i, p = xs
                new_caches, loads, heads = [], [], []
                for j in range(period):
                    rng_j = None if rng is None else jax.random.fold_in(rng, self.first + i * period + j)
                    weights, where = (states_i[j], None) if round_ is None else (states[j], (round_, p))
                    x_BTD, cache_j, reduced_j, load_j, heads_j = layers[j](x_BTD, weights, where, caches_i[j], rng_j,
                                                                           pos_BT, seg_BT)
                    x_BTD = residual(x_BTD)
                    new_caches.append(cache_j)
                    loads.append(load_j)
                    heads.append(heads_j)
                    reduced = fold_sown(reduced, reduced_j)
                return (x_BTD, reduced), (new_caches, loads, heads)

            xs = ([None] * period if round_ is not None else states, caches, numbers, jnp.arange(len(numbers)))
            (x_BTD, reduced), (new_caches, loads, heads) = _loop(unit, (x_BTD, zeros), xs)
            return x_BTD, reduced, new_caches, loads, heads

        return units, zeros, sown_names

    def stage_function(self, units):
        """`stage_fn(x_bTD, rows_b, states_P, first[, round_]) -> (x_bTD, reduced, loads)`, what
        `ops.pipeline` runs: P units of `parts`' `units` (the first numbered `first`) on one
        microbatch, `rows_b` its positions and segment ids."""
        period = len(self.unit)

        def stage_fn(x_bTD, rows_b, states_P, first, round_=None):
            P = jax.tree.leaves(states_P)[0].shape[0 if round_ is None else 1]
            x_bTD, reduced, _, loads, _ = units(x_bTD, *rows_b, states_P, [None] * period, first + jnp.arange(P),
                                                round_)
            return x_bTD, reduced, loads

        return stage_fn

    @jax.named_scope("stack")
    def __call__(self, x_BTD, pos_BT, seg_BT, caches, rng, diagnostics: bool = False):
        """`(x, caches, reduced, loads)`: `reduced` maps each SUMMED / MAXED name some layer sowed to
        its sum / max over the stack's layers; `loads[j]` is `moe_load` of block j of the unit,
        `[repeats, E]`, or None for a dense block."""
        period = len(self.unit)
        states = [nnx.split(block)[1] for block in self.blocks]
        caches = [None] * period if caches is None else caches
        units, zeros, sown_names = self.parts(rng, diagnostics)
        if caches[0] is None and pipeline.pipelined():  # training and scoring: over the pipeline stages
            x_BTD, reduced, loads = pipeline.run(self.stage_function(units), x_BTD, (pos_BT, seg_BT), states, zeros,
                                                 fold_sown, self.whole_batch, loop_count)
            new_caches = [None] * period
        else:
            x_BTD, reduced, new_caches, loads, heads = units(x_BTD, pos_BT, seg_BT, states, list(caches),
                                                             jnp.arange(self.repeats))
            if diagnostics:  # each layer's heads, [repeats, N] a block of the unit (not through a pipeline's stages)
                self.sow(nnx.Intermediate, HEAD_LOGITS, tuple(heads), capture_noop=True)
        if diagnostics:
            sown_names.add(MAX_LOGIT)
        loads = [None if pair is None else pair[0] for pair in loads]
        return x_BTD, new_caches, {name: reduced[name] for name in sown_names}, loads

    def whole_batch(self, reduced, loads, M: int, tokens: int):
        """The batch's values from its `M` microbatches' (`reduced` added up over them, of `tokens`
        in all): the router's z-loss, a mean over the tokens, is their mean; so is a per-sequence
        balance loss; the batch's balance loss `E sum_e f_e P_e` is rebuilt from the summed loads
        and scores of each layer."""
        cfg = self.cfg
        reduced = {**reduced, ROUTER_Z_LOSS: reduced[ROUTER_Z_LOSS] / M}
        if cfg.moe_aux_per_sequence:
            return {**reduced, AUX_LOSS: reduced[AUX_LOSS] / M}
        balance = [cfg.n_experts * jnp.sum(load_NE * scores_NE) / (cfg.experts_per_token * tokens**2)
                   for load_NE, scores_NE in filter(None, loads)]
        return {**reduced, AUX_LOSS: sum(balance, jnp.zeros((), jnp.float32))}


def _loop(body, carry, xs):
    """`jax.lax.scan(body, carry, xs)`, or the same unrolled in Python (`execution.scan_layers`)."""
    if execution.current().scan_layers:
        return jax.lax.scan(body, carry, xs)
    outs = []
    for i in range(len(jax.tree.leaves(xs)[0])):
        carry, out = body(carry, jax.tree.map(lambda a: a[i], xs))
        outs.append(out)
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *outs)


def loop_count(body, carry, n: int):
    """`body(carry, t)` for t in 0 .. n - 1, scanned or unrolled as `_loop`."""
    return _loop(body, carry, jnp.arange(n))


class MTPLayer(nnx.Module):
    """One multi-token-prediction module (DeepSeek-V3 section 2.2), named as DeepSeek-V3's checkpoint names it.

        h'_i = eh_proj [enorm(Emb(t_{i+k})); hnorm(h_i)]      (the embedding first, as the checkpoint's
        h_i  = Block(h'_i)                                    `eh_proj` reads it; the paper writes h first)

    `h_i` entering module k is module k - 1's output (module 1: the main model's final hidden states,
    after its final norm); module k's own output through `head_norm` (DeepSeek-V3's `shared_head.norm`) and
    the model's shared head predicts token i + k + 1. The block is one of the model's kind, that of its last
    layer (dense or a mixture of experts)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, rngs: nnx.Rngs):
        D = cfg.d_model
        self.enorm = Norm(cfg, rngs=rngs)
        self.hnorm = Norm(cfg, rngs=rngs)
        self.eh_proj = Proj(cfg, (2 * D, D), ("mlp", "embed"), role="in", rngs=rngs)  # W = 2D, the two joined
        self.block = Block(cfg, spec, rngs=rngs)
        self.head_norm = Norm(cfg, rngs=rngs) if cfg.has_final_norm else None

    @jax.named_scope("mtp")
    def __call__(self, h_BTD, e_BTD, pos_BT, seg_BT, cache, rng, diagnostics: bool = False):
        """`(h_BTD, cache)`: this module's output (before `head_norm`) from the previous hidden states `h`
        and the embedded tokens `e` k positions ahead."""
        joined_BTW = jnp.concatenate([self.enorm(e_BTD), self.hnorm(h_BTD)], axis=-1)
        x_BTD = residual(self.eh_proj("BTW,WD->BTD", joined_BTW))
        return self.block(x_BTD, pos_BT, seg_BT, cache, rng, diagnostics=diagnostics)


def stacked_mtp(cfg: ModelConfig, rngs: nnx.Rngs) -> MTPLayer:
    """`cfg.mtp_depth` MTP modules with parameters stacked on a leading `layers` axis (module k at k - 1)."""

    @nnx.split_rngs(splits=cfg.mtp_depth)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
        return MTPLayer(cfg, cfg.layer_specs()[-1], rngs=rngs)

    return make(rngs)


class Transformer(nnx.Module):
    """`logits[B, T, V] = model(tokens[B, T])`; with `cache=`, returns `(logits, cache)`.

    V is `cfg.padded_vocab_size` (= vocab_size unless `vocab_pad_to` pads it for tensor
    parallelism; padded entries hold the lowest float32 and are never predicted).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layers: tuple[LayerSpec, ...] | None = None):
        self.cfg = cfg
        D, V, dtype = cfg.d_model, cfg.padded_vocab_size, jnp.dtype(cfg.param_dtype)
        self.embed_tokens = param(rngs, jax.nn.initializers.normal(cfg.init_std), (V, D), ("vocab", "embed"), dtype)
        self.embed_positions = (
            param(rngs, jax.nn.initializers.normal(cfg.init_std), (cfg.max_position_embeddings, D), (None, "embed"), dtype)
            if cfg.position_embedding == "learned" else None
        )
        stages, first = [], 0
        for unit, repeats in plan_stages(cfg.layer_specs() if layers is None else layers):
            stages.append(Stack(cfg, unit, repeats, first, rngs=rngs))
            first += len(unit) * repeats
        self.stages = nnx.List(stages)
        self.norm = Norm(cfg, rngs=rngs) if cfg.has_final_norm else None
        self.lm_head = (
            None if cfg.tie_embeddings
            else Proj(cfg, (D, V), ("embed", "vocab"), role="in", bias=cfg.head_bias, rngs=rngs)
        )
        self.mtp = stacked_mtp(cfg, rngs) if cfg.mtp_depth else None

    # ----- decoding cache ------------------------------------------------------

    def layer_by_layer(self) -> Transformer:
        """This model with each layer a stack of its own (`Stack.one_layer_stacks`), what decoding runs: a
        decoding step then reads each layer's weights and cache where they lie, and writes its token's keys
        into that cache in place, where a loop over stacked layers copies every layer's weights and cache
        out of the stacks and back, each step. The slices are a copy of the blocks' weights, made once (by
        the program that decodes). On a mesh that splits the layers over pipeline stages, the model as it is
        (each stage holds its own layers)."""
        if pipeline.pipelined():
            return self
        model = nnx.merge(*nnx.split(self))  # the same arrays, its own modules
        model.stages = nnx.List([one for stack in self.stages for one in stack.one_layer_stacks()])
        return model

    def init_cache(self, batch: int, max_len: int, dtype=None) -> dict:
        """An empty cache for `batch` sequences of at most `max_len` tokens."""
        cfg = self.cfg
        if cfg.position_embedding == "learned" and max_len > cfg.max_position_embeddings:
            raise ValueError(f"init_cache(max_len={max_len}) exceeds max_position_embeddings="
                             f"{cfg.max_position_embeddings} (learned positions have no row past it): "
                             f"use max_len <= {cfg.max_position_embeddings}")
        dtype = jnp.dtype(dtype or self.cfg.dtype)
        return {"index": jnp.zeros((batch,), jnp.int32),
                "stages": [stack.init_cache(batch, max_len, dtype) for stack in self.stages]}

    @staticmethod
    def cache_rows(cache: dict, rows_R) -> dict:
        """The cache of rows `rows_R` of `cache` (copied by index; a row may be taken several times)."""
        stages = jax.tree.map(lambda a: jnp.take(a, rows_R, axis=1), cache["stages"])  # [repeats, B, S, ...]
        return {"index": cache["index"][rows_R], "stages": stages}

    def cache_length(self, cache: dict) -> int | None:
        """The most tokens `cache` holds: the slots of its global layers (and of any ring shorter
        than its window or chunk); None when every layer is a full ring (a `sliding_window` or an
        `attention_chunk_size` one), which wraps."""
        lengths = [layer["pos"].shape[2]  # [repeats, B, S]
                   for stack, stage_cache in zip(self.stages, cache["stages"])
                   for spec, layer in zip(stack.unit, stage_cache)
                   if spec.span is None or layer["pos"].shape[2] < spec.span]
        return min(lengths) if lengths else None

    def _check_cache(self, cache: dict, B: int, T: int) -> None:
        """The batch and, statically or wherever the index is known, the length of `cache`."""
        cache_B = cache["index"].shape[0]
        if cache_B != B:
            raise ValueError(f"the cache was made for batch {cache_B}, the tokens have batch {B}: "
                             f"make it with init_cache({B}, max_len)")
        S = self.cache_length(cache)
        if S is None:
            return
        if T > S:
            raise ValueError(f"{T} tokens do not fit a cache of max_len={S}: make it with "
                             f"init_cache(batch, max_len >= {T})")
        _check_range(cache["index"] + T, 0, S + 1,
                     f"decoding past the cache: the tokens would end at lengths [{{}}, {{}}], the cache "
                     f"holds max_len={S} (global layers would overwrite their oldest keys): make it "
                     f"with a larger init_cache(batch, max_len)")

    # ----- forward -------------------------------------------------------------

    def hidden_states(self, tokens_BT, *, positions=None, segment_ids=None, cache=None, dropout_rng=None,
                      diagnostics: bool = False):
        """The final hidden states [B, T, D] (after the final norm), and the updated cache.

        `diagnostics` (static): also sow `max_attention_logit`, the max |q.k| * scale over every
        layer's visible pairs, measured by the attention kernels during this same pass.
        """
        x_BTD, pos_BT = self.enter(tokens_BT, positions=positions, segment_ids=segment_ids, cache=cache)
        x_BTD, new_stage_caches, reduced, loads = self.through(x_BTD, pos_BT, segment_ids, cache, dropout_rng,
                                                               diagnostics)
        for name, value in reduced.items():
            self.sow(nnx.Intermediate, name, value, capture_noop=True)  # read only when captured
        if self.moe_layers():
            self.sow(nnx.Intermediate, LOAD, self.layer_loads(loads), capture_noop=True)
        new_cache = None if cache is None else {"index": pos_BT[:, -1] + 1, "stages": new_stage_caches}
        return self.finish(x_BTD), new_cache

    def enter(self, tokens_BT, *, positions=None, segment_ids=None, cache=None):
        """`(x_BTD, pos_BT)`: the tokens embedded (the first stack's input) and their positions."""
        cfg = self.cfg
        tokens_BT = _check_tokens(tokens_BT, cfg.vocab_size)
        B, T = tokens_BT.shape
        if T == 0:
            raise ValueError("tokens have length 0: give at least one token")
        if cache is not None and segment_ids is not None:
            raise ValueError("segment_ids are for packed training sequences; decoding with a cache takes none")
        if cache is not None:
            self._check_cache(cache, B, T)
        P = cfg.max_position_embeddings
        if cfg.position_embedding == "learned" and cache is None and positions is None and T > P:
            raise ValueError(f"{T} tokens exceed max_position_embeddings={P} (learned positions have no row "
                             f"past it): give at most {P} tokens")  # static: the positions are 0 .. T - 1
        if positions is None:
            start_B = jnp.zeros((B,), jnp.int32) if cache is None else cache["index"]
            positions = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        elif positions.shape != (B, T):
            raise ValueError(f"positions must have the tokens' shape {(B, T)}, got {positions.shape}")
        pos_BT = positions.astype(jnp.int32)
        if cfg.position_embedding == "learned":  # (a negative position, padding, reads row 0)
            _check_range(jnp.maximum(pos_BT, 0), 0, P, f"positions must lie below max_position_embeddings={P} "
                                                       f"(learned positions have no row past it); got values in "
                                                       f"[{{}}, {{}}]: shorten the sequence")

        x_BTD = self.embed(tokens_BT)
        if cfg.position_embedding == "learned":
            x_BTD = x_BTD + self.embed_positions[...].astype(cfg.dtype)[jnp.maximum(pos_BT, 0)]
        elif cfg.position_embedding == "sinusoidal":
            x_BTD = x_BTD + sinusoidal(pos_BT, cfg.d_model, cfg.dtype)
        return residual(x_BTD), pos_BT

    def embed(self, tokens_BT):
        """The tokens' embeddings [B, T, D] (scaled where the model scales them), without positions."""
        cfg = self.cfg
        x_BTD = vocab.lookup(self.embed_tokens[...].astype(cfg.dtype), tokens_BT)
        return x_BTD * jnp.asarray(cfg.d_model**0.5, cfg.dtype) if cfg.embed_scale else x_BTD

    def mtp_states(self, h_BTD, tokens_BT, pos_BT, seg_BT=None, caches=None, dropout_rng=None, modules=None,
                   diagnostics: bool = False):
        """`(hidden states, caches)` of the MTP modules numbered `modules` (default all: 1 .. D), run in
        turn: module k's `[B, T, D]` after its `head_norm`, row i read from `h` (module 1: the main model's
        `hidden_states` at row i) and `tokens[i + k]`; its head's logits predict token i + k + 1. The
        tokens wrap around at the end (rows past T - k are not meaningful: a loss weights them 0).
        Their blocks sow as the stacks' do: the losses of a mixture into the model's, its loads as
        `MTP_LOAD`, and with `diagnostics` each head's max attention logit (`HEAD_LOGITS`, on `mtp`).

        With `caches` (one per module, each a block's `init_cache`), row i is position `pos[i]` of a
        decode: `tokens` then already hold each row's token ahead (no shift), and one module runs."""
        graphdef, state = nnx.split(self.mtp)
        modules = range(1, self.cfg.mtp_depth + 1) if modules is None else modules
        outs, new_caches, loads, heads = [], [], [], []
        for k in modules:
            layer = nnx.merge(graphdef, jax.tree.map(lambda w: w[k - 1], state))
            e_BTD = self.embed(tokens_BT if caches is not None else jnp.roll(tokens_BT, -k, axis=1))
            rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, self.cfg.n_layers + k - 1)
            cache = None if caches is None else caches[k - 1]
            (h_BTD, cache), sown = nnx.capture(layer, nnx.Intermediate)(h_BTD, e_BTD, pos_BT, seg_BT, cache, rng,
                                                                        diagnostics)
            for name in SUMMED + MAXED:  # a mixture's balance and z-losses join the model's
                value = sown_value(sown, name)
                if value is not None:
                    self.sow(nnx.Intermediate, name, value, capture_noop=True)
            loads.append(sown_value(sown, LOAD))
            heads.append(_sown(sown, MAX_LOGIT))
            outs.append(h_BTD if layer.head_norm is None else layer.head_norm(h_BTD))
            new_caches.append(cache)
        if loads[0] is not None:  # a mixture's loads, for the metrics and balancing (`expert_loads`)
            self.sow(nnx.Intermediate, MTP_LOAD, jnp.stack(loads), capture_noop=True)
        if diagnostics:  # each module's heads, for QK-clip (`head_logits`)
            self.mtp.sow(nnx.Intermediate, HEAD_LOGITS, (jnp.stack([h[0] for h in heads]),), capture_noop=True)
        return outs, new_caches

    def init_mtp_cache(self, batch: int, max_len: int, dtype=None) -> list:
        """An empty cache of each MTP module's block."""
        dtype = jnp.dtype(dtype or self.cfg.dtype)
        graphdef, state = nnx.split(self.mtp)
        layer = nnx.merge(graphdef, jax.tree.map(lambda w: w[0], state))
        return [layer.block.self_attn.init_cache(batch, max_len, dtype) for _ in range(self.cfg.mtp_depth)]

    def through(self, x_BTD, pos_BT, segment_ids, cache, dropout_rng, diagnostics: bool, stacks=None):
        """The stacks numbered `stacks` (default all) in turn: `(x_BTD, their caches, reduced, loads)`,
        `reduced` each sown SUMMED / MAXED name's sum / max over their layers, `loads[s]` stack s's."""
        new_stage_caches, reduced, loads = [], {}, []
        for s in range(len(self.stages)) if stacks is None else stacks:
            x_BTD, stage_cache, reduced_s, loads_s = self.stages[s](x_BTD, pos_BT, segment_ids,
                                                                    None if cache is None else cache["stages"][s],
                                                                    dropout_rng, diagnostics)
            new_stage_caches.append(stage_cache)
            loads.append(loads_s)
            reduced = fold_sown(reduced, reduced_s)
        return x_BTD, new_stage_caches, reduced, loads

    def finish(self, x_BTD):
        """The last stack's output through the final norm: the hidden states the head reads."""
        return x_BTD if self.norm is None else self.norm(x_BTD)

    def layer_loads(self, loads):
        """`moe_load` `[MoE layers, E]` in layer order, from `through`'s loads of every stack."""
        return jnp.stack([loads[s][j][i] for _, s, i, j in self.moe_layers()])

    def moe_layers(self) -> list[tuple[int, int, int, int]]:
        """`(layer, stack, repeat, block)` of every mixture-of-experts layer, in layer order."""
        found = [(stack.first + i * len(stack.unit) + j, s, i, j)
                 for s, stack in enumerate(self.stages) for j, block in enumerate(stack.blocks)
                 if isinstance(block.mlp, MoE) for i in range(stack.repeats)]
        return sorted(found)

    def balance_routers(self, loads_LE, rate: float) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3): each MoE layer's selection bias moves by
        `rate * sign(mean load - load_e)` (towards the under-loaded experts), then is re-centred
        at zero. `loads_LE`: the `moe_load` rows, in `moe_layers()` order, then the MTP modules'
        (`expert_loads`)."""
        biases = [(self.stages[s].blocks[j].mlp.router.selection_bias, i) for _, s, i, j in self.moe_layers()]
        if self.mtp is not None and isinstance(self.mtp.block.mlp, MoE):
            biases += [(self.mtp.block.mlp.router.selection_bias, k) for k in range(self.cfg.mtp_depth)]
        for n, (bias, i) in enumerate(biases):
            load_E = loads_LE[n].astype(jnp.float32)
            new_E = bias[...][i] + rate * jnp.sign(jnp.mean(load_E) - load_E)
            bias[...] = bias[...].at[i].set(new_E - jnp.mean(new_E))

    def clip_qk(self, logits: dict[int, tuple], tau: float) -> None:
        """QK-clip (Kimi K2's MuonClip): each head whose max attention logit exceeded `tau` has its
        query and key weights scaled so that its logits scale by `tau / max logit` (each attention
        layer's `clip_qk`). `logits`: the stacks' and MTP modules' `HEAD_LOGITS` (`head_logits`)."""
        for s, per_block in logits["stages"].items():
            for block, logits_LN in zip(self.stages[s].blocks, per_block):
                block.self_attn.clip_qk(logits_LN, tau)
        if "mtp" in logits:  # the modules' blocks, stacked as a stack's layers are
            self.mtp.block.self_attn.clip_qk(logits["mtp"][0], tau)

    def head(self) -> vocab.Head:
        """The output head over this model's parameters: `embed_tokens` when tied, else `lm_head`."""
        cfg = self.cfg
        if self.lm_head is None:
            return vocab.Head(self.embed_tokens[...], None, cfg.final_softcap, cfg.vocab_size)
        bias_V = None if self.lm_head.bias is None else self.lm_head.bias[...]
        return vocab.Head(self.lm_head.kernel[...].T, bias_V, cfg.final_softcap, cfg.vocab_size)

    def logits(self, x_BTD):
        """Output logits [B, T, V] in float32 from hidden states (padding rows masked)."""
        return constrain(self.head().logits(x_BTD), ("activation_batch", "activation_length", "activation_vocab"))

    def __call__(self, tokens_BT, *, positions=None, segment_ids=None, cache=None, dropout_rng=None):
        x_BTD, new_cache = self.hidden_states(tokens_BT, positions=positions, segment_ids=segment_ids, cache=cache,
                                              dropout_rng=dropout_rng)
        logits_BTV = self.logits(x_BTD)
        return logits_BTV if cache is None else (logits_BTV, new_cache)


class Resumed:
    """`model` with its stacks already run, to `x_BTD` (the last stack's output, by a pipeline schedule
    that holds the loss inside its loop): what an objective reads of a model, `hidden_states` (the
    final norm of `x_BTD`, the tokens' own) and `head`."""

    def __init__(self, model: Transformer, x_BTD):
        self.model, self.x_BTD = model, x_BTD

    def hidden_states(self, tokens_BT, **_):
        if tuple(tokens_BT.shape) != tuple(self.x_BTD.shape[:2]):
            raise ValueError(f"the tokens {tuple(tokens_BT.shape)} are not those of the stacks' output "
                             f"{tuple(self.x_BTD.shape[:2])}")
        return self.model.finish(self.x_BTD), None

    def head(self) -> vocab.Head:
        return self.model.head()


_CHECKS = os.environ.get("MODERN_JAX_CHECKS", "") == "1"


def abstract_model(cfg: ModelConfig, layers: tuple[LayerSpec, ...] | None = None) -> Transformer:
    """The model with every parameter a ShapeDtypeStruct (no memory, no initialisation): what
    counts, sharding plans, checkpoint readers and converters read."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), layers=layers))


def abstract_params(cfg: ModelConfig, layers: tuple[LayerSpec, ...] | None = None):
    """`(graphdef, parameters as ShapeDtypeStructs)` of `abstract_model(cfg, layers)`."""
    return nnx.split(abstract_model(cfg, layers), nnx.Param)


PROJECTIONS = (Proj, ExpertProj)  # the weights a block applies by einsum or by the experts' matmul


def projections(model: Transformer):
    """`(name inside its block, module, stack, block index)` of every projection in the blocks."""
    for s, stack in enumerate(model.stages):
        for j, block in enumerate(stack.blocks):
            for path, module in nnx.iter_graph(block):
                if isinstance(module, PROJECTIONS):
                    yield ".".join(map(str, path)), module, s, j


@contextlib.contextmanager
def checked():
    """Check value ranges under jit too: token ids, learned positions, the cache's length.

    Eagerly they are always checked (ValueError). Traced values become `checkify.check`s
    while this is on (or with `MODERN_JAX_CHECKS=1`), so the function must be traced inside
    it and wrapped in `checkify.checkify`:

        graphdef, state = nnx.split(model)
        forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
        with modern_jax.model.checked():
            err, logits = checkify.checkify(forward)(state, tokens)
        err.throw()  # a JaxRuntimeError naming the range, e.g. vocab_size

    The switch is read while tracing: a function jitted before it was turned on keeps its
    unchecked trace. With checks on, a jitted call outside `checkify.checkify` fails to trace.
    """
    global _CHECKS
    before, _CHECKS = _CHECKS, True
    try:
        yield
    finally:
        _CHECKS = before


def _check_range(x, low: int, high: int, message: str) -> None:
    """Values of `x` must lie in [low, high); `message` has two `{}` for their min and max.

    Concrete values raise a ValueError; traced ones add a `checkify.check` when checks are on."""
    if isinstance(x, jax.core.Tracer):
        if _CHECKS:
            checkify.check(jnp.all((x >= low) & (x < high)), message, jnp.min(x), jnp.max(x))
        return
    host = np.asarray(jax.device_get(x))
    if host.size and (int(host.min()) < low or int(host.max()) >= high):
        raise ValueError(message.format(int(host.min()), int(host.max())))


def _check_tokens(tokens_BT, vocab_size: int):
    """Shape and dtype always; the id range eagerly, and under jit inside `checked()`."""
    tokens_BT = jnp.asarray(tokens_BT)
    if tokens_BT.ndim != 2 or not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
        raise ValueError(f"tokens must be integers of shape [batch, length], got {tokens_BT.dtype}{list(tokens_BT.shape)}")
    _check_range(tokens_BT, 0, vocab_size, f"token ids must lie in [0, vocab_size={vocab_size}); got values in [{{}}, {{}}]")
    return tokens_BT
