"""How a ``RayWorkerGroup`` travels to another process (a Prefect task in the task host): its handles and bindings,
rebound on arrival. A process that gets the same group again (every task in a long-lived task host) reuses the
one it unpickled then instead of deserializing each actor handle again, at every call that sends the group. Under
Ray Client (a ``ray://`` controller) the state travels as is, through Ray Client's own pickler, which turns the
handles into the cluster's."""

from __future__ import annotations

import collections
import hashlib
import threading

import ray
from ray import cloudpickle

_UNPICKLED_GROUPS: collections.OrderedDict[bytes, object] = collections.OrderedDict()
_UNPICKLED_GROUPS_KEPT = 16  # distinct group states kept per process (the few groups of a run, and their restarts)
_unpickled_groups_lock = threading.Lock()


def _unpickle_group(cls: type, digest: bytes, payload: bytes) -> object:
    """The group pickled as ``payload`` (see ``RayWorkerGroup.__reduce__``): the one this process made from the
    same bytes before, if it still keeps it."""
    with _unpickled_groups_lock:
        group = _UNPICKLED_GROUPS.get(digest)
        if group is not None:
            _UNPICKLED_GROUPS.move_to_end(digest)
            return group
    group = cls.__new__(cls)
    group.__setstate__(cloudpickle.loads(payload))
    with _unpickled_groups_lock:
        _UNPICKLED_GROUPS[digest] = group
        while len(_UNPICKLED_GROUPS) > _UNPICKLED_GROUPS_KEPT:
            _UNPICKLED_GROUPS.popitem(last=False)
    return group


def _rebuild_group(cls: type, state: dict) -> object:
    group = cls.__new__(cls)
    group.__setstate__(state)
    return group


def reduce_group(group) -> tuple:
    """``group.__reduce__()``: the state as pickled bytes with their digest (a changed group, after ``restart`` or
    ``set_call_timeout``, has other bytes, so a new cache entry); sharing one is like sharing Ray actor handles."""
    if ray.util.client.ray.is_connected():
        return _rebuild_group, (type(group), group.__getstate__())
    payload = cloudpickle.dumps(group.__getstate__())
    return _unpickle_group, (type(group), hashlib.blake2b(payload, digest_size=16).digest(), payload)
