"""FSDP2 (``actor.strategy: fsdp2``, rlworkers/workers/fsdp.py) on real 2-worker groups on Ray (gloo on CPU): the
same job gives DDP's numbers, sharded checkpoints come back bit for bit and load on another number of workers, the
published model is a whole HF folder, and DCP's metadata pickle is read with an allowlist."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from rlworkers.data.batching import prompt_batch, sft_batch
from rlworkers.data.synthetic import addition_rows
from rlworkers.models.loading import load_model, load_tokenizer
from rlworkers.models.tiny import ensure_tiny_model
from rlworkers.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker
from rlworkers.workers.critic import CriticWorker

ROWS = addition_rows(num_train=200, num_val=10, max_digits=2, seed=0)


@pytest.fixture(scope="module")
def tiny_path(ray_cluster, tmp_path_factory):
    return str(ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


def config(path: str, strategy: str, **actor) -> dict:
    return {
        "model": {"path": path},
        "rollout": {"response_length": 5, "log_prob_micro_batch_size_per_gpu": 4},
        "ref_micro_batch_size_per_gpu": 4,
        "actor": {
            "ppo_mini_batch_size": 8,
            "ppo_micro_batch_size_per_gpu": 2,
            "use_kl_loss": True,
            "optim": {"lr": 1e-3},
            "strategy": strategy,
            **actor,
        },
    }


class Group:
    def __init__(self, cls, n: int, **kwargs):
        self.pool = RayResourcePool([n], use_gpu=False, max_colocate_count=1)
        self.group = RayWorkerGroup(resource_pool=self.pool, ray_cls_with_init=RayClassWithInitArgs(cls=cls, **kwargs))
        self.group.init_model()

    def __getattr__(self, name):
        return getattr(self.group, name)

    def close(self):
        self.group.shutdown()
        self.pool.remove()


def ppo_steps(group, tokenizer, steps: int) -> list[dict]:
    """``steps`` GRPO-like updates on seeded samples: generate, old and reference log-probs, random advantages."""
    out = []
    for step in range(steps):
        batch = prompt_batch(ROWS["train"][step * 4 : step * 4 + 4], tokenizer)
        batch.meta_info.update(n=2, seed=step)
        data = group.generate_sequences(batch)
        data.union(group.compute_log_prob(data))
        data.union(group.compute_ref_log_prob(data))
        generator = torch.Generator().manual_seed(step)
        data.batch["advantages"] = torch.randn(data.batch["responses"].shape, generator=generator)
        data.batch["advantages"] *= data.batch["response_mask"]
        metrics = group.update_actor(data).meta_info["metrics"]
        out.append(
            {
                "responses": data.batch["responses"],
                "old_log_probs": data.batch["old_log_probs"],
                "ref_log_prob": data.batch["ref_log_prob"],
                **{k: float(np.mean(v)) for k, v in metrics.items()},
            }
        )
    return out


@pytest.fixture(scope="module")
def ddp_run(tiny_path):
    """The DDP group's numbers the fsdp2 ones are held against: 3 PPO-style steps, then an SFT step."""
    tokenizer = load_tokenizer(tiny_path)
    ddp = Group(ActorRolloutRefWorker, 2, config=config(tiny_path, "ddp"), role="actor_rollout_ref")
    steps = ppo_steps(ddp, tokenizer, 3)
    sft = ddp.sft_step(sft_batch(ROWS["train"][:8], tokenizer)).meta_info["metrics"]
    checksum = ddp.get_weights_checksum()[0]
    ddp.close()
    return steps, sft, checksum


