"""Request fields only the router may send to an engine: the KV hand-off of disaggregated serving.

A request body is forwarded to the engine mostly as the client wrote it, so any field an engine
reads is a field a client can set. Two of them make the engine act on another machine's say-so:

* vLLM's ``kv_transfer_params`` (NixlConnector and the other KV connectors): with
  ``do_remote_prefill`` and ``remote_host`` / ``remote_port`` / ``remote_block_ids`` the engine
  connects to the named host and pulls the named blocks, which may hold another request's
  prompt; with ``do_remote_decode`` it keeps a request's blocks for a puller it cannot check;
* SGLang's ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` (and
  ``bootstrap_pair_key``): the bootstrap server a prefill/decode pair meets at, which the client
  could point at a host of its choosing or at another request's room;
* jetrouter's own ``jetrouter.kv_transfer`` handle (the simulated engine's hand-off).

The router is the only party that speaks the hand-off (api/forward/prefill.py adds these fields
to the hops it makes), so a client request carrying any of them is refused with a 400 naming
the field, before anything is routed or forwarded.
"""

from __future__ import annotations

from typing import Any

from api.errors import ApiError
from eventlog.names import TRANSFER_KEY

# Top-level request fields an engine acts on as hand-off instructions.
HANDOFF_FIELDS: tuple[str, ...] = (
    "kv_transfer_params",   # vLLM
    "bootstrap_host",       # SGLang
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
)
JETROUTER_EXTENSION = "jetrouter"


def refuse_handoff_fields(body: dict[str, Any]) -> None:
    """Raise ApiError 400 naming the first hand-off field a client request carries (even a
    null one: an engine may read presence, and no honest client needs to send it)."""
    for name in HANDOFF_FIELDS:
        if name in body:
            raise ApiError(400, f"'{name}' is set by the router for disaggregated serving and "
                           "may not be sent by a client.", param=name,
                           code="unsupported_parameter")
    ext = body.get(JETROUTER_EXTENSION)
    if isinstance(ext, dict) and TRANSFER_KEY in ext:
        param = f"{JETROUTER_EXTENSION}.{TRANSFER_KEY}"
        raise ApiError(400, f"'{param}' is set by the router for disaggregated serving and "
                       "may not be sent by a client.", param=param,
                       code="unsupported_parameter")
