"""`make demo`: the whole product on this machine in a few minutes.

1. starts the local Prefect and MLflow servers (`rlflow server up`);
2. SFT-warms the tiny offline model on 2-digit addition (configs/demo-sft.yaml), as a Prefect flow on Ray;
3. runs GRPO from the SFT model (configs/demo.yaml);
4. prints the validation accuracy before and after each phase, and where to look in the Prefect and MLflow UIs.

`make demo-real` (`rlflow demo --model smollm2-135m-instruct`) does the same with a real pretrained chat model,
SmolLM2-135M-Instruct, the sums asked in its chat template with GSM8K's "#### answer" format: SFT warm-up
(configs/real-sft.yaml), then GRPO (configs/real-gsm8k.yaml). configs/real.yaml is GRPO alone from the base model.

`make demo-agent` (`rlflow demo --agent`): SmolLM2-135M-Instruct and a calculator tool on 4-digit sums: an SFT
warm-up on demonstrations of the tool call (configs/agent-sft.yaml), then GRPO on whole trajectories
(configs/agent.yaml).

`make demo-agent-env` (`rlflow demo --environment`): SmolLM2-135M-Instruct in a multi-turn environment
(rlworkers.agents.examples:RetryArithmetic) that answers a wrong sum with "Wrong, try again." twice: GRPO alone
(configs/agent-env.yaml), and how many answers were right at the first try and how many after feedback.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table

console = Console()


def _val_history(run_id: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return [
        (m.step, m.value)
        for m in sorted(MlflowClient().get_metric_history(run_id, "val/score/mean"), key=lambda m: m.step)
    ]


REAL_MODEL = "smollm2-135m-instruct"
AGENT = "agent"  # `rlflow demo --agent`: SmolLM2 learns to call a calculator tool (configs/agent*.yaml)
ENVIRONMENT = "agent-env"  # `rlflow demo --environment`: SmolLM2 with "wrong, try again" feedback (GRPO alone)


PRESETS = {  # model -> (SFT preset, GRPO preset, what the table measures)
    "tiny": ("demo-sft", "demo", "2-digit addition, 200 held-out sums, greedy exact match"),
    REAL_MODEL: (
        "real-sft",
        "real-gsm8k",
        'SmolLM2-135M-Instruct: 200 held-out sums in its chat template, greedy, the number after "####"',
    ),
    AGENT: (
        "agent-sft",
        "agent",
        "SmolLM2-135M-Instruct with a calculator tool: 100 held-out 4-digit sums, greedy, several turns",
    ),
    ENVIRONMENT: (
        None,
        "agent-env",
        "SmolLM2-135M-Instruct, 'Wrong, try again.' twice: 200 held-out 2-digit sums, greedy, score 1/(1 + retries)",
    ),
}


def main(
    sft_steps: int | None = None,
    grpo_steps: int | None = None,
    model: str = "tiny",
    agent: bool = False,
    environment: bool = False,
) -> None:
    from flows.config import load_config, runs_root
    from flows.launch import run_training
    from flows.ops.preflight import apply_service_env
    from flows.ops.services import ServiceConfig, start_services

    if model not in PRESETS or model in (AGENT, ENVIRONMENT):
        raise ValueError(f"rlflow demo --model {model!r}: use 'tiny' (the default) or {REAL_MODEL!r}")
    if agent and environment:
        raise ValueError("rlflow demo: --agent or --environment, not both")
    model = AGENT if agent else ENVIRONMENT if environment else model
    sft_preset, grpo_preset, title = PRESETS[model]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    prefix = {"tiny": "demo", REAL_MODEL: "demo-real", AGENT: "demo-agent", ENVIRONMENT: "demo-agent-env"}[model]
    sft_overrides = [f"trainer.run_name={prefix}-sft-{stamp}", "trainer.resume=never"]
    if sft_steps:
        sft_overrides += [
            f"trainer.total_steps={sft_steps}",
            f"trainer.save_freq={sft_steps}",
            f"trainer.test_freq={sft_steps}",
        ]
    sft_config = load_config(sft_preset, sft_overrides) if sft_preset else None
    grpo_overrides = [f"trainer.run_name={prefix}-grpo-{stamp}", "trainer.resume=never"]
    if grpo_steps:
        grpo_overrides += [f"trainer.total_steps={grpo_steps}"]
    load_config(grpo_preset, grpo_overrides)  # validate both configs before anything starts
    urls = start_services(ServiceConfig())
    apply_service_env(urls)

    phases = []
    if sft_config is not None:
        console.rule(f"1/2  SFT warm-up ({sft_preset})")
        started = time.time()
        run_training("sft", sft_config)
        phases.append(("sft", sft_config, time.time() - started))
        grpo_overrides.append(f"model.path={runs_root(sft_config)}/final_model")
        console.rule(f"2/2  GRPO from the SFT model ({grpo_preset})")
    else:
        console.rule(f"GRPO ({grpo_preset})")
    grpo_config = load_config(grpo_preset, grpo_overrides)
    started = time.time()
    run_training("grpo", grpo_config)
    phases.append(("grpo", grpo_config, time.time() - started))
    _report(urls, phases, title)


def _report(urls: dict, phases: list[tuple], title: str) -> None:
    """The accuracy table (first and last validation of each phase's MLflow run) and where to look."""
    from mlflow.tracking import MlflowClient

    from flows.config import runs_root

    client = MlflowClient()
    experiment_id = client.get_experiment_by_name(phases[0][1].trainer.project_name).experiment_id
    table = Table("phase", "steps", "val accuracy before", "val accuracy after", "wall time", title=title)
    links = []
    for phase, config, seconds in phases:
        name = config.trainer.run_name
        run = client.search_runs([experiment_id], filter_string=f"tags.`rlflow.run_name` = '{name}'")[0]
        history = _val_history(run.info.run_id)
        table.add_row(phase, str(history[-1][0]), f"{history[0][1]:.1%}", f"{history[-1][1]:.1%}", f"{seconds:.0f} s")
        links.append(f"  {phase}: {urls['mlflow_ui']}/#/experiments/{experiment_id}/runs/{run.info.run_id}")
    console.print(table)
    for phase, config, _ in phases:
        console.print(f"{phase}: {paired_test(config)}")
        if config.rollout.multi_turn.environment:
            console.print(f"{phase}: {tries(config)}")
    console.print(f"done in {sum(seconds for _, _, seconds in phases):.0f} s")
    console.print("MLflow runs:\n" + "\n".join(links))
    console.print(f"Prefect UI (flow runs, task runs per stage, checkpoint artifacts): {urls['prefect_ui']}")
    console.print(f"MLflow UI (metrics, params, sample generations, model): {urls['mlflow_ui']}")
    console.print("Checkpoints and final models: " + " and ".join(runs_root(config) for _, config, _ in phases))
    console.print("Stop the servers with `.venv/bin/rlflow server down`.")


def tries(config) -> str:
    """For an environment scored 1 / (1 + retries) (RetryArithmetic): how many held-out answers were right at the
    first try, and how many only after the environment's feedback, before and after training."""
    from flows.config import runs_root
    from flows.lineages.evaluation import EvalResults, results_path
    from rlworkers.checkpoint import read_json

    counts = []
    for label in ("start", "final"):
        rows = EvalResults(**read_json(results_path(runs_root(config), label, config.eval.primary_set))).rows
        first = sum(row["score"] >= 1.0 for row in rows)
        later = sum(0.0 < row["score"] < 1.0 for row in rows)
        counts.append(f"{label} model {first} of {len(rows)} right at the first try, {later} more after feedback")
    return "; ".join(counts)


def paired_test(config) -> str:
    """The run's final model against its start model on the same held-out examples, as the promotion gate compares
    (flows/lineages/evaluation.py): the difference with its interval, how many examples went up and down, and the exact
    test."""
    from flows.config import runs_root
    from flows.lineages.evaluation import EvalResults, compare, describe, results_path
    from rlworkers.checkpoint import read_json

    root, primary = runs_root(config), config.eval.primary_set
    start, final = (EvalResults(**read_json(results_path(root, label, primary))) for label in ("start", "final"))
    comparison = compare(final, start, "its start model", confidence=config.eval.confidence, margin=config.eval.margin)
    return f"the final model on {primary!r} is {describe(comparison)}"
