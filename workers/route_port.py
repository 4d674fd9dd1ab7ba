"""What the simulated engine's extra routes (pooling, Responses, Messages) need of its runtime:
a view of :class:`workers.server.WorkerRuntime`, so those modules do not import the server that
imports them."""

from __future__ import annotations

from typing import Protocol

from eventlog.model_tokenizer import Codec
from workers.engine import Engine


class RouteSettings(Protocol):
    @property
    def worker_id(self) -> str: ...
    @property
    def model(self) -> str: ...


class EngineRuntime(Protocol):
    @property
    def settings(self) -> RouteSettings: ...
    @property
    def codec(self) -> Codec: ...
    @property
    def draining(self) -> bool: ...

    def pick_engine(self, dp_rank: int | None) -> Engine: ...
