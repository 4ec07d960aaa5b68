"""Prompt datasets (parquet/jsonl via fsspec), a resumable seeded batch loader, and built-in synthetic tasks."""

from rlworkers.data.datasets import LoaderState, PromptDataLoader, load_prompt_dataset
from rlworkers.data.synthetic import addition_rows, ensure_addition_dataset, make_addition_dataset

__all__ = [
    "LoaderState",
    "PromptDataLoader",
    "addition_rows",
    "ensure_addition_dataset",
    "load_prompt_dataset",
    "make_addition_dataset",
]
