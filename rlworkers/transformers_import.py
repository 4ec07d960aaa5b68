"""How rlflow's processes import transformers: the same library, with less of every process's start spent on it.

``import rlworkers`` (which every process of a run does before it imports transformers: the workers, the task host,
the controller) calls :func:`prepare_transformers_import`. When transformers' import machinery
(``transformers.utils.import_utils``) is first imported, these things change in it, before anything reads them:

- At its import it maps every installed package to its distributions (``importlib.metadata.packages_distributions``:
  the metadata of every installed distribution read and parsed). The map depends on what is installed only: it is
  kept on disk and read again while no folder of ``sys.path`` that holds distributions changed.
- It builds the lazy table of its model classes by reading each of the ~2,800 files of its ~520 model folders
  (``create_import_structure_from_path``), and does so twice: ``transformers`` and ``transformers.models`` ask for
  the same folder under two keys (the folder, and the ``__init__.py`` in it). The table depends on the installed
  files only: it is kept on disk, for the installed transformers (its version and the modification times of its
  ``models`` folder, that folder's ``__init__.py`` and the import machinery).
- scikit-learn and scipy are installed (mlflow needs them), and transformers would import scikit-learn's metrics for
  a threshold of assisted decoding rlflow never uses, and scipy.optimize for the losses of its object-detection
  models, in every process. Their availability checks say no.
- transformers imports accelerate, which imports boto3 (installed for object storage) for its SageMaker settings
  (``accelerate config``): accelerate's check of boto3 (``accelerate.utils.imports``) says no.

What is kept lives in ``~/.cache/rlflow`` (``$XDG_CACHE_HOME/rlflow``), a file per table and Python environment (and
for the map, per set of folders), with the key it was made for; a file that is missing, unreadable or made for
another key is made again, as transformers would, and written atomically. What each saves: bench/imports.py and
docs/performance.md.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

_TRANSFORMERS = "transformers.utils.import_utils"
_ACCELERATE = "accelerate.utils.imports"


def prepare_transformers_import() -> None:
    """Arrange for transformers' import machinery to be adjusted when it is first imported (see above)."""
    if _TRANSFORMERS in sys.modules:  # imported before rlworkers: transformers imports the usual way in this process
        return
    if not any(isinstance(finder, _AdjustOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AdjustOnImport())


class _AdjustOnImport(importlib.abc.MetaPathFinder):
    """Finds the modules above as Python would, and runs each through its function below instead of directly."""

    def __init__(self):
        self.pending = {_TRANSFORMERS: _run_transformers_machinery, _ACCELERATE: _run_accelerate_checks}

    def find_spec(self, name, path, target=None):
        run_adjusted = self.pending.pop(name, None)
        if run_adjusted is None:
            return None
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module
        spec.loader.exec_module = lambda module: run_adjusted(module, run)
        return spec


def _run_transformers_machinery(import_utils, run) -> None:
    with _kept_packages_distributions():
        run(import_utils)
    for check in ("is_sklearn_available", "is_scipy_available"):
        if hasattr(import_utils, check):
            setattr(import_utils, check, _not_for_rlflow)
    build = getattr(import_utils, "create_import_structure_from_path", None)
    if build is not None:
        import_utils.create_import_structure_from_path = _kept_import_structure(build)


def _run_accelerate_checks(imports, run) -> None:
    run(imports)
    if hasattr(imports, "is_boto3_available"):
        imports.is_boto3_available = _not_for_rlflow


@contextlib.contextmanager
def _kept_packages_distributions():
    make = importlib.metadata.packages_distributions
    folders = _distribution_folders()  # one file per set of folders (a process that imported Ray has one more)
    name = "packages-distributions-" + hashlib.sha256("|".join(folders).encode()).hexdigest()[:12]
    key = "|".join(f"{folder}:{os.stat(folder).st_mtime_ns}" for folder in folders)
    importlib.metadata.packages_distributions = lambda: _kept(name, key, make)
    try:
        yield
    finally:
        importlib.metadata.packages_distributions = make


def _distribution_folders() -> list[str]:
    """The folders of ``sys.path`` that hold installed distributions (a package installed or removed changes the
    folder's modification time); not the others (a Ray worker's and its controller's differ)."""
    folders = []
    for folder in sys.path:
        with contextlib.suppress(OSError), os.scandir(folder or ".") as entries:
            if any(entry.name.endswith((".dist-info", ".egg-info")) for entry in entries):
                folders.append(os.path.abspath(folder or "."))
    return folders


def _not_for_rlflow() -> bool:
    return False


def _kept_import_structure(build):
    """``build`` (transformers' function; it calls itself by its module's name for each subfolder, so through this
    wrapper too), with the table of transformers' ``models`` folder kept on disk. Each call returns a table of its
    own, as ``build`` did for each of its two keys."""

    @functools.wraps(build)
    def import_structure(module_path):
        path = str(module_path)
        models = Path(os.path.dirname(path) if os.path.isfile(path) else path)
        machinery = models.parent / "utils" / "import_utils.py"
        if models.name != "models" or not machinery.is_file():
            return build(module_path)  # a model package's own folder: read when that package is imported
        version = getattr(sys.modules.get("transformers"), "__version__", "")
        stamps = [os.stat(p) for p in (models, models / "__init__.py", machinery)]
        key = "|".join([str(models), version, *(f"{s.st_mtime_ns}:{s.st_size}" for s in stamps)])
        table = _kept("transformers-import-structure", key, lambda: _encode(build(module_path)))
        try:
            return _decode(table)
        except (KeyError, TypeError, ValueError, AttributeError):  # a file of the right key and a wrong shape
            return build(module_path)

    import_structure.build = build
    return import_structure


def _kept(name: str, key: str, make: Callable[[], Any]) -> Any:
    """``make()``'s JSON-able value, read from this environment's file ``name`` when it was made for ``key``, else
    made and written there."""
    environment = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlflow"
    path = root / f"{name}-{environment}.json"
    with contextlib.suppress(OSError, ValueError):
        kept = json.loads(path.read_text())
        if isinstance(kept, dict) and kept.get("key") == key:
            return kept["value"]
    value = make()
    with contextlib.suppress(OSError):  # a read-only home: the next process makes it again
        root.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=root, prefix=path.name, suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump({"key": key, "value": value}, file)
        os.replace(temporary, path)
    return value


# The model table: dicts keyed by folder names (str) and by sets of backends (frozenset), whose leaves map a module to
# the set of names it exports. JSON has no sets nor non-string keys, so each value is written with its type.
def _encode(value):
    if isinstance(value, dict):
        return {"dict": [[_encode(key), _encode(item)] for key, item in value.items()]}
    if isinstance(value, frozenset):
        return {"frozenset": sorted(value)}
    if isinstance(value, set):
        return {"set": sorted(value)}
    return value


def _decode(value):
    if isinstance(value, str):
        return value
    if "dict" in value:
        return {_decode(key): _decode(item) for key, item in value["dict"]}
    if "frozenset" in value:
        return frozenset(value["frozenset"])
    return set(value["set"])
