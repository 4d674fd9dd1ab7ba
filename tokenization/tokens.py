"""The built-in byte-level tokenizer shared by the router and the simulated worker.

Pure module. A router hashes exactly the token ids the worker caches only if both sides turn a
request into tokens the same way, so the text -> ids rule (UTF-8 bytes) and the chat flattening
(:func:`chat_prompt`) live here, in a package below both.

Token-id prompts may carry ids >= ``VOCAB_SIZE`` (ids from a real tokenizer, up to 2**32 - 1
because block hashing packs ids as u32); :func:`decode` renders each as a short made-up word so
such prompts and their outputs still print.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

VOCAB_SIZE = 256
"""Ids ``0..255`` are bytes; anything larger is an opaque id from elsewhere."""

MAX_TOKEN_ID = 2**32 - 1

_CONSONANTS = "bdfghklmnprstvz"
_VOWELS = "aeiou"


def encode(text: str) -> list[int]:
    """UTF-8 bytes of ``text`` as token ids 0..255."""
    return list(text.encode("utf-8"))


def _word(token_id: int) -> str:
    """A deterministic pronounceable word for an id outside the byte range (e.g. " tokamu")."""
    syllables: list[str] = []
    n = token_id
    while True:
        n, rest = divmod(n, len(_CONSONANTS) * len(_VOWELS))
        c, v = divmod(rest, len(_VOWELS))
        syllables.append(_CONSONANTS[c] + _VOWELS[v])
        if n == 0:
            break
    return " " + "".join(syllables)


def decode(ids: Sequence[int] | Iterable[int]) -> str:
    """Inverse of :func:`encode` for byte ids; larger ids become words; bad UTF-8 -> U+FFFD."""
    parts: list[str] = []
    run = bytearray()
    for token_id in ids:
        if 0 <= token_id < VOCAB_SIZE:
            run.append(token_id)
            continue
        if run:
            parts.append(run.decode("utf-8", errors="replace"))
            run.clear()
        parts.append(_word(token_id))
    if run:
        parts.append(run.decode("utf-8", errors="replace"))
    return "".join(parts)


def content_text(content: Any, joiner: str = "") -> str:
    """OpenAI message content: a string, None, or a list of parts of which text parts count
    (joined by ``joiner``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts: list[str] = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text":
                texts.append(str(part.get("text", "")))
        return joiner.join(texts)
    return str(content)


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""The chat roles OpenAI's API accepts ("function" is its deprecated predecessor of "tool")."""


def role_error(role: object) -> str | None:
    """Why ``role`` is not an accepted chat role, or None when it is one.

    Shared by the router and the simulated engine so that both reject the same messages."""
    if not isinstance(role, str):
        return "expected a string"
    if role not in CHAT_ROLES:
        return f"unknown role: {role!r}, expected one of {', '.join(CHAT_ROLES)}"
    return None


def chat_prompt(messages: Iterable[Mapping[str, Any]]) -> str:
    """Flatten chat messages into one prompt, deterministically (a ChatML-like template).

    Every message becomes ``<|role|>\\ncontent\\n`` and the prompt ends with ``<|assistant|>\\n``
    (the generation prompt). A conversation's next turn therefore starts with the exact bytes of
    the previous turn's prompt, so multi-turn chats share KV-cache prefixes.
    """
    out: list[str] = []
    for message in messages:
        role = str(message.get("role", "user"))
        out.append(f"<|{role}|>\n{content_text(message.get('content'))}\n")
    out.append("<|assistant|>\n")
    return "".join(out)
