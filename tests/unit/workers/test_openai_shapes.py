"""The simulated engine's request parsing: what a body's prompt becomes, and what is refused."""

from __future__ import annotations

from typing import Any

import pytest

from tokenization.tokens import MAX_TOKEN_ID
from workers.openai_shapes import BadRequest, decode_body, parse_request


def _parse(body: Any) -> list[int]:
    return parse_request(body, chat=False, default_max_tokens=16).prompt_ids


def test_token_ids_are_the_prompt() -> None:
    assert _parse({"prompt": [0, 5, MAX_TOKEN_ID]}) == [0, 5, MAX_TOKEN_ID]
    assert _parse({"prompt": [[7, 8]]}) == [7, 8]


@pytest.mark.parametrize("ids", [[1, -1], [MAX_TOKEN_ID + 1], [3, 2**70]])
def test_ids_out_of_range_are_refused_by_range(ids: list[int]) -> None:
    with pytest.raises(BadRequest, match=r"token ids must be in 0\.\.") as caught:
        _parse({"prompt": ids})
    assert caught.value.param == "prompt"


@pytest.mark.parametrize(("prompt", "why"), [
    ([1, True], "only one prompt"), ([1, 2.0], "only one prompt"), ([1, "2"], "only one prompt"),
    ([True], "prompt must be a string"), ([], "prompt must be a string")])
def test_a_list_that_is_not_all_integers_is_not_token_ids(prompt: list[Any], why: str) -> None:
    with pytest.raises(BadRequest, match=why) as caught:
        _parse({"prompt": prompt})
    assert caught.value.param == "prompt"


def test_a_text_prompt_is_encoded() -> None:
    assert _parse({"prompt": "ab"}) == _parse({"prompt": ["ab"]})
    assert len(_parse({"prompt": "ab"})) >= 2


@pytest.mark.parametrize("raw", [b"{", b'{"prompt": "\xff"}', b"[" * 100_000, b"NaN", b""])
def test_a_body_that_is_not_json_is_a_bad_request(raw: bytes) -> None:
    with pytest.raises(BadRequest, match="not valid JSON"):
        decode_body(raw)


def test_an_id_past_64_bits_in_a_body_is_refused_by_range() -> None:
    body = decode_body(b'{"prompt": [1, 100000000000000000000000]}')
    with pytest.raises(BadRequest, match=r"token ids must be in 0\.\."):
        _parse(body)


def test_a_json_body_decodes() -> None:
    assert decode_body(b'{"prompt": [1, 2], "max_tokens": 3}') == {"prompt": [1, 2],
                                                                   "max_tokens": 3}
