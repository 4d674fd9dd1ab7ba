"""HTTP hardening of a router replica, over real sockets against real processes (one replica,
one simulated engine, a real nats-server): chat roles, body size limit before parsing (413, both
Content-Length and chunked bodies), request read timeout (slowloris), idle keep-alive timeout,
constant-time admin token, and the admin-only POST /busy_threshold option."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from launch.local_cluster import LocalCluster
from tests.waiting import until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
MODEL = "jetrouter-sim"
MAX_BODY = 64 * 1024
READ_TIMEOUT = 1.0
KEEP_ALIVE = 1.0


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("hardening")
    router_args = ["--max-body-bytes", str(MAX_BODY), "--request-read-timeout", str(READ_TIMEOUT),
                   "--http-keep-alive-timeout", str(KEEP_ALIVE), "--busy-threshold-requires-admin"]
    async with LocalCluster(replicas=1, workers=1, data_dir=Path(data), namespace="hard",
                            router_args=router_args) as c:
        async with httpx.AsyncClient() as h:
            await until(lambda: h.get(c.router_urls[0] + "/v1/models"),
                        lambda r: r.json()["data"] != [], what="worker registered")
        yield c


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    return err


async def read_response(reader: asyncio.StreamReader, timeout: float = 20.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    return await asyncio.wait_for(reader.read(), timeout)


# --- roles -------------------------------------------------------------------------------------


async def test_unknown_chat_role_is_400_and_every_openai_role_is_served(
        cluster: LocalCluster) -> None:
    url = cluster.router_urls[0]
    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.post(url + "/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]})
        err = assert_openai_error(r, 400, "messages[1].role")
        assert "wizard" in err["message"]
        for bad in ("", "User", 7, None):
            r = await h.post(url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": bad, "content": "x"}]})
            assert_openai_error(r, 400, "messages[0].role")
        roles = ("system", "developer", "user", "assistant", "tool", "function")
        r = await h.post(url + "/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2,
            "messages": [{"role": role, "content": f"{role} says hi"} for role in roles]})
        assert r.status_code == 200, r.text
        # The simulated engine validates the same way when called directly.
        r = await h.post(cluster.worker_urls[0] + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"


# --- body size ---------------------------------------------------------------------------------


async def test_body_over_the_limit_is_413_before_it_is_read(cluster: LocalCluster) -> None:
    host, port = host_port(cluster.router_urls[0])
    reader, writer = await asyncio.open_connection(host, port)
    try:
        # Announce a body far over the limit and send none of it: the answer must not wait.
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\n"
                     b"content-length: 1000000000\r\n\r\n")
        await writer.drain()
        raw = await read_response(reader)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), raw[:200]
    assert b'"code":"request_too_large"' in body


async def test_chunked_body_over_the_limit_is_413(cluster: LocalCluster) -> None:
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:  # no length known up front: chunked encoding
        nonlocal sent
        yield b'{"model": "jetrouter-sim", "prompt": "'
        for _ in range(4 * MAX_BODY // 4096):
            sent += 4096
            yield b"a" * 4096
        yield b'"}'

    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.post(cluster.router_urls[0] + "/v1/completions", content=chunks(),
                         headers={"content-type": "application/json"})
        err = assert_openai_error(r, 413)
        assert err["code"] == "request_too_large"
        for path in ("/busy_threshold", "/admin/snapshot-threshold"):
            r = await h.post(cluster.router_urls[0] + path, content=b"{" * (MAX_BODY + 1))
            assert_openai_error(r, 413)
        # Just under the limit is read and judged on its content (a prompt of ~60 KiB).
        body = b'{"model": "jetrouter-sim", "max_tokens": 1, "prompt": "' + \
            b"b" * (MAX_BODY - 100) + b'"}'
        r = await h.post(cluster.router_urls[0] + "/v1/completions", content=body,
                         headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text


async def test_bytes_that_are_not_http_get_an_openai_shaped_400(cluster: LocalCluster) -> None:
    # Found by the HTTP fuzz test: uvicorn's own parser error was a plain-text 400.
    host, port = host_port(cluster.router_urls[0])
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\nauthorization: \x01\x7f ;;\r\n\r\n")
        await writer.drain()
        raw = await read_response(reader)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, raw[:300]
    assert json.loads(body)["error"]["code"] == "invalid_http_request"


async def test_deeply_nested_json_is_a_400_on_every_body_endpoint(cluster: LocalCluster) -> None:
    # Found by the HTTP fuzz test: RecursionError in the JSON decoder was a 500.
    deep = b"[" * 20000 + b"]" * 20000
    url = cluster.router_urls[0]
    auth = {"authorization": f"Bearer {cluster.admin_token}"}
    async with httpx.AsyncClient(timeout=30) as h:
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("POST", "/busy_threshold"), ("PUT", "/admin/snapshot-threshold")):
            r = await h.request(method, url + path, content=deep, headers=auth)
            assert_openai_error(r, 400)
        r = await h.post(cluster.worker_urls[0] + "/v1/completions", content=deep)
        assert r.status_code == 400


# --- slow and idle clients ---------------------------------------------------------------------


async def test_slow_headers_and_slow_body_are_cut_off(cluster: LocalCluster) -> None:
    host, port = host_port(cluster.router_urls[0])
    # Headers that never finish (slowloris): a byte now and then must not keep it open.
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
    await writer.drain()

    async def trickle() -> None:
        for _ in range(200):
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(READ_TIMEOUT / 4)  # the slow client's pace, not a wait

    drip = asyncio.create_task(trickle())
    try:
        raw = await read_response(reader)
    finally:
        drip.cancel()
        await asyncio.gather(drip, return_exceptions=True)
        writer.close()
    assert raw.startswith(b"HTTP/1.1 408"), raw[:200]
    # Headers complete, body promised and never sent.
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
        await writer.drain()
        raw = await read_response(reader)
    finally:
        writer.close()
    assert raw == b"" or raw.startswith(b"HTTP/1.1 408"), raw[:200]
    async with httpx.AsyncClient(timeout=10) as h:
        assert (await h.get(cluster.router_urls[0] + "/health")).status_code == 200
        assert (await h.get(cluster.router_urls[0] + "/ready")).status_code == 200


async def test_idle_keep_alive_connection_is_closed(cluster: LocalCluster) -> None:
    host, port = host_port(cluster.router_urls[0])
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
        assert head.startswith(b"HTTP/1.1 200")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        # Then say nothing: the server closes the connection after the keep-alive timeout.
        assert await read_response(reader) == b""
    finally:
        writer.close()


# --- admin token ----------------------------------------------------------------------------


async def test_busy_threshold_post_needs_the_admin_token_when_configured(
        cluster: LocalCluster) -> None:
    url = cluster.router_urls[0] + "/busy_threshold"
    body = {"model": MODEL, "active_decode_blocks_threshold": 0.9}
    token = cluster.admin_token
    async with httpx.AsyncClient(timeout=30) as h:
        assert_openai_error(await h.post(url, json=body), 401)
        wrong = "x" * len(token)  # same length: only the comparison itself can refuse it
        assert_openai_error(await h.post(url, json=body,
                                         headers={"authorization": f"Bearer {wrong}"}), 403)
        assert_openai_error(await h.post(url, json=body,
                                         headers={"authorization": f"Basic {token}"}), 403)
        r = await h.post(url, json=body, headers={"authorization": f"Bearer {token}"})
        assert r.status_code == 200 and r.json()["active_decode_blocks_threshold"] == 0.9
        assert (await h.get(url)).status_code == 200  # reading stays open


async def test_busy_threshold_numbers_an_event_cannot_carry_are_400(cluster: LocalCluster) -> None:
    """Thresholds travel in a router-stream event: a number past 64 bits (or one that is not
    finite) is the client's mistake, answered 400, never a 500 from encoding the event."""
    url = cluster.router_urls[0] + "/busy_threshold"
    auth = {"authorization": f"Bearer {cluster.admin_token}",
            "content-type": "application/json"}
    async with httpx.AsyncClient(timeout=30) as h:
        for key, raw in (("active_prefill_tokens_threshold_frac", "18446744073709551616"),
                         ("active_prefill_tokens_threshold", "18446744073709551616")):
            body = f'{{"model": "{MODEL}", "{key}": {raw}}}'
            assert_openai_error(await h.post(url, content=body, headers=auth), 400, key)
        r = await h.put(cluster.router_urls[0] + "/admin/snapshot-threshold",
                        content='{"threshold": 18446744073709551616}', headers=auth)
        assert_openai_error(r, 400, "threshold")
        # Past a double's range: the JSON itself is refused.
        body = f'{{"model": "{MODEL}", "active_prefill_tokens_threshold_frac": 1e400}}'
        assert_openai_error(await h.post(url, content=body, headers=auth), 400)
        r = await h.post(url, json={"model": MODEL, "active_prefill_tokens_threshold_frac": 3},
                         headers=auth)
        assert r.status_code == 200 and r.json()["active_prefill_tokens_threshold_frac"] == 3.0
