"""verl parity of the single controller: nd (device-mesh) dispatch, the Worker's dispatch/collect registry, the
per-worker environment, RayWorkerGroup's verl keywords and resource pools (split, merge, ResourcePoolManager).
Ported from verl's tests/single_controller/ test_get_set_dispatch_collect_cpu.py, test_device_mesh_register.py
(4 CPU ranks on gloo instead of 8 GPUs), test_ray_local_envs_on_cpu.py and test_split_resource_pool.py; values
are computed by hand in the comments."""

from __future__ import annotations

import pytest
import ray
import torch
from tensordict import NonTensorData, TensorDict

from rlworkers import tensordict_utils as tu
from rlworkers.protocol import DataProto, ProtocolError
from rlworkers.single_controller import DataProtoFuture, Dispatch, PlacementError, Worker, WorkerError, register
from rlworkers.single_controller.base.decorator import (
    dispatch_nd_compute_data_proto,
    make_nd_compute_dataproto_dispatch_fn,
)
from rlworkers.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourcePoolManager,
    create_colocated_worker_cls,
    create_colocated_worker_raw_cls,
    merge_resource_pool,
    sort_placement_group_by_node_ip,
    split_resource_pool,
)


# ----------------------------------------------------------------------------- the registry, no Ray
@pytest.fixture
def worker_env(monkeypatch):
    """Worker() in this process: a rank of a world of 2 whose rendezvous is elsewhere (nothing is bound)."""
    for key, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": "12345",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }.items():
        monkeypatch.setenv(key, value)


def test_get_set_dispatch_collect(worker_env):
    ref = Worker()
    ref._register_dispatch_collect_info(mesh_name="actor", dp_rank=0, is_collect=True)
    actor = Worker()
    actor._register_dispatch_collect_info(mesh_name="actor", dp_rank=1, is_collect=False)

    outer = Worker()
    outer.set_dispatch_collect(mesh_name="ref", **ref.get_dispatch_collect())
    outer.set_dispatch_collect(mesh_name="actor", **actor.get_dispatch_collect())
    assert outer._query_dispatch_info("ref") == 0 and outer._query_collect_info("ref") is True
    assert outer._query_dispatch_info("actor") == 1 and outer.query_collect_info("actor") is False
    assert outer.get_dispatch_collect() == {
        "dispatch_dp_rank": {"ref": 0, "actor": 1},
        "collect_dp_rank": {"ref": True, "actor": False},
    }

    with pytest.raises(ValueError, match="'actor' is already registered"):  # verl: AssertionError
        outer.set_dispatch_collect(mesh_name="actor", **actor.get_dispatch_collect())
    with pytest.raises(ValueError, match="'actor' is already registered"):
        actor._register_dispatch_collect_info("actor", dp_rank=0, is_collect=True)
    with pytest.raises(ValueError, match="copies exactly one mesh"):  # verl silently keeps the last one
        Worker().set_dispatch_collect("both", **outer.get_dispatch_collect())
    with pytest.raises(ValueError, match=r"'train' is not registered on Worker rank 1 .registered: \['actor', 'ref'\]"):
        outer._query_dispatch_info("train")


