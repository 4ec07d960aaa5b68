"""A server that answers 503 now and then (SQLite busy under another run's writes, a gateway in front of it): `rlflow
deploy` and `rlflow train` go on through it. A proxy in front of the session's Prefect server answers one request
with 503 instead of relaying it; the client tries again (Prefect's client: 429, 502, 503 and connection errors with
backoff, ``PREFECT_CLIENT_MAX_RETRIES``) and the command succeeds. (A training run through such a 503:
tests/test_stop_signals.py, whose uninterrupted run goes through this proxy.) A server that keeps failing ends the
command after those retries with one line naming the server, its URL and the request (flows.ops.preflight), no
traceback."""

from __future__ import annotations

import pytest
from faults import TcpProxy
from rlflow_cli import rlflow

pytestmark = pytest.mark.slow


def test_deploy_goes_on_through_a_503(prefect_proxy):
    proxy, env = prefect_proxy
    # the first request about deployments, whichever it is: creating them (POST), or reading and updating the ones an
    # earlier deploy on the same server made
    proxy.answer_at(b" /api/deployments/")
    done = rlflow("deploy", env=env)
    assert len(proxy.answered) == 1 and b" /api/deployments/" in proxy.answered[0], proxy.answered
    assert "rlflow: restart crashed runs" in done.stdout


def test_a_prefect_server_that_keeps_failing_is_named_with_its_url(prefect_proxy):
    proxy, env = prefect_proxy
    proxy.answer_at(b"/api/work_pools/", every=True)
    done = rlflow("deploy", env={**env, "PREFECT_CLIENT_MAX_RETRIES": "1"}, check=False)
    said = " ".join(done.stdout.split())
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"The Prefect API server at {env['PREFECT_API_URL']} answered 503 Service Unavailable" in said, said
    assert "PREFECT_CLIENT_MAX_RETRIES=1" in said and "rlflow server status" in said
    assert "Traceback" not in done.stdout + done.stderr
    assert len(proxy.answered) >= 2  # tried, and tried again


def test_an_mlflow_server_that_keeps_failing_is_named_with_its_url(services):
    port = int(services["MLFLOW_TRACKING_URI"].rsplit(":", 1)[1].split("/", 1)[0])
    proxy = TcpProxy(port)
    proxy.start()
    try:
        proxy.answer_at(b"POST /api/2.0/mlflow/", every=True)
        url = f"http://127.0.0.1:{proxy.port}"
        retries = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
        done = rlflow("runs", env={"MLFLOW_TRACKING_URI": url, **retries}, check=False)
    finally:
        proxy.stop()
    said = " ".join(done.stdout.split())
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    # after its retries MLflow's client raises its retry error ("did not answer POST ...") or, now and then, hands
    # back the last 503 ("answered 503 to ..."): either way one line naming the server and the request
    assert f"The MLflow tracking server at {url} did not answer POST /api/2.0/mlflow/" in said or (
        f"The MLflow tracking server at {url} answered 503 to /api/2.0/mlflow/" in said
    ), said
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES=1" in said and "Traceback" not in done.stdout + done.stderr
    assert len(proxy.answered) >= 2
