"""Run configuration: pydantic models (so Prefect deployments get parameter forms), YAML presets in
``flows/configs/`` (package data, so an installed rlflow has them; ``configs/`` at the repo root links there) and
``key=value`` overrides from the command line. Everything is validated before any worker starts; an error names the
field and what to change.

    config = load_config("configs/demo.yaml", ["trainer.total_steps=50", "actor.optim.lr=1e-4"])

Over 450 lines on purpose: one schema, every field a run takes with its description and check, read top to bottom
(the workers' own sections come from rlworkers/workers/config.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlworkers.workers.config import (
    ActorConfig,
    CriticConfig,
    KLEstimator,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    WorkerConfig,
)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
# model.path may name a model in MLflow: models:/<name>@<alias>, models:/<name>/<version>, runs:/<run id>/<path>
MODEL_REFERENCE = re.compile(r"^(models:/[^/@]+(@[^/]+|/\d+)|runs:/[0-9a-f]{32}/.+)$")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TaskConfig(_Frozen):
    """The built-in synthetic task, used when ``data.train_files`` is not set."""

    name: Literal["addition"] = "addition"
    num_train: int = Field(2000, gt=0)
    num_val: int = Field(200, gt=0)
    max_digits: int = Field(2, ge=1, le=6)
    prompt_format: Literal["plain", "chat", "gsm8k", "tool"] = Field(
        "plain",
        description="plain '12+34=' (the tiny model); chat 'What is 12 + 34? Reply with the number only.'; gsm8k: "
        "the answer after '####'; tool: asked to use the add tool (rollout.multi_turn), with demonstrations for SFT "
        "(the chat formats in verl's layout, for chat models)",
    )
    seed: int = 0


class DataConfig(_Frozen):
    """verl's ``data`` section where the names overlap: ``train_files``/``val_files`` (a path or a list),
    ``prompt_key``, ``max_prompt_length``, ``truncation``, ``apply_chat_template_kwargs``."""

    # a path or a list, as verl takes them (both in the JSON schema, so a deployment's form and `prefect deployment
    # run --params` accept either); always a list after validation
    train_files: str | list[str] | None = Field(
        None, description="parquet/jsonl file or list of files; unset = the built-in task"
    )
    val_files: str | list[str] | None = Field(None, description="file or list of files; unset = data.train_files")
    prompt_key: str = Field("prompt", description="a string, or chat messages rendered with the chat template")
    answer_key: str = Field(
        "answer",
        description="ground-truth column; rows without it use 'ground_truth', then verl's reward_model.ground_truth",
    )
    response_key: str = Field("response", description="SFT target column")
    messages_key: str = Field("messages", description="SFT: a column of whole conversations (loss on assistant turns)")
    apply_chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra arguments of tokenizer.apply_chat_template (e.g. enable_thinking)"
    )
    train_batch_size: int = Field(32, gt=0, description="prompts per step")
    val_batch_size: int | None = Field(None, gt=0, description="validation prompts (unset = all)")
    max_prompt_length: int = Field(64, gt=0, description="in tokens, chat template included")
    truncation: Literal["error", "left", "right"] = Field(
        "error", description="a longer prompt: refuse the dataset (error), keep its end (left) or its start (right)"
    )
    shuffle: bool = True
    task: TaskConfig = TaskConfig()

    @field_validator("train_files", "val_files")
    @classmethod
    def _one_or_many(cls, value):
        return [value] if isinstance(value, str) else value


class KLControlConfig(_Frozen):
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0)
    target_kl: float = Field(0.1, gt=0)
    horizon: int = Field(10000, gt=0)


class RolloutCorrectionConfig(_Frozen):
    """verl's ``algorithm.rollout_correction`` (rlworkers/algorithms/rollout_correction.py): the rollout's policy
    against the old policy's, corrected by truncated importance weights and/or rejection (decoupled mode), or the
    rollout's log-probs taken as the old policy's (bypass mode)."""

    bypass_mode: bool = Field(
        False,
        description="use the rollout's log-probs as the old policy's (no compute_log_prob stage, one forward pass "
        "less per step): exact when the rollout samples with the actor's own weights in float32 (rollout.name=hf); "
        "with vLLM, bf16 or async_training.staleness the PPO ratio then also corrects the rollout/actor mismatch, "
        "as in verl",
    )
    rollout_is: Literal["token", "sequence"] | None = Field(
        None,
        description="importance weights min(pi_old / pi_rollout, rollout_is_threshold) on each token's policy loss: "
        "per token (biased, low variance) or per sequence (the product of its tokens' ratios)",
    )
    rollout_is_threshold: float = Field(2.0, gt=0, description="the importance weights' upper bound (truncated IS)")
    rollout_is_batch_normalize: bool = Field(False, description="scale the weights to a mean of 1 over the batch")
    rollout_rs: str | None = Field(
        None,
        description="rejection: mask out tokens or sequences whose divergence from the old policy is out of bounds; "
        "token_k1..k3, seq_sum_k1..k3, seq_mean_k1..k3, seq_max_k2/k3, several comma separated",
    )
    rollout_rs_threshold: str | float | None = Field(
        None, description="rollout_rs's bounds: lower_upper ratios for k1 (e.g. 0.5_2.0), an upper bound for k2/k3"
    )

    @model_validator(mode="after")
    def _check(self) -> RolloutCorrectionConfig:
        from rlworkers.algorithms.rollout_correction import parse_rejection

        if self.bypass_mode and (self.rollout_is or self.rollout_rs):
            raise ValueError(
                "algorithm.rollout_correction: rollout_is and rollout_rs weigh the rollout against the old policy the "
                "actor recomputes, which bypass_mode skips. Fix: bypass_mode=false, or leave rollout_is and "
                "rollout_rs unset"
            )
        if self.rollout_rs is not None:
            parse_rejection(self.rollout_rs, self.rollout_rs_threshold)  # names a bad option or threshold
        return self


class AlgorithmConfig(_Frozen):
    adv_estimator: Literal[
        "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo_passk"
    ] = "grpo"
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KLEstimator = "kl"
    kl_ctrl: KLControlConfig = KLControlConfig()
    dpo_beta: float = Field(0.1, gt=0, description="online DPO: strength of the reference anchor")
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()


class AsyncTrainingConfig(_Frozen):
    """Generation a bounded number of policy versions behind the update (verl's ``async_training``, SkyRL's
    ``max_staleness_steps``): the batches of the next ``staleness`` steps are generated before this step's update
    changes the weights, so each is trained on ``staleness`` versions after the policy that sampled it. Never more:
    no batch is dropped or regenerated for its age (every prompt is trained when the data loader hands it out, hard
    ones too), and none is generated across a due validation or checkpoint (a checkpoint holds no batch in flight,
    so a resume continues as a straight run would)."""

    staleness: int = Field(
        0,
        ge=0,
        description="policy versions a batch may be behind the update that trains on it: 0 = on-policy (each "
        "generation waits for the update before it), 1 = one-step-off, k = bounded",
    )
    allow_uncorrected: bool = Field(
        False,
        description="train stale batches with no algorithm.rollout_correction (bypass_mode, rollout_is or "
        "rollout_rs): their policy gradient is then biased by how far the policy that sampled and the one updated "
        "differ",
    )


Role = Literal["actor", "rollout", "ref", "critic", "reward"]


class ResourcePoolConfig(_Frozen):
    """Named pools of worker processes and the pool each role runs on (verl's ``resource_pool_spec`` and
    ``mapping``). A pool is its processes on each node: ``[4, 4]`` is two placement groups of 4 processes, each
    packed on one node (on two nodes when no node holds both, as verl's). The rollout and the reference on the
    actor's pool run in the actor's processes; on a pool of their own, in its processes. A critic and a reward model
    run in processes of their own, on a pool no other role uses. The pools set what the shorter settings say for one
    node (trainer.n_workers, rollout.n_workers, trainer.colocate_ref, reward.num_workers; a reference of several
    processes only so), and a role not mapped keeps its section's settings."""

    spec: dict[str, list[int]] = Field(
        default_factory=dict, description="pool name -> its processes on each node, e.g. {global_pool: [2]}"
    )
    mapping: dict[Role, str] = Field(
        default_factory=dict, description="role (actor, rollout, ref, critic, reward) -> pool name; actor required"
    )

    @model_validator(mode="after")
    def _check(self):
        if not self.spec and not self.mapping:
            return self
        for name, nodes in self.spec.items():
            if not nodes or any(not isinstance(n, int) or n < 1 for n in nodes):
                raise ValueError(
                    f"resource_pool.spec.{name}={nodes}: a pool is a list of processes per node, each >= 1 (e.g. [2])"
                )
        if "actor" not in self.mapping:
            raise ValueError("resource_pool.mapping.actor is missing: name the pool the actor trains on")
        unknown = {role: pool for role, pool in self.mapping.items() if pool not in self.spec}
        if unknown:
            raise ValueError(
                f"resource_pool.mapping names pools that resource_pool.spec lacks ({unknown}; it has "
                f"{sorted(self.spec)}): add them to resource_pool.spec"
            )
        unused = sorted(set(self.spec) - set(self.mapping.values()))
        if unused:
            raise ValueError(f"resource_pool.spec has pools no role is mapped to ({unused}): map a role or remove them")
        actor_pool = self.mapping["actor"]
        for role, pool in self.mapping.items():
            sharing = sorted(other for other, p in self.mapping.items() if p == pool and other != role)
            if role in ("critic", "reward") and sharing:
                raise ValueError(
                    f"resource_pool.mapping.{role}: pool '{pool}' is also {', '.join(sharing)}'s; a {role} runs in "
                    f"processes of its own (only the rollout and the reference share the actor's): map it to a pool "
                    f"of its own, e.g. resource_pool.spec.{role}_pool=[1]"
                )
            if pool != actor_pool and sharing:
                raise ValueError(
                    f"resource_pool.mapping: {role} and {', '.join(sharing)} share pool '{pool}', which is not the "
                    "actor's; roles share only the actor's processes: give each its own pool, or map it to the actor's"
                )
        critic, actors = self.mapping.get("critic"), sum(self.spec[actor_pool])
        if critic and sum(self.spec[critic]) != actors:
            raise ValueError(
                f"resource_pool.spec.{critic}={self.spec[critic]}: the critic trains data-parallel over the actor's "
                f"split of each batch, so its pool needs as many processes as the actor's ({actors})"
            )
        return self

    def settings(self) -> dict[tuple[str, str], Any]:
        """What the pools set of the shorter settings: ``{(section, field): value}``."""
        if not self.spec:
            return {}
        actor = self.mapping["actor"]
        own = {role: pool != actor for role, pool in self.mapping.items()}
        size = {role: sum(self.spec[pool]) for role, pool in self.mapping.items()}
        settings = {("trainer", "n_workers"): size["actor"]}
        if "rollout" in self.mapping:
            settings[("rollout", "n_workers")] = size["rollout"] if own["rollout"] else 0
        if "ref" in self.mapping:
            settings[("trainer", "colocate_ref")] = not own["ref"]
        if "reward" in self.mapping:
            settings[("reward", "num_workers")] = size["reward"]
        return settings


class TrainerConfig(_Frozen):
    project_name: str = Field("rlflow", description="MLflow experiment")
    run_name: str | None = Field(
        None,
        description="names the run folder and resume target; same name = same "
        "run. Unset: '<lineage>-<UTC time>' for a lineage, else the algorithm's name",
    )
    lineage: str | None = Field(
        None,
        description="train a lineage: each run starts from its champion model and "
        "continues its data, then registers its model and promotes it if validation held",
    )
    promotion_alias: str = Field("champion", description="registry alias of a lineage's current model")
    lineage_data: Literal["continue", "from_champion"] = Field(
        "continue",
        description="where a lineage's next run takes up the data: continue: after the rows of the last run that "
        "finished, promoted or not (a rejected run's rows are used up: the champion never trains on them); "
        "from_champion: after the rows of the run that trained the champion (a rejected run's rows come again)",
    )
    promotion: Literal["auto", "manual"] = Field(
        "auto",
        description="auto: the gate (eval.*) decides; manual: the flow run pauses after evaluation with an approve / "
        "reject form in the Prefect UI, the gate's comparison beside it",
    )
    approval_timeout_s: float = Field(
        24 * 3600.0, gt=0, description="trainer.promotion=manual: a run not approved within this long is rejected"
    )
    republish: bool = Field(False, description="publish an already complete run again instead of failing")
    max_crash_restarts: int = Field(3, ge=0, description="automatic restarts of a crashed flow run (deployments)")
    total_steps: int = Field(20, gt=0)
    save_freq: int = Field(10, description="checkpoint every N steps (and at the end); <= 0: only at the end")
    test_freq: int = Field(10, description="validate every N steps (and before the first and after the last)")
    stop_at_val_score: float | None = Field(
        None,
        description="end training at the first validation after step 0 (every test_freq steps: none before the "
        "last with test_freq <= 0) whose val/score/mean reaches this (Lightning's EarlyStopping stopping_threshold): "
        "that step is the run's last, its model the one published; null: train all total_steps",
    )
    steps_per_task: int = Field(
        1,
        ge=1,
        description="SFT only: training steps per sft_step task, one batch and one optimizer step each, every step "
        "logged (Keras's steps_per_execution): a task's orchestration shared by that many steps, for steps so "
        "short that it shows; a block of steps ends where validation or a checkpoint is due",
    )
    keep_last_checkpoints: int = Field(2, description="retention; <= 0 keeps all")
    runs_dir: str = Field("runs", description="local path or fsspec URL (s3://...) shared by driver and workers")
    resume: str = Field("auto", description="'auto' (newest valid checkpoint of run_name), 'never', or a path")
    n_workers: int = Field(2, gt=0, description="data-parallel actor workers (resource_pool: the actor's pool)")
    colocate_ref: bool = Field(
        True,
        description="the reference model lives in the actor's worker processes (verl's actor_rollout_ref): no "
        "reference group to start, its log-probs data-parallel; false: a one-worker reference group of its own",
    )
    device: Literal["cpu", "cuda"] = "cpu"
    ray_address: str | None = Field(
        None, description="existing Ray cluster: <head>:6379, or ray://<head>:10001 (Ray Client); unset = a local Ray"
    )
    ray_num_cpus: int | None = Field(
        None, gt=0, description="logical CPUs of a local Ray (placement slots); ignored with ray_address"
    )
    log_samples: int = Field(8, ge=0, description="sample generations logged per validation")
    log_model: bool = Field(True, description="log the final model to MLflow")
    register_model_name: str | None = Field(None, description="also register the final model under this name")
    max_restarts: int = Field(
        3,
        ge=0,
        description="worker faults (a worker died or hung) a run recovers from "
        "by restoring its newest checkpoint; one more ends it Failed",
    )
    stage_timeout_s: float = Field(600.0, gt=0, description="time limit of every worker-group call ...")
    stage_timeout_s_per_sample: float = Field(0.5, ge=0, description="... plus this per row of its batch")
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
        description="torch.distributed timeout: a dead peer ends a "
        "collective with an error after this long instead of hanging",
    )
    capacity_timeout_s: float = Field(
        600.0,
        ge=0,
        description="how long a restart waits for room to place "
        "workers again (a lost node coming back) before the run fails",
    )
    seed: int = 0

    @model_validator(mode="after")
    def _check(self):
        for name in ("run_name", "lineage"):
            value = getattr(self, name)
            if value is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", value):
                raise ValueError(f"trainer.{name} may only hold letters, digits, '_', '-' and '.'")
        if self.lineage and not self.log_model:
            raise ValueError("trainer.lineage publishes each run's model: set trainer.log_model=true")
        return self


