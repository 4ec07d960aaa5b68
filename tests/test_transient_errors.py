"""A server that answers 503 now and then (SQLite busy under another run's writes, a gateway in front of it): `rlflow
deploy` and `rlflow train` go on through it. A proxy in front of the session's Prefect server answers one request
with 503 instead of relaying it; the client tries again (Prefect's client: 429, 502, 503 and connection errors with
backoff, ``PREFECT_CLIENT_MAX_RETRIES``) and the command succeeds. (A training run through such a 503:
tests/test_stop_signals.py, whose uninterrupted run goes through this proxy.)"""

from __future__ import annotations

import pytest
from rlflow_cli import rlflow

pytestmark = pytest.mark.slow


def test_deploy_goes_on_through_a_503(prefect_proxy):
    proxy, env = prefect_proxy
    proxy.answer_at(b"POST /api/deployments/")
    done = rlflow("deploy", env=env)
    assert proxy.answered == [b"POST /api/deployments/ HTTP/1.1"], proxy.answered
    assert "rlflow: restart crashed runs" in done.stdout
