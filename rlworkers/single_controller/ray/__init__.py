from rlworkers.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from rlworkers.single_controller.ray.colocate import (
    create_colocated_worker_cls,
    create_colocated_worker_cls_fused,
    create_colocated_worker_raw_cls,
)

__all__ = ["RayClassWithInitArgs", "RayResourcePool", "RayWorkerGroup", "create_colocated_worker_cls",
           "create_colocated_worker_cls_fused", "create_colocated_worker_raw_cls"]
