"""Tokens per second of generate, log-prob and update for the tiny model, at 1 and 2 data-parallel workers.

Each stage runs through a real RayWorkerGroup on the same batch (``--prompts`` prompts x ``--n`` samples, 2-digit
addition prompts, ``--response-length`` new tokens). Tokens counted: response tokens for generate; all real
tokens (prompt + response) for log-prob and update. The ratio column is 2 workers / 1 worker (on a 2-core
machine the best case is ~2x; gloo all-reduce and process overhead eat into it).

    .venv/bin/python bench/train_step.py [--prompts 32] [--n 8] [--response-length 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray

from rlworkers.data.batching import prompt_batch
from rlworkers.data.synthetic import addition_rows
from rlworkers.models.loading import load_tokenizer, resolve_model_path
from rlworkers.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker
from rlworkers.workers.config import WorkerConfig


def measure(workers: int, args, path: str, tokenizer) -> dict[str, float]:
    total = args.prompts * args.n
    config = WorkerConfig.model_validate(
        {
            "model": {"path": path},
            "rollout": {"response_length": args.response_length, "n": args.n},
            "actor": {"ppo_mini_batch_size": total, "ppo_micro_batch_size_per_gpu": total // workers},
        }
    )
    pool = RayResourcePool([workers], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=ActorRolloutRefWorker, config=config, role="actor_rollout"),
    )
    group.init_model()
    prompts = prompt_batch(addition_rows(num_train=args.prompts, num_val=1, max_digits=2, seed=0)["train"], tokenizer)
    rates = {"generate": [], "log_prob": [], "update": []}
    for _ in range(args.repeats + 1):  # the first round warms up
        start = time.perf_counter()
        gen = group.generate_sequences(prompts)
        t_gen = time.perf_counter() - start
        start = time.perf_counter()
        gen.union(group.compute_log_prob(gen))
        t_lp = time.perf_counter() - start
        gen.batch["advantages"] = gen.batch["response_mask"].float()
        start = time.perf_counter()
        group.update_actor(gen)
        t_up = time.perf_counter() - start
        response_tokens = int(gen.batch["response_mask"].sum())
        all_tokens = int(gen.batch["attention_mask"].sum())
        rates["generate"].append(response_tokens / t_gen)
        rates["log_prob"].append(all_tokens / t_lp)
        rates["update"].append(all_tokens / t_up)
    group.shutdown()
    pool.remove()
    return {stage: statistics.median(values[1:]) for stage, values in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    results = {workers: measure(workers, args, path, tokenizer) for workers in (1, 2)}
    print(f"batch: {args.prompts} prompts x {args.n} samples, {args.response_length} new tokens, model {args.model}")
    print(f"{'stage':>9} {'1 worker tok/s':>15} {'2 workers tok/s':>16} {'ratio':>6}")
    for stage in ("generate", "log_prob", "update"):
        one, two = results[1][stage], results[2][stage]
        print(f"{stage:>9} {one:>15.0f} {two:>16.0f} {two / one:>6.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
