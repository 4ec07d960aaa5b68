"""Checkpoint folders with a sha256 manifest as the commit marker; resume and retention on any fsspec path.

Layout: ``<root>/step_<N>/`` where ``root`` is ``<runs>/<run-name>/checkpoints`` and ``N`` is the number of
completed training steps. Every path goes through fsspec, so ``root`` may be a local path, ``s3://bucket/...``
or ``memory://...``; workers on other nodes write their shards straight into the step folder (nothing assumes
the driver and the workers share a disk, the failure behind verl #2265 / #4332).

The save protocol, run by the driver::

    step_dir = begin_checkpoint(root, step)          # creates step_<N>/, clears a crashed earlier attempt
    ...workers write weights / optimizer / RNG shards into step_dir...
    write_json(f"{step_dir}/trainer_state.json", {...})   # data-loader position, KL controller, MLflow run id
    commit_checkpoint(step_dir, metadata={...})      # hashes every file, then writes manifest.json LAST
    apply_retention(root, keep_last=K)               # only after the commit (verl PR #4873)

A checkpoint counts only once ``manifest.json`` exists and matches the files. On a local disk the manifest is
written to a temporary name, fsynced and renamed (atomic); on object stores a single PUT of the manifest, made
after every other file, is the commit marker. Readers never trust a folder without a manifest:
``find_latest_checkpoint`` skips partial or corrupt folders with a WARNING that names them and why, so a
resumed run falls back to the previous good checkpoint instead of failing (or, worse, silently loading a
half-written one). Only corruption causes that fallback: an I/O error (network, permissions) propagates.

Resume (``resolve_resume``): ``"auto"`` = newest valid checkpoint under root or ``None``; ``"never"`` =
``None``; anything else is the path of one ``step_<N>`` folder, verified before use.

This module imports neither Ray, Prefect nor MLflow.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any

import fsspec

from rlworkers.storage import basename, filesystem, join_path, write_bytes_atomic

__all__ = [
    "CorruptCheckpointError",
    "CheckpointSaveError",
    "MANIFEST_NAME",
    "MANIFEST_FORMAT",
    "begin_checkpoint",
    "write_json",
    "read_json",
    "commit_checkpoint",
    "verify_checkpoint",
    "list_checkpoints",
    "find_latest_checkpoint",
    "resolve_resume",
    "apply_retention",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "rlflow.checkpoint/1"
_STEP_RE = re.compile(r"^step_(\d+)$")
# Our own temporary files (".<name>.tmp-<uuid hex>"): left behind only by a crash mid-write, never hashed.
_TMP_RE = re.compile(r"^\..+\.tmp-[0-9a-f]{32}$")
_CHUNK_BYTES = 8 * 1024 * 1024  # sha256 is streamed: weight files can be many GiB


class CorruptCheckpointError(ValueError):
    """A checkpoint folder is partial (no manifest) or does not match its manifest.

    ``step_dir`` is the folder and ``problem`` the first problem found; ``str(err)`` names both.
    """

    def __init__(self, step_dir: str, problem: str):
        self.step_dir = step_dir
        self.problem = problem
        super().__init__(f"checkpoint {step_dir}: {problem}")

    def __reduce__(self):  # rebuilt from its fields when Ray or Prefect re-raise it in another process
        return type(self), (self.step_dir, self.problem)


class CheckpointSaveError(RuntimeError):
    """Saving ``step_dir`` failed (the store refused a write, the network dropped...). Nothing committed before
    it was touched: ``previous`` is the newest good checkpoint (None if there is none yet)."""

    def __init__(self, step_dir: str, previous: str | None, cause: str):
        self.step_dir, self.previous, self.cause = step_dir, previous, cause
        kept = f"the newest good checkpoint is still {previous}" if previous else "no earlier checkpoint exists"
        super().__init__(
            f"could not save checkpoint {step_dir}: {cause}. Nothing was lost: the partial folder is "
            f"never loaded and {kept}. Fix: check that trainer.runs_dir is reachable and writable "
            "(credentials, quota, network), then run again: the run resumes from "
            f"{previous or 'its start'}."
        )

    def __reduce__(self):
        return type(self), (self.step_dir, self.previous, self.cause)


# ----------------------------------------------------------------------------------------------- paths / io


def _step_of(step_dir: str | os.PathLike) -> int | None:
    match = _STEP_RE.match(basename(os.fspath(step_dir)))
    return int(match.group(1)) if match else None


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` (any fsspec path), atomically where the filesystem can rename.

    Raises:
        TypeError: ``obj`` holds something JSON cannot encode (the message names the file).
    """
    try:
        text = json.dumps(obj, indent=2)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"cannot write {os.fspath(path)} as JSON: {exc}; convert the value to plain "
            "dicts/lists/str/numbers first (e.g. tensor.item(), str(path))"
        ) from exc
    write_bytes_atomic(path, text.encode("utf-8"))


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file from any fsspec path. Raises FileNotFoundError if it does not exist."""
    fs, p = filesystem(path)
    with fs.open(p, "rb") as f:
        return json.loads(f.read().decode("utf-8"))


def _sha256_and_size(fs: fsspec.AbstractFileSystem, path: str) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _list_files(fs: fsspec.AbstractFileSystem, p: str) -> list[str]:
    """Relative paths of every file under ``p`` except the manifest and our temporary files."""
    fs.invalidate_cache(p)  # workers on other nodes wrote here: a cached listing (s3fs) would miss them
    rels = []
    for full in fs.find(p, withdirs=False):
        full = full.rstrip("/")
        assert full.startswith(p + "/"), (full, p)
        rel = full[len(p) + 1 :]
        if rel == MANIFEST_NAME or _TMP_RE.match(basename(rel)):
            continue
        rels.append(rel)
    return sorted(rels)


# ----------------------------------------------------------------------------------------------- save


def begin_checkpoint(root: str | os.PathLike, step: int, *, overwrite: bool = False) -> str:
    """Create and return ``<root>/step_<step>``, the folder workers write into.

    A folder for this step without a valid manifest is left over from a crashed attempt: it is removed first
    (WARNING). A committed checkpoint of the same step is never replaced silently.

    Raises:
        ValueError: ``step`` is not a non-negative int.
        FileExistsError: ``step_<step>`` is already a committed checkpoint and ``overwrite`` is False.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    step_dir = join_path(root, f"step_{step}")
    fs, p = filesystem(step_dir)
    fs.invalidate_cache(p)
    if fs.exists(p):
        try:
            verify_checkpoint(step_dir, check_hashes=False)
        except CorruptCheckpointError as exc:
            logger.warning("removing stale checkpoint folder from an earlier attempt (%s)", exc)
        else:
            if not overwrite:
                raise FileExistsError(
                    f"checkpoint {step_dir} is already committed; resume from it (resume='auto'), use another "
                    "run name, or pass overwrite=True to replace it"
                )
            logger.warning("replacing committed checkpoint %s (overwrite=True)", step_dir)
        _remove_checkpoint(fs, p)
    fs.makedirs(p, exist_ok=True)
    return step_dir


