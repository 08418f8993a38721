"""Preference pairs (`modern_jax.data.preference`): TRL's three record formats give the tokens and
completion weights built here from the known prompt and completion strings, every reader gives
the same pairs, the batch interleaves chosen and rejected rows exactly as `pack_windows` lays
out one sequence, truncation keeps the start, and every bad record is named."""

import json
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers

from modern_jax.data import (
    BATCH_KEYS,
    ByteTokenizer,
    CharTokenizer,
    DataConfig,
    TokenStream,
    load_tokenizer,
    pack_windows,
)
from modern_jax.data.preference import PreferencePairs, batch_of, pair_eval_batches, pair_iterator, read_pairs

HF_CHAT = pathlib.Path(__file__).parent / "fixtures" / "hf_chat"
BYTE = ByteTokenizer()
BOS, EOS = BYTE.bos_id, BYTE.eos_id


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "you are a calculator"}
QUESTION = [SYSTEM, user("what is one plus three")]
GOOD, BAD = [assistant("one plus three is four")], [assistant("one plus three is five")]
CHATML_PROMPT = ("<|im_start|>system\nyou are a calculator<|im_end|>\n<|im_start|>user\nwhat is one plus three"
                 "<|im_end|>\n<|im_start|>assistant\n")


def write_jsonl(path, records) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read(tmp_path, records, tokenizer=BYTE, seq_len=64, name="pairs.jsonl", **cfg) -> PreferencePairs:
    return read_pairs(DataConfig(**cfg), write_jsonl(tmp_path / name, records), tokenizer, seq_len)


def expected(prompt_ids, chosen_ids, rejected_ids, seq_len):
    """`(tokens [2, W], weights [2, T])` of one pair, built position by position."""
    W = seq_len + 1
    tokens, weights = np.zeros((2, W), np.int32), np.zeros((2, seq_len), np.float32)
    for c, completion in enumerate((chosen_ids, rejected_ids)):
        sequence = (list(prompt_ids) + list(completion))[:W]
        tokens[c, : len(sequence)] = sequence
        for t in range(seq_len):
            weights[c, t] = float(len(prompt_ids) <= t + 1 < len(sequence))  # target t is token t + 1
    return tokens, weights


def assert_pair(pairs, p, want):
    np.testing.assert_array_equal(pairs.tokens[p], want[0])
    np.testing.assert_array_equal(pairs.weights[p], want[1])


def byte_ids(text):
    return list(text.encode("utf-8"))


def chatml_ids(text):
    """The fixture's ids of `text`, from the `tokenizers` library directly."""
    return tokenizers.Tokenizer.from_file(str(HF_CHAT / "tokenizer.json")).encode(text, add_special_tokens=False).ids


# ----- the three formats ---------------------------------------------------------


@pytest.mark.quick
def test_explicit_text_prompt_completions_end_in_eos(tmp_path):
    pairs = read(tmp_path, [{"prompt": "Q: 2+2?", "chosen": " 4", "rejected": " five"},
                            {"prompt": "Q: hi", "chosen": " hello<eos>", "rejected": " no"}], seq_len=24)
    assert pairs.tokens.shape == (2, 2, 25) and pairs.weights.shape == (2, 2, 24)
    assert pairs.tokens.dtype == np.int32 and pairs.weights.dtype == np.float32
    prompt = [BOS, *byte_ids("Q: 2+2?")]
    assert_pair(pairs, 0, expected(prompt, byte_ids(" 4") + [EOS], byte_ids(" five") + [EOS], 24))
    # a text completion ending in the eos string gets no second one (the byte tokenizer names none: it gets one)
    assert_pair(pairs, 1, expected([BOS, *byte_ids("Q: hi")], byte_ids(" hello<eos>") + [EOS], byte_ids(" no") + [EOS],
                                   24))
    np.testing.assert_array_equal(pairs.lengths, [[11, 14], [18, 10]])
    np.testing.assert_array_equal(pairs.prompts, [8, 6])
    assert pairs.names == ("pairs.jsonl, line 1", "pairs.jsonl, line 2")


def test_text_completion_ending_in_the_tokenizers_eos_token_gets_no_second_one(tmp_path):
    tokenizer = load_tokenizer(HF_CHAT / "tokenizer.json")
    pairs = read(tmp_path, [{"prompt": "what is two", "chosen": " plus two<|im_end|>", "rejected": " plus one"}],
                 tokenizer)
    prompt = [tokenizer.bos_id, *chatml_ids("what is two")]
    assert_pair(pairs, 0, expected(prompt, chatml_ids(" plus two<|im_end|>"), chatml_ids(" plus one<|im_end|>"), 64))


