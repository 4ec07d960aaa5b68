"""Checkpoint manifest, verification, resume and retention (pure filesystem: local tmp_path and memory://)."""

from __future__ import annotations

import hashlib
import logging
import os
import uuid

import fsspec
import pytest

from rlworkers import checkpoint as ckpt
from rlworkers.checkpoint import (
    CorruptCheckpointError,
    apply_retention,
    begin_checkpoint,
    commit_checkpoint,
    find_latest_checkpoint,
    list_checkpoints,
    read_json,
    resolve_resume,
    verify_checkpoint,
    write_json,
)
from rlworkers.storage import basename, filesystem, join_path

LOGGER = "rlworkers.checkpoint"


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "runs" / "demo" / "checkpoints")
        return
    url = f"memory://ckpt-tests/{uuid.uuid4().hex}/checkpoints"
    yield url
    fs, p = fsspec.core.url_to_fs(url)
    if fs.exists(p):
        fs.rm(p, recursive=True)


def _put(path: str, data: bytes) -> None:
    fs, p = fsspec.core.url_to_fs(path)
    fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(p, data)


def _get(path: str) -> bytes:
    fs, p = fsspec.core.url_to_fs(path)
    return fs.cat_file(p)


def _exists(path: str) -> bool:
    fs, p = fsspec.core.url_to_fs(path)
    fs.invalidate_cache()
    return fs.exists(p)


def _save(root: str, step: int, payload: bytes = b"weights") -> str:
    """One full save as the driver does it: workers' shards, trainer state, commit."""
    step_dir = begin_checkpoint(root, step)
    _put(f"{step_dir}/actor/rank_0/model.safetensors", payload + bytes([step % 256]) * 1000)
    _put(f"{step_dir}/actor/rank_1/model.safetensors", payload * 3)
    write_json(f"{step_dir}/trainer_state.json", {"step": step, "dataloader": {"epoch": 0, "position": step}})
    commit_checkpoint(step_dir, {"world_size": 2})
    return step_dir


# ----------------------------------------------------------------------------------------------- commit / verify


def test_commit_verify_round_trip(root):
    step_dir = begin_checkpoint(root, 7)
    assert step_dir == f"{root}/step_7" and _exists(step_dir)
    shards = {"actor/rank_0/model.safetensors": os.urandom(3000), "actor/rank_1/optim.pt": b"opt" * 50}
    for rel, data in shards.items():
        _put(f"{step_dir}/{rel}", data)
    state = {"step": 7, "kl_ctl": {"value": 0.05}, "mlflow_run_id": "abc123", "config": {"lr": 1e-6}}
    write_json(f"{step_dir}/trainer_state.json", state)
    assert read_json(f"{step_dir}/trainer_state.json") == state

    manifest = commit_checkpoint(step_dir, {"world_size": 2}, required=["trainer_state.json"])
    expected = {**shards, "trainer_state.json": _get(f"{step_dir}/trainer_state.json")}
    assert manifest["format"] == ckpt.MANIFEST_FORMAT and manifest["step"] == 7
    assert manifest["metadata"] == {"world_size": 2} and manifest["created_at"]
    assert manifest["files"] == {
        rel: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)} for rel, d in expected.items()
    }
    # The manifest is on disk, is not listed in itself, and no temporary file is left behind.
    assert read_json(f"{step_dir}/manifest.json") == manifest
    fs, p = fsspec.core.url_to_fs(step_dir)
    assert sorted(f[len(p) + 1 :] for f in fs.find(p)) == sorted([*expected, "manifest.json"])
    assert verify_checkpoint(step_dir, required=["trainer_state.json"]) == manifest
    assert list_checkpoints(root) == [(7, step_dir)]
    # Committing again (e.g. a retried stage) re-hashes the same files and never lists the manifest itself.
    again = commit_checkpoint(step_dir, {"world_size": 2})
    assert again["files"] == manifest["files"]
    assert verify_checkpoint(step_dir) == again


def test_flipped_byte_names_the_file(root):
    step_dir = _save(root, 1)
    rel = "actor/rank_0/model.safetensors"
    data = bytearray(_get(f"{step_dir}/{rel}"))
    data[500] ^= 0xFF  # same size: only the hash can catch it
    _put(f"{step_dir}/{rel}", bytes(data))
    with pytest.raises(CorruptCheckpointError, match="sha256 mismatch") as err:
        verify_checkpoint(step_dir)
    assert rel in str(err.value) and step_dir in str(err.value)
    assert err.value.step_dir == step_dir
    verify_checkpoint(step_dir, check_hashes=False)  # the cheap check cannot see a same-size flip


