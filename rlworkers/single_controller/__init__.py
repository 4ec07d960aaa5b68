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
from rlworkers.single_controller.futures import DataProtoFuture

__all__ = [
    "ClassWithInitArgs",
    "DataProtoFuture",
    "Dispatch",
    "Execute",
    "PlacementError",
    "ResourcePool",
    "StageTimeout",
    "Worker",
    "WorkerError",
    "WorkerGroup",
    "WorkerProcess",
    "register",
]
