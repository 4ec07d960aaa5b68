"""rlworkers: verl-style workers, single controller and the ``DataProto`` batch type.

``from rlworkers import DataProto`` works like verl's ``from verl import DataProto``. It is resolved on first use,
so ``import rlworkers`` (and any submodule that does not need it) stays free of torch and tensordict.
"""

from rlworkers.process_start import pause_gc_while_importing
from rlworkers.transformers_import import prepare_transformers_import

# before anything imports torch or transformers: see the two modules
pause_gc_while_importing()
prepare_transformers_import()

__all__ = ["DataProto"]


def __getattr__(name: str):
    if name == "DataProto":
        from rlworkers.protocol import DataProto

        return DataProto
    raise AttributeError(f"module 'rlworkers' has no attribute {name!r}")