def test_fsdp2_gives_ddp_numbers_and_its_checkpoints_reshard(tiny_path, ddp_run, tmp_path):
    tokenizer = load_tokenizer(tiny_path)
    ddp_steps, ddp_sft, ddp_checksum = ddp_run
    sharded = Group(ActorRolloutRefWorker, 2, config=config(tiny_path, "fsdp2"), role="actor_rollout_ref")
    steps = ppo_steps(sharded, tokenizer, 3)
    for ours, theirs in zip(steps, ddp_steps):
        assert torch.equal(ours["responses"], theirs["responses"])  # sampled from the gathered weights alike
        torch.testing.assert_close(ours["old_log_probs"], theirs["old_log_probs"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours["ref_log_prob"], theirs["ref_log_prob"], rtol=1e-4, atol=1e-5)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-3, abs=1e-5), key
    sft = sharded.sft_step(sft_batch(ROWS["train"][:8], tokenizer)).meta_info["metrics"]
    assert np.mean(sft["sft/loss"]) == pytest.approx(np.mean(ddp_sft["sft/loss"]), rel=1e-4)
    assert np.mean(sft["sft/grad_norm"]) == pytest.approx(np.mean(ddp_sft["sft/grad_norm"]), rel=1e-3)
    checksums = sharded.get_weights_checksum()
    assert checksums[0] == checksums[1] == pytest.approx(ddp_checksum, rel=1e-6)

    # a checkpoint is each rank's shard: no whole model written, and it comes back bit for bit
    checkpoint = str(tmp_path / "step_4" / "actor")
    sharded.save_checkpoint(checkpoint)
    files = set(os.listdir(checkpoint))
    assert "model.safetensors" not in files and {"shards", "actor_state_rank_0.pt", "actor_state_rank_1.pt"} <= files
    assert sorted(os.listdir(f"{checkpoint}/shards")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    saved = sharded.get_weights_checksum()[0]
    next_step = ppo_steps(sharded, tokenizer, 1)[0]
    assert sharded.get_weights_checksum()[0] != saved
    sharded.load_checkpoint(checkpoint)
    assert sharded.get_weights_checksum()[0] == saved
    again = ppo_steps(sharded, tokenizer, 1)[0]
    assert again["actor/pg_loss"] == next_step["actor/pg_loss"]  # optimizer state and RNG came back too
    assert torch.equal(again["responses"], next_step["responses"])

    # the published model: one whole HF folder from the shards
    sharded.load_checkpoint(checkpoint)
    sharded.save_model(str(tmp_path / "final"))
    whole = load_model(str(tmp_path / "final"))
    assert float(sum(p.detach().double().sum() for p in whole.parameters())) == pytest.approx(saved, rel=1e-12)
    sharded.close()

    # saved by 2 workers, loaded by 1: DCP reshards; the update that follows is the 2-worker one's
    single = Group(ActorRolloutRefWorker, 1, config=config(tiny_path, "fsdp2"), role="actor_rollout_ref")
    single.load_checkpoint(checkpoint)
    assert single.get_weights_checksum()[0] == saved
    single.close()


def test_generation_a_layer_at_a_time_in_lockstep_gives_the_same_numbers(tiny_path, ddp_run):
    """fsdp_config.gather_for_generation=false: each layer gathered for each token, the ranks kept in step by HF's
    synced_gpus (a rank whose rows ended runs the forward passes the other still needs)."""
    tokenizer = load_tokenizer(tiny_path)
    ddp_steps, _, _ = ddp_run
    lockstep = config(tiny_path, "fsdp2", fsdp_config={"gather_for_generation": False})
    sharded = Group(ActorRolloutRefWorker, 2, config=lockstep, role="actor_rollout_ref")
    for ours, theirs in zip(ppo_steps(sharded, tokenizer, 3), ddp_steps):
        assert torch.equal(ours["responses"], theirs["responses"])
        assert ours["actor/pg_loss"] == pytest.approx(theirs["actor/pg_loss"], rel=1e-3, abs=1e-5)
    sharded.close()


def test_the_critic_shards_too(tiny_path, tmp_path):
    critic = {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4, "optim": {"lr": 1e-3}}
    tokenizer = load_tokenizer(tiny_path)
    batch = prompt_batch(ROWS["train"][:8], tokenizer)
    actor = ActorRolloutRefWorker(config(tiny_path, "ddp"), role="rollout")
    actor.init_model()
    data = actor.generate_sequences(batch)
    data.batch["returns"] = torch.randn(data.batch["responses"].shape) * data.batch["response_mask"]
    results = {}
    for strategy in ("ddp", "fsdp2"):
        group = Group(CriticWorker, 2, config={**critic, "strategy": strategy}, model={"path": tiny_path})
        data.batch["values"] = group.compute_values(data).batch["values"]
        results[strategy] = group.update_critic(data).meta_info["metrics"]
        saved = tmp_path / f"critic-{strategy}"
        group.save_checkpoint(str(saved))
        values = group.compute_values(data).batch["values"]
        assert torch.equal(group.compute_values(data).batch["values"], values)
        group.update_critic(data)
        group.load_checkpoint(str(saved))  # ddp: rank 1 takes AdamW's state from rank 0's file, the one copy
        assert torch.equal(group.compute_values(data).batch["values"], values)
        if strategy == "ddp":
            states = [torch.load(saved / f"critic_state_rank_{rank}.pt", weights_only=True) for rank in (0, 1)]
            assert states[0]["optimizer"]["state"] and "optimizer" not in states[1]
        group.close()
    for key in ("critic/vf_loss", "critic/grad_norm"):
        assert np.mean(results["fsdp2"][key]) == pytest.approx(np.mean(results["ddp"][key]), rel=1e-4), key


def test_checkpoint_metadata_that_is_not_dcp_is_refused(tmp_path):
    from rlworkers.workers.fsdp import MetadataCheckingReader

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        MetadataCheckingReader(str(tmp_path)).read_metadata()
