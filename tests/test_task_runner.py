"""WarmRayTaskRunner against a real Prefect server and Ray: every task is still a Prefect task run with its name and
state in the API, all of a flow run's tasks run in one long-lived Ray actor (the same process each time, not the
flow's), that actor is gone when the flow ends, and a task that fails is reported Failed with its traceback."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect_api import settled_task_runs

from flows.plumbing.task_runner import WarmRayTaskRunner, serialize_context_once

pytestmark = pytest.mark.slow  # starts services, trains or installs: `make test-quick` leaves it out

STAGE = {"cache_policy": NO_CACHE, "persist_result": False}


@task(name="where", task_run_name="where-step-{step}", **STAGE)
def where(previous: list[int], step: int) -> list[int]:
    return [*previous, os.getpid()]


@task(name="wait", task_run_name="wait-{i}", **STAGE)
def wait(previous: list[int], i: int) -> tuple[int, float, float]:
    start = time.time()
    time.sleep(1.0)
    return os.getpid(), start, time.time()


@flow(name="warm-runner-fan-out", persist_result=False)
def fan_out(width: int) -> list[tuple[int, float, float]]:
    first = where.submit([], 0)
    return [f.result() for f in [wait.submit(first, i) for i in range(width)]]  # as reward, log-prob and ref


@task(name="say", task_run_name="say-{word}", **STAGE)
def say(word: str) -> tuple[str, list[str]]:
    import logging

    from prefect import get_run_logger

    get_run_logger().info("the host says %s", word)
    return os.readlink("/proc/self/fd/2"), [type(h).__name__ for h in logging.getLogger().handlers]


@flow(name="warm-runner-logs", persist_result=False)
def speak(word: str) -> tuple[str, list[str]]:
    return say.submit(word).result()


@task(name="divide", task_run_name="divide-step-{step}", **STAGE)
def divide(step: int) -> float:
    return 1 / 0


@flow(name="warm-runner-probe", persist_result=False)
def chained(steps: int) -> list[int]:
    pids: object = []
    for step in range(steps):
        pids = where.submit(pids, step)  # each task gets the previous one's future, as the RL stages do
    return pids.result()


@flow(name="warm-runner-failure", persist_result=False)
def failing() -> float:
    return divide.submit(1).result()


@flow(name="warm-runner-states", persist_result=False)
def settle() -> list:
    done, failed = where.submit([], 0), divide.submit(1)
    done.wait(), failed.wait()
    return [done.state.type.value, done.state.result(), done.result(), failed.state.type.value]


class Unpickled:
    """A value that appends the pid of every process that unpickles it to the file ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return _unpickle, (self.path,)


def _unpickle(path: str) -> Unpickled:
    with open(path, "a") as record:
        record.write(f"{os.getpid()}\n")
    return Unpickled(path)


@task(name="make", **STAGE)
def make(path: str) -> Unpickled:
    return Unpickled(path)


@task(name="use", **STAGE)
def use(value: Unpickled) -> str:
    return value.path


@flow(name="warm-runner-hand-over", persist_result=False)
def hand_over(path: str) -> str:
    return use.submit(make.submit(path)).result()  # as an RL stage gets the batch of the stage before it


@task(name="sleep", **STAGE)
def sleep(seconds: float) -> None:
    time.sleep(seconds)


@flow(name="warm-runner-leaves-a-task-running", persist_result=False)
def leave_a_task_running() -> int:
    sleep.submit(60)  # never waited for: still running in the host when the flow run ends
    return where.submit([], 0).result()[0]


