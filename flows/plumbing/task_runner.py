"""``WarmRayTaskRunner``: a Prefect task runner that runs every task of a flow run in one long-lived Ray actor.

It implements Prefect's public ``TaskRunner`` contract (``submit``, ``duplicate``, enter/exit). Every RL stage stays a
Prefect task: its task run, states, name, logs and retries are Prefect's own (Prefect's ``run_task_sync`` runs it),
and a task's result is a Ray ``ObjectRef`` that the flow's future (prefect-ray's ``PrefectRayFuture``) wraps. It began
as prefect-ray 0.6.0's ``RayTaskRunner`` (still the baseline of bench/overhead.py); what it does differently, and why:

1. **One remote actor instead of one remote function per submit.** Stock ``submit`` wraps ``_run_prefect_task`` in a
   new ``ray.remote`` each time: Ray exports it to the GCS again, gives it a new scheduling class and leases a
   worker for it (PrefectHQ/prefect#5653). Here the runner starts a ``TaskHost`` actor when it starts Ray
   (threaded, no CPU and no GPU asked: the stage tasks only call the WorkerGroups, whose placement groups hold the
   resources; pinned to the node of the flow process's own raylet, so losing another node never takes it away) and
   every submit is a method call on it. No ``max_calls=1`` either: stock Ray tasks with ``num_gpus`` get a fresh
   process per task.
2. **Settings and flow run serialized once.** A stock submit dumps every Prefect setting into the task's
   context (most of its cost) and every task validates them all again. Here the flow side serializes
   them once per ``SettingsContext`` (immutable) into the object store and sends a key; the host validates them
   once per key and each task enters a copy. The flow run's part of the context (the flow, the flow run, its
   parameters) goes the same way, once per flow run state.
3. **One Prefect client per host.** Stock tasks build two new HTTP clients per task (``hydrated_context`` and the
   task engine each call ``get_client``; each loads the CA bundle). The host opens one client per API
   URL and puts it in a ``SyncClientContext`` for each task, which both then reuse.
4. **Plain console logging in the host.** What a task run logs goes to the Prefect API (the UI shows it) and to the
   host's stderr, a Ray log file: the host prints it there with a plain ``logging.StreamHandler`` (same format)
   instead of Prefect's rich console, a noticeable share of every task's cost ("Finished in state Completed()").
5. **A completed task sends back its return value, not its state.** Stock tasks return their final ``State``, so
   every downstream task gets States as parameters and resolves each with ``State.result()``, a coroutine run from
   a sync thread (3 of them in the GRPO advantage stage), and so does the flow. Here a task
   that ended Completed returns its value and any other final state (Failed, Crashed, ...) returns as before;
   ``HostFuture`` turns a value back into a ``Completed`` state for ``wait``/``state``. The edges of the run graph
   that stock tasks find in those States (``task_inputs``) are sent along as the task run's ``dependencies``.
6. **Each upstream result deserialized once.** Stock tasks get the upstream ``ObjectRef``s twice: as positional
   arguments, which Ray resolves before the task starts (and which are then unused), and inside the parameters,
   which ``_run_prefect_task`` fetches and deserializes again with ``ray.get``. Here the values Ray resolved replace
   the references in the parameters.
7. **A result goes from task to task inside the host.** A stock task that gets an upstream future waits for Ray to
   resolve it: the upstream task's result goes back to the flow process (its owner), which then sends the waiting
   task on with it: a round trip between one stage's end and the next one's start, 3 times per GRPO step. Here a
   future of a task of the same host goes as a ``HandOff`` (its task run id and reference, not a Ray dependency):
   the task starts in the host at once, waits there for the upstream task to finish and takes its result, pickled
   once by the upstream task (each task unpickles its own copy, as from Ray's store; the same bytes go back to the
   flow as the Ray result). The host keeps a result only while tasks wait for it; one that comes later reads it
   from Ray's store. A result is handed on as soon as the upstream task's function returns it, while Prefect's
   engine records the upstream's Completed state: the next task starts meanwhile (sooner by that recording; the
   upstream's completion hooks, if it has any, run beside it). In the host a ``HandOff`` becomes a
   ``HandedOffFuture``, which Prefect's engine waits for as for any upstream future: the task run is created and
   Pending while its upstream runs, as with Prefect's own runners, so only the engine's steps from Pending to Running
   come between the upstream's end and this task's start. It starts once the
   upstream's function has started, not before: the host's tasks share one GIL, and five engines starting beside the
   step's first task would delay it.

Ray starts in ``start_ray``, not when Prefect enters the runner (before the flow's body runs): a flow knows the Ray
settings it wants (its config's ``trainer.ray_address`` / ``ray_num_cpus``) only once it runs, and
``flows.controller.run_start.start_run`` passes them. A flow that never calls it gets Ray with the runner's own
``address`` and ``init_kwargs`` at its first submit.

The host starts with the flow's Ray, and at once imports the modules the tasks come from (``preload``) and opens
its client, while the flow builds its worker groups: the first task does not wait for them. The imports run in the
actor's constructor, which Ray completes before any method call: a task's arguments, unpickled in one of the host's
threads, never import a module (transformers' lazy modules above all) while another thread is still importing it
(a resumed run's first tasks once failed so: "cannot import name 'AutoModelForCausalLM' from 'transformers'").

When the flow run's task runner exits, the host sends the logs and state events it still holds. A runner that started
(or connected) Ray itself (``rlflow train``, a deployment run) shuts Ray down and the host with it. In a process whose
Ray outlives the flow run (a notebook, a sweep, the tests: ``ray.init`` before the flow), an idle host is kept for the
next flow run of that process with the same Ray job, modules and environment, so that run's tasks do not wait for
(and the machine does not pay again) a process start and its imports: it forgets the flow run's contexts and task
runs first, and one with a task still running is killed instead. One host is kept per process at most.
The host's environment variables are ``host_env()`` (evaluated when it starts) plus the ``runtime_env`` of
``remote_options(...)`` (prefect-ray's context) current then; ``num_cpus`` / ``num_gpus`` are not asked by it.

Over 450 lines on purpose: one runner. The Prefect names it needs beyond the public contract are used only through
flows/plumbing/prefect_internals.py, which lists and checks them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
import signal
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable
from uuid import uuid4

from prefect.client.schemas.objects import RunInput
from prefect.futures import PrefectFuture
from prefect.states import Pending, State
from prefect.task_runners import TaskRunner
from prefect.tasks import Task
from prefect.utilities.engine import collect_task_run_inputs_sync
from prefect_ray.context import RemoteOptionsContext
from prefect_ray.task_runners import PrefectRayFuture
from ray import cloudpickle

from flows.plumbing import kept as kept_processes
from flows.plumbing import prefect_internals

HOST_THREADS = 32  # tasks in flight at once (they mostly wait on WorkerGroup calls)
# the idle host of this process's last flow run, for its next one (see the module docstring): [(key, actor)] or [None]
_kept_host: list = [None]
_kept_host_lock = threading.Lock()
FINISHED_KEPT = 4096  # task runs the host remembers as finished (a later task reads their results from Ray's store)
# what serialize_context_once serialized last, replaced as one tuple (submits may come from several threads):
_last_settings: list = [(None, {})]  # [(SettingsContext, its serialized form)]
_last_flow_run: list = [(None, None, {})]  # [(FlowRunContext, its flow run's state then, its serialized form)]


def serialize_context_once(asset_ctx_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``prefect.context.serialize_context(asset_ctx_kwargs)`` with the settings serialized once per
    ``SettingsContext``: it is immutable, and dumping every setting (secrets handled) is most of what a stock
    submit costs. The flow run context is serialized again only when it or its flow run's state
    changed (a state change replaces the state object; nothing else in it changes while the flow's body runs)."""
    from prefect.context import FlowRunContext, SettingsContext

    settings_context = SettingsContext.get()
    settings = _last_settings[0]
    if settings_context is not None and settings[0] is not settings_context:
        settings = _last_settings[0] = (settings_context, settings_context.serialize())
    flow_run_context = FlowRunContext.get()
    flow_run = _last_flow_run[0]
    state = flow_run_context.flow_run.state if flow_run_context and flow_run_context.flow_run else None
    if flow_run_context is not None and (flow_run[0] is not flow_run_context or flow_run[1] is not state):
        flow_run = _last_flow_run[0] = (flow_run_context, state, flow_run_context.serialize())
    return prefect_internals.serialize_context_reusing(
        settings if settings_context is not None else None,
        (flow_run[0], flow_run[2]) if flow_run_context is not None else None,
        asset_ctx_kwargs,
    )