class EvalSetConfig(_Frozen):
    """One held-out evaluation set: its rows, how each response is scored, how responses are decoded."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="names its metrics (eval/<name>/score/mean)")
    files: str | list[str] | None = Field(
        None, description="parquet/jsonl file or list; unset = the validation rows (data.val_files or the task's)"
    )
    scorer: str = Field(
        "auto",
        description="how a response scores, apart from the training reward: a registered rule, 'file.py:fn' or "
        "'package.module:fn' (reward.reward_fn's forms); auto = the rule for each row's data_source",
    )
    max_examples: int | None = Field(None, gt=0, description="the first N rows (unset = all)")
    decoding: Literal["greedy", "sampled"] = Field(
        "greedy", description="greedy: one deterministic response per example; sampled: `samples` drawn with `seed`"
    )
    samples: int = Field(1, ge=1, le=64, description="responses per example (decoding=sampled)")
    temperature: float | None = Field(None, gt=0, description="decoding=sampled (unset = rollout.temperature)")
    seed: int = Field(
        0,
        ge=0,
        description="decoding=sampled: the same seed draws the same responses; the draws never touch the training's "
        "random state",
    )
    metric: str = Field(
        "mean",
        pattern=r"^(mean|pass@[1-9][0-9]*)$",
        description="an example's score from its responses: mean, or pass@k (the chance that one of k responses "
        "scores 1, estimated without bias from `samples` >= k)",
    )

    @field_validator("files")
    @classmethod
    def _one_or_many(cls, value):
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_decoding(self):
        where = f"eval.sets[{self.name}]"
        if self.decoding == "greedy" and (self.samples > 1 or self.temperature is not None):
            raise ValueError(
                f"{where}: greedy decoding gives one deterministic response per example; set decoding: sampled "
                "for samples > 1 or a temperature"
            )
        if self.metric.startswith("pass@") and self.k > self.samples:
            raise ValueError(f"{where}.metric {self.metric} needs samples >= {self.k} (got {self.samples})")
        return self

    @property
    def k(self) -> int:
        return metric_k(self.metric)


def metric_k(metric: str) -> int:
    """pass@k's k (1 for the mean): an eval set's ``metric``."""
    return int(metric.removeprefix("pass@")) if metric.startswith("pass@") else 1


class EvalConfig(_Frozen):
    """Held-out evaluation of the start and the final model of every run, and the promotion gate that reads it.

    With no ``sets``, the one set is ``validation``: the validation rows scored by the training reward."""

    sets: list[EvalSetConfig] = Field(default_factory=list)
    primary: str | None = Field(None, description="the set promotion is decided on (unset = the first)")
    confidence: float = Field(
        0.95,
        gt=0.5,
        lt=1,
        description="of the paired bootstrap interval of the difference; every verdict of the gate (better, worse, "
        "non-inferior, the reward-hacking alarm) is one-sided at (1 - confidence) / 2, and better and worse also "
        "need the exact sign test (McNemar's for 0/1 scores) at that level",
    )
    promote_if: Literal["better", "non_inferior"] = Field(
        "better",
        description="better: the whole interval of (candidate - champion) above 0 and the exact sign test "
        "significant; non_inferior: the interval above -margin",
    )
    margin: float = Field(
        0.02,
        ge=0,
        description="non-inferiority margin: against the lineage's best version always (when it scored higher than "
        "the champion, the interval must lie above -margin), against the champion with promote_if=non_inferior",
    )
    hacking_threshold: float = Field(
        0.02,
        ge=0,
        description="reward-hacking alarm: the training reward rose while the primary eval score fell from the start "
        "model's significantly (the gate's paired test, one-sided at (1 - confidence) / 2) and by more than this "
        "(the version is rejected)",
    )

    @model_validator(mode="after")
    def _check(self):
        names = [s.name for s in self.sets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.sets: two sets share a name ({names}); give each its own")
        if self.primary is not None and self.primary not in (names or ["validation"]):
            raise ValueError(f"eval.primary {self.primary!r} is not a set's name; the sets: {names or ['validation']}")
        return self

    @property
    def primary_set(self) -> str:
        return self.primary or (self.sets[0].name if self.sets else "validation")


class CustomRewardFunctionConfig(_Frozen):
    """verl's ``custom_reward_function``: ``compute_score`` (or ``name``) from the file at ``path``, with verl's
    signature ``(data_source, solution_str, ground_truth, extra_info=None)`` or rlflow's batch one. It sets
    ``reward.reward_fn`` to ``<path>:<name>`` (a relative path is taken from the directory the config is read in)."""

    path: str | None = None
    name: str = "compute_score"


class RLConfig(_Frozen):
    """One training run: model, data, algorithm, workers, trainer."""

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    actor: ActorConfig = ActorConfig()
    rollout: RolloutConfig = RolloutConfig()
    critic: CriticConfig = CriticConfig()
    reward: RewardConfig = RewardConfig()
    custom_reward_function: CustomRewardFunctionConfig = CustomRewardFunctionConfig()
    eval: EvalConfig = EvalConfig()
    async_training: AsyncTrainingConfig = AsyncTrainingConfig()
    resource_pool: ResourcePoolConfig = ResourcePoolConfig()
    trainer: TrainerConfig = TrainerConfig()

    @model_validator(mode="before")
    @classmethod
    def _replaced_fields(cls, data):
        trainer = data.get("trainer") if isinstance(data, dict) else None
        if isinstance(trainer, dict) and "promotion_tolerance" in trainer:
            raise ValueError(
                "trainer.promotion_tolerance was replaced by the paired gate: eval.margin (a non-inferiority margin) "
                "with eval.promote_if=non_inferior; remove trainer.promotion_tolerance"
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def _pool_settings(cls, data):
        """resource_pool sets trainer.n_workers, rollout.n_workers, trainer.colocate_ref and reward.num_workers for
        the roles it maps; one of them given otherwise is refused rather than silently replaced."""
        pools = data.get("resource_pool") if isinstance(data, dict) else None
        if not pools:
            return data
        try:
            settings = ResourcePoolConfig.model_validate(pools).settings()
        except ValidationError:
            return data  # the field's own validation names the problem
        data = dict(data)
        for (section, name), value in settings.items():
            given = data.get(section) or {}
            given = given.model_dump() if isinstance(given, BaseModel) else dict(given)
            if given.get(name) is not None and given[name] != value:
                raise ValueError(
                    f"{section}.{name}={given[name]} (given, or the preset's) disagrees with resource_pool, which "
                    f"makes it {value}: set {section}.{name}={value} too, or change the pools"
                )
            data[section] = {**given, name: value}
        return data

    @model_validator(mode="before")
    @classmethod
    def _custom_reward_function(cls, data):
        custom = data.get("custom_reward_function") if isinstance(data, dict) else None
        if not isinstance(custom, dict) or not custom.get("path"):
            return data
        path = custom["path"] if "://" in custom["path"] else os.path.abspath(os.path.expanduser(custom["path"]))
        spec = f"{path}:{custom.get('name') or 'compute_score'}"
        reward = data.get("reward") or {}
        reward = reward.model_dump() if isinstance(reward, BaseModel) else dict(reward)
        if reward.get("reward_fn") not in (None, "auto", spec):
            raise ValueError(
                f"custom_reward_function.path ({custom['path']}) and reward.reward_fn ({reward['reward_fn']}) both "
                "name a reward function; keep one of them"
            )
        return {**data, "custom_reward_function": {**custom, "path": path}, "reward": {**reward, "reward_fn": spec}}

    @model_validator(mode="after")
    def _check_model_reference(self):
        path = self.model.path
        if path.startswith(("models:", "runs:")) and not MODEL_REFERENCE.match(path):
            raise ValueError(
                f"model.path {path!r} is not an MLflow model reference: use models:/<name>@<alias>, "
                "models:/<name>/<version> or runs:/<run id>/<path>"
            )
        return self

    @model_validator(mode="after")
    def _check_batches(self):
        rows = self.data.train_batch_size * self.rollout.n
        n = self.trainer.n_workers
        for name, value in (
            ("actor.ppo_mini_batch_size", self.actor.ppo_mini_batch_size),
            ("critic.ppo_mini_batch_size", self.critic.ppo_mini_batch_size),
        ):
            if value % n:
                raise ValueError(f"{name} ({value}) must be divisible by trainer.n_workers ({n})")
        if rows % self.actor.ppo_mini_batch_size:
            raise ValueError(
                f"data.train_batch_size x rollout.n ({rows}) must be a multiple of actor.ppo_mini_batch_size "
                f"({self.actor.ppo_mini_batch_size})"
            )
        if self.actor.ppo_micro_batch_size_per_gpu > self.actor.ppo_mini_batch_size // n:
            raise ValueError(
                f"actor.ppo_micro_batch_size_per_gpu ({self.actor.ppo_micro_batch_size_per_gpu}) exceeds the "
                f"per-worker mini-batch ({self.actor.ppo_mini_batch_size // n}); lower it"
            )
        return self

    @model_validator(mode="after")
    def _check_staleness(self):
        """A stale batch is trained with a correction for the policy that sampled it, or without on purpose."""
        staleness, correction = self.async_training.staleness, self.algorithm.rollout_correction
        corrected = correction.bypass_mode or correction.rollout_is or correction.rollout_rs
        if staleness and not (corrected or self.async_training.allow_uncorrected):
            raise ValueError(
                f"async_training.staleness={staleness} trains on batches sampled by an older policy with no "
                "correction for it: the old log-probs are recomputed by the policy of now, and nothing weighs the "
                "policy that sampled, so the policy gradient is biased by how far the two differ. Fix: "
                "algorithm.rollout_correction.rollout_is=token (truncated importance weights) and/or rollout_rs, or "
                "bypass_mode=true (the PPO ratio against the sampling policy, verl's one-step-off default), or "
                "async_training.allow_uncorrected=true to train so anyway"
            )
        return self

    @model_validator(mode="after")
    def _check_weights_precision(self):
        """AdamW on bf16/fp16 weights loses every step below the dtype's resolution: refused unless asked for."""
        trained = [("actor", self.model, self.actor.optim)] if not self.actor.lora.enabled else []
        if self.algorithm.adv_estimator == "gae":
            trained.append(("critic", self.critic.model or self.model, self.critic.optim))
        for role, model, optim in trained:
            if model.dtype != "float32" and not optim.low_precision_weights:
                where = "critic.model.dtype" if role == "critic" and self.critic.model else "model.dtype"
                raise ValueError(
                    f"{where}={model.dtype} trains the {role}'s weights in {model.dtype} with no float32 master copy: "
                    f"AdamW steps below {model.dtype}'s resolution (~1/256 of a weight for bf16) are lost, and small "
                    f"learning rates barely move the model. Fix: {where}=float32 with "
                    f"{where.replace('dtype', 'autocast')}={model.dtype} (mixed precision: {model.dtype} compute, "
                    f"float32 weights and optimizer state), or set {role}.optim.low_precision_weights=true to train "
                    "this way anyway"
                )
        return self

    def processes_on_nodes(self, role: Role) -> list[int]:
        """The worker processes of ``role``'s group on each node: its pool's (``resource_pool``), else one node's
        trainer.n_workers (actor, critic), rollout.n_workers, one reference, or the reward's workers."""
        pools = self.resource_pool
        if role in pools.mapping:
            return list(pools.spec[pools.mapping[role]])
        n = self.trainer.n_workers
        return [{"actor": n, "critic": n, "rollout": self.rollout.n_workers, "ref": 1,
                 "reward": self.reward.worker_count}[role]]  # fmt: skip

    def check_algorithm(self, algorithm: str) -> None:
        """What a flow needs of the config beyond its fields, checked before anything starts (``start_run``)."""
        problems = []
        group_estimators = ("grpo", "rloo", "grpo_passk", "reinforce_plus_plus_baseline")
        if algorithm != "sft" and self.trainer.steps_per_task != 1:
            problems.append(
                f"trainer.steps_per_task={self.trainer.steps_per_task} applies to SFT only: {algorithm} runs each "
                "stage of a step as a task of its own; set it to 1"
            )
        correction = self.algorithm.rollout_correction
        if algorithm in ("sft", "online_dpo") and (correction.rollout_is or correction.rollout_rs):
            problems.append(
                f"algorithm.rollout_correction.rollout_is / rollout_rs weigh a policy-gradient update, which the "
                f"{algorithm} flow has none of: unset them, or run the grpo or ppo flow"
            )
        if algorithm in ("sft", "online_dpo") and self.rollout.n_workers:
            problems.append(
                f"rollout.n_workers={self.rollout.n_workers} gives the training generations a pool of their own, "
                f"which the {algorithm} flow does not have yet: set it to 0, or run the grpo or ppo flow"
            )
        if algorithm in ("sft", "online_dpo") and self.async_training.staleness:
            problems.append(
                f"async_training.staleness={self.async_training.staleness} lets generation run ahead of a "
                f"policy-gradient update, which the {algorithm} flow has none of: set it to 0, or run the grpo or "
                "ppo flow"
            )
        if algorithm == "grpo" and self.algorithm.adv_estimator == "gae":
            problems.append(
                "algorithm.adv_estimator=gae needs a critic, which the grpo flow has none of: run the ppo flow "
                "(rlflow train ppo ...), or choose grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline or "
                "grpo_passk"
            )
        if algorithm == "ppo" and self.algorithm.adv_estimator != "gae":
            problems.append(
                f"the ppo flow trains a critic for GAE: set algorithm.adv_estimator=gae (for "
                f"{self.algorithm.adv_estimator}, run the grpo flow)"
            )
        if algorithm == "grpo" and self.algorithm.adv_estimator in group_estimators and self.rollout.n < 2:
            problems.append(
                f"algorithm.adv_estimator={self.algorithm.adv_estimator} compares each response with the others of "
                f"its prompt; with rollout.n={self.rollout.n} a group has one response and its advantage is 0 or the "
                "raw score: set rollout.n >= 2 (or adv_estimator=reinforce_plus_plus, which needs no group)"
            )
        if algorithm == "online_dpo" and self.rollout.n < 2:
            problems.append("online DPO pairs responses of the same prompt: set rollout.n >= 2")
        if problems:
            raise ConfigError(f"invalid config for {algorithm}:\n" + "\n".join(f"  {p}" for p in problems))

    def worker_config(self) -> WorkerConfig:
        actor = self.actor.model_copy(update={"optim": self._with_horizon(self.actor.optim)})
        return WorkerConfig(
            model=self.model,
            actor=actor,
            rollout=self.rollout,
            device=self.trainer.device,
            seed=self.trainer.seed,
            collective_timeout_s=self.trainer.collective_timeout_s,
        )

    def critic_config(self) -> CriticConfig:
        return self.critic.model_copy(update={"optim": self._with_horizon(self.critic.optim)})

    def _with_horizon(self, optim: OptimConfig) -> OptimConfig:
        """The LR schedule's horizon: ``total_training_steps`` if set, else the run's steps (one update a step)."""
        steps = optim.total_training_steps or self.trainer.total_steps
        return optim.model_copy(update={"total_training_steps": steps})


