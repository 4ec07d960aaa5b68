"""RL algorithm math for rlflow: advantage estimators, KL, policy/value/DPO losses, masked helpers.

This is the one import surface, named after verl's ``verl/trainer/ppo/core_algos.py`` with the same
function names and signatures, so a verl recipe ports by changing
``from verl.trainer.ppo import core_algos`` to ``from rlworkers.algorithms import core_algos``.
Everything here is a pure function (or a tiny controller class) on torch tensors: no Ray, Prefect or
MLflow, so it is unit-tested on CPU and runs unchanged inside any worker.

The code lives in modules split by responsibility:

* :mod:`rlworkers.algorithms.advantages` - ``AdvantageEstimator``, ``register_adv_est`` /
  ``get_adv_estimator_fn`` and the estimators (gae, grpo, grpo_passk, rloo, reinforce_plus_plus,
  reinforce_plus_plus_baseline), ``compute_token_level_scores``.
* :mod:`rlworkers.algorithms.kl` - ``kl_penalty`` estimators, Fixed/Adaptive KL controllers,
  ``apply_kl_penalty``.
* :mod:`rlworkers.algorithms.losses` - ``agg_loss``, ``register_policy_loss`` / ``get_policy_loss_fn``
  (vanilla PPO with dual-clip, gspo), entropy, value and DPO losses.
* :mod:`rlworkers.algorithms.utils` - ``masked_mean`` / ``masked_var`` / ``masked_whiten``,
  ``entropy_from_logits``.

Tensor shapes in the docstrings: ``B`` rows (sequences), ``T`` response tokens, ``V`` vocabulary.
Tests: ``pytest tests/test_algorithms.py`` (hand-computed values).
"""

from rlworkers.algorithms import advantages as _advantages
from rlworkers.algorithms import kl as _kl
from rlworkers.algorithms import losses as _losses
from rlworkers.algorithms import utils as _utils
from rlworkers.algorithms.advantages import *  # noqa: F403
from rlworkers.algorithms.kl import *  # noqa: F403
from rlworkers.algorithms.losses import *  # noqa: F403
from rlworkers.algorithms.utils import *  # noqa: F403

# Each module's __all__ is its public surface; this module adds nothing of its own.
__all__ = [*_advantages.__all__, *_kl.__all__, *_losses.__all__, *_utils.__all__]
