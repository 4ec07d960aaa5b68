"""Porting a verl worker by changing imports only.

``VERL_RECIPE`` is written the way a verl 0.9 recipe is: verl's imports, a Worker that joins the process group
and builds a [dp, tp] device mesh in ``__init__``, an nd-dispatched method (``make_nd_compute_dataproto_dispatch_fn``)
that all-reduces over tp, a DP_COMPUTE_PROTO role colocated with it (``create_colocated_worker_cls`` + ``spawn``,
``ray.remote`` classes), a driver that turns on ``DataProtoConfig.auto_padding`` for a batch that does not
divide evenly, and an engine-worker method (verl 0.9's newer idiom) that takes a TensorDict of jagged token rows
built with ``verl.utils.tensordict_utils`` through the same nd dispatch. The test rewrites the imports with
``VERL_TO_RLFLOW``, checks that nothing else changed, and runs the result on RayWorkerGroup on CPU (gloo), against
values computed by hand.
"""

from __future__ import annotations

import sys
import types

import ray
import torch

VERL_RECIPE = """
import ray
import torch
import torch.distributed
from torch.distributed.device_mesh import init_device_mesh

from verl import DataProto
from verl.protocol import DataProtoConfig
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
)
from verl.utils import tensordict_utils as tu


class ActorWorker(Worker):
    def __init__(self, tp_size: int):
        super().__init__()
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(backend="gloo")
        self.device_mesh = init_device_mesh(
            "cpu", mesh_shape=(self.world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp")
        )
        self._register_dispatch_collect_info(
            "actor",
            dp_rank=self.device_mesh["dp"].get_local_rank(),
            is_collect=self.device_mesh["tp"].get_local_rank() == 0,
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        self.scale = 1.0

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob(self, data: DataProto) -> DataProto:
        # each tp rank holds one shard of the "model": the log-prob is the sum over tp of x * (tp_rank + 1)
        tp_rank = self.device_mesh["tp"].get_local_rank()
        log_prob = data.batch["x"] * self.scale * (tp_rank + 1)
        torch.distributed.all_reduce(log_prob, group=self.device_mesh.get_group("tp"))
        dp_rank = torch.full((len(data),), self.device_mesh["dp"].get_local_rank())
        return DataProto.from_dict(tensors={"old_log_prob": log_prob, "dp_rank": dp_rank})

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_score_of_tokens(self, data):
        # the engine-worker idiom: a TensorDict of jagged token rows in, a TensorDict out
        tp_rank = self.device_mesh["tp"].get_local_rank()
        score = torch.stack([row.sum() for row in data["input_ids"].unbind()]).float() * (tp_rank + 1)
        torch.distributed.all_reduce(score, group=self.device_mesh.get_group("tp"))
        score = score / tu.get_non_tensor_data(data, "temperature", 1.0)
        lengths = torch.tensor([row.shape[0] for row in data["input_ids"].unbind()])
        return tu.get_tensordict({"score": score, "length": lengths})


class RewardWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_score(self, data: DataProto) -> DataProto:
        score = data.batch["old_log_prob"] - data.batch["x"]
        return DataProto.from_dict(tensors={"score": score, "reward_rank": torch.full((len(data),), self.rank)})


def run(rows: int):
    DataProtoConfig.auto_padding = True
    resource_pool = RayResourcePool(process_on_nodes=[4], use_gpu=False, max_colocate_count=1)
    class_dict = {
        "actor": RayClassWithInitArgs(cls=ray.remote(ActorWorker), tp_size=2),
        "reward": RayClassWithInitArgs(cls=ray.remote(RewardWorker)),
    }
    worker_dict_cls = create_colocated_worker_cls(class_dict=class_dict)
    wg_dict = RayWorkerGroup(resource_pool=resource_pool, ray_cls_with_init=worker_dict_cls, device_name="cpu")
    spawn_wg = wg_dict.spawn(prefix_set=class_dict.keys())
    actor_wg, reward_wg = spawn_wg["actor"], spawn_wg["reward"]
    actor_wg.init_model()

    batch = DataProto.from_dict(tensors={"x": torch.arange(1, rows + 1, dtype=torch.float32)}, auto_padding=True)
    batch = batch.union(actor_wg.compute_log_prob(batch))
    batch = batch.union(reward_wg.compute_score(batch))

    ids = torch.nested.as_nested_tensor([torch.arange(1, n + 1) for n in (1, 3, 2, 4)], layout=torch.jagged)
    tokens = tu.get_tensordict({"input_ids": ids}, non_tensor_dict={"temperature": 2.0})
    scored = actor_wg.compute_score_of_tokens(tokens)
    return batch, scored, wg_dict, resource_pool
"""

VERL_TO_RLFLOW = {
    "from verl.utils import tensordict_utils": "from rlworkers import tensordict_utils",
    "from verl.single_controller": "from rlworkers.single_controller",
    "from verl.protocol import": "from rlworkers.protocol import",
    "from verl import": "from rlworkers import",
}


def port(source: str) -> str:
    for verl, rlflow in VERL_TO_RLFLOW.items():
        source = source.replace(verl, rlflow)
    return source


def load_module(name: str, source: str) -> types.ModuleType:
    """The ported recipe as an importable module, pickled by value so that Ray's workers get its classes."""
    module = types.ModuleType(name)
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)
    sys.modules[name] = module
    ray.cloudpickle.register_pickle_by_value(module)
    return module


def test_only_the_imports_change():
    changed = [(a, b) for a, b in zip(VERL_RECIPE.splitlines(), port(VERL_RECIPE).splitlines()) if a != b]
    assert len(changed) == 6 and all(a.startswith("from verl") and b.startswith("from rlworkers") for a, b in changed)
    assert "verl" not in port(VERL_RECIPE)


def test_ported_verl_recipe_runs_on_ray(ray_cluster):
    from rlworkers.protocol import DataProtoConfig

    recipe = load_module("verl_recipe_ported", port(VERL_RECIPE))
    try:
        out, scored, group, pool = recipe.run(rows=5)
        group.shutdown()
        pool.remove()
    finally:
        DataProtoConfig.auto_padding = False
        ray.cloudpickle.unregister_pickle_by_value(recipe)
        del sys.modules["verl_recipe_ported"]
    x = torch.arange(1, 6, dtype=torch.float32)
    assert torch.equal(out.batch["x"], x)
    # tp ranks 0 and 1 contribute x*1 + x*2; 5 rows over dp=2 -> 6 padded rows, 3 per dp group, padding dropped
    assert torch.equal(out.batch["old_log_prob"], 3 * x)
    assert out.batch["dp_rank"].tolist() == [0, 0, 0, 1, 1]
    # DP_COMPUTE_PROTO over 4 ranks: 5 rows -> 8 padded rows, 2 per rank; ranks 0, 1 get 2 real rows, rank 2 one
    assert torch.equal(out.batch["score"], 2 * x)
    assert out.batch["reward_rank"].tolist() == [0, 0, 1, 1, 2]
    # the TensorDict of jagged rows [1], [1,2,3], [1,2], [1,2,3,4]: dp 0 gets the first two, dp 1 the last two;
    # row sums 1, 6, 3, 10, times (1 + 2) over tp, over the temperature 2.0
    assert scored["score"].tolist() == [1.5, 9.0, 4.5, 15.0] and scored["length"].tolist() == [1, 3, 2, 4]
