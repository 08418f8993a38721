"""Tokenizers: byte-level (default), character-level, and Hugging Face `tokenizer.json`.

Every tokenizer maps text to a 1-D integer array and back, names its `bos_id` / `eos_id`
(the packer puts them around each document), and says how many bytes of text each id
stands for (`token_bytes`, for bits-per-byte). It saves itself as one JSON file.

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

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    kind: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes of text each id stands for ([vocab_size] int32; 0 for specials)."""
        raise NotImplementedError

    def to_json(self) -> dict:
        raise NotImplementedError

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

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in np.asarray(ids).reshape(-1) if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.array([1] * 256 + [0] * len(self.SPECIALS), np.int32)

    def to_json(self) -> dict:
        return {"kind": "byte"}


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

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in map(int, np.asarray(ids).reshape(-1)) if 0 <= i < len(self.chars))

    def token_bytes(self) -> np.ndarray:
        return np.array([len(c.encode("utf-8")) for c in self.chars] + [0, 0], np.int32)

    def to_json(self) -> dict:
        return {"kind": "char", "chars": "".join(self.chars)}


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers.Tokenizer` (the optional `hf` extra)."""

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
        tokenizers = _import_tokenizers()
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int) -> HFTokenizer:
        """A byte-level BPE trained on `texts` with `vocab_size` ids, `<bos>` and `<eos>` included."""
        tokenizers = _import_tokenizers()
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
        return {"kind": "hf", "tokenizer": json.loads(self.tok.to_str())}


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ValueError("data.tokenizer='hf' needs the `tokenizers` package: uv sync --extra hf") from None
    return tokenizers


def tokenizer_from_json(spec: dict) -> Tokenizer:
    kind = spec.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        if not isinstance(spec.get("chars"), str):
            raise ValueError("a saved char tokenizer needs its vocabulary as a string `chars`")
        return CharTokenizer(spec["chars"])
    if kind == "hf":
        tokenizers = _import_tokenizers()
        return HFTokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec["tokenizer"])))
    raise ValueError(f"unknown tokenizer kind {kind!r} in a saved tokenizer")


def load_tokenizer(path) -> Tokenizer:
    """A tokenizer saved by `Tokenizer.save`, or a Hugging Face `tokenizer.json`."""
    from modern_jax.configfile import read_json

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
