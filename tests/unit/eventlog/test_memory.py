"""What only the in-memory log has to say: subject wildcards and the duplicate window's age (the
shared behaviour is the contract in tests/contracts/test_log_contract.py)."""

from __future__ import annotations

import pytest

from eventlog.events import BlocksStored
from eventlog.memory import MemoryLog, subject_matches
from eventlog.names import KV, Names

pytestmark = pytest.mark.timeout(60)

NAMES = Names("jr")


@pytest.mark.parametrize(("pattern", "subject", "matches"), [
    ("jr.kv.>", "jr.kv.w1", True),
    ("jr.kv.>", "jr.kv.w1.more", True),
    ("jr.kv.>", "jr.kv", False),
    ("jr.kv.*", "jr.kv.w1", True),
    ("jr.kv.*", "jr.kv.w1.more", False),
    ("jr.kv.w1", "jr.kv.w1", True),
    ("jr.kv.w1", "jr.kv.w2", False),
    ("jr.router.>", "jr.kv.w1", False),
])
def test_subject_matching_follows_nats_wildcards(pattern: str, subject: str,
                                                 matches: bool) -> None:
    assert subject_matches(pattern, subject) is matches


async def test_a_message_id_is_new_again_once_the_duplicate_window_has_passed() -> None:
    now = [100.0]
    log = MemoryLog(duplicate_window=2.0, clock=lambda: now[0])
    await log.ensure_streams(NAMES, kinds=(KV,))
    event = BlocksStored("w1", 1, 0, None, [(1, 1)], 1.0)
    subject = NAMES.kv_subject("w1")
    assert await log.append(subject, [event], "id") == 1
    now[0] += 1.9
    assert await log.append(subject, [event], "id") == 1
    assert log.duplicates == 1
    now[0] += 0.2  # 2.1 s after the first append: the window no longer remembers it
    assert await log.append(subject, [event], "id") == 2


async def test_ensuring_twice_keeps_what_the_stream_holds() -> None:
    log = MemoryLog()
    await log.ensure_streams(NAMES)
    await log.append(NAMES.kv_subject("w1"), [BlocksStored("w1", 1, 0, None, [], 1.0)], "a")
    await log.ensure_streams(NAMES)
    assert await log.bounds(NAMES.stream(KV)) == (1, 1)
