"""The Prefect names flows/plumbing/task_runner.py needs beyond Prefect's public task-runner contract, read only through
flows/plumbing/prefect_internals.py: each one is there, and an upgrade that removes or reshapes one fails ``check()``
naming it (shown below against a Prefect monkeypatched so, one name at a time), instead of somewhere inside a training
run. The pins in pyproject.toml (prefect==3.7.7, prefect-ray==0.6.0) say which versions these were read from.
"""

from __future__ import annotations

import inspect
import re

import pytest
from prefect.context import SettingsContext
from prefect.futures import PrefectTaskRunFuture
from prefect.task_runners import TaskRunner
from pydantic import BaseModel

from flows.plumbing import prefect_internals


def test_every_name_the_task_runner_reads_is_there():
    assert prefect_internals.missing() == []
    prefect_internals.check()


def _future_without_final_state(self, task_run_id):
    self._task_run_id = task_run_id


def _runner_without_started(self):
    self.running = False


def _serialize_without_the_context_var(asset_ctx_kwargs=None):
    from prefect.context import GLOBAL_SETTINGS_CONTEXT

    return {"settings_context": GLOBAL_SETTINGS_CONTEXT.serialize()}


class _RecordWithoutResult(BaseModel):
    metadata: dict = {}


BREAKS = {  # a name in prefect_internals.NEEDED -> how an upgrade could remove or change it
    "prefect.context.SettingsContext.__var__": lambda m: m.setattr(SettingsContext, "__var__", None),
    "prefect.context.serialize_context reading SettingsContext.get()": lambda m: m.setattr(
        prefect_internals, "serialize_context", _serialize_without_the_context_var
    ),
    "prefect.futures.PrefectTaskRunFuture._final_state": lambda m: m.setattr(
        PrefectTaskRunFuture, "__init__", _future_without_final_state
    ),
    "prefect.task_runners.TaskRunner._started": lambda m: (
        m.setattr(TaskRunner, "__init__", _runner_without_started),
        m.setattr(TaskRunner, "__enter__", _runner_without_started),
    ),
    "prefect.results.ResultRecord fields metadata, result": lambda m: m.setattr(
        prefect_internals, "ResultRecord", _RecordWithoutResult
    ),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_check_fails_naming_a_name_an_upgrade_removed(name, monkeypatch):
    assert name in prefect_internals.NEEDED
    BREAKS[name](monkeypatch)
    assert name in prefect_internals.missing()
    with pytest.raises(ImportError, match=re.escape(name)):
        prefect_internals.check.__wrapped__()  # not check(): that one remembers that the real Prefect passed


def test_run_task_sync_takes_what_the_task_host_passes():
    from prefect.task_engine import run_task_sync

    parameters = set(inspect.signature(run_task_sync).parameters)
    assert {"task", "task_run_id", "parameters", "wait_for", "return_type", "dependencies", "context"} <= parameters


@pytest.mark.parametrize("package, pinned", [("prefect", "3.7.7"), ("prefect-ray", "0.6.0")])
def test_the_installed_prefect_is_the_one_read(package, pinned):
    from importlib.metadata import version

    assert version(package) == pinned, (
        f"{package} {version(package)}: re-read flows/plumbing/prefect_internals.py first"
    )
