"""RL algorithm math for rlflow: advantage estimators, KL, policy/value/DPO losses, masked helpers.

This is the one import surface, named after verl's ``verl/trainer/ppo/core_algos.py`` with the same
function names and signatures, so a verl recipe ports by changing
``from verl.trainer.ppo import core_algos`` to ``from rlworkers.algorithms import core_algos``.
Everything here is a pure function (or a tiny controller class) on torch tensors: no Ray, Prefect or
MLflow, so it is unit-tested on CPU and runs unchanged inside any worker.

The code lives in modules split by responsibility:

* :mod:`rlworkers.algorithms.advantages` - ``AdvantageEstimator``, ``register_adv_est`` /
  ``get_adv_estimator_fn`` and the estimators (gae, grpo, grpo_passk, rloo, reinforce_plus_plus,
  reinforce_plus_plus_baseline, remax), ``compute_token_level_scores``.
* :mod:`rlworkers.algorithms.kl` - ``kl_penalty`` estimators, Fixed/Adaptive KL controllers,
  ``apply_kl_penalty``.
* :mod:`rlworkers.algorithms.losses` - ``agg_loss``, ``register_policy_loss`` / ``get_policy_loss_fn``
  (vanilla PPO with dual-clip, gspo), entropy, value and DPO losses.
* :mod:`rlworkers.algorithms.utils` - ``masked_mean`` / ``masked_var`` / ``masked_whiten``,
  ``entropy_from_logits``.

Tensor shapes in the docstrings: ``B`` rows (sequences), ``T`` response tokens, ``V`` vocabulary.
Tests: ``pytest tests/test_algorithms.py`` (hand-computed values).
"""

from rlworkers.algorithms.advantages import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimator,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_token_level_scores,
    get_adv_estimator_fn,
    register_adv_est,
)
from rlworkers.algorithms.kl import (
    KL_PENALTY_MODES,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
)
from rlworkers.algorithms.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSS_REGISTRY,
    PolicyLossConfig,
    PolicyLossFn,
    agg_loss,
    compute_dpo_loss,
    compute_entropy_loss,
    compute_policy_loss_gspo,
    compute_policy_loss_vanilla,
    compute_value_loss,
    get_policy_loss_fn,
    register_policy_loss,
    resolve_policy_loss_config,
)
from rlworkers.algorithms.utils import entropy_from_logits, masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    # advantages
    "ADV_ESTIMATOR_REGISTRY",
    "AdvantageEstimator",
    "register_adv_est",
    "get_adv_estimator_fn",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_token_level_scores",
    # KL
    "KL_PENALTY_MODES",
    "kl_penalty",
    "KLController",
    "FixedKLController",
    "AdaptiveKLController",
    "get_kl_controller",
    "apply_kl_penalty",
    # losses
    "LOSS_AGG_MODES",
    "agg_loss",
    "PolicyLossConfig",
    "resolve_policy_loss_config",
    "PolicyLossFn",
    "POLICY_LOSS_REGISTRY",
    "register_policy_loss",
    "get_policy_loss_fn",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_entropy_loss",
    "compute_value_loss",
    "compute_dpo_loss",
    # masked helpers
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "entropy_from_logits",
]
