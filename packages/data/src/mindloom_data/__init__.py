"""mindloom_data: clean, deduplicate and tokenize corpora (no MindSpore)."""

from mindloom_data.__about__ import __version__
from mindloom_data._blend import BlendedDataset, build_datasets
from mindloom_data._corpus import bundled_corpus
from mindloom_data._executors import ExecutorError, LocalExecutor, RayExecutor
from mindloom_data._indexed import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError
from mindloom_data._loader import DataLoader, build_dataloader
from mindloom_data._pack import PackedDataset
from mindloom_data._pipeline import CleanError, clean
from mindloom_data._ranked_tokenize import tokenize_ranks
from mindloom_data._readers import Document, iter_documents
from mindloom_data._safe_yaml import load_yaml as safe_load_yaml
from mindloom_data._tokenize import read_dataset_metadata, tokenize

__all__ = [
    "BlendedDataset",
    "CleanError",
    "DataLoader",
    "Document",
    "ExecutorError",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "LocalExecutor",
    "PackedDataset",
    "RayExecutor",
    "__version__",
    "build_dataloader",
    "build_datasets",
    "bundled_corpus",
    "clean",
    "iter_documents",
    "safe_load_yaml",
    "read_dataset_metadata",
    "tokenize",
    "tokenize_ranks",
]
