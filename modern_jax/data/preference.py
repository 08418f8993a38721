"""Preference pairs for DPO: records in the formats Hugging Face TRL's `DPOTrainer` reads,
tokenized as it tokenizes them, laid out as fixed-length rows weighted on the completions only.

A record (JSON Lines, Parquet, `datasets`: `modern_jax.data.records`) holds TRL's columns
`chosen`, `rejected` and, optionally, `prompt`; each is a text or a conversation (a list of
`{role, content}` messages):

    explicit, text          {"prompt": "Q: 2 + 2?", "chosen": " 4", "rejected": " 5"}
    explicit, conversation  {"prompt": [user ...], "chosen": [assistant ...], "rejected": [assistant ...]}
    implicit                {"chosen": [user, assistant], "rejected": [user, assistant]}  (or two texts)

An implicit prompt is the start that `chosen` and `rejected` share, cut as TRL's
`extract_prompt` cuts it: at the first message (or character) where they differ, or before
the last one when one is the start of the other; a text prompt gives a space it would end
with to the completions. A `prompt` of the other kind than the completions (a text beside
whole conversations, as in `ultrafeedback_binarized`) is ignored and the prompt extracted
the same way (TRL's `maybe_extract_prompt`); a conversation `prompt` beside text completions
is an error. Whether the records have a `prompt` is decided by the first one; a later record
without one (or with a null `prompt`) is an error. So are a completion that is empty (blank text, or messages of blank
content), a pair whose two completions are the same, and implicit conversations that part at a
message other than the assistant's (a user or system message: they ask different questions).
Each error names the record: its file and line (JSON Lines, from 1) or row (Parquet and
`datasets`, from 0).

Tokens, as TRL 1.x's `DPOTrainer._prepare_dataset` makes them:

- a conversation: the prompt rendered by the chat template (`corpora.chat_template`) with the
  generation prompt, and prompt + chosen, prompt + rejected rendered whole, each encoded;
- a text: the prompt, prompt + chosen and prompt + rejected each encoded after the
  tokenizer's `<bos>` (as this repository's text documents start; TRL's tokenizer call adds
  whatever special tokens its tokenizer adds), the completions ending in `<eos>` (TRL appends
  `eos_token` to a completion that does not already end with it).

The prompt is the tokens its own encoding shares with both whole encodings (TRL's
`common_prefix_length`: when a template renders the prompt alone otherwise, or a token merges
across the boundary, the completions start earlier), and each completion is the rest of its
whole encoding. Everything after the prompt is trained, for a conversation the template's
markup after the answer too (`<|im_end|>\n`), as TRL trains it.

Truncation is TRL's default (`truncation_mode="keep_start"`) with `max_length` T + 1,
T = `seq_len`: each sequence (prompt + completion) keeps its first T + 1 tokens, so a long
completion loses its end. A prompt of T + 1 tokens or more leaves no completion token: TRL drops
such a pair, here it is an error naming the record.

Layout, per pair (T + 1 tokens make T next-token targets, as a window of `batches.pack_windows`;
letters of the package legend, the pairs in words):

    tokens    int32   [pairs, 2, T + 1]  index 0 chosen, 1 rejected: prompt, completion, then 0s
    weights   float32 [pairs, 2, T]      1 iff tokens[p, c, t + 1] is a completion token
    lengths   int32   [pairs, 2]         tokens of each sequence
    prompts   int32   [pairs]            tokens of the prompt (the same in both sequences)

`batch_of` makes the training batch of some pairs: the `batches.BATCH_KEYS` arrays of
`[2N, T]`, row 2n the chosen and row 2n + 1 the rejected sequence of pair n, each one document
(positions from 0, segment 1, padding segment 0), exactly as `pack_windows` lays out a window
that holds that sequence alone. The iterators' batches also carry each sequence's `lengths`, by
which `packed` lays a batch's sequences into fewer rows, several to a row (the DPO objective
packs each batch into the fewest rows of its width that hold it), `sequence` naming each
token's sequence.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass


import numpy as np

from modern_jax.data import chat, records
from modern_jax.data.config import RECORD_SOURCES, DataConfig
from modern_jax.data.corpora import chat_template, split_documents
from modern_jax.data.batches import UNBOUNDED, Batches, epoch_order, grain_iterator, spread
from modern_jax.data.tokenizers import Tokenizer

PROMPT, CHOSEN, REJECTED = "prompt", "chosen", "rejected"  # TRL's column names
COLUMNS = f"{PROMPT!r} (optional), {CHOSEN!r}, {REJECTED!r}"
_SETTING = "preference_column"  # the setting records.py names in a missing-field error; replaced here


@dataclass(frozen=True)
class PreferencePairs:
    """Tokenized preference pairs (module docstring, Layout)."""

    tokens: np.ndarray  # int32 [pairs, 2, T + 1]
    weights: np.ndarray  # float32 [pairs, 2, T]
    lengths: np.ndarray  # int32 [pairs, 2]
    prompts: np.ndarray  # int32 [pairs]
    names: tuple[str, ...]  # each pair's record ("file.jsonl, line 3"), for a deterministic split

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def seq_len(self) -> int:
        return self.weights.shape[-1]


def read_pairs(cfg: DataConfig, path, tokenizer: Tokenizer, seq_len: int) -> PreferencePairs:
    """The preference pairs of the records at `path` (None: `cfg.path`; at most
    `cfg.max_documents`), tokenized by `tokenizer` (conversations rendered by `cfg.chat_template`,
    else the tokenizer's, else the built-in template) into sequences of at most `seq_len + 1`
    tokens. Every problem with a record is a ValueError naming its file and line (or row)."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r}: expected a positive number of tokens")
    cfg = cfg if path is None else cfg.replace(path=str(path))
    source = cfg.resolved_source
    if source not in RECORD_SOURCES:
        raise ValueError(f"data.path={str(cfg.path)!r} is read as source {source!r}, but preference pairs are "
                         f"records with the fields {COLUMNS}: give .jsonl / .parquet files or a Hugging Face "
                         f"dataset (or set data.source: {' / '.join(RECORD_SOURCES)})")
    template, special = chat_template(cfg, tokenizer), tokenizer.special_tokens
    width = seq_len + 1
    rows = []
    for name, where, prompt, chosen, rejected in _records(cfg, source):
        prompt, chosen, rejected = _split_prompt(prompt, chosen, rejected, where)
        try:
            ids = _tokenize(prompt, chosen, rejected, tokenizer, template, special, where)
        except ValueError as e:  # a character the tokenizer has no id for
            raise ValueError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
        rows.append((name, _check_fits(*ids, width, where)))
    if not rows:
        raise ValueError(f"data.path={str(cfg.path)!r} holds no records")

    # the module docstring's layout: [pairs, 2, T + 1], [pairs, 2] and [pairs]
    tokens = np.zeros((len(rows), 2, width), np.int32)
    completion = np.zeros((len(rows), 2, width), bool)
    lengths = np.zeros((len(rows), 2), np.int32)
    prompts = np.zeros(len(rows), np.int32)
    cut = 0
    for p, (_, (prompt_ids, *completions)) in enumerate(rows):
        prompts[p] = len(prompt_ids)
        for c, completion_ids in enumerate(completions):
            sequence = np.concatenate([prompt_ids, completion_ids])[:width]  # keep_start
            cut += len(prompt_ids) + len(completion_ids) > width
            tokens[p, c, : len(sequence)] = sequence
            completion[p, c, len(prompt_ids) : len(sequence)] = True
            lengths[p, c] = len(sequence)
    if cut:
        warnings.warn(f"{cut} of the {2 * len(rows)} sequences of data.path={str(cfg.path)!r} are longer than seq_len "
                      f"+ 1 = {width} tokens and lose the end of their completion", stacklevel=2)
    return PreferencePairs(tokens, completion[..., 1:].astype(np.float32), lengths, prompts,
                           tuple(name for name, _ in rows))