def _plain_console_logging() -> None:
    """Swap Prefect's rich console handler on the root logger for a plain ``StreamHandler`` with its level, stream
    and formatter (see point 4 of the module docstring)."""
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler

    ensure_logging_setup()
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, PrefectConsoleHandler)]:
        plain = logging.StreamHandler(handler.stream)
        plain.setLevel(handler.level)
        plain.setFormatter(handler.formatter)
        root.removeHandler(handler)
        root.addHandler(plain)


RAY_CLIENT_CONNECT_ATTEMPTS = 3


def connect_ray(address: str, init_kwargs: dict[str, Any], log: logging.Logger) -> None:
    """``ray.init(address, **init_kwargs)``. A Ray Client server (``ray://``) may fail to start a client's session
    (its proxier starts a server process per client; seen on a loaded machine: "Initialization failure from server",
    the new process gone before it answered): tried again, 2 s apart, ``RAY_CLIENT_CONNECT_ATTEMPTS`` times in all."""
    import ray

    for attempt in range(1, RAY_CLIENT_CONNECT_ATTEMPTS + 1):
        try:
            with keep_sigterm_handler():
                ray.init(address, **init_kwargs)
            return
        except ConnectionAbortedError as error:  # Ray Client disconnects before raising it: a new try starts clean
            if not address.startswith("ray://") or attempt == RAY_CLIENT_CONNECT_ATTEMPTS:
                raise
            log.warning(
                "Ray Client at %s could not start a session (attempt %d of %d): %s; trying again",
                address,
                attempt,
                RAY_CLIENT_CONNECT_ATTEMPTS,
                str(error).splitlines()[0],
            )
            time.sleep(2)


