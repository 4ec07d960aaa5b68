"""Local services: a Prefect API server and an MLflow tracking server for this project, a local Ray that runs join
(flows/plumbing/kept.py) and the controller fork server that `rlflow` commands start from
(flows/plumbing/forkserver.py).

``rlflow server up`` starts them as detached background processes that keep running after the command returns,
with SQLite backends under a project-local state folder (``.rlflow/`` in the current directory, or ``$RLFLOW_HOME``),
bound to 127.0.0.1 unless ``--host`` says otherwise. It waits until both answer their health endpoints, records
their pids in ``<state_dir>/services.json`` and writes ``<state_dir>/env.sh``::

    rlflow server up            # idempotent: healthy services recorded in services.json are reused
    source .rlflow/env.sh       # exports PREFECT_API_URL and MLFLOW_TRACKING_URI
    rlflow server status
    rlflow server down

The ``rlflow server`` commands are in ``flows/ops/cli.py``; the checks that flows run before they start (is the
Prefect API reachable, is the MLflow tracking URI usable) are in ``flows/ops/preflight.py``.

Layout of the state folder::

    services.json  env.sh  logs/{prefect,mlflow,ray,controller}.log
    controller.sock  the controller fork server's socket (flows/plumbing/forkserver.py)
    prefect/       PREFECT_HOME of the server: prefect.db (SQLite)
    mlflow/        mlflow.db (SQLite backend store), artifacts/ (served over HTTP by the tracking server),
                   basic_auth.ini + basic_auth.db (MLflow's users, with --auth)

With ``--auth`` (``$RLFLOW_SERVER_AUTH``, ``user:password``) both servers ask every client for that user and
password: Prefect's server through ``PREFECT_SERVER_API_AUTH_STRING`` (clients send ``PREFECT_API_AUTH_STRING``),
MLflow's through its ``basic-auth`` app with that user as admin (clients send ``MLFLOW_TRACKING_USERNAME`` /
``MLFLOW_TRACKING_PASSWORD``). Health endpoints stay open. ``env.sh`` then derives the client variables from
``$RLFLOW_SERVER_AUTH`` and holds no secret itself.

Over 450 lines: one concern, the process control of the two servers (start, health, reuse, stop, status) and the
settings they start with (SQLite or PostgreSQL, artifacts, authentication).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from flows.plumbing import kept
from flows.plumbing.forkserver import CONTROLLER_ENV as CONTROLLER  # the controller fork server's socket, in env.sh
from flows.plumbing.forkserver import SOCKET_NAME
from flows.plumbing.kept import LOCAL_RAY_ENV as LOCAL_RAY  # the local Ray's address, in env.sh
from flows.plumbing.servers import (
    MLFLOW_TRACKING_URI,
    PREFECT_API_URL,
    ServiceError,
    default_state_dir,
    http_ok,
)

logger = logging.getLogger(__name__)

SERVICES = ("prefect", "mlflow", "ray", "controller")
_SERVICES_FILE = "services.json"
_WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


class ServiceConfig(BaseModel):
    """Where and how the local services run. Binding to anything but 127.0.0.1 must be asked for with ``host``."""

    model_config = ConfigDict(frozen=True)

    state_dir: Path = Field(
        default_factory=default_state_dir,
        validate_default=True,
        description="State folder (default .rlflow in the current directory, or $RLFLOW_HOME).",
    )
    host: str = Field("127.0.0.1", description="Interface both servers bind to; 0.0.0.0 exposes them to the network.")
    prefect_port: int = Field(4200, ge=1, le=65535)
    mlflow_port: int = Field(5000, ge=1, le=65535)
    ray_port: int = Field(6390, ge=1, le=65535, description="Port of the local Ray's GCS (on 127.0.0.1 only).")
    ray_cpus: int | None = Field(
        None, ge=1, description="Logical CPUs of the local Ray: slots for worker processes (default max(8, cores))."
    )
    startup_timeout_s: float = Field(90.0, gt=0, description="How long to wait for both health endpoints.")
    stop_grace_s: float = Field(10.0, ge=0, description="SIGTERM to SIGKILL delay when stopping.")
    postgres: str | None = Field(
        None,
        description="postgresql://user:password@host:port of a PostgreSQL server: Prefect's server keeps its state in "
        "its database 'prefect', MLflow's in 'mlflow' (both created when missing); unset = SQLite files in state_dir",
    )
    artifacts: str | None = Field(
        None,
        description="where MLflow's server stores artifacts and models (e.g. s3://bucket/mlflow; credentials and "
        "MLFLOW_S3_ENDPOINT_URL from the environment); unset = state_dir/mlflow/artifacts",
    )
    auth: SecretStr | None = Field(
        None,
        description="user:password that both servers ask every client for (Prefect's API auth string, MLflow's "
        "basic-auth admin); unset = no authentication (fine on 127.0.0.1, not on a shared interface)",
    )
    # One uvicorn worker: the handlers are thread-pooled, so one worker serves several logging processes, and
    # MLflow's default of 4 starts 4 Python processes (and pays their start-up) for a server one person uses.
    mlflow_workers: int = Field(1, ge=1)

    @field_validator("state_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        # Absolute once, here: the SQLite URIs and env.sh must not depend on a later working directory.
        return value.expanduser().resolve()

    @field_validator("auth")
    @classmethod
    def _user_and_password(cls, value: SecretStr | None) -> SecretStr | None:
        user, _, password = (value.get_secret_value() if value else ":").partition(":")
        if value is not None and not (user and password):
            raise ValueError("auth (RLFLOW_SERVER_AUTH / --auth) must be user:password, both non-empty")
        if value is not None and len(password) < 12:  # MLflow refuses a shorter admin password at start-up
            raise ValueError("auth (RLFLOW_SERVER_AUTH / --auth): the password needs at least 12 characters")
        return value

    @property
    def credentials(self) -> tuple[str, str] | None:
        """(user, password) of ``auth``, or None."""
        if self.auth is None:
            return None
        user, _, password = self.auth.get_secret_value().partition(":")
        return user, password

    @property
    def env_file(self) -> Path:
        """The shell file that exports PREFECT_API_URL and MLFLOW_TRACKING_URI (written by ``start_services``)."""
        return self.state_dir / "env.sh"


@dataclass(frozen=True)
class _Spec:
    """How to launch one service and how to tell that it is up."""

    name: str
    port: int
    option: str  # the CLI option that changes the port, named in errors
    url: str  # what clients use (UI link, tracking URI, base of the API URL)
    health_url: str
    command: list[str]
    env: dict[str, str]
    log: Path
    waited_for: bool = True  # `up` waits until it answers (the controller answers once it imported everything)
    niceness: int = 0  # its CPU priority (os.setpriority) if above the shell's: it yields to lower ones; 0: the shell's


def _url_host(host: str) -> str:
    """The host clients use to reach a server bound to ``host`` (a wildcard bind is reached on loopback)."""
    if host in _WILDCARD_HOSTS:
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _prefect_spec(config: ServiceConfig) -> _Spec:
    home = config.state_dir / "prefect"
    url = f"http://{_url_host(config.host)}:{config.prefect_port}"
    env = {
        "PREFECT_HOME": str(home),  # profiles and DB of the server live in the state folder, not ~/.prefect
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": postgres_url(config.postgres, "prefect", "asyncpg")
        if config.postgres
        else f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # start-up analytics need the internet
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
        "PREFECT_UI_API_URL": f"{url}/api",  # else the UI would follow a PREFECT_API_URL inherited from the shell
        "DO_NOT_TRACK": "true",  # SDK telemetry of the `prefect` CLI process
    }
    if config.auth:
        env["PREFECT_SERVER_API_AUTH_STRING"] = config.auth.get_secret_value()
    # Background services (scheduler, late runs, cancellation clean-up, concurrency lease reaping) stay on: the
    # deployments' schedules and concurrency limits need them. With one worker they run inside the server process.
    # The task run recorder writes task runs from their state events; by default it commits one event at a time, a
    # SQLite transaction for each of a task's three states (Pending, Running, Completed). Batched, the server used
    # half the CPU during training (0.25 -> 0.12 cores, demo SFT on 2 cores); task runs reach the API and UI up to a
    # second later. A value set in the environment wins.
    for setting, value in (("BATCH_SIZE", "50"), ("FLUSH_INTERVAL", "1")):
        name = f"PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_{setting}"
        env[name] = os.environ.get(name, value)
    command = [
        sys.executable,
        "-m",
        "prefect",
        "server",
        "start",
        "--host",
        config.host,
        "--port",
        str(config.prefect_port),
        "--analytics-off",
        "--no-prompt",
    ]
    return _Spec(
        "prefect",
        config.prefect_port,
        "--prefect-port",
        url,
        f"{url}/api/health",
        command,
        env,
        config.state_dir / "logs" / "prefect.log",
        # Ray's workers run at niceness 15 (its worker_niceness): at 0 the server's recording of each task run's
        # states took the cores from a step's training whenever it woke, on a machine whose cores the workers fill;
        # at theirs it shares them, and what it records reaches the API as soon (docs/performance.md).
        niceness=int(os.environ.get("RAY_worker_niceness", "15")),
    )


def _mlflow_spec(config: ServiceConfig) -> _Spec:
    root = config.state_dir / "mlflow"
    url = f"http://{_url_host(config.host)}:{config.mlflow_port}"
    # --serve-artifacts + --artifacts-destination: new experiments get `mlflow-artifacts:/<id>` locations and
    # clients upload/download artifacts and models over HTTP through the server. Any process that can reach the
    # URL can log (Ray workers, another working directory, a container), and no client-side path is stored in
    # the DB. With --default-artifact-root <dir> each client would write to <dir> on its own filesystem instead.
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--serve-artifacts",
        "--artifacts-destination",
        config.artifacts or str(root / "artifacts"),
        "--host",
        config.host,
        "--port",
        str(config.mlflow_port),
        "--workers",
        str(config.mlflow_workers),
        *(["--app-name", "basic-auth"] if config.auth else []),
    ]
    env = {
        # the store in the environment, not on the command line: a PostgreSQL URL holds a password
        "MLFLOW_BACKEND_STORE_URI": postgres_url(config.postgres, "mlflow", "psycopg")
        if config.postgres
        else f"sqlite:///{root / 'mlflow.db'}",
        # The job runner (a huey consumer for GenAI judge jobs) is not used by RL training: one process fewer.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
    }
    if config.credentials:
        env["MLFLOW_AUTH_CONFIG_PATH"] = str(root / "basic_auth.ini")  # written by _write_mlflow_auth_config
        env["MLFLOW_AUTH_ADMIN_USERNAME"], env["MLFLOW_AUTH_ADMIN_PASSWORD"] = config.credentials
        # signs the UI's forms (CSRF); a new one at each start only logs browsers out
        env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = os.environ.get("MLFLOW_FLASK_SERVER_SECRET_KEY") or secrets.token_hex(
            32
        )
    return _Spec(
        "mlflow",
        config.mlflow_port,
        "--mlflow-port",
        url,
        f"{url}/health",
        command,
        env,
        config.state_dir / "logs" / "mlflow.log",
    )


def postgres_url(server: str, database: str, driver: str) -> str:
    """SQLAlchemy's URL of ``database`` on the PostgreSQL ``server`` (postgresql://user:password@host:port)."""
    parsed = urllib.parse.urlsplit(server)
    if parsed.scheme not in ("postgresql", "postgres") or not parsed.hostname:
        raise ValueError(f"--postgres {server!r}: give postgresql://user:password@host:port")
    return f"postgresql+{driver}://{parsed.netloc}/{database}"


