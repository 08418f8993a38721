"""Sampling with the KV cache: greedy, temperature, top-k and top-p (nucleus).

    tokens = generate(graphdef, params, prompt_BT, max_new_tokens=100, rng=jax.random.key(0),
                      temperature=0.8, top_k=50, top_p=0.95, eos_id=tok.eos_id)

The prompt is prefilled in one call (once per prompt when rows share it: `decode(group=)`), then
one token per step inside a loop, all in one jit; attention reads the cache only up to its
filled part (`kernels.chunked.attention_decode`), and from `BY_LAYER_FROM` new tokens the model runs
layer by layer (`decoding_model`: each layer's weights sliced out of the stacks once, its cache its
own, so a step copies neither). After a sequence emits `eos_id` it keeps
emitting it (callers cut there); the rows that have stop costing (the batch is compacted as they
finish), and the loop stops once every sequence has. `generate`, GRPO's rollouts and the
harness's generation tasks all sample through `decode`. Prompts of different lengths share a batch right-aligned
(`left_padded`, then `decode(..., length_B=)`, traceable inside any jit): the pads get negative
positions, which no query sees.

A model with learned positions has no row past `max_position_embeddings`: `generate`
refuses a prompt plus `max_new_tokens` longer than that, and `sample_texts` stops there
with a warning. Other models may run past it; `sample_texts` warns that it leaves the
trained context. The program is compiled first and its memory (the KV cache, the tokens
and the step, by XLA's count) checked against what the device has free, so a request too
large is refused with the largest `max_new_tokens` that fits (`accounting.check_fits`)
before anything is allocated.

Self-speculative greedy decoding with a model's multi-token-prediction module (`mtp_decode`,
`generate_mtp`): MTP module 1 drafts the token after next, the main model checks the draft and
its own next token in one call, and the draft is kept only where the main model would have chosen
it, so the tokens are plain greedy decoding's.

Letters as in `modern_jax`: B batch, P prompts (one a group), R the rows of a compacted batch, T prompt or
generated length, V vocabulary.
"""

from __future__ import annotations

import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from modern_jax import execution

from modern_jax.accounting import check_fits


def filter_logits(logits_BV, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
    """Temperature-scaled logits with everything outside the top-k / top-p set at -inf."""
    logits_BV = logits_BV.astype(jnp.float32) / temperature
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if top_p is not None and top_p < 1.0:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass of the tokens ranked above
        kept_BV = before_BV < top_p  # the smallest set whose mass reaches top_p (never empty)
        threshold_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV < threshold_B1, -jnp.inf, logits_BV)
    return logits_BV


