"""Worker processes kept in the local Ray of `rlflow server up` between the runs of different processes.

`rlflow server up` starts a Ray beside the Prefect and MLflow servers (flows/ops/services.py); every run of this machine
that was given no other Ray joins it (``$RLFLOW_LOCAL_RAY``, flows/controller/groups.py ``ray_settings``). There a run
builds its worker groups and its task host as detached actors, in detached placement groups, and this module's
``KeptProcesses`` actor (one per Ray, detached too) records them: held by the run's process while it runs, idle once
it ended and its workers let go (``Worker.end_for_reuse``). The next run, in another process (the next `rlflow train`,
a deployment run), takes the idle ones of the same class, size, resources and environment and builds its workers in
them (``RayWorkerGroup.reinitialize``: seeded and set up exactly as in new processes) instead of starting processes
that import torch and transformers again. What a run does not take is ended then (so it never holds the placement a
run needs); so is what a process that died held (a SIGKILLed run: found within ``CHECK_EVERY_S``, or at the next
take), what stayed idle longer than ``IDLE_S``, and all of it at `rlflow server down` (the Ray stops).

A group is ended by removing its placement groups (Ray ends the actors placed in them: a group ``restart``ed after a
fault has other actors in the same placement groups); a task host, which asks for no resources, by killing it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

from flows.plumbing.forkserver import start_ticks

LOCAL_RAY_ENV = "RLFLOW_LOCAL_RAY"  # the address of the local Ray of `rlflow server up` (flows/ops/services.py)
NAMESPACE = "rlflow"
REGISTRY_NAME = (
    "rlflow-kept-processes-2"  # -2: holders by start ticks (a registry of before, in a Ray still up, is left alone)
)
IDLE_S = 1800.0  # an idle group or host older than this is ended: its processes hold memory (~0.4 GiB each)
CHECK_EVERY_S = 5.0  # how often the registry looks for processes that died holding something


def digest(value) -> str:
    """A key's stand-in for ``value`` (an environment: it may hold the servers' credentials, which the registry is
    not to hold)."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def holder() -> tuple[int, int]:
    """This process as a holder of kept processes: its pid and start time (a pid alone may be reused), in clock ticks
    since boot. Not psutil's ``create_time``: that adds the boot time in whole seconds of the wall clock, which moves
    by one when the clock is adjusted across a second, and a live holder then looked dead (its groups were ended
    under its run)."""
    return os.getpid(), start_ticks(os.getpid())


def _holder_alive(who: tuple[int, int]) -> bool:
    try:
        return start_ticks(who[0]) == who[1]
    except (FileNotFoundError, ProcessLookupError):
        return False


class KeptProcesses:
    """The registry of kept processes of one Ray (a detached actor; see the module docstring). An item is one worker
    group (its placement groups) or one task host (its actor), with ``key`` (what a run must ask for to take it),
    ``payload`` (the pickled group or actor handle the run gets back), ``pids`` (its processes on this node, waited
    for when it ends) and ``holder`` (the process using it; None while it is idle)."""

    def __init__(self):
        self._items: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._check_forever, daemon=True).start()

    def hold(self, item_id: str, kind: str, key: tuple, who: tuple, pgs: list = (), actors: list = (), pids=()) -> None:
        """Record an item a run just started: held by ``who`` until it calls ``release`` or ``end``."""
        with self._lock:
            self._items[item_id] = {
                "kind": kind, "key": key, "holder": who, "pgs": list(pgs), "actors": list(actors),
                "pids": list(pids), "payload": None, "idle_since": None,
            }  # fmt: skip

    def release(self, item_id: str, payload: bytes, pids: list[int]) -> None:
        """The holder ended its run and its workers let go: the item waits, idle, for the next run that asks for it."""
        with self._lock:
            item = self._items.get(item_id)
            if item is not None:
                item.update(holder=None, payload=payload, pids=list(pids), idle_since=time.monotonic())

    def take(self, kind: str, keys: list[tuple], who: tuple) -> list[tuple[str, bytes] | None]:
        """For each of ``keys``, an idle item of ``kind`` with that key, now held by ``who`` (``(item id, payload)``;
        None where none is idle). Idle items of ``kind`` not taken are ended (and waited for) first, with what dead
        processes held."""
        taken, ending = [], []
        with self._lock:
            idle = [i for i, item in self._items.items() if item["kind"] == kind and item["holder"] is None]
            for key in keys:
                found = next((i for i in idle if self._items[i]["key"] == key), None)
                if found is None:
                    taken.append(None)
                    continue
                idle.remove(found)
                self._items[found].update(holder=who, idle_since=None)
                taken.append((found, self._items[found]["payload"]))
            ending = [self._items.pop(i) for i in idle + self._dead_holders()]
        self._end(ending)
        return taken

    def end(self, item_ids: list[str]) -> None:
        """End items (their processes exit, their placement is freed) and forget them."""
        with self._lock:
            ending = [self._items.pop(i) for i in item_ids if i in self._items]
        self._end(ending)

    def end_idle(self) -> int:
        """End every idle item; returns how many there were."""
        with self._lock:
            ending = [self._items.pop(i) for i, item in list(self._items.items()) if item["holder"] is None]
        self._end(ending)
        return len(ending)

    def items(self) -> list[dict[str, Any]]:
        """What is kept now: kind, key, held or idle, pids."""
        with self._lock:
            return [
                {"id": i, "kind": item["kind"], "key": item["key"], "held": item["holder"] is not None,
                 "pids": item["pids"]}
                for i, item in self._items.items()
            ]  # fmt: skip

    def _dead_holders(self) -> list[str]:
        now = time.monotonic()
        return [
            i
            for i, item in self._items.items()
            if (item["holder"] is not None and not _holder_alive(item["holder"]))
            or (item["idle_since"] is not None and now - item["idle_since"] > IDLE_S)
        ]

    def _check_forever(self) -> None:
        while True:
            time.sleep(CHECK_EVERY_S)
            with self._lock:
                ending = [self._items.pop(i) for i in self._dead_holders()]
            self._end(ending)

    @staticmethod
    def _end(items: list[dict[str, Any]], wait_s: float = 10.0) -> None:
        import psutil
        import ray
        from ray.util.placement_group import remove_placement_group

        for item in items:
            for pg in item["pgs"]:
                with contextlib.suppress(Exception):  # removed already
                    remove_placement_group(pg)
            for actor in item["actors"]:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
        processes = []
        for pid in {pid for item in items for pid in item["pids"]}:
            with contextlib.suppress(psutil.NoSuchProcess):
                processes.append(psutil.Process(pid))
        psutil.wait_procs(processes, timeout=wait_s)  # whoever ends them expects them gone, not still exiting