def ensure_postgres_databases(server: str, databases: tuple[str, ...] = ("prefect", "mlflow")) -> list[str]:
    """Create the servers' databases on ``server`` when missing (the user needs CREATEDB); returns those created.

    Raises:
        ServiceError: the server cannot be reached or refuses, with what to check.
    """
    import psycopg

    parsed = urllib.parse.urlsplit(server)
    try:
        with psycopg.connect(f"postgresql://{parsed.netloc}/postgres", autocommit=True, connect_timeout=10) as conn:
            existing = {row[0] for row in conn.execute("SELECT datname FROM pg_database")}
            created = [name for name in databases if name not in existing]
            for name in created:
                conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.Error as error:
        raise ServiceError(
            f"PostgreSQL at {parsed.hostname}:{parsed.port or 5432} as {parsed.username!r}: "
            f"{str(error).strip().splitlines()[0]}. Check that the server runs, the user and password, and that the "
            f"user may create databases (or create {', '.join(databases)} yourself)"
        ) from None
    return created


def _write_mlflow_auth_config(config: ServiceConfig) -> None:
    """MLflow's basic-auth settings: its users in ``basic_auth.db`` beside the tracking store (database
    'mlflow_auth' on PostgreSQL), the admin (``auth``'s user, created on the first start) given in the environment.
    Signed-in users may read every experiment, and change only what they are granted (MLflow's default). A user's
    password is checked once a minute, not at every request (MLflow's auth_cache_ttl_seconds, off by default): its
    scrypt hash is slow by design (docs/performance.md), and a run sends hundreds of requests. A
    wrong password is checked every time; a changed or deleted one is refused within a minute at most."""
    root = config.state_dir / "mlflow"
    root.mkdir(parents=True, exist_ok=True)
    database = (
        postgres_url(config.postgres, "mlflow_auth", "psycopg")
        if config.postgres
        else f"sqlite:///{root / 'basic_auth.db'}"
    )
    path = root / "basic_auth.ini"
    path.touch(mode=0o600)  # a PostgreSQL URL holds a password
    path.write_text(
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = {database}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        "grant_default_workspace_access = false\n"
        "auth_cache_ttl_seconds = 60\n"
    )


