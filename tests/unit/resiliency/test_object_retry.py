"""The object store's one retry policy: which errors are transient, which are the user's, and
the budget. Unit tests of the classification (errors as botocore raises them); the network
faults themselves come from a proxy in tests/integration/test_remote_faults.py."""

from __future__ import annotations

import botocore.exceptions
import pytest
import urllib3.exceptions

from pretrain.context import exit_codes
from pretrain.context.failures import classify
from resiliency.storage.object_retry import (
    ObjectStoreAccessError,
    ObjectStoreUnavailable,
    RetryPolicy,
    error_class,
)


def _client_error(code: str, status: int) -> botocore.exceptions.ClientError:
    response = {
        "Error": {"Code": code, "Message": code},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return botocore.exceptions.ClientError(response, "PutObject")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "exc, kind",
    [
        (_client_error("SlowDown", 503), "transient"),
        (_client_error("InternalError", 500), "transient"),
        (_client_error("Whatever", 502), "transient"),
        (_client_error("TooManyRequests", 429), "transient"),
        (botocore.exceptions.EndpointConnectionError(endpoint_url="http://x"), "transient"),
        (botocore.exceptions.ReadTimeoutError(endpoint_url="http://x"), "transient"),
        (botocore.exceptions.ConnectionClosedError(endpoint_url="http://x"), "transient"),
        (botocore.exceptions.ResponseStreamingError(error="cut"), "transient"),
        (urllib3.exceptions.ProtocolError("Connection broken"), "transient"),
        (ConnectionResetError(104, "reset"), "transient"),
        (_client_error("AccessDenied", 403), "access"),
        (_client_error("InvalidAccessKeyId", 403), "access"),
        (_client_error("SignatureDoesNotMatch", 403), "access"),
        (botocore.exceptions.NoCredentialsError(), "access"),
        (_client_error("NoSuchBucket", 404), "no_bucket"),
        (_client_error("NoSuchKey", 404), "other"),
        (_client_error("PreconditionFailed", 412), "other"),
        (ValueError("not ours"), "other"),
    ],
)
def test_error_classes(exc: BaseException, kind: str) -> None:
    assert error_class(exc) == kind


def _failing(errors: list[BaseException]) -> tuple[list[int], object]:
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return "done"

    return calls, fn


def test_transient_errors_are_retried_until_the_call_succeeds() -> None:
    calls, fn = _failing([_client_error("SlowDown", 503), ConnectionResetError(104, "reset")])
    policy = RetryPolicy(budget_s=10, first_delay_s=0.01, max_delay_s=0.02)
    assert policy.call("s3://b/k", "PUT", fn) == "done"  # type: ignore[arg-type]
    assert len(calls) == 3


def test_a_spent_budget_is_retryable_infrastructure() -> None:
    calls, fn = _failing([_client_error("SlowDown", 503)] * 1000)
    policy = RetryPolicy(budget_s=0.2, first_delay_s=0.01, max_delay_s=0.05)
    with pytest.raises(ObjectStoreUnavailable, match="retry_budget_s") as err:
        policy.call("s3://b/k", "GET", fn)  # type: ignore[arg-type]
    assert 2 <= len(calls) < 1000
    failure = classify(err.value)
    assert (failure.exit_code, failure.retryable) == (exit_codes.INFRASTRUCTURE, True)


def test_access_errors_are_not_retried_and_say_what_to_fix() -> None:
    calls, fn = _failing([_client_error("InvalidAccessKeyId", 403)])
    with pytest.raises(ObjectStoreAccessError, match="AWS_ACCESS_KEY_ID") as err:
        RetryPolicy().call("s3://b/k", "PUT", fn)  # type: ignore[arg-type]
    assert len(calls) == 1 and classify(err.value).exit_code == exit_codes.CONFIG_ERROR
    calls, fn = _failing([_client_error("NoSuchBucket", 404)])
    with pytest.raises(ObjectStoreAccessError, match="the bucket does not exist"):
        RetryPolicy().call("s3://b/k", "PUT", fn)  # type: ignore[arg-type]


def test_other_errors_are_the_callers() -> None:
    calls, fn = _failing([_client_error("NoSuchKey", 404)])
    with pytest.raises(botocore.exceptions.ClientError):
        RetryPolicy().call("s3://b/k", "GET", fn)  # type: ignore[arg-type]
    assert len(calls) == 1
