"""Turning prompt text into the token ids the router hashes into KV blocks.

The router only needs ids that match what the engines cache, so the choice follows the fleet:
simulated workers use :mod:`eventlog.tokens` (one id per UTF-8 byte), real engines need the
model's own ``tokenizer.json``. Special tokens are never added: engines add their own BOS, and a
spurious extra id would shift every block boundary and destroy prefix matches.
"""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

from eventlog import tokens


@runtime_checkable
class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...


class TokenizerLoadError(ValueError):
    """The tokenizer file could not be found or parsed; the message names the path."""


class ByteTokenizer:
    """One id per UTF-8 byte (the simulated workers' tokenizer)."""

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return tokens.encode(text)


class HuggingFaceTokenizer:
    """A model's ``tokenizer.json`` through the ``tokenizers`` library.

    ``path`` is the file itself or a directory holding ``tokenizer.json``.
    """

    def __init__(self, path: str) -> None:
        # Imported here so replicas running on byte ids never pay for loading the library.
        from tokenizers import Tokenizer as HFTokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        try:
            tok = HFTokenizer.from_file(file)
        except Exception as exc:  # the library raises bare Exception subclasses
            raise TokenizerLoadError(f"cannot load tokenizer from {file!r}: {exc}") from exc
        # A truncating or padding tokenizer would silently change the ids we hash.
        tok.no_truncation()
        tok.no_padding()
        self._tok = tok
        self.path = file
        parent = os.path.basename(os.path.dirname(os.path.abspath(file)))
        self.name = parent or os.path.basename(file)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def load_tokenizer(path: str | None) -> Tokenizer:
    """Byte ids when ``path`` is empty/None/"bytes", else the Hugging Face tokenizer at ``path``."""
    if path is None or path == "" or path == "bytes":
        return ByteTokenizer()
    return HuggingFaceTokenizer(path)