@pytest.mark.quick
def test_explicit_conversation_chatml(tmp_path):
    tokenizer = load_tokenizer(HF_CHAT / "tokenizer.json")
    pairs = read(tmp_path, [{"prompt": QUESTION, "chosen": GOOD, "rejected": BAD}], tokenizer, seq_len=32)
    want = expected(chatml_ids(CHATML_PROMPT), chatml_ids("one plus three is four<|im_end|>\n"),
                    chatml_ids("one plus three is five<|im_end|>\n"), 32)
    assert_pair(pairs, 0, want)
    np.testing.assert_array_equal(pairs.weights.sum(-1), [[6, 6]])  # "one plus three is four" and <|im_end|>
    assert pairs.prompts[0] == len(chatml_ids(CHATML_PROMPT)) == 17


def test_builtin_template_with_generation_marks(tmp_path):
    pairs = read(tmp_path, [{"prompt": [user("What is 2 + 2?")], "chosen": [assistant("4")],
                             "rejected": [assistant("5")]}], seq_len=64)
    prompt = byte_ids("<|user|>\nWhat is 2 + 2?<|end|>\n<|assistant|>\n")  # a rendered template: no <bos>
    assert_pair(pairs, 0, expected(prompt, byte_ids("4<|end|>\n"), byte_ids("5<|end|>\n"), 64))


@pytest.mark.quick
def test_implicit_prompts_are_the_shared_start(tmp_path):
    tokenizer = load_tokenizer(HF_CHAT / "tokenizer.json")
    explicit = read(tmp_path, [{"prompt": QUESTION, "chosen": GOOD, "rejected": BAD}], tokenizer, name="e.jsonl")
    implicit = read(tmp_path, [{"chosen": QUESTION + GOOD, "rejected": QUESTION + BAD}], tokenizer, name="i.jsonl")
    # a text prompt beside whole conversations (ultrafeedback_binarized) is left for the shared start
    beside = read(tmp_path, [{"prompt": "what is one plus three", "chosen": QUESTION + GOOD,
                              "rejected": QUESTION + BAD}], tokenizer, name="b.jsonl")
    for pairs in (implicit, beside):
        np.testing.assert_array_equal(pairs.tokens, explicit.tokens)
        np.testing.assert_array_equal(pairs.weights, explicit.weights)

    # texts: up to the first difference, a space at the end given to the completions
    text = read(tmp_path, [{"chosen": "Q: hi A: yes", "rejected": "Q: hi A: no"}], name="t.jsonl")
    assert_pair(text, 0, expected([BOS, *byte_ids("Q: hi A:")], byte_ids(" yes") + [EOS], byte_ids(" no") + [EOS], 64))
    # one the start of the other: the prompt stops before the shorter one's last character (TRL's extract_prompt)
    prefix = read(tmp_path, [{"chosen": "abc", "rejected": "abcd"}], name="p.jsonl")
    assert_pair(prefix, 0, expected([BOS, *byte_ids("ab")], byte_ids("c") + [EOS], byte_ids("cd") + [EOS], 64))


def test_every_reader_gives_the_same_pairs_and_max_documents_the_first(tmp_path):
    records = [{"prompt": QUESTION, "chosen": GOOD, "rejected": BAD},
               {"prompt": [user("what is two plus two")], "chosen": [assistant("four")],
                "rejected": [assistant("two plus two is five")]}]
    tokenizer = load_tokenizer(HF_CHAT / "tokenizer.json")
    jsonl = read(tmp_path, records, tokenizer)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "pairs.parquet")
    parquet = read_pairs(DataConfig(), tmp_path / "pairs.parquet", tokenizer, 64)
    hf = read_pairs(DataConfig(source="hf", path=str(tmp_path / "pairs.jsonl")), None, tokenizer, 64)
    for pairs in (parquet, hf):
        for field in ("tokens", "weights", "lengths", "prompts"):
            np.testing.assert_array_equal(getattr(pairs, field), getattr(jsonl, field), err_msg=field)
    assert parquet.names == ("pairs.parquet, row 0", "pairs.parquet, row 1")
    first = read_pairs(DataConfig(max_documents=1), tmp_path / "pairs.parquet", tokenizer, 64)
    np.testing.assert_array_equal(first.tokens, jsonl.tokens[:1])


