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
from modern_jax.data.batches import TrainBatches
from modern_jax.model import Transformer


def stream_of(lengths, bos=90, eos=91):
    rng = np.random.default_rng(0)
    return TokenStream.from_documents([rng.integers(0, 80, n) for n in lengths], bos, eos)


@pytest.mark.quick
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
    share = 4 // hosts  # rows of each accumulation step per process
    parts = [TrainBatches(stream, seq_len=8, batch_size=8, grad_accum=2, seed=3, rows=slice(h * share, (h + 1) * share))
             for h in range(hosts)]
    for i in (0, 5):
        full = whole[i]
        for key in full:
            np.testing.assert_array_equal(np.concatenate([p[i][key] for p in parts], axis=1), full[key])
        # global rows [h R, (h + 1) R) of each accumulation step are host h's: disjoint, covering
        assert all(p[i]["inputs"].shape == (2, 4 // hosts, 8) for p in parts)
    full_eval = list(eval_batches(stream, seq_len=8, batch_size=4))
    sharded = [list(eval_batches(stream, seq_len=8, batch_size=4, rows=slice(2 * h, 2 * h + 2))) for h in range(2)]
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


@pytest.mark.quick
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
    assert len(train) == 900 and len(val) == 100
    whole = pack_windows(train, [0], 899)  # the split in one window: its 18 documents end at 49
    assert whole["segment_ids"].max() == 18 and whole["positions"][0, 50] == 0
    np.testing.assert_array_equal(train.tokens, ids[:900])

    write_records(tmp_path / "docs.array_record", [f"record {i} text".encode() for i in range(12)])
    tok, train, val = load_splits(DataConfig(path=str(tmp_path / "docs.array_record"), tokenizer="char"))
    assert (len(train), len(val)) == (10, 2)  # records cut at 0.9
    assert tok.decode(train.window(0, 20)[0]) == "record 0 textreco"  # <bos> record 0 text <eos> <bos> reco

    with pytest.raises(ValueError, match="does not exist"):
        load_splits(DataConfig(path=str(tmp_path / "missing.txt")))


def write_records(path, records):
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(path), "group_size:1")
    for record in records:
        writer.write(record)
    writer.close()


def test_arrayrecord_shards_are_read_a_record_at_a_time(tmp_path, monkeypatch):
    """Opening 3 shards reads each one's 64 head records alone; a batch's rows and an evaluation's
    windows equal `pack_windows` of the whole stream laid out in memory (the independent
    reference), reading only the records they cover."""
    import grain

    from modern_jax.data.arrayrecords import OFFSETS
    from modern_jax.data.batches import BATCH_KEYS

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 250, size=rng.integers(1, 40)).astype(np.uint16) for _ in range(300)]
    (tmp_path / "ar").mkdir()
    for f in range(3):
        write_records(tmp_path / "ar" / f"part-{f}.array_record", [d.tobytes() for d in docs[f * 100:(f + 1) * 100]])
    reads = []
    read = grain.sources.ArrayRecordDataSource.__getitem__
    monkeypatch.setattr(grain.sources.ArrayRecordDataSource, "__getitem__",
                        lambda self, i: reads.append(i) or read(self, i))
    tok, train, val = load_splits(DataConfig(path=str(tmp_path / "ar"), record_format="tokens"))
    assert (len(train), len(val)) == (270, 30)
    assert sorted(set(reads)) == [*range(64), *range(100, 164), *range(200, 264)]

    whole = TokenStream.from_documents(docs[:270], tok.bos_id, tok.eos_id, np.uint16)
    reads.clear()
    batch = TrainBatches(train, seq_len=32, batch_size=8, seed=3)[5]
    starts = np.random.default_rng([3, 5]).integers(0, 270 * OFFSETS, size=(1, 8))[0]
    for row, start in enumerate(starts):
        r, k = divmod(int(start), OFFSETS)
        expected = pack_windows(whole, [whole.doc_starts[r] + k * (len(docs[r]) + 2) // OFFSETS], 32)
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(batch[key][0, row], expected[key][0], err_msg=f"row {row} {key}")
    assert len(reads) < 8 * 8  # a window of 33 tokens spans a few records of ~22
    assert batch["segment_ids"].max() > 1 and (batch["segment_ids"] == 0).sum() == 0

    val_whole = TokenStream.from_documents(docs[270:], tok.bos_id, tok.eos_id, np.uint16)
    (first,) = eval_batches(val, seq_len=16, batch_size=4, max_windows=3)
    expected = pack_windows(val_whole, val_whole.doc_starts[[0, 14, 29]].tolist() + [len(val_whole)], 16)
    for key in BATCH_KEYS:
        np.testing.assert_array_equal(first[key][0], expected[key], err_msg=key)

    write_records(tmp_path / "bad.array_record", [b"abc"] * 3)
    with pytest.raises(ValueError, match=r"bad.array_record' \(record-0\): 3 bytes are not a whole number of "
                                         r"data.token_dtype=uint16 ids"):
        load_splits(DataConfig(path=str(tmp_path / "bad.array_record"), record_format="tokens"))
    write_records(tmp_path / "latin.array_record", [b"ok"] * 70 + [b"caf\xe9"])
    tok, train, val = load_splits(DataConfig(path=str(tmp_path / "latin.array_record")))  # past the head: at its read
    with pytest.raises(ValueError, match=r"\(record-70\) is not UTF-8 text \(byte 3\)"):
        val.window(len(val) - 1 << 16, 8)


def test_parquet_shards_are_read_a_row_group_at_a_time(tmp_path, monkeypatch):
    """3 shards of 100 rows in row groups of 16, the text among other columns: opening reads the
    footers and the groups of each shard's 64 head rows alone; training and evaluation windows equal
    those of an ArrayRecord corpus of the same texts (grain's reader, the independent reference), a
    batch reading only the groups its rows cover, and so do a saved dataset's; a row that is not text is
    named by file and row."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from modern_jax.data.arrayrecords import OFFSETS
    from modern_jax.data.batches import BATCH_KEYS

    rng = np.random.default_rng(0)
    texts = [f"document {i}: " + "xyz " * int(rng.integers(0, 12)) for i in range(300)]
    (tmp_path / "pq").mkdir()
    for f in range(3):
        pq.write_table(pa.table({"id": list(range(100)), "title": ["SECRET"] * 100,
                                 "text": texts[f * 100:(f + 1) * 100]}),
                       tmp_path / "pq" / f"part-{f}.parquet", row_group_size=16)
    write_records(tmp_path / "all.array_record", [t.encode() for t in texts])
    reads = []
    read = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, g, **kw: reads.append(g) or read(self, g, **kw))
    tok, train, val = load_splits(DataConfig(path=str(tmp_path / "pq" / "part-*.parquet")))
    assert (len(train), len(val)) == (270, 30)
    assert reads == [0, 1, 2, 3] * 3  # rows 0-63 of each shard: groups 0-3
    _, want_train, want_val = load_splits(DataConfig(path=str(tmp_path / "all.array_record")))

    reads.clear()
    batch = TrainBatches(train, seq_len=32, batch_size=8, seed=3)[5]
    want = TrainBatches(want_train, seq_len=32, batch_size=8, seed=3)[5]
    for key in BATCH_KEYS:
        np.testing.assert_array_equal(batch[key], want[key], err_msg=key)
    assert "SECRET" not in tok.decode(batch["inputs"].ravel()) and len(reads) <= 2 * 8
    datasets.Dataset.from_dict({"title": ["SECRET"] * 300, "text": texts}).save_to_disk(str(tmp_path / "saved"))
    _, saved, _ = load_splits(DataConfig(path=str(tmp_path / "saved")))  # a dataset's rows, read one at a time
    saved_batch = TrainBatches(saved, seq_len=32, batch_size=8, seed=3)[5]
    for key in BATCH_KEYS:
        np.testing.assert_array_equal(saved_batch[key], want[key], err_msg=key)
    for got, expected in zip(eval_batches(val, seq_len=16, batch_size=4, max_windows=3),
                             eval_batches(want_val, seq_len=16, batch_size=4, max_windows=3)):
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(got[key], expected[key], err_msg=key)

    pq.write_table(pa.table({"text": ["ok"] * 70 + [None]}), tmp_path / "null.parquet", row_group_size=16)
    _, train, val = load_splits(DataConfig(path=str(tmp_path / "null.parquet")))  # past the head: at its read
    with pytest.raises(ValueError, match=r"null.parquet, row 70: field 'text' \(data.text_field\) holds NoneType"):
        val.window((len(val) - 1) * OFFSETS, 8)


def test_json_lines_of_many_blocks_are_read_a_block_at_a_time(tmp_path, monkeypatch):
    """Blocks of 64 bytes, read as records from 40 blocks: each block holds the lines that start in it
    (grouped here from the lines' byte offsets), every line once; a training batch equals `pack_windows`
    of the whole training stream laid out in memory; a smaller corpus is read whole; a bad line past the
    head is named by its line number when it is read."""
    from modern_jax.data.arrayrecords import OFFSETS
    from modern_jax.data.batches import BATCH_KEYS
    from modern_jax.data.records import JsonlRecords

    monkeypatch.setattr(JsonlRecords, "BLOCK", 64)
    monkeypatch.setattr(JsonlRecords, "FROM_BLOCKS", 40)
    rng = np.random.default_rng(0)
    texts = [f"doc {i} " + "w" * int(rng.integers(0, 150)) for i in range(120)]
    (tmp_path / "js").mkdir()
    blocks, first = [], 0  # the global block each line starts in
    for f in range(2):
        lines = [json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts[f * 60:(f + 1) * 60])]
        lines[-1] = lines[-1] if f == 0 else "not json\n"
        (tmp_path / "js" / f"part-{f}.jsonl").write_text("".join(lines))
        offsets = np.cumsum([0] + [len(line) for line in lines[:-1]])
        blocks += (first + offsets // 64).tolist()
        first += -(-sum(map(len, lines)) // 64)
    tok, train, val = load_splits(DataConfig(path=str(tmp_path / "js" / "*.jsonl")))
    assert len(train) + len(val) == first and len(val) == first - int(first * 0.9)
    source = train.source
    for b in range(first - 1):
        assert source[b] == [t for t, at in zip(texts, blocks) if at == b], b

    whole = TokenStream.from_documents([tok.encode(t) for t, at in zip(texts, blocks) if at < len(train)],
                                       tok.bos_id, tok.eos_id, np.uint16)
    batch = TrainBatches(train, seq_len=32, batch_size=8, seed=3)[5]
    starts = np.random.default_rng([3, 5]).integers(0, len(train) * OFFSETS, size=(1, 8))[0]
    for row, start in enumerate(starts):
        r, k = divmod(int(start), OFFSETS)
        docs = [j for j, at in enumerate(blocks) if at >= r]
        in_r = sum(len(tok.encode(texts[j])) + 2 for j in docs if blocks[j] == r)
        expected = pack_windows(whole, [whole.doc_starts[docs[0]] + k * in_r // OFFSETS], 32)
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(batch[key][0, row], expected[key][0], err_msg=f"row {row} {key}")
    with pytest.raises(ValueError, match=r"part-1.jsonl, line 60: not valid JSON"):
        val.window((len(val) - 1) * OFFSETS, 8)

    monkeypatch.setattr(JsonlRecords, "FROM_BLOCKS", first + 1)  # fewer blocks: read whole, then refused whole
    with pytest.raises(ValueError, match=r"part-1.jsonl, line 60: not valid JSON"):
        load_splits(DataConfig(path=str(tmp_path / "js" / "*.jsonl")))


def test_embedded_corpus_needs_no_download():
    tok, train, val = load_splits(DataConfig())
    assert len(train) > 1_000_000 and len(val) > 100_000
    assert len(train.doc_starts) > 100
    _, train2, _ = load_splits(DataConfig())
    np.testing.assert_array_equal(train.tokens[:10000], train2.tokens[:10000])
    assert "import" in tok.decode(train.tokens[:200_000])


# ----- records: JSON Lines, Parquet, Hugging Face datasets ------------------------------------

RECORD_TEXTS = [f"document {i}: " + "héllo wörld " * (i + 2) for i in range(5)]  # < 10: each cut 90 / 10


def _write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def test_records_give_the_token_stream_of_the_same_text_in_plain_files_and_only_their_text_field(tmp_path):
    import gzip

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "plain").mkdir()
    for i, text in enumerate(RECORD_TEXTS):
        (tmp_path / "plain" / f"{i}.txt").write_text(text)
    records = [{"id": i, "title": "SECRET TITLE", "text": text, "meta": {"tag": "SECRET"}}
               for i, text in enumerate(RECORD_TEXTS)]
    _write_jsonl(tmp_path / "docs.jsonl", records)
    _write_jsonl(tmp_path / "docs.jsonl.gz", records, gzip.open)
    (tmp_path / "shards").mkdir()
    _write_jsonl(tmp_path / "shards" / "a.jsonl", records[:3])
    _write_jsonl(tmp_path / "shards" / "b.jsonl", records[3:])
    pq.write_table(pa.table({"id": list(range(5)), "title": ["SECRET"] * 5, "text": RECORD_TEXTS}),
                   tmp_path / "docs.parquet")
    datasets.Dataset.from_dict({"title": ["SECRET"] * 5, "text": RECORD_TEXTS}).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["unused"]}),
                          "notes": datasets.Dataset.from_dict({"body": RECORD_TEXTS})}).save_to_disk(
        str(tmp_path / "saved_dict"))

    _, want_train, want_val = load_splits(DataConfig(path=str(tmp_path / "plain")))
    cases = [({"path": "docs.jsonl"}, "jsonl"), ({"path": "docs.jsonl.gz"}, "jsonl"), ({"path": "shards"}, "jsonl")]
    for settings, source in cases:
        cfg = DataConfig(**{**settings, "path": str(tmp_path / settings["path"])})
        assert cfg.resolved_source == source, settings
        tok, train, val = load_splits(cfg)
        for got, want in ((train, want_train), (val, want_val)):
            np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=str(settings))
            np.testing.assert_array_equal(got.doc_starts, want.doc_starts, err_msg=str(settings))
            assert got.trained is None
        assert "SECRET" not in tok.decode(train.tokens) + tok.decode(val.tokens)
    # Parquet and datasets are read a row at a time (the tests below): their records are the text column's alone
    for settings in ({"path": "docs.parquet"}, {"path": "saved"},
                     {"path": "saved_dict", "hf_split": "notes", "text_field": "body"}):
        _, train, val = load_splits(DataConfig(**{**settings, "path": str(tmp_path / settings["path"])}))
        assert [train.source[i] for i in range(len(train) + len(val))] == RECORD_TEXTS and len(val) == 1, settings


def test_a_streamed_dataset_reads_the_first_max_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"record {i} " * 3 for i in range(12)]
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"text": texts[:6]}), tmp_path / "pq" / "part-0.parquet")
    pq.write_table(pa.table({"text": texts[6:]}), tmp_path / "pq" / "part-1.parquet")
    (tmp_path / "plain").mkdir()
    for i, text in enumerate(texts[:4]):
        (tmp_path / "plain" / f"{i}.txt").write_text(text)
    _, want, _ = load_splits(DataConfig(path=str(tmp_path / "plain")))
    streamed = DataConfig(source="hf", path=str(tmp_path / "pq"), streaming=True, max_documents=4)
    _, train, _ = load_splits(streamed)
    np.testing.assert_array_equal(train.tokens, want.tokens)
    _, train, val = load_splits(DataConfig(path=str(tmp_path / "pq"), max_documents=4))  # Parquet, by row group
    assert [train.source[i] for i in range(len(train) + len(val))] == texts[:4]


def test_record_errors_name_the_file_the_line_and_the_fields(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    def error(**settings):
        with pytest.raises(ValueError) as e:
            load_splits(DataConfig(**settings))
        return str(e.value)

    path = tmp_path / "a.jsonl"
    _write_jsonl(path, [{"text": "fine"}, {"body": "x", "id": 2}])
    assert error(path=str(path)) == (f"{path}, line 2: no field 'text' (data.text_field); the fields are 'body', "
                                     "'id': set data.text_field to the one to read")
    path.write_text('{"text": "fine"}\n{"text": "cut\n')
    assert error(path=str(path)).startswith(f"{path}, line 2: not valid JSON (")
    _write_jsonl(path, [{"text": ["a", "list"]}])
    assert "line 1: field 'text' (data.text_field) holds list" in error(path=str(path))
    _write_jsonl(path, [{"messages": [{"role": "user", "content": "hi"}]}])
    assert "line 1: field 'messages' (data.text_field) holds list" in error(path=str(path), text_field="messages")
    assert "set data.format: chat" in error(path=str(path), text_field="messages")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    assert error(path=str(tmp_path / "a.parquet")) == (f"{tmp_path / 'a.parquet'}: no field 'text' (data.text_field); "
                                                       "the fields are 'body': set data.text_field to the one to read")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp_path / "dd"))
    assert "has no split 'test' (data.hf_split); its splits are 'train'" in error(path=str(tmp_path / "dd"),
                                                                                  hf_split="test")
    (tmp_path / "notes.txt").write_text("plain text")
    assert "data.format='chat' reads conversations from records" in error(path=str(tmp_path / "notes.txt"),
                                                                          format="chat")
    with pytest.raises(ValueError, match=r"DataConfig.format='chat' is invalid: conversations are records"):
        DataConfig(source="text", path="x.txt", format="chat")
    assert "for a Hugging Face hub dataset set data.source: hf" in error(path="someone/some_dataset")
    (tmp_path / "mixed").mkdir()
    _write_jsonl(tmp_path / "mixed" / "a.jsonl", [{"text": "x" * 20}])
    (tmp_path / "mixed" / "README.md").write_text("about the data")
    assert "holds jsonl files (a.jsonl, ...) among other files" in error(path=str(tmp_path / "mixed"))
    tok, train, val = load_splits(DataConfig(source="jsonl", path=str(tmp_path / "mixed")))
    assert tok.decode(train.tokens) + tok.decode(val.tokens) == "x" * 20  # the README is not read


# ----- conversations: the chat template and the loss mask -------------------------------------

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
                {"role": "assistant", "content": "hello friend"}, {"role": "user", "content": "bye"},
                {"role": "assistant", "content": "see you"}]
# every token of CONVERSATION under CHATML and whether it is trained, written out by hand: the
# assistant's words and the <|im_end|> (the eos_token) that closes each of its turns
CHATML_TOKENS = [("<|im_start|>", 0), ("system", 0), ("be", 0), ("brief", 0), ("<|im_end|>", 0),
                 ("<|im_start|>", 0), ("user", 0), ("hi", 0), ("there", 0), ("<|im_end|>", 0),
                 ("<|im_start|>", 0), ("assistant", 0), ("hello", 1), ("friend", 1), ("<|im_end|>", 1),
                 ("<|im_start|>", 0), ("user", 0), ("bye", 0), ("<|im_end|>", 0),
                 ("<|im_start|>", 0), ("assistant", 0), ("see", 1), ("you", 1), ("<|im_end|>", 1)]


def _chatml_tokenizer(directory):
    """A word-level Hugging Face tokenizer with ChatML's special tokens and template, as
    transformers saves one (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    words = sorted({w for m in CONVERSATION for w in (m["role"] + " " + m["content"]).split()} | {"ok"})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials[1:]])
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None, "unk_token": "<unk>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory / "tokenizer.json"


@pytest.mark.quick
def test_chat_loss_mask_token_by_token_for_a_chatml_template(tmp_path):
    tokenizer_path = _chatml_tokenizer(tmp_path / "tok")
    other = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    _write_jsonl(tmp_path / "chat.jsonl", [{"id": 1, "messages": CONVERSATION}, {"id": 2, "messages": other}])
    cfg = DataConfig(path=str(tmp_path / "chat.jsonl"), format="chat", tokenizer="hf",
                     tokenizer_path=str(tokenizer_path))
    tok, train, val = load_splits(cfg)
    assert tok.chat_template == CHATML  # read from tokenizer_config.json, saved with the run's tokenizer
    assert [tok.tok.id_to_token(int(i)) for i in train.tokens] == [t for t, _ in CHATML_TOKENS]
    np.testing.assert_array_equal(train.trained, [w for _, w in CHATML_TOKENS])
    assert [tok.tok.id_to_token(int(i)) for i in val.tokens[val.trained]] == ["ok", "<|im_end|>"]  # the last one

    # the targets of a packed row: weight 1 exactly where the next token is the assistant's
    batch = pack_windows(train, np.array([0]), seq_len=len(train) - 1)
    np.testing.assert_array_equal(batch["weights"][0], [w for _, w in CHATML_TOKENS[1:]])
    # and evaluation counts the same targets (as evaluate reports the loss over them)
    assert sum(b["weights"].sum() for b in eval_batches(train, seq_len=8, batch_size=2)) == 6


def test_builtin_template_masks_byte_by_byte_and_packing_keeps_each_conversation(tmp_path):
    first = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    second = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "héllo"}]
    # the built-in template by hand: (text, trained); the generation blocks hold content + "<|end|>\n"
    first_pieces = [("<|user|>\n2+2?<|end|>\n<|assistant|>\n", 0), ("4<|end|>\n", 1)]
    second_pieces = [("<|system|>\nbe nice<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n", 0), ("héllo<|end|>\n", 1)]

    def by_byte(pieces):
        return ([b for text, _ in pieces for b in text.encode()],
                [w for text, w in pieces for _ in text.encode()])

    _write_jsonl(tmp_path / "chat.jsonl", [{"messages": first}, {"messages": second}, {"messages": first}])
    tok, train, val = load_splits(DataConfig(path=str(tmp_path / "chat.jsonl"), format="chat", val_fraction=0.3))
    (ids1, w1), (ids2, w2) = by_byte(first_pieces), by_byte(second_pieces)
    np.testing.assert_array_equal(train.tokens, ids1 + ids2)  # no <bos> / <eos>: the template is the document
    np.testing.assert_array_equal(train.trained, w1 + w2)
    np.testing.assert_array_equal(train.doc_starts, [0, len(ids1)])
    np.testing.assert_array_equal(val.tokens, ids1)

    # a window across both conversations: each keeps its segment and its mask, the boundary has weight 0
    start = len(ids1) - 6
    batch = pack_windows(train, np.array([start]), seq_len=14)
    want_segments = [1] * 6 + [2] * 8
    np.testing.assert_array_equal(batch["segment_ids"][0], want_segments)
    want_weights = [w1[start + t + 1] if t < 5 else 0 if t == 5 else w2[t - 6 + 1] for t in range(14)]
    np.testing.assert_array_equal(batch["weights"][0], want_weights)
    assert batch["weights"][0][:5].all() and not batch["weights"][0][5:].any()

    # the char tokenizer learns its vocabulary from the rendered conversations (markup included)
    char, train, _ = load_splits(DataConfig(path=str(tmp_path / "chat.jsonl"), format="chat", val_fraction=0.3,
                                            tokenizer="char"))
    assert char.decode(train.tokens) == "".join(t for t, _ in first_pieces + second_pieces)


def test_chat_errors_name_the_record(tmp_path):
    _write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user"}]}, {"messages": []}])
    with pytest.raises(ValueError, match=r"\(chat.jsonl, line 1\): message 0 of 'messages' is "
                                         r"\{'role': 'user'\}, expected"):
        load_splits(DataConfig(path=str(tmp_path / "chat.jsonl"), format="chat"))
    _write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 3)
    with pytest.raises(ValueError, match="has no assistant tokens to train on"):
        load_splits(DataConfig(path=str(tmp_path / "chat.jsonl"), format="chat"))
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match=r"the chat template does not parse \(line 1"):
        load_splits(DataConfig(path=str(tmp_path / "chat.jsonl"), format="chat",
                               chat_template=str(tmp_path / "bad.jinja")))
