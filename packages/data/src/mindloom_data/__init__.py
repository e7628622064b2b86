"""mindloom_data: clean, deduplicate and tokenize corpora (no MindSpore).

Besides the stages (`clean`, `tokenize`, the datasets and the loader), the clean stage's
parts are public for experiments and benchmarks: the filters (`build_filters` over
`TextInfo`), the `Normalizer`, the `MinHasher`, the web steps and readers, and, loaded on
first use because of their models, the HTML `Extractor` and the `LanguageIdentifier`.
"""

import importlib
from typing import Any

from mindloom_data.__about__ import __version__
from mindloom_data._blend import BlendedDataset, build_datasets
from mindloom_data._clean_config import DEFAULTS as CLEAN_DEFAULTS
from mindloom_data._corpus import bundled_corpus
from mindloom_data._documents import ReadStats
from mindloom_data._executors import ExecutorError, LocalExecutor, RayExecutor
from mindloom_data._filter_base import TextInfo
from mindloom_data._filters import build_filters
from mindloom_data._indexed import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError
from mindloom_data._loader import DataLoader, build_dataloader
from mindloom_data._minhash import MinHasher
from mindloom_data._normalize import Normalizer
from mindloom_data._pack import PackedDataset
from mindloom_data._pipeline import CleanError, clean
from mindloom_data._ranked_tokenize import tokenize_ranks
from mindloom_data._readers import Document, iter_documents
from mindloom_data._safe_yaml import load_yaml as safe_load_yaml
from mindloom_data._tokenize import read_dataset_metadata, tokenize
from mindloom_data._web import WEB_DEFAULTS, WebSteps
from mindloom_data._web_read import iter_web_file

# loaded on first use: their imports load models (resiliparse/trafilatura, lingua)
_LAZY = {"Extractor": "_extract", "LanguageIdentifier": "_langid"}

__all__ = [
    "__version__",
    "BlendedDataset",
    "build_dataloader",
    "build_datasets",
    "build_filters",
    "bundled_corpus",
    "clean",
    "CLEAN_DEFAULTS",
    "CleanError",
    "DataLoader",
    "Document",
    "ExecutorError",
    "Extractor",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "iter_documents",
    "iter_web_file",
    "LanguageIdentifier",
    "LocalExecutor",
    "MinHasher",
    "Normalizer",
    "PackedDataset",
    "RayExecutor",
    "read_dataset_metadata",
    "ReadStats",
    "safe_load_yaml",
    "TextInfo",
    "tokenize",
    "tokenize_ranks",
    "WEB_DEFAULTS",
    "WebSteps",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mindloom_data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mindloom_data.{module}"), name)
    globals()[name] = value
    return value
