"""Write a model folder so that no reader ever sees it half-written: build it in a temporary sibling folder, then
rename it into place. Shared by the named models (``tiny``, ``smollm2-135m-instruct``), which several Ray actors
may ask for at once."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def build_into_place(path: Path, create: Callable[[Path], None], is_complete: Callable[[Path], bool]) -> Path:
    """``create(staging)`` writes the whole folder; it then becomes ``path`` by one rename. If another process got
    there first (the rename fails), its folder is kept when ``is_complete`` says so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        create(staging)
        if path.exists():  # an empty folder left by a caller; rename cannot replace a non-empty one
            path.rmdir()
        staging.rename(path)
    except OSError:
        if not is_complete(path):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