def batch_of(pairs: PreferencePairs, indices) -> dict[str, np.ndarray]:
    """The training batch of the pairs `indices` (N of them): `[2N, T]` arrays, row 2n chosen and
    row 2n + 1 rejected (module docstring)."""
    indices = np.asarray(indices, np.int64).reshape(-1)
    tokens = pairs.tokens[indices].reshape(2 * len(indices), -1)  # [B, T + 1], B = 2N rows: chosen, rejected, ...
    T = tokens.shape[1] - 1
    valid_BT = np.arange(T) < pairs.lengths[indices].reshape(-1, 1)  # an input token, not padding
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": np.where(valid_BT, np.arange(T, dtype=np.int32), 0).astype(np.int32),
        "segment_ids": valid_BT.astype(np.int32),
        "weights": pairs.weights[indices].reshape(2 * len(indices), T),
    }


def subset(pairs: PreferencePairs, indices) -> PreferencePairs:
    """The pairs `indices` of `pairs`, in that order."""
    indices = np.asarray(indices, np.int64)
    return PreferencePairs(pairs.tokens[indices], pairs.weights[indices], pairs.lengths[indices],
                           pairs.prompts[indices], tuple(pairs.names[i] for i in indices))


def split_pairs(pairs: PreferencePairs, val_fraction: float) -> tuple[PreferencePairs, PreferencePairs]:
    """The deterministic train / validation split of the pairs by their records' names, as
    documents and conversations split (`corpora.split_documents`)."""
    named = [(name, i) for i, name in enumerate(pairs.names)]
    train, val = split_documents(named, val_fraction, whole=True)
    return subset(pairs, [i for _, i in train]), subset(pairs, [i for _, i in val])


