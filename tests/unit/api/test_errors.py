"""api.errors: OpenAI-shaped bodies, the seed's exact 503, and the handlers over a real socket."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from pydantic import BaseModel

from api.errors import (
    SERVICE_UNAVAILABLE_BODY,
    ApiError,
    error_response,
    install_error_handlers,
    overloaded_response,
)
from api.openai_schema import parse_request
from api.tokenizer import ByteTokenizer

# Copied from the seed (000_*.txt, "HTTP/1.1 503 Service Unavailable"), key order included.
SEED_503_TEXT = """{
 "message": "Service temporarily unavailable: All workers are busy, please retry later",
 "type": "service_unavailable",
 "code": 503
}"""


def assert_openai_shape(body: object) -> dict:
    assert isinstance(body, dict) and set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err


@pytest.mark.parametrize(
    ("status", "expected_type"),
    [(400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
     (404, "not_found_error"), (413, "invalid_request_error"), (500, "internal_error")],
)
def test_api_error_default_types(status: int, expected_type: str) -> None:
    err = assert_openai_shape(ApiError(status, "boom").body())
    assert err["type"] == expected_type
    assert err["message"] == "boom"
    assert err["param"] is None and err["code"] is None


def test_api_error_carries_param_code_and_explicit_type() -> None:
    exc = ApiError(413, "too long", param="prompt", code="prompt_too_long")
    assert exc.body() == {"error": {"message": "too long", "type": "invalid_request_error",
                                    "param": "prompt", "code": "prompt_too_long"}}
    custom = ApiError(400, "x", type="custom_error")
    assert custom.body()["error"]["type"] == "custom_error"


def test_service_unavailable_body_is_the_seeds_byte_for_byte() -> None:
    seed = json.loads(SEED_503_TEXT)
    assert SERVICE_UNAVAILABLE_BODY == seed
    assert list(SERVICE_UNAVAILABLE_BODY) == list(seed)  # same key order
    resp = overloaded_response()
    assert resp.status_code == 503
    assert resp.body == json.dumps(seed, separators=(",", ":")).encode()
    assert "retry-after" not in resp.headers


def test_overloaded_response_retry_after_rounds_up_to_whole_seconds() -> None:
    assert overloaded_response(0.2).headers["retry-after"] == "1"
    assert overloaded_response(2.5).headers["retry-after"] == "3"
    assert overloaded_response(4).headers["retry-after"] == "4"


def test_api_error_503_renders_in_the_seed_shape() -> None:
    body = ApiError(503, SERVICE_UNAVAILABLE_BODY["message"]).body()
    assert body == SERVICE_UNAVAILABLE_BODY


def test_error_response_status_headers_and_body() -> None:
    resp = error_response(401, "bad token", headers={"WWW-Authenticate": "Bearer"})
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"] == "Bearer"
    err = assert_openai_shape(json.loads(resp.body))
    assert err["type"] == "authentication_error"


# --- handlers on a tiny app served by uvicorn on a real socket --------------------------------


class Typed(BaseModel):
    name: str
    count: int


def build_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        parsed = parse_request("completions", await request.body(), ByteTokenizer(),
                               max_prompt_tokens=64)
        return {"n": len(parsed.prompt_ids)}

    @app.post("/typed")
    async def typed(item: Typed) -> dict:
        return {"name": item.name}

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("secret-internal-detail")

    @app.get("/admin")
    async def admin() -> dict:
        raise ApiError(403, "not allowed")

    @app.get("/busy")
    async def busy() -> dict:
        raise ApiError(503, SERVICE_UNAVAILABLE_BODY["message"], headers={"Retry-After": "1"})

    return app


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(), log_level="critical", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    deadline = asyncio.get_running_loop().time() + 10
    while not server.started:
        assert not task.done(), "uvicorn exited before starting"
        assert asyncio.get_running_loop().time() < deadline, "uvicorn did not start"
        await asyncio.sleep(0.01)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            yield http
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


async def test_malformed_json_is_400_openai_shape(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/completions", content=b'{"model": "m", "prompt": ')
    assert resp.status_code == 400
    assert assert_openai_shape(resp.json())["type"] == "invalid_request_error"


async def test_fastapi_json_decode_failure_is_400(client: httpx.AsyncClient) -> None:
    resp = await client.post("/typed", content=b"{not json",
                             headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert assert_openai_shape(resp.json())["type"] == "invalid_request_error"


async def test_fastapi_validation_error_is_400_with_param(client: httpx.AsyncClient) -> None:
    resp = await client.post("/typed", json={"name": "x", "count": "many"})
    assert resp.status_code == 400
    err = assert_openai_shape(resp.json())
    assert err["param"] == "count"


async def test_api_error_from_parser_keeps_status_and_param(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x" * 65})
    assert resp.status_code == 413
    err = assert_openai_shape(resp.json())
    assert (err["param"], err["code"]) == ("prompt", "prompt_too_long")
    ok = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert ok.status_code == 200


async def test_unknown_route_is_404_openai_shape(client: httpx.AsyncClient) -> None:
    resp = await client.get("/nope")
    assert resp.status_code == 404
    assert assert_openai_shape(resp.json())["type"] == "not_found_error"


async def test_wrong_method_is_405_with_allow_header(client: httpx.AsyncClient) -> None:
    resp = await client.get("/v1/completions")
    assert resp.status_code == 405
    assert "POST" in resp.headers.get("allow", "")
    assert_openai_shape(resp.json())


async def test_unhandled_exception_is_500_without_traceback(
        client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    resp = await client.get("/boom")
    assert resp.status_code == 500
    err = assert_openai_shape(resp.json())
    assert err["type"] == "internal_error"
    assert "Traceback" not in resp.text and "secret-internal-detail" not in resp.text
    assert any(r.exc_info and "secret-internal-detail" in str(r.exc_info[1])
               for r in caplog.records)


async def test_api_error_403_and_503(client: httpx.AsyncClient) -> None:
    resp = await client.get("/admin")
    assert resp.status_code == 403
    assert assert_openai_shape(resp.json())["type"] == "permission_error"
    busy = await client.get("/busy")
    assert busy.status_code == 503
    assert busy.json() == SERVICE_UNAVAILABLE_BODY
    assert busy.headers["retry-after"] == "1"
