"""Prompts for reinforcement learning (GRPO): records in the format TRL's `GRPOTrainer` reads,
tokenized as it tokenizes them, and the batches of them each step samples completions for.

A record (JSON Lines, Parquet, `datasets`: `modern_jax.data.records`) holds TRL's `prompt`, a
text or a conversation (a list of `{role, content}` messages), and any other fields (an
`answer`, say), which reach the reward functions as keyword arguments of the same names:

    text            {"prompt": "2 + 3 =", "answer": "5"}
    conversation    {"prompt": [{"role": "user", "content": "2 + 3?"}], "answer": "5"}

Tokens: a conversation rendered by the chat template (`corpora.chat_template`) as TRL renders a
prompt (`render_prompt`): after a final user or tool message with the generation prompt, a final
assistant message left open for the completion to continue (any other final role is an error),
then encoded; a text encoded after the tokenizer's `<bos>`. A prompt longer
than `room` tokens (the run's `seq_len` less the completions' `max_completion_length`) is an
error naming its record, as is an empty one.

A step's batch is `batch_size / num_generations` prompts in an epoch's random order (each
epoch its own, `numpy.random.default_rng([seed, epoch])`), each repeated `num_generations`
times in a row (a group), laid out `[grad_accum, rows]` as every batch is; with
`num_iterations` > 1 each batch serves that many steps in a row. A batch is a pure function
of `(seed, index)`, so a resumed run sees the prompts an uninterrupted one sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from modern_jax.data import records
from modern_jax.data.config import RECORD_SOURCES, DataConfig
from modern_jax.data.corpora import chat_template, split_documents
from modern_jax.data.batches import UNBOUNDED, Batches, epoch_order, grain_iterator, spread
from modern_jax.data.preference import render_conversation, value_kind
from modern_jax.data.tokenizers import Tokenizer

PROMPT = "prompt"  # TRL's column name
_SETTING = "prompt_column"  # the setting records.py names in a missing-field error; replaced here


@dataclass(frozen=True)
class Prompts:
    """Tokenized prompts with their records (module docstring)."""

    ids: tuple[np.ndarray, ...]  # each prompt's token ids (int32)
    prompts: tuple  # each as its record holds it: a text or a list of messages (what rewards receive)
    columns: dict[str, tuple]  # the records' other fields, one value per prompt
    names: tuple[str, ...]  # each prompt's record ("file.jsonl, line 3"), for a deterministic split

    def __len__(self) -> int:
        return len(self.ids)

    def subset(self, indices) -> Prompts:
        indices = [int(i) for i in indices]
        return Prompts(tuple(self.ids[i] for i in indices), tuple(self.prompts[i] for i in indices),
                       {k: tuple(v[i] for i in indices) for k, v in self.columns.items()},
                       tuple(self.names[i] for i in indices))


def read_prompts(cfg: DataConfig, tokenizer: Tokenizer, room: int) -> Prompts:
    """The prompts of the records at `cfg.path` (at most `cfg.max_documents`), tokenized by
    `tokenizer`, each at most `room` tokens. Every problem with a record is a ValueError naming
    its file and line (or row)."""
    source = cfg.resolved_source
    if source not in RECORD_SOURCES:
        raise ValueError(f"data.path={str(cfg.path)!r} is read as source {source!r}, but prompts are records with a "
                         f"{PROMPT!r} field: give .jsonl / .parquet files or a Hugging Face dataset (or set "
                         f"data.source: {' / '.join(RECORD_SOURCES)})")
    reader = {"jsonl": records._jsonl, "parquet": records._parquet, "hf": records._hf}[source]
    template, special = chat_template(cfg, tokenizer), tokenizer.special_tokens
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    rows = []
    try:
        for name, where, record in reader(cfg, PROMPT, _SETTING, whole=True):
            prompt = record[PROMPT]
            if value_kind(prompt, PROMPT, where) == "conversation":
                ids = tokenizer.encode(render_prompt(prompt, template, special, where))
            else:
                if not prompt.strip():
                    raise ValueError(f"{where}: field {PROMPT!r} is empty: give the record a prompt")
                try:
                    ids = np.concatenate([np.asarray(bos, np.int32), tokenizer.encode(prompt)])
                except ValueError as e:  # a character the tokenizer has no id for
                    raise ValueError(f"{where}: {e}") from None
            if len(ids) > room:
                raise ValueError(f"{where}: the prompt is {len(ids)} tokens, more than the {room} that train.seq_len "
                                 f"leaves beside grpo.max_completion_length: raise train.seq_len to at least "
                                 f"{len(ids)} + max_completion_length, or shorten the prompt")
            rows.append((name, np.asarray(ids, np.int32), record))
            if cfg.max_documents is not None and len(rows) >= cfg.max_documents:
                break
    except ValueError as e:
        message = str(e)
        if f"(data.{_SETTING})" in message:  # records.py's missing-field error, with the fix for prompts
            raise ValueError(message.replace(f" (data.{_SETTING})", "").replace(
                f"set data.{_SETTING} to the one to read",
                f"a prompt record holds its prompt in the field {PROMPT!r}, as TRL's GRPOTrainer reads it: rename "
                f"that field to {PROMPT!r}")) from None
        raise
    if not rows:
        raise ValueError(f"data.path={str(cfg.path)!r} holds no records")
    fields = [k for k in rows[0][2] if k != PROMPT]
    for name, _, record in rows:
        if [k for k in record if k != PROMPT] != fields:
            raise ValueError(f"{name}: fields {sorted(k for k in record if k != PROMPT)}, but the first record has "
                             f"{sorted(fields)}: give every record the same fields (the reward functions read them)")
    return Prompts(tuple(ids for _, ids, _ in rows), tuple(r[PROMPT] for _, _, r in rows),
                   {k: tuple(r[k] for _, _, r in rows) for k in fields}, tuple(name for name, _, _ in rows))


ANSWERED, CONTINUED = ("user", "tool"), "assistant"  # the roles a prompt may end with
_CONTINUE = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' own mark of the end of the message to continue


def render_prompt(messages: list[dict], template: str, special: dict[str, str], where: str) -> str:
    """A conversation prompt as TRL's `apply_chat_template` renders one: ending with a user's or a
    tool's message, with the generation prompt; with an assistant's, up to the end of its content
    (transformers' `continue_final_message`), which the completion continues; any other role is
    an error naming the record."""
    role = messages[-1]["role"]
    if role in ANSWERED:
        return render_conversation(messages, template, special, where, True)
    if role != CONTINUED:
        raise ValueError(f"{where}: the prompt's last message has the role {role!r}: a prompt ends with a user or "
                         f"tool message (the model answers it) or an assistant message (the model continues it), as "
                         f"TRL reads prompts")
    marked = messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + _CONTINUE}]
    text = render_conversation(marked, template, special, where, False)
    end = text.rfind(_CONTINUE.strip())
    if end < 0:
        raise ValueError(f"{where}: the chat template leaves out the end of the prompt's final assistant message, so "
                         f"no completion can continue it: end the prompt with a user message instead")
    return text[:end] if text.startswith(_CONTINUE, end) else text[:end].rstrip()  # trimmed by the template


def split_prompts(prompts: Prompts, val_fraction: float) -> tuple[Prompts, Prompts]:
    """The deterministic train / validation split by the records' names, as documents split."""
    train, val = split_documents([(name, i) for i, name in enumerate(prompts.names)], val_fraction, whole=True)
    return prompts.subset([i for _, i in train]), prompts.subset([i for _, i in val])


class PromptBatches:
    """Random-access grain source: record `i` is this process's rows of step `i`'s batch, the
    `index` of each row's prompt `[A, R]` and `width`, the longest prompt of the whole batch (every
    process pads to it); the batch of prompts changes every `repeat` steps (module docstring)."""

    def __init__(self, prompts: Prompts, batch_size: int, generations: int, grad_accum: int = 1, seed: int = 0,
                 rows: slice | None = None, repeat: int = 1):
        self.lengths = np.asarray([len(ids) for ids in prompts.ids], np.int64)
        self.seed, self.generations, self.repeat = seed, generations, repeat
        self.n = batch_size // generations
        self.shape = (grad_accum, batch_size // grad_accum)
        self.rows = slice(None) if rows is None else rows

    def __len__(self) -> int:
        return UNBOUNDED

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        chosen = epoch_order(len(self.lengths), self.seed, int(i) // self.repeat * self.n, self.n)
        index = np.repeat(chosen, self.generations).reshape(self.shape)
        return {"index": index[:, self.rows], "width": np.asarray(self.lengths[chosen].max())}


def prompt_iterator(prompts: Prompts, *, batch_size: int, generations: int, grad_accum: int = 1, seed: int = 0,
                    rows: slice | None = None, repeat: int = 1, state: dict | None = None):
    """A grain iterator of `PromptBatches` (this process's `rows`); `state` resumes it exactly."""
    return grain_iterator(PromptBatches(prompts, batch_size, generations, grad_accum, seed, rows, repeat), state)


def prompt_eval_batches(prompts: Prompts, *, batch_size: int, generations: int, max_prompts: int | None = None,
                        rows: slice | None = None) -> Batches:
    """Batches `[1, R]` of the prompts in order (`max_prompts` of them spread evenly), each repeated
    `generations` times; the last batch is filled up with rows that count for nothing (`real` 0)."""
    chosen = spread(np.arange(len(prompts)), max_prompts)
    n, lengths = batch_size // generations, np.asarray([len(ids) for ids in prompts.ids])
    rows = slice(None) if rows is None else rows

    def make():
        for b in range(-(-len(chosen) // n)):
            part = chosen[b * n:(b + 1) * n]
            real = np.repeat(np.arange(n) < len(part), generations)
            index = np.repeat(np.resize(part, n), generations)
            yield {"index": index[rows][None], "real": real[rows][None], "width": np.asarray(lengths[part].max())}

    return Batches(-(-len(chosen) // n), make())