def commit_checkpoint(
    step_dir: str | os.PathLike, metadata: dict | None = None, *, required: Iterable[str] = ()
) -> dict:
    """Hash every file under ``step_dir`` and write ``manifest.json`` last; return the manifest.

    The manifest is ``{format, step, created_at, files: {relpath: {sha256, size}}, metadata}``. ``required``
    lists relative paths that must be present (e.g. ``trainer_state.json``); checked before the commit.

    Raises:
        ValueError: the folder is not named ``step_<N>``, holds no file, or lacks a required file.
        TypeError: ``metadata`` is not a dict or is not JSON-serialisable.
    """
    step_dir = os.fspath(step_dir)
    step = _step_of(step_dir)
    if step is None:
        raise ValueError(
            f"cannot commit {step_dir}: the folder must be named step_<N>; create it with begin_checkpoint(root, step)"
        )
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise TypeError(f"commit_checkpoint metadata must be a dict, got {type(metadata).__name__}")
    fs, p = filesystem(step_dir)
    rels = _list_files(fs, p) if fs.exists(p) else []
    if not rels:
        raise ValueError(
            f"cannot commit {step_dir}: it holds no file. Workers must write into this folder "
            "(a path every node can reach, e.g. s3://... or a shared mount), not a node-local disk"
        )
    missing = [r for r in required if r not in rels]
    if missing:
        raise ValueError(f"cannot commit {step_dir}: required file(s) {missing} were not written")
    files = {}
    for rel in rels:
        sha, size = _sha256_and_size(fs, f"{p}/{rel}")
        files[rel] = {"sha256": sha, "size": size}
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "files": files,
        "metadata": metadata,
    }
    try:
        data = json.dumps(manifest, indent=2).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise TypeError(f"checkpoint metadata for {step_dir} is not JSON-serialisable: {exc}") from exc
    write_bytes_atomic(join_path(step_dir, MANIFEST_NAME), data)  # the commit point
    logger.info(
        "committed checkpoint %s (%d files, %d bytes)", step_dir, len(files), sum(f["size"] for f in files.values())
    )
    return manifest