def _ray_spec(config: ServiceConfig) -> _Spec:
    """The local Ray that runs join when they are given no other (flows/controller/groups.py ``ray_settings``), where
    worker processes are kept from run to run (flows/plumbing/kept.py). Clients reach it at 127.0.0.1; Ray itself
    listens on the node's address, as the Ray a run starts for itself does, with Ray's token authentication (its
    default, the token in ~/.ray/auth_token). Its temporary folder is its own (see ``local_ray_command``)."""
    import hashlib

    digest = hashlib.blake2b(str(config.state_dir).encode(), digest_size=4).hexdigest()
    address = f"127.0.0.1:{config.ray_port}"
    num_cpus = config.ray_cpus or max(8, os.cpu_count() or 1)
    command = local_ray_command(config.ray_port, num_cpus, f"/tmp/rlflow-ray-{digest}")
    return _Spec("ray", config.ray_port, "--ray-port", address, f"tcp://{address}", command, LOCAL_RAY_PROCESS_ENV,
                 config.state_dir / "logs" / "ray.log")  # fmt: skip


def _controller_spec(config: ServiceConfig) -> _Spec:
    """The controller fork server (flows/plumbing/forkserver.py): `rlflow` commands run in its forked children, with
    torch, transformers, Prefect, MLflow and Ray imported once. It listens once it imported them, seconds after the
    servers answer: `up` does not wait for it, and until then commands run in their own processes, as without it."""
    path = config.state_dir / SOCKET_NAME
    # a file, not a module: the server serves the checkout it is in (and importing it would import the CLI)
    command = [sys.executable, str(Path(__file__).resolve().with_name("warm_controller.py")), str(path)]
    return _Spec("controller", 0, "", f"unix://{path}", f"unix://{path}", command, {},
                 config.state_dir / "logs" / "controller.log", waited_for=False)  # fmt: skip


