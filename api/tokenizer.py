"""Turning prompt text into the token ids the router hashes into KV blocks.

The router only needs ids that match what the engines cache, so the choice follows the fleet:
simulated workers without a model use :mod:`tokenization.tokens` (one id per UTF-8 byte); a model
folder (``--model-path``, or the older ``--tokenizer`` pointing at a ``tokenizer.json``) is
tokenized by :class:`tokenization.model_tokenizer.ModelTokenizer`, the same code the simulated
engine runs, following vLLM's rules for completions (special tokens added) and chat (template
rendered, no special tokens added). ``encode`` itself never adds special tokens: it is for plain
text such as generated output re-tokenized for a migrated request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from tokenization import tokens
from tokenization.model_tokenizer import ByteCodec, ModelFolderUnusable, ModelTokenizer, load_codec


@runtime_checkable
class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...


TokenizerLoadError = ModelFolderUnusable
"""The tokenizer file or model folder could not be found or parsed; the message names the path."""


class ByteTokenizer(ByteCodec):
    """One id per UTF-8 byte (the simulated workers' tokenizer without a model folder)."""


class HuggingFaceTokenizer(ModelTokenizer):
    """A model's ``tokenizer.json`` through the ``tokenizers`` library; ``path`` is the file
    itself or a model folder (then its ``tokenizer_config.json`` chat template is used too)."""


def load_tokenizer(path: str | None) -> Tokenizer:
    """Byte ids when ``path`` is empty/None/"bytes", else the Hugging Face tokenizer at ``path``."""
    if path is None or path == "" or path == "bytes":
        return ByteTokenizer()
    return HuggingFaceTokenizer(path)


def load_model_tokenizer(model_path: str | None, tokenizer: str | None = None) -> Tokenizer:
    """``--model-path`` wins over ``--tokenizer``; neither gives the byte tokenizer."""
    if model_path:
        codec = load_codec(model_path)  # checks the folder and names what is missing
        return HuggingFaceTokenizer(codec.folder) if isinstance(codec, ModelTokenizer) \
            else ByteTokenizer()
    return load_tokenizer(tokenizer)


def encode_prompt(tokenizer: Tokenizer, text: str, body: Mapping[str, Any]) -> list[int]:
    """A completions text prompt as the engine tokenizes it."""
    method = getattr(tokenizer, "encode_prompt", None)
    if method is None:
        return tokenizer.encode(text)
    add = body.get("add_special_tokens")
    return list(method(text, add if isinstance(add, bool) else True))


def encode_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]],
                body: Mapping[str, Any]) -> list[int]:
    """A chat request as the engine tokenizes it (template, then ids)."""
    method = getattr(tokenizer, "encode_chat", None)
    if method is None:
        return tokenizer.encode(tokens.chat_prompt(messages))
    return list(method(messages, body))
