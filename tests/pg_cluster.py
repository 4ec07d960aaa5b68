"""A private PostgreSQL cluster for the tests that run the servers on PostgreSQL (tests/test_topology.py,
tests/test_schedule.py): Debian's postgresql server binaries (`apt-get install postgresql`; `.ci/run` installs
them), run as the postgres user, so root is needed; the tests skip with that hint otherwise."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows.ops.services import free_port


def postgres_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        pytest.skip("PostgreSQL's server is not installed: `apt-get install postgresql` (Debian) runs this test")
    if os.geteuid() != 0:
        pytest.skip("starting a private PostgreSQL cluster needs root (to run it as the postgres user)")
    return Path(found[-1]).parent


def _as_postgres(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", "postgres", "--", *args], capture_output=True, text=True, timeout=120)


@contextlib.contextmanager
def private_postgres() -> Iterator[dict]:
    """A PostgreSQL cluster on 127.0.0.1 (its own folder and port), with a login role that may create databases, as
    a team's database server would hand out; removed afterwards. Yields {"url", "port", "psql"}."""
    bin_dir = postgres_bin()
    folder = Path(tempfile.mkdtemp(prefix="rlpg-", dir="/tmp"))  # not under pytest's root-only folders
    shutil.chown(folder, "postgres")
    folder.chmod(0o700)
    port = free_port()
    done = _as_postgres(str(bin_dir / "initdb"), "-D", str(folder / "data"), "--auth-local=trust", "-U", "postgres")
    assert done.returncode == 0, done.stderr
    options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1"
    done = _as_postgres(str(bin_dir / "pg_ctl"), "-D", str(folder / "data"), "-o", options, "-l", str(folder / "log"),
                        "-w", "start")  # fmt: skip
    assert done.returncode == 0, done.stderr + (folder / "log").read_text()
    try:
        password = uuid.uuid4().hex
        sql = f"CREATE ROLE team LOGIN PASSWORD '{password}' CREATEDB"
        done = _as_postgres(str(bin_dir / "psql"), "-h", str(folder), "-p", str(port), "-U", "postgres", "-c", sql)
        assert done.returncode == 0, done.stderr
        yield {"url": f"postgresql://team:{password}@127.0.0.1:{port}", "port": port, "psql": (bin_dir, folder)}
    finally:
        _as_postgres(str(bin_dir / "pg_ctl"), "-D", str(folder / "data"), "-m", "fast", "stop")
        shutil.rmtree(folder, ignore_errors=True)


def query(postgres: dict, database: str, sql: str) -> list[str]:
    """The rows of ``sql`` in ``database``, as psql prints them (one value per row)."""
    bin_dir, folder = postgres["psql"]
    done = _as_postgres(str(bin_dir / "psql"), "-h", str(folder), "-p", str(postgres["port"]), "-U", "postgres",
                        "-d", database, "-tAc", sql)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.split()