# The environment of a Ray of one node that outlives its runs (``local_ray_command``): no metrics, no usage stats, and
# its dashboard agent's reporter, whose node and worker statistics only a dashboard shows (there is none), once a
# minute instead of every 5 s: it costs an idle Ray CPU all along (docs/performance.md)
LOCAL_RAY_PROCESS_ENV = {
    "RAY_enable_metrics_collection": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
}


def local_ray_command(port: int, num_cpus: int, temp_dir: str) -> list[str]:
    """`ray start --head --block` of a Ray of one node on ``port`` (also the test processes' own Rays,
    tests/conftest.py): no dashboard, autoscaler or log monitor (metrics: the caller's environment). Its temporary
    folder ``temp_dir`` is its own (a short path: Ray's socket paths have a length limit), so a bare ``ray.init()``
    never finds and joins it; Ray Client's server and the dashboard agent take free ports, where `ray start` has
    fixed defaults that two such Rays on one machine would share."""
    return [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
        f"--port={port}", f"--num-cpus={num_cpus}",
        "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}",
        "--no-monitor",  # no autoscaler: a Ray of one node
        # runs join with log_to_driver=False (flows/controller/groups.py): nothing reads the worker output a log monitor
        # pushes (it stays in the temporary folder's logs), and the monitor polls every log file of the node all along
        "--include-log-monitor=false",
        f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
        # every actor rlflow starts has a runtime env of its own: idle workers started for a job go unused
        '--system-config={"prestart_worker_first_driver": false}',
    ]  # fmt: skip


