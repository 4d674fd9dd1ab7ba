"""OpenAI request parsing and response shapes for the simulated worker (no I/O).

Accepted: ``prompt`` as text, a token-id list, or a one-element list of either; chat ``messages``
rendered and tokenized by the worker's codec (:mod:`tokenization.model_tokenizer`: the model
folder's chat template, or :func:`tokenization.tokens.chat_prompt` over bytes without one);
``max_tokens`` (or ``max_completion_tokens``); ``stream`` and ``stream_options.include_usage``.
Other sampling fields are accepted and ignored: decoding is deterministic. ``ignore_eos`` is
irrelevant (the simulator has no EOS).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from errors.root import JetrouterError
from tokenization.model_tokenizer import ByteCodec, ChatTemplateFailed, Codec
from tokenization.tokens import MAX_TOKEN_ID, decode, role_error

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) documented default for /completions


class BadRequest(JetrouterError, ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    chat: bool
    model: str | None
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    request_id: str | None
    # vLLM's cache_salt: the prompt's blocks are cached apart from the same tokens without it
    cache_salt: str = ""


def decode_body(raw: bytes) -> Any:
    """The JSON value of a request body; BadRequest for anything that is not JSON (including
    invalid UTF-8 and nesting deeper than the decoder's limit)."""
    try:
        return msgspec.json.decode(raw)
    except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
        raise BadRequest("request body is not valid JSON") from None


def _token_list(value: list[Any]) -> list[int] | None:
    """``value`` as token ids when every item is an integer (not a boolean), else None.
    msgspec checks the items in C: a Python loop over a few hundred ids was ~6 % of the
    simulated engines' CPU per request."""
    if not value:
        return None
    try:
        ids: list[int] = msgspec.convert(value, list[int], strict=True)
    except msgspec.ValidationError:  # not all integers (any size is one; a boolean is not)
        return None
    if min(ids) < 0 or max(ids) > MAX_TOKEN_ID:
        raise BadRequest(f"token ids must be in 0..{MAX_TOKEN_ID}", "prompt")
    return ids


_BYTES = ByteCodec()


def prompt_ids(prompt: Any, codec: Codec = _BYTES, add_special_tokens: bool = True) -> list[int]:
    if isinstance(prompt, str):
        return codec.encode_prompt(prompt, add_special_tokens)
    if isinstance(prompt, list):
        ids = _token_list(prompt)
        if ids is not None:
            return ids
        if len(prompt) == 1 and isinstance(prompt[0], str | list):
            return prompt_ids(prompt[0], codec, add_special_tokens)
        if len(prompt) > 1:
            raise BadRequest("only one prompt per request is supported", "prompt")
    raise BadRequest("prompt must be a string, a list of token ids, or a list of one of those",
                     "prompt")


def parse_request(body: Any, *, chat: bool, default_max_tokens: int,
                  header_request_id: str | None = None, codec: Codec = _BYTES) -> ParsedRequest:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or \
                not all(isinstance(m, dict) for m in messages):
            raise BadRequest("messages must be a non-empty list of objects", "messages")
        for i, message in enumerate(messages):
            why = role_error(message.get("role"))
            if why is not None:
                raise BadRequest(f"messages[{i}].role: {why}", f"messages[{i}].role")
        try:
            ids = codec.encode_chat(messages, body)
        except ChatTemplateFailed as exc:
            raise BadRequest(str(exc), "messages") from None
        fallback = default_max_tokens
    else:
        if "prompt" not in body:
            raise BadRequest("prompt is required", "prompt")
        add = body.get("add_special_tokens")
        ids = prompt_ids(body["prompt"], codec, add if isinstance(add, bool) else True)
        fallback = COMPLETIONS_DEFAULT_MAX_TOKENS
    if not ids:
        raise BadRequest("the prompt is empty", "messages" if chat else "prompt")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = fallback
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest("max_tokens must be an integer >= 1", "max_tokens")
    stream = bool(body.get("stream", False))
    options = body.get("stream_options") or {}
    include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    ext = body.get("jetrouter")
    rid = ext.get("request_id") if isinstance(ext, dict) else None
    model = body.get("model")
    salt = body.get("cache_salt")
    return ParsedRequest(chat, model if isinstance(model, str) else None, ids, max_tokens, stream,
                         include_usage, str(rid) if rid else header_request_id,
                         salt if isinstance(salt, str) else "")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ResponseShaper:
    """Builds the bodies and stream chunks of one completion or chat completion."""

    def __init__(self, response_id: str, model: str, chat: bool) -> None:
        self.id = response_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        # Set when the request asked for ``return_token_ids`` (as vLLM names it): the prompt's
        # ids ride on the first choice of the first chunk (or of the whole answer).
        self.prompt_token_ids: list[int] | None = None

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def full(self, output: list[int], finish_reason: str,
             usage_body: dict[str, Any]) -> dict[str, Any]:
        text = decode(output)
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason,
                                      "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.prompt_token_ids is not None:
            choice["prompt_token_ids"] = self.prompt_token_ids
        body = self._envelope(self.object, [choice])
        body["usage"] = usage_body
        return body

    def chunk(self, text: str | None, finish_reason: str | None = None, *,
              first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None,
                      "finish_reason": finish_reason}
        if self.prompt_token_ids is not None:
            choice["prompt_token_ids"], self.prompt_token_ids = self.prompt_token_ids, None
        return self._envelope(self.chunk_object, [choice])

    def usage_chunk(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope(self.chunk_object, [])
        body["usage"] = usage_body
        return body
