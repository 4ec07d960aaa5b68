"""DP_COMPUTE_PROTO round trip against raw Ray on the same tensors, measured in the same run.

For each batch size (1, 16, 128 MB) and worker count (1, 2, 4) this times:

* ``rlflow``: ``wg.identity(data)``: dispatch (split a DataProto), run a trivial method on every worker, collect
  (concatenate the returned DataProtos) — the full single-controller path;
* ``raw``: the same data path in plain Ray with no rlflow code: ``torch.chunk`` the same tensors, ``ray.put`` each
  chunk, call a plain actor method that returns it, ``ray.get`` and ``torch.cat``;
* ``raw-np``: the same as ``raw`` with the tensors handed to Ray as numpy arrays (Ray's zero-copy path: the
  fastest plain Ray can do; DataProto uses it under the hood);
* ``put/get``: one ``ray.put`` + ``ray.get`` of the whole tensor dict (no workers), for scale.

and prints ``ratio = rlflow / raw`` (goal: <= 1.3 at 128 MB) and ``vs-np = rlflow / raw-np`` (what the controller
costs over the best plain-Ray transfer). Then chaining (``chaining``): group A's output into group B as a
``DataProtoFuture`` against collecting it on the driver and dispatching it again, for A->B of 4->4, 4->2 and 2->3
workers (``--chain-sizes-mb``), printing ``chained / driver`` (goal: <= 1.0). Median of ``--repeats`` runs after
one warm-up.

    .venv/bin/python bench/dispatch.py [--sizes-mb 1 16 128] [--workers 1 2 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch

from rlworkers.protocol import DataProto
from rlworkers.single_controller import Dispatch, Worker, register
from rlworkers.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

ROWS = 512


class IdentityWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def identity(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def identity_async(self, data: DataProto) -> DataProto:
        return data


@ray.remote(num_cpus=0.01)
class RawActor:
    def identity(self, tensors: dict) -> dict:
        return tensors


def make_tensors(size_mb: int) -> dict[str, torch.Tensor]:
    columns = (size_mb * 2**20) // (ROWS * 8)  # two tensors of 4-byte elements
    return {
        "input_ids": torch.randint(0, 32000, (ROWS, columns), dtype=torch.int32),
        "log_probs": torch.randn(ROWS, columns, dtype=torch.float32),
    }


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def run_raw(actors, tensors):
    n = len(actors)
    chunks = [dict(zip(tensors, parts)) for parts in zip(*(t.chunk(n) for t in tensors.values()))]
    refs = [actor.identity.remote(ray.put(chunk)) for actor, chunk in zip(actors, chunks)]
    outputs = ray.get(refs)
    return {k: torch.cat([o[k] for o in outputs]) for k in tensors}


def run_raw_numpy(actors, tensors):
    n = len(actors)
    chunks = [{k: p.numpy() for k, p in zip(tensors, parts)} for parts in zip(*(t.chunk(n) for t in tensors.values()))]
    refs = [actor.identity.remote(ray.put(chunk)) for actor, chunk in zip(actors, chunks)]
    outputs = ray.get(refs)
    return {k: torch.cat([torch.from_numpy(o[k].copy()) for o in outputs]) for k in tensors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chain-sizes-mb", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()

    ray.init(
        num_cpus=max(max(args.workers) * 2 + 2, 10),
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=4 * 2**30,
    )
    print(
        f"{'MB':>5} {'workers':>7} {'put/get s':>10} {'raw s':>8} {'raw-np s':>9} {'rlflow s':>9} "
        f"{'ratio':>6} {'vs-np':>6}"
    )
    for n in args.workers:
        pool = RayResourcePool([n], use_gpu=False, max_colocate_count=1, cpus_per_worker=1)
        group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=IdentityWorker))
        actors = [RawActor.remote() for _ in range(n)]
        for size in args.sizes_mb:
            tensors = make_tensors(size)
            data = DataProto.from_dict(tensors)
            out = group.identity(data)
            assert torch.equal(out.batch["log_probs"], tensors["log_probs"])
            put_get = timed(lambda: ray.get(ray.put(tensors)), args.repeats)
            raw = timed(lambda: run_raw(actors, tensors), args.repeats)
            raw_np = timed(lambda: run_raw_numpy(actors, tensors), args.repeats)
            ours = timed(lambda: group.identity(data), args.repeats)
            print(
                f"{size:>5} {n:>7} {put_get:>10.4f} {raw:>8.4f} {raw_np:>9.4f} {ours:>9.4f} "
                f"{ours / raw:>6.2f} {ours / raw_np:>6.2f}",
                flush=True,
            )
        group.shutdown()
        pool.remove()
        for actor in actors:
            ray.kill(actor)
    chaining(args.chain_sizes_mb, args.repeats)
    ray.shutdown()


def chaining(sizes_mb: list[int], repeats: int) -> None:
    """Group A's output into group B: chained (A's non-blocking call returns a DataProtoFuture; each B rank fetches
    only the chunks it needs) against the driver round trip (A's blocking call collects on the driver, B's call
    dispatches again). Both end with B's output collected on the driver."""
    print(f"\n{'MB':>5} {'A->B':>5} {'driver s':>9} {'chained s':>10} {'chained / driver':>17}")
    for n_a, n_b in ((4, 4), (4, 2), (2, 3)):
        pools = [RayResourcePool([n], use_gpu=False, max_colocate_count=1, cpus_per_worker=1) for n in (n_a, n_b)]
        a, b = (
            RayWorkerGroup(resource_pool=p, ray_cls_with_init=RayClassWithInitArgs(cls=IdentityWorker)) for p in pools
        )
        for size in sizes_mb:
            tensors = make_tensors(size)
            data = DataProto.from_dict(tensors)
            assert torch.equal(b.identity(a.identity_async(data)).batch["log_probs"], tensors["log_probs"])
            driver = timed(lambda: b.identity(a.identity(data)), repeats)
            chained = timed(lambda: b.identity(a.identity_async(data)), repeats)
            print(f"{size:>5} {n_a:>2}->{n_b:<2} {driver:>9.4f} {chained:>10.4f} {chained / driver:>17.2f}", flush=True)
        for group, pool in zip((a, b), pools):
            group.shutdown()
            pool.remove()


if __name__ == "__main__":
    main()