def test_tasks_run_in_one_actor_that_the_next_flow_run_of_the_process_reuses(services, ray_cluster):
    state = chained.with_options(task_runner=WarmRayTaskRunner())(steps=4, return_state=True)
    pids = state.result()
    assert len(set(pids)) == 1, pids  # one process for every task: the runner's actor, reused
    assert pids[0] != os.getpid()  # ... which is not the flow's
    runs = settled_task_runs(state.state_details.flow_run_id)
    runs = sorted(runs, key=lambda r: r.name)
    assert [r.name for r in runs] == [f"where-step-{i}" for i in range(4)]
    assert all(r.state.is_completed() for r in runs)
    for before, after in zip(runs, runs[1:]):  # the run graph's edges: each task's input is the previous task's result
        assert [i.id for i in after.task_inputs["previous"]] == [before.id], after.task_inputs
        assert not after.task_inputs.get("__parents__"), after.task_inputs  # an input, not a parent task run

    # this process's Ray outlives the flow run (ray_cluster), so the idle host is kept for the next flow run here
    again = chained.with_options(task_runner=WarmRayTaskRunner())(steps=2)
    assert set(again) == {pids[0]}, (again, pids)
    elsewhere = chained.with_options(task_runner=WarmRayTaskRunner(preload=("json",)))(steps=1)
    assert elsewhere[0] != pids[0]  # other modules (or environment): another host, and the kept one ends
    gone, _ = psutil.wait_procs([psutil.Process(pids[0])], timeout=30) if psutil.pid_exists(pids[0]) else ([1], [])
    assert gone, "a host kept for other settings outlived the next flow run"

    # a host with a task still running when its flow run ends is not kept: it ends, and the next run gets a new one
    busy = leave_a_task_running.with_options(task_runner=WarmRayTaskRunner())()
    gone, _ = psutil.wait_procs([psutil.Process(busy)], timeout=30) if psutil.pid_exists(busy) else ([1], [])
    assert gone, "a host with a task still running was kept"
    assert chained.with_options(task_runner=WarmRayTaskRunner())(steps=1)[0] not in (busy, pids[0])


def test_tasks_submitted_together_run_together_in_the_host(services, ray_cluster):
    runs = fan_out.with_options(task_runner=WarmRayTaskRunner())(width=3)
    assert len({pid for pid, _, _ in runs}) == 1 and runs[0][0] != os.getpid()
    assert max(start for _, start, _ in runs) < min(end for _, _, end in runs), "they ran one after another"


def test_the_host_logs_to_the_api_and_plainly_to_its_log_file(services, ray_cluster):
    word = f"hello-{os.getpid()}-{time.time_ns()}"
    state = speak.with_options(task_runner=WarmRayTaskRunner())(word, return_state=True)
    stderr_file, handlers = state.result()
    assert "PrefectConsoleHandler" not in handlers and "StreamHandler" in handlers  # rich console swapped out
    with open(stderr_file) as log_file:
        lines = [line for line in log_file if word in line]
    assert any(f"| INFO    | Task run 'say-{word}' - the host says {word}" in line for line in lines), lines
    run = settled_task_runs(state.state_details.flow_run_id)[0]
    assert api_log_text(run.id, until=word).count(f"the host says {word}") == 1


def api_log_text(task_run_id, until: str) -> str:
    """The log messages of a task run in the API, once one contains ``until`` (they are sent in batches)."""

    async def logs():
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId

        async with get_client() as client:
            return await client.read_logs(LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])))

    for _ in range(20):
        text = "\n".join(entry.message for entry in asyncio.run(logs()))
        if until in text:
            break
        time.sleep(0.5)
    return text


@flow(name="warm-runner-context", persist_result=False)
def serialized_contexts() -> tuple[list[dict], dict]:
    from uuid import uuid4

    from prefect.context import FlowRunContext, serialize_context
    from prefect.states import Running

    asset_ctx_kwargs = {"task": where, "task_run_id": uuid4(), "task_inputs": {}}
    contexts = [serialize_context_once(asset_ctx_kwargs), serialize_context_once(asset_ctx_kwargs)]
    FlowRunContext.get().flow_run.state = Running()  # as a state change does: a new state object
    contexts.append(serialize_context_once(asset_ctx_kwargs))
    return contexts, serialize_context(asset_ctx_kwargs)


