"""The single controller on real local Ray: every dispatch and execute mode, padding, futures across groups,
colocation, torch.distributed over gloo, worker errors and unplaceable pools."""

from __future__ import annotations

import copy
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import ray
import torch

from rlworkers.protocol import DataProto
from rlworkers.single_controller import (
    DataProtoFuture,
    Dispatch,
    Execute,
    PlacementError,
    Worker,
    WorkerError,
    register,
)
from rlworkers.single_controller.base.decorator import register_dispatch_mode
from rlworkers.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
)


def _split_by_parity(worker_group, values):
    """A user dispatch mode: even-indexed items to rank 0, odd to rank 1."""
    return ([values[0::2], values[1::2]],), {}


def _sum_collect(worker_group, outputs):
    return sum(outputs)


PARITY = register_dispatch_mode("TEST_PARITY", _split_by_parity, _sum_collect)


class Echo(Worker):
    def __init__(self, scale: int = 1):
        super().__init__()
        self.scale = scale
        self.calls = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self, tag=None):
        return {
            "rank": self.rank,
            "world": self.world_size,
            "tag": tag,
            "pid": os.getpid(),
            "master": self.get_master_addr_port(),
        }

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def echo(self, value):
        return value

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def times_rank(self, value):
        return value * (self.rank + 1)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        out = DataProto.from_dict(
            {"x": data.batch["x"] * 2 * self.scale},
            {"uid": data.non_tensor_batch["uid"]},
            meta_info={"metrics": {"rows": len(data)}},
        )
        out.non_tensor_batch["rank"] = np.array([self.rank] * len(data), dtype=object)
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double_async(self, data: DataProto) -> DataProto:
        return self.double(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def sample_twice(self, data: DataProto) -> DataProto:
        return data.repeat(2, interleave=True)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, func, data: DataProto) -> DataProto:
        return func(self, data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def row_count(self, data: DataProto) -> dict:
        return {"rank": self.rank, "rows": len(data)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_rank_zero(self):
        self.calls += 1
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def call_count(self):
        return self.calls

    @register(dispatch_mode=PARITY)
    def sum_values(self, values):
        return sum(values)

    @register(dispatch_mode={"dispatch_fn": _split_by_parity, "collect_fn": _sum_collect})
    def sum_values_dict_mode(self, values):
        return sum(values)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_on_rank(self, rank):
        if self.rank == rank:
            raise ZeroDivisionError(f"boom on {self.rank}")
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def async_whoami(self):
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def garbage_collector(self):
        import gc

        return gc.isenabled(), gc.get_freeze_count()


class Summer(Worker):
    """A second role: reads what Echo produced."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add_one(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(
            {"x": data.batch["x"] + 1},
            {"uid": data.non_tensor_batch["uid"], "by": np.array([self.rank] * len(data), dtype=object)},
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()


class BrokenOnRankOne(Worker):
    def __init__(self):
        super().__init__()
        if self.rank == 1:
            raise RuntimeError("no model file on this node")


class Distributed(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce(self, backend="gloo"):
        used = self.init_process_group(backend=backend)
        tensor = torch.tensor([float(self.rank + 1)])
        torch.distributed.all_reduce(tensor)
        return used, tensor.item()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def gather_tags(self, tag: int) -> list:
        """Each rank's ``tag`` of the collective this call ran: the same on every rank when the ranks ran their
        calls in one order (a sharded model's forward, or gathering its weights, is such a collective)."""
        self.init_process_group(backend="gloo")
        tags = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(tags, tag)
        return tags


def make_group(cls, n, **init_kwargs):
    pool = RayResourcePool([n], use_gpu=False, max_colocate_count=1)
    return RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=cls, **init_kwargs)), pool


def batch(n):
    return DataProto.from_dict({"x": torch.arange(n, dtype=torch.float32)}, {"uid": [f"u{i}" for i in range(n)]})


@pytest.fixture(scope="module")
def echo_group(ray_cluster):
    group, pool = make_group(Echo, 4)
    yield group
    group.shutdown()
    pool.remove()


def test_worker_env_and_one_to_all(echo_group):
    infos = echo_group.whoami(tag=[1, 2])
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    assert all(i["world"] == 4 for i in infos)
    assert all(i["tag"] == [1, 2] for i in infos)  # a list argument is broadcast, never scattered
    assert len({i["master"] for i in infos}) == 1 and infos[0]["master"][1] is not None
    assert echo_group.execute_all_sync("getenv", "LOCAL_RANK") == ["0", "0", "0", "0"]  # Ray: one GPU per actor


def test_a_workers_imports_are_frozen_and_its_collector_runs_again_once_it_is_constructed(echo_group):
    """rlworkers/process_start.py: the collector is off while a worker process imports, then on, with what the imports
    made frozen; a process that is not a Ray worker (this one, a controller's) is left as it is."""
    import gc

    for enabled, frozen in echo_group.garbage_collector():
        assert enabled and frozen > 100_000  # torch alone makes more
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_all_to_all_broadcasts_lists(echo_group):
    assert echo_group.echo([10, 20, 30, 40]) == [[10, 20, 30, 40]] * 4


def test_dp_compute_needs_one_value_per_rank(echo_group):
    assert echo_group.times_rank([1, 1, 1, 1]) == [1, 2, 3, 4]
    with pytest.raises(TypeError, match="one value per rank"):
        echo_group.times_rank([1, 2])


@pytest.mark.parametrize("n", [1, 3, 4, 5, 9])
def test_dp_compute_proto_pads_and_unpads(echo_group, n):
    out = echo_group.double(batch(n))
    assert len(out) == n
    assert torch.equal(out.batch["x"], torch.arange(n, dtype=torch.float32) * 2)
    assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in range(n)]
    padded = n + (-n) % 4
    assert sum(out.meta_info["metrics"]["rows"]) == padded  # every rank ran on its padded chunk


