"""Placement: ``RayResourcePool``, the placement groups that hold a worker group's slots (verl's name and
signature), and whether they are placed on live nodes."""

from __future__ import annotations

import uuid

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from rlworkers.single_controller.base.worker_group import ResourcePool
from rlworkers.single_controller.errors import PlacementError


class RayResourcePool(ResourcePool):
    """Worker slots on a Ray cluster: one placement group per entry of ``process_on_nodes``.

    Each worker gets a bundle of ``cpus_per_worker * max_colocate_count`` CPUs (and one GPU if ``use_gpu``);
    up to ``max_colocate_count`` worker groups may share the pool (each actor asks for its share).
    Placement that cannot succeed raises ``PlacementError`` at once; placement that waits on busy resources
    raises after ``placement_timeout_s``. Both name what was asked for and what the cluster has.
    """

    def __init__(
        self,
        process_on_nodes: list[int] | None = None,
        use_gpu: bool = True,
        name_prefix: str | None = None,
        max_colocate_count: int = 10,
        detached: bool = False,
        accelerator_type: str | None = None,
        cpus_per_worker: float = 1.0,
        placement_timeout_s: float = 60.0,
    ):
        super().__init__(process_on_nodes, max_colocate_count)
        self.use_gpu = use_gpu
        self.name_prefix = name_prefix if name_prefix is not None else f"rlflow_{uuid.uuid4().hex[:6]}_"
        self.detached = detached
        self.accelerator_type = accelerator_type
        self.cpus_per_worker = cpus_per_worker
        self.placement_timeout_s = placement_timeout_s
        self.pgs: list[PlacementGroup] | None = None

    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.cpus_per_worker * self.max_colocate_count}
        if self.use_gpu:
            bundle["GPU"] = 1
        if self.accelerator_type:
            bundle[self.accelerator_type] = 1e-4
        return bundle

    def _check_placeable(self) -> None:
        bundle = self.bundle()
        totals = ray.cluster_resources()
        wanted = {k: v * self.world_size for k, v in bundle.items()}
        short = {k: v for k, v in wanted.items() if totals.get(k, 0) < v}
        node_max = {}
        for node in ray.nodes():
            if node.get("Alive"):
                for key, value in node.get("Resources", {}).items():
                    node_max[key] = max(node_max.get(key, 0), value)
        too_big = {k: v for k, v in bundle.items() if node_max.get(k, 0) < v}
        if short or too_big:
            raise PlacementError(
                f"resource pool {self.store} cannot be placed: it asks for {wanted} in all "
                f"({self.world_size} bundles of {bundle}); the cluster has {_resources(totals, wanted)} in all and "
                f"at most {_resources(node_max, bundle)} on one node. Fix: lower max_colocate_count "
                f"(now {self.max_colocate_count}) or cpus_per_worker (now {self.cpus_per_worker}), use fewer workers, "
                f"pass use_gpu=False on CPU machines, or start Ray with more resources (ray.init(num_cpus=...))."
            )

    def get_placement_groups(
        self, strategy: str = "STRICT_PACK", name: str | None = None, device_name: str = "cuda"
    ) -> list[PlacementGroup]:
        if self.pgs is not None:
            return self.pgs
        self._check_placeable()
        lifetime = "detached" if self.detached else None
        pgs = [
            placement_group(
                [self.bundle()] * count,
                strategy=strategy,
                lifetime=lifetime,
                name=f"{name or self.name_prefix}group_{'_'.join(map(str, self.store))}:{idx}",
            )
            for idx, count in enumerate(self.store)
        ]
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=self.placement_timeout_s)
        if len(ready) < len(pgs):
            available = ray.available_resources()
            for pg in pgs:
                remove_placement_group(pg)
            raise PlacementError(
                f"resource pool {self.store} was not placed within {self.placement_timeout_s:.0f}s: "
                f"it asks for {len(self.store)} placement group(s) of bundles {self.bundle()}; resources free now: "
                f"{_resources(available, self.bundle())}. Other pools or actors hold the rest: shut them down, "
                "or raise placement_timeout_s if they will finish."
            )
        self.pgs = sort_placement_group_by_node_ip(pgs)
        return self.pgs

    def bundle_slots(self) -> list[tuple[int, PlacementGroup, int]]:
        """``(placement group index, placement group, bundle index)`` of each rank, in rank order."""
        return [
            (pg_idx, pg, bundle)
            for pg_idx, pg in enumerate(self.get_placement_groups())
            for bundle in range(pg.bundle_count)
        ]

    def remove(self) -> None:
        """Release the placement groups (the pool can be placed again later)."""
        for pg in self.pgs or []:
            remove_placement_group(pg)
        self.pgs = None


def _placed(pg: PlacementGroup) -> bool:
    """Every bundle of ``pg`` sits on a live node (Ray re-places the bundles of a lost node when it can)."""
    table = placement_group_table(pg)
    alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
    return table.get("state") == "CREATED" and set(table.get("bundles_to_node_id", {}).values()) <= alive


def _resources(available: dict, keys: dict) -> dict:
    return {k: round(available.get(k, 0), 3) for k in keys}


def sort_placement_group_by_node_ip(pgs: list[PlacementGroup]) -> list[PlacementGroup]:
    """``pgs`` ordered by the IP of the node each one is on (all bundles of a group share a node).

    Ranks follow this order, so RANK -> node stays the same across jobs and cluster restarts (a checkpoint saved
    per rank on local disk is found again on resume). Groups on the same node keep their order.
    """
    node_ip = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}

    def ip_of(pg: PlacementGroup) -> str:
        return node_ip[placement_group_table(pg)["bundles_to_node_id"][0]]

    return sorted(pgs, key=ip_of)
