"""The HybridFlow single controller: ``@register`` tags worker methods, a WorkerGroup binds them as one call.

verl's import paths map one to one: ``verl.single_controller`` -> ``rlworkers.single_controller``.
"""

from rlworkers.single_controller.base import (
    ClassWithInitArgs,
    Dispatch,
    Execute,
    ResourcePool,
    Worker,
    WorkerGroup,
    register,
)
from rlworkers.single_controller.errors import PlacementError, StageTimeout, WorkerError, WorkerProcess

__all__ = ["ClassWithInitArgs", "Dispatch", "Execute", "PlacementError", "ResourcePool", "StageTimeout", "Worker",
           "WorkerError", "WorkerGroup", "WorkerProcess", "register"]
