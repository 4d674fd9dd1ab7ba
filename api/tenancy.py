"""Who is the tenant, and what it is told (design.md §9, "Tenants").

A request's tenant comes from its API key (``Authorization: Bearer KEY`` looked up in
``--api-keys-file`` and among the keys set through the admin API, ``POST
/admin/tenants/{id}/keys``; an unknown or missing key is refused with 401 once any key exists) or,
without keys, from a header a trusted gateway sets (``--tenant-header``). With none of them there
is no tenant: one lookup of the (empty) replicated key table per request.

Over a limit the answer is OpenAI's: 429 ``rate_limit_exceeded`` with ``retry-after`` (and
``retry-after-ms``, which the official client reads first), and every answer to a tenant with
limits carries OpenAI's ``x-ratelimit-*`` headers.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml
from fastapi import Request
from fastapi.responses import Response

from api.errors import ApiError, error_response
from errors.root import JetrouterError
from replicas.core.tenant_admission import Verdict

MAX_TENANT_ID = 128

# The tenant of the request this task serves: set at admission, read when it is routed (every
# inference route goes through Conductor.admit and then Conductor.first_hop in the same task,
# api/forward/conductor.py).
current_tenant: contextvars.ContextVar[str] = contextvars.ContextVar("jetrouter_tenant",
                                                                     default="")
# The x-ratelimit-* headers of the admission of the request this task serves (None: no limits).
rate_limit_headers: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "jetrouter_rate_limit_headers", default=None)


class KeysFileInvalid(JetrouterError, ValueError):
    """--api-keys-file cannot be read or is not a mapping of keys to tenant ids."""


def _digest(key: str) -> bytes:
    # Looked up by digest, not by the key itself: a dict lookup on the key would compare it
    # with a stored key character by character, and how long that takes says how much of a
    # guess was right.
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def load_keys(path: str) -> dict[bytes, str]:
    """A YAML or JSON file mapping API key -> tenant id (a ``keys:`` mapping at the top level
    is accepted too), as key digests -> tenant ids."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise KeysFileInvalid(f"--api-keys-file {path}: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        detail = " ".join(str(exc).split())  # one line, as every CLI error is
        raise KeysFileInvalid(f"--api-keys-file {path}: not valid YAML/JSON: {detail}") from None
    if isinstance(doc, dict) and isinstance(doc.get("keys"), dict):
        doc = doc["keys"]
    if not isinstance(doc, dict) or not doc:
        raise KeysFileInvalid(f"--api-keys-file {path}: expected a mapping of API key to "
                              "tenant id")
    keys: dict[bytes, str] = {}
    for key, tenant in doc.items():
        if not isinstance(key, str) or not key or not isinstance(tenant, str) \
                or not 1 <= len(tenant) <= MAX_TENANT_ID:
            raise KeysFileInvalid(f"--api-keys-file {path}: every key must be a non-empty "
                                  f"string mapped to a tenant id of 1 to {MAX_TENANT_ID} "
                                  "characters")
        keys[_digest(key)] = tenant
    return keys


@dataclass(frozen=True, slots=True)
class Identity:
    """How this replica tells tenants apart: keys from ``--api-keys-file`` (``keys``), keys set
    through the admin API (``replicated()``: the tenant book's SHA-256 hex -> tenant, the same
    on every replica), or a gateway's ``header``. Keys, once any exist, win over the header."""

    keys: dict[bytes, str] | None = None
    header: str | None = None
    replicated: Callable[[], dict[str, str]] = dict

    @classmethod
    def configure(cls, keys_file: str | None, header: str | None,
                  replicated: Callable[[], dict[str, str]] = dict) -> Identity:
        return cls(load_keys(keys_file) if keys_file else None,
                   header.lower() if header else None, replicated)

    def tenant_of(self, request: Request) -> str:
        """The request's tenant ("" for none); ApiError 401/400 when it cannot be told."""
        replicated = self.replicated()
        if self.keys is not None or replicated:
            scheme, _, key = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer":
                key = request.headers.get("x-api-key", "")  # Anthropic's clients send this
            digest = _digest(key.strip())
            tenant = self.keys.get(digest) if self.keys is not None else None
            if tenant is None:
                tenant = replicated.get(digest.hex())
            if tenant is None:
                raise ApiError(401, "Incorrect API key provided. Send `Authorization: Bearer "
                               "KEY` with a key this router knows.", type="invalid_request_error",
                               code="invalid_api_key", headers={"www-authenticate": "Bearer"})
            return tenant
        if self.header is None:
            return ""
        value = request.headers.get(self.header, "").strip()
        if len(value) > MAX_TENANT_ID:
            raise ApiError(400, f"Invalid '{self.header}' header: at most {MAX_TENANT_ID} "
                           "characters.", param=self.header)
        return value


def key_sha256(key: str) -> str:
    """The digest an API key is known by in the tenant book (lowercase hex)."""
    return _digest(key).hex()


def rate_limited(verdict: Verdict, tenant: str, headers: dict[str, str]) -> Response:
    """OpenAI's 429 for a request over one of its tenant's limits."""
    what = {"requests": f"requests per minute (limit {verdict.limits.requests_per_minute})",
            "tokens": f"tokens per minute (limit {verdict.limits.tokens_per_minute}, "
                      "counting prompt + max_tokens)",
            "concurrent": f"concurrent requests (limit {verdict.limits.max_concurrent})",
            }[verdict.reason]
    return error_response(
        429, f"Rate limit reached for tenant {tenant!r} on {what}. Please try again in "
        f"{verdict.retry_after:.3g}s.", type="requests" if verdict.reason != "tokens"
        else "tokens", code="rate_limit_exceeded",
        headers={**headers, **verdict.headers()})
