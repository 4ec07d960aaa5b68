"""Pre-flight checks: what a process needs before it runs a flow, and the fix when it is missing.

Flows call :func:`require_prefect_api` and :func:`require_mlflow_tracking` before they start: without
PREFECT_API_URL Prefect would start a temporary in-process API server, and under the Ray task runner every Ray
worker would start its own (../shared/reference/prefect_mlflow.md §0.6, §3), so those are refused with the fix.
:func:`use_running_services` points the CLI at the servers ``rlflow server up`` started (``flows/services.py``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flows.services import (
    CONTROLLER,
    LOCAL_RAY,
    MLFLOW_TRACKING_URI,
    PREFECT_API_URL,
    ServiceConfig,
    ServiceError,
    basic_auth_header,
    http_ok,
    http_status,
    service_status,
)

SERVER_AUTH = "RLFLOW_SERVER_AUTH"  # user:password of servers started with `rlflow server up --auth`


def apply_service_env(urls: Mapping[str, Any]) -> None:
    """Point this process at the services: set PREFECT_API_URL and MLFLOW_TRACKING_URI in ``os.environ``.

    Prefect snapshots its settings when it is imported, so an already-imported prefect has its global settings
    refreshed; an already-imported mlflow gets ``set_tracking_uri`` (which wins over the environment)."""
    os.environ[PREFECT_API_URL] = str(urls[PREFECT_API_URL])
    os.environ[MLFLOW_TRACKING_URI] = str(urls[MLFLOW_TRACKING_URI])
    if urls.get(LOCAL_RAY):  # runs join the local Ray (flows/groups.py ray_settings)
        os.environ[LOCAL_RAY] = str(urls[LOCAL_RAY])
    if urls.get(CONTROLLER):  # `rlflow` commands run in its forked children (flows/forkserver.py)
        os.environ[CONTROLLER] = str(urls[CONTROLLER])
    if urls.get("auth") and os.environ.get(SERVER_AUTH):  # what env.sh derives from it, unless set otherwise
        user, _, password = os.environ[SERVER_AUTH].partition(":")
        os.environ.setdefault("PREFECT_API_AUTH_STRING", os.environ[SERVER_AUTH])
        os.environ.setdefault("MLFLOW_TRACKING_USERNAME", user)
        os.environ.setdefault("MLFLOW_TRACKING_PASSWORD", password)
    if "prefect.context" in sys.modules:
        sys.modules["prefect.context"].refresh_global_settings_context()
    if "mlflow" in sys.modules:
        sys.modules["mlflow"].set_tracking_uri(urls[MLFLOW_TRACKING_URI])


def use_running_services() -> None:
    """Point this process at the servers `rlflow server up` started (and its local Ray, when it is up), unless the
    environment already names some."""
    if os.environ.get(PREFECT_API_URL) and os.environ.get(MLFLOW_TRACKING_URI):
        return
    status = service_status(ServiceConfig())
    if status["prefect"]["healthy"] and status["mlflow"]["healthy"]:
        apply_service_env(
            {
                PREFECT_API_URL: status["prefect"]["url"] + "/api",
                MLFLOW_TRACKING_URI: status["mlflow"]["url"],
                LOCAL_RAY: status["ray"]["url"] if status["ray"]["alive"] and status["ray"]["healthy"] else None,
                "auth": status["prefect"]["auth"] or status["mlflow"]["auth"],
            }
        )


def _fix_hint() -> str:
    env_file = ServiceConfig().env_file
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
            f"{_fix_hint()} (or `export PREFECT_API_URL=http://127.0.0.1:4200/api` for a Prefect server you "
            "already run)."
        )
    host = urllib.parse.urlsplit(url).hostname or ""
    if host.endswith("prefect.cloud"):
        return url  # Prefect Cloud: this check is for self-hosted servers
    if not http_ok(url.rstrip("/") + "/health"):
        raise ServiceError(
            f"PREFECT_API_URL={url} does not answer at {url.rstrip('/')}/health. Start the server: "
            f"{_fix_hint()}; `rlflow server status` shows what runs."
        )
    auth = get_current_settings().api.auth_string
    headers = basic_auth_header(auth.get_secret_value()) if auth else {}
    if http_status(url.rstrip("/") + "/admin/version", headers=headers) == 401:
        raise ServiceError(
            f"The Prefect API at {url} asks for a user and password, and "
            + ("refused PREFECT_API_AUTH_STRING" if auth else "PREFECT_API_AUTH_STRING is not set")
            + f". Set PREFECT_API_AUTH_STRING=user:password (for `rlflow server up --auth`: export {SERVER_AUTH}="
            f"user:password, then {_fix_hint()})."
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
            f"each process runs in. To fix it, {_fix_hint()} (or export MLFLOW_TRACKING_URI=http://host:port, or "
            "sqlite:////absolute/path/mlflow.db for a single process)."
        )
    uri = _resolve_tracking_uri()
    scheme = urllib.parse.urlsplit(uri).scheme
    if scheme in ("http", "https"):
        if not http_ok(uri.rstrip("/") + "/health"):
            raise ServiceError(
                f"MLFLOW_TRACKING_URI={uri} does not answer at {uri.rstrip('/')}/health. Start "
                f"the server: {_fix_hint()}; `rlflow server status` shows what runs."
            )
        _require_mlflow_credentials(uri)
    elif scheme == "sqlite" and not uri.startswith("sqlite:////"):
        raise ServiceError(
            f"MLFLOW_TRACKING_URI={uri} is a relative SQLite path (it depends on each process's "
            "working directory): use sqlite:////absolute/path/mlflow.db, or an MLflow server."
        )
    elif scheme in ("", "file"):
        raise ServiceError(
            f"MLFLOW_TRACKING_URI={uri} is a file store, which MLflow 3 refuses. {_fix_hint()} "
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
            f"{SERVER_AUTH}=user:password, then {_fix_hint()})."
        )


class ServerFailure(Exception):
    """A request to a server that failed after its client's retries, said in one line (``server_failure_message``)."""


