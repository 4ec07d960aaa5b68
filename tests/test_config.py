"""Run configuration: presets, overrides, validation messages, flattening for MLflow, and which rows a run uses."""

from __future__ import annotations

import json

import pytest

from flows.config import ConfigError, apply_overrides, flatten, load_config, resolve_preset
from flows.controller.rows import RunInputs, dataset_rows
from flows.controller.runtime import Run


def test_preset_and_overrides():
    config = load_config("demo", ["trainer.total_steps=7", "actor.optim.lr=2e-4", "data.train_files=[a.jsonl]"])
    assert config.trainer.total_steps == 7 and config.actor.optim.lr == 2e-4
    assert config.data.train_files == ["a.jsonl"]
    assert config.rollout.n == 8  # from the preset
    with pytest.raises(FileNotFoundError, match="presets"):
        resolve_preset("no-such-preset")
    with pytest.raises(ValueError, match="key.path=value"):
        apply_overrides({}, ["trainer.total_steps"])


def test_errors_name_the_field():
    with pytest.raises(ConfigError) as info:
        load_config("demo", ["rollout.top_p=2", "trainer.n_workers=0"])
    assert "rollout.top_p" in str(info.value) and "trainer.n_workers" in str(info.value)
    with pytest.raises(ConfigError, match="rollout.stop is supported by the vllm backend only"):
        load_config("demo", ["rollout.stop=[x]"])
    with pytest.raises(ConfigError, match="fault_injection"):
        load_config("demo", ["trainer.fault_injection=boom"])
    # Ray Client addresses are taken as they are (tests/test_cluster.py runs a lineage through one)
    assert load_config("demo", ["trainer.ray_address=ray://head:10001"]).trainer.ray_address == "ray://head:10001"


def test_flatten_gives_dotted_params():
    flat = flatten(load_config("demo"))
    assert flat["actor.optim.lr"] == 1e-4 and flat["rollout.n"] == 8
    assert not any(isinstance(v, dict) for v in flat.values())


def test_validation_rows_fall_back_to_training_files(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(12)))
    config = load_config(
        "demo",
        [
            f"data.train_files=[{path}]",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=32",
            "actor.ppo_micro_batch_size_per_gpu=16",
        ],
    )
    assert [r["prompt"] for r in dataset_rows(config, "validation")] == [f"{i}+1=" for i in range(12)]
    builtin = load_config("demo", [f"trainer.runs_dir={tmp_path}"])
    train, val = dataset_rows(builtin, "train"), dataset_rows(builtin, "validation")
    assert len(train) == 2000 and len(val) == 200
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}


def test_step_blocks_end_where_validation_or_a_checkpoint_is_due_and_rewind():
    config = load_config(
        "demo-sft", ["trainer.total_steps=11", "trainer.test_freq=5", "trainer.save_freq=3", "trainer.steps_per_task=4"]
    )
    inputs = RunInputs(train_rows=[], val_rows=[], eval_sets=[], template_kwargs={})
    run = Run(config=config, algorithm="sft", root="", tokenizer=None, loader=None, inputs=inputs, tracker=None)
    assert list(run.step_blocks(4)) == [[1, 2, 3], [4, 5], [6], [7, 8, 9], [10], [11]]
    assert list(run.steps) == list(range(1, 12))
    blocks = run.step_blocks(4)
    assert next(blocks) == [1, 2, 3] and next(blocks) == [4, 5]
    run.redo_from = 4  # what recovery does after restoring the step-3 checkpoint
    assert list(blocks) == [[4, 5], [6], [7, 8, 9], [10], [11]]


def test_pure_low_precision_weights_are_refused_unless_asked_for():
    mixed = load_config("gpu")
    assert (mixed.model.dtype, mixed.model.autocast) == ("float32", "bfloat16")  # the GPU preset: mixed precision
    with pytest.raises(ConfigError, match="model.dtype=float32 with model.autocast=bfloat16"):
        load_config("demo", ["model.dtype=bfloat16"])
    assert load_config("demo", ["model.dtype=bfloat16", "actor.optim.low_precision_weights=true"])
    assert load_config("demo", ["model.dtype=bfloat16", "actor.lora.rank=4"])  # the frozen base may be bf16
    # the critic trains too (ppo): its own model section, or the actor's
    with pytest.raises(ConfigError, match="critic.model.dtype=bfloat16 trains the critic's weights"):
        load_config("demo", ["algorithm.adv_estimator=gae", "critic.model={path: tiny, dtype: bfloat16}"])
    with pytest.raises(ConfigError, match="critic.optim.low_precision_weights=true"):
        load_config(
            "demo",
            ["algorithm.adv_estimator=gae", "model.dtype=bfloat16", "actor.optim.low_precision_weights=true"],
        )


