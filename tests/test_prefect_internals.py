"""The private Prefect and prefect-ray names flows/task_runner.py builds on, checked in one place so that an upgrade
that renames or reshapes one fails here, by name, instead of somewhere inside a training run. The pins in
pyproject.toml (prefect==3.7.7, prefect-ray==0.6.0) say which versions these were read from.
"""

from __future__ import annotations

import inspect

import pytest


def test_the_private_names_the_task_runner_imports_exist():
    import prefect.context
    from prefect._flow_run_suspension import raise_if_flow_run_suspension_requested
    from prefect._internal.result_records import ResultRecord, ResultRecordMetadata
    from prefect.futures import PrefectFuture
    from prefect.task_engine import SyncTaskRunEngine
    from prefect_ray import RayTaskRunner

    assert callable(raise_if_flow_run_suspension_requested)
    assert {"metadata", "result"} <= set(ResultRecord.model_fields) and ResultRecordMetadata
    for name in ("_deployment_id", "_deployment_parameters"):  # ContextVars serialize_context_once reads
        assert hasattr(getattr(prefect.context, name), "get"), name
    for method in ("_resolve_parameters", "_wait_for_dependencies"):  # WarmTaskRunEngine overrides both
        assert callable(getattr(SyncTaskRunEngine, method, None)), method
    assert callable(getattr(RayTaskRunner, "_exchange_prefect_for_ray_futures", None))
    assert "_final_state" in inspect.getsource(PrefectFuture.__init__)  # PrefectRayFuture sets it when Ray is done


def test_serialize_context_once_returns_prefects_keys():
    """flows/task_runner.py's copy of ``prefect.context.serialize_context`` must hand the task host the same keys."""
    import uuid

    from prefect import task
    from prefect.context import serialize_context

    from flows.task_runner import serialize_context_once

    @task
    def noop():
        pass

    asset_ctx_kwargs = {"task": noop, "task_run_id": uuid.uuid4(), "task_inputs": {}, "copy_to_child_ctx": False}
    assert set(serialize_context_once(asset_ctx_kwargs)) == set(serialize_context(asset_ctx_kwargs))


def test_run_task_sync_takes_what_the_task_host_passes():
    from prefect.task_engine import run_task_sync

    parameters = set(inspect.signature(run_task_sync).parameters)
    assert {"task", "task_run_id", "parameters", "wait_for", "return_type", "dependencies", "context"} <= parameters


@pytest.mark.parametrize("package, pinned", [("prefect", "3.7.7"), ("prefect-ray", "0.6.0")])
def test_the_installed_prefect_is_the_one_read(package, pinned):
    from importlib.metadata import version

    assert version(package) == pinned, f"{package} {version(package)}: re-read flows/task_runner.py's patches first"