# ----------------------------------------------------------------------------------------------- verify


def _load_manifest(step_dir: str, fs: fsspec.AbstractFileSystem, p: str) -> dict:
    mpath = f"{p}/{MANIFEST_NAME}"
    fs.invalidate_cache(p)
    if not fs.exists(mpath):
        raise CorruptCheckpointError(step_dir, f"no {MANIFEST_NAME}: partial or uncommitted (the save did not finish)")
    try:
        with fs.open(mpath, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(step_dir, f"unreadable {MANIFEST_NAME}: {exc}") from exc
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != MANIFEST_FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CorruptCheckpointError(
            step_dir, f"{MANIFEST_NAME} is not a {MANIFEST_FORMAT} manifest (format={found!r})"
        )
    return manifest


def verify_checkpoint(step_dir: str | os.PathLike, *, check_hashes: bool = True, required: Iterable[str] = ()) -> dict:
    """Return the manifest of ``step_dir`` if every listed file is present with its size and sha256.

    ``check_hashes=False`` checks presence and sizes only (cheap: no file is read). ``required`` lists
    relative paths the manifest must contain (e.g. ``trainer_state.json``).

    Raises:
        CorruptCheckpointError: no manifest, unreadable manifest, step mismatch, missing required file,
            missing file, size or sha256 mismatch; the message names the folder and the first problem.
    """
    step_dir = os.fspath(step_dir)
    fs, p = filesystem(step_dir)
    manifest = _load_manifest(step_dir, fs, p)
    folder_step = _step_of(step_dir)
    if folder_step is not None and manifest.get("step") != folder_step:
        raise CorruptCheckpointError(
            step_dir, f"{MANIFEST_NAME} says step {manifest.get('step')!r}, folder says {folder_step}"
        )
    files: dict = manifest["files"]
    for rel in required:
        if rel not in files:
            raise CorruptCheckpointError(step_dir, f"required file {rel!r} is not in {MANIFEST_NAME}")
    for rel, entry in sorted(files.items()):  # sizes of all files first: cheap, catches truncation
        try:
            size = fs.info(f"{p}/{rel}")["size"]
        except FileNotFoundError:
            raise CorruptCheckpointError(step_dir, f"missing file {rel!r}") from None
        if size != entry.get("size"):
            raise CorruptCheckpointError(
                step_dir, f"size mismatch for {rel!r}: manifest {entry.get('size')}, found {size}"
            )
    if check_hashes:
        for rel, entry in sorted(files.items()):
            sha, _ = _sha256_and_size(fs, f"{p}/{rel}")
            if sha != entry.get("sha256"):
                raise CorruptCheckpointError(step_dir, f"sha256 mismatch for {rel!r}")
    return manifest


# ----------------------------------------------------------------------------------------------- find / resume


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, str]]:
    """``(step, step_dir)`` of every ``step_<N>`` folder under ``root``, valid or not, sorted by step."""
    fs, p = filesystem(root)
    fs.invalidate_cache(p)
    if not fs.exists(p):
        return []
    found = []
    for entry in fs.ls(p, detail=True):
        name = basename(entry["name"])
        step = _step_of(name)
        if step is not None and entry.get("type") == "directory":
            found.append((step, join_path(root, name)))
    return sorted(found)


def find_latest_checkpoint(root: str | os.PathLike, *, required: Iterable[str] = ()) -> tuple[str, dict] | None:
    """Newest valid checkpoint under ``root`` as ``(step_dir, manifest)``, or None if there is none.

    Newer partial or corrupt folders are skipped with a WARNING naming them and why.
    """
    required = tuple(required)
    skipped = 0
    for _, step_dir in reversed(list_checkpoints(root)):
        try:
            return step_dir, verify_checkpoint(step_dir, required=required)
        except CorruptCheckpointError as exc:
            skipped += 1
            logger.warning("skipping checkpoint: %s; falling back to an older one", exc)
    if skipped:
        logger.warning("no valid checkpoint under %s (%d invalid folder(s) skipped)", os.fspath(root), skipped)
    return None