def sample_token(logits_BV, rng, *, temperature: float, top_k: int | None, top_p: float | None, rows_B=None,
                 batch: int | None = None):
    """One token a row. `rows_B`: the rows' places in a batch of `batch` rows (a compacted one),
    each row drawing the noise of its place there, so it samples what it would in the whole batch."""
    if temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    filtered_BV = filter_logits(logits_BV, temperature=temperature, top_k=top_k, top_p=top_p)
    if rows_B is None:
        return jax.random.categorical(rng, filtered_BV, axis=-1).astype(jnp.int32)
    noise_BV = jax.random.gumbel(rng, (batch, filtered_BV.shape[-1]), jnp.float32)[rows_B]  # categorical's own draw
    return jnp.argmax(filtered_BV + noise_BV, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p", "eos_id", "run"))
def _generate(graphdef, params, prompt_BT, rng, *, max_new_tokens, temperature, top_k, top_p, eos_id, run):
    with execution.use(run):  # static: another execution is another program
        return decode(nnx.merge(graphdef, params), prompt_BT, rng, max_new_tokens=max_new_tokens,
                      temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id)


BY_LAYER_FROM = 16  # new tokens from which decoding runs layer by layer (`decoding_model`)
COMPACT_FROM = 32  # new tokens from which finished rows are compacted away (shorter: not worth the programs)
COMPACTIONS = 2  # at most: the batch halves at most this many times


def batch_sizes(B: int, max_new_tokens: int) -> list[int]:
    """The batch sizes a decoding with eos runs through: B, then halves while even."""
    sizes = [B]
    while max_new_tokens >= COMPACT_FROM and len(sizes) <= COMPACTIONS and sizes[-1] % 2 == 0:
        sizes.append(sizes[-1] // 2)
    return sizes


def decoding_model(model, max_new_tokens: int):
    """The model as a decoding of `max_new_tokens` runs it: from `BY_LAYER_FROM` new tokens, layer by layer
    (`Transformer.layer_by_layer`: the weights sliced out of the stacks once, so that no step copies them
    out, nor the cache out and back); fewer, as it is, its stacked layers looped over, which compiles one
    layer where layer by layer compiles each (on the 24M Qwen2 of `scripts/bench_grpo.py`, 1.8 s against
    4.4 s; its 24-token rollouts then take 1.00 s against 0.75 s, 8 tokens after 64-token prompts 0.48 s
    against 0.53 s)."""
    return model.layer_by_layer() if max_new_tokens >= BY_LAYER_FROM else model


def decode(model, prompt_BT, rng, *, max_new_tokens: int, temperature: float, top_k: int | None,
           top_p: float | None, eos_id: int | None, length_B=None, group: int = 1):
    """`[B, max_new_tokens]` tokens sampled after each prompt row (traceable: call it inside jit).

    `length_B`: each row's prompt length in a left-padded `prompt_BT` (its last `length` tokens
    are the prompt; the pads before them get negative positions, which no query sees); None:
    every row is a whole prompt. `group`: the rows come in runs of `group` copies of one prompt
    (GRPO's groups): each prompt is prefilled once, and its cache rows are copied to its group's
    rows by index. With `eos_id`, finished rows stop costing: once at most half the batch is live
    (`batch_sizes`), the live rows move into a batch half as large."""
    B, T = prompt_BT.shape
    if group < 1 or B % group:
        raise ValueError(f"group={group} must divide the batch of {B} rows")
    model = decoding_model(model, max_new_tokens)
    sample = partial(sample_token, temperature=temperature, top_k=top_k, top_p=top_p)
    positions = None if length_B is None else (jnp.arange(T, dtype=jnp.int32)[None] - (T - length_B)[:, None])
    cache = model.init_cache(B // group, T + max_new_tokens)
    h_PTD, cache = model.hidden_states(prompt_BT[::group], positions=None if positions is None else positions[::group],
                                       cache=cache)  # once per prompt
    logits_BV = model.logits(h_PTD[:, -1:])[:, 0]  # the last position's only
    if group > 1:
        rows_B = jnp.arange(B) // group
        cache, logits_BV = model.cache_rows(cache, rows_B), logits_BV[rows_B]
    first_B = sample(logits_BV, jax.random.fold_in(rng, 0))
    done_B = jnp.zeros((B,), bool) if eos_id is None else first_B == eos_id

    def step(carry, i, rows_R=None):
        token_R, done_R, cache = carry
        logits_R1V, cache = model(token_R[:, None], cache=cache)
        next_R = sample(logits_R1V[:, 0], jax.random.fold_in(rng, i), rows_B=rows_R, batch=B)
        if eos_id is not None:
            next_R = jnp.where(done_R, eos_id, next_R)
            done_R = done_R | (next_R == eos_id)
        return (next_R, done_R, cache), next_R

    if eos_id is None:
        _, rest_TB = jax.lax.scan(step, (first_B, done_B, cache), jnp.arange(1, max_new_tokens))
        return jnp.concatenate([first_B[:, None], rest_TB.T], axis=1)

    # with eos: the steps stop once every row has emitted it (the tokens left are eos, as they would be)
    def write(carry, compacted: bool):
        i, token_R, done_R, rows_R, cache, out_BN = carry
        (token_R, done_R, cache), next_R = step((token_R, done_R, cache), i, rows_R if compacted else None)
        return i + 1, token_R, done_R, rows_R, cache, out_BN.at[rows_R, i].set(next_R)

    def compact(carry, R: int):  # the live rows first (a stable order), R of them
        i, token_R, done_R, rows_R, cache, out_BN = carry
        keep_R = jnp.argsort(done_R, stable=True)[:R]
        return i, token_R[keep_R], done_R[keep_R], rows_R[keep_R], model.cache_rows(cache, keep_R), out_BN

    out_BN = jnp.full((B, max_new_tokens), eos_id, jnp.int32).at[:, 0].set(first_B)
    carry = (jnp.int32(1), first_B, done_B, jnp.arange(B), cache, out_BN)
    sizes = batch_sizes(B, max_new_tokens)
    for j, R in enumerate(sizes):
        floor = sizes[j + 1] if j + 1 < len(sizes) else 0  # live rows at which this batch size ends

        def more(carry, floor=floor):
            return (carry[0] < max_new_tokens) & (jnp.sum(~carry[2]) > floor)

        carry = jax.lax.while_loop(more, partial(write, compacted=j > 0), compact(carry, R) if j else carry)
    return carry[-1]


def mtp_decode(model, prompt_BT, *, max_new_tokens: int):
    """`(tokens [B, max_new_tokens], accepted [B], steps [B])`: greedy decoding with MTP module 1 as the drafter
    (traceable). Each step feeds the main model `[last, draft]` at positions `[p, p + 1]`: its greedy token
    `g0` after `last` is always emitted, and when `g0` is the draft its token after that, `g1`, is emitted too
    (`accepted`). The caches then go on from the last emitted token (a rejected draft's keys are written over
    by the next step, which starts at its position); MTP module 1 reads the main model's hidden states of
    both positions with the tokens ahead of them, `[g0, g1]`, filling its own cache, and drafts from the row
    of the last emitted token. `steps`: each row's main-model calls after the prefill until it had its tokens."""
    model = decoding_model(model, max_new_tokens)
    B, T = prompt_BT.shape
    N = max_new_tokens
    S = T + 2 * N + 2  # a row that has its tokens still moves (at most 2 a step) until the slowest has
    greedy = lambda h_BTD: jnp.argmax(model.logits(h_BTD), axis=-1).astype(jnp.int32)  # noqa: E731
    h_BTD, cache = model.hidden_states(prompt_BT, cache=model.init_cache(B, S))
    first_B = greedy(h_BTD[:, -1:])[:, 0]
    pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    ahead_BT = jnp.concatenate([prompt_BT[:, 1:], first_B[:, None]], axis=1)  # row i: token i + 1
    (d_BTD,), mtp_cache = model.mtp_states(h_BTD, ahead_BT, pos_BT, caches=model.init_mtp_cache(B, S)[:1],
                                           modules=[1])
    draft_B = greedy(d_BTD[:, -1:])[:, 0]
    out_BN = jnp.zeros((B, N), jnp.int32).at[:, 0].set(first_B)
    zero_B = jnp.zeros((B,), jnp.int32)

    def more(carry):
        return jnp.any(carry[3] < N)

    def step(carry):
        last_B, draft_B, p_B, count_B, out_BN, cache, mtp_cache, accepted_B, steps_B = carry
        pos_B2 = p_B[:, None] + jnp.arange(2, dtype=jnp.int32)[None]
        h_B2D, cache = model.hidden_states(jnp.stack([last_B, draft_B], axis=1), positions=pos_B2, cache=cache)
        g_B2 = greedy(h_B2D)
        accept_B = (g_B2[:, 0] == draft_B).astype(jnp.int32)
        # g0 always, g1 where the draft was right; past N the writes drop
        slot_B2 = count_B[:, None] + jnp.arange(2)[None]
        slot_B2 = jnp.where(jnp.arange(2)[None] <= accept_B[:, None], slot_B2, N)
        out_BN = out_BN.at[jnp.arange(B)[:, None], slot_B2].set(g_B2, mode="drop")
        active_B = (count_B < N).astype(jnp.int32)
        cache = {**cache, "index": p_B + 1 + accept_B}  # after the last emitted token (the steps pass positions)
        (m_B2D,), mtp_cache = model.mtp_states(h_B2D, g_B2, pos_B2, caches=mtp_cache, modules=[1])
        m_B1D = jnp.take_along_axis(m_B2D, accept_B[:, None, None], axis=1)
        return (jnp.where(accept_B == 1, g_B2[:, 1], g_B2[:, 0]), greedy(m_B1D)[:, 0], p_B + 1 + accept_B,
                count_B + 1 + accept_B, out_BN, cache, mtp_cache, accepted_B + accept_B * active_B, steps_B + active_B)

    init = (first_B, draft_B, jnp.full((B,), T, jnp.int32), jnp.ones((B,), jnp.int32), out_BN, cache, mtp_cache,
            zero_B, zero_B)
    *_, out_BN, _, _, accepted_B, steps_B = jax.lax.while_loop(more, step, init)
    return out_BN, accepted_B, steps_B


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "run"))
def _generate_mtp(graphdef, params, prompt_BT, *, max_new_tokens, run):
    with execution.use(run):
        return mtp_decode(nnx.merge(graphdef, params), prompt_BT, max_new_tokens=max_new_tokens)


def generate_mtp(graphdef, params, prompt_BT, *, max_new_tokens: int) -> tuple[np.ndarray, dict]:
    """Greedy tokens `[B, N]` by self-speculative decoding (`mtp_decode`), the same as `generate(...,
    temperature=0)`'s, and `{"accepted", "steps"}`: the drafts kept and the main model's decoding calls, summed
    over the rows (acceptance rate = accepted / steps; tokens per call = (accepted + steps) / steps)."""
    cfg = nnx.merge(graphdef, params).cfg
    prompt_BT = jnp.asarray(prompt_BT, jnp.int32)
    if not cfg.mtp_depth:
        raise ValueError("generate_mtp drafts with the model's multi-token-prediction module, and this model has "
                         "none: set model.mtp_depth (and train it), or use generate")
    if any(spec.span is not None for spec in cfg.layer_specs()):
        raise ValueError("generate_mtp needs every layer to cache all its keys: a rejected draft's key would have "
                         "overwritten a key a sliding-window or chunked layer still sees; use generate")
    if prompt_BT.ndim != 2 or prompt_BT.shape[1] == 0 or max_new_tokens <= 0:
        raise ValueError(f"prompts must be [batch, length >= 1] token ids and max_new_tokens positive, got shape "
                         f"{tuple(prompt_BT.shape)} and {max_new_tokens}")
    room = new_tokens_that_fit(cfg, prompt_BT.shape[1] + max_new_tokens + 2)
    if room is not None and room < max_new_tokens:
        raise ValueError(_past_the_context(cfg, prompt_BT.shape[1], 2 * max_new_tokens + 2))
    tokens, accepted, steps = _generate_mtp(graphdef, params, prompt_BT, max_new_tokens=max_new_tokens,
                                            run=execution.current())
    return np.asarray(tokens), {"accepted": int(np.sum(accepted)), "steps": int(np.sum(steps))}


def left_padded(prompts, width: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`(prompt[B, width], length[B])`: token-id lists right-aligned in rows of `width` (for `decode`)."""
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    if not len(prompts) or lengths.min() < 1 or lengths.max() > width:
        raise ValueError(f"prompts must each hold 1 to {width} tokens, got lengths {sorted(set(lengths.tolist()))}")
    rows = np.full((len(prompts), width), pad_id, np.int32)
    for row, prompt, n in zip(rows, prompts, lengths):
        row[width - n:] = prompt
    return rows, lengths


def generate(graphdef, params, prompt_BT, *, max_new_tokens: int, rng=None, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None) -> np.ndarray:
    """`max_new_tokens` new tokens `[B, N]` after each prompt row (rows share one length)."""
    prompt_BT = jnp.asarray(prompt_BT, jnp.int32)
    if prompt_BT.ndim != 2 or prompt_BT.shape[1] == 0:
        raise ValueError(f"prompts must be [batch, length >= 1] token ids, got shape {tuple(prompt_BT.shape)}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    cfg, T = nnx.merge(graphdef, params).cfg, prompt_BT.shape[1]
    room = new_tokens_that_fit(cfg, T)
    if room is not None and max_new_tokens > room:
        raise ValueError(_past_the_context(cfg, T, max_new_tokens))
    rng = jax.random.key(0) if rng is None else rng

    def compile_at(max_new_tokens: int, rows: int):
        prompt = jax.ShapeDtypeStruct((rows, T), jnp.int32)
        return _generate.lower(graphdef, params, prompt, rng, max_new_tokens=max_new_tokens,
                               temperature=float(temperature), top_k=top_k, top_p=top_p, eos_id=eos_id,
                               run=execution.current()).compile()

    sizes = {"max_new_tokens": max_new_tokens, "rows": prompt_BT.shape[0]}
    compiled = check_fits("generate", compile_at, sizes, resident=params, lower=("max_new_tokens", "rows"))
    return np.asarray(compiled(params, prompt_BT, rng))


def new_tokens_that_fit(cfg, prompt_len: int) -> int | None:
    """How many new tokens a prompt of `prompt_len` leaves room for; None: no hard limit
    (only learned positions stop at `max_position_embeddings`)."""
    if cfg.position_embedding != "learned":
        return None
    return max(cfg.max_position_embeddings - prompt_len, 0)


def _past_the_context(cfg, prompt_len: int, max_new_tokens: int) -> str:
    P, room = cfg.max_position_embeddings, new_tokens_that_fit(cfg, prompt_len)
    fix = f"at most {room} new tokens fit" if room else "the prompt leaves no room: shorten it"
    return (f"max_new_tokens={max_new_tokens} after a prompt of {prompt_len} tokens exceeds "
            f"max_position_embeddings={P} (learned positions have no row past it): {fix}")


def cut_at_eos(tokens_T, eos_id: int | None) -> np.ndarray:
    tokens_T = np.asarray(tokens_T)
    if eos_id is None:
        return tokens_T
    hits = np.flatnonzero(tokens_T == eos_id)
    return tokens_T[: hits[0]] if len(hits) else tokens_T


def sample_texts(graphdef, params, tokenizer, prompt: str = "", *, n: int = 3, max_new_tokens: int = 200,
                 seed: int = 0, temperature: float = 0.8, top_k: int | None = None,
                 top_p: float | None = None) -> list[str]:
    """`n` continuations of `prompt` (from `<bos>` when the prompt is empty), decoded to text.

    With learned positions the continuations stop at `max_position_embeddings` tokens (with
    a warning); other models warn when they generate past it."""
    ids = list(tokenizer.encode(prompt)) if prompt else []
    if tokenizer.bos_id is not None:
        ids = [tokenizer.bos_id] + ids
    if not ids:
        raise ValueError("this tokenizer has no <bos>: give a prompt")
    cfg, T = nnx.merge(graphdef, params).cfg, len(ids)
    room, P = new_tokens_that_fit(cfg, T), cfg.max_position_embeddings
    if room is not None and max_new_tokens > room:
        if not room:
            raise ValueError(_past_the_context(cfg, T, max_new_tokens))
        warnings.warn(f"generation stops at the context of max_position_embeddings={P} tokens (learned "
                      f"positions): {room} new tokens after the {T}-token prompt, not max_new_tokens="
                      f"{max_new_tokens}", stacklevel=2)
        max_new_tokens = room
    elif room is None and T + max_new_tokens > P:
        warnings.warn(f"generating past the trained context: {T} prompt + {max_new_tokens} new tokens exceed "
                      f"max_position_embeddings={P}; quality may degrade there", stacklevel=2)
    prompt_BT = np.tile(np.asarray(ids, np.int32)[None], (n, 1))
    out_BT = generate(graphdef, params, prompt_BT, max_new_tokens=max_new_tokens, rng=jax.random.key(seed),
                      temperature=temperature, top_k=top_k, top_p=top_p, eos_id=tokenizer.eos_id)
    return [prompt + tokenizer.decode(cut_at_eos(row, tokenizer.eos_id)) for row in out_BT]
