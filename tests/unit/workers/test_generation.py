"""Deterministic output, the resumption property, and the shared byte tokenizer."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from eventlog.hashing import tokens_hashes
from tokenization.tokens import VOCAB_SIZE, chat_prompt, decode, encode
from workers.generation import ContextState, expected_tokens, next_token, wrong_token
from workers.scheduler import EngineConfig, EngineCore


def test_outputs_are_deterministic_printable_and_prompt_dependent() -> None:
    a = expected_tokens(encode("hello"), 50)
    assert a == expected_tokens(encode("hello"), 50)
    assert all(32 <= t <= 126 for t in a)
    assert a != expected_tokens(encode("hellp"), 50)
    assert expected_tokens(encode("hello"), 20) == a[:20]


def test_resumption_continues_identically() -> None:
    prompt = encode("The quick brown fox")
    first10 = expected_tokens(prompt, 10)
    assert expected_tokens(prompt + first10[:4], 6) == first10[4:]


def test_resumption_through_the_engine_core() -> None:
    prompt = list(range(40))
    core = EngineCore(EngineConfig(num_gpu_blocks=64))
    full = core.add("full", prompt, max_tokens=10)
    while not full.done:
        core.step()
    other = EngineCore(EngineConfig(num_gpu_blocks=64))  # "another engine"
    resumed = other.add("resumed", prompt + full.output[:4], max_tokens=6)
    while not resumed.done:
        other.step()
    assert resumed.output == full.output[4:]


def test_context_state_is_incremental() -> None:
    state = ContextState([1, 2])
    state.append(3)
    assert state.digest() == ContextState([1, 2, 3]).digest()
    copy = state.copy()
    copy.append(4)
    assert state.digest() != copy.digest()


def test_wrong_token_always_differs() -> None:
    for i in range(300):
        state = ContextState([i])
        assert wrong_token(state) != next_token(state)
        assert 32 <= wrong_token(state) <= 126


@given(st.text())
def test_encode_decode_round_trip(text: str) -> None:
    ids = encode(text)
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert decode(ids) == text


def test_decode_renders_large_ids_as_stable_words_and_bad_bytes_as_replacement() -> None:
    assert decode([104, 105, 70000, 33]) == "hi" + decode([70000]) + "!"
    assert decode([70000]) == decode([70000]) and decode([70000]) != decode([70001])
    assert decode([70000]).strip().isalpha()
    assert decode([0xFF]) == "\ufffd"


def test_chat_prompt_is_stable_and_multi_turn_prompts_share_a_prefix() -> None:
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": [{"type": "text", "text": "more"}]}]
    p1, p2 = chat_prompt(turn1), chat_prompt(turn2)
    assert p1 == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert p2.startswith(p1)
    assert p2.endswith("<|user|>\nmore\n<|assistant|>\n")


def test_block_hashes_follow_the_documented_rule() -> None:
    import struct

    import xxhash
    tokens = list(range(40))
    expected = [xxhash.xxh3_64_intdigest(struct.pack("<16I", *tokens[i:i + 16]), seed=1337)
                for i in (0, 16)]
    assert tokens_hashes(tokens, 16) == expected  # the trailing 8 tokens are not hashed
