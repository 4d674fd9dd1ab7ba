"""What the client has seen of one request served by a chain of engine hops (design.md §9), and
how to carry it on elsewhere. No I/O: :mod:`api.forward.run` drives it.

When an engine fails mid-request, the request continues on another engine with the tokens
generated so far appended to the prompt and ``max_tokens`` reduced by them; the client sees one
continuous stream. :class:`Continuation` is the bookkeeping for that (no I/O): what the client has
been sent, the body of the next hop, and how an upstream event becomes a client event.

Two kinds of hop:

* **verbatim** — nothing has reached the client yet, so the client's own request is sent as it is
  (only forced to stream, for a non-streaming client) and the engine's events pass through
  untouched: the common, single-hop path costs no rewriting.
* **continuation** — the client has seen events already. The hop is a ``/v1/completions``
  request whose prompt is the original prompt ids plus the generated text re-tokenized with the
  router's tokenizer (exact for the byte tokenizer the simulated engines use), and every chunk is
  rewritten into the client's shape (chat ``delta.content`` or completion ``text``) under the
  ``id``/``created``/``model`` of the first events the client saw.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from api.forward.engine import DONE_EVENT, HopFailed, HopFailure, sse_data
from api.openai_schema import ParsedRequest
from replicas.runtime.replica import Routed

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"

# Sampling fields that mean the same on /completions and /chat/completions, so a chat request
# continued as a completion keeps them. Chat-only fields (tools, response_format, logprobs as a
# bool) and `echo`/`n` are deliberately left behind.
CARRIED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos", "user")

_json = msgspec.json.Decoder()


@dataclass(slots=True)
class Hop:
    """One engine's part of a request.

    What the engine sent (``tokens``, ``usage``, ``done``) is written by
    :meth:`Continuation.on_event`; the hop's lifecycle on the router stream (``prefilled``,
    ``ended``) only by :class:`api.forward.run.Run`, which appends those events.
    """

    routed: Routed
    verbatim: bool
    tokens: int = 0                 # token-bearing chunks received from this engine
    output_blocks: int = 0          # output block boundaries reported (OutputProgress)
    usage: dict[str, Any] | None = None
    done: bool = False              # the engine sent [DONE]
    prefilled: bool = False         # PrefillCompleted appended for this hop
    ended: bool = False             # RequestFinished appended for this hop

    @property
    def request_id(self) -> str:
        return self.routed.request_id

    @property
    def worker_id(self) -> str:
        return self.routed.worker_id

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the engine served from its prefix cache for this hop, from its usage
        (``prompt_tokens_details.cached_tokens``); -1 when it did not report them."""
        details = self.usage.get("prompt_tokens_details") if self.usage is not None else None
        value = details.get("cached_tokens") if isinstance(details, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) \
            and value >= 0 else -1

    @property
    def predicted_tokens(self) -> int:
        """The router's predicted reuse for this hop: overlap blocks times the block size."""
        return self.routed.overlap_blocks * self.routed.event.block_size

    @property
    def count(self) -> int:
        """Output tokens of this hop: the engine's own usage figure when it sent one."""
        if self.usage is not None and isinstance(self.usage.get("completion_tokens"), int):
            return int(self.usage["completion_tokens"])
        return self.tokens


@dataclass(frozen=True, slots=True)
class HopPlan:
    """What to send for the next hop."""

    path: str
    body: bytes
    verbatim: bool
    token_ids: list[int]   # the prompt to route by
    expected_osl: int


def with_transfer(body: bytes, transfer: dict[str, Any]) -> bytes:
    """The forwarded JSON body with a disaggregated request's hand-off fields set at its top
    level (api/forward/prefill.py: vLLM's ``kv_transfer_params``, or jetrouter's
    ``{"jetrouter": {"kv_transfer": ...}}``); an object is merged into the client's object of
    the same name, so the client's own ``jetrouter`` hints stay."""
    obj = msgspec.json.decode(body)
    for name, value in transfer.items():
        mine = obj.get(name)
        if isinstance(value, dict) and isinstance(mine, dict):
            value = {**mine, **value}
        obj[name] = value
    return msgspec.json.encode(obj)


@dataclass(slots=True)
class Envelope:
    id: str
    created: int
    model: str


def _choice(obj: dict[str, Any]) -> dict[str, Any] | None:
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


def _text_of(choice: dict[str, Any]) -> str:
    text = choice.get("text")
    if isinstance(text, str):
        return text
    delta = choice.get("delta")
    if isinstance(delta, dict) and isinstance(delta.get("content"), str):
        return delta["content"]
    return ""