# ----- batches and truncation ----------------------------------------------------


@pytest.mark.quick
def test_batch_interleaves_chosen_and_rejected_as_pack_windows_lays_out_each(tmp_path):
    pairs = read(tmp_path, [{"prompt": f"Q{i}: {'x' * i}?", "chosen": " yes" * (i + 1), "rejected": " no"}
                            for i in range(3)], seq_len=20)
    batch = batch_of(pairs, [2, 0])
    assert tuple(batch) == BATCH_KEYS
    assert all(v.shape == (4, 20) for v in batch.values())
    assert batch["inputs"].dtype == batch["targets"].dtype == batch["positions"].dtype == np.int32
    assert batch["segment_ids"].dtype == np.int32 and batch["weights"].dtype == np.float32
    for row, (p, c) in enumerate([(2, 0), (2, 1), (0, 0), (0, 1)]):  # row 2n chosen, 2n + 1 rejected
        n, start = pairs.lengths[p, c], pairs.prompts[p]
        sequence = pairs.tokens[p, c, :n]
        alone = TokenStream(sequence, np.array([0]), trained=np.arange(n) >= start)
        window = pack_windows(alone, np.array([0]), 20)
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(batch[key][row], window[key][0], err_msg=f"{key} of row {row}")
    np.testing.assert_array_equal(batch["weights"][1], pairs.weights[2, 1])


def test_truncation_keeps_the_start_and_a_prompt_filling_the_sequence_is_refused(tmp_path):
    record = {"prompt": "0123456789", "chosen": "abcdefghij", "rejected": "xy"}  # prompt: <bos> and 10 bytes
    with pytest.warns(UserWarning, match="1 of the 2 sequences .* lose the end of their completion"):
        pairs = read(tmp_path, [record], seq_len=15)
    prompt = [BOS, *byte_ids("0123456789")]
    assert_pair(pairs, 0, expected(prompt, byte_ids("abcdefghij") + [EOS], byte_ids("xy") + [EOS], 15))
    np.testing.assert_array_equal(pairs.tokens[0, 0], prompt + byte_ids("abcde"))  # the first 16 tokens
    np.testing.assert_array_equal(pairs.lengths, [[16, 14]])
    np.testing.assert_array_equal(pairs.weights[0, 0, 10:], 1.0)
    # a prompt of seq_len tokens keeps one completion token; one more leaves none
    with pytest.warns(UserWarning):
        last = read(tmp_path, [record], seq_len=11)
    np.testing.assert_array_equal(last.weights[0].sum(-1), [1, 1])
    with pytest.raises(ValueError, match=r"pairs.jsonl, line 1: the prompt is 11 tokens, so a sequence of seq_len "
                                         r"\+ 1 = 11 tokens holds none of the completions: raise seq_len"):
        read(tmp_path, [record], seq_len=10)


# ----- errors --------------------------------------------------------------------


EMPTY_ASSISTANT = "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}\n{% endif %}{% endfor %}"


@pytest.mark.parametrize("record, match", [
    ({"prompt": "Q", "rejected": " b"}, r"line 2: no field 'chosen'; the fields are 'prompt', 'rejected': .*rename "
                                         r"the field that holds the chosen text or messages to 'chosen'"),
    ({"prompt": "Q", "chosen": " a", "answer": " b"}, r"line 2: no field 'rejected'; .*to 'rejected'"),
    ({"chosen": " a", "rejected": " b"}, r"line 2: no field 'prompt', but the records before it have one"),
    ({"prompt": "Q", "chosen": " a", "rejected": [assistant("b")]}, r"line 2: 'chosen' is a text but 'rejected'"),
    ({"prompt": [user("Q")], "chosen": " a", "rejected": " b"}, r"line 2: 'prompt' is a conversation but 'chosen'"),
    ({"prompt": "Q", "chosen": [assistant("a")], "rejected": [assistant("b")]},
     r"line 2: 'prompt' is a text and 'chosen' and 'rejected' are conversations that do not start alike"),
    ({"prompt": "Q", "chosen": [], "rejected": [assistant("b")]}, r"line 2: field 'chosen' holds list '\[\]', "
                                                                  r"expected a text or a non-empty list"),
    ({"prompt": "Q", "chosen": 5, "rejected": " b"}, r"line 2: field 'chosen' holds int"),
    ({"prompt": "Q", "chosen": [{"role": "assistant"}], "rejected": [assistant("b")]},
     r"line 2: message 0 of 'chosen' .* a string content"),
    ({"prompt": "Q", "chosen": " \u00e9", "rejected": " b"}, r"line 2: characters outside the char tokenizer"),
])
def test_bad_records_are_named(tmp_path, record, match):
    good = {"prompt": "Q", "chosen": " a", "rejected": " b"}
    tokenizer = CharTokenizer("Q ab") if "\u00e9" in str(record) else BYTE
    with pytest.raises(ValueError, match=match):
        read(tmp_path, [good, record], tokenizer)


