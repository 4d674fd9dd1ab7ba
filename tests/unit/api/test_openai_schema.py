"""api.openai_schema.parse_request: every validation rule, and good requests of every form."""

from __future__ import annotations

import json
from typing import Any

import pytest

from api.errors import ApiError
from api.openai_schema import ParsedRequest, parse_request
from api.tokenizer import ByteTokenizer
from tokenization import tokens

TOK = ByteTokenizer()
LIMIT = 1000
CHAT = [{"role": "user", "content": "hi"}]


def parse(endpoint: str, body: Any, *, header: str | None = None,
          limit: int = LIMIT) -> ParsedRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(endpoint, raw, TOK, max_prompt_tokens=limit, priority_header=header)


def comp(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hello", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": CHAT, **fields}


def hints(**h: Any) -> dict[str, Any]:
    return {"nvext": {"agent_hints": h}}


# (case id, endpoint, body (dict or raw bytes), x-priority header, status, error type, param)
BAD: list[tuple[str, str, Any, str | None, int, str, str | None]] = [
    ("not-json", "completions", b"{nope", None, 400, "invalid_request_error", None),
    ("nan", "completions", b'{"model":"m","prompt":"x","temperature":NaN}', None, 400,
     "invalid_request_error", None),
    ("not-utf8", "completions", b'{"model":"m","prompt":"\xff"}', None, 400,
     "invalid_request_error", None),
    ("empty-body", "chat", b"", None, 400, "invalid_request_error", None),
    ("array-body", "completions", [1, 2], None, 400, "invalid_request_error", None),
    ("string-body", "chat", "hello", None, 400, "invalid_request_error", None),
    ("model-missing", "completions", {"prompt": "x"}, None, 400, "invalid_request_error",
     "model"),
    ("model-int", "completions", comp(model=3), None, 400, "invalid_request_error", "model"),
    ("model-empty", "chat", chat(model=""), None, 400, "invalid_request_error", "model"),
    ("prompt-missing", "completions", {"model": "m"}, None, 400, "invalid_request_error",
     "prompt"),
    ("prompt-null", "completions", comp(prompt=None), None, 400, "invalid_request_error",
     "prompt"),
    ("prompt-empty-str", "completions", comp(prompt=""), None, 400, "invalid_request_error",
     "prompt"),
    ("prompt-empty-list", "completions", comp(prompt=[]), None, 400, "invalid_request_error",
     "prompt"),
    ("prompt-int", "completions", comp(prompt=5), None, 400, "invalid_request_error", "prompt"),
    ("prompt-object", "completions", comp(prompt={"a": 1}), None, 400,
     "invalid_request_error", "prompt"),
    ("prompt-list-of-floats", "completions", comp(prompt=[1.5, 2.0]), None, 400,
     "invalid_request_error", "prompt"),
    ("prompt-list-of-bools", "completions", comp(prompt=[True]), None, 400,
     "invalid_request_error", "prompt"),
    ("prompt-ids-mixed", "completions", comp(prompt=[1, "a"]), None, 400,
     "invalid_request_error", "prompt"),
    ("prompt-id-negative", "completions", comp(prompt=[1, -1]), None, 400,
     "invalid_request_error", "prompt"),
    ("prompt-id-too-big", "completions", comp(prompt=[2**31]), None, 400,
     "invalid_request_error", "prompt"),
    ("prompt-batched-strings", "completions", comp(prompt=["a", "b"]), None, 400,
     "invalid_request_error", "prompt"),
    ("prompt-batched-ids", "completions", comp(prompt=[[1], [2]]), None, 400,
     "invalid_request_error", "prompt"),
    ("prompt-one-empty-str", "completions", comp(prompt=[""]), None, 400,
     "invalid_request_error", "prompt"),
    ("prompt-one-empty-ids", "completions", comp(prompt=[[]]), None, 400,
     "invalid_request_error", "prompt"),
    ("prompt-one-bad-ids", "completions", comp(prompt=[[1, -2]]), None, 400,
     "invalid_request_error", "prompt"),
    ("messages-missing", "chat", {"model": "m"}, None, 400, "invalid_request_error", "messages"),
    ("messages-empty", "chat", chat(messages=[]), None, 400, "invalid_request_error",
     "messages"),
    ("messages-string", "chat", chat(messages="hi"), None, 400, "invalid_request_error",
     "messages"),
    ("message-not-object", "chat", chat(messages=["hi"]), None, 400, "invalid_request_error",
     "messages[0]"),
    ("message-role-missing", "chat", chat(messages=[{"content": "x"}]), None, 400,
     "invalid_request_error", "messages[0].role"),
    ("message-role-int", "chat", chat(messages=[{"role": 1, "content": "x"}]), None, 400,
     "invalid_request_error", "messages[0].role"),
    ("message-role-unknown", "chat", chat(messages=[*CHAT, {"role": "wizard", "content": "x"}]),
     None, 400, "invalid_request_error", "messages[1].role"),
    ("message-role-wrong-case", "chat", chat(messages=[{"role": "User", "content": "x"}]), None,
     400, "invalid_request_error", "messages[0].role"),
    ("message-content-missing", "chat", chat(messages=[{"role": "user"}]), None, 400,
     "invalid_request_error", "messages[0].content"),
    ("message-content-int", "chat", chat(messages=[*CHAT, {"role": "user", "content": 3}]),
     None, 400, "invalid_request_error", "messages[1].content"),
    ("message-part-image", "chat",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     None, 400, "invalid_request_error", "messages[0].content[0]"),
    ("message-part-text-int", "chat",
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
     None, 400, "invalid_request_error", "messages[0].content[0].text"),
    ("max-tokens-zero", "completions", comp(max_tokens=0), None, 400, "invalid_request_error",
     "max_tokens"),
    ("max-tokens-negative", "chat", chat(max_tokens=-5), None, 400, "invalid_request_error",
     "max_tokens"),
    # Found by the HTTP fuzz test: a 400-digit max_tokens reached the routing decision (500).
    ("max-tokens-huge", "chat", chat(max_tokens=10**400), None, 400, "invalid_request_error",
     "max_tokens"),
    ("max-completion-tokens-huge", "chat", chat(max_completion_tokens=2**31), None, 400,
     "invalid_request_error", "max_completion_tokens"),
    ("max-tokens-float", "completions", comp(max_tokens=1.5), None, 400,
     "invalid_request_error", "max_tokens"),
    ("max-tokens-string", "completions", comp(max_tokens="10"), None, 400,
     "invalid_request_error", "max_tokens"),
    ("max-tokens-bool", "completions", comp(max_tokens=True), None, 400,
     "invalid_request_error", "max_tokens"),
    ("max-completion-tokens-zero", "chat", chat(max_completion_tokens=0), None, 400,
     "invalid_request_error", "max_completion_tokens"),
    ("temperature-high", "completions", comp(temperature=2.01), None, 400,
     "invalid_request_error", "temperature"),
    ("temperature-negative", "chat", chat(temperature=-0.1), None, 400,
     "invalid_request_error", "temperature"),
    ("temperature-string", "chat", chat(temperature="hot"), None, 400,
     "invalid_request_error", "temperature"),
    ("top-p-zero", "completions", comp(top_p=0), None, 400, "invalid_request_error", "top_p"),
    ("top-p-high", "chat", chat(top_p=1.1), None, 400, "invalid_request_error", "top_p"),
    ("n-too-many", "completions", comp(n=129), None, 400, "invalid_request_error", "n"),
    ("n-zero", "chat", chat(n=0), None, 400, "invalid_request_error", "n"),
    ("n-string", "chat", chat(n="1"), None, 400, "invalid_request_error", "n"),
    ("stream-string", "completions", comp(stream="true"), None, 400, "invalid_request_error",
     "stream"),
    ("stream-int", "chat", chat(stream=1), None, 400, "invalid_request_error", "stream"),
    ("stream-options-list", "chat", chat(stream=True, stream_options=[]), None, 400,
     "invalid_request_error", "stream_options"),
    ("include-usage-string", "chat", chat(stream=True, stream_options={"include_usage": "y"}),
     None, 400, "invalid_request_error", "stream_options.include_usage"),
    ("nvext-list", "chat", chat(nvext=[]), None, 400, "invalid_request_error", "nvext"),
    ("agent-hints-string", "chat", chat(nvext={"agent_hints": "x"}), None, 400,
     "invalid_request_error", "nvext.agent_hints"),
    ("priority-header-unknown", "completions", comp(), "urgent", 400, "invalid_request_error",
     "x-priority"),
    ("priority-hint-unknown", "chat", chat(**hints(priority="vip")), None, 400,
     "invalid_request_error", "nvext.agent_hints.priority"),
    ("priority-hint-int", "chat", chat(**hints(priority=1)), None, 400,
     "invalid_request_error", "nvext.agent_hints.priority"),
    ("overlap-weight-negative", "chat", chat(**hints(kv_overlap_score_weight=-1)), None, 400,
     "invalid_request_error", "nvext.agent_hints.kv_overlap_score_weight"),
    ("overlap-weight-string", "chat", chat(**hints(kv_overlap_score_weight="1")), None, 400,
     "invalid_request_error", "nvext.agent_hints.kv_overlap_score_weight"),
    ("osl-zero", "completions", comp(**hints(osl=0)), None, 400, "invalid_request_error",
     "nvext.agent_hints.osl"),
    ("osl-float", "completions", comp(**hints(osl=2.5)), None, 400, "invalid_request_error",
     "nvext.agent_hints.osl"),
    ("latency-string", "completions", comp(**hints(latency_sensitivity="hi")), None, 400,
     "invalid_request_error", "nvext.agent_hints.latency_sensitivity"),
    ("prompt-too-long", "completions", comp(prompt="x" * (LIMIT + 1)), None, 413,
     "invalid_request_error", "prompt"),
    ("prompt-ids-too-long", "completions", comp(prompt=[7] * (LIMIT + 1)), None, 413,
     "invalid_request_error", "prompt"),
    ("chat-too-long", "chat", chat(messages=[{"role": "user", "content": "y" * (LIMIT + 1)}]), None,
     413, "invalid_request_error", "messages"),
]


