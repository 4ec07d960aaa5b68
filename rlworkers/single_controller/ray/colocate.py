"""Several roles in one actor process: ``create_colocated_worker_cls`` + ``RayWorkerGroup.spawn``.

The colocated class instantiates every role's worker in the same process, so actor, rollout and reference share
memory (and devices), and exposes each role's registered method ``m`` as ``<role>_m``. ``spawn`` then gives one
WorkerGroup per role whose methods have the role's plain names.
"""

from __future__ import annotations

import inspect

from rlworkers.single_controller.base.decorator import MAGIC_ATTR
from rlworkers.single_controller.base.worker import Worker
from rlworkers.single_controller.base.worker_group import registered_methods
from rlworkers.single_controller.ray.base import RayClassWithInitArgs


def _role_method(role: str, name: str, attrs: dict, is_async: bool):
    if is_async:
        async def method(self, *args, **kwargs):
            return await getattr(self.worker_dict[role], name)(*args, **kwargs)
    else:
        def method(self, *args, **kwargs):
            return getattr(self.worker_dict[role], name)(*args, **kwargs)
    method.__name__ = method.__qualname__ = f"{role}_{name}"
    setattr(method, MAGIC_ATTR, attrs)
    return method


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """One worker class holding an instance of each role's class (``{"actor": ..., "ref": ...}``)."""
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    roles = {role: (cia.user_cls, cia.args, cia.kwargs) for role, cia in class_dict.items()}

    class WorkerDict(Worker):
        def __init__(self):
            super().__init__()
            self.worker_dict = {role: cls(*args, **kwargs) for role, (cls, args, kwargs) in roles.items()}

    for role, (cls, _, _) in roles.items():
        for name, attrs in registered_methods(cls).items():
            is_async = inspect.iscoroutinefunction(getattr(cls, name))
            setattr(WorkerDict, f"{role}_{name}", _role_method(role, name, attrs, is_async))
    WorkerDict.__name__ = WorkerDict.__qualname__ = "WorkerDict_" + "_".join(roles)

    colocated = RayClassWithInitArgs(cls=WorkerDict)
    colocated.role_classes = {role: cls for role, (cls, _, _) in roles.items()}
    for cia in class_dict.values():  # options such as runtime_env apply to the shared process
        colocated.update_options(cia._options)
    return colocated
