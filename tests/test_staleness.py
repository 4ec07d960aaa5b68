"""Bounded staleness (``async_training``): which generations are submitted ahead of an update, the config's
refusals, and the staleness each update measures from the policy version its batch carries. The run itself (a GRPO
flow one step off) is tests/test_flows.py's ``test_one_step_off_trains_each_batch_one_update_behind``; the workers'
policy versions, tests/test_workers.py's ``test_an_update_measures_its_batchs_staleness_from_its_policy_version``."""

from __future__ import annotations

import pytest

from flows.config import ConfigError, load_config
from flows.controller.rows import RunInputs
from flows.controller.runtime import Run

CORRECTED = ["algorithm.rollout_correction.bypass_mode=false", "algorithm.rollout_correction.rollout_is=token"]


def run_of(*overrides: str) -> Run:
    config = load_config("demo", [*CORRECTED, *overrides])
    inputs = RunInputs(train_rows=[], val_rows=[], eval_sets=[], template_kwargs={})
    return Run(config=config, algorithm="grpo", root="", tokenizer=None, loader=None, inputs=inputs, tracker=None)


def submitted_by_step(run: Run) -> dict[int, list]:
    """Drive ``submit_stale_ahead`` as a flow does: step s takes its generation (submitted ahead or now), then
    submits ahead before its update. Returns, per step, the (step, after) of each generation it submitted."""
    calls: dict[int, list] = {}

    def generate(step, after=None):
        calls[current].append((step, after))
        return f"gen{step}"

    for current in run.steps:
        calls[current] = []
        gen = run.submitted_ahead(current) or generate(current)
        waited = run.submit_stale_ahead(current, gen, generate)
        assert waited == [f"gen{step}" for step, _ in calls[current] if step != current]
    return calls


def test_one_step_off_submits_the_next_generation_before_each_update_and_drains_at_a_checkpoint():
    calls = submitted_by_step(run_of("async_training.staleness=1", "trainer.total_steps=5", "trainer.save_freq=3",
                                     "trainer.test_freq=0"))  # fmt: skip
    # step 1 samples on-policy and submits step 2's after its own; none across the step-3 checkpoint; none past the end
    assert calls == {
        1: [(1, None), (2, ["gen1"])],
        2: [(3, ["gen2"])],
        3: [],
        4: [(4, None), (5, ["gen4"])],
        5: [],
    }


def test_staleness_k_keeps_k_generations_in_flight_each_after_the_one_before():
    calls = submitted_by_step(run_of("async_training.staleness=2", "trainer.total_steps=5", "trainer.save_freq=0",
                                     "trainer.test_freq=0"))  # fmt: skip
    assert calls == {
        1: [(1, None), (2, ["gen1"]), (3, ["gen2"])],
        2: [(4, ["gen3"])],
        3: [(5, ["gen4"])],
        4: [],
        5: [],
    }


def test_on_policy_submits_nothing_before_the_update():
    run = run_of("trainer.total_steps=3", "trainer.save_freq=0", "trainer.test_freq=0")
    assert run.config.async_training.staleness == 0
    calls = submitted_by_step(run)
    assert calls == {1: [(1, None)], 2: [(2, None)], 3: [(3, None)]}


def test_the_config_refuses_staleness_without_a_correction_unless_asked():
    with pytest.raises(ConfigError, match="allow_uncorrected=true"):
        load_config("demo", ["async_training.staleness=1", "algorithm.rollout_correction.bypass_mode=false"])
    bypass = load_config("demo", ["async_training.staleness=1"])  # the demo's bypass mode: verl's one-step-off
    assert bypass.algorithm.rollout_correction.bypass_mode and bypass.async_training.staleness == 1
    uncorrected = load_config(
        "demo",
        ["async_training.staleness=1", "algorithm.rollout_correction.bypass_mode=false",
         "async_training.allow_uncorrected=true"],
    )  # fmt: skip
    assert uncorrected.async_training.staleness == 1
    rejection = [
        "algorithm.rollout_correction.rollout_rs=seq_max_k3",
        "algorithm.rollout_correction.rollout_rs_threshold=10",
    ]
    load_config("demo", ["async_training.staleness=1", "algorithm.rollout_correction.bypass_mode=false", *rejection])
    with pytest.raises(ConfigError, match="async_training.staleness"):
        load_config("demo", ["async_training.staleness=-1"])


def test_a_flow_without_a_policy_gradient_refuses_staleness():
    config = load_config("demo", [*CORRECTED, "async_training.staleness=1"])
    config.check_algorithm("grpo")
    for flow in ("sft", "online_dpo"):
        with pytest.raises(ValueError, match=f"the {flow} flow has none"):
            config.check_algorithm(flow)


def test_on_a_rollout_pool_of_its_own_the_update_does_not_wait_for_the_generations_ahead():
    run = run_of("async_training.staleness=1", "trainer.total_steps=3", "trainer.save_freq=0", "trainer.test_freq=0")
    run.use_workers({"actor": "actor group", "rollout": "rollout group"})
    assert run.rollout_of_its_own()
    assert run.submit_stale_ahead(1, "gen1", lambda step, after: f"gen{step}") == []  # it runs beside the update
    assert run.ahead == {2: "gen2"}
    run.use_workers({"actor": "actor group", "rollout": "actor group"})
    assert not run.rollout_of_its_own()
    assert run.rollout_ready() is None and run.rollout_ready(["update"]) == ["update"]
