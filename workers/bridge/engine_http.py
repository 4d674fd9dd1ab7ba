"""What the bridge reads from the engine's HTTP side: ``/v1/models``, ``/metrics``, ``/health``.

* ``/v1/models`` (OpenAI): the served model is the entry without a ``parent``; entries with a
  ``parent`` are LoRA adapters (vLLM lists them so), registered as ``loras``.
* ``/metrics`` (Prometheus text): vLLM's ``vllm:cache_config_info`` labels carry ``block_size``
  and ``num_gpu_blocks``; ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` /
  ``vllm:kv_cache_usage_perc`` (older: ``vllm:gpu_cache_usage_perc``, a 0..1 fraction despite the
  name) are the load, per ``engine`` label (the data-parallel rank); ``process_start_time_seconds``
  identifies the engine incarnation (a restarted engine reports a new one). SGLang's ``sglang:``
  names are read the same way; the prefix seen names the engine kind (``vllm`` or ``sglang``).
* ``/health``: 2xx is healthy; a request that timed out (connected or not) is *silent*, which a
  busy engine is too (vLLM's API server shares the CPU with its engine core); a refused
  connection or another status is *down*. The monitor tells busy from hung by the engine's KV
  events (workers/bridge/monitor.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

import httpx
from prometheus_client.parser import text_string_to_metric_families

from errors.root import JetrouterError

_PREFIXES = ("vllm:", "sglang:")


class EngineUnavailable(JetrouterError, RuntimeError):
    """The engine's HTTP side did not answer usefully."""


class EngineSilent(EngineUnavailable):
    """The engine did not answer within the timeout (busy or hung; not refused)."""


class Health(StrEnum):
    OK = "ok"
    SILENT = "silent"  # timed out
    DOWN = "down"      # refused, or answered with an error


@dataclass(slots=True)
class MetricsView:
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    start_time: float | None = None
    # per dp rank: num_running, num_waiting, kv_usage (0..1)
    load: dict[int, dict[str, float]] = field(default_factory=dict)
    # Which engine the metric names come from ("vllm" or "sglang"; None: neither prefix seen).
    engine_kind: str | None = None


def _rank(labels: dict[str, str]) -> int:
    for key in ("engine", "dp_rank", "data_parallel_rank"):
        value = labels.get(key)
        if value is not None and value.isdigit():
            return int(value)
    return 0


_LOAD_NAMES = {
    "num_requests_running": "num_running",
    "num_requests_waiting": "num_waiting",
    "kv_cache_usage_perc": "kv_usage",
    "gpu_cache_usage_perc": "kv_usage",
    "token_usage": "kv_usage",  # SGLang
}


def parse_metrics(text: str) -> MetricsView:
    view = MetricsView()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == "process_start_time_seconds":
                view.start_time = float(sample.value)
                continue
            prefix = next((p for p in _PREFIXES if name.startswith(p)), None)
            if prefix is None:
                continue
            view.engine_kind = view.engine_kind or prefix[:-1]
            short = name[len(prefix):]
            if short == "cache_config_info":
                labels = sample.labels
                if labels.get("block_size", "").isdigit():
                    view.block_size = int(labels["block_size"])
                if labels.get("num_gpu_blocks", "").isdigit():
                    view.num_gpu_blocks = int(labels["num_gpu_blocks"])
                continue
            key = _LOAD_NAMES.get(short)
            if key is not None and math.isfinite(sample.value):
                slot = view.load.setdefault(_rank(sample.labels), {})
                slot[key] = slot.get(key, 0.0) + float(sample.value)
    return view


def parse_models(doc: object) -> tuple[str, list[str]]:
    """(served base model, LoRA adapters) from an OpenAI ``/v1/models`` body."""
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list) or not data:
        raise EngineUnavailable("/v1/models lists no model")
    ids = [(m.get("id"), m.get("parent")) for m in data if isinstance(m, dict)]
    bases = [mid for mid, parent in ids if isinstance(mid, str) and not parent]
    if not bases:
        raise EngineUnavailable("/v1/models lists no base model")
    loras = sorted(mid for mid, parent in ids if isinstance(mid, str) and parent)
    return bases[0], loras


class EngineHttp:
    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout)

    async def close(self) -> None:
        await self._http.aclose()

    async def models(self) -> tuple[str, list[str]]:
        try:
            resp = await self._http.get("/v1/models")
            resp.raise_for_status()
            return parse_models(resp.json())
        except (httpx.HTTPError, ValueError) as exc:
            raise EngineUnavailable(f"GET {self.url}/v1/models: {exc!r}") from exc

    async def metrics(self) -> MetricsView:
        try:
            resp = await self._http.get("/metrics")
            resp.raise_for_status()
            return parse_metrics(resp.text)
        except httpx.TimeoutException as exc:
            raise EngineSilent(f"GET {self.url}/metrics: {exc!r}") from exc
        except (httpx.HTTPError, ValueError) as exc:
            raise EngineUnavailable(f"GET {self.url}/metrics: {exc!r}") from exc

    async def healthy(self) -> bool:
        return await self.health() is Health.OK

    async def health(self) -> Health:
        try:
            resp = await self._http.get("/health")
        except httpx.TimeoutException:
            return Health.SILENT
        except httpx.HTTPError:
            return Health.DOWN
        return Health.OK if 200 <= resp.status_code < 300 else Health.DOWN
