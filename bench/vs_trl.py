"""GRPO samples per second: rlflow against TRL's ``GRPOTrainer`` on the same job, both measured in one run.

The job, for both sides read from configs/demo.yaml (the GRPO half of `make demo`): GRPO on the built-in 2-digit
addition task (rlworkers.data.synthetic, 2000 training sums) from one SFT-warmed tiny model, ``--steps`` steps of
32 prompts x 8 samples, 4 new tokens at temperature 1.0, lr 1e-4 (AdamW, constant), KL loss to the reference with
coefficient 0.001 (k3), PPO clip 0.2, one epoch of two optimizer steps of 128 samples per step (forward/backward 64
samples at a time), group-normalised advantages, token-mean loss, float32, seed 0, and the reward rlflow uses for
the task (``reward.reward_fn`` = auto -> exact answer, rlworkers.rewards; TRL calls it through an adapter).

- rlflow runs as a user runs it, in a child process:
  ``rlflow train grpo --config demo model.path=<sft model> trainer.total_steps=N`` (+ a fresh run name, and no
  validation or checkpoint in between: test_freq=0, save_freq=0). That is Ray with 2 data-parallel workers (one
  thread each), a Prefect flow and MLflow tracking; besides the steps the job validates at its start and end, saves
  a checkpoint and the final model and logs the model to MLflow. Per-step wall time (from one step's metrics to the
  next's, by their MLflow time stamps: what the controller does between steps counts, as in TRL's clock; the first
  step: its ``timing_s/step``) and mean reward (``critic/score/mean``) are read back from MLflow.
- TRL runs in a child process too (this file with ``--trl-child``): one process on all cores, ``report_to="none"``,
  ``save_model`` at the end. One rlflow step = one generation batch of 256 samples = two TRL optimizer steps; a
  callback times each pair, the reward adapter records each batch's mean reward.

Printed per side: samples/s at the median step (256 / median step wall time), samples/s over the whole job
(steps x 256 / wall time of the child process, spawn to exit: imports, start-up, training, saving), that wall time
(and in brackets the sum of the step times), and the mean sampled reward of the first and the last step; then each
repeat's values (the two sides alternate which goes first), and last the ratio rlflow / TRL of the medians over
``--repeats``. ``--variant 'KEY=VALUE ...'`` (repeatable) adds an rlflow side with those config overrides (e.g.
``trainer.colocate_ref=true``) and prints its ratio to plain rlflow. The machine should be otherwise idle: each
run's line shows the load average when it started.

The SFT model is configs/demo-sft.yaml cut to ``--sft-steps`` steps, trained once with rlflow into
~/.cache/rlflow/bench/vs_trl/sft/ and reused from there by later runs. Needs the servers (`rlflow server up`, or
PREFECT_API_URL and MLFLOW_TRACKING_URI); if none answer it starts them, and stops them again at the end. Needs the
bench extra for TRL: ``.venv/bin/pip install -e '.[bench]'``.

    .venv/bin/python bench/vs_trl.py [--steps 20] [--repeats 1] [--sft-steps 500]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

CACHE = Path.home() / ".cache" / "rlflow" / "bench" / "vs_trl"
PYTHON = sys.executable


# ---------------------------------------------------------------------------------------------- the job
def job_config(steps: int, model_path: str):
    """The GRPO job as rlflow validates it: configs/demo.yaml with the SFT model and ``steps`` steps."""
    from flows.config import load_config

    return load_config("demo", [f"model.path={model_path}", f"trainer.total_steps={steps}"])


def trl_spec(config) -> dict:
    """The same job in GRPOConfig's terms (plus what the child needs to build the dataset and the reward)."""
    samples = config.data.train_batch_size * config.rollout.n
    actor, optim = config.actor, config.actor.optim
    updates_per_step = samples // actor.ppo_mini_batch_size  # optimizer steps per generation batch
    micro = actor.ppo_micro_batch_size_per_gpu  # samples per forward/backward, as on one rlflow worker
    grpo_args = {
        "num_generations": config.rollout.n,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": actor.ppo_mini_batch_size // micro,
        "steps_per_generation": samples // micro,  # micro-batches per generation batch: one batch per rlflow step
        "max_steps": config.trainer.total_steps * updates_per_step,
        "num_iterations": actor.ppo_epochs,
        "max_completion_length": config.rollout.response_length,
        "temperature": config.rollout.temperature,
        "top_p": config.rollout.top_p,
        "top_k": config.rollout.top_k,
        "learning_rate": optim.lr,
        "lr_scheduler_type": optim.lr_scheduler,
        "warmup_steps": optim.lr_warmup_steps,
        "weight_decay": optim.weight_decay,
        "adam_beta1": optim.betas[0],
        "adam_beta2": optim.betas[1],
        "max_grad_norm": optim.grad_clip,
        "beta": actor.kl_loss_coef if actor.use_kl_loss else 0.0,
        "use_bias_correction_kl": False,  # rlflow's KL loss is plain k3 (low_var_kl), not importance-weighted
        "epsilon": actor.clip_ratio,
        "loss_type": "bnpo",  # token mean over each forward/backward batch: rlflow's loss_agg_mode token-mean
        "scale_rewards": "group" if config.algorithm.norm_adv_by_std_in_grpo else "none",
        "seed": config.trainer.seed,
        "bf16": False,  # GRPOConfig defaults to bf16; rlflow's demo trains in float32
        "model_init_kwargs": {"dtype": config.model.dtype},
        "use_cpu": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }
    task = config.data.task
    return {
        "model": config.model.path,
        "grpo_args": grpo_args,
        "updates_per_step": updates_per_step,
        "task": {
            "num_train": task.num_train,
            "num_val": task.num_val,
            "max_digits": task.max_digits,
            "seed": task.seed,
        },
        "reward_fn": config.reward.reward_fn,
    }


