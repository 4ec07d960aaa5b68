"""Workers: DataProto in/out contracts of every method, log-prob consistency, SFT and PPO updates, checkpoints.

Fast tests call the worker classes in-process (a Worker outside a group is rank 0 of 1); the data-parallel tests
run them as a 2-worker group on real Ray.
"""

from __future__ import annotations

import os
import pickle
import random

import numpy as np
import pytest
import torch

from rlworkers.algorithms.batch_ops import compute_advantage, compute_data_metrics
from rlworkers.data.batching import decode_responses, prompt_batch, sft_batch
from rlworkers.data.synthetic import addition_rows
from rlworkers.models.tiny import ensure_tiny_model
from rlworkers.protocol import DataProto
from rlworkers.rewards import RewardFunctionError, compute_scores, load_reward_fn
from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker
from rlworkers.workers.config import RewardConfig, WorkerConfig
from rlworkers.workers.critic import CriticWorker
from rlworkers.workers.reward import RewardWorker, RuleReward

ROWS = addition_rows(num_train=400, num_val=50, max_digits=2, seed=0)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return str(ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


def worker_config(path, **overrides) -> WorkerConfig:
    base = {
        "model": {"path": path},
        "rollout": {"response_length": 5},
        "actor": {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4, "optim": {"lr": 1e-3}},
    }
    for key, value in overrides.items():
        base.setdefault(key, {}).update(value)
    return WorkerConfig.model_validate(base)


@pytest.fixture()
def worker(tiny_path):
    w = ActorRolloutRefWorker(worker_config(tiny_path), role="actor_rollout_ref")
    w.init_model()
    return w


def generated(worker, n_prompts=6, n=2) -> DataProto:
    batch = prompt_batch(ROWS["train"][:n_prompts], worker.tokenizer)
    batch.meta_info["n"] = n
    return worker.generate_sequences(batch)


def test_generate_sequences_contract(worker):
    out = generated(worker, n_prompts=6, n=2)
    prompt_len = out.batch["prompts"].shape[1]
    assert len(out) == 12
    assert out.batch["responses"].shape == (12, 5)
    assert out.batch["input_ids"].shape == (12, prompt_len + 5)
    assert out.batch["attention_mask"].shape == out.batch["position_ids"].shape == (12, prompt_len + 5)
    assert out.batch["rollout_log_probs"].shape == out.batch["response_mask"].shape == (12, 5)
    uids = out.non_tensor_batch["uid"]
    assert all(uids[2 * i] == uids[2 * i + 1] for i in range(6)) and len(set(uids)) == 6  # a a b b ...
    eos, pad = worker.tokenizer.eos_token_id, worker.tokenizer.pad_token_id
    for row, mask in zip(out.batch["responses"], out.batch["response_mask"]):
        valid = int(mask.sum())
        assert mask[:valid].all() and not mask[valid:].any()  # ones, then zeros
        if valid < 5:
            assert row[valid - 1] == eos and (row[valid:] == pad).all()
        assert eos not in row[: valid - 1].tolist()
    assert (out.batch["rollout_log_probs"][out.batch["response_mask"] == 0] == 0).all()
    assert (out.batch["rollout_log_probs"][out.batch["response_mask"] == 1] < 0).all()


def test_greedy_generation_is_deterministic(worker):
    batch = prompt_batch(ROWS["validation"][:4], worker.tokenizer)
    batch.meta_info.update(do_sample=False)
    first, second = worker.generate_sequences(batch), worker.generate_sequences(batch)
    assert torch.equal(first.batch["responses"], second.batch["responses"])


def test_seeded_sampling_repeats_its_draws_and_leaves_the_training_random_state_alone(worker):
    batch = prompt_batch(ROWS["validation"][:8], worker.tokenizer)
    batch.meta_info.update(do_sample=True, n=4, temperature=1.0, seed=7)
    state = torch.get_rng_state()
    first = worker.generate_sequences(batch)
    assert torch.equal(torch.get_rng_state(), state)  # the training's next draws are the ones it would have made
    second = worker.generate_sequences(batch)
    assert torch.equal(first.batch["responses"], second.batch["responses"])
    assert "seed" not in first.meta_info  # per rank, so not merged across ranks
    batch.meta_info["seed"] = 8
    other = worker.generate_sequences(batch)
    assert not torch.equal(first.batch["responses"], other.batch["responses"])
    del batch.meta_info["seed"]
    worker.generate_sequences(batch)  # unseeded: draws from the training's state
    assert not torch.equal(torch.get_rng_state(), state)


def test_recomputed_log_probs_match_rollout(worker):
    out = generated(worker, n_prompts=8, n=2)
    recomputed = worker.compute_log_prob(out)
    assert set(recomputed.batch.keys()) == {"old_log_probs", "entropys"}
    mask = out.batch["response_mask"].bool()
    diff = (recomputed.batch["old_log_probs"] - out.batch["rollout_log_probs"])[mask].abs().max()
    assert diff < 1e-4, f"actor and rollout disagree by {diff}"


def test_ref_matches_actor_until_the_actor_trains(worker):
    out = generated(worker)
    out.union(worker.compute_log_prob(out))
    ref = worker.compute_ref_log_prob(out)
    mask = out.batch["response_mask"].bool()
    assert torch.allclose(ref.batch["ref_log_prob"][mask], out.batch["old_log_probs"][mask], atol=1e-5)
    out.batch["advantages"] = torch.randn(len(out), 5) * out.batch["response_mask"]
    metrics = worker.update_actor(out).meta_info["metrics"]
    for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr"):
        assert np.isfinite(metrics[name]), name
    after = worker.compute_ref_log_prob(out).batch["ref_log_prob"]
    assert torch.equal(after, ref.batch["ref_log_prob"])  # the reference is frozen
    new = worker.compute_log_prob(out).batch["old_log_probs"]
    assert not torch.allclose(new[mask], out.batch["old_log_probs"][mask])  # the actor moved


def test_an_update_measures_its_batchs_staleness_from_its_policy_version(worker):
    """Each response carries its policy's number of updates (``policy_version``); an update reports how many updates
    the policy has had since (``async/staleness_*``, async_training): 0 for a batch sampled just before, 1 for one
    sampled before the last update."""
    from rlworkers.workers.actor_rollout_ref import POLICY_VERSION

    def with_advantages(out):
        out.union(worker.compute_log_prob(out))
        out.batch["advantages"] = torch.randn(len(out), 5) * out.batch["response_mask"]
        return out

    first, second = with_advantages(generated(worker)), with_advantages(generated(worker))
    assert list(first.non_tensor_batch[POLICY_VERSION]) == [0] * 12
    metrics = worker.update_actor(first).meta_info["metrics"]
    assert metrics["async/staleness_mean"] == 0 and metrics["async/staleness_max"] == 0
    metrics = worker.update_actor(second).meta_info["metrics"]  # sampled before the first update
    assert metrics["async/staleness_mean"] == 1 and metrics["async/staleness_max"] == 1
    assert list(generated(worker).non_tensor_batch[POLICY_VERSION]) == [2] * 12


def test_a_rollout_worker_of_its_own_samples_with_the_actors_weights_sent_to_it(worker, tiny_path):
    """``get_policy_weights`` / ``set_policy_weights`` (a rollout pool of its own, rollout.n_workers): after an
    update, a rollout-only worker given the actor's weights draws, from the same seed, exactly what the actor draws,
    stamped with the actor's number of updates; before, it drew from the start weights."""
    from rlworkers.workers.actor_rollout_ref import POLICY_VERSION

    rollout = ActorRolloutRefWorker(worker_config(tiny_path), role="rollout")
    rollout.init_model()
    batch = prompt_batch(ROWS["validation"][:6], worker.tokenizer)
    batch.meta_info.update(n=2, seed=11)
    out = generated(worker)
    out.union(worker.compute_log_prob(out))
    out.batch["advantages"] = torch.randn(len(out), 5) * out.batch["response_mask"]
    worker.update_actor(out)
    stale = rollout.generate_sequences(batch)
    assert list(stale.non_tensor_batch[POLICY_VERSION]) == [0] * 12
    rollout.set_policy_weights(worker.get_policy_weights())
    ours, actors = rollout.generate_sequences(batch), worker.generate_sequences(batch)
    assert torch.equal(ours.batch["responses"], actors.batch["responses"])
    assert torch.equal(ours.batch["rollout_log_probs"], actors.batch["rollout_log_probs"])
    assert not torch.equal(stale.batch["rollout_log_probs"], ours.batch["rollout_log_probs"])
    assert list(ours.non_tensor_batch[POLICY_VERSION]) == [1] * 12
    with pytest.raises(RuntimeError, match="rollout \\(without actor\\)"):
        worker.set_policy_weights(worker.get_policy_weights())


def test_kl_loss_and_gspo_paths(tiny_path):
    w = ActorRolloutRefWorker(
        worker_config(tiny_path, actor={"use_kl_loss": True, "policy_loss": "gspo", "ppo_mini_batch_size": 12})
    )  # one optimizer step
    w.init_model()
    out = generated(w)
    out.union(w.compute_log_prob(out))
    out.union(w.compute_ref_log_prob(out))
    out.batch["advantages"] = torch.ones(len(out), 5) * out.batch["response_mask"]
    metrics = w.update_actor(out).meta_info["metrics"]
    assert metrics["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # actor == ref before this step
    assert metrics["actor/kl_coef"] == 0.001


def test_sft_lowers_loss(tiny_path):
    config = worker_config(tiny_path, actor={"ppo_mini_batch_size": 32, "ppo_micro_batch_size_per_gpu": 32})
    w = ActorRolloutRefWorker(config, role="actor")
    w.init_model()
    rng = random.Random(0)
    losses = [
        w.sft_step(sft_batch(rng.sample(ROWS["train"], 32), w.tokenizer)).meta_info["metrics"]["sft/loss"]
        for _ in range(40)
    ]
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3])


