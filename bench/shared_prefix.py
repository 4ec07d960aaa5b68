"""What computing a shared prompt prefix once saves: a worker's generation (HF, greedy), log-prob, update and SFT
step, and PPO's critic's values and update, on SmolLM2-135M-Instruct with the agent preset's prompts (its tool
described in the system prompt, ~220 tokens every prompt starts with), the prefix computed once per batch or
micro-batch (what the workers do: ``rlworkers.workers.common.logits_sharing_prefix``,
``rlworkers.workers.rollout.hf_rollout``) and in every row (what they did before), taken in turns, one thread, median
of ``--repeat``.

    .venv/bin/python bench/shared_prefix.py [--model smollm2-135m-instruct] [--config agent] [--rows 8]
        [--response 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_description, machine_speed  # noqa: E402
from flows.config import load_config  # noqa: E402
from flows.controller.rows import chat_template_kwargs, dataset_rows  # noqa: E402
from rlworkers.data.batching import prompt_batch  # noqa: E402
from rlworkers.models.loading import resolve_model_path  # noqa: E402
from rlworkers.protocol import DataProto  # noqa: E402
from rlworkers.workers import common  # noqa: E402
from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker  # noqa: E402
from rlworkers.workers.config import WorkerConfig  # noqa: E402
from rlworkers.workers.critic import CriticWorker  # noqa: E402


def prompts_batch(args, config, tokenizer) -> DataProto:
    """The preset's first training prompts."""
    rows = dataset_rows(config, "train")[: args.rows]
    prompts = prompt_batch(rows, tokenizer, chat_template_kwargs=chat_template_kwargs(config))
    prompts.meta_info.update(do_sample=False, n=1, response_length=args.response)
    return prompts


def rollout_batch(args, prompts: DataProto, tokenizer) -> DataProto:
    """The prompts, each with a random response, old log-probs, advantages, values and returns."""
    generator = torch.Generator().manual_seed(0)
    responses = torch.randint(0, len(tokenizer), (args.rows, args.response), generator=generator)
    input_ids = torch.cat([prompts.batch["input_ids"], responses], dim=1)
    attention_mask = torch.cat([prompts.batch["attention_mask"], torch.ones_like(responses)], dim=1)
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": torch.ones_like(responses),
            "old_log_probs": torch.zeros(args.rows, args.response),
            "advantages": torch.randn(args.rows, args.response, generator=generator),
            "values": torch.zeros(args.rows, args.response),
            "returns": torch.randn(args.rows, args.response, generator=generator),
            "loss_mask": torch.cat([torch.zeros_like(prompts.batch["input_ids"]), torch.ones_like(responses)], dim=1),
        },
        meta_info={"temperature": 1.0},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model.path (tiny, smollm2-135m-instruct)")
    parser.add_argument("--config", default="agent", help="the preset whose prompts (and micro-batch sizes) are used")
    parser.add_argument("--rows", type=int, default=8, help="sequences a batch")
    parser.add_argument("--response", type=int, default=64, help="response tokens a sequence")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a Ray worker computes
    data = tempfile.mkdtemp(prefix="shared-prefix-")  # where the built-in task's rows are written
    config = load_config(
        args.config, [f"model.path={args.model}", "data.task.num_train=64", f"trainer.runs_dir={data}"]
    )
    worker_config = {
        "model": {"path": str(resolve_model_path(args.model)), "autocast": None},
        "rollout": {"response_length": args.response, "log_prob_micro_batch_size_per_gpu": 4},
        "actor": {"ppo_mini_batch_size": args.rows, "ppo_micro_batch_size_per_gpu": 4},
    }
    worker = ActorRolloutRefWorker(WorkerConfig.model_validate(worker_config), role="actor_rollout")
    worker.init_model()
    critic = CriticWorker(worker_config["actor"], worker_config["model"])
    critic.init_model()
    prompts = prompts_batch(args, config, worker.tokenizer)
    rollout = rollout_batch(args, prompts, worker.tokenizer)
    first = rollout.batch[:4]
    shared = common.shared_prompt_prefix(
        first["input_ids"], first["attention_mask"], first["input_ids"].shape[1] - args.response
    )
    stages = {
        "generate": lambda: worker.generate_sequences(prompts),
        "log-prob": lambda: worker.compute_log_prob(rollout),
        "update": lambda: worker.update_actor(rollout),
        "sft step": lambda: worker.sft_step(rollout),
        "values": lambda: critic.compute_values(rollout),
        "critic update": lambda: critic.update_critic(rollout),
    }
    ways = {"every row": 10**9, "shared once": common.MIN_SHARED_PREFIX}
    seconds = {(stage, way): [] for stage in stages for way in ways}
    for _ in range(args.repeat + 1):  # the first round warms up
        for stage, run in stages.items():
            for way, minimum in ways.items():
                with mock.patch.object(common, "MIN_SHARED_PREFIX", minimum):
                    start = time.process_time()
                    run()
                    seconds[(stage, way)].append(time.process_time() - start)
    prompt = rollout.batch["input_ids"].shape[1] - args.response
    print(f"CPU: {cpu_description()}")
    print(f"speed: {machine_speed()}")
    print(f"{args.model}, {args.config}'s prompts: {args.rows} sequences of up to {prompt} prompt + {args.response} "
          f"response tokens, micro-batches of 4; shared prefix {shared} tokens")  # fmt: skip
    print(f"{'stage':13} {'every row s':>12} {'shared once s':>14} {'ratio':>7}")
    for stage in stages:
        each, once = (statistics.median(seconds[(stage, way)][1:]) for way in ways)
        print(f"{stage:13} {each:12.2f} {once:14.2f} {once / each:7.2f}")


if __name__ == "__main__":
    main()
