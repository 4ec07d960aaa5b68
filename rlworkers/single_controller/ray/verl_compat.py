"""verl's pool helpers that no rlflow flow uses, kept (and tested in tests/test_single_controller_verl_parity.py)
because they are part of the porting promise: a verl trainer that splits, merges or names its pools ports by
changing imports. ``SubRayResourcePool`` (a range of another pool's bundles),
``split_resource_pool``, ``merge_resource_pool`` and ``ResourcePoolManager`` (pools by role)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import PlacementGroup

from rlworkers.single_controller.errors import PlacementError
from rlworkers.single_controller.ray.placement import RayResourcePool, _resources


class SubRayResourcePool(RayResourcePool):
    """Bundles ``start_bundle_index .. start_bundle_index + subgroup_world_size`` (in rank order) of a placed
    pool, made by ``split_resource_pool``: the parent's placement groups, shared, so ``remove`` belongs to the
    parent."""

    def __init__(
        self, placement_groups: list[PlacementGroup], start_bundle_index: int, subgroup_world_size: int, **pool_options
    ):
        super().__init__(**pool_options)
        self.pgs = placement_groups
        self.start_bundle_index = start_bundle_index
        self.subgroup_world_size = subgroup_world_size

    @property
    def world_size(self) -> int:
        return self.subgroup_world_size

    def bundle_slots(self) -> list[tuple[int, PlacementGroup, int]]:
        start = self.start_bundle_index
        return super().bundle_slots()[start : start + self.subgroup_world_size]

    def remove(self) -> None:
        raise ValueError(
            f"resource pool {self.name_prefix!r} is split from another pool and shares its placement "
            "groups: call remove() on the pool it was split from"
        )


def split_resource_pool(resource_pool: RayResourcePool, split_size: int | list[int]) -> list[SubRayResourcePool]:
    """Consecutive, disjoint parts of ``resource_pool`` (placed now if it is not yet): ``split_size`` is the
    size of every part (it must divide the pool's world size) or a list of sizes summing to it. A part can be
    split again."""
    world_size = resource_pool.world_size
    if isinstance(split_size, int):
        if split_size <= 0 or world_size % split_size:
            raise ValueError(f"split_size={split_size} must divide the pool's world size {world_size}")
        split_size = [split_size] * (world_size // split_size)
    if sum(split_size) != world_size or min(split_size) <= 0:
        raise ValueError(
            f"split_size={split_size} must be positive sizes summing to the pool's world size {world_size}"
        )
    offset = resource_pool.start_bundle_index if isinstance(resource_pool, SubRayResourcePool) else 0
    starts = offset + np.cumsum([0] + split_size[:-1])
    return [
        SubRayResourcePool(
            placement_groups=resource_pool.get_placement_groups(),
            start_bundle_index=int(start),
            subgroup_world_size=size,
            process_on_nodes=resource_pool.store,
            use_gpu=resource_pool.use_gpu,
            name_prefix=f"{resource_pool.name_prefix}_split_{i}",
            max_colocate_count=resource_pool.max_colocate_count,
            cpus_per_worker=resource_pool.cpus_per_worker,
        )
        for i, (start, size) in enumerate(zip(starts, split_size))
    ]


def merge_resource_pool(rp1: RayResourcePool, rp2: RayResourcePool) -> RayResourcePool:
    """One pool over the placement groups of both (placed now if they are not yet): rp1's ranks, then rp2's."""
    for option in ("use_gpu", "max_colocate_count", "cpus_per_worker", "detached"):
        if getattr(rp1, option) != getattr(rp2, option):
            raise ValueError(
                f"cannot merge resource pools whose {option} differ ({getattr(rp1, option)} and "
                f"{getattr(rp2, option)}): create them with the same {option}"
            )
    merged = RayResourcePool(
        rp1.store + rp2.store,
        use_gpu=rp1.use_gpu,
        name_prefix=f"{rp1.name_prefix}_{rp2.name_prefix}",
        max_colocate_count=rp1.max_colocate_count,
        detached=rp1.detached,
        cpus_per_worker=rp1.cpus_per_worker,
    )
    merged.pgs = rp1.get_placement_groups() + rp2.get_placement_groups()
    return merged


@dataclass
class ResourcePoolManager:
    """verl's trainer helper: named pools and the pool each role runs on.

    ``resource_pool_spec`` maps a pool name to its ``process_on_nodes`` (``{"global_pool": [8, 8]}``),
    ``mapping`` a role to a pool name. ``create_resource_pool()`` builds every pool (placed when a worker group
    first uses it) after checking that the cluster has room for all of them together. ``use_gpu``,
    ``max_colocate_count`` (verl: 3) and ``cpus_per_worker`` apply to every pool.
    """

    resource_pool_spec: dict[str, list[int]]
    mapping: dict[Any, str]
    resource_pool_dict: dict[str, RayResourcePool] = field(default_factory=dict)
    use_gpu: bool = True
    max_colocate_count: int = 3
    cpus_per_worker: float = 1.0

    def create_resource_pool(self) -> None:
        if not self.resource_pool_spec:
            raise ValueError("resource_pool_spec is empty: name at least one pool, e.g. {'global_pool': [8]}")
        unknown = sorted(set(self.mapping.values()) - set(self.resource_pool_spec))
        if unknown:
            raise ValueError(
                f"mapping names pools {unknown} that resource_pool_spec lacks (it has "
                f"{sorted(self.resource_pool_spec)}): add them to resource_pool_spec"
            )
        for name, process_on_nodes in self.resource_pool_spec.items():
            self.resource_pool_dict[name] = RayResourcePool(
                process_on_nodes=process_on_nodes,
                use_gpu=self.use_gpu,
                name_prefix=name,
                max_colocate_count=self.max_colocate_count,
                cpus_per_worker=self.cpus_per_worker,
            )
        self._check_resource_available()

    def get_resource_pool(self, role) -> RayResourcePool:
        if role not in self.mapping:
            raise KeyError(f"role {role!r} has no resource pool; mapping has roles {list(self.mapping)}")
        if not self.resource_pool_dict:
            raise ValueError("no resource pools yet: call create_resource_pool() first")
        return self.resource_pool_dict[self.mapping[role]]

    def get_n_gpus(self) -> int:
        """Workers over all pools (one GPU each when the pools use GPUs)."""
        return sum(sum(process_on_nodes) for process_on_nodes in self.resource_pool_spec.values())

    def _check_resource_available(self) -> None:
        """The cluster's free resources cover all pools together (each pool checks its own node fit when placed)."""
        bundle = next(iter(self.resource_pool_dict.values())).bundle()
        wanted = {key: value * self.get_n_gpus() for key, value in bundle.items()}
        available = ray.available_resources()
        if any(available.get(key, 0) < value for key, value in wanted.items()):
            raise PlacementError(
                f"resource pools {self.resource_pool_spec} need {wanted} together ({self.get_n_gpus()} bundles of "
                f"{bundle}); the cluster has {_resources(available, wanted)} free. Fix: smaller pools, a lower "
                f"max_colocate_count (now {self.max_colocate_count}) or cpus_per_worker (now {self.cpus_per_worker}), "
                "or more resources in the cluster."
            )