def test_strings_with_a_fixed_set_of_values_are_choices():
    with pytest.raises(ConfigError) as info:
        load_config("demo", ["algorithm.kl_penalty=full", "actor.kl_loss_type=k4", "critic.loss_agg_mode=token-sum"])
    message = str(info.value)
    assert "algorithm.kl_penalty: Input should be 'kl'" in message and "'low_var_kl+'" in message
    assert "actor.kl_loss_type" in message and "critic.loss_agg_mode: Input should be 'token-mean'" in message
    assert load_config("demo", ["algorithm.kl_penalty=k3+", "actor.kl_loss_type=mse"]).actor.kl_loss_type == "mse"


def test_verl_names_point_to_rlflows():
    with pytest.raises(ConfigError) as info:
        load_config(
            "demo",
            [
                "data.max_response_length=16",
                "trainer.total_training_steps=5",
                "actor_rollout_ref.actor.ppo_epochs=2",
                "trainer.no_such_key=1",
            ],
        )
    message = str(info.value)
    assert "data.max_response_length: this is a verl name; use rollout.response_length" in message
    assert "trainer.total_training_steps: this is a verl name; use trainer.total_steps" in message
    assert "actor_rollout_ref.actor.ppo_epochs: this is a verl name; use actor.ppo_epochs" in message
    assert "trainer.no_such_key: Extra inputs are not permitted" in message


def test_verl_fsdp_names_point_to_rlflows():
    with pytest.raises(ConfigError) as info:
        load_config(
            "demo",
            [
                "actor.strategy=fsdp",
                "actor.fsdp_config.param_offload=true",
                "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
                "critic.model.fsdp_config.optimizer_offload=true",
            ],
        )
    message = str(info.value)
    assert "actor.strategy: this is a verl value; use fsdp2" in message
    assert "actor.fsdp_config.param_offload: this is a verl name; use actor.fsdp_config.offload_policy" in message
    assert "actor_rollout_ref.actor.fsdp_config.model_dtype: this is a verl name; use model.autocast" in message
    assert "critic.model.fsdp_config.optimizer_offload: this is a verl name; use critic.fsdp_config" in message
    assert "FSDP2 is planned" not in message
    assert load_config("demo", ["actor.strategy=fsdp2", "actor.fsdp_config.offload_policy=true"]).actor.strategy == (
        "fsdp2"
    )


def test_lr_schedule_spans_the_run_unless_set():
    import torch

    from rlworkers.workers.common import build_lr_scheduler

    config = load_config("demo", ["trainer.total_steps=24", "actor.optim.lr_scheduler=cosine"])
    optim = config.worker_config().actor.optim
    assert optim.total_training_steps == 24 and config.critic_config().optim.total_training_steps == 24
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([parameter], lr=optim.lr)
    scheduler = build_lr_scheduler(optimizer, optim)
    lrs = []
    for _ in range(24):  # one scheduler step per update call, one update call per training step
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(optim.lr) and lrs[12] == pytest.approx(optim.lr / 2, rel=0.05)
    assert scheduler.get_last_lr()[0] == pytest.approx(0, abs=1e-12)  # decayed to min_lr_ratio at the run's end
    set_explicitly = load_config("demo", ["trainer.total_steps=24", "actor.optim.total_training_steps=100"])
    assert set_explicitly.worker_config().actor.optim.total_training_steps == 100
    with pytest.raises(ValueError, match="optim.total_training_steps, which is unset"):
        build_lr_scheduler(optimizer, config.actor.optim)  # a worker built without a run's horizon


@pytest.mark.parametrize(
    "algorithm, overrides, message",
    [
        ("grpo", ["rollout.n=1", "actor.ppo_mini_batch_size=32"], "with rollout.n=1 a group has one response"),
        ("grpo", ["algorithm.adv_estimator=rloo", "rollout.n=1", "actor.ppo_mini_batch_size=32"], "rollout.n >= 2"),
        ("grpo", ["algorithm.adv_estimator=gae"], "run the ppo flow"),
        ("ppo", [], "set algorithm.adv_estimator=gae"),
        ("online_dpo", ["rollout.n=1", "actor.ppo_mini_batch_size=32"], "set rollout.n >= 2"),
        ("grpo", ["trainer.steps_per_task=2"], "applies to SFT only"),
    ],
)
def test_what_a_flow_needs_is_checked_before_anything_starts(algorithm, overrides, message):
    config = load_config("demo", overrides + ["actor.ppo_micro_batch_size_per_gpu=16"])
    with pytest.raises(ConfigError, match=message):
        config.check_algorithm(algorithm)


