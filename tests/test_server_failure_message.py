"""The one line a command ends with when a server keeps failing (flows.ops.preflight.server_failure_message), for
the errors the Prefect and MLflow clients raise after their retries, built by the clients' own code. (The same
through a real server behind a failing proxy: tests/test_transient_errors.py.)"""

from __future__ import annotations

import pytest
import requests
from mlflow.exceptions import MlflowException
from mlflow.utils.rest_utils import verify_rest_response

from flows.ops.preflight import server_failure_message

MLFLOW = "http://127.0.0.1:5999"


def response(status: int, body: str) -> requests.Response:
    answer = requests.Response()
    answer.status_code, answer._content = status, body.encode()
    return answer


def mlflow_error(status: int, body: str) -> MlflowException:
    with pytest.raises(MlflowException) as raised:
        verify_rest_response(response(status, body), "/api/2.0/mlflow/experiments/search")
    return raised.value


def test_an_mlflow_answer_its_client_handed_back_after_retries_names_the_server_and_the_endpoint(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", MLFLOW)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    said = server_failure_message(mlflow_error(503, "503 Service Unavailable"))
    assert said is not None and said.startswith(f"The MLflow tracking server at {MLFLOW} answered 503"), said
    assert "/api/2.0/mlflow/experiments/search" in said and "MLFLOW_HTTP_REQUEST_MAX_RETRIES=2" in said, said


def test_an_mlflow_error_that_is_not_the_server_failing_is_left_to_its_traceback(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", MLFLOW)
    assert server_failure_message(mlflow_error(404, "no such page")) is None
    rejected = '{"error_code": "INVALID_PARAMETER_VALUE", "message": "max_results must be positive"}'
    assert server_failure_message(mlflow_error(400, rejected)) is None


def test_an_mlflow_request_that_ran_out_of_retries_names_the_method_and_path(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", MLFLOW)
    request = requests.Request("POST", f"{MLFLOW}/api/2.0/mlflow/runs/create").prepare()
    try:
        try:
            raise requests.exceptions.RetryError("Max retries exceeded", request=request)
        except requests.RequestException as cause:
            raise MlflowException(f"API request to {request.url} failed with exception {cause}")  # as MLflow does
    except MlflowException as error:
        said = server_failure_message(error)
    assert said is not None, "a retry error in the cause chain is a server failure"
    assert f"The MLflow tracking server at {MLFLOW} did not answer POST /api/2.0/mlflow/runs/create" in said, said
