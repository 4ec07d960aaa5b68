"""One-step-off training against on-policy, on the demo's job, measured in one run (``async_training``).

The demo's SFT warm-up once (``--sft-steps``, or ``--model`` to start from a model of your own), then the demo's GRPO
from it five ways, the same seed and steps: on-policy (``async_training.staleness=0``, the demo's bypass mode), one
step off (``staleness=1``) in bypass mode (the PPO ratio against the policy that sampled: verl's one-step-off
default), one step off with the old log-probs recomputed and truncated importance weights (``bypass_mode=false``,
``algorithm.rollout_correction.rollout_is=token``: one forward pass more per step), one step off with them
recomputed and nothing to correct (``async_training.allow_uncorrected=true``), and one step off in bypass mode on a
rollout pool of its own (below). Prints each run's held-out accuracy
(greedy, the 200 validation prompts), its median step time and that time's ratio to the on-policy run's, and each
one-step-off final model against the on-policy one on the same examples, with the promotion gate's paired test. The
servers are those of `rlflow server up`, started for it on free ports in a temporary folder.

The first four share one pool (the actor's workers generate): the generation ahead runs there before the update, not
beside it, so their step times show the pipeline's cost. The fifth has a rollout process of its own
(``rollout.n_workers=1``) beside the demo's two actor processes: on a 2-core machine the three share the cores.

    .venv/bin/python bench/staleness.py [--grpo-steps 30] [--sft-steps 700] [--model PATH]

Whether a kind of prompt is starved: the addition task's prompts are of two kinds, the sums with a carry in some
column and those without (which kind is the harder one for a model is measured: its held-out accuracy on each).
For each way the bench prints how many prompts of each kind it trained on (the batches its loader handed out up to
the position its final checkpoint holds: a dropped or regenerated batch would move that position) and its held-out
accuracy on each kind, each paired against the on-policy model's on the same prompts.

``--config real --sft-steps 0`` runs the same five ways on SmolLM2-135M-Instruct (configs/real.yaml: 2-digit sums
asked in its chat template, 8 prompts x 4 samples a step) from the preset's own start model, without a warm-up.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_description, machine_speed  # noqa: E402 (after ROOT joins the path)
from flows.ops.services import free_port  # noqa: E402

CORRECTION = "algorithm.rollout_correction"
WAYS = {  # the demo's GRPO is in bypass mode: the PPO ratio against the policy that sampled
    "on-policy": [],
    "one step off, bypass": ["async_training.staleness=1"],
    "one step off, rollout_is=token": [
        "async_training.staleness=1",
        f"{CORRECTION}.bypass_mode=false",
        f"{CORRECTION}.rollout_is=token",
    ],
    "one step off, uncorrected": [
        "async_training.staleness=1",
        f"{CORRECTION}.bypass_mode=false",
        "async_training.allow_uncorrected=true",
    ],
    "one step off, bypass, rollout pool of 1": ["async_training.staleness=1", "rollout.n_workers=1"],
}


def train(flow: str, preset: str, work: Path, name: str, *settings: str) -> float:
    line = [
        str(work / ".venv" / "bin" / "rlflow"), "train", flow, "--config", preset, f"trainer.run_name={name}",
        "trainer.log_model=false", *settings,
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(line, cwd=work, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{shlex.join(line)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return time.perf_counter() - start


SUM = re.compile(r"(\d+)\s*\+\s*(\d+)")


def carries(prompt) -> bool:
    """Whether the prompt's sum ``a + b`` carries in some column (a plain prompt, or a chat's messages)."""
    text = prompt if isinstance(prompt, str) else " ".join(message["content"] for message in prompt)
    a, b = SUM.search(text).groups()
    width = max(len(a), len(b))
    return any(int(x) + int(y) >= 10 for x, y in zip(a.zfill(width), b.zfill(width), strict=True))


def trained_prompts(preset: str, work: Path, settings: list[str], loader_state: dict) -> list[dict]:
    """The prompt rows a run's loader handed out before it reached ``loader_state`` (its final checkpoint's)."""
    from flows.config import load_config
    from flows.controller.rows import dataset_rows
    from rlworkers.data.datasets import PromptDataLoader

    config = load_config(preset, [f"trainer.runs_dir={work / 'runs'}", *settings])
    data = config.data
    loader = PromptDataLoader(
        dataset_rows(config, "train"), batch_size=data.train_batch_size, shuffle=data.shuffle, seed=config.trainer.seed
    )
    handed = []
    while (loader.state.epoch, loader.state.position) != (loader_state["epoch"], loader_state["position"]):
        handed += loader.next_batch()
    return handed


def by_kind(results, kind: bool):
    """``results`` on the held-out prompts that carry (``kind`` True) or do not."""
    from flows.lineages.evaluation import EvalResults

    rows = [row for row in results.rows if carries(row["prompt"]) == kind]
    return EvalResults(results.set, results.label, results.fingerprint, results.model, rows, results.step)


def median_step(run_name: str) -> float:
    """The median ``timing_s/step`` of the MLflow run named ``run_name`` (its first step, the warm-up, left out)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    experiment = client.get_experiment_by_name("rlflow")
    run = client.search_runs([experiment.experiment_id], filter_string=f"tags.`rlflow.run_name` = '{run_name}'")[0]
    steps = sorted(client.get_metric_history(run.info.run_id, "timing_s/step"), key=lambda m: m.step)
    return statistics.median(m.value for m in steps[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpo-steps", type=int, default=30)
    parser.add_argument("--sft-steps", type=int, default=700)
    parser.add_argument("--model", help="start the GRPO runs from this model instead of an SFT warm-up")
    parser.add_argument("--config", default="demo", help="the GRPO preset (demo, or real: SmolLM2-135M-Instruct)")
    args = parser.parse_args()

    from flows.lineages.evaluation import EvalResults, compare, describe, details, results_path
    from flows.ops.preflight import apply_service_env
    from flows.ops.services import ServiceConfig, start_services, stop_services
    from rlworkers.checkpoint import read_json

    print(f"CPU: {cpu_description()}; {machine_speed()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rlflow-staleness-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        (work / ".venv").symlink_to(Path(sys.executable).parent.parent)
        config = ServiceConfig(
            state_dir=Path(tmp) / "home", prefect_port=free_port(), mlflow_port=free_port(), ray_port=free_port()
        )
        os.environ["PYTHONPATH"] = str(ROOT)
        urls = start_services(config)
        try:
            apply_service_env(urls)
            model = args.model
            if model is None and args.sft_steps > 0:
                seconds = train("sft", "demo-sft", work, "warm", f"trainer.total_steps={args.sft_steps}",
                                "trainer.test_freq=0", "trainer.save_freq=0")  # fmt: skip
                model = str(work / "runs" / "warm" / "final_model")
                print(f"SFT warm-up: {args.sft_steps} steps in {seconds:.0f} s", flush=True)
            finals, steps = {}, {}
            for index, (way, settings) in enumerate(WAYS.items()):
                name = f"way{index}"
                steps_settings = [
                    *([f"model.path={model}"] if model else []), f"trainer.total_steps={args.grpo_steps}",
                    f"trainer.test_freq={args.grpo_steps}", f"trainer.save_freq={args.grpo_steps}", *settings,
                ]  # fmt: skip
                seconds = train("grpo", args.config, work, name, *steps_settings)
                finals[way] = EvalResults(**read_json(results_path(str(work / "runs" / name), "final", "validation")))
                steps[way] = median_step(name)
                final = work / "runs" / name / "checkpoints" / f"step_{args.grpo_steps}"
                trained = trained_prompts(
                    args.config, work, steps_settings, read_json(final / "trainer_state.json")["loader"]
                )
                hard = sum(carries(row["prompt"]) for row in trained)
                print(
                    f"{way}: held-out accuracy {finals[way].mean:.1%} ({len(finals[way].rows)} prompts; with a "
                    f"carry {by_kind(finals[way], True).mean:.1%}, without {by_kind(finals[way], False).mean:.1%}), "
                    f"trained on {len(trained)} prompts ({hard} with a carry), median step {steps[way]:.3f} s "
                    f"({steps[way] / steps['on-policy']:.2f}x on-policy's), run {seconds:.0f} s",
                    flush=True,
                )
            for way in list(WAYS)[1:]:
                comparison = compare(
                    finals[way], finals["on-policy"], "the on-policy model", confidence=0.95, margin=0.0
                )
                kinds = [
                    f"with{'' if kind else 'out'} a carry, "
                    + details(compare(by_kind(finals[way], kind), by_kind(finals["on-policy"], kind),
                                      "the on-policy model", confidence=0.95, margin=0.0))
                    for kind in (True, False)
                ]  # fmt: skip
                print(f"{way}: {describe(comparison)}; on the prompts {'; '.join(kinds)}")
        finally:
            stop_services(config)


if __name__ == "__main__":
    main()