def test_a_single_sample_without_groups_is_fine():
    config = load_config(
        "demo",
        [
            "rollout.n=1",
            "algorithm.adv_estimator=reinforce_plus_plus",
            "actor.ppo_mini_batch_size=32",
            "actor.ppo_micro_batch_size_per_gpu=16",
        ],
    )
    config.check_algorithm("grpo")
    load_config("demo", ["algorithm.adv_estimator=gae"]).check_algorithm("ppo")


def test_the_gpu_async_preset_splits_one_node_into_a_training_and_a_rollout_pool():
    """configs/gpu-async.yaml: 4 GPUs train, 4 generate with vLLM one step off, the drift weighed by truncated
    importance weights (a stale batch without a correction would be refused); its resource_pool names the two
    pools, so the 8 GPUs of the node are their sum."""
    config = load_config("gpu-async")
    assert (config.trainer.device, config.rollout.name) == ("cuda", "vllm")
    assert config.trainer.n_workers + config.rollout.n_workers == 8 and config.rollout.n_workers == 4
    assert config.processes_on_nodes("actor") == config.processes_on_nodes("rollout") == [4]
    assert config.trainer.colocate_ref
    assert config.async_training.staleness == 1
    assert config.algorithm.rollout_correction.rollout_is == "token"
    with pytest.raises(ConfigError, match="async_training.staleness=1 trains on batches sampled by an older policy"):
        load_config("gpu-async", ["algorithm.rollout_correction.rollout_is=null"])


POOLS = "resource_pool.spec={spec}", "resource_pool.mapping={mapping}"


def pools(spec: str, mapping: str, *extra: str):
    return load_config("demo", [POOLS[0].format(spec=spec), POOLS[1].format(mapping=mapping), *extra])


def test_resource_pools_set_each_roles_processes_and_what_the_shorter_settings_say():
    """resource_pool (verl's resource_pool_spec and mapping): the actor's pool is trainer.n_workers, a rollout or a
    reference on a pool of its own is its group (rollout.n_workers, trainer.colocate_ref=false), on the actor's pool
    the actor's processes; a pool of several nodes keeps its shape; roles not mapped keep their sections' settings."""
    config = pools(
        "{train: [1, 1], gen: [1], ref: [2]}", "{actor: train, rollout: gen, ref: ref}",
        "async_training.staleness=1", "algorithm.rollout_correction.bypass_mode=true",
    )  # fmt: skip
    assert (config.trainer.n_workers, config.rollout.n_workers, config.trainer.colocate_ref) == (2, 1, False)
    assert [config.processes_on_nodes(role) for role in ("actor", "rollout", "ref")] == [[1, 1], [1], [2]]
    assert config.processes_on_nodes("critic") == [2] and config.processes_on_nodes("reward") == [0]  # not mapped
    shared = pools("{train: [2], score: [1]}", "{actor: train, rollout: train, ref: train, reward: score}")
    assert (shared.rollout.n_workers, shared.trainer.colocate_ref, shared.reward.worker_count) == (0, True, 1)
    critic = pools("{train: [2], values: [1, 1]}", "{actor: train, critic: values}")
    assert critic.processes_on_nodes("critic") == [1, 1]
    unset = load_config("demo", ["trainer.colocate_ref=false", "reward.num_workers=1"])  # the shorter settings
    assert [unset.processes_on_nodes(role) for role in ("actor", "ref", "reward", "rollout")] == [[2], [1], [1], [0]]


@pytest.mark.parametrize(
    ("spec", "mapping", "message"),
    [
        ("{train: [2]}", "{rollout: train}", "resource_pool.mapping.actor is missing"),
        ("{train: [2]}", "{actor: other}", "resource_pool.mapping names pools that resource_pool.spec lacks"),
        ("{train: [2], spare: [1]}", "{actor: train}", "resource_pool.spec has pools no role is mapped to"),
        ("{train: [0]}", "{actor: train}", r"resource_pool.spec.train=\[0\]: a pool is a list of processes per node"),
        ("{train: [2]}", "{actor: train, critic: train}", "resource_pool.mapping.critic: pool 'train' is also actor's"),
        ("{train: [2], gen: [1]}", "{actor: train, ref: gen, rollout: gen}", "ref and rollout share pool 'gen'"),
        ("{train: [2], values: [1]}", "{actor: train, critic: values}", "as many processes as the actor's"),
        ("{train: [1]}", "{actor: train}", r"trainer.n_workers=2 \(given, or the preset's\) disagrees"),
    ],
)
def test_resource_pools_that_cannot_run_are_refused_naming_the_field(spec, mapping, message):
    with pytest.raises(ConfigError, match=message):
        pools(spec, mapping)
