"""Reading what a flow run left in the Prefect API, as the UI does."""

from __future__ import annotations

import asyncio
import time


def settled_task_runs(flow_run_id, timeout_s: float = 30.0, quiet_s: float = 1.5) -> list:
    """The task runs of ``flow_run_id`` once the server has recorded what the flow run sent: the same ones, in the
    same states, for ``quiet_s``. The server writes task runs from their state events in batches (at least once a
    second, see ``flows/ops/services.py``), so the last ones appear a moment after the flow run ends."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read() -> list:
        async with get_client() as client:
            return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))

    deadline = time.monotonic() + timeout_s
    seen, runs = None, []
    while time.monotonic() < deadline:
        runs = asyncio.run(read())
        view = sorted((str(r.id), r.state_type) for r in runs)
        if view == seen:
            return runs
        seen = view
        time.sleep(quiet_s)
    return runs
