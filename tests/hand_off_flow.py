"""A flow of two tasks on ``WarmRayTaskRunner``, the second given the first one's future; run by
tests/test_task_runner.py as its own process (connected to the test session's Ray) so that the test can pause it.

usage: python hand_off_flow.py <ray address> <folder>: the first task writes ``<folder>/first-started`` then sleeps
3 s; the second writes ``<folder>/second-ran``."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.plumbing.task_runner import WarmRayTaskRunner

STAGE = {"cache_policy": NO_CACHE, "persist_result": False}


@task(name="first", **STAGE)
def first(folder: str) -> int:
    Path(folder, "first-started").touch()
    time.sleep(3)
    return os.getpid()


@task(name="second", **STAGE)
def second(pid: int, folder: str) -> int:
    Path(folder, "second-ran").write_text(str(pid))
    return pid


@flow(name="warm-runner-hand-off", persist_result=False)
def hand_off(folder: str) -> int:
    return second.submit(first.submit(folder), folder).result()


if __name__ == "__main__":
    address, folder = sys.argv[1:3]
    root = str(Path(__file__).resolve().parents[1])
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join([root, str(Path(root, "tests"))])}}
    runner = WarmRayTaskRunner(address=address, init_kwargs={"runtime_env": runtime_env, "log_to_driver": False})
    print(f"first task's pid: {hand_off.with_options(task_runner=runner)(folder)}", flush=True)