def test_deleted_or_truncated_file(root):
    step_dir = _save(root, 1)
    rel = "actor/rank_1/model.safetensors"
    _put(f"{step_dir}/{rel}", b"short")
    with pytest.raises(CorruptCheckpointError, match="size mismatch") as err:
        verify_checkpoint(step_dir, check_hashes=False)
    assert rel in str(err.value)
    fs, p = fsspec.core.url_to_fs(f"{step_dir}/{rel}")
    fs.rm(p)
    with pytest.raises(CorruptCheckpointError, match="missing file") as err:
        verify_checkpoint(step_dir)
    assert rel in str(err.value) and step_dir in str(err.value)


def test_manifest_problems(root):
    step_dir = _save(root, 3)
    with pytest.raises(CorruptCheckpointError, match="required file 'rng.pt'"):
        verify_checkpoint(step_dir, required=["trainer_state.json", "rng.pt"])
    _put(f"{step_dir}/manifest.json", b"{not json")
    with pytest.raises(CorruptCheckpointError, match="unreadable manifest.json"):
        verify_checkpoint(step_dir)
    _put(f"{step_dir}/manifest.json", b'{"format": "other/9", "files": {}}')
    with pytest.raises(CorruptCheckpointError, match="format='other/9'"):
        verify_checkpoint(step_dir)
    fs, p = fsspec.core.url_to_fs(f"{step_dir}/manifest.json")
    fs.rm(p)
    with pytest.raises(CorruptCheckpointError, match="no manifest.json"):
        verify_checkpoint(step_dir)


def test_commit_refuses_bad_input(root):
    empty = begin_checkpoint(root, 1)
    with pytest.raises(ValueError, match="holds no file"):
        commit_checkpoint(empty, {})
    _put(f"{empty}/model.bin", b"x")
    with pytest.raises(ValueError, match="trainer_state.json"):
        commit_checkpoint(empty, {}, required=["trainer_state.json"])
    with pytest.raises(TypeError, match="JSON"):
        commit_checkpoint(empty, {"bad": object()})
    with pytest.raises(ValueError, match="step_<N>"):
        commit_checkpoint(f"{root}/not_a_step", {})
    # None of the refused commits left a manifest: the folder is still uncommitted.
    assert not _exists(f"{empty}/manifest.json")


def test_failed_manifest_rename_leaves_checkpoint_uncommitted(tmp_path, monkeypatch):
    step_dir = begin_checkpoint(str(tmp_path), 2)
    _put(f"{step_dir}/model.bin", b"abc")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        commit_checkpoint(step_dir, {})
    monkeypatch.undo()
    assert sorted(os.listdir(step_dir)) == ["model.bin"]  # no manifest, no temp file
    with pytest.raises(CorruptCheckpointError, match="no manifest.json"):
        verify_checkpoint(step_dir)


def test_sha256_is_streamed_in_chunks(tmp_path, monkeypatch):
    data = os.urandom(1000)
    (tmp_path / "w.bin").write_bytes(data)
    reads = []
    monkeypatch.setattr(ckpt, "_CHUNK_BYTES", 64)
    real_open = fsspec.implementations.local.LocalFileSystem.open

    def spy_open(self, path, mode="rb", **kw):
        f = real_open(self, path, mode, **kw)
        real_read = f.read
        f.read = lambda n=-1: reads.append(n) or real_read(n)
        return f

    monkeypatch.setattr(fsspec.implementations.local.LocalFileSystem, "open", spy_open)
    fs, p = fsspec.core.url_to_fs(str(tmp_path / "w.bin"))
    assert ckpt._sha256_and_size(fs, p) == (hashlib.sha256(data).hexdigest(), 1000)
    assert reads and set(reads) == {64}


# ----------------------------------------------------------------------------------------------- begin / find


def test_begin_cleans_stale_partial_folder(root, caplog):
    stale = f"{root}/step_5"
    _put(f"{stale}/actor/rank_0/half_written.safetensors", b"junk")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        step_dir = begin_checkpoint(root, 5)
    assert step_dir == stale and _exists(step_dir)
    assert not _exists(f"{stale}/actor/rank_0/half_written.safetensors")
    assert any("step_5" in r.getMessage() and "stale" in r.getMessage() for r in caplog.records)


