"""Model cards: the ``README.md`` of a model folder, YAML front matter (license, base model) and a short text, as on
the Hugging Face hub. The tiny and SmolLM2 folders get one when they are built, and every final model a run saves
gets one that carries its start model's license and base model on (flows/controller/run_publish.py). MLflow logs the
card with the model; without one, it looks the local folder up on the model hub and warns that it found no card or
license."""

from __future__ import annotations

import os

TINY_CARD = {"license": "apache-2.0"}  # random weights made by rlflow (rlworkers.models.tiny): the project's license
SMOLLM2_CARD = {"license": "apache-2.0", "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # Hugging Face's


def write_model_card(folder: str | os.PathLike, data: dict, title: str, description: str) -> None:
    """``README.md`` in ``folder`` (any fsspec path): a text-generation model card with ``data`` in its header."""
    import fsspec
    from huggingface_hub import ModelCardData

    header = ModelCardData(library_name="transformers", pipeline_tag="text-generation", **data).to_yaml()
    with fsspec.open(f"{os.fspath(folder)}/README.md", "w", encoding="utf-8") as file:
        file.write(f"---\n{header}\n---\n\n# {title}\n\n{description}\n")


def read_model_card_data(folder: str | os.PathLike) -> dict:
    """The license and base model in ``folder``'s model card (any fsspec path); {} without a card."""
    import fsspec
    from huggingface_hub import ModelCard

    try:
        with fsspec.open(f"{os.fspath(folder).rstrip('/')}/README.md", "r", encoding="utf-8") as file:
            data = ModelCard(file.read()).data.to_dict()
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return {key: data[key] for key in ("license", "base_model") if data.get(key)}
