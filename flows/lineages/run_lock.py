"""One run of a lineage at a time (and one attempt of a run name), however the runs were started.

A deployment's ``concurrency_limit`` does not do this: it covers one deployment only (not ``rlflow train ...
trainer.lineage=X``, nor a second deployment of the same lineage), and Prefect releases its slot when a run pauses
(``trainer.promotion: manual``), after which the paused run's lease renewal fails and Prefect ends it Crashed.
So the lock is the flow's own: a Prefect global concurrency limit of 1 named after the lineage
(``rlflow-lineage-<lineage>``, or ``rlflow-run-<run name>`` for a run outside a lineage), taken by ``start_run``
before anything starts and held, through a pause, until the run has published and closed (``Run.close``).

The slot is a lease (Prefect's client API) that a thread of the holding process renews. A process that dies
(SIGKILL, OOM, a lost machine) stops renewing and the slot frees itself within ``LEASE_S``; the next attempt of the
same run does not wait for that: it finds the dead attempt's lease in the run folder (``lock.json``) and releases
it. Another run waits for the slot, saying so in its log, instead of training the same lineage from the same parent
and data cursor.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import httpx
from prefect import get_run_logger
from prefect.exceptions import MissingContextError

from rlworkers.checkpoint import read_json, write_json
from rlworkers.storage import filesystem

logger = logging.getLogger(__name__)

LEASE_S = 60.0  # Prefect's shortest lease (it refuses less): a dead holder's slot frees itself this long after
RENEW_EVERY_S = 20.0  # its last renewal
LOCK_FILE = "lock.json"  # in the run folder: the lease its newest attempt holds


def lock_name(lineage: str | None, run_name: str) -> str:
    return f"rlflow-lineage-{lineage}" if lineage else f"rlflow-run-{run_name}"


@contextlib.contextmanager
def one_run_at_a_time(lineage: str | None, run_name: str, root: str) -> Iterator[None]:
    """Hold the lineage's (or the run name's) slot for the body; wait, saying so, while another run holds it.
    ``root``: the run folder, where the lease is written for the run's next attempt."""
    from prefect.client.orchestration import get_client

    name = lock_name(lineage, run_name)
    with get_client(sync_client=True) as client:
        with contextlib.suppress(Exception):  # two first runs of a lineage create it at once: one of them wins
            client.upsert_global_concurrency_limit_by_name(name, limit=1)
        release_dead_attempt(client, root)
        lease_id = acquire(client, name, f"lineage {lineage!r}" if lineage else f"run {run_name!r}")
    write_json(f"{root}/{LOCK_FILE}", {"lease_id": lease_id, "limit": name})
    stop = threading.Event()
    renewing = threading.Thread(target=renew, args=(lease_id, stop), name=f"renew {name}", daemon=True)
    renewing.start()
    try:
        yield
    finally:
        stop.set()
        renewing.join(timeout=5)
        with get_client(sync_client=True) as client, contextlib.suppress(Exception):  # expires anyway
            client.release_concurrency_slots_with_lease(lease_id)
        with contextlib.suppress(Exception):
            fs, path = filesystem(f"{root}/{LOCK_FILE}")
            fs.rm(path)


def acquire(client, name: str, what: str) -> str:
    """A lease on one slot of ``name``, waiting (and saying so once) while another run holds it."""
    said = False
    while True:
        try:
            response = client.increment_concurrency_slots_with_lease(
                names=[name], slots=1, mode="concurrency", lease_duration=LEASE_S
            )
            return str(response.json()["lease_id"])
        except httpx.HTTPStatusError as error:
            if error.response.status_code != 423:  # 423 Locked: the slot is taken
                raise
            if not said:
                run_logger().warning(
                    "another run of %s is running (Prefect concurrency limit %r): waiting for it to end, as one "
                    "%s trains at a time",
                    what,
                    name,
                    what.split()[0] + (" name" if what.startswith("run") else ""),
                )
                said = True
            time.sleep(min(float(error.response.headers.get("Retry-After", 5)), 10.0))


def release_dead_attempt(client, root: str) -> None:
    """A lease an earlier attempt of this run left (it died holding it): released, so this attempt need not wait
    for it to expire. The earlier attempt is dead: Prefect starts a run's next attempt only after the last ended."""
    fs, path = filesystem(f"{root}/{LOCK_FILE}")
    if fs.exists(path):
        with contextlib.suppress(Exception):  # already expired (404), or the file is torn
            client.release_concurrency_slots_with_lease(read_json(f"{root}/{LOCK_FILE}")["lease_id"])


def renew(lease_id: str, stop: threading.Event) -> None:
    """Renew the lease every ``RENEW_EVERY_S`` until ``stop``; a failure (the server away for a while) is said
    once and retried: the run goes on training, as its slot may only be lost, not its work."""
    from prefect.client.orchestration import get_client

    warned = False
    with get_client(sync_client=True) as client:
        while not stop.wait(RENEW_EVERY_S):
            try:
                client.renew_concurrency_lease(lease_id, lease_duration=LEASE_S)
            except Exception as error:
                if not warned:
                    logger.warning("renewing the lineage lock's lease failed (%s); trying again", error)
                    warned = True


def run_logger() -> logging.Logger:
    """The flow run's logger (its lines reach the Prefect UI), or this module's outside a flow run."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logger
