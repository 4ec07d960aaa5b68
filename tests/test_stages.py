"""Stage tasks through ``.fn()`` with stand-in worker groups: what ``@timed`` records, and what the flows read."""

from __future__ import annotations

import torch

from flows import stages
from flows.stages import generate_sequences, update_actor
from rlworkers.protocol import DataProto


class StandInActor:
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        return DataProto.from_dict({"responses": torch.ones(2, 3)})

    def update_actor(self, batch: DataProto) -> DataProto:
        return DataProto(meta_info={"metrics": {"actor/pg_loss": [1.0, 3.0]}})  # one value per rank


def _clock(monkeypatch, *readings: float) -> None:
    ticks = iter(readings)
    monkeypatch.setattr(stages.time, "perf_counter", lambda: next(ticks))


def test_a_stage_that_returns_a_batch_records_its_time_in_meta_info(monkeypatch):
    _clock(monkeypatch, 10.0, 12.5)
    out = generate_sequences.fn(StandInActor(), DataProto.from_dict({"input_ids": torch.zeros(2, 3)}), step=1)
    assert out.meta_info == {"timing_s/gen": 2.5}


def test_the_update_reports_its_time_beside_those_its_batch_carries(monkeypatch):
    batch = DataProto.from_dict({"input_ids": torch.zeros(2, 3)})
    batch.meta_info.update(
        {
            "timing_s/gen": 2.5,
            "timing_s/adv": 0.25,
            "data_metrics": {"critic/score/mean": 0.5},
            "kl_ctrl_state": {"value": 0.1},
        }
    )
    _clock(monkeypatch, 100.0, 101.0)
    result = update_actor.fn(StandInActor(), batch, step=1)
    assert result.metrics == {
        "actor/pg_loss": 2.0,
        "critic/score/mean": 0.5,
        "timing_s/gen": 2.5,
        "timing_s/adv": 0.25,
        "timing_s/update_actor": 1.0,
    }
    assert result.kl_ctrl_state == {"value": 0.1}


def test_one_task_run_name_format_made_by_the_stages_and_read_by_recovery():
    assert stages.update_actor.task_run_name == "update_actor-step-{step}"  # Prefect fills in the step
    assert stages.task_run_name("sft_step", 4, 7) == "sft_step-step-4-to-7"
    assert stages.task_run_name("sft_step", 4, 4) == "sft_step-step-4"
    assert stages.is_task_run_of_step("update_actor-step-12", 12)
    assert stages.is_task_run_of_step("sft_step-step-4-to-7", 4)
    assert not stages.is_task_run_of_step("update_actor-step-12", 2)  # a suffix of another step's number
    assert not stages.is_task_run_of_step("sft_step-step-4-to-7", 7)  # a block belongs to its first step