@pytest.mark.parametrize(("endpoint", "body", "header", "status", "etype", "param"),
                         [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_requests_are_rejected(endpoint: str, body: Any, header: str | None, status: int,
                                   etype: str, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        parse(endpoint, body, header=header)
    exc = info.value
    assert exc.status == status
    err = exc.body()["error"]
    assert (err["type"], err["param"]) == (etype, param)
    assert err["message"]
    if status == 413:
        assert err["code"] == "prompt_too_long"


def test_n_is_carried_and_batches_are_split_only_where_allowed() -> None:
    assert parse("completions", comp(n=3)).n == 3
    assert parse("chat", chat(n=2)).n == 2
    with pytest.raises(ApiError, match="one prompt per request"):
        parse("completions", comp(prompt=["a", "b"]))
    raw = json.dumps(comp(prompt=["a", [1, 2]], n=2)).encode()
    batched = parse_request("completions", raw, TOK, max_prompt_tokens=LIMIT, allow_batch=True)
    assert batched.batch == ["a", [1, 2]] and batched.prompt_ids == [] and batched.n == 2
    too_many = json.dumps(comp(prompt=["a"] * 257)).encode()
    with pytest.raises(ApiError, match="at most 256"):
        parse_request("completions", too_many, TOK, max_prompt_tokens=LIMIT, allow_batch=True)


def test_unknown_endpoint_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        parse("embeddings", comp())


# --- good requests --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hello", tokens.encode("hello")),
     ("héllo ✓", tokens.encode("héllo ✓")),
     (["hello"], tokens.encode("hello")),
     ([5, 0, 2**31 - 1], [5, 0, 2**31 - 1]),
     ([[9, 8, 7]], [9, 8, 7])],
    ids=["text", "unicode-text", "one-string-list", "token-ids", "one-token-list"],
)
def test_completion_prompt_forms(prompt: Any, expected: list[int]) -> None:
    parsed = parse("completions", comp(prompt=prompt))
    assert parsed.prompt_ids == expected
    assert parsed.endpoint == "completions" and parsed.model == "m"


def test_defaults() -> None:
    parsed = parse("completions", comp())
    assert parsed.stream is False
    assert parsed.max_tokens is None
    assert parsed.include_usage is False
    assert parsed.priority == "standard"
    assert parsed.overlap_weight is None
    assert parsed.expected_osl == 128
    assert parsed.latency_sensitivity == 0.0
    assert parsed.body == comp()


def test_nulls_mean_default() -> None:
    parsed = parse("chat", chat(stream=None, max_tokens=None, temperature=None, top_p=None,
                                n=None, stream_options=None, nvext=None))
    assert (parsed.stream, parsed.max_tokens, parsed.expected_osl) == (False, None, 128)


def test_chat_prompt_is_flattened_messages() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    parsed = parse("chat", chat(messages=messages))
    assert parsed.prompt_ids == tokens.encode(tokens.chat_prompt(messages))
    assert parsed.endpoint == "chat"


def test_chat_content_parts_are_accepted() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]}]
    parsed = parse("chat", chat(messages=messages))
    assert parsed.prompt_ids == tokens.encode(tokens.chat_prompt(messages))
    assert parsed.prompt_ids


