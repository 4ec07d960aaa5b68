"""`make demo` (until the training flows land): the single controller on this machine.

Starts local Ray, creates a group of two CPU workers, and sends one uneven DataProto batch through a
DP_COMPUTE_PROTO method (split, padded, computed on both workers, merged, padding removed), then all-reduces a
tensor across the two workers over gloo. Prints what each step did.
"""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from rlworkers.protocol import DataProto
from rlworkers.single_controller import Dispatch, Worker, register
from rlworkers.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup


class SquareWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def square(self, data: DataProto) -> DataProto:
        rank = torch.full((len(data),), self.rank)
        return DataProto.from_dict({"x": data.batch["x"], "x_squared": data.batch["x"] ** 2, "rank": rank})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> float:
        self.init_process_group()
        value = torch.tensor([float(self.rank + 1)])
        torch.distributed.all_reduce(value)
        return value.item()


def main() -> None:
    import ray

    console = Console()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=SquareWorker))
    out = group.square(DataProto.from_dict({"x": torch.arange(5.0)}))
    table = Table("x", "x squared", "computed on rank", title="square() over 2 workers (5 rows, padded to 6)")
    for x, sq, rank in zip(out.batch["x"].tolist(), out.batch["x_squared"].tolist(), out.batch["rank"].tolist()):
        table.add_row(f"{x:g}", f"{sq:g}", str(rank))
    console.print(table)
    console.print(f"all_reduce over gloo of rank+1 on each worker: {group.all_reduce_rank()}")
    ray.shutdown()


if __name__ == "__main__":
    main()
