"""Input data: corpora and records, token shards and mixtures, conversations, tokenizers and the grain pipeline
(packing, per-host shards)."""

from modern_jax.data.config import DataConfig
from modern_jax.data.corpora import Mixture, TokenStream, embedded_documents, load_splits, load_stream, split_documents
from modern_jax.data.batches import BATCH_KEYS, eval_batches, pack_windows, train_iterator
from modern_jax.data.tokenizers import ByteTokenizer, CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BATCH_KEYS",
    "ByteTokenizer",
    "CharTokenizer",
    "DataConfig",
    "HFTokenizer",
    "Mixture",
    "TokenStream",
    "Tokenizer",
    "embedded_documents",
    "eval_batches",
    "load_splits",
    "load_stream",
    "load_tokenizer",
    "pack_windows",
    "split_documents",
    "train_iterator",
]
