"""Why a request cannot be routed: the failures the HTTP layer maps to statuses."""

from __future__ import annotations

from collections.abc import Sequence

from errors.root import JetrouterError


class RoutingError(JetrouterError):
    """Base of the request-level failures the HTTP layer maps to statuses."""


class NoWorkers(RoutingError):
    """No worker is registered (or every one was refused)."""


class UnknownModel(RoutingError):
    def __init__(self, model: str, known: Sequence[str]) -> None:
        super().__init__(f"The model `{model}` does not exist. Available: {', '.join(known)}")
        self.model = model


class AllWorkersBusy(RoutingError):
    """Every candidate is over its busy thresholds (or the router queue waited too long)."""