def test_the_flow_run_context_is_serialized_again_only_when_its_state_changes(services):
    (first, second, after_change), prefects = serialized_contexts()
    assert second["flow_run_context"] is first["flow_run_context"]  # the same dict: put in Ray's store once
    assert after_change["flow_run_context"] is not first["flow_run_context"]
    assert after_change["flow_run_context"]["flow_run"]["id"] == first["flow_run_context"]["flow_run"]["id"]
    assert second["settings_context"] is first["settings_context"] and first["settings_context"]
    assert after_change == prefects  # what Prefect's own serialize_context gives, every key and value


def test_a_handed_off_future_never_asks_the_api_for_its_state(monkeypatch):
    """Prefect's engine reads the state of each future in a task's parameters when it creates the task run; a
    hand-off's must come from the host (Pending until taken), not from the API: ~10 ms a task, and an upstream still
    Running there would be recorded as the task run's parent."""
    from uuid import uuid4

    import prefect.futures
    from prefect.states import Pending

    from flows.plumbing.task_runner import HandedOffFuture, HandOff

    def no_api(*args, **kwargs):
        raise AssertionError("a hand-off's state was read from the Prefect API")

    monkeypatch.setattr(prefect.futures, "get_client", no_api)
    future = HandedOffFuture(host=None, entry=[HandOff(uuid4(), ref=None), None])
    assert future.state.type == Pending().type


def test_a_failing_task_is_reported_failed_with_its_traceback(services, ray_cluster):
    state = failing.with_options(task_runner=WarmRayTaskRunner())(return_state=True)
    assert state.is_failed()
    with pytest.raises(ZeroDivisionError):
        state.result()
    runs = settled_task_runs(state.state_details.flow_run_id)
    assert [r.name for r in runs] == ["divide-step-1"] and runs[0].state.is_failed()
    assert "ZeroDivisionError" in runs[0].state.message

    text = api_log_text(runs[0].id, until="Traceback")
    assert "Traceback" in text and "1 / 0" in text, text


def test_a_future_settles_to_its_task_runs_state_and_value(services, ray_cluster):
    completed, value, result, failed = settle.with_options(task_runner=WarmRayTaskRunner())(return_state=True).result(
        raise_on_failure=False
    )
    assert completed == "COMPLETED" and value == result and len(result) == 1 and isinstance(result[0], int)
    assert failed == "FAILED"


def test_a_task_gets_the_result_of_the_task_before_it_unpickled_once(services, ray_cluster, tmp_path):
    record = tmp_path / "unpickled"
    assert hand_over.with_options(task_runner=WarmRayTaskRunner())(str(record)) == str(record)
    pids = record.read_text().split()
    assert len(pids) == 1, f"unpickled {len(pids)} times"  # in the host, to run `use`; never in the flow
    assert int(pids[0]) != os.getpid()


@flow(name="warm-runner-late-consumer", persist_result=False)
def late_consumer() -> list[int]:
    first = where.submit([], 0)
    first.wait()  # done before the next task is even submitted: nothing in the host waits for it
    return where.submit(first, 1).result()


def test_a_task_submitted_after_its_upstream_finished_gets_the_result_from_rays_store(services, ray_cluster):
    pids = late_consumer.with_options(task_runner=WarmRayTaskRunner())()
    assert len(pids) == 2 and pids[0] == pids[1] != os.getpid()


@task(name="same", **STAGE)
def same(value):
    return value


@flow(name="warm-runner-none", persist_result=False)
def pass_none_on() -> list:
    nothing = same.submit(None)
    downstream = same.submit(same.submit(nothing))
    downstream.wait()
    return [same.submit(nothing).result(), downstream.state.result()]


def test_a_task_that_returns_none_hands_none_on(services, ray_cluster):
    """None goes from task to task like any result, and a future's state holds it (Prefect would raise MissingResult
    for a Completed state with no data)."""
    assert pass_none_on.with_options(task_runner=WarmRayTaskRunner())() == [None, None]