# Ray's worker processes listen on ports 10002-19999 (`ray start --min-worker-port/--max-worker-port`'s defaults)
RAY_WORKER_PORTS = range(10002, 20000)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, from the ports no process takes by itself: above Ray's worker ports and below
    the kernel's ephemeral ones, where a socket bound to port 0 lands and where Ray picks its own at random. A port
    from either range can be taken by another process between this call and the bind of the server it is meant for
    (a Ray starting workers beside the suite once answered a Prefect server's health check); the kernel's pick
    when that gap is too small."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    candidates = range(RAY_WORKER_PORTS.stop, ephemeral_low)
    if len(candidates) >= 1000:
        for port in (secrets.choice(candidates) for _ in range(100)):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _specs(config: ServiceConfig) -> dict[str, _Spec]:
    return {
        "prefect": _prefect_spec(config),
        "mlflow": _mlflow_spec(config),
        "ray": _ray_spec(config),
        "controller": _controller_spec(config),
    }


# ---------------------------------------------------------------------------------------------- processes


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of ``pid`` from /proc, or None when it does not exist or /proc is missing."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[2])


def _reap(pid: int) -> None:
    # Servers started by this process are our children: collect them so they do not linger as zombies.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in process group ``pgid``."""
    _reap(pgid)
    if Path("/proc").is_dir():
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and (stat := _proc_stat(int(entry.name))) and stat[1] == pgid and stat[0] != "Z":
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_ours(pid: int, name: str) -> bool:
    """Whether ``pid`` still leads the process group of an rlflow-started ``name`` server (pids get reused)."""
    if not _group_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True  # no /proc: trust the live process group
    stat = _proc_stat(pid)
    if name == "controller":
        ours = any(word.endswith(b"flows/ops/warm_controller.py") for word in cmdline)
    else:
        marker = (b"ray.scripts.scripts", b"start") if name == "ray" else (name.encode(), b"server")
        ours = all(word in cmdline for word in marker)
    return ours and stat is not None and stat[1] == pid


def _stop_group(pid: int, grace_s: float) -> bool:
    """SIGTERM the process group led by ``pid``, SIGKILL what is left after ``grace_s``. True if it was running."""
    if not _group_alive(pid):
        return False
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _group_alive(pid):
                return True
            time.sleep(0.1)
    if _group_alive(pid):
        raise ServiceError(f"Process group {pid} survived SIGKILL; look at it with `ps -g {pid}`.")
    return True


def _check_port_free(host: str, spec: _Spec) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR: a port left in TIME_WAIT by a server we just stopped counts as free (as for the servers).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, spec.port))
        except socket.gaierror:
            raise ServiceError(
                f"Cannot bind to host {host!r}: not an address of this machine (`rlflow server up --host`)."
            ) from None
        except OSError as error:
            raise ServiceError(
                f"Port {spec.port} on {host} is already in use by another process, so the {spec.name} server "
                f"cannot start ({error.strerror}). Stop that process, or choose another port: "
                f"`rlflow server up {spec.option} <port>` (ServiceConfig.{spec.name}_port)."
            ) from None


