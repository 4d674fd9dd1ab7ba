"""The pure pieces of the extra routes: usage figures read from every answer shape, batched
choices re-indexed and usage summed, errors turned into Anthropic's shape."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse, Response

from api.errors import ApiError, overloaded_response
from api.forward.passthrough import find_usage, usage_counts
from api.routes.batch import _reindex, summed_usage
from api.routes.messages import as_anthropic


def test_usage_from_openai_responses_and_anthropic_shapes() -> None:
    assert usage_counts({"completion_tokens": 3,
                         "prompt_tokens_details": {"cached_tokens": 16}}) == (3, 16)
    assert usage_counts({"output_tokens": 4,
                         "input_tokens_details": {"cached_tokens": 0}}) == (4, 0)
    assert usage_counts({"output_tokens": 5, "cache_read_input_tokens": 32}) == (5, 32)
    assert usage_counts({"prompt_tokens": 3, "total_tokens": 3}) is None  # embeddings
    assert usage_counts({"completion_tokens": True}) is None
    assert find_usage({"type": "response.completed",
                       "response": {"usage": {"output_tokens": 7}}}) == (7, -1)
    assert find_usage({"type": "message_start",
                       "message": {"usage": {"input_tokens": 9, "output_tokens": 0}}}) == (0, -1)
    assert find_usage({"choices": []}) is None


def test_batched_choices_are_indexed_by_prompt_then_choice() -> None:
    assert [c["index"] for c in _reindex([{"index": 0}, {"index": 1}], 2, 2)] == [4, 5]
    assert _reindex(None, 0, 1) == []


def test_usage_is_summed_and_cached_tokens_only_when_every_part_has_them() -> None:
    a = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
         "prompt_tokens_details": {"cached_tokens": 1}}
    b = {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
    assert summed_usage([a, b]) == {"prompt_tokens": 6, "completion_tokens": 4,
                                    "total_tokens": 10}
    assert summed_usage([a, a])["prompt_tokens_details"] == {"cached_tokens": 2}


def body_of(resp: Response) -> dict[str, object]:
    return json.loads(bytes(resp.body))


def test_errors_become_anthropics_shape_and_keep_status_and_retry_after() -> None:
    bad = as_anthropic(ApiError(400, "messages: empty", param="messages").response())
    assert bad.status_code == 400
    assert body_of(bad) == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": "messages: empty"}}
    busy = as_anthropic(overloaded_response(retry_after=2))
    assert busy.status_code == 503 and busy.headers["retry-after"]
    assert body_of(busy)["error"]["type"] == "overloaded_error"  # type: ignore[index]
    already = JSONResponse({"type": "error", "error": {"type": "x", "message": "y"}}, 404)
    assert as_anthropic(already) is already
    ok = Response(b"{}")
    assert as_anthropic(ok) is ok
