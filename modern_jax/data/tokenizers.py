"""Tokenizers: byte-level (default), character-level, and Hugging Face `tokenizer.json`.

Every tokenizer maps text to a 1-D integer array and back (`encode_offsets` also gives the
characters each id covers, for the chat loss mask), names its `bos_id` / `eos_id` (the
packer puts them around each document), and says how many bytes of text each id stands
for (`token_bytes`, for bits-per-byte). It may carry a chat template and the special-token
strings a template reads (`bos_token`, `eos_token`, ...; a Hugging Face tokenizer takes
both from the `tokenizer_config.json` or `chat_template.jinja` beside its `tokenizer.json`).
It saves itself, template included, as one JSON file.

| kind  | ids                                                   | vocab          |
|-------|-------------------------------------------------------|----------------|
| byte  | 0..255 the UTF-8 bytes; 256 `<pad>`, 257 `<bos>`, 258 `<eos>`, 259 `<mask>` | 260 |
| char  | the corpus' characters in code-point order; then `<bos>`, `<eos>` | chars + 2 |
| hf    | a `tokenizers` model (a file, or a BPE trained on the corpus) | its own |
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable

import numpy as np

from modern_jax import paths

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # the strings a chat template may read


class Tokenizer:
    kind: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None = None  # Jinja source; None: modern_jax.data.chat.BUILTIN_TEMPLATE
    special_tokens: dict[str, str] = {}  # e.g. {"eos_token": "<|im_end|>"}, for the chat template

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(ids, start, end)`: the ids of `text` and the characters `text[start:end]` each covers."""
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes of text each id stands for ([vocab_size] int32; 0 for specials)."""
        raise NotImplementedError

    def to_json(self) -> dict:
        raise NotImplementedError

    def with_chat(self, template: str | None, special_tokens: dict[str, str] | None = None) -> Tokenizer:
        """This tokenizer with a chat template (and special-token strings); returns itself."""
        self.chat_template = template
        if special_tokens is not None:
            self.special_tokens = dict(special_tokens)
        return self

    def _chat_json(self) -> dict:
        out = {"chat_template": self.chat_template} if self.chat_template is not None else {}
        return {**out, "special_tokens": self.special_tokens} if self.special_tokens else out

    def save(self, directory) -> pathlib.Path:
        path = pathlib.Path(directory) / TOKENIZER_FILE
        path.write_text(json.dumps(self.to_json()))
        return path


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes, plus four specials after them."""

    kind = "byte"
    SPECIALS = ("<pad>", "<bos>", "<eos>", "<mask>")
    vocab_size = 256 + len(SPECIALS)
    pad_id, bos_id, eos_id, mask_id = 256, 257, 258, 259

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def encode_offsets(self, text: str):
        codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        n_bytes = 1 + (codes >= 0x80) + (codes >= 0x800) + (codes >= 0x10000)  # UTF-8 length of each character
        start = np.repeat(np.arange(len(codes)), n_bytes)
        return self.encode(text), start, start + 1

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in np.asarray(ids).reshape(-1) if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.array([1] * 256 + [0] * len(self.SPECIALS), np.int32)

    def to_json(self) -> dict:
        return {"kind": "byte", **self._chat_json()}