# ----------------------------------------------------------------------------- nd dispatch on 4 ranks
class MeshWorker(Worker):
    """4 ranks, three meshes:
    infer    [dp=2, tp=2]: rank r has dp r//2, tp r%2; collectors tp == 0 -> ranks 0 (dp 0), 2 (dp 1)
    train    [pp=2, dp=2]: rank r has pp r//2, dp r%2; collectors pp == 1 -> ranks 2 (dp 0), 3 (dp 1)
    reversed [dp=2, tp=2] with the dp groups numbered backwards: collectors rank 2 (dp 0), rank 0 (dp 1)
    """

    def __init__(self):
        super().__init__()
        torch.distributed.init_process_group(backend="gloo")
        from torch.distributed.device_mesh import init_device_mesh

        self.infer_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        self.train_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        infer_dp, infer_tp = self.infer_mesh["dp"].get_local_rank(), self.infer_mesh["tp"].get_local_rank()
        self._register_dispatch_collect_info("infer", dp_rank=infer_dp, is_collect=infer_tp == 0)
        self._register_dispatch_collect_info(
            "train",
            dp_rank=self.train_mesh["dp"].get_local_rank(),
            is_collect=self.train_mesh["pp"].get_local_rank() == 1,
        )
        self._register_dispatch_collect_info("reversed", dp_rank=1 - infer_dp, is_collect=infer_tp == 0)
        self._register_dispatch_collect_info("every_rank_collects", dp_rank=infer_dp, is_collect=True)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="infer"))
    def generate(self, data: DataProto) -> DataProto:
        data.batch["a"] += (self.infer_mesh["tp"].get_local_rank() + 1) * self.infer_mesh["dp"].get_local_rank()
        return data

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="infer"), blocking=False)
    def generate_async(self, data: DataProto) -> DataProto:
        return self.generate(data)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"))
    def train(self, data: DataProto) -> DataProto:
        data.batch["a"] += (self.train_mesh["dp"].get_local_rank() + 2) * (self.train_mesh["pp"].get_local_rank() + 3)
        return data

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="reversed"))
    def tag_rank(self, data: DataProto) -> DataProto:
        data.batch["rank"] = torch.full((len(data),), self.rank)
        return data

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="every_rank_collects"))
    def ambiguous(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="nowhere"))
    def unregistered(self, data: DataProto) -> DataProto:
        return data

    # verl 0.9's engine workers take and return TensorDicts: jagged token rows, metadata as NonTensorData
    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="infer"))
    def score_tokens(self, batch: TensorDict) -> TensorDict:
        ids, positions = batch["input_ids"], batch["position_ids"]  # [B, j] and [B, j, 2], both jagged
        scale = tu.get_non_tensor_data(batch, "scale", default=1)
        out = TensorDict(
            {
                "score": torch.stack([row.sum() * scale for row in ids.unbind()]),
                "positions_per_row": torch.tensor([row.shape[0] for row in positions.unbind()]),
                "rank": torch.full((len(batch),), self.rank),
                "input_ids": ids * 2,
            },
            batch_size=batch.batch_size,
        )
        return out

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="infer"), blocking=False)
    def score_tokens_async(self, batch: TensorDict) -> TensorDict:
        return self.score_tokens(batch)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def count_tokens(self, batch: TensorDict) -> TensorDict:
        lengths = torch.tensor([row.shape[0] for row in batch["input_ids"].unbind()])
        return TensorDict({"tokens": lengths, "rank": torch.full((len(batch),), self.rank)}, batch.batch_size)


def proto(values) -> DataProto:
    return DataProto.from_single_dict({"a": torch.tensor(values)})


@pytest.fixture(scope="module")
def mesh_group(ray_cluster):
    pool = RayResourcePool([4], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(
        resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=MeshWorker), device_name="cpu"
    )
    yield group
    group.shutdown()
    pool.remove()


def test_nd_dispatch_sends_dp_chunks_and_keeps_the_collectors(mesh_group):
    assert mesh_group.generate(proto([1, 2])).batch["a"].tolist() == [1, 3]  # dp0: 1 + 0; dp1: 2 + (0+1)*1
    assert mesh_group._dispatch_info["infer"] == [0, 0, 1, 1]
    assert mesh_group._collect_info["infer"] == [True, False, True, False]

    assert mesh_group.train(proto([3, 4])).batch["a"].tolist() == [11, 16]  # 3 + 2*4 on rank 2; 4 + 3*4 on rank 3
    assert mesh_group._dispatch_info["train"] == [0, 1, 0, 1]


def test_nd_dispatch_pads_and_the_worker_unpads(mesh_group):
    # 3 rows -> padded to 4: dp0 gets [1, 2], dp1 gets [3, 1 (padding)] and returns only [3 + 1]
    assert mesh_group.generate(proto([1, 2, 3])).batch["a"].tolist() == [1, 2, 4]