def test_assistant_tool_call_turn_may_have_null_content() -> None:
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "user", "content": "and?"}]
    parsed = parse("chat", chat(messages=messages))
    assert parsed.prompt_ids == tokens.encode(tokens.chat_prompt(messages))
    with pytest.raises(ApiError):
        parse("chat", chat(messages=[{"role": "user", "content": None}]))


def test_sampling_bounds_are_inclusive_where_openai_says_so() -> None:
    for temperature in (0, 0.0, 2, 2.0):
        parse("completions", comp(temperature=temperature))
    parse("completions", comp(top_p=1))
    parse("completions", comp(n=1))


def test_stream_and_usage() -> None:
    parsed = parse("chat", chat(stream=True, stream_options={"include_usage": True}))
    assert (parsed.stream, parsed.include_usage) == (True, True)
    parsed = parse("chat", chat(stream=True, stream_options={}))
    assert (parsed.stream, parsed.include_usage) == (True, False)


def test_max_tokens_sets_expected_osl_and_max_completion_tokens_wins() -> None:
    assert parse("completions", comp(max_tokens=40)).expected_osl == 40
    parsed = parse("chat", chat(max_tokens=40, max_completion_tokens=30))
    assert (parsed.max_tokens, parsed.expected_osl) == (30, 30)