def registry():
    """The ``KeptProcesses`` actor of the Ray this process is connected to (started by the first run that asks)."""
    import ray

    return (
        ray.remote(KeptProcesses)
        .options(name=REGISTRY_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0)
        .remote()
    )


def in_local_ray() -> bool:
    """Whether this process is connected to the local Ray of `rlflow server up` (``$RLFLOW_LOCAL_RAY``: its port on
    127.0.0.1; Ray names it by the node's address)."""
    import ray

    address = os.environ.get(LOCAL_RAY_ENV)
    if not address or not ray.is_initialized() or ray.util.client.ray.is_connected():
        return False
    host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
    return port == address.rpartition(":")[2] and host in ("127.0.0.1", ray.util.get_node_ip_address())


def ensure_token() -> None:
    """Before starting a local Ray with `ray start`: this user's token for Ray's token authentication, made with
    Ray's own function if there is none (``ray get-auth-token --generate``). `ray start` turns token authentication
    on only when a token exists (a new local Ray of ``ray.init`` makes one), and runs join it with authentication on
    (``use_token_authentication``): on a machine where Ray never ran before, every join would be refused."""
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        return
    from ray._private.authentication.authentication_token_setup import (
        AuthenticationTokenLoader,
        generate_and_save_token,
    )

    if not AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
        generate_and_save_token()


def use_token_authentication() -> None:
    """Before joining the local Ray: send its token (Ray's token authentication, on by default for `ray start`; the
    token is in ~/.ray/auth_token). Ray reads ``RAY_AUTH_MODE`` when it is imported, so it is set with Ray's own
    function, as ``ray.init`` does for the local Ray it starts; a ``RAY_AUTH_MODE`` the environment sets is kept."""
    if "RAY_AUTH_MODE" not in os.environ:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()


def hold(item_id: str, kind: str, key: tuple, pgs: list = (), actors: list = (), pids=()) -> None:
    """Record (or update) an item this process holds: see ``KeptProcesses.hold``."""
    import ray

    ray.get(registry().hold.remote(item_id, kind, key, holder(), list(pgs), list(actors), list(pids)))


def take(kind: str, keys: list[tuple]) -> list[tuple[str, bytes] | None]:
    """``KeptProcesses.take`` for this process."""
    import ray

    return ray.get(registry().take.remote(kind, keys, holder()))


def release(item_id: str, payload: bytes, pids: list[int]) -> None:
    import ray

    ray.get(registry().release.remote(item_id, payload, pids))


def end(item_ids: list[str]) -> None:
    import ray

    ray.get(registry().end.remote(item_ids))


def end_idle() -> int:
    import ray

    return ray.get(registry().end_idle.remote())
