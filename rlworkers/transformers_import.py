"""How rlflow's processes import transformers: the same library, in a second less of every process's start.

``import rlworkers`` (which every process of a run does before it imports transformers: the workers, the task host,
the controller) calls :func:`prepare_transformers_import`, which changes two things in transformers' own import
machinery (``transformers.utils.import_utils``) the moment that module has run, before anything reads them:

- transformers builds the lazy table of its model classes at every import by reading each of the ~2,800 files of
  its ~520 model folders (``create_import_structure_from_path``: ~0.5 s on a 2-core Xeon), and does it twice, since
  ``transformers`` and ``transformers.models`` ask for the same folder under two keys (a folder, and the
  ``__init__.py`` in it). The table is a function of the installed files alone: it is now made once per folder in
  a process and kept on disk for the installed transformers (``~/.cache/rlflow``, or ``$XDG_CACHE_HOME/rlflow``),
  keyed by the folder, transformers' version and the modification times of the folder, its ``__init__.py`` and
  the import machinery (a new install of transformers makes a new table). Each worker and controller starts ~1 s
  sooner.
- scikit-learn and scipy are installed (mlflow needs them), and transformers would import scikit-learn's metrics for
  a threshold of assisted decoding rlflow never uses, and scipy.optimize for the losses of its object-detection
  models: ~1 s each in every process. Their availability checks say no.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
from pathlib import Path

_MODULE = "transformers.utils.import_utils"


def prepare_transformers_import() -> None:
    """Arrange for :func:`_adjust` to run on transformers' import machinery when it is first imported."""
    if _MODULE in sys.modules:  # imported before rlworkers: transformers imports the usual way in this process
        return
    if not any(isinstance(finder, _AdjustOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AdjustOnImport())


class _AdjustOnImport(importlib.abc.MetaPathFinder):
    """Finds ``transformers.utils.import_utils`` as Python would, and adjusts it right after it has run."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _adjust(module)

        spec.loader.exec_module = exec_module
        return spec


def _not_for_rlflow() -> bool:
    return False


def _adjust(import_utils) -> None:
    for check in ("is_sklearn_available", "is_scipy_available"):
        if hasattr(import_utils, check):
            setattr(import_utils, check, _not_for_rlflow)
    build = getattr(import_utils, "create_import_structure_from_path", None)
    if build is not None:
        import_utils.create_import_structure_from_path = _kept_import_structure(build)


def _kept_import_structure(build):
    """``build`` (transformers' function; it calls itself by its module's name for each subfolder, so through this
    wrapper too), with the table of transformers' ``models`` folder read from disk when it is there, and made and
    written there when it is not. Each call returns a table of its own, as ``build`` did for each of the two keys."""
    kept: dict[Path, str] = {}

    @functools.wraps(build)
    def import_structure(module_path):
        path = str(module_path)
        cache = _cache_file(os.path.dirname(path) if os.path.isfile(path) else path)
        if cache is None:
            return build(module_path)
        if cache not in kept:
            try:
                kept[cache] = cache.read_text()
                return _decode(json.loads(kept[cache]))
            except (OSError, ValueError, KeyError, TypeError):
                structure = build(module_path)
                try:
                    kept[cache] = json.dumps(_encode(structure))
                except TypeError:  # a table of another shape (another transformers): made as transformers makes it
                    return structure
                _write_atomically(cache, kept[cache])
                return structure
        return _decode(json.loads(kept[cache]))

    import_structure.build = build
    return import_structure


def _cache_file(folder: str) -> Path | None:
    """Where the table of ``folder`` is kept: only transformers' own ``models`` folder (what every import reads);
    its subfolders are made in the same call."""
    models = Path(folder)
    if models.name != "models" or not (models.parent / "utils" / "import_utils.py").is_file():
        return None
    version = getattr(sys.modules.get("transformers"), "__version__", "unknown")
    stamps = [(models / "__init__.py").stat(), (models.parent / "utils" / "import_utils.py").stat(), models.stat()]
    key = f"{models}|{version}|" + "|".join(f"{s.st_mtime_ns}:{s.st_size}" for s in stamps)
    name = f"transformers-{version}-import-structure-{_digest(key)}.json"
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlflow"
    return root / name


def _digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _write_atomically(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except OSError:  # a read-only home: the table is made again by the next process, as transformers would
        pass


# The table: dicts keyed by folder names (str) and by sets of backends (frozenset), whose leaves map a module to
# the set of names it exports. JSON has no sets nor non-string keys, so each value is written with its type.
def _encode(value):
    if isinstance(value, dict):
        return {"dict": [[_encode(key), _encode(item)] for key, item in value.items()]}
    if isinstance(value, frozenset):
        return {"frozenset": sorted(value)}
    if isinstance(value, set):
        return {"set": sorted(value)}
    if isinstance(value, str):
        return value
    raise TypeError(f"transformers' import structure holds a {type(value).__name__}: not kept")


def _decode(value):
    if isinstance(value, str):
        return value
    if "dict" in value:
        return {_decode(key): _decode(item) for key, item in value["dict"]}
    if "frozenset" in value:
        return frozenset(value["frozenset"])
    return set(value["set"])
