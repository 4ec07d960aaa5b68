"""Worker faults at the single-controller level, injected from outside as the kernel or an operator would
(SIGKILL, SIGSTOP): errors that survive pickling and name the process, time limits that fire and end the hung
actors, collectives that fail instead of hanging, and a group that restarts in place."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import ray
import torch
from faults import alive, cpu_hogs

from flows.config import ConfigError
from flows.controller.recovery import FaultBudgetExhausted, StepFailed
from flows.lineages.lineage import ModelReferenceError, RestartBudgetExhausted, RunAlreadyComplete
from flows.plumbing.servers import ServiceError
from rlworkers.checkpoint import CorruptCheckpointError
from rlworkers.single_controller import (
    Dispatch,
    PlacementError,
    StageTimeout,
    Worker,
    WorkerError,
    WorkerProcess,
    register,
)
from rlworkers.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

PROCESS = WorkerProcess(
    worker_class="ActorWorker",
    actor_name="abc_ActorWorker_0:1",
    pid=4242,
    node_ip="10.0.0.2",
    node_id="f" * 56,
    log_file="/tmp/ray/session_x/logs/worker-1-4242.out",
)
ERRORS = [
    WorkerError(1, "update_actor", ZeroDivisionError("boom"), PROCESS, remote_traceback="Traceback ...\nboom"),
    StageTimeout([0, 1], "generate_sequences", 20.0, [PROCESS, None]),
    PlacementError("resource pool [2] cannot be placed"),
    CorruptCheckpointError("/runs/x/checkpoints/step_4", "actor/model.safetensors: sha256 mismatch"),
    ConfigError("trainer.total_steps: Input should be greater than 0"),
    ServiceError("the MLflow server at http://127.0.0.1:1 is not reachable"),
    RunAlreadyComplete("run 'x' already trained its 3 steps"),
    ModelReferenceError("models:/nope@champion does not exist"),
    RestartBudgetExhausted("capped at trainer.max_crash_restarts=0"),
    FaultBudgetExhausted("4 worker faults, more than trainer.max_restarts=3", ["step 3: actor lost"]),
    StepFailed("step 3 failed with every worker alive"),
]
FIELDS = (
    "rank",
    "method",
    "ranks",
    "timeout_s",
    "worker",
    "workers",
    "remote_traceback",
    "step_dir",
    "problem",
    "faults",
)


def _fields(error: BaseException) -> dict:
    return {name: getattr(error, name) for name in FIELDS if name in vars(error)}


@ray.remote
def _raise(error: BaseException):
    raise error


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_every_project_error_travels_with_its_fields(ray_cluster, error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error) and _fields(copy) == _fields(error)

    with pytest.raises(type(error)) as info:  # raised in a Ray worker, re-raised here as RayTaskError(<type>)
        ray.get(_raise.remote(error))
    assert isinstance(info.value, ray.exceptions.RayTaskError)
    original = info.value.cause
    assert type(original) is type(error) and str(original) == str(error) and _fields(original) == _fields(error)


def test_worker_error_message_names_the_process():
    error = ERRORS[0]
    assert "ActorWorker rank 1 failed in 'update_actor'" in str(error)
    assert "pid 4242 on node 10.0.0.2" in str(error) and PROCESS.log_file in str(error)
    assert isinstance(pickle.loads(pickle.dumps(error)).cause, ZeroDivisionError)


class Unpicklable(Exception):
    def __init__(self, a, b):  # the default pickle calls Unpicklable(message) and fails
        super().__init__(f"{a}/{b}")


def test_a_cause_that_cannot_travel_keeps_its_text():
    error = pickle.loads(pickle.dumps(WorkerError(0, "m", Unpicklable(1, 2))))
    assert "Unpicklable: 1/2" in str(error.cause)


class Peer(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def work(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def compute(self, cpu_seconds: float) -> int:
        """A fixed amount of work (CPU seconds, however long it takes on a busy machine)."""
        start = time.process_time()
        while time.process_time() - start < cpu_seconds:
            sum(i * i for i in range(10_000))
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def join(self, timeout_s: float) -> str:
        return self.init_process_group("gloo", timeout_s=timeout_s)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce(self) -> float:
        value = torch.ones(1)
        torch.distributed.all_reduce(value)
        return float(value)


@pytest.fixture(scope="module")
def peers(ray_cluster):
    """Two workers shared by the tests below; each test leaves them healthy (the last one may not)."""
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1, placement_timeout_s=30)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=Peer))
    yield group
    group.shutdown()
    pool.remove()


def _after(seconds: float, action) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()), daemon=True)
    thread.start()
    return thread


def test_a_killed_worker_is_named_and_the_group_restarts_in_place(peers):
    pids = peers.pid()
    assert pids == [p.pid for p in peers.worker_processes]
    _after(1.0, lambda: os.kill(pids[1], signal.SIGKILL))
    with pytest.raises(WorkerError) as info:
        peers.work(5)
    error = info.value
    assert error.rank == 1 and error.method == "work" and error.actor_died
    assert f"Peer rank 1 died in 'work' (actor {peers.worker_names[1]}, pid {pids[1]} on node" in str(error)
    assert error.worker.log_file and os.path.exists(error.worker.log_file)
    assert peers.unresponsive_ranks(timeout_s=30) == [1]  # rank 0 answers once its 5 s call is over

    peers.restart()
    assert peers.unresponsive_ranks() == []
    assert peers.work(0) == [0, 1]
    assert set(peers.pid()).isdisjoint(pids)
    assert not alive(pids[0])


def test_a_hung_worker_times_out_and_is_ended(peers):
    pids = peers.pid()
    peers.set_call_timeout(3.0)
    os.kill(pids[0], signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(StageTimeout) as info:
            peers.work(0)
    finally:
        if psutil.pid_exists(pids[0]):
            os.kill(pids[0], signal.SIGCONT)
    assert time.monotonic() - started < 20
    assert info.value.ranks == [0] and "did not answer within 3 s on rank(s) [0]" in str(info.value)
    assert f"pid {pids[0]}" in str(info.value)
    gone, _ = psutil.wait_procs([psutil.Process(pids[0])], timeout=30)
    assert gone, "the hung actor was not ended"
    assert peers.unresponsive_ranks() == [0]
    peers.restart()
    assert peers.work(0) == [0, 1]
    peers.set_call_timeout(None)


def test_a_call_slowed_past_its_limit_by_a_cpu_hog_is_slow_not_hung(peers):
    """Each rank needs 1 s of CPU; with two processes burning the machine's cores beside them it takes longer than
    its 0.5 s limit. The ranks are working (running, or waiting for a core), so the call gets more time and finishes:
    nothing is killed, and the method's next limit is scaled to what it took."""
    pids = peers.pid()
    peers.set_call_timeout(0.5)
    try:
        with cpu_hogs(2):
            started = time.monotonic()
            assert peers.compute(1.0) == [0, 1]
        assert time.monotonic() - started > 1.0  # it did run past its limit
        assert peers.pid() == pids  # no rank was ended
        assert peers.call_time_limit("compute") >= 3 * 1.0  # 3 x the slowest call so far (at least its CPU time)
        assert peers.call_time_limit("pid") == 0.5  # a fast method keeps the configured limit
    finally:
        peers.set_call_timeout(None)