# ---------------------------------------------------------------------------------------------- services, SFT model
def ensure_services() -> bool:
    """Point this process (and so the children) at running servers; start them if none answer. True if started."""
    from flows.preflight import use_running_services

    use_running_services()
    if os.environ.get("PREFECT_API_URL") and os.environ.get("MLFLOW_TRACKING_URI"):
        return False
    run_child([PYTHON, "-m", "flows.cli", "server", "up"], CACHE / "logs" / "server-up.log")
    use_running_services()
    print("started the Prefect and MLflow servers (`rlflow server up`); they are stopped again at the end", flush=True)
    return True


def run_child(command: list[str], log: Path) -> float:
    """Run a child process with its output in ``log``; return its wall time (spawn to exit)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"{' '.join(command)} failed with exit code {code}; end of {log}:\n{tail}")
    return wall


def ensure_sft_model(sft_steps: int) -> tuple[str, float]:
    """The SFT-warmed model folder (trained once, then reused) and its validation accuracy."""
    run_name = f"demo-sft-{sft_steps}steps"
    root = CACHE / "sft" / run_name
    result = root / "result.json"  # written last by rlflow, once the final model is saved
    if not result.exists():
        print(
            f"SFT warm-up: configs/demo-sft.yaml for {sft_steps} steps into {root} (once; reused later) ...", flush=True
        )
        wall = run_child(
            [
                PYTHON,
                "-m",
                "flows.cli",
                "train",
                "sft",
                "--config",
                "demo-sft",
                f"trainer.total_steps={sft_steps}",
                f"trainer.save_freq={sft_steps}",
                f"trainer.test_freq={sft_steps}",
                f"trainer.runs_dir={CACHE / 'sft'}",
                f"trainer.run_name={run_name}",
            ],
            CACHE / "logs" / f"{run_name}.log",
        )
        print(f"SFT warm-up done in {wall:.0f} s", flush=True)
    return str(root / "final_model"), json.loads(result.read_text())["val/score/mean"]


# ---------------------------------------------------------------------------------------------- one run per side
def run_rlflow(config, samples_per_step: int, tag: str, overrides: tuple[str, ...] = ()) -> dict:
    """``rlflow train grpo`` (+ ``overrides``) in a child process; per-step metrics from its MLflow run."""
    from mlflow.tracking import MlflowClient

    run_name = f"bench-vs-trl-{tag}"
    runs_dir = CACHE / "runs"
    load = os.getloadavg()[0]
    wall = run_child(
        [
            PYTHON,
            "-m",
            "flows.cli",
            "train",
            "grpo",
            "--config",
            "demo",
            f"model.path={config.model.path}",
            f"trainer.total_steps={config.trainer.total_steps}",
            f"trainer.run_name={run_name}",
            "trainer.resume=never",
            f"trainer.runs_dir={runs_dir}",
            "trainer.test_freq=0",
            "trainer.save_freq=0",
            *overrides,
        ],
        CACHE / "logs" / f"{run_name}.log",
    )
    client = MlflowClient()
    experiment = client.get_experiment_by_name(config.trainer.project_name)
    run = client.search_runs([experiment.experiment_id], filter_string=f"tags.`rlflow.run_name` = '{run_name}'")[0]

    def history(metric: str) -> list:
        return sorted(client.get_metric_history(run.info.run_id, metric), key=lambda m: m.step)

    # A step's wall time runs from the previous step's metrics to its own (their MLflow time stamps), so what the
    # controller does between steps counts, as it does in TRL's clock; the first step: its own timing_s/step.
    steps = history("timing_s/step")
    walls = [steps[0].value] + [(b.timestamp - a.timestamp) / 1000 for a, b in zip(steps, steps[1:])]
    rewards = [m.value for m in history("critic/score/mean")]
    shutil.rmtree(runs_dir / run_name, ignore_errors=True)  # checkpoint and final model: not needed here
    return summarise(walls, rewards, wall, samples_per_step, load)


def run_trl(spec: dict, samples_per_step: int, tag: str) -> dict:
    """TRL's GRPOTrainer in a child process (``trl_child`` below); it writes its per-step numbers to a file."""
    work = CACHE / "trl" / tag
    work.mkdir(parents=True, exist_ok=True)
    (work / "spec.json").write_text(json.dumps(spec))
    load = os.getloadavg()[0]
    wall = run_child([PYTHON, __file__, "--trl-child", str(work)], CACHE / "logs" / f"trl-{tag}.log")
    found = json.loads((work / "result.json").read_text())
    shutil.rmtree(work, ignore_errors=True)
    return summarise(found["step_walls"], found["step_rewards"], wall, samples_per_step, load)


