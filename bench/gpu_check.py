"""The CUDA paths of the actor worker on one GPU, in three precisions: float32; mixed (float32 weights and AdamW
state, bf16 compute under torch.autocast: what configs/gpu.yaml runs); pure bf16 weights (model.dtype=bfloat16,
which a run refuses unless actor.optim.low_precision_weights=true). Each runs an nccl process group, HF generate,
log-probs, the reference, GRPO updates and a checkpoint round trip, with the checks a GPU run must pass and the time
of each stage, then a learning probe: ``--probe-steps`` updates at ``--lr`` (gpu.yaml's 1e-6) that reinforce one
fixed batch, reporting how many weights moved and how far the batch's log-likelihood rose. Ray, Prefect and MLflow
are not needed (the worker runs in this process, rank 0 of 1), so it runs on a bare GPU machine with torch,
transformers, tensordict and pydantic.

    python bench/gpu_check.py [--layers 12] [--hidden 768] [--prompts 64] [--n 8] [--response-length 64] [--steps 4]
                              [--strategy ddp|fsdp2]

``--strategy fsdp2`` runs the same with the actor and reference sharded by FSDP2 (a world of one GPU: the CUDA path,
nccl and the MixedPrecisionPolicy, not the memory saving, which needs several).

Prints one table per precision and ends with each one's time per stage against float32's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from rlworkers.algorithms import core_algos
from rlworkers.data.batching import prompt_batch
from rlworkers.data.synthetic import addition_rows
from rlworkers.models.tiny import ensure_tiny_model
from rlworkers.workers import fsdp
from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker
from rlworkers.workers.config import WorkerConfig
from rlworkers.workers.critic import CriticWorker
from rlworkers.workers.reward import RewardWorker


def timed(fn, *args):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


times_keys = ("generate", "log_prob", "ref_log_prob", "update")
PRECISIONS = {  # name: model settings (and the opt-in a pure bf16 run needs)
    "float32": ({"dtype": "float32"}, {}),
    "mixed": ({"dtype": "float32", "autocast": "bfloat16"}, {}),
    "bf16": ({"dtype": "bfloat16"}, {"low_precision_weights": True}),
}


def run(precision: str, path: str, args) -> dict[str, float]:
    total = args.prompts * args.n
    model, optim = PRECISIONS[precision]
    config = WorkerConfig.model_validate(
        {
            "model": {"path": path, **model},
            "device": args.device,
            "rollout": {"response_length": args.response_length, "n": args.n, "log_prob_micro_batch_size_per_gpu": 64},
            "actor": {
                "ppo_mini_batch_size": total // 2,
                "ppo_micro_batch_size_per_gpu": min(32, total // 2),
                "use_kl_loss": True,
                "optim": {"lr": args.lr, **optim},
                "strategy": args.strategy,
            },
        }
    )
    worker = ActorRolloutRefWorker(config, role="actor_rollout_ref")
    worker.init_model()
    assert torch.distributed.get_backend() == ("nccl" if args.device == "cuda" else "gloo")
    assert next(worker.model.parameters()).dtype == getattr(torch, model["dtype"])
    assert next(worker.model.parameters()).device.type == args.device
    prompts = prompt_batch(
        addition_rows(num_train=args.prompts, num_val=1, max_digits=3, seed=0)["train"], worker.tokenizer
    )
    prompts.meta_info["n"] = args.n
    times = {k: [] for k in ("generate", "log_prob", "ref_log_prob", "update")}
    gaps, losses = [], []
    for step in range(args.steps + 1):  # step 0 warms up (CUDA context, kernels, allocator)
        gen, t_gen = timed(worker.generate_sequences, prompts)
        old, t_lp = timed(worker.compute_log_prob, gen)
        ref, t_ref = timed(worker.compute_ref_log_prob, gen)
        gen.union(old)
        gen.union(ref)
        mask = gen.batch["response_mask"].bool()
        gaps.append(float((gen.batch["rollout_log_probs"] - gen.batch["old_log_probs"])[mask].abs().max()))
        scores = torch.randn(len(gen))  # the reward does not matter for the mechanics
        token_scores = scores[:, None] * gen.batch["response_mask"]
        advantages, _ = core_algos.compute_grpo_outcome_advantage(
            token_scores, gen.batch["response_mask"], gen.non_tensor_batch["uid"]
        )
        gen.batch["advantages"] = advantages
        out, t_up = timed(worker.update_actor, gen)
        losses.append(out.meta_info["metrics"]["actor/pg_loss"])
        if step:
            for key, value in zip(times, (t_gen, t_lp, t_ref, t_up)):
                times[key].append(value)
    checksum = worker.get_weights_checksum()
    with tempfile.TemporaryDirectory() as folder:
        worker.save_checkpoint(folder)
        worker.update_actor(gen)
        assert worker.get_weights_checksum() != checksum
        worker.load_checkpoint(folder)
        assert worker.get_weights_checksum() == checksum, "checkpoint round trip changed the weights"
    assert all(torch.isfinite(torch.tensor(losses))), losses
    moved, rise = learning_probe(worker, gen, args.probe_steps)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
    what = f"{total} sequences x {args.response_length} new tokens, {args.steps} steps"
    print(f"\n{precision} ({model}, {args.strategy}): {what}")
    for key, values in times.items():
        print(f"  {key:<13} {statistics.median(values):7.3f} s (median; min {min(values):.3f})")
    print(f"  max |rollout log-prob - recomputed log-prob| over response tokens: {max(gaps):.2e}")
    print(f"  pg_loss per step: {', '.join(f'{x:.4f}' for x in losses)}; peak GPU memory {peak:.2f} GiB")
    print("  checkpoint save -> change -> load restored the weights exactly")
    print(
        f"  learning probe, {args.probe_steps} updates at lr {args.lr:g} reinforcing one batch: {moved:.1%} of the "
        f"weights moved; the batch's mean log-prob per response token rose {rise:+.2e} nats"
    )
    del worker
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return {key: statistics.median(values) for key, values in times.items()} | {"moved": moved, "rise": rise}


def check_critic_and_reward(path: str, args) -> None:
    """The critic and a reward model on the device, both under bf16 autocast over float32 weights: values, critic
    updates on one fixed batch (its value loss must fall), and reward-model scores (finite, one per row)."""
    total = args.prompts * args.n
    actor = ActorRolloutRefWorker(
        WorkerConfig.model_validate(
            {"model": {"path": path}, "device": args.device, "rollout": {"response_length": args.response_length}}
        ),
        role="rollout",
    )
    actor.init_model()
    prompts = prompt_batch(
        addition_rows(num_train=args.prompts, num_val=1, max_digits=3, seed=0)["train"], actor.tokenizer
    )
    prompts.meta_info["n"] = args.n
    batch = actor.generate_sequences(prompts)
    del actor
    mixed = {"path": path, "autocast": "bfloat16"}
    critic = CriticWorker(
        {
            "ppo_mini_batch_size": total // 2,
            "ppo_micro_batch_size_per_gpu": min(32, total // 2),
            "optim": {"lr": 1e-5},
            "strategy": args.strategy,
        },
        model=mixed,
        device=args.device,
    )
    critic.init_model()
    batch.union(critic.compute_values(batch))
    batch.batch["returns"] = batch.batch["response_mask"].float()
    losses, t_update = [], 0.0
    for _ in range(5):
        out, seconds = timed(critic.update_critic, batch)
        losses.append(out.meta_info["metrics"]["critic/vf_loss"])
        t_update += seconds
    assert next(critic.model.parameters()).device.type == args.device
    assert losses[-1] < losses[0], losses
    del critic
    reward = RewardWorker({"reward_model": mixed, "num_workers": 1}, tokenizer_path=path, device=args.device)
    reward.init_model()
    scores, t_score = timed(reward.compute_rm_score, batch)
    values = scores.non_tensor_batch["score"].astype(float)
    assert next(reward.reward_model.model.parameters()).device.type == args.device
    assert len(values) == total and np.isfinite(values).all()
    print(f"\ncritic and reward model, mixed precision, on {args.device}: {total} sequences")
    print(
        f"  critic value loss over 5 updates on one batch: {', '.join(f'{x:.4f}' for x in losses)} ({t_update:.2f} s)"
    )
    print(f"  reward-model scores: mean {values.mean():+.4f}, std {values.std():.4f} ({t_score:.2f} s)")


def learning_probe(worker: ActorRolloutRefWorker, batch, steps: int) -> tuple[float, float]:
    """``steps`` updates with advantage +1 on every response of ``batch``: the share of weight elements that
    changed, and the rise of the batch's mean log-prob per response token (float32 recomputation)."""
    batch.batch["advantages"] = batch.batch["response_mask"].float()
    before = [w.clone() for _, w in fsdp.full_weights(worker.model)]
    mask = batch.batch["response_mask"].float()
    start = mean_log_prob(worker, batch, mask)
    for _ in range(steps):
        worker.update_actor(batch)
    changed = sum(int((w != b).sum()) for (_, w), b in zip(fsdp.full_weights(worker.model), before))
    return changed / sum(b.numel() for b in before), mean_log_prob(worker, batch, mask) - start