# ------------------------------------------------------------------------------------------------ loading
def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like key.path=value (e.g. trainer.total_steps=50)")
    key, raw = item.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        path, value = _parse_override(item)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {'.'.join(path[:-1])} is not a section")
        node[path[-1]] = value
    return data


def resolve_preset(path_or_name: str) -> Path:
    """A YAML path, or the name of a preset in flows/configs/ ('demo' -> flows/configs/demo.yaml)."""
    candidate = Path(path_or_name)
    if candidate.is_file():
        return candidate
    preset = CONFIG_DIR / f"{path_or_name.removesuffix('.yaml')}.yaml"
    if preset.is_file():
        return preset
    available = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise FileNotFoundError(f"config {path_or_name!r} not found; give a YAML path or one of the presets {available}")


def load_config(path_or_name: str | None = None, overrides: list[str] | None = None) -> RLConfig:
    """Preset (or defaults) + overrides, validated. Raises ``ConfigError`` naming the field."""
    data: dict = {}
    if path_or_name:
        with open(resolve_preset(path_or_name)) as f:
            data = yaml.safe_load(f) or {}
    apply_overrides(data, list(overrides or []))
    return validate_config(data)


class ConfigError(ValueError):
    """Invalid configuration; the message lists each bad field as a dotted path."""