def test_nd_collectors_are_ordered_by_dp_rank(mesh_group):
    # the "reversed" mesh's dp 0 is ranks 2, 3 and its dp 1 is ranks 0, 1: rows 0-1 come from rank 2
    out = mesh_group.tag_rank(proto([10, 11, 12, 13]))
    assert out.batch["rank"].tolist() == [2, 2, 0, 0] and out.batch["a"].tolist() == [10, 11, 12, 13]


def test_each_dp_chunk_is_stored_once_and_shared_by_its_dp_group(mesh_group):
    args, kwargs = dispatch_nd_compute_data_proto("infer", mesh_group, proto([5, 6, 7, 8]))
    chunk_of_rank = args[0]
    assert chunk_of_rank[0] is chunk_of_rank[1] and chunk_of_rank[2] is chunk_of_rank[3]
    assert ray.get(chunk_of_rank[0]).batch["a"].tolist() == [5, 6]
    assert ray.get(chunk_of_rank[2]).batch["a"].tolist() == [7, 8]
    assert kwargs == {}  # no padding to undo


def test_non_blocking_nd_call_returns_a_future_over_the_collectors(mesh_group):
    future = mesh_group.generate_async(proto([1, 2, 3]))
    assert isinstance(future, DataProtoFuture) and future.ranks == [0, 2]
    assert future.get().batch["a"].tolist() == [1, 2, 4]
    # chained into another nd call: each dp group reads its rows of the future; [1,2,4] -> dp0 [1,2], dp1 [4, 1]
    assert mesh_group.generate(mesh_group.generate_async(proto([1, 2, 3]))).batch["a"].tolist() == [1, 2, 5]


def test_nd_errors_name_the_mesh_and_the_fix(mesh_group):
    with pytest.raises(ValueError, match=r"'every_rank_collects' needs exactly one collector .* ranks \[0, 1, 2, 3\]"):
        mesh_group.ambiguous(proto([1, 2]))
    with pytest.raises(WorkerError, match=r"mesh 'nowhere' is not registered .*_register_dispatch_collect_info"):
        mesh_group.unregistered(proto([1, 2]))


def token_batch(rows: list[list[int]]) -> TensorDict:
    ids = torch.nested.as_nested_tensor([torch.tensor(r) for r in rows], layout=torch.jagged)
    positions = torch.nested.as_nested_tensor(
        [torch.arange(2 * len(r)).reshape(len(r), 2) for r in rows], layout=torch.jagged
    )
    batch = TensorDict({"input_ids": ids, "position_ids": positions}, batch_size=[len(rows)])
    batch["scale"] = NonTensorData(10)
    return batch


def test_tensordicts_with_jagged_tensors_go_through_nd_dispatch(mesh_group):
    rows = [[1], [1, 2, 3], [4, 5], [6, 7, 8, 9]]
    out = mesh_group.score_tokens(token_batch(rows))
    assert isinstance(out, TensorDict) and out.batch_size == torch.Size([4])
    assert out["score"].tolist() == [10, 60, 90, 300]  # row sums 1, 6, 9, 30 times the NonTensorData scale
    assert out["positions_per_row"].tolist() == [1, 3, 2, 4]  # the 3-D jagged tensor kept each row's length
    assert out["rank"].tolist() == [0, 0, 2, 2]  # the infer mesh's collectors: rank 0 (dp 0), rank 2 (dp 1)
    assert [r.tolist() for r in out["input_ids"].unbind()] == [[2], [2, 4, 6], [8, 10], [12, 14, 16, 18]]