def test_begin_refuses_to_replace_committed_checkpoint(root):
    step_dir = _save(root, 4)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        begin_checkpoint(root, 4)
    verify_checkpoint(step_dir)  # untouched
    assert begin_checkpoint(root, 4, overwrite=True) == step_dir
    assert not _exists(f"{step_dir}/manifest.json")
    with pytest.raises(ValueError, match="non-negative int"):
        begin_checkpoint(root, -1)


def test_find_latest_skips_partial_and_corrupt(root, caplog):
    assert find_latest_checkpoint(root) is None  # root does not even exist yet
    good = _save(root, 10)
    corrupt = _save(root, 20)
    _put(f"{corrupt}/actor/rank_1/model.safetensors", b"weightsweightsXeights")  # same size, other bytes
    partial = begin_checkpoint(root, 30)
    _put(f"{partial}/actor/rank_0/model.safetensors", b"half")
    assert [s for s, _ in list_checkpoints(root)] == [10, 20, 30]

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        found = find_latest_checkpoint(root)
    assert found is not None
    step_dir, manifest = found
    assert step_dir == good and manifest["step"] == 10
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step_30" in m and "no manifest.json" in m for m in warnings)
    assert any("step_20" in m and "sha256 mismatch" in m for m in warnings)


def test_find_latest_respects_required(root, caplog):
    _save(root, 1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert find_latest_checkpoint(root, required=["rng.pt"]) is None
    assert any("no valid checkpoint" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------------------------- retention


def _steps(root: str) -> list[int]:
    return [s for s, _ in list_checkpoints(root)]


def test_retention_keeps_last_valid_and_removes_older(root):
    for step in (10, 20, 30, 40):
        _save(root, step)
    broken = _save(root, 15)
    fs, p = fsspec.core.url_to_fs(f"{broken}/trainer_state.json")
    fs.rm(p)
    _put(f"{root}/step_25/actor/rank_0/partial.bin", b"x")  # stale partial older than newest valid
    _put(f"{root}/step_50/actor/rank_0/partial.bin", b"x")  # newer than newest valid: may be in progress

    assert apply_retention(root, None) == [] and apply_retention(root, 0) == []
    assert _steps(root) == [10, 15, 20, 25, 30, 40, 50]

    deleted = apply_retention(root, 2)
    assert sorted(deleted) == sorted(f"{root}/step_{s}" for s in (10, 15, 20, 25))
    assert _steps(root) == [30, 40, 50]
    verify_checkpoint(f"{root}/step_30")
    verify_checkpoint(f"{root}/step_40")


def test_retention_never_deletes_newest_valid(root):
    _save(root, 1)
    _save(root, 2)
    _put(f"{root}/step_3/shard.bin", b"partial")  # the save of step 3 crashed
    assert apply_retention(root, 1) == [f"{root}/step_1"]
    assert _steps(root) == [2, 3]
    assert find_latest_checkpoint(root)[0] == f"{root}/step_2"

    only_partial = f"{root}-other"
    _put(f"{only_partial}/step_1/shard.bin", b"partial")
    assert apply_retention(only_partial, 1) == []
    assert _steps(only_partial) == [1]


# ----------------------------------------------------------------------------------------------- resume


def test_resolve_resume_auto_never_and_paths(root):
    assert resolve_resume(root, "auto") is None
    first = _save(root, 1)
    second = _save(root, 2)
    assert resolve_resume(root, "never") is None
    step_dir, manifest = resolve_resume(root, "auto")
    assert step_dir == second and manifest["step"] == 2
    step_dir, manifest = resolve_resume(root, first)
    assert step_dir == first and manifest["step"] == 1 and manifest["metadata"] == {"world_size": 2}

    with pytest.raises(FileNotFoundError, match="resume='auto'"):
        resolve_resume(root, f"{root}/step_99")
    _put(f"{first}/trainer_state.json", b"{}")
    with pytest.raises(CorruptCheckpointError, match="step_1.*trainer_state.json.*older step_<N>"):
        resolve_resume(root, first)
    with pytest.raises(CorruptCheckpointError, match="checkpoints root"):
        resolve_resume(root, root)
    with pytest.raises(TypeError, match="auto"):
        resolve_resume(root, None)


def test_path_helpers_keep_urls_and_strip_trailing_slashes(tmp_path):
    fs, path = filesystem("memory://bucket/runs/x/")
    assert "memory" in fs.protocol and path == "/bucket/runs/x"
    assert filesystem(f"{tmp_path}/runs/")[1] == f"{tmp_path}/runs"
    assert join_path("s3://bucket/runs/", "x", "step_3") == "s3://bucket/runs/x/step_3"
    assert basename("s3://bucket/runs/x/step_3/") == "step_3"
