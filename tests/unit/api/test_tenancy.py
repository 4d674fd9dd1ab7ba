"""Who the tenant is: the keys file and the request headers."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.requests import Request

from api.errors import ApiError
from api.tenancy import Identity, KeysFileInvalid, key_sha256, load_keys


def _request(headers: dict[str, str]) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})


def test_keys_from_yaml_json_and_a_keys_mapping(tmp_path: Path) -> None:
    (tmp_path / "k.yaml").write_text("sk-1: alice\nsk-2: bob\n")
    (tmp_path / "k.json").write_text('{"keys": {"sk-3": "carol"}}')
    ident = Identity(load_keys(str(tmp_path / "k.yaml")))
    assert ident.tenant_of(_request({"authorization": "Bearer sk-2"})) == "bob"
    assert ident.tenant_of(_request({"x-api-key": "sk-1"})) == "alice"  # Anthropic's header
    assert Identity(load_keys(str(tmp_path / "k.json"))).tenant_of(
        _request({"authorization": "bearer sk-3"})) == "carol"


@pytest.mark.parametrize("text", ["", "[1, 2]", "a: 1\n", "a: ''\n", "a: [1\n",
                                  f"a: {'x' * 129}\n"])
def test_a_bad_keys_file_is_one_clear_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "k.yaml"
    path.write_text(text)
    with pytest.raises(KeysFileInvalid) as err:
        load_keys(str(path))
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    with pytest.raises(KeysFileInvalid):
        load_keys(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer nope"},
                                     {"authorization": "Basic sk-1"}, {"x-api-key": ""}])
def test_unknown_or_missing_key_is_401(tmp_path: Path, headers: dict[str, str]) -> None:
    (tmp_path / "k.yaml").write_text("sk-1: alice\n")
    ident = Identity(load_keys(str(tmp_path / "k.yaml")))
    with pytest.raises(ApiError) as err:
        ident.tenant_of(_request(headers))
    assert err.value.status == 401


def test_trusted_header_without_keys() -> None:
    ident = Identity.configure(None, "X-Tenant-Id")
    assert ident is not None
    assert ident.tenant_of(_request({"x-tenant-id": " team-a "})) == "team-a"
    assert ident.tenant_of(_request({})) == ""  # no tenant: served as before
    with pytest.raises(ApiError):
        ident.tenant_of(_request({"x-tenant-id": "t" * 129}))
    # Nothing configured: no tenant, no key asked for.
    assert Identity.configure(None, None).tenant_of(_request({})) == ""


def test_keys_from_the_admin_api_are_looked_up_by_digest_and_win_over_the_header() -> None:
    replicated: dict[str, str] = {}
    ident = Identity.configure(None, "X-Tenant-Id", lambda: replicated)
    assert ident.tenant_of(_request({"x-tenant-id": "team-a"})) == "team-a"
    replicated[key_sha256("sk-admin-made")] = "team-b"  # applied from ApiKeySet
    assert ident.tenant_of(_request({"authorization": "Bearer sk-admin-made"})) == "team-b"
    with pytest.raises(ApiError) as err:  # once a key exists, the header alone is not enough
        ident.tenant_of(_request({"x-tenant-id": "team-a"}))
    assert err.value.status == 401