class CharTokenizer(Tokenizer):
    """One id per character of the corpus (code-point order), then `<bos>` and `<eos>`."""

    kind = "char"

    def __init__(self, chars: Iterable[str]):
        self.chars = sorted(set(chars))
        if any(len(c) != 1 for c in self.chars):
            raise ValueError("a character vocabulary holds single characters")
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.bos_id, self.eos_id = len(self.chars), len(self.chars) + 1
        self.vocab_size = len(self.chars) + 2
        self._lookup = np.full(max(map(ord, self.chars), default=0) + 1, -1, np.int32)
        self._lookup[[ord(c) for c in self.chars]] = np.arange(len(self.chars), dtype=np.int32)

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        return cls(chars)

    def encode(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        ids = np.where(codes < len(self._lookup), self._lookup[np.minimum(codes, len(self._lookup) - 1)], -1)
        if (ids < 0).any():
            missing = sorted({chr(c) for c in codes[ids < 0]})[:10]
            raise ValueError(f"characters outside the char tokenizer's vocabulary: {missing!r}")
        return ids.astype(np.int32)

    def encode_offsets(self, text: str):
        start = np.arange(len(text))
        return self.encode(text), start, start + 1

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in map(int, np.asarray(ids).reshape(-1)) if 0 <= i < len(self.chars))

    def token_bytes(self) -> np.ndarray:
        return np.array([len(c.encode("utf-8")) for c in self.chars] + [0, 0], np.int32)

    def to_json(self) -> dict:
        return {"kind": "char", "chars": "".join(self.chars), **self._chat_json()}


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers.Tokenizer`."""

    kind = "hf"

    def __init__(self, tokenizer, bos: str | None = None, eos: str | None = None):
        self.tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special(bos, ("<bos>", "<s>", "<|begin_of_text|>", "<|endoftext|>"))
        self.eos_id = self._special(eos, ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>"))

    def _special(self, name, candidates):
        for candidate in (name,) if name else candidates:
            token_id = self.tok.token_to_id(candidate)
            if token_id is not None:
                return token_id
        if name:
            raise ValueError(f"the tokenizer has no token {name!r}")
        return None

    @classmethod
    def from_file(cls, path) -> HFTokenizer:
        """A `tokenizer.json`, with the special tokens and chat template of the `tokenizer_config.json`
        (and `chat_template.jinja`) beside it."""
        import tokenizers

        path = pathlib.Path(path)
        template, special = read_tokenizer_config(path.parent)
        tok = cls(tokenizers.Tokenizer.from_file(str(path)), special.get("bos_token"), special.get("eos_token"))
        return tok.with_chat(template, special)

    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int) -> HFTokenizer:
        """A byte-level BPE trained on `texts` with `vocab_size` ids, `<bos>` and `<eos>` included."""
        import tokenizers
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<bos>", "<eos>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_offsets(self, text: str):
        encoding = self.tok.encode(text, add_special_tokens=False)
        offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
        return np.asarray(encoding.ids, np.int32), offsets[:, 0], offsets[:, 1]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=True)

    def token_bytes(self) -> np.ndarray:
        out = np.zeros(self.vocab_size, np.int32)
        specials = {i for i in (self.bos_id, self.eos_id) if i is not None}
        for i in range(self.vocab_size):
            if i not in specials:
                out[i] = len(self.tok.decode([i], skip_special_tokens=True).encode("utf-8"))
        return out

    def to_json(self) -> dict:
        return {"kind": "hf", "tokenizer": json.loads(self.tok.to_str()), **self._chat_json()}


def read_tokenizer_config(directory) -> tuple[str | None, dict[str, str]]:
    """`(chat template, special-token strings)` of a Hugging Face tokenizer directory: its
    `chat_template.jinja`, else the `chat_template` of its `tokenizer_config.json` (a list of
    named templates gives the one named `default`); `(None, {})` without either file."""
    from modern_jax.configfile import read_json

    directory = pathlib.Path(directory)
    config = read_json(directory / TOKENIZER_CONFIG) if (directory / TOKENIZER_CONFIG).is_file() else {}
    special = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        template = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    return (template if isinstance(template, str) else None), special


def tokenizer_from_json(spec: dict) -> Tokenizer:
    kind = spec.get("kind")
    special = spec.get("special_tokens") or {}
    if kind == "byte":
        tok = ByteTokenizer()
    elif kind == "char":
        if not isinstance(spec.get("chars"), str):
            raise ValueError("a saved char tokenizer needs its vocabulary as a string `chars`")
        tok = CharTokenizer(spec["chars"])
    elif kind == "hf":
        import tokenizers

        tok = HFTokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec["tokenizer"])), special.get("bos_token"),
                          special.get("eos_token"))
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r} in a saved tokenizer")
    return tok.with_chat(spec.get("chat_template"), special)


def load_tokenizer(path) -> Tokenizer:
    """A tokenizer saved by `Tokenizer.save`, or a Hugging Face `tokenizer.json`."""
    from modern_jax.configfile import read_json

    if paths.is_remote(path):  # the tokenizer libraries read local files: a copy of it and its companions
        import tempfile

        with tempfile.TemporaryDirectory(prefix="modern-jax-tokenizer-") as local:
            return load_tokenizer(_copied(paths.as_path(path), pathlib.Path(local)))
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    spec = read_json(path)
    try:
        if "kind" in spec:
            return tokenizer_from_json(spec)
        return HFTokenizer.from_file(path)  # a plain Hugging Face tokenizer.json
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    except Exception as e:  # the `tokenizers` library raises a bare Exception on a malformed file
        raise ValueError(f"{path}: not a tokenizer this library or Hugging Face `tokenizers` can read "
                         f"({type(e).__name__}: {e})") from None


def _copied(path, local: pathlib.Path) -> pathlib.Path:
    """The tokenizer at `path` on object storage (a file, or a directory holding `tokenizer.json`)
    copied into `local`, with the files `HFTokenizer.from_file` reads beside it."""
    file = path / TOKENIZER_FILE if path.is_dir() else path
    for name in (file.name, TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE):
        if (file.parent / name).is_file():
            paths.copy(file.parent / name, local / name)
    return local / file.name