def test_a_call_that_waits_past_its_limit_without_working_is_cut(peers):
    """A rank that neither computes nor answers (here: asleep, as in a deadlock) is not slow: cut at its limit
    plus the watch, its message saying so."""
    peers.set_call_timeout(2.0)
    started = time.monotonic()
    try:
        with pytest.raises(StageTimeout) as info:
            peers.work(60)
    finally:
        peers.set_call_timeout(None)
    assert time.monotonic() - started < 30
    assert info.value.ranks == [0, 1] and info.value.windows == 1
    assert "processes were not working (stopped, gone, or idle)" in str(info.value)
    peers.restart()
    assert peers.work(0) == [0, 1]


def test_a_collective_with_a_hung_peer_fails_after_its_timeout(peers):  # last: leaves a broken world
    peers.join(timeout_s=5)
    assert peers.all_reduce() == [2.0, 2.0]
    pids = peers.pid()
    os.kill(pids[1], signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(WorkerError) as info:
            peers.all_reduce()
    finally:
        os.kill(pids[1], signal.SIGCONT)
    assert time.monotonic() - started < 60
    assert info.value.rank == 0 and not info.value.actor_died
    assert "all_reduce" in str(info.value) and "rank 0" in str(info.value)


def test_a_checkpoint_of_another_run_shape_is_refused_before_workers_start():
    from flows.config import load_config
    from flows.controller.run_start import CheckpointMismatch, check_checkpoint_fits

    config = load_config("demo", ["trainer.n_workers=2", "model.path=tiny"])
    state = {"algorithm": "grpo", "world_size": 2, "config": config.model_dump(mode="json")}
    check_checkpoint_fits("/runs/x/checkpoints/step_4", state, config, "grpo")  # the same shape resumes
    wider = load_config("demo", ["trainer.n_workers=4", "model.path=tiny", "actor.ppo_micro_batch_size_per_gpu=32"])
    other_model = load_config("demo", ["trainer.n_workers=2", "model.path=/models/other"])
    sharded = load_config("demo", ["trainer.n_workers=2", "model.path=tiny", "actor.strategy=fsdp2"])
    for run_config, algorithm, expected in [
        (config, "ppo", "it is a grpo checkpoint and this is the ppo flow"),
        (wider, "grpo", "written by 2 actor workers and this run has trainer.n_workers=4"),
        (other_model, "grpo", "it trains model.path='tiny' and this run names '/models/other'"),
        (sharded, "grpo", "it was trained with actor.strategy=ddp and this run has actor.strategy=fsdp2"),
    ]:
        with pytest.raises(CheckpointMismatch, match="cannot resume /runs/x/checkpoints/step_4") as info:
            check_checkpoint_fits("/runs/x/checkpoints/step_4", state, run_config, algorithm)
        assert expected in str(info.value) and "Fix:" in str(info.value)
        assert pickle.loads(pickle.dumps(info.value)).args == info.value.args
    # a sharded checkpoint loads on another number of workers: DCP reshards it
    sharded_state = {**state, "config": sharded.model_dump(mode="json")}
    wider_sharded = load_config("demo", ["trainer.n_workers=4", "model.path=tiny", "actor.strategy=fsdp2",
                                         "actor.ppo_micro_batch_size_per_gpu=32"])  # fmt: skip
    check_checkpoint_fits("/runs/x/checkpoints/step_4", sharded_state, wider_sharded, "grpo")


def test_a_model_too_big_for_ddp_on_this_machine_is_refused_with_fsdp2_as_the_fix(tmp_path, monkeypatch):
    """A 1.1B-parameter Llama (its config only: counted on the meta device) on 2 DDP workers needs ~41 GiB of
    weights, gradients, AdamW state and reference before any activation: on a 24 GiB machine the run is refused
    before any worker starts, naming fsdp2; with fsdp2 and a layer gathered at a time it fits and is let through."""
    import psutil
    from transformers import LlamaConfig

    from flows.config import load_config
    from flows.controller.run_start import NotEnoughMemory, check_memory_fits

    shape = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32}
    LlamaConfig(**shape, num_key_value_heads=4, vocab_size=32000).save_pretrained(tmp_path)  # TinyLlama's shape
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"total": 24 * 2**30})())
    roles = ("actor", "ref")

    def config(*extra):
        return load_config("demo", ["trainer.n_workers=2", f"model.path={tmp_path}", *extra])

    with pytest.raises(NotEnoughMemory) as info:
        check_memory_fits(config(), roles, str(tmp_path))
    said = str(info.value)
    assert "1.10B parameters" in said and "2 actor worker(s) x 20.5 GiB (ddp)" in said, said
    assert "this machine has 24.0 GiB" in said and "Fix: actor.strategy=fsdp2" in said
    assert "shard: 28.7 GiB in all, 20.5 GiB with actor.fsdp_config.gather_for_generation=false)" in said
    with pytest.raises(NotEnoughMemory, match="Fix: actor.fsdp_config.gather_for_generation=false"):  # gathered copies
        check_memory_fits(config("actor.strategy=fsdp2"), roles, str(tmp_path))
    lockstep = config("actor.strategy=fsdp2", "actor.fsdp_config.gather_for_generation=false")
    check_memory_fits(lockstep, roles, str(tmp_path))