@task(name="record", **STAGE)
def record(value: float, path: str) -> float:
    Path(path).write_text(str(value))
    return value


@flow(name="warm-runner-upstream-failed", persist_result=False)
def after_a_failure(path: str) -> list[str]:
    failed = divide.submit(1)
    downstream = record.submit(failed, path)
    downstream.wait()
    failed.wait()
    return [failed.state.type.value, downstream.state.type.value]


@flow(name="warm-runner-waited-for-failed", persist_result=False)
def waiting_for_a_failure(path: str) -> list[str]:
    failed = divide.submit(1)
    downstream = record.submit(2.0, path, wait_for=[failed])
    downstream.wait()
    failed.wait()
    return [failed.state.type.value, downstream.state.type.value, downstream.state.name]


def test_a_task_whose_upstream_failed_does_not_run(services, ray_cluster, tmp_path):
    path = tmp_path / "ran"
    upstream, downstream = after_a_failure.with_options(task_runner=WarmRayTaskRunner())(str(path))
    assert upstream == "FAILED" and downstream != "COMPLETED"
    assert not path.exists()
    upstream, downstream, name = waiting_for_a_failure.with_options(task_runner=WarmRayTaskRunner())(str(path))
    assert (upstream, downstream, name) == ("FAILED", "PENDING", "NotReady")  # as Prefect's own runners leave it
    assert not path.exists()


def _finish_slowly(task, task_run, state) -> None:
    time.sleep(2)  # Prefect's engine runs this after the task's function returned, before the task run ends
    Path(state.result()).with_suffix(".finished").write_text(str(time.time()))  # the path the task returned


@task(name="produce", on_completion=[_finish_slowly], **STAGE)
def produce(path: str) -> str:
    return path


@task(name="consume", **STAGE)
def consume(path: str) -> float:
    return time.time()


@flow(name="warm-runner-early-hand-over", persist_result=False)
def produce_then_consume(path: str) -> list:
    upstream = produce.submit(path)
    started = consume.submit(upstream).result()
    upstream.wait()
    return [started, upstream.state.type.value]


def test_a_result_is_handed_on_when_the_function_returns_it_not_when_the_engine_is_done(
    services, ray_cluster, tmp_path
):
    """The next task starts while Prefect's engine still finishes the task before it (here: a slow completion hook),
    and that one still ends Completed, its hook run."""
    path = tmp_path / "produced"
    started, upstream_state = produce_then_consume.with_options(task_runner=WarmRayTaskRunner())(str(path))
    finished = float(path.with_suffix(".finished").read_text())
    assert upstream_state == "COMPLETED"
    assert started < finished - 1, f"the next task started {started - finished:.2f} s after the hook ended"


@task(name="hold", **STAGE)
def hold(path: str) -> str:
    while not Path(path).exists():  # until the test lets it finish
        time.sleep(0.05)
    return Path(path).read_text()


@task(name="after", **STAGE)
def after(text: str) -> str:
    return text.upper()


@flow(name="warm-runner-pending-while-upstream-runs", persist_result=False)
def hold_then_after(path: str, tag: str, edge: str) -> str:
    from prefect import tags

    with tags(tag):
        upstream = hold.submit(path)
        if edge == "parameter":
            return after.submit(upstream).result()
        return after.submit("waited", wait_for=[upstream]).result()  # as GRPO's next generation waits for an update


