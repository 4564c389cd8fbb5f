"""Data pipeline: tokenizer -> examples from JSONL -> fixed-shape batches."""

from harli_train.data.dataset import load_examples
from harli_train.data.example import IGNORE_INDEX, DataError, Example
from harli_train.data.loader import DataLoader
from harli_train.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "ByteTokenizer",
    "DataError",
    "DataLoader",
    "Example",
    "HFTokenizer",
    "Tokenizer",
    "load_examples",
    "load_tokenizer",
]
