"""A JetStream limit is not a transient failure: the appender must not retry it."""

from __future__ import annotations

import pytest
from nats.js.errors import APIError, ServiceUnavailableError

from eventlog.appender import is_transient


@pytest.mark.parametrize("err_code", [10023, 10028, 10047, 10054, 10077])
def test_limits_are_not_retried(err_code: int) -> None:
    assert not is_transient(ServiceUnavailableError(code=503, err_code=err_code,
                                                    description="maximum bytes exceeded"))


def test_plain_unavailability_is_retried() -> None:
    assert is_transient(ServiceUnavailableError(code=503))


def test_an_attempt_still_in_process_is_retried() -> None:
    # A retry under the same msg id while the first attempt is still being proposed (its ack
    # timed out during an election or without quorum): only a later retry learns the outcome.
    assert is_transient(APIError(code=409, err_code=10158,
                                 description="duplicate message id is in process"))
    assert not is_transient(APIError(code=400, err_code=10059, description="stream not found"))