def test_tensordict_futures_chain_and_dp_compute_proto_splits_tensordicts(mesh_group):
    rows = [[1], [1, 2, 3], [4, 5], [6, 7, 8, 9]]
    future = mesh_group.score_tokens_async(token_batch(rows))
    assert isinstance(future, DataProtoFuture) and future.get()["score"].tolist() == [10, 60, 90, 300]
    # chained: each of the 4 DP_COMPUTE_PROTO ranks fetches its one row of the collectors' outputs
    counted = mesh_group.count_tokens(mesh_group.score_tokens_async(token_batch(rows)))
    assert counted["tokens"].tolist() == [1, 3, 2, 4] and counted["rank"].tolist() == [0, 1, 2, 3]


def test_a_tensordict_that_does_not_split_evenly_names_the_fix(mesh_group):
    with pytest.raises(ProtocolError, match=r"TensorDict of 3 rows.* 2 equal parts: pad it first"):
        mesh_group.score_tokens(token_batch([[1], [2], [3]]))


def _times_rank_plus_one(worker, data: DataProto) -> DataProto:
    return DataProto.from_single_dict({"a": data.batch["a"] * (worker.rank + 1)})


def _add(x, y):
    return x + y


def test_driver_functions_run_on_the_workers(mesh_group):
    # DP_COMPUTE_PROTO_WITH_FUNC: rank r gets row r
    out = mesh_group.execute_with_func_generator(_times_rank_plus_one, proto([1, 1, 1, 1]))
    assert out.batch["a"].tolist() == [1, 2, 3, 4]
    assert mesh_group.execute_func_rank_zero(_add, 2, y=3) == 5


# ----------------------------------------------------------------------------- colocated roles
class Trainer(Worker):
    def __init__(self):
        super().__init__()
        self._register_dispatch_collect_info("model", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="model"))
    def rows_seen(self, data: DataProto) -> DataProto:
        return DataProto.from_single_dict({"rows": torch.full((len(data),), len(data))})


class Scorer(Worker):
    def __init__(self):
        super().__init__()
        self._register_dispatch_collect_info("model", dp_rank=self.rank, is_collect=True)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="model"))
    def rows_seen(self, data: DataProto) -> DataProto:
        return DataProto.from_single_dict({"rows": torch.full((len(data),), len(data))})


def test_spawned_roles_keep_their_own_mesh_registry(ray_cluster):
    pool = RayResourcePool([4], use_gpu=False, max_colocate_count=1)
    colocated = create_colocated_worker_cls(
        {"trainer": RayClassWithInitArgs(cls=Trainer), "scorer": RayClassWithInitArgs(cls=Scorer)}
    )
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=colocated)
    try:
        roles = group.spawn(prefix_set={"trainer", "scorer"})
        # the same mesh name means dp=2 for the trainer role (4 rows per dp rank) and dp=4 for the scorer (2)
        assert roles["trainer"].rows_seen(proto(list(range(8)))).batch["rows"].tolist() == [4] * 8
        assert roles["scorer"].rows_seen(proto(list(range(8)))).batch["rows"].tolist() == [2] * 8
        assert roles["trainer"]._dispatch_info == {"model": [0, 0, 1, 1]}
        assert roles["scorer"]._dispatch_info == {"model": [0, 1, 2, 3]}
    finally:
        group.shutdown()
        pool.remove()


class Adder(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add(self, x):
        return x + self.rank


class Subtracter(Worker):
    def __init__(self, val):
        super().__init__()
        self.val = val

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def sub(self, x):
        return x - self.val

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sibling_add(self, x):
        return self.get_fused_worker_by_name("actor").add(x)


FusedBase = create_colocated_worker_raw_cls(
    {"actor": RayClassWithInitArgs(cls=ray.remote(Adder)), "critic": RayClassWithInitArgs(cls=Subtracter, val=10)}
)


@ray.remote
class HybridWorker(FusedBase):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def foo(self, x):
        return self.critic.sub(self.actor.add(x))


def test_fused_worker_subclass_and_fuse(ray_cluster):
    """verl's test_fused_workers_on_cpu (ALL_TO_ALL gets a scalar: rlflow never scatters a list)."""
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=HybridWorker))
    try:
        group.fuse({"actor", "critic"})
        assert group.actor.add(0.5) == [0.5, 1.5]  # + rank
        assert group.critic.sub(0.5) == [-9.5, -9.5]
        assert group.foo(0.5) == [-9.5, -8.5]  # the subclass's own method uses both roles in one process
        assert group.critic.sibling_add(0.5) == [0.5, 1.5]  # a role reaches its sibling
        with pytest.raises(ValueError, match=r"roles \['reward'\] that the colocated class lacks"):
            group.spawn({"reward"})
    finally:
        group.shutdown()
        pool.remove()


