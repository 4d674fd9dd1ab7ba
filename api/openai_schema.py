"""Parsing and validating OpenAI completions / chat requests on the router's hot path.

One ``msgspec`` JSON decode into plain Python objects, then hand-written checks: no pydantic,
because this runs for every request before routing and its cost is part of router overhead.
The decoded body is kept untouched (``ParsedRequest.body``) to forward to the chosen worker;
only what routing needs is extracted: the prompt's token ids, the output budget and the
``nvext.agent_hints`` that tune the decision.

Every rejection is an :class:`~api.errors.ApiError` 400 naming the offending ``param`` (413 with
code ``prompt_too_long`` for a prompt over the limit), with OpenAI's wording where one exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from api.errors import ApiError
from api.handoff_fields import refuse_handoff_fields
from api.tokenizer import Tokenizer, encode_chat, encode_prompt
from replicas.core.shedding import TIERS, PriorityTier
from tokenization.model_tokenizer import ChatTemplateFailed
from tokenization.tokens import role_error

ENDPOINTS = ("completions", "chat")
PRIORITIES = TIERS
DEFAULT_PRIORITY = PriorityTier.STANDARD
DEFAULT_EXPECTED_OSL = 128
MAX_TOKEN_ID = 2**31
SESSION_ACTIONS = ("open", "bind", "close")
MAX_SESSION_ID = 512
MAX_CHOICES = 128  # n: each choice is generated in full, so a bound on what one request asks
MAX_BATCH = 256    # prompts in one completions request
# nvext response fields a client can ask for (others are ignored, as unknown hints are).
EXTRA_FIELDS = ("worker_id", "timing")

# Token-id lists are validated by msgspec in C: checking 100k ids in a Python loop costs ms.
_TokenIds = list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_TOKEN_ID)]]

_JSON_ERROR = ("We could not parse the JSON body of your request. Please make sure the body is "
               "valid JSON.")


@dataclass(slots=True)
class ParsedRequest:
    endpoint: str                 # "completions" | "chat"
    model: str
    prompt_ids: list[int]         # what the router hashes
    stream: bool
    max_tokens: int | None
    include_usage: bool
    priority: str                 # "premium" | "standard" | "best_effort"
    overlap_weight: float | None  # nvext.agent_hints.kv_overlap_score_weight
    expected_osl: int             # nvext.agent_hints.osl, else max_tokens, else 128
    latency_sensitivity: float    # nvext.agent_hints.latency_sensitivity (queue priority jump)
    body: dict[str, Any]          # the JSON body as received (to forward upstream)
    # nvext.session_control as (session_id, action, timeout seconds or None for the default)
    session_control: tuple[str, str, float | None] | None = None
    extra_fields: tuple[str, ...] = ()  # nvext.extra_fields this router answers: see EXTRA_FIELDS
    osl_hint: int = 0             # nvext.agent_hints.osl as given (0: none; output-block weight)
    n: int = 1                    # choices asked for (all from one engine: one prompt, one cache)
    # A completions request with several prompts: the prompts as given (``prompt_ids`` is empty;
    # each becomes a request of its own, see api/routes/batch.py).
    batch: list[Any] | None = None


def decode_json(raw: bytes) -> Any:
    """The JSON value of a request body, or ApiError 400 for anything that is not JSON.

    Beyond syntax errors: invalid UTF-8 inside a string, and nesting deeper than the decoder's
    recursion limit (``[[[[...`` a few thousand deep), which surfaces as RecursionError."""
    try:
        return msgspec.json.decode(raw)
    except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
        raise _bad(_JSON_ERROR, None) from None


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param=param)


# JSON types as error messages name them; bool before int (a bool is an int to isinstance)
_TYPE_NAMES: tuple[tuple[type, str], ...] = (
    (bool, "a boolean"), (int, "an integer"), (float, "a decimal"), (str, "a string"),
    (list, "an array"), (dict, "an object"))


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    for kind, name in _TYPE_NAMES:
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _wrong_type(param: str, expected: str, value: object) -> ApiError:
    return _bad(f"Invalid type for '{param}': expected {expected}, but got "
                f"{_type_name(value)} instead.", param)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_ids(ids: list[Any], param: str) -> list[int]:
    if not ids:
        raise _bad(f"Invalid '{param}': empty token array. Expected at least one token.", param)
    try:
        return msgspec.convert(ids, _TokenIds, strict=True)
    except msgspec.ValidationError as exc:
        raise _bad(f"Invalid '{param}': every token id must be an integer in "
                   f"[0, {MAX_TOKEN_ID}) ({exc}).", param) from None


def _check_text(text: str, param: str) -> str:
    if not text:
        raise _bad(f"Invalid '{param}': empty string. Expected a non-empty prompt.", param)
    return text


def _completion_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("'prompt' is a required property.", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return encode_prompt(tokenizer, _check_text(prompt, "prompt"), body)
    if not isinstance(prompt, list):
        raise _wrong_type("prompt", "a string, an array of tokens or an array of one string",
                          prompt)
    if not prompt:
        raise _bad("Invalid 'prompt': empty array. Expected a non-empty prompt.", "prompt")
    first = prompt[0]
    if _is_int(first):
        return _check_ids(prompt, "prompt")
    if isinstance(first, (str, list)):
        if len(prompt) > 1:
            raise _bad("Invalid 'prompt': several prompts cannot be combined with this "
                       "request (one prompt per request here).", "prompt")
        if isinstance(first, str):
            return encode_prompt(tokenizer, _check_text(first, "prompt"), body)
        return _check_ids(first, "prompt")
    raise _bad("Invalid 'prompt': expected a string, an array of token ids or an array of one "
               f"string, but the array holds {_type_name(first)}.", "prompt")


def _check_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    if "messages" not in body or body["messages"] is None:
        raise _bad("'messages' is a required property.", "messages")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise _wrong_type("messages", "an array", messages)
    if not messages:
        raise _bad("Invalid 'messages': empty array. Expected an array with minimum length 1.",
                   "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _wrong_type(where, "an object", message)
        role = message.get("role")
        if role is None:
            raise _bad(f"Missing required parameter: '{where}.role'.", f"{where}.role")
        why = role_error(role)
        if why is not None:
            raise _bad(f"Invalid value for '{where}.role': {why}.", f"{where}.role")
        content = message.get("content")
        # An assistant turn that only made tool calls has null content (OpenAI allows it).
        if isinstance(content, str) or (content is None and role == "assistant"):
            continue
        if not isinstance(content, list):
            raise _wrong_type(f"{where}.content", "a string or an array of text parts", content)
        for j, part in enumerate(content):
            part_where = f"{where}.content[{j}]"
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad(f"Invalid '{part_where}': only parts of type 'text' are supported.",
                           part_where)
            if not isinstance(part.get("text"), str):
                raise _wrong_type(f"{part_where}.text", "a string", part.get("text"))
    return messages


# Engines take token counts as 32-bit integers; a larger one is a client error, not something
# to carry into a routing decision (whose counters are bounded, eventlog/events.py).
MAX_TOKEN_COUNT = 2**31 - 1


def _max_tokens(body: dict[str, Any]) -> int | None:
    chosen: int | None = None
    # max_completion_tokens is the newer name (chat); it wins when both are given.
    for param in ("max_tokens", "max_completion_tokens"):
        value = body.get(param)
        if value is None:
            continue
        if not _is_int(value):
            raise _wrong_type(param, "an integer", value)
        if value < 1:
            raise _bad(f"Invalid '{param}': integer below minimum value. Expected a value >= 1, "
                       f"but got {value} instead.", param)
        if value > MAX_TOKEN_COUNT:
            raise _bad(f"Invalid '{param}': integer above maximum value. Expected a value <= "
                       f"{MAX_TOKEN_COUNT}.", param)
        chosen = value
    return chosen


def _check_sampling(body: dict[str, Any]) -> int:
    """Checks the sampling fields; returns ``n``."""
    temperature = body.get("temperature")
    if temperature is not None:
        if not _is_number(temperature):
            raise _wrong_type("temperature", "a number", temperature)
        if not 0.0 <= temperature <= 2.0:
            raise _bad(f"Invalid 'temperature': expected a value in [0, 2], but got "
                       f"{temperature} instead.", "temperature")
    top_p = body.get("top_p")
    if top_p is not None:
        if not _is_number(top_p):
            raise _wrong_type("top_p", "a number", top_p)
        if not 0.0 < top_p <= 1.0:
            raise _bad(f"Invalid 'top_p': expected a value in (0, 1], but got {top_p} instead.",
                       "top_p")
    return _choices(body)


def _choices(body: dict[str, Any]) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if not _is_int(n):
        raise _wrong_type("n", "an integer", n)
    if not 1 <= n <= MAX_CHOICES:
        raise _bad(f"Invalid 'n': expected a value in [1, {MAX_CHOICES}], but got {n} instead.",
                   "n")
    return n


def is_batch(prompt: object) -> bool:
    """A completions ``prompt`` holding several prompts (strings or token-id lists)."""
    return isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise _wrong_type("stream", "a boolean", stream)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _wrong_type("stream_options", "an object", options)
        usage = options.get("include_usage")
        if usage is not None:
            if not isinstance(usage, bool):
                raise _wrong_type("stream_options.include_usage", "a boolean", usage)
            include_usage = usage
    return stream, include_usage


def _agent_hints(body: dict[str, Any]) -> dict[str, Any]:
    nvext = body.get("nvext")
    if nvext is None:
        return {}
    if not isinstance(nvext, dict):
        raise _wrong_type("nvext", "an object", nvext)
    hints = nvext.get("agent_hints")
    if hints is None:
        return {}
    if not isinstance(hints, dict):
        raise _wrong_type("nvext.agent_hints", "an object", hints)
    return hints


def _nvext(body: dict[str, Any]) -> dict[str, Any]:
    nvext = body.get("nvext")
    return nvext if isinstance(nvext, dict) else {}  # a non-object was refused by _agent_hints


def _session_control(nvext: dict[str, Any]) -> tuple[str, str, float | None] | None:
    sc = nvext.get("session_control")
    if sc is None:
        return None
    param = "nvext.session_control"
    if not isinstance(sc, dict):
        raise _wrong_type(param, "an object", sc)
    sid = sc.get("session_id")
    if not isinstance(sid, str) or not sid or len(sid) > MAX_SESSION_ID:
        raise _bad(f"Invalid '{param}.session_id': expected a non-empty string of at most "
                   f"{MAX_SESSION_ID} characters.", f"{param}.session_id")
    action = sc.get("action", "bind")
    if action not in SESSION_ACTIONS:
        raise _bad(f"Invalid '{param}.action': expected one of {', '.join(SESSION_ACTIONS)}.",
                   f"{param}.action")
    timeout = sc.get("timeout")
    if timeout is not None and (not _is_number(timeout) or not math.isfinite(timeout)
                                or not 0 < timeout <= 1e9):
        raise _bad(f"Invalid '{param}.timeout': expected seconds, a number in (0, 1e9].",
                   f"{param}.timeout")
    return sid, action, float(timeout) if timeout is not None else None


def _extra_fields(nvext: dict[str, Any]) -> tuple[str, ...]:
    fields = nvext.get("extra_fields")
    if fields is None:
        return ()
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise _wrong_type("nvext.extra_fields", "an array of strings", fields)
    return tuple(f for f in EXTRA_FIELDS if f in fields)


def _finite_number(hints: dict[str, Any], key: str, *, minimum: float | None) -> float | None:
    value = hints.get(key)
    if value is None:
        return None
    param = f"nvext.agent_hints.{key}"
    if not _is_number(value):
        raise _wrong_type(param, "a number", value)
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise _bad(f"Invalid '{param}': expected a finite number{bound}, but got {value}.",
                   param)
    return float(value)


def normalize_priority(value: object, param: str) -> str:
    """A priority tier name, case- and dash-insensitive ("Best-Effort" -> "best_effort")."""
    if not isinstance(value, str):
        raise _wrong_type(param, "a string", value)
    tier = value.strip().lower().replace("-", "_")
    if tier not in PRIORITIES:
        raise _bad(f"Invalid '{param}': unknown priority {value!r}; expected one of "
                   f"{', '.join(PRIORITIES)}.", param)
    return tier


def _expected_osl(hints: dict[str, Any], max_tokens: int | None) -> int:
    osl = hints.get("osl")
    if osl is None:
        return max_tokens if max_tokens is not None else DEFAULT_EXPECTED_OSL
    if not _is_int(osl):
        raise _wrong_type("nvext.agent_hints.osl", "an integer", osl)
    if not 1 <= osl <= MAX_TOKEN_COUNT:
        raise _bad(f"Invalid 'nvext.agent_hints.osl': expected a value in [1, {MAX_TOKEN_COUNT}].",
                   "nvext.agent_hints.osl")
    return osl


def parse_request(endpoint: str, raw: bytes, tokenizer: Tokenizer, *, max_prompt_tokens: int,
                  priority_header: str | None = None, allow_batch: bool = False) -> ParsedRequest:
    """Validate one request body for ``endpoint`` ("completions" or "chat"); raises ApiError.

    ``allow_batch``: a completions request with several prompts is returned with ``batch`` set
    and no prompt ids (each prompt is validated when its own request is parsed); without it,
    such a request is refused."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"unknown endpoint {endpoint!r}; expected one of {ENDPOINTS}")
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise _bad(f"Invalid request body: expected a JSON object, but got {_type_name(body)}.",
                   None)
    refuse_handoff_fields(body)  # only the router speaks the KV hand-off

    model = body.get("model")
    if model is None:
        raise _bad("You must provide a model parameter.", "model")
    if not isinstance(model, str) or not model:
        raise _bad("Invalid 'model': expected a non-empty string.", "model")

    max_tokens = _max_tokens(body)
    n = _check_sampling(body)
    stream, include_usage = _stream_flags(body)
    hints = _agent_hints(body)
    if priority_header is not None:
        priority = normalize_priority(priority_header, "x-priority")
    elif hints.get("priority") is not None:
        priority = normalize_priority(hints["priority"], "nvext.agent_hints.priority")
    else:
        priority = DEFAULT_PRIORITY
    overlap_weight = _finite_number(hints, "kv_overlap_score_weight", minimum=0.0)
    latency = _finite_number(hints, "latency_sensitivity", minimum=None)
    expected_osl = _expected_osl(hints, max_tokens)
    nvext = _nvext(body)
    session_control = _session_control(nvext)
    extra_fields = _extra_fields(nvext)

    common: dict[str, Any] = dict(
        endpoint=endpoint, model=model, stream=stream, max_tokens=max_tokens,
        include_usage=include_usage, priority=priority, overlap_weight=overlap_weight,
        expected_osl=expected_osl, latency_sensitivity=latency if latency is not None else 0.0,
        body=body, session_control=session_control, extra_fields=extra_fields,
        osl_hint=expected_osl if hints.get("osl") is not None else 0, n=n)
    if endpoint == "completions" and allow_batch and is_batch(body.get("prompt")):
        if len(body["prompt"]) > MAX_BATCH:
            raise _bad(f"Invalid 'prompt': at most {MAX_BATCH} prompts per request.", "prompt")
        return ParsedRequest(prompt_ids=[], batch=list(body["prompt"]), **common)
    # Tokenize last: it is the expensive step, so cheap rejections come first.
    if endpoint == "chat":
        prompt_param = "messages"
        try:
            prompt_ids = encode_chat(tokenizer, _check_messages(body), body)
        except ChatTemplateFailed as exc:  # the model's template refused the conversation
            raise _bad(f"Invalid 'messages': {exc}", "messages") from None
    else:
        prompt_param = "prompt"
        prompt_ids = _completion_prompt(body, tokenizer)
    if not prompt_ids:
        raise _bad(f"Invalid '{prompt_param}': the prompt encodes to no tokens.", prompt_param)
    if len(prompt_ids) > max_prompt_tokens:
        raise ApiError(413, f"This model's maximum prompt length is {max_prompt_tokens} tokens. "
                       f"However, your prompt has {len(prompt_ids)} tokens. Please reduce the "
                       "length of the prompt.", param=prompt_param, code="prompt_too_long")

    return ParsedRequest(prompt_ids=prompt_ids, **common)