class Continuation:
    """The client's view of one request across hops, and how to carry it on elsewhere."""

    def __init__(self, parsed: ParsedRequest, raw: bytes, encode: Callable[[str], list[int]], *,
                 chat_default_max_tokens: int = 256) -> None:
        self.parsed = parsed
        self.raw = raw
        self.chat = parsed.endpoint == "chat"
        self._encode = encode
        self.max_tokens = parsed.max_tokens or (
            chat_default_max_tokens if self.chat else COMPLETIONS_DEFAULT_MAX_TOKENS)
        self.hops: list[Hop] = []
        self.text: list[str] = []
        self.envelope: Envelope | None = None
        self.forwarded = False        # the client has been sent (or, unary, we kept) some event
        self.finish_reason: str | None = None
        self.usage_forwarded = False

    # --- planning hops -------------------------------------------------------------------------

    def generated_ids(self) -> list[int]:
        return self._encode("".join(self.text)) if self.text else []

    def remaining(self) -> int:
        return self.max_tokens - len(self.generated_ids())

    @property
    def complete(self) -> bool:
        """The answer is whole: the engine said why it stopped, or the token budget is spent."""
        return self.finish_reason is not None or (bool(self.hops) and self.hops[-1].done) \
            or self.remaining() <= 0

    def plan(self) -> HopPlan:
        p = self.parsed
        if not self.forwarded:
            body = self.raw
            if not p.stream or not p.include_usage:
                # The engine streams to us even for a non-streaming client: that is what lets an
                # idle timeout tell a hung engine from a long generation. Usage is always asked
                # for: its cached_tokens is the engine's own count of reused prompt tokens,
                # recorded beside our prediction (stripped again if the client did not ask).
                options = p.body.get("stream_options")
                options = {**options} if isinstance(options, dict) else {}
                options["include_usage"] = True
                body = msgspec.json.encode({**p.body, "stream": True,
                                            "stream_options": options})
            return HopPlan(CHAT_PATH if self.chat else COMPLETIONS_PATH, body, True,
                           p.prompt_ids, p.expected_osl)
        generated = self.generated_ids()
        remaining = self.max_tokens - len(generated)
        prompt = [*p.prompt_ids, *generated]
        body_obj: dict[str, Any] = {k: p.body[k] for k in CARRIED_FIELDS if k in p.body}
        body_obj.update(model=p.model, prompt=prompt, max_tokens=max(remaining, 1), stream=True,
                        stream_options={"include_usage": True})
        return HopPlan(COMPLETIONS_PATH, msgspec.json.encode(body_obj), False, prompt,
                       max(min(p.expected_osl - len(generated), remaining), 1))

    def start_hop(self, routed: Routed, plan: HopPlan) -> Hop:
        hop = Hop(routed, plan.verbatim)
        self.hops.append(hop)
        return hop

    # --- upstream events -----------------------------------------------------------------------

    def on_event(self, hop: Hop, raw: bytes, payload: bytes | None) -> tuple[bytes | None, bool]:
        """(bytes for the client or None, whether the event carried a token).

        Raises :class:`HopFailed` for an error event: the engine gave up mid-stream."""
        if payload is None:
            return (raw if hop.verbatim else None), False  # comments, keep-alives
        if payload == b"[DONE]":
            hop.done = True
            return None, False  # the tail (usage, [DONE]) is ours to send: see tail()
        try:
            obj = _json.decode(payload)
        except msgspec.DecodeError:
            return None, False
        if not isinstance(obj, dict):
            return None, False
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            raise HopFailed(HopFailure.STREAM_ERROR, f"the engine sent an error event: {msg}",
                            engine_answered=True)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            hop.usage = usage
        choice = _choice(obj)
        text = _text_of(choice) if choice is not None else ""
        finish = choice.get("finish_reason") if choice is not None else None
        if text:
            hop.tokens += 1
            self.text.append(text)
        if isinstance(finish, str):
            self.finish_reason = finish
        if hop.verbatim:
            if self.envelope is None and isinstance(obj.get("id"), str):
                created = obj.get("created")
                self.envelope = Envelope(obj["id"], created if isinstance(created, int) else
                                         int(time.time()), str(obj.get("model") or
                                                               self.parsed.model))
            if choice is None and usage is not None:
                if not self.parsed.include_usage:
                    return None, False
                self.usage_forwarded = True
            self.forwarded = True
            return raw, bool(text)
        if not text and not isinstance(finish, str):
            return None, False
        return self.client_chunk(text, finish if isinstance(finish, str) else None), bool(text)

    # --- what the client gets ------------------------------------------------------------------

    def _env(self) -> Envelope:
        if self.envelope is None:  # nothing came from an engine yet: make our own
            prefix = "chatcmpl-" if self.chat else "cmpl-"
            first = self.hops[0].request_id if self.hops else "jetrouter"
            self.envelope = Envelope(prefix + first, int(time.time()), self.parsed.model)
        return self.envelope

    def _frame(self, obj_type: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        env = self._env()
        return {"id": env.id, "object": obj_type, "created": env.created, "model": env.model,
                "choices": choices}

    def client_chunk(self, text: str, finish: str | None) -> bytes:
        self.forwarded = True
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text else {}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish}
            return sse_data(self._frame("chat.completion.chunk", [choice]))
        return sse_data(self._frame("text_completion", [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]))

    def usage(self) -> dict[str, Any]:
        """Usage covering every hop: the original prompt and every token the client got."""
        last = self.hops[-1] if self.hops else None
        if last is not None and last.verbatim and last.usage is not None:
            return last.usage  # one engine did all the visible work: its figures are exact
        prompt = len(self.parsed.prompt_ids)
        completion = sum(h.count for h in self.hops)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def tail(self) -> bytes:
        """What ends a successful stream: a finish chunk if no engine sent one, the usage chunk
        if asked for and not passed through yet, then [DONE]."""
        out = b""
        if self.finish_reason is None and self.remaining() <= 0:
            self.finish_reason = "length"
            out += self.client_chunk("", "length")
        if self.parsed.include_usage and not self.usage_forwarded:
            frame = self._frame("chat.completion.chunk" if self.chat else "text_completion", [])
            frame["usage"] = self.usage()
            out += sse_data(frame)
            self.usage_forwarded = True
        return out + DONE_EVENT

    def response_body(self) -> dict[str, Any]:
        """The non-streaming answer assembled from every hop."""
        text = "".join(self.text)
        finish = self.finish_reason or "length"
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                             "content": text},
                                      "logprobs": None, "finish_reason": finish}
            body = self._frame("chat.completion", [choice])
        else:
            body = self._frame("text_completion", [{"index": 0, "text": text, "logprobs": None,
                                                    "finish_reason": finish}])
        body["usage"] = self.usage()
        return body