def positions_through_output_layer(model) -> list[int]:
    """Records how many positions of each forward reach ``model``'s output layer (its sequence dimension)."""
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    return seen


def test_the_output_layer_computes_only_the_response_positions_of_a_log_prob(tiny_path):
    """Log-probs (actor and reference) and the update take the logits of the response positions alone
    (transformers' ``logits_to_keep``), with the values the whole sequence's logits give."""
    from rlworkers.workers.common import logprobs_from_logits, takes_logits_to_keep

    w = ActorRolloutRefWorker(
        worker_config(tiny_path, actor={"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 8}),
        role="actor_rollout",
    )
    w.init_model()
    seen = positions_through_output_layer(w.model)
    out = generated(w, n_prompts=4, n=2)
    seen.clear()
    log_probs = w.compute_log_prob(out).batch["old_log_probs"]
    response_length, total = out.batch["responses"].shape[1], out.batch["input_ids"].shape[1]
    assert seen == [response_length + 1] and response_length + 1 < total
    with torch.no_grad():
        logits = w.model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"],
                         position_ids=out.batch["position_ids"]).logits[:, -response_length - 1 : -1]  # fmt: skip
    torch.testing.assert_close(log_probs, logprobs_from_logits(logits, out.batch["responses"]), rtol=0, atol=1e-6)

    class NoKeyword(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
            raise AssertionError("not called")

    assert takes_logits_to_keep(w.model) and not takes_logits_to_keep(NoKeyword())


def test_bf16_autocast_computes_in_bf16_over_float32_weights(tiny_path):
    """model.autocast=bfloat16: log-probs move by bf16 rounding (not more), the weights and AdamW's state stay float32,
    and SFT under it learns as float32 does."""
    config = worker_config(tiny_path, actor={"ppo_mini_batch_size": 32, "ppo_micro_batch_size_per_gpu": 32})
    plain = ActorRolloutRefWorker(config)
    mixed = ActorRolloutRefWorker(
        config.model_copy(update={"model": config.model.model_copy(update={"autocast": "bfloat16"})})
    )
    plain.init_model()
    mixed.init_model()
    out = generated(mixed, n_prompts=8, n=2)
    mask = out.batch["response_mask"].bool()
    gap = mixed.compute_log_prob(out).batch["old_log_probs"] - plain.compute_log_prob(out).batch["old_log_probs"]
    assert 1e-4 < gap[mask].abs().max() < 0.2, gap[mask].abs().max()  # bf16 compute, same weights
    rng = random.Random(0)
    losses = [
        mixed.sft_step(sft_batch(rng.sample(ROWS["train"], 32), mixed.tokenizer)).meta_info["metrics"]["sft/loss"]
        for _ in range(20)  # bf16 is emulated (~15x slower) on CPUs without AMX / AVX512-BF16
    ]
    assert np.mean(losses[-3:]) < 0.6 * np.mean(losses[:3])
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    assert all(v.dtype == torch.float32 for state in mixed.optimizer.state.values() for v in state.values() if v.dim())
    with pytest.raises(ValueError, match="model.autocast=bfloat16 computes in bfloat16 over float32 weights"):
        worker_config(tiny_path, model={"dtype": "bfloat16", "autocast": "bfloat16"})


def test_sft_batch_masks_only_the_answer(worker):
    data = sft_batch([{"prompt": "1+2=", "response": "3"}], worker.tokenizer)
    tokens = data.batch["input_ids"][0][data.batch["loss_mask"][0].bool()].tolist()
    assert tokens == worker.tokenizer("3", add_special_tokens=False)["input_ids"] + [worker.tokenizer.eos_token_id]


def test_role_is_checked(tiny_path):
    w = ActorRolloutRefWorker(worker_config(tiny_path), role="rollout")
    w.init_model()
    with pytest.raises(RuntimeError, match="update_actor needs the 'actor' role"):
        w.update_actor(DataProto())
    with pytest.raises(ValueError, match="role 'critic'"):
        ActorRolloutRefWorker(worker_config(tiny_path), role="critic")


def test_batches_move_to_the_worker_device_without_touching_the_callers(worker):
    from rlworkers.workers import common

    batch = prompt_batch(ROWS["train"][:3], worker.tokenizer)
    moved = common.to_device(batch, "meta")  # any device other than the caller's
    assert moved.batch["input_ids"].device.type == "meta" and batch.batch["input_ids"].device.type == "cpu"
    assert moved.non_tensor_batch is batch.non_tensor_batch and moved.meta_info is batch.meta_info
    assert common.to_device(batch, "cpu") is batch


def test_checkpoint_round_trip(worker, tmp_path):
    out = generated(worker)
    out.union(worker.compute_log_prob(out))
    start_ref = worker.compute_ref_log_prob(out).batch["ref_log_prob"]
    out.batch["advantages"] = torch.randn(len(out), 5) * out.batch["response_mask"]
    worker.update_actor(out)
    saved = worker.get_weights_checksum()
    worker.save_checkpoint(str(tmp_path / "ckpt"))
    assert {"model.safetensors", "tokenizer_config.json", "actor_state_rank_0.pt"} <= set(os.listdir(tmp_path / "ckpt"))
    worker.save_model(str(tmp_path / "model"))  # what is published: the model and its tokenizer only
    published = set(os.listdir(tmp_path / "model"))
    assert {"model.safetensors", "config.json", "tokenizer_config.json"} <= published
    assert not any(name.endswith(".pt") for name in published), published
    worker.update_actor(out)
    assert worker.get_weights_checksum() != saved
    worker.load_checkpoint(str(tmp_path / "ckpt"))
    assert worker.get_weights_checksum() == saved
    assert worker.update_steps == 1
    assert worker.optimizer.state_dict()["state"]  # Adam moments came back too
    # a colocated reference stays the start model: the checkpoint holds the policy
    assert torch.equal(worker.compute_ref_log_prob(out).batch["ref_log_prob"], start_ref)


def test_reward_worker_rule_and_user_function(worker, tmp_path):
    rows = ROWS["validation"][:3]
    batch = prompt_batch(rows, worker.tokenizer)
    tok = worker.tokenizer
    answers = [rows[0]["answer"], "999", rows[2]["answer"]]
    responses = torch.full((3, 5), tok.pad_token_id)
    mask = torch.zeros(3, 5, dtype=torch.long)
    for i, text in enumerate(answers):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        responses[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    batch.batch["responses"], batch.batch["response_mask"] = responses, mask
    assert decode_responses(batch, tok) == answers
    rw = RewardWorker({"reward_fn": "exact"}, tokenizer_path=worker.config.model.path)
    rw.init_model()
    scored = rw.compute_rm_score(batch)
    assert list(scored.non_tensor_batch["score"]) == [1.0, 0.0, 1.0]
    last = mask.sum(-1) - 1
    assert scored.batch["token_level_scores"][torch.arange(3), last].tolist() == [1.0, 0.0, 1.0]
    assert scored.batch["token_level_scores"].sum() == 2.0
    user_file = tmp_path / "my_reward.py"
    user_file.write_text("def length(prompts, responses, **cols):\n    return [float(len(r)) for r in responses]\n")
    rw = RewardWorker({"reward_fn": f"{user_file}:length"}, tokenizer_path=worker.config.model.path)
    rw.init_model()
    assert list(rw.compute_rm_score(batch).non_tensor_batch["score"]) == [float(len(a)) for a in answers]
    rw.save_checkpoint(str(tmp_path / "ckpt"))
    rw.load_checkpoint(str(tmp_path / "ckpt"))
    other = RewardWorker({"reward_fn": "exact"}, tokenizer_path=worker.config.model.path)
    with pytest.raises(ValueError, match="resume with the same reward"):
        other.load_checkpoint(str(tmp_path / "ckpt"))

    # The same rule scored in the calling process (reward.num_workers=0): the worker's output, and a checkpoint
    # either wrote fits the other (where the reward runs may change between attempts; what it is may not).
    rule = RuleReward({"reward_fn": f"{user_file}:length", "num_workers": 0}, worker.config.model.path)
    assert list(rule.compute_rm_score(batch).non_tensor_batch["score"]) == [float(len(a)) for a in answers]
    rule.load_checkpoint(str(tmp_path / "ckpt"))
    rule.save_checkpoint(str(tmp_path / "ckpt-rule"))
    rw.load_checkpoint(str(tmp_path / "ckpt-rule"))
    with pytest.raises(ValueError, match="resume with the same reward"):
        other.load_checkpoint(str(tmp_path / "ckpt-rule"))
    exact = RuleReward({"reward_fn": "exact"}, worker.config.model.path)
    assert torch.equal(exact.compute_rm_score(batch).batch["token_level_scores"], scored.batch["token_level_scores"])
    assert len(pickle.dumps(exact)) < 2000  # travels to each stage task as its config, not with a tokenizer
    with pytest.raises(ValueError, match="reward model runs in a RewardWorker group"):
        RuleReward({"reward_model": {"path": worker.config.model.path}}, worker.config.model.path)
    with pytest.raises(ValueError, match="set reward.num_workers >= 1"):
        RewardConfig(reward_model={"path": worker.config.model.path}, num_workers=0)


def test_a_raising_reward_function_is_named_with_its_line(tmp_path):
    (tmp_path / "broken.py").write_text("def score(prompts, responses, **columns):\n    return 1 / 0\n")
    with pytest.raises(RewardFunctionError, match=r"broken\.py:score raised ZeroDivisionError: division by zero"):
        compute_scores(load_reward_fn(f"{tmp_path / 'broken.py'}:score"), ["p"], ["r"])


def test_reward_worker_with_reward_model(worker):
    out = generated(worker)
    rw = RewardWorker({"reward_model": {"path": worker.config.model.path}}, tokenizer_path=worker.config.model.path)
    rw.init_model()
    scored = rw.compute_rm_score(out)
    assert scored.batch["token_level_scores"].shape == (len(out), 5)
    assert np.isfinite(scored.non_tensor_batch["score"].astype(float)).all()


def test_critic_values_and_update(worker):
    out = generated(worker, n_prompts=8)
    critic = CriticWorker(
        {"ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 8, "optim": {"lr": 1e-3}},
        model={"path": worker.config.model.path},
    )
    critic.init_model()
    values = critic.compute_values(out).batch["values"]
    assert values.shape == (16, 5) and (values[out.batch["response_mask"] == 0] == 0).all()
    out.batch["values"] = values
    out.batch["returns"] = torch.ones(16, 5) * out.batch["response_mask"]
    losses = [critic.update_critic(out).meta_info["metrics"]["critic/vf_loss"] for _ in range(5)]
    assert losses[-1] < losses[0]
    after = critic.compute_values(out).batch["values"]  # no dropout left on by the update's train()
    assert torch.equal(critic.compute_values(out).batch["values"], after)


def test_advantage_step_and_metrics(worker):
    out = generated(worker, n_prompts=4, n=4)
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0] * 4)
    from rlworkers.algorithms.core_algos import compute_token_level_scores

    out.batch["token_level_scores"] = compute_token_level_scores(scores, out.batch["response_mask"])
    out, _ = compute_advantage(out, "grpo")
    adv = (out.batch["advantages"] * out.batch["response_mask"]).sum(-1) / out.batch["response_mask"].sum(-1)
    assert adv[0] > 0 and (adv[1:4] < 0).all()  # the one right answer of its group is pushed up
    metrics = compute_data_metrics(out)
    assert metrics["critic/score/mean"] == pytest.approx(0.25)
    assert metrics["response_length/mean"] >= 1 and metrics["response_length/mean"] <= 5


def test_config_rejects_bad_values(tiny_path):
    with pytest.raises(ValueError, match="ppo_micro_batch_size_per_gpu"):
        worker_config(tiny_path, actor={"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 8})
    with pytest.raises(ValueError, match="nccl"):
        WorkerConfig.model_validate({"backend": "nccl"})
    with pytest.raises(ValueError, match="lr"):
        WorkerConfig.model_validate({"actor": {"optim": {"lr": -1}}})


def test_pure_bf16_weights_lose_small_updates_that_mixed_precision_keeps(tiny_path):
    """The reason configs/gpu.yaml trains float32 weights under bf16 autocast: at lr 1e-6 (its lr) AdamW's steps
    are below bf16's resolution, so a bf16 model barely moves while the mixed-precision one moves every weight and
    raises the reinforced responses' likelihood (bench/gpu_check.py's probe; the H200's figures in docs)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from bench.gpu_check import learning_probe

    results = {}
    for name, model, optim in (
        ("mixed", {"autocast": "bfloat16"}, {}),
        ("bf16", {"dtype": "bfloat16"}, {"low_precision_weights": True}),
    ):
        config = worker_config(
            tiny_path,
            model=model,
            actor={"ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 8, "optim": {"lr": 1e-6, **optim}},
        )
        w = ActorRolloutRefWorker(config)
        w.init_model()
        batch = generated(w, n_prompts=8, n=2)
        batch.union(w.compute_log_prob(batch))
        results[name] = learning_probe(w, batch, steps=3)
    assert results["mixed"][0] > 0.99 and results["mixed"][1] > 0, results
    assert results["bf16"][0] < 0.1, results


def test_critic_applies_autocast_and_gradient_checkpointing(worker):
    out = generated(worker, n_prompts=8)
    critic = CriticWorker(
        {"ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 8, "optim": {"lr": 1e-3}},
        model={"path": worker.config.model.path, "autocast": "bfloat16", "gradient_checkpointing": True},
    )
    critic.init_model()
    assert critic.model.is_gradient_checkpointing
    head_dtypes = []
    critic.model.score.register_forward_hook(lambda module, args, output: head_dtypes.append(output.dtype))
    values = critic.compute_values(out).batch["values"]
    assert set(head_dtypes) == {torch.bfloat16} and values.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in critic.model.parameters())
    out.batch["values"] = values
    out.batch["returns"] = torch.ones(16, 5) * out.batch["response_mask"]
    losses = [critic.update_critic(out).meta_info["metrics"]["critic/vf_loss"] for _ in range(5)]
    assert losses[-1] < losses[0]
    after = critic.compute_values(out).batch["values"]  # no dropout left on by the update's train()
    assert torch.equal(critic.compute_values(out).batch["values"], after)
