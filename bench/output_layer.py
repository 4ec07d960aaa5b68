"""What computing the output layer on the response positions alone saves: a worker's log-prob and update on
SmolLM2-135M-Instruct (a 49k vocabulary) with long prompts and short responses (an agent's: tool schemas in the
prompt), with the logits of the response positions alone (transformers' ``logits_to_keep``, what the workers do) and
with those of every position (what they did before), taken in turns, one thread, median of ``--repeat``.

    .venv/bin/python bench/output_layer.py [--model smollm2-135m-instruct] [--prompt 600] [--response 64] [--batch 4]
        [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_description, machine_speed  # noqa: E402
from rlworkers.models.loading import resolve_model_path  # noqa: E402
from rlworkers.protocol import DataProto  # noqa: E402
from rlworkers.workers import common  # noqa: E402
from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker  # noqa: E402
from rlworkers.workers.config import WorkerConfig  # noqa: E402


def rollout_batch(args, vocab: int) -> DataProto:
    """A rollout's batch: prompt + response, with old log-probs and advantages."""
    generator = torch.Generator().manual_seed(0)
    total = args.prompt + args.response
    input_ids = torch.randint(0, vocab, (args.batch, total), generator=generator)
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(total).expand(args.batch, -1).clone(),
            "responses": input_ids[:, -args.response :],
            "response_mask": torch.ones(args.batch, args.response, dtype=torch.long),
            "old_log_probs": torch.zeros(args.batch, args.response),
            "advantages": torch.randn(args.batch, args.response, generator=generator),
        },
        meta_info={"temperature": 1.0},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model.path (tiny, smollm2-135m-instruct)")
    parser.add_argument("--prompt", type=int, default=600, help="prompt tokens a sequence")
    parser.add_argument("--response", type=int, default=64, help="response tokens a sequence")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a Ray worker computes
    config = {
        "model": {"path": str(resolve_model_path(args.model)), "autocast": None},
        "rollout": {"response_length": args.response},
        "actor": {"ppo_mini_batch_size": args.batch, "ppo_micro_batch_size_per_gpu": args.batch},
    }
    worker = ActorRolloutRefWorker(WorkerConfig.model_validate(config), role="actor")
    worker.init_model()
    rollout = rollout_batch(args, worker.model.config.vocab_size)
    stages = {"log-prob": lambda: worker.compute_log_prob(rollout), "update": lambda: worker.update_actor(rollout)}
    seconds = {(stage, way): [] for stage in stages for way in ("kept", "all")}
    for _ in range(args.repeat + 1):  # the first round warms up
        for stage, run in stages.items():
            for way in ("kept", "all"):
                with mock.patch.object(common, "takes_logits_to_keep", lambda model, kept=way == "kept": kept):
                    start = time.process_time()
                    run()
                    seconds[(stage, way)].append(time.process_time() - start)
    print(f"CPU: {cpu_description()}")
    print(f"speed: {machine_speed()}")
    print(f"{args.model}, {args.batch} sequences of {args.prompt} prompt + {args.response} response tokens")
    print(f"{'stage':10} {'all positions s':>16} {'response only s':>16} {'ratio':>7}")
    for stage in stages:
        full, kept = (statistics.median(seconds[(stage, way)][1:]) for way in ("all", "kept"))
        print(f"{stage:10} {full:16.2f} {kept:16.2f} {kept / full:7.2f}")


if __name__ == "__main__":
    main()
