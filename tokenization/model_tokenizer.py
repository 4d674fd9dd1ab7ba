"""A model folder's tokenizer and chat template, applied as an OpenAI-compatible engine does.

The router and the simulated engine both import this (``tokenization`` lies below both), so
"text -> token ids" has one implementation: a router can only predict which KV blocks an engine
caches if it turns a request into the engine's own token ids. The rules follow vLLM's OpenAI
server, which is what real engines behind jetrouter run:

* ``/v1/completions`` with a text prompt: ``tokenizer(prompt, add_special_tokens=True)`` — the
  tokenizer's post-processor adds its BOS (the request's ``add_special_tokens`` overrides);
* ``/v1/chat/completions``: the ``chat_template`` of ``tokenizer_config.json`` rendered the way
  transformers' ``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``
  does (jinja2 sandbox, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``bos_token`` and
  the other special tokens as variables), then tokenized with ``add_special_tokens=False``: the
  template writes the BOS itself, and adding another would shift every block boundary;
* token-id prompts are never touched.

Without a model folder the byte tokenizer of :mod:`tokenization.tokens` stays the rule on both
sides.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from errors.root import JetrouterError
from tokenization import tokens

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
# Newer transformers save the template as its own file; it wins over the config's field.
TEMPLATE_FILE = "chat_template.jinja"
# transformers passes these special tokens to every chat template as variables.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")
# Request fields vLLM forwards to the template (besides messages and chat_template_kwargs).
_TEMPLATE_REQUEST_FIELDS = ("tools", "documents")


class ModelFolderUnusable(JetrouterError, ValueError):
    """A model folder (or tokenizer file) that cannot be used; the message names the path."""


class ChatTemplateFailed(JetrouterError, ValueError):
    """The chat template refused the conversation (``raise_exception``) or failed to render."""


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def chat_content_text(content: Any) -> str:
    """OpenAI message content as the string a text-only template sees.

    vLLM hands "string"-format templates (all common ones) the text parts joined with a newline;
    a missing/None content stays empty."""
    return tokens.content_text(content, "\n")


def _raise_exception(message: str) -> None:
    raise ChatTemplateFailed(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers overrides jinja's |tojson (which HTML-escapes) with plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template; :meth:`render` is transformers' ``apply_chat_template``."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        # jinja2 only where a folder has a template: byte-tokenizer deployments never import it.
        from jinja2 import TemplateError
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class GenerationTag(Extension):
            """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask
            markers) renders its body unchanged, as it does when masks are not asked for."""

            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols, GenerationTag])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template_error = TemplateError
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ModelFolderUnusable(f"chat_template does not compile: {exc}") from exc
        self.source = source
        self.special_tokens = dict(special_tokens)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        conversation = [{**m, "content": chat_content_text(m.get("content"))}
                        if "content" in m else dict(m) for m in messages]
        variables = {**self.special_tokens, **kwargs, "messages": conversation,
                     "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**variables)
        except ChatTemplateFailed:
            raise
        except self._template_error as exc:
            raise ChatTemplateFailed(f"the chat template failed: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateFailed(f"the chat template failed: {type(exc).__name__}: {exc}") \
                from exc


def template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The template variables an OpenAI chat request carries, as vLLM passes them."""
    out: dict[str, Any] = {}
    extra = body.get("chat_template_kwargs")
    if isinstance(extra, Mapping):
        out.update(extra)
    for key in _TEMPLATE_REQUEST_FIELDS:
        if body.get(key) is not None:
            out[key] = body[key]
    if isinstance(body.get("add_generation_prompt"), bool):
        out["add_generation_prompt"] = body["add_generation_prompt"]
    if body.get("continue_final_message") is True:
        out["continue_final_message"] = True
        out.setdefault("add_generation_prompt", False)
    return out


