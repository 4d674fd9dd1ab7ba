"""The KV hand-off's wire pieces: the handle a decode engine accepts, and how the router passes
it on inside the forwarded body."""

from __future__ import annotations

import msgspec

from api.forward.continuation import with_transfer
from eventlog.hashing import tokens_hashes
from eventlog.names import PREFILL_HOP, prefill_request_id, split_hop
from workers.handoff import transferred_tokens

BS = 16
PROMPT = list(range(5 * BS + 3))


def handle(prompt: list[int], block_size: int = BS) -> dict[str, object]:
    return {"kv_transfer": {"block_size": block_size,
                            "block_hashes": tokens_hashes(prompt, block_size)}}


def test_the_leading_blocks_that_agree_are_transferred() -> None:
    assert transferred_tokens(handle(PROMPT), PROMPT, BS) == 5 * BS
    other = [*PROMPT[:2 * BS], 99999, *PROMPT[2 * BS + 1:]]
    assert transferred_tokens(handle(other), PROMPT, BS) == 2 * BS
    # Another block size, no handle, a malformed one: nothing is transferred.
    assert transferred_tokens(handle(PROMPT, 32), PROMPT, BS) == 0
    assert transferred_tokens({}, PROMPT, BS) == 0
    assert transferred_tokens({"kv_transfer": {"block_size": BS, "block_hashes": "x"}},
                              PROMPT, BS) == 0


def test_handle_rides_in_the_jetrouter_extension() -> None:
    body = msgspec.json.encode({"model": "m", "prompt": "hi", "jetrouter": {"dp_rank": 1}})
    # The prefill router hands jetrouter's own hand-off as the ``jetrouter`` object to merge.
    transfer = {"jetrouter": {"kv_transfer": {"handle": "p0/x"}}}
    out = msgspec.json.decode(with_transfer(body, transfer))
    assert out["jetrouter"] == {"dp_rank": 1, "kv_transfer": {"handle": "p0/x"}}
    assert out["prompt"] == "hi"


def test_prefill_hop_groups_under_its_request() -> None:
    assert split_hop(prefill_request_id("abc")) == ("abc", PREFILL_HOP)
    assert split_hop("abc~2") == ("abc", 2) and split_hop("a~prefillx") == ("a~prefillx", 0)