def mean_log_prob(worker: ActorRolloutRefWorker, batch, mask: torch.Tensor) -> float:
    log_probs = worker.compute_log_prob(batch).batch["old_log_probs"]
    return float((log_probs * mask).sum() / mask.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-6, help="configs/gpu.yaml's actor.optim.lr")
    parser.add_argument("--probe-steps", type=int, default=5)
    parser.add_argument("--precisions", default="float32,mixed,bf16", help=f"of {', '.join(PRECISIONS)}")
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp2"], help="the actor's and reference's")
    parser.add_argument("--critic-and-reward", action="store_true", help="also check the critic and a reward model")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the script")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check needs a GPU (--device cpu for a dry run)")
    path = str(
        ensure_tiny_model(
            os.path.join(tempfile.gettempdir(), f"rlflow-llama-{args.layers}x{args.hidden}"),
            num_layers=args.layers,
            hidden_size=args.hidden,
        )
    )
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{device}, torch {torch.__version__}, random Llama {args.layers}x{args.hidden}")
    if args.critic_and_reward:
        check_critic_and_reward(path, args)
    medians = {precision: run(precision, path, args) for precision in args.precisions.split(",") if precision}
    if not medians:
        return
    base = medians.get("float32")
    print(f"\n{'precision':<10} " + " ".join(f"{k:>13}" for k in next(iter(medians.values()))))
    for precision, figures in medians.items():
        cells = [f"{figures[k]:.3f}" + (f" ({figures[k] / base[k]:.2f}x)" if base else "") for k in times_keys]
        cells += [f"{figures['moved']:.1%}", f"{figures['rise']:+.2e}"]
        print(f"{precision:<10} " + " ".join(f"{c:>13}" for c in cells))
    print("(stages in seconds, median; in brackets against float32; moved: share of weights changed by the probe;")
    print(" rise: the probe's rise of the reinforced batch's mean log-prob per token, in nats)")


if __name__ == "__main__":
    main()
