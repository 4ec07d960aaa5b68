"""Scheduling: the work pool, the deployments of ``deployments/prefect.yaml``, and two Prefect automations that make
a crashed run recover without a person.

    rlflow deploy      # idempotent: work pool, deployments (schedules), automations
    rlflow worker      # a Prefect process worker on the pool (same as `prefect worker start --pool rlflow`)

The automations (Prefect UI -> Automations; each firing shows in the event feed and in the flow run's states):

- ``rlflow: crash unresponsive runs``: a flow run of a deployment tagged ``rlflow`` that sent a heartbeat
  (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, set to 30 s by the pool's job variables) and then neither another one
  nor a final state within ``HEARTBEAT_TIMEOUT_S`` is marked Crashed: its process died with its worker, or the
  machine restarted. (When only the flow-run process dies, the process worker itself marks it Crashed at once.)
- ``rlflow: restart crashed runs``: a Crashed flow run tagged ``rlflow`` is set back to Scheduled, so the worker
  starts a new attempt of the *same* flow run: same name, so the same training run, which resumes its newest
  valid checkpoint and continues its MLflow run. Each attempt counts the crashes in its flow run's state history
  and ends Failed, saying so, once they exceed ``trainer.max_crash_restarts`` (see ``flows/lineages/lineage.py``).

``rlflow worker`` backs the second one up (``restart_missed_crashes``): the Prefect server can drop an automation's
evaluation of an event (on SQLite, a busy database fails it with "database is locked" a few times in a row and the
event goes to the server's dead-letter queue), which left a crashed run Crashed for good. Every
``CRASH_CHECK_EVERY_S`` the worker sets such a run, Crashed for longer than ``CRASH_GRACE_S``, to the same
"Restarting" state itself, saying so in the state's message.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

from flows.lineages.lineage import RESTART_STATE_NAME
from flows.ops.preflight import ServerFailure, name_the_server

PROJECT_DIR = Path(__file__).resolve().parents[2]
PREFECT_FILE = PROJECT_DIR / "deployments" / "prefect.yaml"
POOL = "rlflow"
TAG = "rlflow"
HEARTBEAT_TIMEOUT_S = 120  # four heartbeats of 30 s
CRASH_GRACE_S = 60  # how long the restart automation has before `rlflow worker` restarts a crashed run itself
CRASH_CHECK_EVERY_S = 20


def automations() -> list:
    """The two automations (see the module docstring), matched on flow runs tagged ``rlflow``."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture

    ours = {"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{TAG}"}
    terminal = {f"prefect.flow-run.{state}" for state in ("Completed", "Failed", "Cancelled", "Crashed")}
    return [
        Automation(
            name="rlflow: crash unresponsive runs",
            description=f"Marks a run of an rlflow deployment Crashed when its heartbeats stop for "
            f"{HEARTBEAT_TIMEOUT_S} s (the process died with its worker or machine).",
            trigger=EventTrigger(
                match={"prefect.resource.id": "prefect.flow-run.*"},
                match_related=ours,
                after={"prefect.flow-run.heartbeat"},
                expect={"prefect.flow-run.heartbeat", *terminal},
                for_each={"prefect.resource.id"},
                posture=Posture.Proactive,
                threshold=1,
                within=timedelta(seconds=HEARTBEAT_TIMEOUT_S),
            ),
            actions=[
                ChangeFlowRunState(
                    state=StateType.CRASHED, message=f"no heartbeat for {HEARTBEAT_TIMEOUT_S} s: the process is gone"
                )
            ],
        ),
        Automation(
            name="rlflow: restart crashed runs",
            description="Starts a new attempt of a crashed run of an rlflow deployment; it resumes from the run's "
            "newest checkpoint. Attempts stop at trainer.max_crash_restarts crashes.",
            trigger=EventTrigger(
                match={"prefect.resource.id": "prefect.flow-run.*"},
                match_related=ours,
                expect={"prefect.flow-run.Crashed"},
                for_each={"prefect.resource.id"},
                posture=Posture.Reactive,
                threshold=1,
                within=timedelta(0),
            ),
            actions=[
                ChangeFlowRunState(
                    state=StateType.SCHEDULED,
                    name=RESTART_STATE_NAME,
                    message="rlflow: automatic restart after a crash; resumes from the newest checkpoint",
                )
            ],
        ),
    ]


def restart_missed_crashes(grace_s: float = CRASH_GRACE_S) -> list[str]:
    """Set the runs of rlflow deployments that have been Crashed for more than ``grace_s`` to "Restarting", as the
    restart automation would have (see the module docstring); returns their names."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Scheduled

    crashed = FlowRunFilter(
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CRASHED])),
        tags=FlowRunFilterTags(all_=[TAG]),
    )
    restarted = []
    with get_client(sync_client=True) as client:
        for run in client.read_flow_runs(flow_run_filter=crashed):
            age = datetime.now(timezone.utc) - run.state.timestamp
            if run.deployment_id is None or age.total_seconds() < grace_s:
                continue
            message = (
                f"rlflow worker: automatic restart after a crash ({age.total_seconds():.0f} s ago, the restart "
                "automation did not act); resumes from the newest checkpoint"
            )
            client.set_flow_run_state(run.id, Scheduled(name=RESTART_STATE_NAME, message=message), force=True)
            restarted.append(run.name)
    return restarted


def ensure_automations() -> list[str]:
    """Create the automations, or update the ones of the same name (so ``rlflow deploy`` can run again)."""
    from prefect.automations import Automation

    names = []
    for wanted in automations():
        try:
            existing = Automation.read(name=wanted.name)
        except ValueError:
            existing = None
        if existing is None:
            wanted.create()
        else:
            wanted.id = existing.id
            wanted.update()
        names.append(wanted.name)
    return names


def ensure_work_pool(name: str = POOL) -> None:
    _prefect("work-pool", "create", name, "--type", "process", "--overwrite")


def deploy_all(prefect_file: Path = PREFECT_FILE) -> str:
    """``prefect deploy --all`` on the project's prefect.yaml (the same command works by hand)."""
    return _prefect("--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file))


def _prefect(*args: str) -> str:
    env = {**os.environ, "RLFLOW_PROJECT_DIR": str(PROJECT_DIR)}
    result = subprocess.run(
        [sys.executable, "-m", "prefect", *args], cwd=PROJECT_DIR, env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        output = result.stdout + result.stderr
        failed = re.search(r"(?:Server|Client) error '([^']+)' for url '([^']+)'", output)
        if failed:  # the API server still failed after the client's retries: say which one, without the traceback
            status, url = failed.groups()
            raise ServerFailure(name_the_server(url, f"answered {status} to `prefect {' '.join(args[:3])}`"))
        raise RuntimeError(f"`prefect {' '.join(args)}` failed:\n{output}")
    return result.stdout
