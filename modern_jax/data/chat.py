"""Conversations: a chat template renders a record's `messages` to text, and the loss mask
keeps the assistant's turns only.

A conversation is a list of `{"role": ..., "content": ...}` messages. It is rendered with
a Jinja chat template exactly as transformers renders one (`apply_chat_template`): a
sandboxed jinja2 environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension, `tojson`, `raise_exception` and `strftime_now`, and the variables `messages`,
`add_generation_prompt` (false) and the tokenizer's special tokens (`bos_token`,
`eos_token`, ...). The template is the tokenizer's (the `chat_template` of a Hugging Face
`tokenizer_config.json`, or `chat_template.jinja` beside it), or `data.chat_template`, or,
for a tokenizer without one (byte, char, a trained BPE), `BUILTIN_TEMPLATE`:

    <|user|>
    What is 2 + 2?<|end|>
    <|assistant|>
    4<|end|>

The trained characters are, as transformers' `return_assistant_tokens_mask` marks them, the
text inside the template's `{% generation %} ... {% endgeneration %}` blocks (the built-in
template wraps each assistant message's content and its `<|end|>` newline). A template
without such blocks (most published ones) trains each assistant message's content (found in
the rendered text in message order) and the tokenizer's `eos_token` when it follows at once
(`<|im_end|>`, `<|eot_id|>`), so the model learns to end its turn. Everything else, the
system and user turns and the template's own markup, has weight 0. A token is trained when
any character it covers is.
"""

from __future__ import annotations

import datetime
import functools
import json

import numpy as np

BUILTIN_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}<|end|>\n{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] }}<|end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
OPEN, CLOSE = "\ue000", "\ue001"  # private-use characters that bracket a generation block while rendering


class TemplateError(ValueError):
    """A chat template that cannot render a conversation."""


def check_messages(messages, where: str, field: str) -> list[dict]:
    """`messages` is a non-empty list of `{role: str, content: str}` objects, else a ValueError naming `where`."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: data.messages_field={field!r} holds {type(messages).__name__} "
                         f"{str(messages)[:60]!r}, expected a non-empty list of {{role, content}} messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {i} of {field!r} is {str(message)[:80]}, expected an object "
                             "with a string role and a string content")
        if OPEN in message["content"] or CLOSE in message["content"]:
            raise ValueError(f"{where}: message {i} holds the private-use characters U+E000 / U+E001, which "
                             "mark the trained text while rendering: remove them")
    return messages


@functools.cache
def compile_template(source: str):
    """The jinja2 template of `source`, compiled as transformers compiles chat templates (plus the
    `generation` tag); a syntax error is a TemplateError naming the line."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %} ... {% endgeneration %}`: the text the model is trained to write."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return OPEN + caller() + CLOSE

    def raise_exception(message):
        raise TemplateError(f"the chat template refused the conversation: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"the chat template does not parse (line {e.lineno}: {e.message})") from None


def render(messages: list[dict], template: str, special_tokens: dict[str, str], where: str
           ) -> tuple[str, list[tuple[int, int]]]:
    """`(text, trained character spans [start, end))` of one conversation (module docstring)."""
    import jinja2

    try:
        marked = compile_template(template).render(messages=messages, add_generation_prompt=False, tools=None,
                                                   documents=None, **special_tokens)
    except TemplateError as e:
        raise TemplateError(f"{where}: {e}") from None
    except jinja2.TemplateError as e:
        raise TemplateError(f"{where}: the chat template failed on this conversation ({type(e).__name__}: {e})") \
            from None
    if OPEN in marked:
        return _generation_spans(marked)
    return marked, _content_spans(marked, messages, special_tokens.get("eos_token"), where)


def _generation_spans(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without the block marks, and the spans the blocks held."""
    pieces = marked.replace(CLOSE, OPEN + CLOSE).split(OPEN)
    text, spans, n, start = [pieces[0]], [], len(pieces[0]), 0
    for piece in pieces[1:]:
        if piece.startswith(CLOSE):  # the text after a block
            spans.append((start, n))
            piece = piece[1:]
        else:  # a block's text
            start = n
        text.append(piece)
        n += len(piece)
    return "".join(text), [(s, e) for s, e in spans if e > s]


def _content_spans(text: str, messages: list[dict], eos: str | None, where: str) -> list[tuple[int, int]]:
    spans, at = [], 0
    for i, message in enumerate(messages):
        content = message["content"].strip()
        if not content:
            continue
        found = text.find(content, at)
        if found < 0:
            raise TemplateError(f"{where}: the chat template does not render message {i} ({message['role']}) as "
                                "given, so its tokens cannot be found; mark the assistant turns with "
                                "{% generation %} ... {% endgeneration %} in the template (data.chat_template)")
        at = found + len(content)
        if message["role"] == "assistant":
            end = at + len(eos) if eos and text.startswith(eos, at) else at
            spans.append((found, end))
            at = end
    return spans


def trained_tokens(starts: np.ndarray, ends: np.ndarray, spans: list[tuple[int, int]], n_chars: int) -> np.ndarray:
    """Per token `[start, end)` of characters: whether it covers a trained character."""
    marked = np.zeros(n_chars + 1, np.int64)
    for s, e in spans:
        marked[s] += 1
        marked[e] -= 1
    cum = np.concatenate([[0], np.cumsum(np.cumsum(marked)[:-1] > 0)])  # trained characters before each index
    ends = np.maximum(ends, np.minimum(starts + 1, n_chars))  # a token of no width counts the character at it
    return cum[ends] - cum[starts] > 0
