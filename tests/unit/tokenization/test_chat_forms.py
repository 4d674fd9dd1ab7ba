"""The Responses API's and Anthropic's request bodies as chat messages (what the router and the
simulated engine both tokenize)."""

from __future__ import annotations

import pytest

from tokenization.chat_forms import FormError, anthropic_messages, responses_messages


def test_responses_instructions_and_text_input() -> None:
    assert responses_messages({"instructions": "be brief", "input": "hi"}) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_responses_items_parts_and_tool_calls() -> None:
    body = {"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_image", "image_url": "x"},
                                     {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "c"}]},
        {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "1"},
        {"type": "function_call_output", "call_id": "1", "output": "42"},
        {"type": "reasoning", "summary": []},
    ]}
    assert responses_messages(body) == [
        {"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"},
        {"role": "assistant", "content": "f({})"}, {"role": "tool", "content": "42"}]


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 3}, "input"),
    ({"input": "x", "instructions": 3}, "instructions"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
     "input[0].content[0].text"),
])
def test_responses_refusals_name_the_parameter(body: dict[str, object], param: str) -> None:
    with pytest.raises(FormError) as info:
        responses_messages(body)
    assert info.value.param == param


def test_anthropic_system_blocks_and_tool_use() -> None:
    body = {"system": [{"type": "text", "text": "sys"}], "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "text", "text": "let me see"},
                                          {"type": "tool_use", "id": "t", "name": "f",
                                           "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": "done"}]},
    ]}
    assert anthropic_messages(body) == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me seef({'x': 1})"},
        {"role": "user", "content": "done"}]


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
])
def test_anthropic_refusals_name_the_parameter(body: dict[str, object], param: str) -> None:
    with pytest.raises(FormError) as info:
        anthropic_messages(body)
    assert info.value.param == param