def server_failure_message(error: BaseException) -> str | None:
    """One line for a Prefect or MLflow request that still failed after its client's own retries (Prefect's: 429,
    502, 503 and connection errors, ``PREFECT_CLIENT_MAX_RETRIES`` times with backoff; MLflow's: 429 and 5xx,
    ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` times with backoff), naming the server, its URL and the request; None when
    ``error`` (or what caused it) is not such a failure."""
    import httpx
    import requests

    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        url, what = None, None
        if isinstance(error, ServerFailure):
            return str(error)
        if isinstance(error, httpx.HTTPStatusError):
            url, what = str(error.request.url), f"answered {error.response.status_code} {error.response.reason_phrase}"
            what = f"{what} to {error.request.method} {error.request.url.path}"
        elif isinstance(error, httpx.TransportError):
            with contextlib.suppress(RuntimeError):  # an error raised before its request was built has none
                url = str(error.request.url)
                what = f"did not answer {error.request.method} {error.request.url.path} ({type(error).__name__})"
        elif isinstance(error, requests.RequestException) and error.request is not None:
            url = error.request.url
            what = f"did not answer {error.request.method} {urllib.parse.urlsplit(url).path} ({error})"
        if url:
            return name_the_server(url, what)
        error = error.__cause__ or error.__context__
    return None


def name_the_server(url: str, what: str) -> str:
    """The line for a request to ``url`` that failed as ``what`` says, after its client's retries."""
    from prefect.settings import get_current_settings

    prefect_url = (get_current_settings().api.url or "").rstrip("/")
    mlflow_url = os.environ.get(MLFLOW_TRACKING_URI, "").rstrip("/")
    if prefect_url and url.startswith(prefect_url):
        server = f"The Prefect API server at {prefect_url}"
        retries = f"PREFECT_CLIENT_MAX_RETRIES={get_current_settings().client.max_retries}"
    elif mlflow_url and url.startswith(mlflow_url):
        from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES

        server = f"The MLflow tracking server at {mlflow_url}"
        retries = f"MLFLOW_HTTP_REQUEST_MAX_RETRIES={MLFLOW_HTTP_REQUEST_MAX_RETRIES.get()}"
    else:
        parts = urllib.parse.urlsplit(url)
        server, retries = f"The server at {parts.scheme}://{parts.netloc}", "its client's retries"
    return (
        f"{server} {what}, also when tried again ({retries}). `rlflow server status` shows whether it runs; run "
        "the command again once it answers (a training run resumes from its last checkpoint)."
    )
