"""API keys in the tenant book (replicas/core/tenants.py): applied from ``ApiKeySet`` /
``ApiKeyRevoked``, part of the digest, carried by snapshots in state format 3 only when a key
exists (format 2 otherwise, which the previous release reads)."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from eventlog import events as ev
from eventlog import wire
from eventlog.names import CONTROL
from replicas.core.state import RouterState, StateConfig

DIGEST = hashlib.sha256(b"sk-jr-secret").hexdigest()


def test_keys_are_applied_digested_and_revoked() -> None:
    state = RouterState(StateConfig(block_size=16))
    before = state.digests()["tenants"]
    state.apply(CONTROL, 1, [ev.ApiKeySet(DIGEST, "acme", 1.0)])
    assert state.tenants.keys == {DIGEST: "acme"}
    assert state.tenants.keys_of("acme") == [DIGEST]
    assert "acme" in state.tenants.tenants()
    assert state.digests()["tenants"] != before
    state.apply(CONTROL, 2, [ev.ApiKeyRevoked(DIGEST, 2.0)])
    assert state.tenants.revoke_key(ev.ApiKeyRevoked(DIGEST, 3.0)) == "unknown_key"
    assert state.tenants.keys == {} and state.digests()["tenants"] == before


def test_a_snapshot_carries_keys_in_format_3_and_is_format_2_without() -> None:
    state = RouterState(StateConfig(block_size=16))
    assert state.snapshot_format == 2
    assert msgspec.msgpack.decode(state.encode())["format"] == 2
    state.apply(CONTROL, 1, [ev.ApiKeySet(DIGEST, "acme", 1.0)])
    assert state.snapshot_format == 3
    blob = state.encode()
    assert msgspec.msgpack.decode(blob)["format"] == 3
    back = RouterState.decode(blob, StateConfig(block_size=16))
    assert back.tenants.keys == {DIGEST: "acme"}
    assert back.digests() == state.digests()


def test_key_events_are_format_3_and_a_key_digest_must_be_sha256_hex() -> None:
    assert wire.message_format([ev.ApiKeySet(DIGEST, "acme", 1.0)]) == 3
    assert wire.message_format([ev.ApiKeyRevoked(DIGEST, 1.0)]) == 3
    # Format 1 messages (most of every stream) are still read by this release.
    assert wire.check_message(None, "S", 1) == 1
    raw = ev.encode_batch([ev.ApiKeySet(DIGEST, "acme", 1.0)]).replace(
        DIGEST.encode(), b"sk-jr-secret-not-a-digest-sk-jr-secret-not-a-digest-0123456789ab")
    with pytest.raises(ev.MalformedMessage, match="key_sha256"):  # counted and skipped
        ev.decode_batch(raw)
