"""What a Prefect task costs on a Ray task runner: the project's ``WarmRayTaskRunner`` against prefect-ray's stock
``RayTaskRunner`` and against calling the same function in a plain loop, in one process, one Ray, one run.

A flow runs one task (so the runner's processes are up), then submits ``--tasks`` chained tasks (each takes the
previous one's result, as the RL stages do) that each call a trivial method of a Ray actor (as a stage calls its
WorkerGroup); the per-task cost is their wall time minus the plain loop's, divided by the number of tasks. Median
of ``--repeats`` flows after one warm-up flow per runner. Needs the servers (`rlflow server up`, or PREFECT_API_URL
/ MLFLOW_TRACKING_URI in the environment). Prints the ratio stock / warm last.

    .venv/bin/python bench/overhead.py [--tasks 40] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect_ray import RayTaskRunner

from flows.task_runner import WarmRayTaskRunner


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from flows.preflight import use_running_services

    use_running_services()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    actor = Echo.remote()
    loop = statistics.median(plain_loop(actor, args.tasks) for _ in range(args.repeats))
    per_task = {}
    for name, runner in (("stock RayTaskRunner", RayTaskRunner), ("WarmRayTaskRunner", WarmRayTaskRunner)):
        run = chain.with_options(task_runner=runner())
        run(actor, 3)  # warm-up: imports, the Ray worker or host process, the events connection
        walls = [run(actor, args.tasks) for _ in range(args.repeats)]
        per_task[name] = (statistics.median(walls) - loop) / args.tasks
        spread = ", ".join(f"{(w - loop) / args.tasks * 1000:.1f}" for w in walls)
        print(f"{name:22s} {per_task[name] * 1000:7.1f} ms per task  (runs: {spread} ms)")
    print(f"{'plain loop':22s} {loop / args.tasks * 1000:7.1f} ms per call (not counted above)")
    ratio = per_task["stock RayTaskRunner"] / per_task["WarmRayTaskRunner"]
    print(f"ratio stock / warm per-task cost: {ratio:.1f}x")


if __name__ == "__main__":
    main()
