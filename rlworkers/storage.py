"""Folders on any fsspec path (a local disk, a shared mount, ``s3://...``) for libraries that only take local folders.

``save_pretrained`` and ``from_pretrained`` (transformers, vLLM, MLflow's model logging) read and write local
folders. Where ``trainer.runs_dir`` is object storage, they meet it here:

    with staged_dir("s3://bucket/runs/x/step_4/actor") as folder:   # a local temporary folder
        model.save_pretrained(folder)                               # ...uploaded file by file on exit
    path = cached_copy("s3://bucket/runs/_models/sft-v3/hf")        # downloaded once per node, then reused
    with local_dir("s3://bucket/runs/x/final_model") as folder:     # a temporary copy, removed on exit
        log_model(folder)

A local path passes through unchanged: nothing is copied.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

__all__ = [
    "is_remote",
    "filesystem",
    "join_path",
    "basename",
    "staged_dir",
    "local_dir",
    "cached_copy",
    "download_dir",
    "upload_dir",
    "storage_env",
]

COMPLETE_MARKER = ".complete"
# Variables that configure object-store clients (botocore/s3fs: credentials, endpoint, retries; fsspec's own).
STORAGE_ENV_PREFIXES = ("AWS_", "FSSPEC_")


def storage_env() -> dict[str, str]:
    """The object-store settings of this process's environment, for processes that must reach the same store
    (Ray workers started before they were set, or on other nodes)."""
    return {k: v for k, v in os.environ.items() if k.startswith(STORAGE_ENV_PREFIXES)}


def is_remote(path: str | os.PathLike) -> bool:
    """True for a URL of a filesystem other than the local one (``s3://``, ``gs://``, ``memory://``...)."""
    protocol = fsspec.core.split_protocol(os.fspath(path))[0]
    return protocol not in (None, "file", "local")


def filesystem(path: str | os.PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of ``path`` and the path within it (no protocol, no trailing ``/``)."""
    fs, stripped = fsspec.core.url_to_fs(os.fspath(path))
    return fs, stripped.rstrip("/") or stripped


def join_path(base: str | os.PathLike, *parts: str) -> str:
    """``base/part/...`` with ``/`` as fsspec expects, keeping the form of ``base`` (a URL stays a URL)."""
    return "/".join([os.fspath(base).rstrip("/"), *parts])


def basename(path: str | os.PathLike) -> str:
    """The last component of a path or URL."""
    return os.fspath(path).rstrip("/").rsplit("/", 1)[-1]


def upload_dir(local: str | os.PathLike, url: str) -> None:
    """Copy every file under ``local`` to ``url``, keeping relative paths (existing files there stay)."""
    fs, root = filesystem(url)
    for path in sorted(Path(local).rglob("*")):
        if path.is_file():
            fs.put_file(str(path), f"{root}/{path.relative_to(local).as_posix()}")
    fs.invalidate_cache(root)


def download_dir(url: str, local: str | os.PathLike) -> None:
    """Copy every file under ``url`` into the folder ``local``, keeping relative paths.

    Raises:
        FileNotFoundError: ``url`` holds no file.
    """
    fs, root = filesystem(url)
    fs.invalidate_cache(root)
    files = fs.find(root, withdirs=False)
    if not files:
        raise FileNotFoundError(f"{url}: no such folder (or it is empty)")
    for remote in files:
        target = Path(local) / remote[len(root) + 1 :]
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(target))


@contextmanager
def staged_dir(path: str | os.PathLike) -> Iterator[str]:
    """A local folder whose files end up in ``path``: the folder itself when local, else a temporary folder that
    is uploaded when the block ends without an error (nothing is uploaded after an error)."""
    path = os.fspath(path)
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="rlflow-upload-") as tmp:
        yield tmp
        upload_dir(tmp, path)


@contextmanager
def local_dir(path: str | os.PathLike) -> Iterator[str]:
    """A local folder with the files of ``path``: the folder itself when local, else a temporary copy."""
    path = os.fspath(path)
    if not is_remote(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="rlflow-download-") as tmp:
        download_dir(path, tmp)
        yield tmp


def cached_copy(path: str | os.PathLike, cache_root: str | os.PathLike | None = None) -> str:
    """A local folder with the files of ``path``, downloaded once into ``cache_root`` (default
    ``~/.cache/rlflow/remote``) and reused after; for folders that never change once written (a model).
    A local ``path`` is returned as is."""
    path = os.fspath(path)
    if not is_remote(path):
        return path
    cache_root = Path(cache_root) if cache_root else Path.home() / ".cache" / "rlflow" / "remote"
    target = cache_root / f"{hashlib.sha256(path.encode()).hexdigest()[:16]}-{basename(path)}"
    if (target / COMPLETE_MARKER).exists():
        return str(target)
    shutil.rmtree(target, ignore_errors=True)
    cache_root.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache_root))  # same disk: the rename is atomic
    try:
        download_dir(path, partial)
        (partial / COMPLETE_MARKER).touch()
        os.replace(partial, target)  # another process may have finished first: then keep its copy
    except OSError:
        if not (target / COMPLETE_MARKER).exists():
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return str(target)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` (any fsspec path) so that a reader, in this process or another, sees the old file or
    the whole new one, never a torn write."""
    fs, p = filesystem(path)
    parent, name = p.rsplit("/", 1)
    if isinstance(fs, LocalFileSystem):
        # Temp file + fsync + rename: a reader sees the old file or the whole new one, never a torn write.
        os.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.{name}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return
    # Object stores have no rename (mv = copy + delete); a single PUT is atomic per object.
    fs.pipe_file(p, data)
