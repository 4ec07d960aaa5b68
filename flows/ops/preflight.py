"""Before a command runs a flow: point the process at the servers ``rlflow server up`` started
(:func:`use_running_services`, :func:`apply_service_env`; ``flows/ops/services.py``), and say in one line which server
failed a request after its client's retries (:func:`server_failure_message`). The checks a run itself makes before it
starts (is the Prefect API reachable, is the MLflow tracking URI usable) are in ``flows/plumbing/servers.py``."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import urllib.parse
from collections.abc import Mapping
from typing import Any

from flows.ops.services import CONTROLLER, LOCAL_RAY, ServiceConfig, service_status
from flows.plumbing.servers import MLFLOW_TRACKING_URI, PREFECT_API_URL, SERVER_AUTH


def apply_service_env(urls: Mapping[str, Any]) -> None:
    """Point this process at the services: set PREFECT_API_URL and MLFLOW_TRACKING_URI in ``os.environ``.

    Prefect snapshots its settings when it is imported, so an already-imported prefect has its global settings
    refreshed; an already-imported mlflow gets ``set_tracking_uri`` (which wins over the environment)."""
    os.environ[PREFECT_API_URL] = str(urls[PREFECT_API_URL])
    os.environ[MLFLOW_TRACKING_URI] = str(urls[MLFLOW_TRACKING_URI])
    if urls.get(LOCAL_RAY):  # runs join the local Ray (flows/controller/groups.py ray_settings)
        os.environ[LOCAL_RAY] = str(urls[LOCAL_RAY])
    if urls.get(CONTROLLER):  # `rlflow` commands run in its forked children (flows/plumbing/forkserver.py)
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


_MLFLOW_ANSWERED = re.compile(r"API request to endpoint (?P<endpoint>/\S+) failed with error code (?P<status>\d+) ")


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
        elif type(error).__name__ == "MlflowException" and (answered := _MLFLOW_ANSWERED.match(str(error))):
            # MLflow's client can hand back the server's last retryable answer instead of raising its retry error
            # (then its REST layer raises this, naming only the endpoint)
            endpoint, status = answered["endpoint"], int(answered["status"])
            if status == 429 or status >= 500:
                url = os.environ.get(MLFLOW_TRACKING_URI, "").rstrip("/") + endpoint
                what = f"answered {status} to {endpoint}"
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