def summarise(
    step_walls: list[float], step_rewards: list[float], wall: float, samples_per_step: int, load: float
) -> dict:
    """One run's numbers; ``load`` is the 1-minute load average when it started (other work on the machine)."""
    return {
        "median_step": samples_per_step / statistics.median(step_walls),
        "whole_job": samples_per_step * len(step_walls) / wall,
        "wall": wall,
        "in_steps": sum(step_walls),
        "first_reward": step_rewards[0],
        "final_reward": step_rewards[-1],
        "load": load,
    }


# ---------------------------------------------------------------------------------------------- the TRL child
def trl_child(work: Path) -> None:
    """Train with TRL's GRPOTrainer as ``spec.json`` says; write per-step walls and rewards to ``result.json``."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlworkers.data.synthetic import addition_rows
    from rlworkers.rewards import compute_scores, load_reward_fn

    spec = json.loads((work / "spec.json").read_text())
    rows = addition_rows(**spec["task"])["train"]
    dataset = Dataset.from_list(
        [{"prompt": r["prompt"], "answer": r["answer"], "data_source": r["data_source"]} for r in rows]
    )
    rlflow_reward = load_reward_fn(spec["reward_fn"])
    step_rewards: list[float] = []

    def addition_reward(prompts, completions, answer, data_source, **_) -> list[float]:
        # TRL's signature -> rlflow's: the columns under the names rlflow's reward worker passes them.
        scores = compute_scores(rlflow_reward, prompts, completions, ground_truth=answer, data_source=data_source)
        step_rewards.append(sum(scores) / len(scores))  # called once per generation batch = once per rlflow step
        return scores

    class StepClock(TrainerCallback):
        """perf_counter at the start of training and at the end of every optimizer step."""

        def __init__(self):
            self.marks: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

    clock = StepClock()
    args = GRPOConfig(output_dir=str(work / "out"), **spec["grpo_args"])
    trainer = GRPOTrainer(
        model=spec["model"], reward_funcs=addition_reward, args=args, train_dataset=dataset, callbacks=[clock]
    )
    trainer.train()
    trainer.save_model(str(work / "out" / "final_model"))
    k = spec["updates_per_step"]
    step_walls = [clock.marks[i + k] - clock.marks[i] for i in range(0, len(clock.marks) - 1, k)]
    (work / "result.json").write_text(json.dumps({"step_walls": step_walls, "step_rewards": step_rewards}))


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps per side")
    parser.add_argument("--repeats", type=int, default=1, help="runs per side (the median is reported)")
    parser.add_argument("--sft-steps", type=int, default=500, help="steps of the SFT warm-up (made once, cached)")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="'KEY=VALUE ...'",
        help="also run rlflow with these config overrides (e.g. trainer.colocate_ref=true), side by side",
    )
    parser.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)  # internal: run the TRL side here
    args = parser.parse_args()
    if args.trl_child:
        trl_child(args.trl_child)
        return

    started_services = ensure_services()
    try:
        sft_model, sft_accuracy = ensure_sft_model(args.sft_steps)
        config = job_config(args.steps, sft_model)
        samples = config.data.train_batch_size * config.rollout.n
        spec = trl_spec(config)
        sides = {
            "rlflow": lambda tag: run_rlflow(config, samples, tag),
            **{
                f"rlflow {variant}": lambda tag, i=i, variant=variant: run_rlflow(
                    config, samples, f"{tag}-v{i}", tuple(variant.split())
                )
                for i, variant in enumerate(args.variant)
            },
            "TRL": lambda tag: run_trl(spec, samples, tag),
        }
        results: dict[str, list[dict]] = {name: [] for name in sides}
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for repeat in range(args.repeats):
            order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
            for name in order:
                print(f"repeat {repeat + 1}/{args.repeats}: {name} ...", end=" ", flush=True)
                results[name].append(sides[name](f"{stamp}-{repeat + 1}"))
                print(f"{results[name][-1]['wall']:.0f} s", flush=True)
    finally:
        if started_services:
            subprocess.run([PYTHON, "-m", "flows.cli", "server", "down"], stdout=subprocess.DEVNULL, check=False)

    print(
        f"\nGRPO, {args.steps} steps x {samples} samples ({config.data.train_batch_size} prompts x "
        f"{config.rollout.n}), {config.rollout.response_length} new tokens, from the SFT model {sft_model} "
        f"(val accuracy {sft_accuracy:.1%} after {args.sft_steps} SFT steps); median of {args.repeats} run(s)"
    )
    width = max(len(name) for name in results)
    print(
        f"{'':{width}s} {'samples/s median step':>22s} {'samples/s whole job':>20s} {'wall time (in steps)':>21s}  "
        f"{'mean reward first -> last step':>30s}"
    )
    median = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in results.items()}
    for name, m in median.items():
        print(
            f"{name:{width}s} {m['median_step']:22.1f} {m['whole_job']:20.1f} {m['wall']:7.1f}s "
            f"({m['in_steps']:5.1f}s)  {m['first_reward']:19.3f} -> {m['final_reward']:.3f}"
        )
    print(
        f"spread over {args.repeats} run(s) (samples/s median step | whole job | wall s | load average at start, "
        f"{os.cpu_count()} cores):"
    )
    for name, runs in results.items():
        print(
            f"  {name:{width}s} "
            + ",  ".join(
                f"{r['median_step']:.1f} | {r['whole_job']:.1f} | {r['wall']:.0f} | {r['load']:.1f}" for r in runs
            )
        )
    ratio = {key: median["rlflow"][key] / median["TRL"][key] for key in ("median_step", "whole_job")}
    for variant in args.variant:
        gain = {key: median[f"rlflow {variant}"][key] / median["rlflow"][key] for key in ("median_step", "whole_job")}
        print(
            f"ratio rlflow {variant} / rlflow samples/s (median step): {gain['median_step']:.2f}x  "
            f"whole job: {gain['whole_job']:.2f}x"
        )
    print(
        f"ratio rlflow/TRL samples/s (median step): {ratio['median_step']:.2f}x  whole job: {ratio['whole_job']:.2f}x"
    )


if __name__ == "__main__":
    main()
