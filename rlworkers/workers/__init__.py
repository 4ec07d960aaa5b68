"""The Ray workers of an RL job: ``ActorRolloutRefWorker`` (actor_rollout_ref.py), ``CriticWorker`` (critic.py),
``RewardWorker`` (reward.py), their configs (config.py), the rollout backends (rollout/) and the pieces they share
(common.py). Import from the module: importing this package loads no model code."""
