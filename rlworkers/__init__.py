"""rlworkers: verl-style workers, single controller and the ``DataProto`` batch type.

``from rlworkers import DataProto`` works like verl's ``from verl import DataProto``. It is resolved on first use,
so ``import rlworkers`` (and any submodule that does not need it) stays free of torch and tensordict.
"""

__all__ = ["DataProto"]


def __getattr__(name: str):
    if name == "DataProto":
        from rlworkers.protocol import DataProto

        return DataProto
    raise AttributeError(f"module 'rlworkers' has no attribute {name!r}")