class Rollout(Worker):
    @register(dispatch_mode=Dispatch.DIRECT_ROLLOUT_METHOD)
    def wake_up(self):
        return f"rank {self.rank} awake"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self):
        return self.rank


class Critic(Worker):
    @register(dispatch_mode=Dispatch.DIRECT_ROLLOUT_METHOD)
    def resume(self):
        return "critic"


def test_direct_rollout_methods_are_called_on_the_actor(ray_cluster):
    """verl's Dispatch.DIRECT_ROLLOUT_METHOD: a rollout role's direct method is bound on the colocated class under
    its plain name, for callers that hold the actor; through a worker group it raises. Another role's keeps only
    its prefixed name."""
    fused = create_colocated_worker_raw_cls(
        {"actor_rollout": RayClassWithInitArgs(cls=Rollout), "critic": RayClassWithInitArgs(cls=Critic)}
    )
    assert hasattr(fused, "wake_up") and hasattr(fused, "actor_rollout_wake_up")
    assert not hasattr(fused, "resume") and hasattr(fused, "critic_resume")
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(fused)))
    try:
        assert ray.get([worker.wake_up.remote() for worker in group.workers]) == ["rank 0 awake", "rank 1 awake"]
        roles = group.spawn({"actor_rollout"})
        assert roles["actor_rollout"].ping() == [0, 1]
        with pytest.raises(TypeError, match="call it on the worker's actor directly"):
            roles["actor_rollout"].wake_up()
    finally:
        group.shutdown()
        pool.remove()

    class Clash(Worker):
        @register(dispatch_mode=Dispatch.DIRECT_ROLLOUT_METHOD)
        def wake_up(self):
            return 0

    with pytest.raises(ValueError, match="direct rollout method 'wake_up' of role 'rollout' clashes"):
        create_colocated_worker_raw_cls(
            {"a_rollout": RayClassWithInitArgs(cls=Rollout), "rollout": RayClassWithInitArgs(cls=Clash)}
        )


# ----------------------------------------------------------------------------- environment and keywords
class EnvWorker(Worker):
    pass


def test_worker_environment_is_verls(ray_cluster):
    pool = RayResourcePool([4], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(
        pool,
        RayClassWithInitArgs(cls=EnvWorker),
        name_prefix="env_test_",
        use_gpu=False,
        worker_env={"test_key": "test_value"},
    )
    try:

        def env(key):
            return group.execute_all_sync("getenv", key)

        assert env("RAY_LOCAL_WORLD_SIZE") == ["4"] * 4
        assert env("WORLD_SIZE") == ["4"] * 4 and env("RANK") == ["0", "1", "2", "3"]
        assert env("LOCAL_RANK") == ["0"] * 4 and env("LOCAL_WORLD_SIZE") == ["1"] * 4
        assert env("WG_PREFIX") == ["env_test_"] * 4 and env("WG_BACKEND") == ["ray"] * 4
        assert env("test_key") == ["test_value"] * 4
        masters = {tuple(m) for m in group.execute_all_sync("get_master_addr_port")}
        assert len(masters) == 1 and masters == {(env("MASTER_ADDR")[0], env("MASTER_PORT")[0])}
    finally:
        group.shutdown()
        pool.remove()


@pytest.mark.parametrize("key", ["WORLD_SIZE", "RAY_LOCAL_WORLD_SIZE", "MASTER_PORT", "WG_BACKEND"])
def test_worker_env_may_not_override_the_groups_keys(key):
    with pytest.raises(ValueError, match=key):
        RayWorkerGroup(
            RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(cls=EnvWorker), worker_env={key: "100"}
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"use_gpu": True}, "use_gpu=True needs a resource pool with GPUs"),
        ({"device_name": "npu"}, "device_name='npu' is not supported"),
        ({"master_addr": "10.0.0.1", "master_port": "29500"}, "cannot be pinned"),
        ({"profile_steps": [1], "worker_nsight_options": {}}, "nsight profiling"),
    ],
)
def test_verl_keywords_rlflow_does_not_support_name_themselves(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(cls=EnvWorker), **kwargs)
    with pytest.raises(TypeError, match="no_such_option"):
        RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(cls=EnvWorker), no_such_option=1)


