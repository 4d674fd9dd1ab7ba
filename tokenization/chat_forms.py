"""The Responses API's and Anthropic Messages' request bodies as chat messages.

An engine serving ``/v1/responses`` or ``/v1/messages`` renders the conversation with the model's
chat template, as for ``/v1/chat/completions`` (vLLM turns ``instructions`` into a system
message and each ``input`` item into a message; an Anthropic ``system`` likewise). The router
must compute the same token ids to predict which KV blocks the engine holds, so the router and
the simulated engine both convert here and then tokenize the messages like a chat request.

Only text reaches the messages: images, files and tool results without text contribute nothing
(they change no prefix the router could predict). Tool calls become assistant messages naming the
call, so a conversation's next turn still starts with the previous turn's tokens.

Pure: no I/O. Malformed bodies raise :class:`FormError` with the offending parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from errors.root import JetrouterError

RESPONSES_ROLES = ("user", "assistant", "system", "developer")
ANTHROPIC_ROLES = ("user", "assistant")
_TEXT_PARTS = ("text", "input_text", "output_text")


class FormError(JetrouterError, ValueError):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def _text(content: Any, param: str) -> str:
    """A message's content as text: a string, or the text of its text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FormError(f"'{param}' must be a string or an array of content parts", param)
    texts: list[str] = []
    for i, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise FormError(f"'{param}[{i}]' must be an object", f"{param}[{i}]")
        if part.get("type") in _TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise FormError(f"'{param}[{i}].text' must be a string", f"{param}[{i}].text")
            texts.append(text)
        elif part.get("type") == "tool_result":
            inner = part.get("content")
            if inner is not None:
                texts.append(_text(inner, f"{param}[{i}].content"))
    return "".join(texts)


def responses_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``instructions`` + ``input`` of a Responses API request as chat messages."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise FormError("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if items is None:
        raise FormError("'input' is a required property", "input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise FormError("'input' must be a string or a non-empty array of input items",
                        "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise FormError(f"'{where}' must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in RESPONSES_ROLES:
                raise FormError(f"'{where}.role' must be one of {', '.join(RESPONSES_ROLES)}",
                                f"{where}.role")
            messages.append({"role": role,
                             "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            messages.append({"role": "assistant", "content": f"{item.get('name', '')}"
                             f"({item.get('arguments', '')})"})
        elif kind == "function_call_output":
            output = item.get("output", "")
            messages.append({"role": "tool", "content": output if isinstance(output, str)
                             else _text(output, f"{where}.output")})
        # Other item kinds (reasoning, web search calls...) carry no prompt text.
    if not messages:
        raise FormError("'input' holds no message", "input")
    return messages


def anthropic_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``system`` + ``messages`` of an Anthropic Messages request as chat messages."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise FormError("'messages' must be a non-empty array", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise FormError(f"'{where}' must be an object", where)
        role = message.get("role")
        if role not in ANTHROPIC_ROLES:
            raise FormError(f"'{where}.role' must be one of {', '.join(ANTHROPIC_ROLES)}",
                            f"{where}.role")
        content = message.get("content")
        text = _text(content, f"{where}.content")
        if isinstance(content, list):
            calls = [f"{p.get('name', '')}({p.get('input', {})})" for p in content
                     if isinstance(p, Mapping) and p.get("type") == "tool_use"]
            text += "".join(calls)
        out.append({"role": role, "content": text})
    return out