def test_only_ray_processes_left_by_a_dead_ray_are_reaped():
    """``ray::`` processes outside any raylet (agents a SIGKILLed local Ray left behind, and what they forked) are
    ended when a run starts, all in one pass; those under a live raylet, a Ray worker and the process it forked
    (which carries the worker's ``ray::`` name), are not."""
    from flows.controller.groups import reap_orphaned_ray_agents

    def chain(*names: str) -> list[psutil.Process]:
        """A process per name, each the parent of the next (names set in /proc/self/comm, as Ray's are)."""
        script = (
            "import os, sys, time\n"
            "for title in sys.argv[1:]:\n"
            "    if title != sys.argv[1] and os.fork() != 0:\n"
            "        break\n"
            "    open('/proc/self/comm', 'w').write(title)\n"
            "    print(os.getpid(), flush=True)\n"
            "time.sleep(120)\n"
        )
        first = subprocess.Popen([sys.executable, "-c", script, *names], stdout=subprocess.PIPE, text=True)
        return [psutil.Process(int(first.stdout.readline())) for _ in names]

    live = chain("raylet", "ray::ReapTestW", "ray::ReapTestF")  # a live raylet, its worker, what the worker forked
    dead = chain("ray::ReapTestA", "ray::ReapTestB")  # an agent whose raylet is gone, and its child
    try:
        reaped = reap_orphaned_ray_agents()
        assert {p.pid for p in dead} <= set(reaped) and not {p.pid for p in live} & set(reaped), reaped
        psutil.wait_procs(dead, timeout=10)
        assert all(alive(p) for p in live)
    finally:
        for process in (*live, *dead):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def test_a_stage_cut_twice_in_a_row_at_the_same_step_fails_the_run_naming_the_setting():
    """The first cut is a fault like any other (recorded, restarted within the budget); the same stage cut again at
    the same step is not retried: the run fails naming the stage, how long it ran and the settings to raise."""
    from types import SimpleNamespace

    from flows.controller.recovery import recover
    from flows.controller.run_state import RunState

    trainer = SimpleNamespace(stage_timeout_s=650.0, stage_timeout_s_per_sample=0.5, max_restarts=0, run_name="r")
    group = SimpleNamespace(unresponsive_ranks=lambda: [0])
    run = SimpleNamespace(distinct_groups=lambda: {"actor": group}, step_started_at=None, faults=[],
                          config=SimpleNamespace(trainer=trainer), last_cut=None)  # fmt: skip
    run.drop_submitted_ahead = lambda: None
    run.note_fault = lambda *fault: RunState.note_fault(run, *fault)  # the run's own bookkeeping of its faults
    cut = StageTimeout([0], "generate_sequences", 650.0, [PROCESS], windows=1)
    with pytest.raises(FaultBudgetExhausted):  # a fault (max_restarts=0: no restart here)
        recover(run, 3, cut)
    assert run.last_cut == (3, "generate_sequences")
    again = StageTimeout([0], "generate_sequences", 650.0, [PROCESS], windows=2)
    with pytest.raises(StepFailed) as info:
        recover(run, 3, again)
    message = str(info.value)
    assert "step 3: 'generate_sequences' was cut at its time limit twice in a row, after 1300 s" in message
    assert "trainer.stage_timeout_s (now 650)" in message and "trainer.stage_timeout_s_per_sample (now 0.5)" in message
    run.last_cut = (2, "generate_sequences")  # the same stage at another step: a fault again
    with pytest.raises(FaultBudgetExhausted):
        recover(run, 3, cut)
