"""A process's start without Python's garbage collector going through its imports again and again.

A worker (or the flow's task host) imports torch, transformers and the rest when its actor is created: hundreds of
thousands of objects, and Python's collector goes through all of them several times while they are made (a large share
of the import; docs/performance.md). In a Ray worker process, ``import rlworkers`` (the first of rlflow's modules it
imports) turns the collector off, and the actor's constructor turns it on again once the imports are done
(``Worker.__init__``, ``TaskHost.__init__``), with what the imports made frozen (``gc.freeze``: modules, classes and
functions live as long as the process; later collections no longer go through them). A process that never constructs one
(a plain Ray task that imports rlworkers) has it on again after ``_LONGEST_PAUSE_S``. Elsewhere (a controller, a
notebook) nothing changes at import; a controller runs the import of its flow (``flows.launch.get_flow``, the bulk of
its start) with the collector off (``collector_off_while_importing``), then on again as it was, nothing frozen.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading

_LONGEST_PAUSE_S = 60.0
_paused = False


def pause_gc_while_importing() -> None:
    """In a Ray worker process (and only there): the collector off until ``resume_gc`` or ``_LONGEST_PAUSE_S``."""
    global _paused
    ray_worker = sys.modules.get("ray._private.worker")
    in_ray_worker = ray_worker is not None and getattr(ray_worker.global_worker, "mode", None) == ray_worker.WORKER_MODE
    if not in_ray_worker or not gc.isenabled() or _paused:
        return
    gc.disable()
    _paused = True
    timer = threading.Timer(_LONGEST_PAUSE_S, resume_gc)
    timer.daemon = True
    timer.start()


def resume_gc() -> None:
    """The imports are done: freeze what they made and collect again (nothing if this process did not pause)."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()


@contextlib.contextmanager
def collector_off_while_importing():
    """The collector off for the imports in the ``with`` block, then on again (if it was on before)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