# ----------------------------------------------------------------------------- splitting, merging, naming pools
# Ported from verl's tests/single_controller/test_split_resource_pool.py (4 CPU bundles instead of 8 GPUs).
class AddWorker(Worker):
    def __init__(self, worker_id: int):
        super().__init__()
        self.worker_id = worker_id

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add(self, data: DataProto) -> DataProto:
        data.batch["a"] += self.rank + self.worker_id
        return data


def run_add(pools_and_rows: list[tuple], worker_id_step: int = 100) -> list[tuple[int, list[str], list[int]]]:
    """Start one AddWorker group per pool (worker ids 0, 100, 200...), all alive together, then call ``add`` on
    ``rows`` zeros each: ``(world size, where each rank runs as "pg:bundle", the rows)`` per group."""
    groups = [
        RayWorkerGroup(
            resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=AddWorker, worker_id=i * worker_id_step)
        )
        for i, (pool, _) in enumerate(pools_and_rows)
    ]
    try:
        return [
            (
                group.world_size,
                [name.rsplit("_", 1)[1] for name in group.worker_names],
                group.add(proto([0] * rows)).batch["a"].tolist(),
            )
            for group, (_, rows) in zip(groups, pools_and_rows)
        ]
    finally:
        for group in groups:
            group.shutdown()


def cpu_pool(process_on_nodes: list[int]) -> RayResourcePool:
    return RayResourcePool(process_on_nodes, use_gpu=False, max_colocate_count=1)


def test_split_resource_pool_with_split_size(ray_cluster):
    pool = cpu_pool([2, 2])
    first, second = split_resource_pool(pool, split_size=2)
    try:
        assert run_add([(first, 4), (second, 4)]) == [
            (2, ["0:0", "0:1"], [0, 0, 1, 1]),  # rows 2 per rank: rank + 0
            (2, ["1:0", "1:1"], [100, 100, 101, 101]),  # the second placement group, rank + 100
        ]
        with pytest.raises(ValueError, match=r"call remove\(\) on the pool it was split from"):
            second.remove()
    finally:
        pool.remove()


def test_split_resource_pool_with_split_size_list_across_placement_groups(ray_cluster):
    pool = cpu_pool([2, 2])
    first, second = split_resource_pool(pool, split_size=[1, 3])
    try:
        assert run_add([(first, 4), (second, 3)]) == [
            (1, ["0:0"], [0, 0, 0, 0]),
            (3, ["0:1", "1:0", "1:1"], [100, 101, 102]),  # ranks 0..2 of the part start at bundle 1
        ]
    finally:
        pool.remove()


def test_split_resource_pool_twice(ray_cluster):
    pool = cpu_pool([4])
    first, middle, last = split_resource_pool(pool, split_size=[1, 2, 1])
    middle_first, middle_second = split_resource_pool(middle, split_size=1)
    try:
        results = run_add([(first, 2), (middle_first, 2), (middle_second, 2), (last, 2)])
        assert results == [
            (1, ["0:0"], [0, 0]),
            (1, ["0:1"], [100, 100]),
            (1, ["0:2"], [200, 200]),
            (1, ["0:3"], [300, 300]),
        ]
    finally:
        pool.remove()


