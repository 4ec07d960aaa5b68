"""ResourcePool, ClassWithInitArgs and WorkerGroup: the backend-independent half of the single controller.

``WorkerGroup._bind_worker_method`` is the binding step: it walks a Worker class, finds methods tagged by
``@register`` and puts a same-named method on the group, built by the backend's ``func_generator``.
"""

from __future__ import annotations

from typing import Any, Callable

from rlworkers.single_controller.base.decorator import MAGIC_ATTR, get_predefined_dispatch_fn


class ResourcePool:
    """How many worker processes run on each node: ``process_on_nodes=[4, 4]`` is 8 workers on 2 nodes."""

    def __init__(
        self, process_on_nodes: list[int] | None = None, max_colocate_count: int = 10, n_gpus_per_node: int = 8
    ):
        self._store = list(process_on_nodes or [])
        if any(n <= 0 for n in self._store):
            raise ValueError(f"process_on_nodes must hold positive counts, got {self._store}")
        self.max_colocate_count = max_colocate_count
        self.n_gpus_per_node = n_gpus_per_node

    def add_node(self, process_count: int) -> None:
        self._store.append(process_count)

    @property
    def world_size(self) -> int:
        return sum(self._store)

    @property
    def store(self) -> list[int]:
        return list(self._store)

    def __call__(self) -> list[int]:
        return self.store


class ClassWithInitArgs:
    """A class and its constructor arguments, instantiated later (and possibly elsewhere)."""

    def __init__(self, cls: type, *args, **kwargs):
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    def __call__(self) -> Any:
        return self.cls(*self.args, **self.kwargs)


def registered_methods(user_cls: type) -> dict[str, dict]:
    """``{method_name: register attributes}`` for every ``@register``-ed method of ``user_cls``."""
    methods = {}
    for name in dir(user_cls):
        try:
            attr = getattr(user_cls, name)
        except Exception:  # properties and descriptors that raise on class access
            continue
        if callable(attr) and hasattr(attr, MAGIC_ATTR):
            methods[name] = getattr(attr, MAGIC_ATTR)
    return methods


class WorkerGroup:
    """A group of workers of one class, called as one object. Backends implement execution and ``share``."""

    def __init__(self, resource_pool: ResourcePool | None, **kwargs):
        self._workers: list = []
        self._worker_names: list[str] = []
        self._master_addr: str | None = None
        self._master_port: str | None = None
        self._bindings: list[tuple[type, str]] = []  # (worker class, remote prefix) bound on this group
        self._dispatch_info: dict[str, list[int]] = {}  # nd dispatch: mesh name -> dp rank of each rank
        self._collect_info: dict[str, list[bool]] = {}  # nd dispatch: mesh name -> is each rank a collector

    @property
    def world_size(self) -> int:
        return len(self._workers)

    def share(self, value: Any) -> Any:
        """The value to send to every rank for a broadcast argument (backends may store it once)."""
        return value

    def _bind_worker_method(self, user_defined_cls: type, func_generator: Callable, remote_prefix: str = "") -> list:
        """Put a distributed call on this group for each ``@register``-ed method of ``user_defined_cls``.

        ``remote_prefix`` names the method on the remote actor (``"actor_"`` for colocated role workers).
        """
        bound = []
        self._bindings = [*self._bindings, (user_defined_cls, remote_prefix)]
        for name, attrs in registered_methods(user_defined_cls).items():
            fns = get_predefined_dispatch_fn(attrs["dispatch_mode"])
            func = func_generator(
                self,
                remote_prefix + name,
                dispatch_fn=fns["dispatch_fn"],
                collect_fn=fns["collect_fn"],
                execute_mode=attrs["execute_mode"],
                blocking=attrs["blocking"],
            )
            if hasattr(self, name) and name not in self.__dict__:
                raise ValueError(f"worker method {name!r} clashes with a WorkerGroup attribute; rename it")
            setattr(self, name, func)
            bound.append(name)
        return bound
