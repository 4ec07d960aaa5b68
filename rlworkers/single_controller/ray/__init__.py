from rlworkers.single_controller.ray.base import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourcePoolManager,
    SubRayResourcePool,
    merge_resource_pool,
    sort_placement_group_by_node_ip,
    split_resource_pool,
)
from rlworkers.single_controller.ray.colocate import (
    create_colocated_worker_cls,
    create_colocated_worker_cls_fused,
    create_colocated_worker_raw_cls,
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
