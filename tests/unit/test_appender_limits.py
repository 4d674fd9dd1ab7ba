"""A JetStream limit is not a transient failure: the appender must not retry it."""

from __future__ import annotations

import pytest
from nats.js.errors import ServiceUnavailableError

from eventlog.appender import is_transient


@pytest.mark.parametrize("err_code", [10023, 10028, 10047, 10054, 10077])
def test_limits_are_not_retried(err_code: int) -> None:
    assert not is_transient(ServiceUnavailableError(code=503, err_code=err_code,
                                                    description="maximum bytes exceeded"))


def test_plain_unavailability_is_retried() -> None:
    assert is_transient(ServiceUnavailableError(code=503))
