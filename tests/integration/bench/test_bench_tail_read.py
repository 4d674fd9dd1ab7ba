"""`python -m bench.tail_read` at a small scale: it publishes, reads every message back and
prints its figures (never asserted)."""

from __future__ import annotations

import argparse

import pytest

from bench import tail_read


async def test_small_run_reads_every_message(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(messages=300, repeats=2, apply_us=1.0, profile=True,
                              bare=False)
    await tail_read.measure(args)
    out = capsys.readouterr().out
    assert "published 300 messages" in out
    assert out.count("run ") == 2 and "300 messages, 300 events, 0 malformed" in out
    assert "[profiled]" in out and "tottime" in out
