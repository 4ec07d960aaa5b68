"""The Prefect names beyond its public task-runner contract that ``flows/plumbing/task_runner.py`` needs, in one place.

``WarmRayTaskRunner`` implements Prefect's public contracts: ``prefect.task_runners.TaskRunner`` (``submit``,
``duplicate``, ``__enter__`` / ``__exit__``) and ``prefect.futures.PrefectFuture`` (through prefect-ray's public
``PrefectRayFuture``); its task host runs each task with Prefect's own ``run_task_sync`` / ``run_task_async``. What
it needs beyond them is used only through the functions below, and ``check()`` (run once when a runner starts, and
by tests/test_prefect_internals.py) fails naming the one that an upgrade removed or changed:

- ``ContextModel.__var__`` of ``SettingsContext`` and ``FlowRunContext`` (the ContextVar behind each context class):
  ``serialize_context_reusing`` sets them to stand-ins that return an already serialized form, then calls Prefect's
  own ``serialize_context``. Dumping every setting is most of what a stock submit costs, and settings do not
  change while a flow runs.
- ``PrefectTaskRunFuture._final_state``: where a future keeps its task run's final state (Prefect's own futures and
  prefect-ray's set it the same way); ``state`` then answers without asking the API (a request per read).
- ``TaskRunner._started``: set by ``TaskRunner.__enter__``; ``submit`` refuses work before it, as Prefect's runners do.
- ``SettingsContext`` (fields ``profile``, ``settings``) and ``SyncClientContext`` (field ``client``) built with
  pydantic's ``model_construct``: each task in the host enters its own copy of a settings context validated once, and
  a client context around the host's one open client, instead of validating every setting and opening a client per
  task.
- ``ResultRecord`` (fields ``metadata``, ``result``) built with ``model_construct``: a Completed state that holds a
  value as Prefect's engine holds one (a task that returned None has a result too).

The pins in pyproject.toml (prefect==3.7.7, prefect-ray==0.6.0) say which versions these were read from.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import uuid
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator

from prefect.context import FlowRunContext, SettingsContext, SyncClientContext, serialize_context
from prefect.futures import PrefectTaskRunFuture
from prefect.results import ResultRecord, ResultRecordMetadata
from prefect.states import Completed, State
from prefect.task_runners import TaskRunner


class _AlreadySerialized:
    """Stands in for a context while ``serialize_context`` runs: ``serialize()`` returns the form serialized before,
    any other attribute is the context's own (``AssetContext`` reads the flow run context's ``task_run_assets``)."""

    def __init__(self, context: Any, serialized: dict):
        self._context, self._serialized = context, serialized

    def serialize(self, include_secrets: bool = True) -> dict:
        return self._serialized

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def serialize_context_reusing(
    settings: tuple[SettingsContext, dict] | None,
    flow_run: tuple[FlowRunContext, dict] | None,
    asset_ctx_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """``prefect.context.serialize_context(asset_ctx_kwargs)`` with the settings and flow run contexts given as
    (context, its serialized form) instead of serialized again (None: serialized as Prefect does)."""

    def serialize() -> dict[str, Any]:
        for context_class, given in ((SettingsContext, settings), (FlowRunContext, flow_run)):
            if given is not None:
                context_class.__var__.set(_AlreadySerialized(*given))
        return serialize_context(asset_ctx_kwargs)

    return contextvars.copy_context().run(serialize)  # the stand-ins never leave this call


def set_final_state(future: PrefectTaskRunFuture, state: State) -> None:
    future._final_state = state


def final_state(future: PrefectTaskRunFuture) -> State | None:
    return future._final_state


def is_started(runner: TaskRunner) -> bool:
    return runner._started


@contextmanager
def task_contexts(settings_context: SettingsContext, client: Any) -> Iterator[None]:
    """Enter a copy of ``settings_context`` (not validated again: one context object cannot be entered by two
    threads at once) and a ``SyncClientContext`` around ``client``, an open ``SyncPrefectClient`` that Prefect's
    engine and ``get_client`` then reuse."""
    with settings_context.model_construct(profile=settings_context.profile, settings=settings_context.settings):
        with SyncClientContext.model_construct(client=client):
            yield


def completed_state(value: Any) -> State:
    """A Completed state whose result is ``value``, held as Prefect's engine holds one."""
    return Completed(data=ResultRecord.model_construct(metadata=ResultRecordMetadata(), result=value))


def completed_value(state: State) -> tuple[Any] | None:
    """(the value,) of a Completed state whose value it holds (as Prefect's engine leaves it), else None."""
    return (state.data.result,) if state.is_completed() and isinstance(state.data, ResultRecord) else None


def _is_context_var(context_class: type) -> bool:
    return isinstance(context_class.__dict__.get("__var__"), ContextVar)


def _fields(model: type, *names: str) -> bool:
    return set(names) <= set(model.model_fields)


def _final_state_on_futures() -> bool:
    class Probe(PrefectTaskRunFuture):
        wait = result = add_done_callback = None  # (abstract there)

    return hasattr(Probe(uuid.uuid4()), "_final_state")


def _started_on_runners() -> bool:
    return "self._started" in inspect.getsource(TaskRunner.__init__) + inspect.getsource(TaskRunner.__enter__)


def _serialize_context_reads_the_context_vars() -> bool:
    settings = SettingsContext.get()
    form = {"read from the stand-in": True}
    return serialize_context_reusing((settings, form), None, {})["settings_context"] is form


# what each function above relies on, checked by name
NEEDED: dict[str, Callable[[], bool]] = {
    "prefect.context.SettingsContext.__var__": lambda: _is_context_var(SettingsContext),
    "prefect.context.FlowRunContext.__var__": lambda: _is_context_var(FlowRunContext),
    "prefect.context.serialize_context reading SettingsContext.get()": _serialize_context_reads_the_context_vars,
    "prefect.futures.PrefectTaskRunFuture._final_state": _final_state_on_futures,
    "prefect.task_runners.TaskRunner._started": _started_on_runners,
    "prefect.context.SettingsContext fields profile, settings": lambda: _fields(SettingsContext, "profile", "settings"),
    "prefect.context.SyncClientContext field client": lambda: _fields(SyncClientContext, "client"),
    "prefect.results.ResultRecord fields metadata, result": lambda: _fields(ResultRecord, "metadata", "result"),
}


def missing() -> list[str]:
    """The names in ``NEEDED`` that this Prefect does not have as read."""

    def holds(check: Callable[[], bool]) -> bool:
        try:
            return bool(check())
        except Exception:
            return False

    return [name for name, check in NEEDED.items() if not holds(check)]


@functools.cache
def check() -> None:
    """Raise, naming each one, when a name in ``NEEDED`` is gone or changed (checked once per process)."""
    gone = missing()
    if gone:
        from importlib.metadata import version

        raise ImportError(
            f"prefect {version('prefect')} lacks what flows/plumbing/prefect_internals.py reads from prefect 3.7.7: "
            f"{'; '.join(gone)}. Install the pinned prefect (pip install -e .) or re-read that module's docstring."
        )