def resolve_resume(root: str | os.PathLike, resume: str, *, required: Iterable[str] = ()) -> tuple[str, dict] | None:
    """Pick the checkpoint to resume from: ``(step_dir, manifest)`` or None to start from scratch.

    ``resume="auto"``: newest valid checkpoint under ``root`` (None if there is none); ``"never"``: None;
    anything else: the path of one ``step_<N>`` folder, verified.

    Raises:
        TypeError: ``resume`` is not a string.
        FileNotFoundError: the explicit path does not exist.
        CorruptCheckpointError: the explicit path is partial, corrupt, or not a step folder.
    """
    if not isinstance(resume, (str, os.PathLike)):
        raise TypeError(f"resume must be 'auto', 'never' or a checkpoint path, got {resume!r}")
    resume = os.fspath(resume)
    if resume == "never":
        logger.info("resume='never': starting from scratch")
        return None
    if resume == "auto":
        found = find_latest_checkpoint(root, required=required)
        if found is None:
            logger.info("resume='auto': no valid checkpoint under %s, starting from scratch", os.fspath(root))
        else:
            logger.info("resume='auto': resuming from %s", found[0])
        return found
    fs, p = filesystem(resume)
    if not fs.exists(p):
        raise FileNotFoundError(
            f"resume={resume!r}: no such checkpoint folder. Pass resume='auto' to continue "
            "from the newest valid checkpoint of this run, resume='never' to start fresh, or "
            "the path of an existing step_<N> folder"
        )
    try:
        manifest = verify_checkpoint(resume, required=required)
    except CorruptCheckpointError as exc:
        hint = (
            "it looks like a checkpoints root: pass resume='auto' or one of its step_<N> folders"
            if _step_of(resume) is None and list_checkpoints(resume)
            else "pick an older step_<N> folder, or pass resume='auto' to use the newest valid one"
        )
        raise CorruptCheckpointError(exc.step_dir, f"{exc.problem}; cannot resume from it: {hint}") from exc
    logger.info("resuming from %s", resume)
    return resume, manifest


# ----------------------------------------------------------------------------------------------- retention


def _remove_checkpoint(fs: fsspec.AbstractFileSystem, p: str) -> None:
    # Manifest first: a deletion interrupted half-way leaves a folder that reads as partial, not as a
    # committed checkpoint with missing files.
    mpath = f"{p}/{MANIFEST_NAME}"
    if fs.exists(mpath):
        fs.rm(mpath)
    fs.rm(p, recursive=True)
    fs.invalidate_cache(p)


def apply_retention(
    root: str | os.PathLike, keep_last: int | None, *, check_hashes: bool = False, required: Iterable[str] = ()
) -> list[str]:
    """Delete old checkpoints so that the newest ``keep_last`` valid ones remain; return the deleted paths.

    Call it only after ``commit_checkpoint`` (verl PR #4873: deleting first lost everything when the save
    failed). The newest valid checkpoint is never deleted; invalid or partial folders older than it are;
    folders newer than it (a save in progress) are left alone. ``keep_last`` None or <= 0 keeps everything.
    Validity is checked without hashes by default (presence and sizes): hashing K checkpoints of a large
    model at every save is too slow; ``check_hashes=True`` does the full check.
    """
    if keep_last is None or keep_last <= 0:
        return []
    required = tuple(required)
    entries = list_checkpoints(root)
    valid = []
    for step, step_dir in entries:
        try:
            verify_checkpoint(step_dir, check_hashes=check_hashes, required=required)
            valid.append(step)
        except CorruptCheckpointError:
            pass
    if not valid:
        logger.warning("retention: no valid checkpoint under %s; deleting nothing", os.fspath(root))
        return []
    keep = set(valid[-keep_last:])
    newest_valid = valid[-1]
    deleted = []
    for step, step_dir in entries:
        if step in keep or step > newest_valid:
            continue
        kind = "valid" if step in valid else "invalid/partial"
        logger.info("retention (keep_last=%d): deleting %s checkpoint %s", keep_last, kind, step_dir)
        fs, p = filesystem(step_dir)
        _remove_checkpoint(fs, p)
        deleted.append(step_dir)
    return deleted
