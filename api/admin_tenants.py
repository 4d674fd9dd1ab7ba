"""Admin API for tenants (design.md §9): ``GET /admin/tenants``, ``GET|PUT|DELETE
/admin/tenants/{id}``, ``GET|POST /admin/tenants/{id}/keys``, ``DELETE /admin/api-keys/{key_id}``,
behind the admin bearer token.

API keys created here are drawn by this replica (or given in the body, to bring an existing key
over), shown once in the answer, and replicated as their SHA-256 only (``ApiKeySet``): neither the
stream, nor a snapshot, nor a backup holds a usable key. A key is named afterwards by its
``key_id``, the first 16 hex digits of that digest.

A change is a control-stream event (``TenantLimitsSet`` / ``TenantDeleted``): the answer comes
once this replica has applied it, and every other replica applies the same event. An update is
checked whole here, with an error naming the field, because an event past the bounds every
replica checks would be skipped as malformed everywhere.
"""

from __future__ import annotations

import dataclasses
import math
import re
import secrets
import time
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.admin import require_admin
from api.errors import ApiError
from api.openai_schema import decode_json
from api.tenancy import MAX_TENANT_ID, key_sha256
from eventlog.events import MAX_COUNT
from replicas.core.tenants import WINDOW, TenantLimits
from replicas.runtime.replica import Replica

_json = msgspec.json.Encoder()
_ID = re.compile(r"^[A-Za-z0-9_.:@-]+$")
_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "weight", "isolated")
MAX_WEIGHT = 1e6
KEY_ID_CHARS = 16  # hex digits of a key's SHA-256 that name it in answers
MIN_KEY_CHARS = 20  # a key brought over must be at least this long
MAX_KEY_CHARS = 256