# verl's names (ppo_trainer.yaml) for what rlflow names otherwise, or does not have: the error says which
VERL_NAMES = {
    "data.max_response_length": "rollout.response_length",
    "data.val_max_samples": "data.val_batch_size",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.total_epochs": "trainer.total_steps (rlflow counts steps, not epochs)",
    "trainer.experiment_name": "trainer.run_name",
    "trainer.default_local_dir": "trainer.runs_dir",
    "trainer.n_gpus_per_node": "trainer.n_workers (with trainer.device=cuda)",
    "trainer.nnodes": "trainer.ray_address (a Ray cluster's nodes) with trainer.n_workers",
    "trainer.logger": "nothing: every run is tracked in MLflow (MLFLOW_TRACKING_URI)",
    "trainer.val_before_train": "trainer.test_freq (validation runs before the first step and after the last)",
    "actor.ppo_micro_batch_size": "actor.ppo_micro_batch_size_per_gpu",
    "actor.use_dynamic_bsz": "nothing yet: micro-batches have a fixed size (actor.ppo_micro_batch_size_per_gpu)",
    "actor.optim.warmup_style": "actor.optim.lr_scheduler",
    "actor.optim.lr_warmup_steps_ratio": "actor.optim.lr_warmup_steps",
    "rollout.log_prob_micro_batch_size": "rollout.log_prob_micro_batch_size_per_gpu",
    "rollout.tensor_model_parallel_size": "nothing: each rollout worker holds the whole model",
    "model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "reward_model.enable": "reward.reward_model (a model section; unset = rule rewards)",
    "reward_model.path": "reward.reward_model.path",
    "reward_model.reward_manager": "reward.reward_fn",
    "critic.model.fsdp_config": "critic.fsdp_config",
}
# verl's fsdp_config keys rlflow has under another name, for the actor and the critic
for _role in ("actor", "critic"):
    _offload = (
        f"{_role}.fsdp_config.offload_policy (FSDP2's CPUOffloadPolicy: parameters, gradients and AdamW's state "
        "stay in CPU memory, the optimizer step runs there)"
    )
    VERL_NAMES |= {
        f"{_role}.fsdp_config.param_offload": _offload,
        f"{_role}.fsdp_config.optimizer_offload": _offload,
        f"{_role}.fsdp_config.model_dtype": "model.autocast (weights and AdamW's state stay float32; forward and "
        "backward compute in the autocast dtype)",
        f"{_role}.fsdp_config.dtype": "model.autocast (the compute dtype; gradients are reduced in float32)",
        f"{_role}.fsdp_config.mixed_precision": "model.autocast (bf16 compute, float32 reduce and master weights)",
        f"{_role}.fsdp_config.fsdp_size": "nothing: fsdp2 shards over all trainer.n_workers",
    }
