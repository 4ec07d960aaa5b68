"""Run configuration: presets, overrides, validation messages, flattening for MLflow, and which rows a run uses."""

from __future__ import annotations

import json

import pytest

from flows.config import ConfigError, apply_overrides, flatten, load_config, resolve_preset
from flows.rows import dataset_rows
from flows.runtime import Run


def test_preset_and_overrides():
    config = load_config("demo", ["trainer.total_steps=7", "actor.optim.lr=2e-4", "data.train_files=[a.jsonl]"])
    assert config.trainer.total_steps == 7 and config.actor.optim.lr == 2e-4
    assert config.data.train_files == ["a.jsonl"]
    assert config.rollout.n == 8  # from the preset
    with pytest.raises(FileNotFoundError, match="presets"):
        resolve_preset("no-such-preset")
    with pytest.raises(ValueError, match="key.path=value"):
        apply_overrides({}, ["trainer.total_steps"])


def test_errors_name_the_field():
    with pytest.raises(ConfigError) as info:
        load_config("demo", ["rollout.top_p=2", "trainer.n_workers=0"])
    assert "rollout.top_p" in str(info.value) and "trainer.n_workers" in str(info.value)
    with pytest.raises(ConfigError, match="rollout.stop is supported by the vllm backend only"):
        load_config("demo", ["rollout.stop=[x]"])
    with pytest.raises(ConfigError, match="fault_injection"):
        load_config("demo", ["trainer.fault_injection=boom"])
    # Ray Client addresses are taken as they are (tests/test_cluster.py runs a lineage through one)
    assert load_config("demo", ["trainer.ray_address=ray://head:10001"]).trainer.ray_address == "ray://head:10001"


def test_flatten_gives_dotted_params():
    flat = flatten(load_config("demo"))
    assert flat["actor.optim.lr"] == 1e-4 and flat["trainer.run_name"] == "demo-grpo"
    assert not any(isinstance(v, dict) for v in flat.values())


def test_validation_rows_fall_back_to_training_files(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(12)))
    config = load_config(
        "demo",
        [
            f"data.train_files=[{path}]",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=32",
            "actor.ppo_micro_batch_size_per_gpu=16",
        ],
    )
    assert [r["prompt"] for r in dataset_rows(config, "validation")] == [f"{i}+1=" for i in range(12)]
    builtin = load_config("demo", [f"trainer.runs_dir={tmp_path}"])
    train, val = dataset_rows(builtin, "train"), dataset_rows(builtin, "validation")
    assert len(train) == 2000 and len(val) == 200
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}


def test_step_blocks_end_where_validation_or_a_checkpoint_is_due_and_rewind():
    config = load_config(
        "demo-sft", ["trainer.total_steps=11", "trainer.test_freq=5", "trainer.save_freq=3", "trainer.steps_per_task=4"]
    )
    run = Run(config=config, algorithm="sft", root="", tokenizer=None, loader=None, val_rows=[], tracker=None)
    assert list(run.step_blocks(4)) == [[1, 2, 3], [4, 5], [6], [7, 8, 9], [10], [11]]
    assert list(run.steps) == list(range(1, 12))
    blocks = run.step_blocks(4)
    assert next(blocks) == [1, 2, 3] and next(blocks) == [4, 5]
    run.redo_from = 4  # what recovery does after restoring the step-3 checkpoint
    assert list(blocks) == [[4, 5], [6], [7, 8, 9], [10], [11]]