class ModelTokenizer:
    """``tokenizer.json`` (+ ``tokenizer_config.json`` when present) of one model folder.

    ``path`` is the folder or, for the older ``--tokenizer`` flag, the ``tokenizer.json`` itself
    (then there is no chat template and chat requests use the built-in flattening)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from tokenizers import Tokenizer as HFTokenizer  # only loaded when a model is given

        path = os.fspath(path)
        folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
        try:
            tok = HFTokenizer.from_file(file)
        except Exception as exc:  # the library raises bare Exception subclasses
            raise ModelFolderUnusable(f"cannot load tokenizer from {file!r}: {exc}") from exc
        # A truncating or padding tokenizer would silently change the ids we hash.
        tok.no_truncation()
        tok.no_padding()
        self._tok = tok
        self.path = file
        self.folder = folder
        self.name = os.path.basename(folder.rstrip(os.sep)) or os.path.basename(file)
        self.config = self._read_config(os.path.join(folder, CONFIG_FILE)) \
            if os.path.isdir(path) else {}
        self.special_tokens = {k: t for k in SPECIAL_TOKEN_KEYS
                               if (t := _token_text(self.config.get(k))) is not None}
        source = self.config.get("chat_template")
        template_file = os.path.join(folder, TEMPLATE_FILE)
        if os.path.isdir(path) and os.path.isfile(template_file):
            try:
                with open(template_file, encoding="utf-8") as fh:
                    source = fh.read()
            except OSError as exc:
                raise ModelFolderUnusable(f"cannot read {template_file!r}: {exc}") from exc
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
            source = named.get("default")
        self.chat_template = ChatTemplate(source, self.special_tokens) \
            if isinstance(source, str) and source else None

    @staticmethod
    def _read_config(file: str) -> dict[str, Any]:
        try:
            with open(file, encoding="utf-8") as fh:
                config = json.load(fh)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise ModelFolderUnusable(f"cannot read {file!r}: {exc}") from exc
        if not isinstance(config, dict):
            raise ModelFolderUnusable(f"{file!r} is not a JSON object")
        return config

    # --- text -> ids ------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Plain text, no special tokens (what generated text re-tokenizes to)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A ``/v1/completions`` text prompt, as vLLM tokenizes it (BOS from the post-processor
        unless the request says ``add_special_tokens: false``)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    body: Mapping[str, Any] | None = None) -> str:
        if self.chat_template is None:
            return tokens.chat_prompt(messages)
        kwargs = template_kwargs(body or {})
        return self.chat_template.render(messages, **kwargs)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    body: Mapping[str, Any] | None = None) -> list[int]:
        """A chat request: the rendered template tokenized without added special tokens
        (vLLM's chat default; the request's ``add_special_tokens: true`` overrides)."""
        add = bool(body.get("add_special_tokens", False)) if body else False
        return list(self._tok.encode(self.render_chat(messages, body),
                                     add_special_tokens=add).ids)

    # --- ids -> text ------------------------------------------------------------------------

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))


class ByteCodec:
    """The built-in rule when no model folder is given: one id per UTF-8 byte."""

    name = "bytes"
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return tokens.encode(text)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return tokens.encode(text)

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    body: Mapping[str, Any] | None = None) -> str:
        return tokens.chat_prompt(messages)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    body: Mapping[str, Any] | None = None) -> list[int]:
        return tokens.encode(tokens.chat_prompt(messages))

    def decode(self, ids: Sequence[int]) -> str:
        return tokens.decode(ids)


Codec = ModelTokenizer | ByteCodec


def load_codec(model_path: str | os.PathLike[str] | None) -> Codec:
    """The model folder's tokenizer, or the byte codec when no path is given."""
    if model_path is None or os.fspath(model_path) in ("", "bytes"):
        return ByteCodec()
    path = os.fspath(model_path)
    if not os.path.exists(path):
        raise ModelFolderUnusable(f"model path {path!r} does not exist")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
        raise ModelFolderUnusable(f"model path {path!r} has no {TOKENIZER_FILE}")
    return ModelTokenizer(path)