# verl's values that rlflow spells otherwise
VERL_VALUES = {("strategy", "fsdp"): "fsdp2 (torch's fully_shard; verl's FSDP1 has no counterpart in rlflow)"}


def verl_name_hint(field: str) -> str | None:
    """What to write instead of ``field`` when it is one of verl's names (``actor_rollout_ref.*`` included)."""
    if field.startswith("actor_rollout_ref."):
        rest = field.removeprefix("actor_rollout_ref.")
        if rest.split(".")[0] in ("actor", "rollout", "model") and rest not in VERL_NAMES:
            return f"{rest} (rlflow's sections are top level: actor, rollout, model)"
        field = rest
    for name, hint in VERL_NAMES.items():
        if field == name or field.startswith(name + "."):
            return hint
    return None


def validate_config(data: dict | RLConfig) -> RLConfig:
    if isinstance(data, RLConfig):
        return data
    try:
        return RLConfig.model_validate(data)
    except ValidationError as error:
        lines = []
        for problem in error.errors():
            field = ".".join(str(p) for p in problem["loc"]) or "(config)"
            if problem["type"] != "extra_forbidden":
                given = problem["input"]
                hint = VERL_VALUES.get((field.rsplit(".", 1)[-1], given)) if isinstance(given, str) else None
                lines.append(f"  {field}: {f'this is a verl value; use {hint}' if hint else problem['msg']}")
                continue
            # an unknown section arrives whole: name each of its keys
            given = flatten(problem["input"], field + ".") if isinstance(problem["input"], dict) else {field: None}
            for name in given:
                hint = verl_name_hint(name)
                lines.append(f"  {name}: {f'this is a verl name; use {hint}' if hint else problem['msg']}")
        raise ConfigError("invalid config:\n" + "\n".join(lines)) from None


def flatten(config: BaseModel | dict, prefix: str = "") -> dict[str, Any]:
    """``{"actor.optim.lr": 1e-4, ...}``: the config as MLflow params."""
    data = config.model_dump() if isinstance(config, BaseModel) else config
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def runs_root(config: RLConfig) -> str:
    runs = config.trainer.runs_dir
    if "://" not in runs:
        runs = os.path.abspath(runs)
    return f"{runs.rstrip('/')}/{config.trainer.run_name}"