def _launch(spec: _Spec, cwd: Path) -> subprocess.Popen[bytes]:
    spec.log.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in (PREFECT_API_URL, "PREFECT_API_KEY")}
    env.update(spec.env)
    with open(spec.log, "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(spec.command)}\n".encode())
        log.flush()
        # A new session: the server outlives this command and is not hit by the terminal's Ctrl-C; its pid is
        # also the id of its process group, which holds the uvicorn children that `down` must stop too.
        process = subprocess.Popen(
            spec.command,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    own = os.getpriority(os.PRIO_PROCESS, 0)
    if spec.niceness > own:  # set while its interpreter starts, before it starts a process of its own
        os.setpriority(os.PRIO_PROCESS, process.pid, spec.niceness)
    return process


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def _wait_healthy(specs: list[_Spec], procs: dict[str, subprocess.Popen[bytes]], timeout_s: float) -> None:
    pending = {spec.name: spec for spec in specs if spec.waited_for}
    deadline = time.monotonic() + timeout_s
    while pending:
        for name, spec in list(pending.items()):
            if http_ok(spec.health_url, timeout=1.0):
                del pending[name]
            elif (code := procs[name].poll()) is not None:
                raise ServiceError(
                    f"The {name} server exited with code {code} before answering {spec.health_url}. "
                    f"Last lines of {spec.log}:\n{_log_tail(spec.log)}"
                )
        if pending and time.monotonic() > deadline:
            spec = next(iter(pending.values()))
            raise ServiceError(
                f"The {spec.name} server did not answer {spec.health_url} within {timeout_s:g} s "
                f"(ServiceConfig.startup_timeout_s). Last lines of {spec.log}:\n{_log_tail(spec.log)}"
            )
        if pending:
            time.sleep(0.25)


# ---------------------------------------------------------------------------------------------- state files


@contextlib.contextmanager
def _locked(config: ServiceConfig) -> Iterator[None]:
    """Serialize up/down on one state folder (two `rlflow server up` at once would start four servers)."""
    config.state_dir.mkdir(parents=True, exist_ok=True)
    with open(config.state_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _read_record(config: ServiceConfig) -> dict[str, Any]:
    path = config.state_dir / _SERVICES_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError:
        logger.warning("Ignoring unreadable %s", path)
        return {}


def _write_record(config: ServiceConfig, record: Mapping[str, Any]) -> None:
    path = config.state_dir / _SERVICES_FILE
    if not any(name in record for name in SERVICES):
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)


def _service_urls(config: ServiceConfig, record: Mapping[str, Any]) -> dict[str, Any]:
    prefect, mlflow = record["prefect"], record["mlflow"]
    return {
        PREFECT_API_URL: f"{prefect['url']}/api",
        MLFLOW_TRACKING_URI: mlflow["url"],
        "prefect_ui": prefect["url"],
        "mlflow_ui": mlflow["url"],
        "prefect_pid": prefect["pid"],
        "mlflow_pid": mlflow["pid"],
        LOCAL_RAY: record["ray"]["url"] if "ray" in record else None,
        "ray_pid": record["ray"]["pid"] if "ray" in record else None,
        CONTROLLER: record["controller"]["url"].removeprefix("unix://") if "controller" in record else None,
        "controller_pid": record["controller"]["pid"] if "controller" in record else None,
        "env_file": str(config.env_file),
        "auth": bool(prefect.get("auth") or mlflow.get("auth")),
    }


def _write_env_file(urls: Mapping[str, Any]) -> None:
    lines = [
        "# Written by `rlflow server up`; load with: source " + urls["env_file"],
        f"export {PREFECT_API_URL}={urls[PREFECT_API_URL]}",
        f"export {MLFLOW_TRACKING_URI}={urls[MLFLOW_TRACKING_URI]}",
    ]
    if urls.get(LOCAL_RAY):  # runs join it (and keep their worker processes there from run to run)
        lines.append(f"export {LOCAL_RAY}={urls[LOCAL_RAY]}")
    if urls.get(CONTROLLER):  # `rlflow` commands run in its forked children
        lines.append(f"export {CONTROLLER}={urls[CONTROLLER]}")
    if urls["auth"]:  # the credentials come from the shell, never from this file
        lines += [
            "# The servers ask for a user and password: export RLFLOW_SERVER_AUTH=user:password before sourcing",
            'export PREFECT_API_AUTH_STRING="${RLFLOW_SERVER_AUTH:?export RLFLOW_SERVER_AUTH=user:password first}"',
            'export MLFLOW_TRACKING_USERNAME="${RLFLOW_SERVER_AUTH%%:*}"',
            'export MLFLOW_TRACKING_PASSWORD="${RLFLOW_SERVER_AUTH#*:}"',
        ]
    Path(urls["env_file"]).write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------- public API


def start_services(config: ServiceConfig | None = None) -> dict[str, Any]:
    """Start (or reuse) the Prefect and MLflow servers and wait until both are healthy.

    Returns ``{"PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RLFLOW_LOCAL_RAY", "RLFLOW_CONTROLLER", "prefect_ui",
    "mlflow_ui", "prefect_pid", "mlflow_pid", "ray_pid", "controller_pid", "env_file", "auth"}``; the upper-case keys
    are also written to ``<state_dir>/env.sh``.

    Raises:
        ServiceError: a port is taken by another process, a server exited or did not become healthy within
            ``startup_timeout_s`` (the message holds the end of its log), or services recorded in this state
            folder run on other ports than asked for.
    """
    config = config or ServiceConfig()
    specs = _specs(config)
    with _locked(config):
        record = _read_record(config)
        to_start = []
        for name, spec in specs.items():
            old = record.get(name)
            if old and _is_ours(old["pid"], name):
                if old["url"] != spec.url or old.get("auth", False) != bool(config.auth):
                    raise ServiceError(
                        f"A {name} server from {config.state_dir} already runs at {old['url']} "
                        f"({'with' if old.get('auth') else 'without'} authentication), not {spec.url} "
                        f"({'with' if config.auth else 'without'}). Run `rlflow server down` first to change it."
                    )
                if http_ok(old["health_url"]) or not spec.waited_for:  # (the controller may still be importing)
                    logger.info("Reusing the %s server at %s (pid %s)", name, old["url"], old["pid"])
                    continue
                logger.warning(
                    "The %s server (pid %s) does not answer %s; restarting it", name, old["pid"], old["health_url"]
                )
                _stop_group(old["pid"], config.stop_grace_s)
            to_start.append(spec)
        for spec in (spec for spec in to_start if spec.port):  # check every port before starting anything
            _check_port_free("127.0.0.1" if spec.name == "ray" else config.host, spec)
        if config.postgres and to_start:
            databases = ("prefect", "mlflow", *(["mlflow_auth"] if config.auth else []))
            for name in ensure_postgres_databases(config.postgres, databases):
                logger.info("Created the PostgreSQL database %r", name)
        if config.auth and specs["mlflow"] in to_start:
            _write_mlflow_auth_config(config)
        procs = _start_and_wait(config, to_start, record)
        record["host"] = config.host
        _write_record(config, record)
        urls = _service_urls(config, record)
        _write_env_file(urls)
    for name, proc in procs.items():
        logger.info("Started the %s server at %s (pid %s)", name, specs[name].url, proc.pid)
    return urls


def _start_and_wait(config: ServiceConfig, specs: list[_Spec], record: dict[str, Any]) -> dict[str, Any]:
    """Launch ``specs`` side by side, record them, wait for health; on failure stop what was launched."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for spec in specs:
            if spec.name == "ray":
                kept.ensure_token()
            procs[spec.name] = _launch(spec, cwd=config.state_dir)
            record[spec.name] = {
                "pid": procs[spec.name].pid,
                "url": spec.url,
                "health_url": spec.health_url,
                "port": spec.port,
                "log": str(spec.log),
                "command": spec.command,
                "auth": bool(config.auth),
            }
        _write_record(config, record)  # before waiting, so that `down` can clean up a start that hangs
        _wait_healthy(specs, procs, config.startup_timeout_s)
    except BaseException:
        for name, proc in procs.items():
            _stop_group(proc.pid, grace_s=2.0)
            record.pop(name, None)
        _write_record(config, record)
        raise
    return procs


def stop_services(config: ServiceConfig | None = None) -> dict[str, bool]:
    """Stop both servers (SIGTERM to their process groups, SIGKILL after ``stop_grace_s``) and the local Ray
    (SIGKILL) and remove services.json. The local Ray's worker processes (each a session of its own) are waited
    for, and killed if they outlive it by ``stop_grace_s``. Idempotent. Returns ``{name: whether it was running}``."""
    import psutil

    config = config or ServiceConfig()
    if not (config.state_dir / _SERVICES_FILE).exists():
        return {name: False for name in SERVICES}
    with _locked(config):
        record = _read_record(config)
        stopped = {}
        for name in SERVICES:
            entry = record.get(name)
            running = bool(entry) and _is_ours(entry["pid"], name)
            workers = []
            if running and name == "ray":
                with contextlib.suppress(psutil.Error):
                    workers = psutil.Process(entry["pid"]).children(recursive=True)
            # on SIGTERM Ray's raylet and GCS shut down gracefully for tens of seconds, for state nothing reads
            # again (the local Ray holds processes, not data): it gets SIGKILL at once, as by `ray stop --force`
            grace_s = 0.0 if name == "ray" else config.stop_grace_s
            stopped[name] = running and _stop_group(entry["pid"], grace_s)
            _, left = psutil.wait_procs(workers, timeout=config.stop_grace_s)
            for process in left:
                with contextlib.suppress(psutil.Error):
                    process.kill()
        (config.state_dir / _SERVICES_FILE).unlink(missing_ok=True)
    return stopped


def service_status(config: ServiceConfig | None = None) -> dict[str, dict[str, Any]]:
    """``{name: {"url", "pid", "alive", "healthy", "log"}}`` for both services. Without a record, ``url`` is
    the configured one and ``healthy`` says whether something answers there anyway."""
    config = config or ServiceConfig()
    record = _read_record(config)
    status = {}
    for name, spec in _specs(config).items():
        entry = record.get(name) or {}
        status[name] = {
            "url": entry.get("url", spec.url),
            "pid": entry.get("pid"),
            "alive": bool(entry) and _is_ours(entry["pid"], name),
            "healthy": http_ok(entry.get("health_url", spec.health_url)),
            "log": entry.get("log", str(spec.log)),
            "auth": entry.get("auth", False),
        }
    return status