@pytest.mark.parametrize(
    "split_size, message",
    [
        (3, "must divide the pool's world size 4"),
        ([1, 2], "summing to the pool's world size 4"),
        ([4, 0], "must be positive sizes"),
    ],
)
def test_split_sizes_that_do_not_fit_name_the_world_size(split_size, message):
    with pytest.raises(ValueError, match=message):
        split_resource_pool(cpu_pool([2, 2]), split_size=split_size)


def test_merge_resource_pool_puts_the_second_pools_ranks_after_the_first(ray_cluster):
    one, two = cpu_pool([1]), cpu_pool([2])
    merged = merge_resource_pool(one, two)
    try:
        assert run_add([(merged, 3)]) == [(3, ["0:0", "1:0", "1:1"], [0, 1, 2])]
    finally:
        one.remove()
        two.remove()


def test_merge_resource_pool_needs_equal_options():
    with pytest.raises(ValueError, match="max_colocate_count differ"):
        merge_resource_pool(cpu_pool([1]), RayResourcePool([1], use_gpu=False, max_colocate_count=2))


def test_resource_pool_manager_gives_each_role_its_pool(ray_cluster):
    manager = ResourcePoolManager(
        resource_pool_spec={"global_pool": [2, 1], "reward_pool": [1]},
        mapping={"actor": "global_pool", "critic": "global_pool", "reward": "reward_pool"},
        use_gpu=False,
        max_colocate_count=2,
    )
    manager.create_resource_pool()
    actor_pool = manager.get_resource_pool("actor")
    try:
        assert manager.get_n_gpus() == 4
        assert actor_pool is manager.get_resource_pool("critic") is manager.resource_pool_dict["global_pool"]
        # actor and critic share the global pool's 3 bundles (max_colocate_count=2); the reward model has its own
        assert run_add(
            [(actor_pool, 3), (manager.get_resource_pool("critic"), 3), (manager.get_resource_pool("reward"), 1)],
            worker_id_step=10,
        ) == [
            (3, ["0:0", "0:1", "1:0"], [0, 1, 2]),
            (3, ["0:0", "0:1", "1:0"], [10, 11, 12]),
            (1, ["0:0"], [20]),
        ]
        with pytest.raises(KeyError, match="role 'rollout' has no resource pool"):
            manager.get_resource_pool("rollout")
    finally:
        for pool in manager.resource_pool_dict.values():
            pool.remove()


def test_resource_pool_manager_checks_the_cluster_and_its_mapping(ray_cluster):
    huge = ResourcePoolManager({"huge": [500, 500]}, {"actor": "huge"}, use_gpu=False, max_colocate_count=1)
    with pytest.raises(PlacementError, match=r"need \{'CPU': 1000.0\} together"):  # 16 CPUs in the test cluster
        huge.create_resource_pool()
    with pytest.raises(ValueError, match=r"mapping names pools \['rollout_pool'\] that resource_pool_spec lacks"):
        ResourcePoolManager({"global_pool": [1]}, {"rollout": "rollout_pool"}).create_resource_pool()


def test_placement_groups_are_ordered_by_node_ip(monkeypatch):
    from rlworkers.single_controller.ray import placement as base

    node_ips = {"node-a": "10.0.0.3", "node-b": "10.0.0.1", "node-c": "10.0.0.2"}
    monkeypatch.setattr(
        base.ray, "nodes", lambda: [{"NodeID": node, "NodeManagerAddress": ip} for node, ip in node_ips.items()]
    )
    # a fake placement group is the name of its node; groups on the same node keep their order
    monkeypatch.setattr(base, "placement_group_table", lambda pg: {"bundles_to_node_id": {0: pg.split("/")[0]}})
    pgs = ["node-a/0", "node-b/0", "node-c/0", "node-b/1"]
    assert sort_placement_group_by_node_ip(pgs) == ["node-b/0", "node-b/1", "node-c/0", "node-a/0"]