def test_unpadding_scales_with_rows_per_input(echo_group):
    out = echo_group.sample_twice(batch(5))
    assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in range(5) for _ in range(2)]


def test_non_blocking_returns_unpadded_future(echo_group):
    future = echo_group.double_async(batch(6))
    assert isinstance(future, DataProtoFuture)
    out = future.get()
    assert len(out) == 6 and torch.equal(out.batch["x"], torch.arange(6, dtype=torch.float32) * 2)


def test_dp_compute_proto_with_func(echo_group):
    def negate(worker, data):
        return DataProto.from_dict({"x": -data.batch["x"]}, {"uid": data.non_tensor_batch["uid"]})

    out = echo_group.apply(negate, batch(8))
    assert torch.equal(out.batch["x"], -torch.arange(8, dtype=torch.float32))


def test_dp_compute_metric_returns_per_rank_list(echo_group):
    metrics = echo_group.row_count(batch(6))  # padded to 8: 2 rows per rank
    assert metrics == [{"rank": r, "rows": 2} for r in range(4)]


def test_execute_rank_zero_runs_once(echo_group):
    before = echo_group.call_count()
    assert echo_group.only_rank_zero() == 0
    after = echo_group.call_count()
    assert after[0] == before[0] + 1 and after[1:] == before[1:]


def test_user_dispatch_modes(ray_cluster):
    group, pool = make_group(Echo, 2)
    try:
        assert group.sum_values([1, 2, 3, 4, 5]) == 15
        assert group.sum_values_dict_mode([1, 2, 3]) == 6
        assert Dispatch.TEST_PARITY is PARITY
    finally:
        group.shutdown()
        pool.remove()


def test_async_worker_method(echo_group):
    assert echo_group.async_whoami() == [0, 1, 2, 3]


def test_worker_error_names_rank_and_traceback(echo_group):
    with pytest.raises(WorkerError) as info:
        echo_group.fail_on_rank(2)
    assert info.value.rank == 2 and info.value.method == "fail_on_rank"
    assert "ZeroDivisionError" in str(info.value) and "boom on 2" in str(info.value)
    assert "test_single_controller.py" in str(info.value)  # the remote traceback comes along
    assert echo_group.fail_on_rank(-1) == [0, 1, 2, 3]  # the group still works afterwards


