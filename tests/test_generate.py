"""Sampling: greedy decoding with the cache equals argmax over full forward passes; top-k /
top-p keep the right sets; seeds reproduce; <eos> ends a sample."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from modern_jax.config import ModelConfig
from modern_jax.data import ByteTokenizer
from modern_jax.generate import cut_at_eos, filter_logits, generate, sample_texts
from modern_jax.model import Transformer


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, qk_norm="head",
                      init_std=0.5)  # a large init: peaked, varied next-token distributions
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    return model, graphdef, nnx.to_pure_dict(params)


def test_greedy_with_the_cache_equals_argmax_of_full_forward_passes(tiny):
    model, graphdef, params = tiny
    prompt = np.array([[257, 100, 101, 102], [257, 7, 8, 9]], np.int32)
    out = generate(graphdef, params, prompt, max_new_tokens=6, temperature=0.0)
    forward = jax.jit(lambda tokens: model(tokens))
    tokens = prompt
    for _ in range(6):
        nxt = np.asarray(jnp.argmax(forward(jnp.asarray(tokens))[:, -1], -1))
        tokens = np.concatenate([tokens, nxt[:, None]], axis=1)
    np.testing.assert_array_equal(out, tokens[:, prompt.shape[1]:])


def test_greedy_with_the_cache_equals_full_forward_passes_for_llama4_attention():
    """Chunks of 3 on the RoPE layers (rings of 3 slots) with the L2 QK-norm, a global NoPE layer
    with temperature tuning (floor 2): the prompt and the generated tokens cross several chunks.
    `BY_LAYER_FROM` new tokens: decoded layer by layer, a stack of 3 chunked layers and the global
    one each sliced out (the test above decodes fewer, over the stacked layers)."""
    from modern_jax.generate import BY_LAYER_FROM

    N = BY_LAYER_FROM
    assert 6 < N
    cfg = ModelConfig(vocab_size=260, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, init_std=0.5,
                      attention_pattern="CCCG", attention_chunk_size=3, rope_pattern="RRRN", qk_norm="l2",
                      attn_temperature_floor=2, attn_temperature_scale=0.5)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    graphdef, params = nnx.split(model, nnx.Param)
    prompt = np.array([[257, 100, 101, 102, 103], [257, 7, 8, 9, 10]], np.int32)
    out = generate(graphdef, nnx.to_pure_dict(params), prompt, max_new_tokens=N, temperature=0.0)
    forward = jax.jit(lambda tokens: model(tokens))
    T = prompt.shape[1]  # one length, one compile: the model is causal, so what follows t changes nothing at t
    tokens = np.zeros((2, T + N), np.int32)
    tokens[:, :T] = prompt
    for t in range(T, T + N):
        tokens[:, t] = np.asarray(jnp.argmax(forward(jnp.asarray(tokens))[:, t - 1], -1))
    np.testing.assert_array_equal(out, tokens[:, T:])
    assert len(set(out[0].tolist())) > 1  # not one token repeated: the comparison has something to see


@pytest.mark.quick
def test_top_k_and_top_p_keep_the_right_tokens():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = lambda **kw: np.isfinite(np.asarray(filter_logits(logits, **kw)))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False, False]
    assert kept(top_p=0.5) == [True, False, False, False, False]
    assert kept(top_p=0.6) == [True, True, False, False, False]
    assert kept(top_p=0.86) == [True, True, True, True, False]
    assert kept(top_p=1.0) == [True] * 5
    np.testing.assert_allclose(filter_logits(logits, temperature=0.5), logits / 0.5, rtol=1e-6)


def test_sampling_is_reproducible_and_respects_top_k(tiny):
    _, graphdef, params = tiny
    prompt = np.full((4, 2), 257, np.int32)
    a = generate(graphdef, params, prompt, max_new_tokens=8, rng=jax.random.key(1), temperature=1.0, top_k=3)
    b = generate(graphdef, params, prompt, max_new_tokens=8, rng=jax.random.key(1), temperature=1.0, top_k=3)
    c = generate(graphdef, params, prompt, max_new_tokens=8, rng=jax.random.key(2), temperature=1.0, top_k=3)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    with pytest.raises(ValueError, match="temperature"):
        generate(graphdef, params, prompt, max_new_tokens=2, temperature=-1.0)


def test_eos_ends_a_sample(tiny):
    assert cut_at_eos(np.array([5, 6, 258, 7]), 258).tolist() == [5, 6]
    assert cut_at_eos(np.array([5, 6]), 258).tolist() == [5, 6]
    _, graphdef, params = tiny
    texts = sample_texts(graphdef, params, ByteTokenizer(), "ab", n=2, max_new_tokens=5, temperature=0.0)
    assert len(texts) == 2 and all(t.startswith("ab") for t in texts)


def test_with_eos_the_steps_stop_once_every_row_has_emitted_it(tiny):
    """decode with eos gives, row by row, the tokens decoding without eos gives up to its first eos,
    then eos: when some row never emits it (every step runs) and when every row emits it at once
    (the loop ends at the first step)."""
    from modern_jax.generate import decode

    model = tiny[0]
    run = jax.jit(lambda p, eos: decode(model, p, jax.random.key(0), max_new_tokens=8, temperature=0.0, top_k=None,
                                        top_p=None, eos_id=eos), static_argnums=1)
    prompts = jnp.asarray([[257, 5, 6], [257, 40, 41], [257, 70, 71]], jnp.int32)
    free = np.asarray(run(prompts, None))
    eos = int(free[0, 2])  # row 0 emits it at its third step
    assert eos not in free[1:, :3].ravel().tolist()  # the others go on
    for eos, rows in ((eos, prompts), (int(free[1, 0]), jnp.tile(prompts[1:2], (3, 1)))):
        expected = np.asarray(run(rows, None)).copy()
        for row in expected:
            hits = np.flatnonzero(row == eos)
            if len(hits):
                row[hits[0]:] = eos
        np.testing.assert_array_equal(np.asarray(run(rows, eos)), expected)
    assert (np.asarray(run(jnp.tile(prompts[1:2], (3, 1)), int(free[1, 0])))[:, 1:] == int(free[1, 0])).all()


@pytest.mark.parametrize("kind", ["rope_gqa", "learned_positions", "window_ring", "llama4_chunks_temperature"])
def test_left_padded_rows_sample_what_each_prompt_samples_alone(kind):
    """Prompts of 2 to 7 tokens right-aligned in one batch (`left_padded` + `decode`): each row's
    greedy tokens and the logits they came from equal those of its prompt decoded alone, unpadded
    (rings shorter than the padded prompt, learned positions and temperature tuning included)."""
    from modern_jax.generate import decode, left_padded

    base = dict(vocab_size=260, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, init_std=0.5)
    cfg = ModelConfig(**{**base, **{
        "rope_gqa": dict(qk_norm="head"),
        "learned_positions": dict(position_embedding="learned", max_position_embeddings=32),
        "window_ring": dict(attention_pattern="LG", sliding_window=3),
        "llama4_chunks_temperature": dict(n_layers=4, attention_pattern="CCCG", attention_chunk_size=3,
                                          rope_pattern="RRRN", qk_norm="l2", attn_temperature_floor=2,
                                          attn_temperature_scale=0.5)}[kind]})
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    prompts = [[257, 5, 6, 7, 8, 9, 10], [257, 40], [257, 70, 71, 72]]
    rows, lengths = left_padded(prompts, 8, pad_id=99)
    run = jax.jit(lambda p, n: decode(model, p, jax.random.key(0), max_new_tokens=6, temperature=0.0, top_k=None,
                                      top_p=None, eos_id=None, length_B=n))
    together = np.asarray(run(jnp.asarray(rows), jnp.asarray(lengths)))
    for prompt, got in zip(prompts, together):
        alone = decode(model, jnp.asarray([prompt], jnp.int32), jax.random.key(0), max_new_tokens=6, temperature=0.0,
                       top_k=None, top_p=None, eos_id=None)
        np.testing.assert_array_equal(got, np.asarray(alone)[0])
    assert len({tuple(r) for r in together.tolist()}) == 3  # the rows differ: padding leaking in would show
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        left_padded([[1] * 9], 8)


def _decoder(model, **kw):
    from modern_jax.generate import decode

    return jax.jit(lambda p, n, key: decode(model, p, key, top_k=None, top_p=None, length_B=n, **kw))


def test_a_group_prefilled_once_samples_what_each_row_prefilled_samples(tiny):
    """Three prompts of different lengths, each four times (GRPO's groups): `group=4` prefills each
    prompt once and copies its cache rows to its group; greedy tokens and the tokens sampled with
    the same key equal those of every row prefilled on its own."""
    from modern_jax.generate import left_padded

    model = tiny[0]
    rows, lengths = left_padded([p for p in ([257, 5, 6, 7, 8], [257, 40], [257, 70, 71]) for _ in range(4)], 6)
    for temperature in (0.0, 1.0):
        kw = dict(max_new_tokens=6, temperature=temperature, eos_id=None)
        shared = np.asarray(_decoder(model, group=4, **kw)(rows, lengths, jax.random.key(3)))
        alone = np.asarray(_decoder(model, **kw)(rows, lengths, jax.random.key(3)))
        np.testing.assert_array_equal(shared, alone)
        assert len({tuple(r) for r in shared.tolist()}) == (3 if temperature == 0.0 else 12)  # groups differ
    with pytest.raises(ValueError, match="group=5 must divide the batch of 12 rows"):
        _decoder(model, group=5, **kw)(rows, lengths, jax.random.key(3))


def test_compacting_finished_rows_keeps_each_rows_tokens(tiny, monkeypatch):
    """With eos, once half the rows have ended the live ones move into a batch half as large (twice
    at most): greedy, each row's tokens equal its prompt decoded alone; sampled, the tokens equal those
    of the same batch decoded without compaction (each row draws its own row's noise)."""
    from modern_jax import generate as generation

    model = tiny[0]
    prompts = [[257, 3 + 7 * i, 4 + 5 * i] for i in range(8)]
    rows, lengths = generation.left_padded(prompts, 3)
    N = generation.COMPACT_FROM
    for temperature in (0.0, 1.0):
        kw = dict(max_new_tokens=N, temperature=temperature, eos_id=15)  # a token half the rows emit early
        got = np.asarray(_decoder(model, **kw)(rows, lengths, jax.random.key(0)))
        ends = [(np.flatnonzero(r == 15).tolist() or [N])[0] for r in got]
        assert sorted(ends)[3] < N - 1 and max(ends) > sorted(ends)[3]  # compacted, with rows left to decode
        if temperature == 0.0:
            alone = _decoder(model, **kw)
            want = np.concatenate([np.asarray(alone(rows[i:i + 1], lengths[i:i + 1], jax.random.key(0)))
                                   for i in range(8)])
        else:
            monkeypatch.setattr(generation, "COMPACTIONS", 0)
            want = np.asarray(_decoder(model, **kw)(rows, lengths, jax.random.key(0)))
        np.testing.assert_array_equal(got, want)
