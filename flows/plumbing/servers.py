"""The Prefect API and the MLflow tracking server a flow talks to: the variables that name them, a health probe
(``http_ok``), and the checks a run makes before it starts (``require_prefect_api``, ``require_mlflow_tracking``),
each refusal naming the fix. Without PREFECT_API_URL Prefect would start a temporary in-process API server, and under
the Ray task runner every Ray worker would start its own (../shared/reference/prefect_mlflow.md §0.6, §3), so that
is refused. Starting the servers is ``flows/ops/services.py``'s job."""

from __future__ import annotations

import base64
import contextlib
import http.client
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path

PREFECT_API_URL = "PREFECT_API_URL"
MLFLOW_TRACKING_URI = "MLFLOW_TRACKING_URI"
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


class ServiceError(RuntimeError):
    """A local service cannot be started, reached or used; the message says how to fix it."""


def default_state_dir() -> Path:
    return Path(os.environ.get("RLFLOW_HOME") or ".rlflow")


def http_status(url: str, timeout: float = 2.0, headers: Mapping[str, str] | None = None) -> int | None:
    """The HTTP status of GET ``url`` (None when nothing answers). Loopback requests bypass any http_proxy of the
    environment."""
    host = urllib.parse.urlsplit(url).hostname or ""
    handlers = [urllib.request.ProxyHandler({})] if host in LOCAL_HOSTS else []
    try:
        with urllib.request.build_opener(*handlers).open(
            urllib.request.Request(url, headers=dict(headers or {})), timeout=timeout
        ) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    # URLError, timeouts and refused connections are OSErrors; HTTPException: an answer not in HTTP (another program)
    except (OSError, ValueError, http.client.HTTPException):
        return None


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True when GET ``url`` answers 2xx; for a ``tcp://host:port`` URL (the local Ray's) or a ``unix://path`` one
    (the controller fork server's socket), when it accepts connections."""
    if url.startswith("unix://"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect(url[len("unix://") :])
                return True
            except OSError:
                return False
    if url.startswith("tcp://"):
        host, _, port = url[len("tcp://") :].rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                return True
        except (OSError, ValueError):
            return False
    status = http_status(url, timeout)
    return status is not None and 200 <= status < 300


def basic_auth_header(user_and_password: str) -> dict[str, str]:
    """The ``Authorization`` header of HTTP basic authentication for ``user:password``."""
    return {"Authorization": "Basic " + base64.b64encode(user_and_password.encode()).decode()}


SERVER_AUTH = "RLFLOW_SERVER_AUTH"  # user:password of servers started with `rlflow server up --auth`


def fix_hint() -> str:
    env_file = default_state_dir().expanduser().resolve() / "env.sh"  # `rlflow server up` writes it there
    with contextlib.suppress(ValueError):
        env_file = env_file.relative_to(Path.cwd())
    return f"run `rlflow server up` and then `source {env_file}`"


def require_prefect_api() -> str:
    """The effective PREFECT_API_URL (environment, profile or settings context), checked to be healthy.

    Raises:
        ServiceError: it is unset — Prefect would use a temporary in-process API server, and with the Ray task
            runner every Ray worker would start its own — or its ``/health`` does not answer.
    """
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if not url:
        raise ServiceError(
            "PREFECT_API_URL is not set, so Prefect would run this flow on a temporary API server inside this "
            "process. rlflow refuses that: with the Ray task runner every Ray worker would start its own "
            "temporary server on the same SQLite file, task runs would not show up beside their flow run, and "
            "the server would stop with the process, leaving no UI to follow the run. To fix it, "
            f"{fix_hint()} (or `export PREFECT_API_URL=http://127.0.0.1:4200/api` for a Prefect server you "
            "already run)."
        )
    host = urllib.parse.urlsplit(url).hostname or ""
    if host.endswith("prefect.cloud"):
        return url  # Prefect Cloud: this check is for self-hosted servers
    if not http_ok(url.rstrip("/") + "/health"):
        raise ServiceError(
            f"PREFECT_API_URL={url} does not answer at {url.rstrip('/')}/health. Start the server: "
            f"{fix_hint()}; `rlflow server status` shows what runs."
        )
    auth = get_current_settings().api.auth_string
    headers = basic_auth_header(auth.get_secret_value()) if auth else {}
    if http_status(url.rstrip("/") + "/admin/version", headers=headers) == 401:
        raise ServiceError(
            f"The Prefect API at {url} asks for a user and password, and "
            + ("refused PREFECT_API_AUTH_STRING" if auth else "PREFECT_API_AUTH_STRING is not set")
            + f". Set PREFECT_API_AUTH_STRING=user:password (for `rlflow server up --auth`: export {SERVER_AUTH}="
            f"user:password, then {fix_hint()})."
        )
    return url


def require_mlflow_tracking() -> str:
    """The MLflow tracking URI, checked: an http(s) server must answer ``/health``; ``sqlite:////abs/path.db``
    (one writing process) and other database URIs are accepted; unset, relative SQLite and ``./mlruns`` file
    stores are refused.

    Raises:
        ServiceError: with the reason and the fix.
    """
    from mlflow.tracking._tracking_service.utils import _resolve_tracking_uri, is_tracking_uri_set

    if not is_tracking_uri_set():
        raise ServiceError(
            "MLFLOW_TRACKING_URI is not set, so MLflow would write to ./mlflow.db relative to whichever directory "
            f"each process runs in. To fix it, {fix_hint()} (or export MLFLOW_TRACKING_URI=http://host:port, or "
            "sqlite:////absolute/path/mlflow.db for a single process)."
        )
    uri = _resolve_tracking_uri()
    scheme = urllib.parse.urlsplit(uri).scheme
    if scheme in ("http", "https"):
        if not http_ok(uri.rstrip("/") + "/health"):
            raise ServiceError(
                f"MLFLOW_TRACKING_URI={uri} does not answer at {uri.rstrip('/')}/health. Start "
                f"the server: {fix_hint()}; `rlflow server status` shows what runs."
            )
        _require_mlflow_credentials(uri)
    elif scheme == "sqlite" and not uri.startswith("sqlite:////"):
        raise ServiceError(
            f"MLFLOW_TRACKING_URI={uri} is a relative SQLite path (it depends on each process's "
            "working directory): use sqlite:////absolute/path/mlflow.db, or an MLflow server."
        )
    elif scheme in ("", "file"):
        raise ServiceError(
            f"MLFLOW_TRACKING_URI={uri} is a file store, which MLflow 3 refuses. {fix_hint()} "
            "(or use sqlite:////absolute/path/mlflow.db)."
        )
    return uri


def _require_mlflow_credentials(uri: str) -> None:
    """An MLflow server with authentication on must accept this process's MLFLOW_TRACKING_USERNAME / _PASSWORD
    (or MLFLOW_TRACKING_TOKEN)."""
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else basic_auth_header(f"{user}:{password}") if user else {}
    search = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1"
    if http_status(search, headers=headers) == 401:
        raise ServiceError(
            f"The MLflow server at {uri} asks for a user and password, and "
            + ("refused MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD" if headers else "none is set")
            + ". Set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (for `rlflow server up --auth`: export "
            f"{SERVER_AUTH}=user:password, then {fix_hint()})."
        )
