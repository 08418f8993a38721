"""Reward functions for configs/grpo.yaml, with TRL's signature (modern_jax.training.rewards):
`f(prompts, completions, **fields) -> list[float | None]`, a completion being a text or, for a
conversation, `[{"role": "assistant", "content": text}]`.

    exact_answer   1 if the completion's last number (digits or a word, zero to eighteen) is the
                   record's `answer`, else 0
    number_last    1 if the completion ends with a number at all, else 0 (a format reward)
"""

from __future__ import annotations

import re

WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen").split()


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def _last_number(text: str) -> int | None:
    words = re.findall(r"[a-z]+|\d+", text.lower())
    if not words:
        return None
    last = words[-1]
    return int(last) if last.isdigit() else WORDS.index(last) if last in WORDS else None


def exact_answer(prompts, completions, answer, **kwargs) -> list[float]:
    return [float(_last_number(_text(c)) == int(a)) for c, a in zip(completions, answer)]


def number_last(prompts, completions, **kwargs) -> list[float]:
    return [float(_last_number(_text(c)) is not None) for c in completions]
