"""Ranges that JAX would clamp silently are refused by name: learned positions, token ids,
the KV cache's batch and length, empty inputs; MLA runs with NoPE layers."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

from modern_jax import model as model_lib
from modern_jax.config import ModelConfig
from modern_jax.data.config import DataConfig
from modern_jax.data.corpora import load_splits
from modern_jax.generate import generate, sample_texts
from modern_jax.model import Transformer
from modern_jax.training.config import run_config_from_dict

BASE = dict(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_position_embeddings=16)
MLA = dict(attention_type="mla", mla_kv_rank=16, mla_q_rank=8, mla_rope_dim=4, mla_nope_dim=8, mla_v_dim=8)


def make(**overrides):
    return Transformer(ModelConfig.from_dict({**BASE, **overrides}), rngs=nnx.Rngs(0))


def tokens(B=2, T=6, V=32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, (B, T)), jnp.int32)


def split(model):
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(params)


# ----- learned positions -----------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [32, "auto"])
def test_seq_len_past_learned_positions_is_refused_at_config_time(vocab_size):
    raw = {"model": {**BASE, "vocab_size": vocab_size, "position_embedding": "learned"},
           "train": {"seq_len": 32, "warmup_steps": 0}}
    with pytest.raises(ValueError, match=r"train.seq_len=32 exceeds model.max_position_embeddings=16 \(learned "
                                         r"positions have no row past it\): lower train.seq_len"):
        run_config_from_dict(raw)
    run_config_from_dict({**raw, "model": {**raw["model"], "position_embedding": "rope"}})  # RoPE may extrapolate


def test_sampling_settings_out_of_range_are_refused_by_name():
    """A temperature of inf samples uniformly over the whole (padded) vocabulary; a top-k above the
    vocabulary keeps every token: both were accepted."""
    from modern_jax.sharding.mesh import make_mesh
    from modern_jax.training import trainer_for

    train = {"warmup_steps": 0}
    with pytest.raises(ValueError, match=r"sample_temperature=inf is invalid: expected a finite number >= 0"):
        run_config_from_dict({"model": BASE, "train": {**train, "sample_temperature": float("inf")}})
    run = run_config_from_dict({"model": BASE, "train": {**train, "sample_top_k": 33}})
    with pytest.raises(ValueError, match=r"^train.sample_top_k=33 exceeds the model's vocabulary of 32 tokens, so it "
                                         r"would keep every token: give at most 32, or null \(no top-k\)$"):
        trainer_for(run, make_mesh(devices=jax.devices()[:1]))


@pytest.mark.parametrize("call,message", [
    (lambda m: m(tokens(T=17)), r"17 tokens exceed max_position_embeddings=16 .*give at most 16 tokens"),
    (lambda m: nnx.jit(lambda m, t: m(t))(m, tokens(T=17)), r"17 tokens exceed max_position_embeddings=16"),
    (lambda m: m(tokens(T=4), positions=jnp.arange(4)[None].repeat(2, 0) + 14),
     r"positions must lie below max_position_embeddings=16 .*got values in \[14, 17\]"),
    (lambda m: m.init_cache(2, 17), r"init_cache\(max_len=17\) exceeds max_position_embeddings=16 .*max_len <= 16"),
], ids=["eager", "jit", "positions_past", "init_cache"])
def test_learned_positions_past_the_table_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call(make(position_embedding="learned"))


def test_negative_learned_positions_are_padding_no_query_sees():
    """A negative position marks a left pad (generate.decode's): accepted, and the tokens after
    it give the logits they give without it."""
    model = make(position_embedding="learned")
    t = tokens(T=6)
    padded = model(t, positions=jnp.arange(6)[None].repeat(2, 0) - 2)  # two pads, then positions 0 .. 3
    np.testing.assert_allclose(padded[:, 2:], model(t[:, 2:]), atol=1e-5)


def test_generate_refuses_to_pass_learned_positions():
    graphdef, params = split(make(position_embedding="learned"))
    prompt = np.asarray(tokens(T=10))
    with pytest.raises(ValueError, match=r"max_new_tokens=7 after a prompt of 10 tokens exceeds "
                                         r"max_position_embeddings=16 .*: at most 6 new tokens fit"):
        generate(graphdef, params, prompt, max_new_tokens=7)
    assert generate(graphdef, params, prompt, max_new_tokens=6, temperature=0.0).shape == (2, 6)


class Letters:
    """A tokenizer of 31 letters after <bos>=0 and no <eos>: every new id becomes one character."""

    bos_id, eos_id = 0, None

    def encode(self, text):
        return [ord(c) - 96 for c in text]

    def decode(self, ids):
        return "".join(chr(96 + int(i)) if i else "^" for i in ids)


def test_sample_texts_stops_at_the_context_of_learned_positions():
    graphdef, params = split(make(position_embedding="learned"))
    with pytest.warns(UserWarning, match=r"generation stops at the context of max_position_embeddings=16 tokens "
                                         r".*13 new tokens after the 3-token prompt, not max_new_tokens=40"):
        texts = sample_texts(graphdef, params, Letters(), "ab", n=2, max_new_tokens=40)
    assert [len(t) for t in texts] == [2 + 13, 2 + 13]
    with pytest.raises(ValueError, match=r"after a prompt of 16 tokens .*the prompt leaves no room: shorten it"):
        sample_texts(graphdef, params, Letters(), "a" * 15, n=1, max_new_tokens=4)


@pytest.mark.parametrize("positions", ["rope", "sinusoidal", "none"])
def test_sample_texts_warns_past_the_trained_context(positions):
    graphdef, params = split(make(position_embedding=positions))
    with pytest.warns(UserWarning, match=r"generating past the trained context: 2 prompt \+ 20 new tokens exceed "
                                         r"max_position_embeddings=16"):
        texts = sample_texts(graphdef, params, Letters(), "a", n=1, max_new_tokens=20)
    assert len(texts[0]) == 1 + 20
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the context: silent
        sample_texts(graphdef, params, Letters(), "a", n=1, max_new_tokens=14)


# ----- token ids ---------------------------------------------------------------------


def token_file(tmp_path, data: bytes, name="data.bin"):
    (tmp_path / name).write_bytes(data)
    return str(tmp_path / name)


TEXT = "the quick brown fox jumps over the lazy dog, again and again.\n" * 4  # an even number of bytes


@pytest.mark.parametrize("data,message", [
    (np.r_[np.arange(7), 300, np.arange(30)].astype(np.uint16).tobytes(),
     r"data.path='.*data.bin': token id 300 at position 7 is outside the tokenizer's vocabulary \[0, 260\): "
     r"set data.token_dtype \(now uint16\) .*data.tokenizer_path"),
    (np.arange(40, dtype=np.uint32).tobytes(),  # uint32 read as uint16 is fine in range: check size below
     None),
    (TEXT.encode(), r"token id \d+ at position \d+ .*; it looks like UTF-8 text: use source: text"),
    (np.arange(5, dtype=np.uint16).tobytes() + b"x",
     r"data.path='.*data.bin' holds 11 bytes, not a whole number of data.token_dtype=uint16 ids \(2 bytes each\)"),
    (b"", r"data.path='.*data.bin' is empty: no tokens"),
], ids=["id_past_vocab", "in_range", "text_as_tokens", "odd_size", "empty"])
def test_token_files_are_checked_when_read(tmp_path, data, message):
    cfg = DataConfig(source="tokens", path=token_file(tmp_path, data), tokenizer="byte")
    if message is None:
        tok, train, val = load_splits(cfg)
        assert len(train) + len(val) == 80
        return
    with pytest.raises(ValueError, match=message):
        load_splits(cfg)


def test_an_empty_token_split_is_named(tmp_path):
    cfg = DataConfig(source="tokens", path=token_file(tmp_path, np.arange(4, dtype=np.uint16).tobytes()),
                     tokenizer="byte", val_fraction=0.9)
    with pytest.raises(ValueError, match=r"the training split of data.path='.*data.bin' is empty: 0 of its 4 tokens "
                                         r"with data.val_fraction=0.9"):
        load_splits(cfg)


@pytest.mark.parametrize("text,message", [
    ("", r"data.path='.*corpus.txt' is empty: no text to train on"),
    ("ab", r"the validation split of data.path='.*corpus.txt' is empty: its 1 document\(s\) hold no tokens: "
           r"give more data or change data.val_fraction=0.1"),
], ids=["empty_file", "empty_validation_split"])
def test_empty_text_and_splits_are_named(tmp_path, text, message):
    (tmp_path / "corpus.txt").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_splits(DataConfig(source="text", path=str(tmp_path / "corpus.txt")))


def test_arrayrecord_token_records_are_checked(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(tmp_path / "ids.array_record"), "group_size:1")
    for i in range(4):
        writer.write(np.asarray([1, 2, 999 if i == 3 else 3, 4], np.uint16).tobytes())
    writer.close()
    with pytest.raises(ValueError, match=r"data.path='.*ids.array_record' \(record-3\): token id 999 at position 2 "
                                         r"is outside the tokenizer's vocabulary \[0, 260\)"):
        load_splits(DataConfig(path=str(tmp_path / "ids.array_record"), record_format="tokens"))


def test_checked_mode_reports_ranges_under_jit():
    model = make(position_embedding="learned")
    graphdef, state = nnx.split(model)

    def checked(fn, *args):  # a fresh trace inside checked(), as its docstring says
        with model_lib.checked():
            return checkify.checkify(jax.jit(lambda state, *a: fn(nnx.merge(graphdef, state), *a)))(state, *args)

    bad = tokens().at[0, 3].set(40)
    err, _ = checked(lambda m, t: m(t), bad)
    with pytest.raises(checkify.JaxRuntimeError, match=r"token ids must lie in \[0, vocab_size=32\); "
                                                       r"got values in \[\d+, 40\]"):
        err.throw()
    err, _ = checked(lambda m, t, p: m(t, positions=p), tokens(), jnp.full((2, 6), 20, jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match=r"positions must lie below max_position_embeddings=16"):
        err.throw()
    cache = {**model.init_cache(2, 8), "index": jnp.array([6, 6], jnp.int32)}
    err, _ = checked(lambda m, t, c: m(t, cache=c), tokens(T=3), cache)
    with pytest.raises(checkify.JaxRuntimeError, match=r"decoding past the cache.*max_len=8"):
        err.throw()
    err, good = checked(lambda m, t: m(t), tokens())
    assert err.get() is None
    np.testing.assert_allclose(good, model(tokens()), atol=1e-5, rtol=1e-5)
    # outside checked(): a jitted call has no checks and runs as before (JAX clamps the gather)
    unchecked = nnx.jit(lambda m, t: m(t))(model, bad)
    assert unchecked.shape == (2, 6, 32) and np.isfinite(np.asarray(unchecked)).all()


# ----- the KV cache ------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_a_cache_for_another_batch_is_refused(jit):
    model = make()
    call = nnx.jit(lambda m, t, c: m(t, cache=c)) if jit else (lambda m, t, c: m(t, cache=c))
    with pytest.raises(ValueError, match=r"the cache was made for batch 2, the tokens have batch 3: "
                                         r"make it with init_cache\(3, max_len\)"):
        call(model, tokens(B=3), model.init_cache(2, 8))


@pytest.mark.parametrize("jit", [False, True])
def test_a_prefill_longer_than_the_cache_is_refused(jit):
    model = make(n_layers=2, sliding_window=4, attention_pattern="LG")
    call = nnx.jit(lambda m, t, c: m(t, cache=c)) if jit else (lambda m, t, c: m(t, cache=c))
    with pytest.raises(ValueError, match=r"12 tokens do not fit a cache of max_len=8: make it with "
                                         r"init_cache\(batch, max_len >= 12\)"):
        call(model, tokens(T=12), model.init_cache(2, 8))


def test_decoding_past_the_cache_is_refused_eagerly():
    model = make()
    _, cache = model(tokens(T=6), cache=model.init_cache(2, 8))
    _, cache = model(tokens(T=2), cache=cache)  # exactly full
    with pytest.raises(ValueError, match=r"decoding past the cache: the tokens would end at lengths \[9, 9\], "
                                         r"the cache holds max_len=8 .*larger init_cache\(batch, max_len\)"):
        model(tokens(T=1), cache=cache)


def test_rings_of_a_full_window_may_wrap_past_max_len():
    """All layers local with a ring of `sliding_window` slots: decoding past max_len is exact."""
    model = make(n_layers=2, sliding_window=3, attention_pattern="L")
    toks = tokens(T=12)
    cache = model.init_cache(2, 4)
    pieces, step = [], nnx.jit(lambda m, t, c: m(t, cache=c))  # one compile, not one per operation
    for t in range(12):
        logits, cache = step(model, toks[:, t:t + 1], cache)
        pieces.append(logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), nnx.jit(lambda m, t: m(t))(model, toks),
                               atol=2e-5, rtol=2e-5)


def test_an_empty_sequence_is_refused():
    with pytest.raises(ValueError, match=r"tokens have length 0: give at least one token"):
        make()(jnp.zeros((2, 0), jnp.int32))


# ----- MLA with NoPE layers -----------------------------------------------------------


def test_mla_with_nope_layers_decodes_like_the_full_forward():
    model = make(n_layers=2, rope_pattern="RN", **MLA)
    toks = tokens(T=10)
    full = model(toks)
    assert np.isfinite(np.asarray(full)).all()
    step = nnx.jit(lambda m, t, c: m(t, cache=c))
    cache, pieces = model.init_cache(2, 12), []
    for start, size in [(0, 4)] + [(t, 1) for t in range(4, 10)]:
        logits, cache = step(model, toks[:, start:start + size], cache)
        pieces.append(logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("attention", [{}, MLA], ids=["mha", "mla"])
def test_a_nope_layer_ignores_positions(attention):
    """A one-layer NoPE model sees only the causal order: shifting positions by 5 or stretching
    their gaps leaves its logits unchanged, while RoPE's change once the gaps do."""
    toks, arange = tokens(T=8), jnp.arange(8, dtype=jnp.int32)[None].repeat(2, 0)
    nope, rope = (make(rope_pattern=p, init_std=0.5, **attention) for p in "NR")  # peaked attention
    for positions in (arange + 5, 3 * arange + 5):
        np.testing.assert_allclose(nope(toks, positions=positions), nope(toks), atol=1e-6, rtol=1e-6)
    assert float(jnp.max(jnp.abs(rope(toks, positions=3 * arange + 5) - rope(toks)))) > 1e-3
