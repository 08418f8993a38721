"""Data: packing keeps documents apart (checked through the model), host shards are disjoint
and cover the batch, the iterator resumes exactly, tokenizers round-trip, every source loads."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from modern_jax.config import ModelConfig
from modern_jax.data import (
    ByteTokenizer,
    CharTokenizer,
    DataConfig,
    HFTokenizer,
    TokenStream,
    eval_batches,
    load_splits,
    load_tokenizer,
    pack_windows,
    split_documents,
    train_iterator,
)
from modern_jax.data.pipeline import TrainBatches
from modern_jax.model import Transformer


def stream_of(lengths, bos=90, eos=91):
    rng = np.random.default_rng(0)
    return TokenStream.from_documents([rng.integers(0, 80, n) for n in lengths], bos, eos)


def test_pack_windows_marks_documents():
    stream = TokenStream(np.arange(10), np.array([0, 4, 7]))  # documents [0..3] [4..6] [7..9]
    batch = pack_windows(stream, np.array([2, 6]), seq_len=5)
    np.testing.assert_array_equal(batch["inputs"], [[2, 3, 4, 5, 6], [6, 7, 8, 9, 0]])
    np.testing.assert_array_equal(batch["targets"], [[3, 4, 5, 6, 7], [7, 8, 9, 0, 0]])
    np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 2, 2, 2], [1, 2, 2, 2, 0]])
    np.testing.assert_array_equal(batch["positions"], [[0, 1, 0, 1, 2], [0, 0, 1, 2, 0]])
    # no target across a boundary, none on padding
    np.testing.assert_array_equal(batch["weights"], [[1, 0, 1, 1, 0], [0, 1, 1, 0, 0]])


def test_packed_documents_never_see_each_other_through_the_model():
    cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    forward = nnx.jit(lambda m, t, p, s: m(t, positions=p, segment_ids=s))
    stream = stream_of([5, 9, 4])
    batch = pack_windows(stream, np.array([0]), seq_len=len(stream) - 1)
    row = {k: jnp.asarray(v) for k, v in batch.items()}
    packed = forward(model, row["inputs"], row["positions"], row["segment_ids"])
    for start, end in zip(stream.doc_starts, list(stream.doc_starts[1:]) + [len(stream) - 1]):
        alone = forward(model, row["inputs"][:, start:end], jnp.arange(end - start)[None], None)
        np.testing.assert_allclose(packed[:, start:end], alone, rtol=2e-5, atol=2e-5)
    # changing the first document changes nothing in the others
    s1 = stream.doc_starts[1]
    changed = row["inputs"].at[0, :s1].set((row["inputs"][0, :s1] + 1) % 80)
    other = forward(model, changed, row["positions"], row["segment_ids"])
    np.testing.assert_allclose(other[:, s1:], packed[:, s1:], rtol=1e-6, atol=1e-6)
    assert not np.allclose(other[:, :s1], packed[:, :s1])


@pytest.mark.parametrize("hosts", [2, 4])
def test_host_shards_are_disjoint_and_cover_the_batch(hosts):
    stream = stream_of([50, 70, 30, 90])
    whole = TrainBatches(stream, seq_len=8, batch_size=8, grad_accum=2, seed=3)
    parts = [TrainBatches(stream, seq_len=8, batch_size=8, grad_accum=2, seed=3, host_index=h, host_count=hosts)
             for h in range(hosts)]
    for i in (0, 5):
        full = whole[i]
        for key in full:
            np.testing.assert_array_equal(np.concatenate([p[i][key] for p in parts], axis=1), full[key])
        # global rows [h R, (h + 1) R) of each accumulation step are host h's: disjoint, covering
        assert all(p[i]["inputs"].shape == (2, 4 // hosts, 8) for p in parts)
    full_eval = list(eval_batches(stream, seq_len=8, batch_size=4))
    sharded = [list(eval_batches(stream, seq_len=8, batch_size=4, host_index=h, host_count=2)) for h in range(2)]
    for b, batch in enumerate(full_eval):
        np.testing.assert_array_equal(np.concatenate([s[b]["targets"] for s in sharded], axis=1), batch["targets"])
    # evaluation covers every target of the stream exactly once
    weights = sum(b["weights"].sum() for b in full_eval)
    assert weights == len(stream) - 1 - (len(stream.doc_starts) - 1)


def test_iterator_state_resumes_exactly():
    stream = stream_of([200, 300])
    straight = train_iterator(stream, seq_len=16, batch_size=4, seed=7)
    expected = [next(straight)["inputs"] for _ in range(6)]
    first = train_iterator(stream, seq_len=16, batch_size=4, seed=7)
    seen = [next(first)["inputs"] for _ in range(3)]
    state = json.loads(json.dumps(first.get_state()))  # as stored in a checkpoint
    resumed = train_iterator(stream, seq_len=16, batch_size=4, seed=7, state=state)
    seen += [next(resumed)["inputs"] for _ in range(3)]
    for a, b in zip(expected, seen):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(expected[0], expected[1])


@pytest.mark.parametrize("text", ["hello world", "naïve — ünïcödé ✓ 日本語", "", "line\nbreaks\ttabs"])
def test_byte_and_char_tokenizers_round_trip(text, tmp_path):
    byte = ByteTokenizer()
    assert byte.decode(byte.encode(text)) == text and byte.vocab_size == 260
    assert byte.token_bytes()[byte.encode(text)].sum() == len(text.encode())
    char = CharTokenizer.from_texts([text, "abc"])
    assert char.decode(char.encode(text)) == text
    assert char.vocab_size == len(set(text + "abc")) + 2
    for tok in (byte, char):
        tok.save(tmp_path)
        again = load_tokenizer(tmp_path)
        np.testing.assert_array_equal(again.encode(text), tok.encode(text))
    with pytest.raises(ValueError, match="outside the char tokenizer"):
        CharTokenizer("ab").encode("abc")


def test_hf_bpe_trains_and_round_trips(tmp_path):
    pytest.importorskip("tokenizers")
    texts = ["the quick brown fox jumps over the lazy dog " * 20, "def f(x):\n    return x * 2\n" * 20]
    tok = HFTokenizer.train_bpe(texts, vocab_size=300)
    assert tok.vocab_size <= 300 and tok.bos_id is not None and tok.eos_id is not None
    for text in ("the lazy fox", "def g(y): return y", "ünïcode ✓"):
        assert tok.decode(tok.encode(text)) == text
    assert tok.token_bytes()[tok.encode("the lazy fox")].sum() == len("the lazy fox")
    tok.save(tmp_path)
    np.testing.assert_array_equal(load_tokenizer(tmp_path).encode("the fox"), tok.encode("the fox"))
    (tmp_path / "hf").mkdir()
    tok.tok.save(str(tmp_path / "hf" / "tokenizer.json"))  # a plain Hugging Face file
    np.testing.assert_array_equal(load_tokenizer(tmp_path / "hf").encode("the fox"), tok.encode("the fox"))


def test_splits_are_deterministic():
    docs = [(f"doc{i}.txt", f"text {i} " * 10) for i in range(40)]
    train, val = split_documents(docs, 0.1)
    assert (train, val) == split_documents(list(reversed(docs))[::-1], 0.1)
    assert {d[0] for d in train}.isdisjoint(d[0] for d in val) and len(train) + len(val) == 40 and val
    one_train, one_val = split_documents([("a", "x" * 100)], 0.1)
    assert one_train[0][1] == "x" * 90 and one_val[0][1] == "x" * 10


def test_every_source_loads(tmp_path):
    (tmp_path / "dir").mkdir()
    for i in range(12):
        (tmp_path / "dir" / f"f{i}.txt").write_text(f"document {i}: " + "abc " * 30)
    tok, train, val = load_splits(DataConfig(path=str(tmp_path / "dir")))
    assert isinstance(tok, ByteTokenizer) and len(train.doc_starts) + len(val.doc_starts) == 12
    assert train.tokens[0] == tok.bos_id

    ids = np.arange(1000, dtype=np.uint16) % 50  # 49 ends each document
    (tmp_path / "tokens.bin").write_bytes(ids.tobytes())
    (tmp_path / "tok").mkdir()
    CharTokenizer("".join(chr(65 + i) for i in range(48))).save(tmp_path / "tok")
    tok, train, val = load_splits(DataConfig(path=str(tmp_path / "tokens.bin"), doc_separator_id=49,
                                             tokenizer_path=str(tmp_path / "tok" / "tokenizer.json")))
    assert len(train) == 900 and len(val) == 100 and len(train.doc_starts) == 18
    np.testing.assert_array_equal(train.tokens, ids[:900])

    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(tmp_path / "docs.array_record"), "group_size:1")
    for i in range(12):
        writer.write(f"record {i} text".encode())
    writer.close()
    tok, train, val = load_splits(DataConfig(path=str(tmp_path / "docs.array_record"), tokenizer="char"))
    assert len(train.doc_starts) == 12  # no record hashed into validation: each record is cut 90 / 10
    assert tok.decode(train.tokens[:20]).startswith("record ")

    with pytest.raises(ValueError, match="does not exist"):
        load_splits(DataConfig(path=str(tmp_path / "missing.txt")))


def test_embedded_corpus_needs_no_download():
    tok, train, val = load_splits(DataConfig())
    assert len(train) > 1_000_000 and len(val) > 100_000
    assert len(train.doc_starts) > 100
    _, train2, _ = load_splits(DataConfig())
    np.testing.assert_array_equal(train.tokens[:10000], train2.tokens[:10000])
    assert "import" in tok.decode(train.tokens[:200_000])