@contextlib.contextmanager
def keep_sigterm_handler():
    """``ray.init`` in the main thread replaces the SIGTERM handler with its own (``sys.exit``); the flow engine's,
    which turns SIGTERM into Prefect's ``TerminationSignal`` and the flow run Crashed, is put back. The run still
    ends its workers and its MLflow run on the way out (``flows.controller.runtime.Run.training``), Ray at exit."""
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and callable(handler):  # a handler of Python's (the flow engine's), not SIG_DFL: Ray's exits cleanly
            signal.signal(signal.SIGTERM, handler)


class HandOff:
    """In a task's parameters: the result of task run ``task_run_id``, which runs in the same host (``ref``: its Ray
    result, for a task that comes after the host let go of it). See point 7 of the module docstring."""

    __slots__ = ("task_run_id", "ref")

    def __init__(self, task_run_id, ref):
        self.task_run_id, self.ref = task_run_id, ref


class Pickled:
    """A task's result pickled once in the host (``payload``): the tasks waiting for it there unpickle it, and Ray
    sends these bytes to the flow, where they unpickle to the result itself."""

    def __init__(self, payload: bytes):
        self.payload = payload

    def __reduce__(self):
        return pickle.loads, (self.payload,)


class _Waiters:
    """The tasks in a host waiting for one task run's result (``count``), whether that task run's function has started
    (``started``: their engines start then) and its result once it is there (``done``)."""

    def __init__(self):
        self.count = 0
        self.started = threading.Event()
        self.done = threading.Event()
        self.payload: bytes | None = None  # None once done: the result is in Ray's store only (or the task raised)


def _take_kept_host(key: tuple):
    """The host kept for ``key`` (see the module docstring), if one is and it still answers; None otherwise."""
    import ray

    with _kept_host_lock:
        kept, _kept_host[0] = _kept_host[0], None
    if kept is None:
        return None
    if kept[0] == key:
        try:
            ray.get(kept[1].__ray_ready__.remote(), timeout=10)
            return kept[1]
        except Exception:  # killed or lost since: a new one is started
            return None
    with contextlib.suppress(Exception):  # another job's (its Ray is gone) or other settings: not reused
        ray.kill(kept[1])
    return None


def _keep_host(key: tuple, host) -> None:
    import ray

    with _kept_host_lock:
        previous, _kept_host[0] = _kept_host[0], (key, host)
    if previous is not None:
        with contextlib.suppress(Exception):
            ray.kill(previous[1])