def _task_run_states(tag: str) -> dict[str, str]:
    """Task name -> state of the task runs tagged ``tag``, as the API has them now."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterTags

    async def read() -> list:
        async with get_client() as client:
            return await client.read_task_runs(task_run_filter=TaskRunFilter(tags=TaskRunFilterTags(all_=[tag])))

    return {run.name.split("-")[0]: run.state_type.value for run in asyncio.run(read())}


@pytest.mark.parametrize("edge", ["parameter", "wait_for"])
def test_a_task_waits_for_its_upstream_as_a_pending_task_run(services, ray_cluster, tmp_path, edge):
    """As with Prefect's own runners, a task whose upstream still runs (its future in the task's parameters or in its
    ``wait_for``) is a Pending task run in the API (its engine created it meanwhile, under Prefect's default name
    until its parameters are resolved), and turns Running and Completed once the upstream has ended."""
    from concurrent.futures import ThreadPoolExecutor
    from uuid import uuid4

    path, tag = tmp_path / "go", uuid4().hex
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(hold_then_after.with_options(task_runner=WarmRayTaskRunner()), str(path), tag, edge)
        states: dict[str, str] = {}
        for _ in range(240):
            states = _task_run_states(tag)
            if len(states) == 2 or result.done():
                break
            time.sleep(0.25)
        path.write_text("sum")
        assert result.result(timeout=120) == ("SUM" if edge == "parameter" else "WAITED")
    assert states == {"hold": "RUNNING", "after": "PENDING"}
    for _ in range(120):
        if _task_run_states(tag) == {"hold": "COMPLETED", "after": "COMPLETED"}:
            break
        time.sleep(0.25)
    assert _task_run_states(tag) == {"hold": "COMPLETED", "after": "COMPLETED"}


def test_a_task_starts_when_the_one_before_it_ends_even_with_the_flow_process_paused(services, ray_cluster, tmp_path):
    """The second task gets the first one's result inside the task host (no round trip through the flow process):
    it runs while the flow's process is stopped (SIGSTOP, as a debugger or the kernel would), right after the first.
    With Ray resolving the future, the result would go to the flow, which would send the second task on."""
    address = ray_cluster.get_runtime_context().gcs_address
    flow_process = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "hand_off_flow.py"), address, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for _ in range(240):
            if (tmp_path / "first-started").exists() or flow_process.poll() is not None:
                break
            time.sleep(0.25)
        assert (tmp_path / "first-started").exists(), flow_process.communicate(timeout=30)[0][-3000:]
        time.sleep(1)  # the flow submitted the second task right after the first
        os.kill(flow_process.pid, signal.SIGSTOP)
        try:
            for _ in range(120):
                if (tmp_path / "second-ran").exists():
                    break
                time.sleep(0.25)
            assert (tmp_path / "second-ran").exists(), "the second task waited for the paused flow process"
        finally:
            os.kill(flow_process.pid, signal.SIGCONT)
        output, _ = flow_process.communicate(timeout=120)
        assert flow_process.returncode == 0, output[-3000:]
        assert f"first task's pid: {(tmp_path / 'second-ran').read_text()}" in output  # as the flow returned it
    finally:
        if flow_process.poll() is None:
            flow_process.kill()


def test_a_ray_client_session_that_fails_to_start_is_tried_again(monkeypatch):
    """Seen in CI: the Ray Client server's proxier lost the process it started for a new client ("Initialization
    failure from server"). The connection is tried again (Ray Client disconnects before raising), a few times."""
    import logging

    import ray

    from flows.plumbing import task_runner

    calls, failures = [], iter([True, True, False])

    def init(address, **kwargs):
        calls.append(address)
        if next(failures, True):
            raise ConnectionAbortedError("Initialization failure from server:\npsutil.ZombieProcess")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(task_runner.time, "sleep", lambda seconds: None)
    log = logging.getLogger("test")
    task_runner.connect_ray("ray://head:10001", {}, log)
    assert calls == ["ray://head:10001"] * 3  # two failures, then connected
    calls.clear()
    with pytest.raises(ConnectionAbortedError):
        task_runner.connect_ray("ray://head:10001", {}, log)  # every attempt fails: the error, not a hang
    assert len(calls) == task_runner.RAY_CLIENT_CONNECT_ATTEMPTS
    calls.clear()
    with pytest.raises(ConnectionAbortedError):
        task_runner.connect_ray("head:6379", {}, log)  # not Ray Client: no retry
    assert calls == ["head:6379"]
