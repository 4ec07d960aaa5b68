"""Loading user code from what a spec names: a ``.py`` file executed as a fresh module, or a dotted module imported.

Shared by reward specs (rlworkers.rewards.loading) and tool specs (rlworkers.tools.loading). Nothing is scanned
and nothing is ``eval``-ed: only the named file or module is loaded. A name that points at nothing raises
``UserCodeNotFoundError`` with the reason; the caller adds its spec and the forms it accepts.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType


class UserCodeNotFoundError(ValueError):
    """The named file or module does not exist, or the name is neither a ``.py`` file nor a dotted module name."""


def load_file_module(file: str, what: str, spec: str) -> ModuleType:
    """Execute the Python file ``file`` as a fresh module and return it.

    ``what`` ("reward", "tool") goes into the module's private name and into the note added to an error raised
    while the file runs; ``spec`` is the user's spec, named in that note.

    Raises:
        UserCodeNotFoundError: the file does not exist.
        Exception: whatever the file raises while it runs, with a note naming the file and the spec.
    """
    path = Path(file).expanduser()
    if not path.is_file():
        raise UserCodeNotFoundError(f"file {str(path)!r} does not exist")
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:10]
    name = f"_rlflow_{what}_{path.stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    # The module sits in sys.modules only while it runs (dataclasses and typing look it up there). Left out
    # afterwards, cloudpickle ships its functions to Ray workers by value, where the file path may not exist.
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        e.add_note(f"while loading {what} file {str(path)!r} for spec {spec!r}")
        raise
    finally:
        sys.modules.pop(name, None)
    return module


def import_module_named(module_name: str) -> ModuleType:
    """Import the dotted module ``module_name`` and return it.

    Raises:
        UserCodeNotFoundError: the name is not a dotted module name, or that module itself cannot be found.
        ModuleNotFoundError: the module exists but one of its own imports is missing (re-raised unchanged).
    """
    if not all(part.isidentifier() for part in module_name.split(".")):
        raise UserCodeNotFoundError(f"{module_name!r} is neither a .py file nor a dotted module name")
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):  # the named module itself is missing, not its imports
            raise UserCodeNotFoundError(f"module {module_name!r} cannot be imported ({e})") from e
        raise


def modules_changed_since_start(since: float | None = None) -> list[str]:
    """The files of the modules this process imported that changed on disk after it started, or after ``since``
    (a `git pull`, an edit, a package upgraded): a process kept for another run (flows/plumbing/kept.py,
    flows/plumbing/forkserver.py) would run their old code, so it is not reused then."""
    import psutil

    # a start time read from /proc may be off by a second
    started = since if since is not None else psutil.Process().create_time() + 2.0
    changed = []
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and os.path.isabs(path):  # (torch's ``_ops.py`` and the like name no file)
            try:
                if os.stat(path).st_mtime > started:
                    changed.append(path)
            except OSError:  # removed: an upgrade; what replaced it, if anything, is newer
                changed.append(path)
    return changed