def _json_response(obj: object, status: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json")


def check_tenant_id(tenant: str) -> str:
    if not 1 <= len(tenant) <= MAX_TENANT_ID or not _ID.match(tenant):
        raise ApiError(400, f"tenant id {tenant!r}: 1 to {MAX_TENANT_ID} characters of "
                       "letters, digits and _ . : @ -", param="tenant")
    return tenant


def parse_limits(body: object) -> TenantLimits:
    """The limits in a PUT body, or ApiError 400 naming what is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object with " + ", ".join(_FIELDS))
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}; expected {', '.join(_FIELDS)}",
                       param=unknown[0])
    counts: dict[str, int | None] = {}
    for key in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                              or not 0 <= v <= MAX_COUNT):
            raise ApiError(400, f"`{key}` must be null (no limit) or an integer from 0 to "
                           f"{MAX_COUNT}", param=key)
        counts[key] = v
    weight = body.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) \
            or not math.isfinite(weight) or not 0 < weight <= MAX_WEIGHT:
        raise ApiError(400, f"`weight` must be a number above 0 and at most {MAX_WEIGHT:g}",
                       param="weight")
    isolated = body.get("isolated", False)
    if not isinstance(isolated, bool):
        raise ApiError(400, "`isolated` must be true or false", param="isolated")
    return TenantLimits(counts["requests_per_minute"], counts["tokens_per_minute"],
                        counts["max_concurrent"], float(weight), isolated)


def tenant_doc(replica: Replica, tenant: str, at: float) -> dict[str, Any]:
    """A tenant's limits and its fleet-wide usage as this replica has applied it."""
    book = replica.state.tenants
    limits = book.limits.get(tenant)
    used = book.usage(tenant, at)
    return {"tenant": tenant, "configured": limits is not None,
            **(limits or TenantLimits()).to_doc(), "api_keys": len(book.keys_of(tenant)),
            "usage": {"requests_last_minute": used.requests, "tokens_last_minute": used.tokens,
                      "concurrent": used.concurrent, "window_s": WINDOW}}


def tenants_router(replica: Replica, cfg: Any) -> APIRouter:
    router = APIRouter()
    admin_token: str | None = cfg.admin_token

    @router.get("/admin/tenants")
    async def list_tenants(request: Request) -> Response:
        require_admin(request, admin_token)
        at = time.time()
        return _json_response({"tenants": [tenant_doc(replica, t, at)
                                           for t in replica.state.tenants.tenants()]})

    @router.get("/admin/tenants/{tenant}")
    async def get_tenant(tenant: str, request: Request) -> Response:
        require_admin(request, admin_token)
        check_tenant_id(tenant)
        return _json_response(tenant_doc(replica, tenant, time.time()))

    @router.put("/admin/tenants/{tenant}")
    async def put_tenant(tenant: str, request: Request) -> Response:
        require_admin(request, admin_token)
        check_tenant_id(tenant)
        limits = parse_limits(decode_json(await request.body()))
        if limits.isolated:
            # Kept across updates (a new salt would strand the tenant's cached prefixes); a
            # fresh one when isolation is (re)enabled.
            known = replica.state.tenants.limits.get(tenant)
            salt = known.cache_salt if known is not None and known.cache_salt \
                else f"jr-{secrets.token_hex(16)}"
            limits = dataclasses.replace(limits, cache_salt=salt)
        await replica.set_tenant_limits(tenant, limits)
        return _json_response(tenant_doc(replica, tenant, time.time()))

    @router.delete("/admin/tenants/{tenant}")
    async def delete_tenant(tenant: str, request: Request) -> Response:
        require_admin(request, admin_token)
        check_tenant_id(tenant)
        if tenant not in replica.state.tenants.limits:
            raise ApiError(404, f"tenant {tenant!r} has no limits to delete", param="tenant")
        await replica.delete_tenant(tenant)
        return _json_response({"tenant": tenant, "deleted": True})

    @router.get("/admin/tenants/{tenant}/keys")
    async def list_keys(tenant: str, request: Request) -> Response:
        require_admin(request, admin_token)
        check_tenant_id(tenant)
        return _json_response({"tenant": tenant, "keys": [
            {"key_id": d[:KEY_ID_CHARS]} for d in replica.state.tenants.keys_of(tenant)]})

    @router.post("/admin/tenants/{tenant}/keys")
    async def create_key(tenant: str, request: Request) -> Response:
        require_admin(request, admin_token)
        check_tenant_id(tenant)
        raw = await request.body()
        body = decode_json(raw) if raw.strip() else {}
        key = parse_key_body(body)
        digest = key_sha256(key)
        owner = replica.state.tenants.keys.get(digest)
        if owner is not None and owner != tenant:
            raise ApiError(409, "this API key already belongs to another tenant", param="key")
        await replica.set_api_key(digest, tenant)
        return _json_response({"tenant": tenant, "key": key,
                               "key_id": digest[:KEY_ID_CHARS]}, status=201)

    @router.delete("/admin/api-keys/{key_id}")
    async def revoke_key(key_id: str, request: Request) -> Response:
        require_admin(request, admin_token)
        digest = find_key(replica, key_id)
        tenant = replica.state.tenants.keys[digest]
        await replica.revoke_api_key(digest)
        return _json_response({"key_id": digest[:KEY_ID_CHARS], "tenant": tenant,
                               "revoked": True})

    return router


def parse_key_body(body: object) -> str:
    """The key to store: drawn here, or the body's ``key`` (an existing key brought over)."""
    if not isinstance(body, dict) or set(body) - {"key"}:
        raise ApiError(400, "the body must be empty or a JSON object with only `key` (an "
                       "existing API key to bring over; by default one is drawn)")
    key = body.get("key")
    if key is None:
        return f"sk-jr-{secrets.token_urlsafe(32)}"
    if not isinstance(key, str) or not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS \
            or not key.isprintable() or key != key.strip() or " " in key:
        raise ApiError(400, f"`key` must be {MIN_KEY_CHARS} to {MAX_KEY_CHARS} printable "
                       "characters without spaces", param="key")
    return key


def find_key(replica: Replica, key_id: str) -> str:
    """The one key digest starting with ``key_id`` (ApiError 400/404/409 otherwise)."""
    key_id = key_id.lower()
    if not 8 <= len(key_id) <= 64 or any(c not in "0123456789abcdef" for c in key_id):
        raise ApiError(400, "a key id is 8 to 64 hex digits (the `key_id` a key was created "
                       "with)", param="key_id")
    found = [d for d in replica.state.tenants.keys if d.startswith(key_id)]
    if not found:
        raise ApiError(404, f"no API key with id {key_id!r}", param="key_id")
    if len(found) > 1:
        raise ApiError(409, f"key id {key_id!r} names {len(found)} keys; give more digits",
                       param="key_id")
    return found[0]
