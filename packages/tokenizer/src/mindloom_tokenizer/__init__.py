"""mindloom_tokenizer: train, load, evaluate and export tokenizers (see the package README)."""

from mindloom_tokenizer.__about__ import __version__
from mindloom_tokenizer._export import export_hf
from mindloom_tokenizer._readers import ReadStats, iter_texts
from mindloom_tokenizer._tokenizer import Tokenizer, TokenizerError
from mindloom_tokenizer._train import train_tokenizer
from mindloom_tokenizer.inputs import NoInputError, discover_inputs

__all__ = [
    "NoInputError",
    "ReadStats",
    "Tokenizer",
    "TokenizerError",
    "__version__",
    "discover_inputs",
    "export_hf",
    "iter_texts",
    "train_tokenizer",
]
