"""Several roles in one actor process: ``create_colocated_worker_cls`` + ``RayWorkerGroup.spawn`` (or ``fuse``).

The colocated class instantiates every role's worker in the same process, so actor, rollout and reference share
memory (and devices), and exposes each role's registered method ``m`` as ``<role>_m``. ``spawn`` then gives one
WorkerGroup per role whose methods have the role's plain names; ``fuse`` puts those groups on the colocated group
as ``group.<role>``. verl's two generations of colocation (WorkerDict and FusedWorker) are this one class.
A ``Dispatch.DIRECT_ROLLOUT_METHOD`` method of a role whose name contains "rollout" is also bound under its plain
name (verl's rule: an async rollout server calls it on the actor itself).
"""

from __future__ import annotations

import inspect

from rlworkers.single_controller.base.decorator import MAGIC_ATTR, Dispatch
from rlworkers.single_controller.base.worker import Worker
from rlworkers.single_controller.base.worker_group import registered_methods
from rlworkers.single_controller.ray.base import RayClassWithInitArgs


def _role_method(role: str, name: str, attrs: dict, is_async: bool):
    if is_async:

        async def method(self, *args, **kwargs):
            return await getattr(self.fused_worker_dict[role], name)(*args, **kwargs)
    else:

        def method(self, *args, **kwargs):
            return getattr(self.fused_worker_dict[role], name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = f"{role}_{name}"
    setattr(method, MAGIC_ATTR, attrs)
    return method


def create_colocated_worker_raw_cls(class_dict: dict[str, RayClassWithInitArgs]) -> type:
    """A Worker class holding an instance of each role's class (``{"actor": ..., "ref": ...}``) as ``self.<role>``
    and in ``fused_worker_dict`` (each role's worker gets the same dict, to reach its siblings). Subclass it to add
    methods that use several roles, then wrap it: ``RayClassWithInitArgs(cls=Subclass)``."""
    if not class_dict:
        raise ValueError("create_colocated_worker_raw_cls needs at least one role")
    roles = {role: (cia.user_cls, cia.args, cia.kwargs) for role, cia in class_dict.items()}

    class FusedWorker(Worker):
        raw_cls_dict = {role: cls for role, (cls, _, _) in roles.items()}  # what RayWorkerGroup.spawn binds

        def __init__(self):
            super().__init__()
            self.fused_worker_dict = {role: cls(*args, **kwargs) for role, (cls, args, kwargs) in roles.items()}
            for role, worker in self.fused_worker_dict.items():
                setattr(self, role, worker)
                worker.fused_worker_dict = self.fused_worker_dict

    for role, (cls, _, _) in roles.items():
        for name, attrs in registered_methods(cls).items():
            is_async = inspect.iscoroutinefunction(getattr(cls, name))
            method = _role_method(role, name, attrs, is_async)
            setattr(FusedWorker, f"{role}_{name}", method)
            if attrs["dispatch_mode"] == Dispatch.DIRECT_ROLLOUT_METHOD and "rollout" in role:
                # verl: a rollout role's direct method keeps its plain name, for callers that hold the actor
                if hasattr(FusedWorker, name):
                    raise ValueError(f"direct rollout method {name!r} of role {role!r} clashes with another {name!r}")
                setattr(FusedWorker, name, method)
    FusedWorker.__name__ = FusedWorker.__qualname__ = "FusedWorker_" + "_".join(roles)
    return FusedWorker


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """``create_colocated_worker_raw_cls`` ready to start: ``RayWorkerGroup(pool, create_colocated_worker_cls(
    {...})).spawn({"actor", "ref"})``. Options such as ``runtime_env`` of every role apply to the shared process.
    verl's ``create_colocated_worker_cls_fused`` is the same function here."""
    colocated = RayClassWithInitArgs(cls=create_colocated_worker_raw_cls(class_dict))
    for cia in class_dict.values():
        colocated.update_options(cia._options)
    return colocated


create_colocated_worker_cls_fused = create_colocated_worker_cls
