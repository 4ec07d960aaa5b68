"""What the controller costs: the project's ``WarmRayTaskRunner`` against prefect-ray's stock ``RayTaskRunner`` and
against no Prefect at all, in one process, one Ray, one run. Two measurements, each printing its ratio:

1. **Per task.** A flow runs one task (so the runner's processes are up), then submits ``--tasks`` chained tasks
   (each takes the previous one's result, as the RL stages do) that each call a trivial method of a Ray actor (as a
   stage calls its WorkerGroup); the per-task cost is their wall time minus a plain loop's, divided by the number
   of tasks. Median of ``--repeats`` flows after one warm-up flow per runner.
2. **The demo GRPO step.** The worker groups of configs/demo.yaml (``--config``; actor and reference as its
   trainer settings say, the rule reward in the stage), built once; then rounds of ``--steps`` GRPO steps, each
   round once per way of driving them: the stage tasks of flows/stages.py submitted as flows/grpo.py does, on
   ``WarmRayTaskRunner`` and on stock ``RayTaskRunner``; and the same stage functions called in a plain loop on the
   WorkerGroups (``Task.fn``: no Prefect; the three concurrent stages on threads, as the runner overlaps them).
   Each way's first step of a round is its warm-up and not counted; the ways alternate their order per round.
   The controller's share of a step: ``1 - plain / runner`` of the median step times (the goal is <= 0.05).

Needs the servers (`rlflow server up`, or PREFECT_API_URL / MLFLOW_TRACKING_URI in the environment).

    .venv/bin/python bench/overhead.py [--tasks 40] [--repeats 3] [--steps 6] [--rounds 3] [--config demo]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import ray
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect_ray import RayTaskRunner
from prefect_ray.context import remote_options

from flows.plumbing.task_runner import WarmRayTaskRunner


@ray.remote(num_cpus=0)
class Echo:
    def echo(self, value: int) -> int:
        return value + 1


@task(name="stage", task_run_name="stage-{step}", cache_policy=NO_CACHE, persist_result=False)
def stage(actor, value: int, step: int) -> int:
    return ray.get(actor.echo.remote(value))


@flow(name="overhead-bench", persist_result=False)
def chain(actor, tasks: int) -> float:
    stage.submit(actor, -1, -1).result()  # the runner's processes are up: what follows is the per-task cost
    start = time.perf_counter()
    value = 0
    for step in range(tasks):
        value = stage.submit(actor, value, step)
    assert value.result() == tasks
    return time.perf_counter() - start


def plain_loop(actor, tasks: int) -> float:
    start = time.perf_counter()
    value = 0
    for _ in range(tasks):
        value = ray.get(actor.echo.remote(value))
    return time.perf_counter() - start


def per_task_cost(tasks: int, repeats: int) -> None:
    actor = Echo.remote()
    loop = statistics.median(plain_loop(actor, tasks) for _ in range(repeats))
    per_task = {}
    for name, runner in (("stock RayTaskRunner", RayTaskRunner), ("WarmRayTaskRunner", WarmRayTaskRunner)):
        run = chain.with_options(task_runner=runner())
        run(actor, 3)  # warm-up: imports, the Ray worker or host process, the events connection
        walls = [run(actor, tasks) for _ in range(repeats)]
        per_task[name] = (statistics.median(walls) - loop) / tasks
        spread = ", ".join(f"{(w - loop) / tasks * 1000:.1f}" for w in walls)
        print(f"{name:22s} {per_task[name] * 1000:7.1f} ms per task  (runs: {spread} ms)")
    print(f"{'plain loop':22s} {loop / tasks * 1000:7.1f} ms per call (not counted above)")
    ratio = per_task["stock RayTaskRunner"] / per_task["WarmRayTaskRunner"]
    print(f"ratio stock / warm per-task cost: {ratio:.1f}x")


# ------------------------------------------------------------------------------------------- the demo GRPO step
def grpo_step(groups: dict, prompts, algorithm: dict, step: int, submit) -> dict:
    """One GRPO step as flows/grpo.py runs it; ``submit(stage, *args)`` returns something with ``.result()``.
    Returns the stages' ``timing_s/...`` (time in each stage's body) and the step's wall time as ``step``."""
    from flows.stages import (
        compute_advantage,
        compute_log_prob,
        compute_ref_log_prob,
        compute_reward,
        generate_sequences,
        update_actor,
    )

    actor, ref, reward = groups["actor"], groups["ref"], groups["reward"]
    start = time.perf_counter()
    gen = submit(generate_sequences, actor, prompts, step)
    scores = submit(compute_reward, reward, gen, step)
    bypass = algorithm["rollout_correction"]["bypass_mode"]  # the rollout's log-probs are the old policy's
    old = [] if bypass else [submit(compute_log_prob, actor, gen, step)]
    ref_lp = submit(compute_ref_log_prob, ref, gen, step)
    batch = submit(compute_advantage, gen, [scores, *old, ref_lp], algorithm, None, step)
    metrics = submit(update_actor, actor, batch, step).result().metrics
    return {"step": time.perf_counter() - start, **{k: v for k, v in metrics.items() if k.startswith("timing_s/")}}


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process's CPU seconds so far, with its kind (bench/cpu_by_process.py's; this process is the flow's)."""
    import psutil
    from cpu_by_process import kind  # bench/, beside this file

    found = {}
    for process in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        times = process.info["cpu_times"]
        if times is None:
            continue
        label = "the flow (this process)" if process.info["pid"] == os.getpid() else None
        label = (
            label
            or kind(" ".join(process.info["cmdline"] or []), process.info["name"] or "")
            or "Ray workers without a title (IDLE)"
        )
        found[process.info["pid"]] = (label, times.user + times.system)
    return found