def test_constructor_error_is_reported_with_rank(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    try:
        with pytest.raises(WorkerError, match="rank 1.*__init__") as info:
            RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=BrokenOnRankOne))
        assert "no model file on this node" in str(info.value)
    finally:
        pool.remove()


@pytest.mark.parametrize("producers,consumers,n", [(4, 4, 8), (4, 2, 7), (2, 3, 5)])
def test_future_chained_into_other_group(ray_cluster, echo_group, producers, consumers, n):
    producer, producer_pool = (echo_group, None) if producers == 4 else make_group(Echo, producers)
    consumer, pool = make_group(Summer, consumers)
    try:
        future = producer.double_async(batch(n))
        out = consumer.add_one(future)
        assert len(out) == n
        assert torch.equal(out.batch["x"], torch.arange(n, dtype=torch.float32) * 2 + 1)
        assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in range(n)]
        size = -(-n // consumers)
        assert list(out.non_tensor_batch["by"]) == [i // size for i in range(n)]
    finally:
        consumer.shutdown()
        pool.remove()
        if producer_pool is not None:
            producer.shutdown()
            producer_pool.remove()


def test_chained_future_moves_each_chunk_once(ray_cluster, echo_group):
    """Each consumer rank fetches only the producer chunks that hold its rows."""
    future = echo_group.double_async(batch(8))
    shards = [future.shard(rank, 4, auto_padding=True) for rank in range(4)]
    fetched = []
    for shard in shards:
        data, pad = shard.materialize()
        assert pad == 0 and len(data) == 2
        fetched.append(set(data.non_tensor_batch["rank"]))
    assert fetched == [{0}, {1}, {2}, {3}]


def test_colocated_roles_share_one_process(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    colocated = create_colocated_worker_cls(
        {"echo": RayClassWithInitArgs(cls=Echo, scale=3), "summer": RayClassWithInitArgs(cls=Summer)}
    )
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=colocated)
    try:
        roles = group.spawn(prefix_set={"echo", "summer"})
        echo, summer = roles["echo"], roles["summer"]
        assert [i["pid"] for i in echo.whoami()] == summer.pid()
        doubled = echo.double(batch(4))
        assert torch.equal(doubled.batch["x"], torch.arange(4, dtype=torch.float32) * 6)  # scale=3 reached the role
        assert torch.equal(summer.add_one(doubled).batch["x"], doubled.batch["x"] + 1)
        assert not hasattr(summer, "double")
    finally:
        group.shutdown()
        pool.remove()


def test_all_reduce_over_gloo(ray_cluster):
    group, pool = make_group(Distributed, 2)
    try:
        assert group.all_reduce() == [("gloo", 3.0), ("gloo", 3.0)]
    finally:
        group.shutdown()
        pool.remove()


def test_calls_from_many_threads_reach_every_rank_in_one_order(ray_cluster):
    """Stage tasks call a group from the threads of one process at once (old log-probs beside reference log-probs
    on a colocated group; sending the weights beside both): every rank must run them in the same order, or their
    collectives pair one call's tensors with another's, a mix no error reports."""
    group, pool = make_group(Distributed, 2)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often, as under load: a call between two ranks' submits is likely
    try:
        group.gather_tags(-1)
        with ThreadPoolExecutor(8) as threads:
            results = list(threads.map(group.gather_tags, range(200)))
        mixed = [(tag, ranks) for tag, ranks in enumerate(results) if ranks != [[tag, tag], [tag, tag]]]
        assert not mixed, mixed[:5]
    finally:
        sys.setswitchinterval(switch)
        group.shutdown()
        pool.remove()


def test_a_group_binds_its_own_rendezvous_whatever_its_processes_inherit(ray_cluster):
    """Ray's processes inherit the environment of the process that started Ray: MASTER_PORT from torchrun, or from
    a Worker that ran in that process. Rank 0 must still bind a store of its own (a stale one hung init)."""
    stale = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    inherited = RayClassWithInitArgs(cls=Distributed)
    inherited.update_options(
        {"runtime_env": {"env_vars": {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(stale.port)}}}
    )
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=inherited)
    try:
        ports = {port for _, port in group.execute_all_sync("get_master_addr_port")}
        assert len(ports) == 1 and str(stale.port) not in ports, ports
        assert group.all_reduce() == [("gloo", 3.0), ("gloo", 3.0)]
    finally:
        group.shutdown()
        pool.remove()


def test_unplaceable_pool_fails_at_once(ray_cluster):
    started = time.monotonic()
    with pytest.raises(PlacementError) as info:
        RayResourcePool([4], use_gpu=False, max_colocate_count=10).get_placement_groups()
    message = str(info.value)
    assert "'CPU': 40" in message and "'CPU': 16" in message and "max_colocate_count" in message
    with pytest.raises(PlacementError, match="GPU"):
        RayResourcePool([1], use_gpu=True, max_colocate_count=1).get_placement_groups()
    assert time.monotonic() - started < 10


def test_busy_pool_times_out_naming_free_resources(ray_cluster):
    total = ray.cluster_resources()["CPU"]
    holder = RayResourcePool([1], use_gpu=False, max_colocate_count=1)
    holder.get_placement_groups()
    try:
        # fits the cluster on paper, but the holder keeps one CPU busy: it can only wait
        waiting = RayResourcePool(
            [1], use_gpu=False, max_colocate_count=1, cpus_per_worker=total, placement_timeout_s=2
        )
        with pytest.raises(PlacementError, match="not placed within 2s.*free now"):
            waiting.get_placement_groups()
    finally:
        holder.remove()
    again = RayResourcePool([1], use_gpu=False, max_colocate_count=1, placement_timeout_s=10)
    assert len(again.get_placement_groups()) == 1  # nothing was left reserved by the failed attempt
    again.remove()


@ray.remote
def _call_group_remotely(group, data):
    return group.double(data), group.whoami()


def test_worker_group_travels_to_another_process(echo_group):
    """A group passed to a Ray task (as Prefect stage tasks receive it) keeps working there."""
    out, infos = ray.get(_call_group_remotely.remote(echo_group, batch(5)))
    assert torch.equal(out.batch["x"], torch.arange(5, dtype=torch.float32) * 2)
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    state = echo_group.__getstate__()
    assert not any(callable(v) and hasattr(v, "__code__") for v in state.values())  # handles and bindings only
    assert len(ray.cloudpickle.dumps(echo_group)) < 50_000


@ray.remote
class _GroupReceiver:
    """A long-lived process that gets groups as arguments, as the task host does."""

    def receive(self, group, data):
        return id(group), group.double(data).batch["x"].tolist(), group.call_timeout_s


def test_a_process_unpickles_an_unchanged_group_once(echo_group):
    """The same group sent again to one process is the object it unpickled the first time (its actor handles are
    not deserialized per call); a group whose state changed arrives as a new object with the new state."""
    receiver = _GroupReceiver.remote()
    first, x, _ = ray.get(receiver.receive.remote(echo_group, batch(2)))
    again, _, _ = ray.get(receiver.receive.remote(echo_group, batch(2)))
    assert x == [0.0, 2.0] and again == first
    before = (echo_group.call_timeout_s, echo_group.call_timeout_s_per_row)
    echo_group.set_call_timeout(123.0)
    try:
        changed, x, timeout = ray.get(receiver.receive.remote(echo_group, batch(2)))
    finally:
        echo_group.set_call_timeout(*before)
    assert changed != first and timeout == 123.0 and x == [0.0, 2.0]
    ray.kill(receiver)


def test_copies_of_a_group_are_distinct_objects(echo_group):
    """``copy.copy`` (as ``spawn`` uses it) makes a new group on the same actors, never a shared cached one."""
    first, second = copy.copy(echo_group), copy.deepcopy(echo_group)
    assert len({id(first), id(second), id(echo_group)}) == 3
    first.set_call_timeout(7.0)
    assert second.call_timeout_s != 7.0 and echo_group.call_timeout_s != 7.0
    assert torch.equal(second.double(batch(3)).batch["x"], torch.arange(3, dtype=torch.float32) * 2)