class TaskHost:
    """The Ray actor that runs Prefect tasks for one flow run (see the module docstring)."""

    def __init__(self, preload: tuple[str, ...] = ()):
        import importlib

        from rlworkers.process_start import resume_gc
        from rlworkers.single_controller.base.worker import WORKING_DIR_ENV

        if os.environ.get(WORKING_DIR_ENV):  # the flow's (flows/controller/groups.py _service_env): relative paths
            os.chdir(os.environ[WORKING_DIR_ENV])
        for module in preload:  # here, not in a method: no task thread runs before the constructor has finished
            importlib.import_module(module)
        resume_gc()  # the imports of this process are done (rlworkers/process_start.py)
        self._settings: dict[str, Any] = {}  # key of a flow-side SettingsContext -> SettingsContext
        self._flow_runs: dict[str, dict] = {}  # key of a serialized flow run context -> that dict
        self._clients: dict[str, Any] = {}  # API URL -> started SyncPrefectClient
        self._waiters: dict[Any, _Waiters] = {}  # task run id -> the tasks waiting for its result (point 7)
        self._running: set[Any] = set()  # task runs whose functions have started and not yet handed over
        self._finished: OrderedDict[Any, None] = OrderedDict()  # the latest task runs that handed over (or ended)
        self._in_flight = 0  # calls of run() not yet returned
        self._lock = threading.Lock()
        _plain_console_logging()

    def release(self) -> bool:
        """The flow run that used this host has ended: forget its contexts and task runs. Whether the host is idle
        (no task still running), and so fit for the next flow run of the same process (``WarmRayTaskRunner``)."""
        with self._lock:
            self._settings.clear()
            self._flow_runs.clear()
            self._finished.clear()
            return self._in_flight == 0 and not self._running and not self._waiters

    def pid(self) -> int:
        return os.getpid()

    def modules_changed(self) -> list[str]:
        """Files of modules this host imported that changed on disk since it started (then it is not reused)."""
        from rlworkers.loading import modules_changed_since_start

        return modules_changed_since_start()

    def warm_up(self) -> None:
        """Open the Prefect client now, while the flow builds its worker groups, instead of in the first task."""
        from prefect.settings import get_current_settings

        self._client(get_current_settings().api.url or "")

    def drain(self) -> None:
        """Send what the task runs logged and the state events still queued here (before the host is killed)."""
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=10)
        EventsWorker.drain_all(timeout=10)

    def run(self, *upstream_values: Any, **kwargs: Any) -> Any:
        """``_run``, counted while in flight (``release``)."""
        with self._lock:
            self._in_flight += 1
        try:
            return self._run(*upstream_values, **kwargs)
        finally:
            with self._lock:
                self._in_flight -= 1

    def _run(
        self,
        *upstream_values: Any,
        upstream_refs: list,
        task: Task,
        task_run_id: Any,
        parameters: dict[str, Any],
        context: dict[str, Any],
        settings: tuple[str, list],
        flow_run: tuple[str, list],
        **kwargs: Any,
    ) -> Any:
        """Run ``task`` with Prefect's engine, as prefect-ray's ``_run_prefect_task`` does, but with the references in
        ``parameters`` replaced by the values Ray resolved (``upstream_values``, in the order of ``upstream_refs``) and
        each ``HandOff`` by a ``HandedOffFuture`` that the engine resolves, and returning the task's value when it
        completed, its final state otherwise (points 5 to 7)."""
        import ray
        from prefect.utilities.collections import visit_collection

        hand_offs = self._register_hand_offs([parameters, kwargs.get("wait_for")])
        resolved = dict(zip(upstream_refs, upstream_values))
        futures = {task_run_id: HandedOffFuture(self, entry) for task_run_id, entry in hand_offs.items()}

        def resolve(expr: Any) -> Any:
            if isinstance(expr, ray.ObjectRef):
                return resolved.get(expr, expr)
            return futures[expr.task_run_id] if isinstance(expr, HandOff) else expr

        parameters = visit_collection(parameters, visit_fn=resolve, return_data=True)
        if kwargs.get("wait_for"):
            kwargs["wait_for"] = visit_collection(kwargs["wait_for"], visit_fn=resolve, return_data=True)
        early: list[bytes] = []  # the result, pickled when the task's function returned it, if tasks waited then
        try:
            if not (task.isasync or task.isgenerator):
                self._wait_for_upstream_starts(hand_offs)
                task = self._handing_over_on_return(task, task_run_id, early)
            out = self._run_task(task, task_run_id, parameters, context, settings, flow_run, **kwargs)
        except BaseException:
            self._hand_over(task_run_id, None)  # the waiting tasks read the error from Ray's store
            raise
        finally:
            self._release(hand_offs)
        if early and not isinstance(out, State):
            return Pickled(early[0])
        if not self._waited_for(task_run_id):
            self._hand_over(task_run_id, None)  # a task that comes later reads the result from Ray's store
            return out
        try:
            payload = cloudpickle.dumps(out)
        except Exception:  # Ray's own serializer will say why
            self._hand_over(task_run_id, None)
            return out
        self._hand_over(task_run_id, payload)
        return Pickled(payload)

    def _handing_over_on_return(self, task: Task, task_run_id: Any, early: list[bytes]) -> Task:
        """A copy of ``task`` whose function, on returning a value that tasks here wait for, pickles it, hands it to
        them and appends the bytes to ``early``: they start while Prefect's engine records this task's end."""
        import copy

        fn = task.fn

        @functools.wraps(fn)  # the engine binds the parameters to the function's signature
        def fn_then_hand_over(*args, **kwargs):
            self._function_started(task_run_id)
            value = fn(*args, **kwargs)
            if self._waited_for(task_run_id) and not isinstance(value, (State, PrefectFuture)):  # a state: its own end
                try:
                    early.append(cloudpickle.dumps(value))
                except Exception:  # Ray's own serializer will say why, once the task returns
                    return value
                self._hand_over(task_run_id, early[0])
            return value

        task = copy.copy(task)
        task.fn = fn_then_hand_over
        return task

    def _run_task(self, task, task_run_id, parameters, context, settings, flow_run, **kwargs) -> Any:
        """Prefect's ``run_task_sync`` / ``run_task_async``, in the settings of ``settings`` and with the host's client;
        the task's value when it completed, its final state otherwise."""
        import asyncio

        from prefect.task_engine import run_task_async, run_task_sync

        context = {**context, "flow_run_context": self._flow_run_context(*flow_run)}
        run = {"task": task, "task_run_id": task_run_id, "parameters": parameters, "context": context, **kwargs}
        settings_context = self._settings_context(*settings)
        with prefect_internals.task_contexts(settings_context, self._client(settings_context.settings.api.url or "")):
            if task.isasync:
                state = asyncio.run(run_task_async(**run, return_type="state"))
            else:
                state = run_task_sync(**run, return_type="state")
        value = prefect_internals.completed_value(state)
        return value[0] if value is not None else state

    def _register_hand_offs(self, expr: Any) -> dict[Any, list]:
        """The ``HandOff``s in ``expr`` (a task's parameters and ``wait_for``), registered as waited for here: task
        run id -> [HandOff, its ``_Waiters`` (None: its task finished before this one came, its result is in Ray's
        store, or this task took it already)]."""
        hand_offs = {}
        with self._lock:
            for task_run_id, hand_off in _hand_offs_in(expr).items():
                if task_run_id in self._finished and task_run_id not in self._waiters:
                    hand_offs[task_run_id] = [hand_off, None]
                    continue
                waiter = self._waiters.setdefault(task_run_id, _Waiters())
                waiter.count += 1
                if task_run_id in self._running:
                    waiter.started.set()
                hand_offs[task_run_id] = [hand_off, waiter]
        return hand_offs

    def _wait_for_upstream_starts(self, hand_offs: dict[Any, list]) -> None:
        """Wait until the function of every upstream task run here has started (or its task ended): this task's
        engine starts its run meanwhile, not while the upstream's engine starts (they share the host's GIL)."""
        for hand_off, waiter in hand_offs.values():
            if waiter is not None:
                _wait_until(waiter.started, hand_off.ref)

    def take_hand_off(self, entry: list) -> bytes | None:
        """Wait for the result of a hand-off (an entry of ``_register_hand_offs``) and stop waiting for it: its
        pickled result, or None when its task finished before this one came or raised (then it is in Ray's store)."""
        hand_off, waiter = entry
        if waiter is not None:
            _wait_until(waiter.done, hand_off.ref)
        payload = waiter.payload if waiter is not None and waiter.done.is_set() else None
        self._release({hand_off.task_run_id: entry})
        return payload

    def _release(self, hand_offs: dict[Any, list]) -> None:
        """No longer wait for these hand-offs (each released once)."""
        with self._lock:
            for task_run_id, entry in hand_offs.items():
                waiter, entry[1] = entry[1], None
                if waiter is None:
                    continue
                waiter.count -= 1
                if waiter.count == 0 and self._waiters.get(task_run_id) is waiter:
                    del self._waiters[task_run_id]

    def _function_started(self, task_run_id: Any) -> None:
        with self._lock:
            self._running.add(task_run_id)
            waiter = self._waiters.get(task_run_id)
        if waiter is not None:
            waiter.started.set()

    def _waited_for(self, task_run_id: Any) -> bool:
        with self._lock:
            return task_run_id in self._waiters

    def _hand_over(self, task_run_id: Any, payload: bytes | None) -> None:
        """Give the tasks waiting for ``task_run_id`` its pickled result (None: they read it from Ray's store), once;
        the tasks that come for it later read it from Ray's store."""
        with self._lock:
            self._running.discard(task_run_id)
            self._finished[task_run_id] = None
            while len(self._finished) > FINISHED_KEPT:
                self._finished.popitem(last=False)
            waiter = self._waiters.get(task_run_id)
            if waiter is None or waiter.done.is_set():
                return
            waiter.payload = payload
        waiter.started.set()
        waiter.done.set()

    def _settings_context(self, key: str, ref: list):
        """The validated SettingsContext of ``key``, built from ``ref[0]`` (its serialized form, in the object store)
        the first time; tasks enter copies of it (one context object cannot be entered by two threads at once)."""
        import ray
        from prefect.context import SettingsContext

        with self._lock:
            if key not in self._settings:
                serialized = ray.get(ref[0])
                self._settings[key] = SettingsContext(**serialized) if serialized else SettingsContext.get()
            return self._settings[key]

    def _flow_run_context(self, key: str, ref: list) -> dict:
        """The serialized flow run context of ``key``, fetched from the object store the first time."""
        import ray

        with self._lock:
            if key not in self._flow_runs:
                self._flow_runs[key] = ray.get(ref[0])
            return self._flow_runs[key]

    def _client(self, api_url: str):
        from prefect.client.orchestration import get_client

        with self._lock:
            if api_url not in self._clients:
                client = get_client(sync_client=True)
                client.__enter__()  # kept open for the host's life; SyncClientContext re-enters it per task
                self._clients[api_url] = client
            return self._clients[api_url]