def test_implicit_records_that_share_no_start_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"line 1: 'chosen' and 'rejected' are texts that do not start alike, so "
                                         r"they hold no prompt: give the prompt as a text in 'prompt'"):
        read(tmp_path, [{"chosen": "yes", "rejected": "no"}])


def test_a_completion_the_template_does_not_render_is_refused(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(EMPTY_ASSISTANT)
    with pytest.raises(ValueError, match=r"line 1: the 'chosen' completion has no tokens after the prompt"):
        read(tmp_path, [{"prompt": [user("Q")], "chosen": [assistant("a")], "rejected": [assistant("b")]}],
             chat_template=str(template))


def test_sources_other_than_records_and_empty_files_are_refused(tmp_path):
    (tmp_path / "pairs.txt").write_text("text")
    with pytest.raises(ValueError, match=r"is read as source 'text', but preference pairs are records"):
        read_pairs(DataConfig(), tmp_path / "pairs.txt", BYTE, 16)
    with pytest.raises(ValueError, match=r"holds no records"):
        read(tmp_path, [])
    with pytest.raises(ValueError, match=r"seq_len=0"):
        read(tmp_path, [{"prompt": "Q", "chosen": " a", "rejected": " b"}], seq_len=0)


# ----- batches for training and evaluation ------------------------------------------


def numbered_pairs(tmp_path, n: int) -> PreferencePairs:
    """`n` pairs whose prompts name their index (so a batch row tells which pair it holds)."""
    return read(tmp_path, [{"prompt": f"{i:02d}", "chosen": "a", "rejected": "b"} for i in range(n)], seq_len=8)


def pair_index(row) -> int:
    return int(bytes(row[1:3].astype(np.uint8)).decode())  # after <bos>


@pytest.mark.quick
def test_training_batches_take_every_pair_once_an_epoch_and_resume_exactly(tmp_path):
    pairs = numbered_pairs(tmp_path, 10)
    it = pair_iterator(pairs, batch_size=4, grad_accum=2, seed=1)  # 2 pairs a batch, 1 in each micro-batch
    batches = [next(it) for _ in range(5)]
    assert batches[0]["inputs"].shape == (2, 2, 8)
    seen = [pair_index(b["inputs"][a, 0]) for b in batches for a in range(2)]
    assert sorted(seen) == list(range(10))  # one epoch: each once
    for b in batches:  # row 2n + 1 is the rejected sequence of row 2n's pair
        np.testing.assert_array_equal(b["inputs"][:, 0, :3], b["inputs"][:, 1, :3])
    state = None
    it = pair_iterator(pairs, batch_size=4, grad_accum=2, seed=1)
    for _ in range(3):
        next(it)
        state = it.get_state()
    resumed = pair_iterator(pairs, batch_size=4, grad_accum=2, seed=1, state=state)
    for want in batches[3:]:
        got = next(resumed)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    it = pair_iterator(pairs, batch_size=4, grad_accum=2, seed=1)
    two = [pair_index(b["inputs"][a, 0]) for b in [next(it) for _ in range(10)] for a in range(2)]
    assert two[:10] == seen and sorted(two[10:]) == list(range(10)) and two[10:] != seen  # epoch 2, reshuffled


@pytest.mark.quick
def test_evaluation_batches_hold_each_pair_once_then_empty_pairs(tmp_path):
    pairs = numbered_pairs(tmp_path, 5)
    batches = list(pair_eval_batches(pairs, batch_size=4))
    assert len(batches) == 3 and batches[0]["inputs"].shape == (1, 4, 8)
    rows = np.concatenate([b["inputs"][0] for b in batches])
    assert [pair_index(r) for r in rows[:10:2]] == list(range(5))
    last = batches[-1]
    assert last["weights"][0, 2:].sum() == 0 and last["segment_ids"][0, 2:].sum() == 0  # padding: no completion
    assert len(list(pair_eval_batches(pairs, batch_size=4, max_pairs=2))) == 1