def timed_steps(step, prompts: list) -> tuple[list[dict], dict[str, float]]:
    """``step(prompts, index)`` for every batch; the steps' times, and the CPU seconds each kind of process used
    from the end of the first step (the warm-up) to the end of the last."""
    times = [step(prompts[0], 0)]
    before = cpu_seconds()
    times += [step(batch, index) for index, batch in enumerate(prompts[1:], 1)]
    used: dict[str, float] = {}
    for pid, (label, seconds) in cpu_seconds().items():
        used[label] = used.get(label, 0.0) + seconds - before.get(pid, (label, 0.0))[1]
    return times, used


class Done:
    """A plain loop's "future": the value, already there."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def plain_submit(pool: ThreadPoolExecutor):
    """The stage function itself (``Task.fn``), no Prefect: the arguments resolved first, as the runner resolves
    upstream futures; ``compute_reward`` / ``compute_log_prob`` / ``compute_ref_log_prob`` run on threads (the
    runner runs them at once too)."""

    def resolve(value):
        if isinstance(value, list):
            return [resolve(v) for v in value]
        return value.result() if hasattr(value, "result") else value

    def submit(stage_task, *args):
        if stage_task.name in ("compute_reward", "compute_log_prob", "compute_ref_log_prob"):
            return pool.submit(lambda: stage_task.fn(*[resolve(a) for a in args]))
        return Done(stage_task.fn(*[resolve(a) for a in args]))

    return submit


def demo_step(config_name: str, steps: int, rounds: int) -> None:
    from flows.config import load_config
    from flows.controller.groups import build_groups
    from flows.controller.rows import dataset_rows
    from rlworkers.data.batching import prompt_batch
    from rlworkers.data.datasets import PromptDataLoader
    from rlworkers.models.loading import load_tokenizer, resolve_model_path

    config = load_config(config_name, [])
    model_path = str(resolve_model_path(config.model.path))
    tokenizer = load_tokenizer(model_path)
    rows = dataset_rows(config, "train", tokenizer)
    loader = PromptDataLoader(rows, batch_size=config.data.train_batch_size, shuffle=True, seed=config.trainer.seed)
    data = config.data

    def batches() -> list:
        return [
            prompt_batch(loader.next_batch(), tokenizer, prompt_key=data.prompt_key, answer_key=data.answer_key)
            for _ in range(steps + 1)
        ]

    started = time.perf_counter()
    groups = build_groups(config, ("actor", "ref", "reward"), model_path)
    print(
        f"\ndemo GRPO step ({config_name}: {config.trainer.n_workers} actor workers, reference "
        f"{'in the actor' if config.trainer.colocate_ref else 'group'}, {config.data.train_batch_size} prompts x "
        f"{config.rollout.n}, {config.rollout.response_length} new tokens); groups built in "
        f"{time.perf_counter() - started:.1f} s"
    )
    algorithm = config.algorithm.model_dump()
    ways = {
        "plain loop (no Prefect)": None,
        "WarmRayTaskRunner": WarmRayTaskRunner,
        "stock RayTaskRunner": RayTaskRunner,
    }
    walls: dict[str, list[dict]] = {name: [] for name in ways}
    by_round: dict[str, list[float]] = {name: [] for name in ways}  # each round's median step, per way
    cpu: dict[str, dict[str, float]] = {name: {} for name in ways}  # CPU seconds by kind of process, counted steps
    with ThreadPoolExecutor(3) as pool:
        for round_ in range(rounds):
            for name in ways if round_ % 2 == 0 else reversed(ways):
                runner = ways[name]
                prompts = batches()
                if runner is None:
                    submit = plain_submit(pool)
                    times, used = timed_steps(lambda p, s: grpo_step(groups, p, algorithm, s, submit), prompts)
                else:  # the groups and batches reach the flow by closure: flow parameters go to the Prefect API

                    @flow(name="overhead-bench-grpo", persist_result=False, task_runner=runner())
                    def grpo_steps() -> tuple[list[dict], dict[str, float]]:
                        with remote_options(num_cpus=0, max_retries=0):  # stock tasks ask no CPU, as the host
                            return timed_steps(
                                lambda p, s: grpo_step(groups, p, algorithm, s, lambda task, *a: task.submit(*a)),
                                prompts,
                            )

                    times, used = grpo_steps()
                walls[name] += times[1:]
                by_round[name].append(statistics.median(t["step"] for t in times[1:]))
                for label, seconds in used.items():
                    cpu[name][label] = cpu[name].get(label, 0.0) + seconds
    stages = [k for k in walls["plain loop (no Prefect)"][0] if k != "step"]
    print(f"{'median s':24s} {'step':>6s} " + " ".join(f"{k.removeprefix('timing_s/'):>12s}" for k in stages))
    median = {
        name: {k: statistics.median(t[k] for t in times) for k in ["step", *stages]} for name, times in walls.items()
    }
    for name, m in median.items():
        print(f"{name:24s} {m['step']:6.3f} " + " ".join(f"{m[k]:12.3f}" for k in stages))
    plain = median["plain loop (no Prefect)"]["step"]
    warm, stock = (median[k]["step"] for k in ("WarmRayTaskRunner", "stock RayTaskRunner"))
    print(f"(the stage columns: time in each stage's body; steps of {steps} per way and round, {rounds} rounds)")
    # why a stage's body is slower under a runner on a machine whose cores the workers keep busy: the CPU that the
    # runner's processes (task host, Prefect server) spend per step is taken from the workers
    counted = {name: len(times) for name, times in walls.items()}
    labels = sorted({label for used in cpu.values() for label in used}, key=lambda k: -cpu[list(ways)[1]].get(k, 0))
    print(f"\n{'CPU ms per step, by process':32s}" + "".join(f"{name.split(' (')[0]:>22s}" for name in ways))
    for label in labels:
        per_step = [cpu[name].get(label, 0.0) / counted[name] * 1000 for name in ways]
        if max(per_step) >= 1:
            print(f"{label:32s}" + "".join(f"{value:22.1f}" for value in per_step))
    totals = [sum(cpu[name].values()) / counted[name] * 1000 for name in ways]
    print(f"{'all processes':32s}" + "".join(f"{value:22.1f}" for value in totals))
    print(
        "controller share of the step (1 - plain / runner): "
        f"WarmRayTaskRunner {1 - plain / warm:.3f}, stock {1 - plain / stock:.3f}"
    )
    # the machine's speed drifts between rounds (minutes apart); the ways of one round ran back to back
    plain_rounds = by_round["plain loop (no Prefect)"]
    for name in ("WarmRayTaskRunner", "stock RayTaskRunner"):
        shares = [1 - p / r for p, r in zip(plain_rounds, by_round[name])]
        print(
            f"{name} by round (the ways of a round back to back): "
            + ", ".join(f"{share:.3f}" for share in shares)
            + f"; median {statistics.median(shares):.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=40, help="chained tasks of the per-task part (0: skip it)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps per way and round (the first is warm-up)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--config", default="demo")
    args = parser.parse_args()
    from machine import cpu_description  # bench/machine.py, beside this file

    from flows.controller.groups import ray_settings
    from flows.ops.preflight import use_running_services
    from flows.plumbing import kept

    print(f"CPU: {cpu_description()}")
    use_running_services()
    address, init_kwargs = ray_settings(None, None)
    if address and address == os.environ.get(kept.LOCAL_RAY_ENV):
        kept.use_token_authentication()  # the local Ray of `rlflow server up` asks for its token, as a run's join does
    ray.init(address, **init_kwargs)
    if args.tasks:
        per_task_cost(args.tasks, args.repeats)
    demo_step(args.config, args.steps, args.rounds)


if __name__ == "__main__":
    main()