def _wait_until(event: threading.Event, ref) -> None:
    """Wait for ``event`` of an upstream task run in the host, or until its Ray result ``ref`` exists: an upstream
    whose call failed in Ray before it ran here never sets it."""
    import ray

    while not event.wait(1.0):
        if ray.wait([ref], timeout=0, fetch_local=False)[0]:
            return


def _hand_offs_in(expr: Any) -> dict[Any, HandOff]:
    """The ``HandOff``s in ``expr``, by task run id."""
    from prefect.utilities.collections import visit_collection

    found: dict[Any, HandOff] = {}
    visit_collection(expr, lambda e: found.setdefault(e.task_run_id, e) if isinstance(e, HandOff) else None)
    return found


class HostFuture(PrefectRayFuture):
    """The future of a task run in the ``TaskHost``: its object is the task's return value when the task completed,
    else the task's final state (point 5 of the module docstring)."""

    def wait(self, timeout: float | None = None) -> None:
        import ray
        from prefect.states import exception_to_crashed_state
        from prefect.utilities.asyncutils import run_coro_as_sync

        try:
            out = ray.get(self.wrapped_future, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            return
        except Exception as error:
            out = run_coro_as_sync(exception_to_crashed_state(error))
        self._settle(out)

    def result(self, timeout: float | None = None, raise_on_failure: bool = True) -> Any:
        import ray

        try:
            out = ray.get(self.wrapped_future, timeout=timeout)
        except ray.exceptions.GetTimeoutError as error:
            raise TimeoutError(f"Task run {self.task_run_id} did not complete within {timeout} seconds") from error
        if not isinstance(out, State):
            return out
        self._settle(out)
        return super().result(timeout, raise_on_failure)

    def _settle(self, out: Any) -> None:
        """Keep the final state of what the task sent back: its value (Completed) or its final state."""
        state = out if isinstance(out, State) else prefect_internals.completed_state(out)
        prefect_internals.set_final_state(self, state)


class HandedOffFuture(HostFuture):
    """In a task's parameters or ``wait_for`` in the host: a ``HandOff``, the future of an upstream task of the same
    host. Prefect's engine resolves it as any upstream future, while this task run is Pending: ``wait`` waits for
    the upstream's hand-over and unpickles this task's own copy of its result, or reads the result (a value, or the
    upstream's final state) from Ray's store when the upstream finished before this task came (point 7)."""

    def __init__(self, host: TaskHost, entry: list):
        super().__init__(task_run_id=entry[0].task_run_id, wrapped_future=entry[0].ref)
        self._host, self._entry, self._taken = host, entry, False

    @property
    def state(self) -> State:
        """Its final state once waited for, Pending before, never read from the API: Prefect's engine reads the state
        of each future in the parameters when it creates the task run (a Running upstream would count as this task
        run's parent), and the upstream's end is still being recorded when its result is handed on."""
        return prefect_internals.final_state(self) or Pending()

    def wait(self, timeout: float | None = None) -> None:
        if self._taken:
            return
        self._taken = True
        payload = self._host.take_hand_off(self._entry)
        if payload is None:
            super().wait(timeout)
            return
        self._settle(pickle.loads(payload))


class WarmRayTaskRunner(TaskRunner[HostFuture]):
    """A Prefect task runner whose tasks run in a long-lived ``TaskHost`` Ray actor (see the module docstring)."""

    def __init__(
        self,
        address: str | None = None,
        init_kwargs: dict[str, Any] | None = None,
        host_env: Callable[[], dict[str, str]] | None = None,
        preload: tuple[str, ...] = (),
    ):
        """``host_env``: the environment variables the task host gets, computed when it starts (in the flow's
        process, so they are that process's values then, not when the runner was built). ``preload``: modules the
        host imports as soon as it starts (where the tasks are defined), so that the first task does not wait for
        them. ``address`` and ``init_kwargs`` (for ``ray.init``, namespace "prefect" unless given) as prefect-ray's
        ``RayTaskRunner`` takes them."""
        super().__init__()
        self.address = address
        self.init_kwargs = {"namespace": "prefect", **(init_kwargs or {})}
        self._owns_ray = False  # whether this runner started (or connected) Ray, and so shuts it down at its exit
        self.host_env = host_env
        self.preload = tuple(preload)
        self._host = None
        self._host_key: tuple | None = None  # see _kept_host
        self._host_item: str | None = (
            None  # its id in the local Ray's registry of kept processes (flows/plumbing/kept.py)
        )
        self._host_token = uuid4().hex  # on this runner's futures: their tasks run in its host (see HandOff)
        self._host_lock = threading.Lock()
        self._by_reference: dict[str, tuple[dict, tuple[str, list]]] = {}  # what -> (its form, its reference)

    def duplicate(self):
        return type(self)(self.address, self.init_kwargs, self.host_env, self.preload)

    def __eq__(self, other: object) -> bool:
        settings = (self.address, self.init_kwargs, self.host_env, self.preload)
        return isinstance(other, WarmRayTaskRunner) and (
            (other.address, other.init_kwargs, other.host_env, other.preload) == settings
        )

    def __reduce__(self):  # it travels inside the flow, in every task's context: as an unstarted copy
        return type(self), (self.address, self.init_kwargs, self.host_env, self.preload)

    def __enter__(self):
        prefect_internals.check()  # here, not deep inside a training run, when Prefect is not the version read
        return super().__enter__()  # Ray starts later: see start_ray

    @property
    def owns_ray(self) -> bool:
        """Whether this runner started (or connected) Ray, and so shuts it down when the flow run ends."""
        return self._owns_ray

    def start_ray(self, address: str | None, init_kwargs: dict[str, Any]) -> None:
        """Connect to the Ray cluster at ``address`` (None: start a local Ray; ``init_kwargs`` go to ``ray.init``)
        unless this process already is, then start the task host (its process starts while the flow builds its
        worker groups: nothing waits for it here). Does nothing once the host runs."""
        import ray

        if self._host is not None:
            return
        if not ray.is_initialized():
            if address and address == os.environ.get(kept_processes.LOCAL_RAY_ENV):
                self.logger.info("Joining the local Ray of `rlflow server up` at %s", address)
                kept_processes.use_token_authentication()
            else:
                self.logger.info(
                    "Connecting to the Ray cluster at %s" if address else "Starting a local Ray%s", address or ""
                )
            # no address: "local" starts a Ray of its own; Ray's default (None) would join a cluster that `ray start`
            # left running on this machine, or one named by a stale /tmp/ray/ray_current_cluster, and then refuse
            # num_cpus ("When connecting to an existing cluster, num_cpus and num_gpus must not be provided")
            connect_ray(address or "local", init_kwargs, self.logger)
            self._owns_ray = True
        self.host()

    def host(self):
        """The task host (started by ``start_ray`` in the flow's process)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        with self._host_lock:
            if self._host is None:
                runtime_env = (RemoteOptionsContext.get().current_remote_options or {}).get("runtime_env", {})
                if self.host_env:
                    env_vars = {**self.host_env(), **runtime_env.get("env_vars", {})}
                    runtime_env = {**runtime_env, "env_vars": env_vars}
                node = ray.get_runtime_context().get_node_id()
                in_local_ray = kept_processes.in_local_ray()  # kept there for any process's next run
                job = None if in_local_ray else ray.get_runtime_context().get_job_id()
                self._host_key = (job, node, self.preload, kept_processes.digest(runtime_env))
                if in_local_ray:
                    (found,) = kept_processes.take("host", [self._host_key])
                    if found is not None:
                        self._host_item, self._host = found[0], cloudpickle.loads(found[1])
                        try:  # one that runs older code is ended: a new one runs the code as it is now
                            stale = bool(ray.get(self._host.modules_changed.remote(), timeout=30))
                        except Exception:  # died since
                            stale = True
                        if stale:
                            kept_processes.end([self._host_item])
                            self._host_item, self._host = None, None
                else:
                    self._host = _take_kept_host(self._host_key)
                if self._host is None:
                    self._host = (
                        ray.remote(TaskHost)
                        .options(
                            num_cpus=0,
                            max_concurrency=HOST_THREADS,
                            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                            **({"runtime_env": runtime_env} if runtime_env else {}),
                            **({"lifetime": "detached"} if in_local_ray else {}),
                        )
                        .remote(self.preload)
                    )
                    if in_local_ray:
                        self._host_item = uuid4().hex
                        kept_processes.hold(self._host_item, "host", self._host_key, actors=[self._host])
                self._host.warm_up.remote()  # not waited for: runs while the flow builds its groups
            return self._host

    def submit(
        self,
        task: Task,
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectFuture] | None = None,
        dependencies: dict[str, set[RunInput]] | None = None,
    ) -> HostFuture:
        if not prefect_internals.is_started(self):
            raise RuntimeError("The task runner must be started before submitting work.")
        self.start_ray(self.address, self.init_kwargs)
        task_run_id = uuid4()
        task_inputs = {k: collect_task_run_inputs_sync(v, future_cls=PrefectRayFuture) for k, v in parameters.items()}
        context = serialize_context_once(
            asset_ctx_kwargs={
                "task": task,
                "task_run_id": task_run_id,
                "task_inputs": task_inputs,
                "copy_to_child_ctx": True,
            }
        )
        settings = self._reference("settings", context.pop("settings_context"))
        flow_run = self._reference("flow_run", context.pop("flow_run_context"))
        dependencies = {k: set(v) for k, v in (dependencies or {}).items()}
        for k, inputs in task_inputs.items():  # the run graph's edges (point 5): the upstream futures of each parameter
            dependencies.setdefault(k, set()).update(inputs)
        parameters, upstream_ray_obj_refs = self._futures_to_ray(parameters)
        if wait_for:  # a future of a task of this host waited for there as a HandOff, as in the parameters
            wait_for = list(wait_for)
            dependencies.setdefault("wait_for", set()).update(collect_task_run_inputs_sync(wait_for))
            wait_for = [HandOff(f.task_run_id, f.wrapped_future) if self._hosted(f) else f for f in wait_for]
        object_ref = (
            self.host()
            .run.options(name=task.name)
            .remote(
                *upstream_ray_obj_refs,  # Ray resolves these before the task starts: see TaskHost.run
                upstream_refs=list(upstream_ray_obj_refs),  # inside a list, Ray leaves them references
                task=task,
                task_run_id=task_run_id,
                parameters=parameters,
                wait_for=wait_for,
                dependencies=dependencies,
                context=context,
                settings=settings,
                flow_run=flow_run,
            )
        )
        future = HostFuture(task_run_id=task_run_id, wrapped_future=object_ref)
        future.host_token = self._host_token
        return future

    def _futures_to_ray(self, parameters: dict[str, Any]) -> tuple[dict[str, Any], list]:
        """``parameters`` with each future of a task on Ray as its Ray reference (Ray resolves those before the task
        starts; the list of them comes second), except that a future of a task of this runner's host becomes a
        ``HandOff`` (point 7 of the module docstring)."""
        from prefect.utilities.collections import visit_collection

        upstream_ray_obj_refs: list = []

        def exchange(expr: Any) -> Any:
            if not isinstance(expr, PrefectRayFuture):
                return expr
            if self._hosted(expr):
                return HandOff(expr.task_run_id, expr.wrapped_future)
            upstream_ray_obj_refs.append(expr.wrapped_future)
            return expr.wrapped_future

        return visit_collection(parameters, visit_fn=exchange, return_data=True), upstream_ray_obj_refs

    def _hosted(self, future: Any) -> bool:
        """Whether ``future`` is of a task run in this runner's host."""
        return getattr(future, "host_token", None) == self._host_token

    def _reference(self, what: str, serialized: dict) -> tuple[str, list]:
        """(key, [ObjectRef]) of a serialized context (``what``: settings or flow run): put in the object store once
        per serialized form (``serialize_context_once`` keeps one while it holds), not sent with every task."""
        import ray

        last = self._by_reference.get(what)
        if last is None or last[0] is not serialized:
            last = self._by_reference[what] = (serialized, (uuid4().hex, [ray.put(serialized)]))
        return last[1]

    def __exit__(self, *exc_info):
        import ray

        if self._host is not None:
            idle = False
            try:
                ray.get(self._host.drain.remote(), timeout=30)
                keep = not self._owns_ray or self._host_item is not None
                idle = keep and ray.get(self._host.release.remote(), timeout=30)
            except Exception as error:  # a dead host has nothing left to send
                self.logger.warning("the task host could not send its last logs and events: %s", error)
            if self._host_item is not None:  # in the local Ray's registry: kept there for any process, or ended
                if idle:
                    pid = ray.get(self._host.pid.remote(), timeout=30)
                    kept_processes.release(self._host_item, cloudpickle.dumps(self._host), [pid])
                else:
                    kept_processes.end([self._host_item])
            elif idle:
                _keep_host(self._host_key, self._host)
            else:
                ray.kill(self._host)
            self._host, self._host_item = None, None
        if self._owns_ray:
            self.logger.debug("Shutting down Ray")
            ray.shutdown()
            self._owns_ray = False
        super().__exit__(*exc_info)
