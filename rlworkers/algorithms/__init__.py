"""RL algorithm math (advantages, KL, losses); see :mod:`rlworkers.algorithms.core_algos`.

``from rlworkers.algorithms import core_algos`` mirrors verl's ``from verl.trainer.ppo import core_algos``;
every public name is also importable from this package directly.
"""

from rlworkers.algorithms import core_algos
from rlworkers.algorithms.core_algos import *  # noqa: F403  (the public surface is core_algos.__all__)
from rlworkers.algorithms.core_algos import __all__ as _core_all

__all__ = ["core_algos", *_core_all]