class PairBatches:
    """Random-access grain source: record `i` is global batch `i`, `[A, R, T]` arrays of
    `batch_size / 2` pairs (every pair once per epoch, each epoch in its own order:
    `numpy.random.default_rng([seed, epoch]).permutation`) and their sequences' `lengths` `[A, R]`,
    so a batch is a pure function of `(seed, i)` and a resumed run sees the batches an
    uninterrupted one sees. Every process holds the whole batch: `packed` lays it into the rows
    the step takes, of which each process passes its own."""

    def __init__(self, pairs: PreferencePairs, batch_size: int, grad_accum: int = 1, seed: int = 0):
        self.pairs, self.seed, self.n = pairs, seed, batch_size // 2
        self.shape = (grad_accum, batch_size // grad_accum)

    def __len__(self) -> int:
        return UNBOUNDED

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        indices = epoch_order(len(self.pairs), self.seed, int(i) * self.n, self.n)
        batch = batch_of(self.pairs, indices)  # [2n, T]: pairs stay in one micro-batch (A divides n)
        return {**{k: v.reshape(*self.shape, -1) for k, v in batch.items()},
                "lengths": self.pairs.lengths[indices].reshape(self.shape)}


def pair_iterator(pairs: PreferencePairs, *, batch_size: int, grad_accum: int = 1, seed: int = 0,
                  state: dict | None = None):
    """A grain iterator of training batches of pairs; `state` (from `.get_state()`) resumes it exactly."""
    return grain_iterator(PairBatches(pairs, batch_size, grad_accum, seed), state)


def pair_eval_batches(pairs: PreferencePairs, *, batch_size: int, max_pairs: int | None = None) -> Batches:
    """Batches `[1, R, T]` of the pairs in order (`max_pairs` of them spread evenly), with their
    `lengths`; the last is filled up with empty pairs (no token: `objectives.dpo.preference_sums`
    counts them out)."""
    chosen = spread(np.arange(len(pairs)), max_pairs)
    n = batch_size // 2

    def make():
        for b in range(-(-len(chosen) // n)):
            indices = chosen[b * n:(b + 1) * n]
            batch = batch_of(pairs, indices)
            pad = 2 * n - len(batch["inputs"])
            yield {**{k: np.pad(v, ((0, pad), (0, 0)))[None] for k, v in batch.items()},
                   "lengths": np.pad(pairs.lengths[indices].reshape(-1), (0, pad))[None]}

    return Batches(-(-len(chosen) // n), make())


def packed(batch: dict, lengths: np.ndarray, rows: int, width: int) -> dict | None:
    """The sequences of `batch` (`[A, R, T]` arrays, row r of micro-batch a one sequence of
    `lengths[a, r]` tokens) laid into `rows` rows of `width` tokens, None if they do not fit: with
    `rows` = R each in its own row, else longest first, each into the first row with room (a
    sequence of L tokens takes its L - 1 inputs, the last token being a target only), each its own
    segment with positions from 0, as `pack_windows` packs documents. `sequence` holds each
    token's row in `batch` (the sequence it belongs to: chosen 2n, rejected 2n + 1), 0 on padding
    (no weight)."""
    A, R = lengths.shape
    slots = np.maximum(lengths - 1, 0)
    out = {k: np.zeros((A, rows, width), v.dtype) for k, v in batch.items()}
    out["sequence"] = np.zeros((A, rows, width), np.int32)
    for a in range(A):
        fill, count = np.zeros(rows, np.int64), np.zeros(rows, np.int32)
        for r in np.argsort(-slots[a], kind="stable"):
            n = int(slots[a, r])
            if n == 0:  # an empty pair's (padding)
                continue
            room = [r] if rows == R else np.flatnonzero(fill + n <= width)
            if not len(room) or fill[room[0]] + n > width:
                return None
            row = room[0]
            at = slice(fill[row], fill[row] + n)
            for key in ("inputs", "targets", "weights"):
                out[key][a, row, at] = batch[key][a, r, :n]
            count[row] += 1
            out["positions"][a, row, at] = np.arange(n)
            out["segment_ids"][a, row, at] = count[row]
            out["sequence"][a, row, at] = r
            fill[row] += n
    return out


# ----- records -------------------------------------------------------------------


def _column(cfg: DataConfig, source: str, field: str):
    """`(name, where, value)` of `field` in every record, by the reader of records.py."""
    reader = {"jsonl": records._jsonl, "parquet": records._parquet, "hf": records._hf}[source]
    try:
        yield from reader(cfg, field, _SETTING)
    except ValueError as e:
        raise _missing_column(e, field) from None


def _missing_column(e: ValueError, field: str) -> ValueError:
    """records.py's missing-field error with the fix for preference records."""
    message = str(e)
    if f"(data.{_SETTING})" not in message:
        return e
    fix = (f"a preference record holds the fields {COLUMNS}, as TRL's DPOTrainer reads them: rename the "
           f"field that holds the {field} text or messages to {field!r}")
    return ValueError(message.replace(f" (data.{_SETTING})", "").replace(f"set data.{_SETTING} to the one to read",
                                                                          fix))


def _records(cfg: DataConfig, source: str):
    """`(name, where, prompt or None, chosen, rejected)` of every record (at most `max_documents`);
    the first record says whether records have a prompt."""
    prompts = _column(cfg, source, PROMPT)
    n = 0
    for (name, where, chosen), (_, _, rejected) in zip(_column(cfg, source, CHOSEN), _column(cfg, source, REJECTED)):
        prompt = None
        if prompts is not None:
            try:
                prompt = next(prompts, (None, None, None))[2]
            except ValueError as e:
                missing = f": no field {PROMPT!r}"
                if missing not in str(e):
                    raise
                if n:
                    raise ValueError(f"{str(e).split(missing)[0]}: no field {PROMPT!r}, but the records before it "
                                     f"have one: give every record a {PROMPT!r}, or none (the prompt is then the "
                                     f"start that {CHOSEN!r} and {REJECTED!r} share)") from None
                prompts = None  # the first record has none: implicit prompts
            if prompts is not None and prompt is None:
                raise ValueError(f"{where}: field {PROMPT!r} is null: give the record its prompt, or leave the field "
                                 f"out of every record (the prompt is then the start that {CHOSEN!r} and "
                                 f"{REJECTED!r} share)")
        yield name, where, prompt, chosen, rejected
        n += 1
        if cfg.max_documents is not None and n >= cfg.max_documents:
            return


def value_kind(value, field: str, where: str) -> str:
    """`text` or `conversation` (checked), else a ValueError naming the record and the field."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value:
        chat.check_messages(value, where, field)
        return "conversation"
    raise ValueError(f"{where}: field {field!r} holds {type(value).__name__} {str(value)[:60]!r}, expected a text or "
                     "a non-empty list of {role, content} messages")


def _split_prompt(prompt, chosen, rejected, where: str):
    """`(prompt, chosen, rejected)` of one kind, the prompt extracted when it is implicit (module docstring);
    completions that are empty or the same, and implicit conversations that part before an answer, refused."""
    kind = value_kind(chosen, CHOSEN, where)
    if value_kind(rejected, REJECTED, where) != kind:
        raise ValueError(f"{where}: {CHOSEN!r} is a {kind} but {REJECTED!r} is not: give both as texts or both as "
                         "lists of messages")
    prompt_kind = None if prompt is None else value_kind(prompt, PROMPT, where)
    if prompt_kind == kind:
        return _check_completions(prompt, chosen, rejected, where, "")
    if prompt_kind == "conversation":
        raise ValueError(f"{where}: {PROMPT!r} is a conversation but {CHOSEN!r} and {REJECTED!r} are texts: give the "
                         f"completions as lists of assistant messages, or the prompt as a text")
    n = _shared_start(chosen, rejected)
    if n == 0:
        got = f"{PROMPT!r} is a {prompt_kind} and " if prompt_kind else ""
        raise ValueError(f"{where}: {got}{CHOSEN!r} and {REJECTED!r} are {kind}s that do not start alike, so they hold "
                         f"no prompt: give the prompt as a {kind} in {PROMPT!r}, or whole {kind}s (prompt and "
                         f"completion) in {CHOSEN!r} and {REJECTED!r}")
    if kind == "conversation":
        parted = next((m for m in (chosen[n], rejected[n]) if m["role"] != "assistant"), None)
        if parted is not None:
            raise ValueError(f"{where}: {CHOSEN!r} and {REJECTED!r} part at message {n}, a {parted['role']} message, "
                             f"not an assistant's answer, so they answer different questions: give both the same "
                             f"messages up to the answer they differ in")
    return _check_completions(chosen[:n], chosen[n:], rejected[n:], where, " after the start both share")


def _check_completions(prompt, chosen, rejected, where: str, cut: str):
    """The pair, unless a completion is empty (blank text, or messages of blank content) or both are the same."""
    for field, completion in ((CHOSEN, chosen), (REJECTED, rejected)):
        text = completion if isinstance(completion, str) else "".join(m["content"] for m in completion)
        if not text.strip():
            raise ValueError(f"{where}: the {field!r} completion is empty{cut}: give {field!r} an answer, or remove "
                             f"the record")
    if chosen == rejected:
        raise ValueError(f"{where}: the {CHOSEN!r} and {REJECTED!r} completions are the same, so the pair teaches "
                         f"nothing (its loss has no gradient): make {REJECTED!r} the worse answer, or remove the "
                         f"record")
    return prompt, chosen, rejected


def _shared_start(chosen, rejected) -> int:
    """The length of the implicit prompt as TRL's `extract_prompt` cuts it."""
    shorter = min(len(chosen), len(rejected))
    n = next((i for i in range(shorter) if chosen[i] != rejected[i]), max(shorter - 1, 0))
    return n - 1 if n > 0 and chosen[n - 1] == " " else n


# ----- tokens --------------------------------------------------------------------


def render_conversation(messages: list[dict], template: str, special: dict[str, str], where: str, generation_prompt: bool) -> str:
    """A conversation as the chat template renders it (`chat.render`'s environment, here with
    the generation prompt when asked); generation marks are dropped."""
    import jinja2

    try:
        marked = chat.compile_template(template).render(messages=messages, add_generation_prompt=generation_prompt,
                                                        tools=None, documents=None, **special)
    except chat.TemplateError as e:
        raise chat.TemplateError(f"{where}: {e}") from None
    except jinja2.TemplateError as e:
        raise chat.TemplateError(f"{where}: the chat template failed on this conversation ({type(e).__name__}: {e})"
                                 ) from None
    return marked.replace(chat.OPEN, "").replace(chat.CLOSE, "")


def _tokenize(prompt, chosen, rejected, tokenizer: Tokenizer, template: str, special: dict[str, str], where: str):
    """`(prompt ids, chosen completion ids, rejected completion ids)` (module docstring)."""
    if isinstance(prompt, list):
        prompt_ids = tokenizer.encode(render_conversation(prompt, template, special, where, True))
        wholes = [tokenizer.encode(render_conversation(prompt + c, template, special, where, False)) for c in (chosen, rejected)]
    else:
        bos = np.asarray([] if tokenizer.bos_id is None else [tokenizer.bos_id], np.int32)
        eos_token = special.get("eos_token")

        def encode(text, end=False):
            eos = end and tokenizer.eos_id is not None and not (eos_token and text.endswith(eos_token))
            eos_ids = np.asarray([tokenizer.eos_id] if eos else [], np.int32)
            return np.concatenate([bos, tokenizer.encode(text), eos_ids])

        prompt_ids = encode(prompt)
        wholes = [encode(prompt + c, end=True) for c in (chosen, rejected)]
    n = min(_common_prefix(prompt_ids, whole) for whole in wholes)
    return prompt_ids[:n], *(whole[n:] for whole in wholes)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _check_fits(prompt_ids, chosen_ids, rejected_ids, width: int, where: str):
    """The ids, unless a sequence of `width` tokens would hold no completion token."""
    for field, ids in ((CHOSEN, chosen_ids), (REJECTED, rejected_ids)):
        if not len(ids):
            raise ValueError(f"{where}: the {field!r} completion has no tokens after the prompt: give it some text")
    if not len(prompt_ids):
        raise ValueError(f"{where}: the prompt has no tokens, so no token comes before the first completion token "
                         f"to predict it: give {PROMPT!r} some text")
    if len(prompt_ids) >= width:
        raise ValueError(f"{where}: the prompt is {len(prompt_ids)} tokens, so a sequence of seq_len + 1 = {width} tokens "
                         f"holds none of the completions: raise seq_len to at least {len(prompt_ids)} or shorten "
                         f"the {PROMPT!r}")
    return prompt_ids, chosen_ids, rejected_ids