def test_agent_hints() -> None:
    parsed = parse("chat", chat(max_tokens=50, **hints(
        osl=300, kv_overlap_score_weight=2.5, latency_sensitivity=1.5, priority="premium")))
    assert parsed.expected_osl == 300
    assert parsed.max_tokens == 50
    assert parsed.overlap_weight == 2.5
    assert parsed.latency_sensitivity == 1.5
    assert parsed.priority == "premium"
    assert parse("chat", chat(**hints(kv_overlap_score_weight=0))).overlap_weight == 0.0


@pytest.mark.parametrize(("header", "tier"), [("premium", "premium"),
                                              ("Best-Effort", "best_effort"),
                                              (" STANDARD ", "standard")])
def test_priority_header_wins_over_hint(header: str, tier: str) -> None:
    parsed = parse("completions", comp(**hints(priority="premium")), header=header)
    assert parsed.priority == tier


def test_prompt_exactly_at_limit_is_accepted() -> None:
    assert len(parse("completions", comp(prompt="z" * LIMIT)).prompt_ids) == LIMIT


def test_body_is_forwarded_untouched() -> None:
    body = comp(stream=True, user="u1", logit_bias={"5": 1}, extra={"x": [1, 2]})
    assert parse("completions", body).body == body


def test_custom_tokenizer_is_used_for_text() -> None:
    class Upper:
        name = "upper"

        def encode(self, text: str) -> list[int]:
            return [ord(c.upper()) for c in text]

    parsed = parse_request("completions", json.dumps(comp(prompt="ab")).encode(), Upper(),
                           max_prompt_tokens=10)
    assert parsed.prompt_ids == [65, 66]


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool", "function"])
def test_every_openai_chat_role_is_accepted(role: str) -> None:
    parsed = parse("chat", chat(messages=[{"role": role, "content": "hi"}]))
    assert parsed.prompt_ids


@pytest.mark.parametrize("raw", [b"[" * 5000 + b"]" * 5000,
                                 b'{"model": "m", "prompt": "x", "extra": ' + b"[" * 3000
                                 + b"]" * 3000 + b"}"])
def test_nesting_deeper_than_the_decoder_allows_is_a_400(raw: bytes) -> None:
    # Found by the HTTP fuzz test: the decoder's RecursionError used to become a 500.
    with pytest.raises(ApiError) as caught:
        parse("completions", raw)
    assert caught.value.status == 400


def test_session_control_and_extra_fields() -> None:
    sc = {"session_id": "abc", "action": "open", "timeout": 30}
    parsed = parse("chat", chat(nvext={"session_control": sc,
                                       "extra_fields": ["timing", "unknown", "worker_id"]}))
    assert parsed.session_control == ("abc", "open", 30.0)
    assert parsed.extra_fields == ("worker_id", "timing")
    bare = parse("chat", chat(nvext={"session_control": {"session_id": "abc"}}))
    assert bare.session_control == ("abc", "bind", None)
    assert parse("chat", chat()).session_control is None


@pytest.mark.parametrize(("nvext", "param"), [
    ({"session_control": "abc"}, "nvext.session_control"),
    ({"session_control": {"action": "open"}}, "nvext.session_control.session_id"),
    ({"session_control": {"session_id": "x" * 513}}, "nvext.session_control.session_id"),
    ({"session_control": {"session_id": "a", "action": "pause"}},
     "nvext.session_control.action"),
    ({"session_control": {"session_id": "a", "timeout": 0}}, "nvext.session_control.timeout"),
    ({"session_control": {"session_id": "a", "timeout": "1"}}, "nvext.session_control.timeout"),
    ({"extra_fields": "timing"}, "nvext.extra_fields"),
])
def test_bad_session_control_and_extra_fields(nvext: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as exc:
        parse("completions", comp(nvext=nvext))
    assert exc.value.status == 400 and exc.value.param == param
