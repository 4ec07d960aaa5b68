from rlworkers.single_controller.ray.base import RayClassWithInitArgs, RayWorkerGroup
from rlworkers.single_controller.ray.colocate import (
    create_colocated_worker_cls,
    create_colocated_worker_cls_fused,
    create_colocated_worker_raw_cls,
)
from rlworkers.single_controller.ray.placement import RayResourcePool, sort_placement_group_by_node_ip
from rlworkers.single_controller.ray.verl_compat import (
    ResourcePoolManager,
    SubRayResourcePool,
    merge_resource_pool,
    split_resource_pool,
)

__all__ = [
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "ResourcePoolManager",
    "SubRayResourcePool",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "create_colocated_worker_raw_cls",
    "merge_resource_pool",
    "sort_placement_group_by_node_ip",
    "split_resource_pool",
]
