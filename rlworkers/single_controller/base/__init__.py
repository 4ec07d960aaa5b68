from rlworkers.single_controller.base.decorator import Dispatch, Execute, register
from rlworkers.single_controller.base.worker import Worker
from rlworkers.single_controller.base.worker_group import ClassWithInitArgs, ResourcePool, WorkerGroup

__all__ = ["ClassWithInitArgs", "Dispatch", "Execute", "ResourcePool", "Worker", "WorkerGroup", "register"]
