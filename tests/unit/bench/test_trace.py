"""Trace loading, the workload generator and the record -> token-id prompt mapping."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

import pytest

from bench.trace import (
    TRACE_BLOCK_SIZE,
    GeneratorParams,
    PromptBuilder,
    TraceRecord,
    describe_records,
    generate,
    iter_jsonl,
    load_jsonl,
    select,
)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_jsonl_sorts_by_timestamp_and_keeps_fields(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [
        {"timestamp": 30, "input_length": 600, "output_length": 5, "hash_ids": [0, 2]},
        {"timestamp": 10, "input_length": 100, "output_length": 7, "hash_ids": [0]},
    ])
    records = load_jsonl(path)
    assert [r.timestamp_ms for r in records] == [10.0, 30.0]
    assert records[1] == TraceRecord(30.0, 600, 5, (0, 2))


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "hash_ids"),
    ("not json", "t.jsonl:2"),
    ('{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}', ">= 0"),
])
def test_load_jsonl_names_the_bad_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
                    + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_jsonl(path)


def test_select_applies_offset_rebases_and_caps() -> None:
    records = [TraceRecord(float(t), 10, 1, (t,)) for t in (0, 1000, 2500, 4000, 9000)]
    picked = select(records, start_offset_s=1.0, max_requests=3)
    assert [r.timestamp_ms for r in picked] == [0.0, 1500.0, 3000.0]
    assert [r.hash_ids for r in picked] == [(1000,), (2500,), (4000,)]
    assert select(records, start_offset_s=100.0) == []


def test_generator_shape_shared_system_prompts_and_growing_context() -> None:
    params = GeneratorParams(sessions=20, turns=4, system_prompts=3, system_blocks=5, seed=7)
    records = generate(params)
    assert len(records) == 20 * 4
    assert [r.timestamp_ms for r in records] == sorted(r.timestamp_ms for r in records)
    by_session: dict[int, list[TraceRecord]] = defaultdict(list)
    for r in records:
        assert r.session is not None
        by_session[r.session].append(r)
        # Mooncake invariant: every id but the last covers 512 tokens, the last at most 512.
        assert (len(r.hash_ids) - 1) * TRACE_BLOCK_SIZE < r.input_length
        assert r.input_length <= len(r.hash_ids) * TRACE_BLOCK_SIZE
    system_prefixes = {r.hash_ids[:5] for r in records}
    assert 1 < len(system_prefixes) <= 3, "sessions share a few system prompts"
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn or 0)
        assert [r.turn for r in turns] == [0, 1, 2, 3]
        for prev, cur in itertools.pairwise(turns):
            assert cur.timestamp_ms >= prev.timestamp_ms
            assert cur.input_length > prev.input_length
            # the whole previous context (bar its partial tail) is the next turn's prefix
            assert cur.hash_ids[:len(prev.hash_ids) - 1] == prev.hash_ids[:-1]
            assert cur.hash_ids[len(prev.hash_ids) - 1] != prev.hash_ids[-1]
    assert generate(params) == records, "deterministic for a seed"
    assert generate(GeneratorParams(sessions=20, seed=8)) != records


def test_generator_rate_sets_the_arrival_rate() -> None:
    records = generate(GeneratorParams(sessions=400, turns=1, rate=10.0, seed=1))
    shape = describe_records(records)
    assert 8.0 < shape["requests"] / shape["duration_s"] < 12.5


def test_generated_records_round_trip_through_jsonl(tmp_path: Path) -> None:
    records = generate(GeneratorParams(sessions=3, turns=2))
    path = tmp_path / "g.jsonl"
    path.write_text("".join(line + "\n" for line in iter_jsonl(records)))
    loaded = load_jsonl(path)
    assert [(r.timestamp_ms, r.hash_ids, r.input_length) for r in loaded] == \
        [(r.timestamp_ms, r.hash_ids, r.input_length) for r in records]


def test_prompt_tokens_deterministic_and_prefix_equal() -> None:
    b = PromptBuilder(block_tokens=32, vocab_size=256)
    a = TraceRecord(0, 3 * 512, 1, (10, 11, 12))
    c = TraceRecord(0, 2 * 512 + 100, 1, (10, 11, 99))
    pa, pc = b.prompt(a), b.prompt(c)
    assert len(pa) == 96
    assert len(pc) == 64 + 7  # 100 of 512 tokens -> ceil(100 * 32 / 512) = 7
    assert pa[:64] == pc[:64], "equal hash ids give equal token prefixes"
    assert pa[64:71] != pc[64:71], "different ids give different tokens"
    assert all(0 <= t < 256 for t in pa + pc)
    assert PromptBuilder(32, 256).prompt(a) == pa, "stable across builders"
    # the same id in another position is the same run of tokens
    assert b.prompt(TraceRecord(0, 512, 1, (11,))) == pa[32:64]


def test_prompt_partial_tail_is_a_prefix_of_the_full_block() -> None:
    b = PromptBuilder(block_tokens=16, vocab_size=50_000)
    full = b.prompt(TraceRecord(0, 1024, 1, (1, 2)))
    short = b.prompt(TraceRecord(0, 520, 1, (1, 2)))
    assert short == full[:17]
    assert max(full) >= 256 and all(0 <= t < 50_000 for t in full), "wide vocab is used"


def test_prompt_filler_beyond_the_hash_ids_and_for_empty_ids() -> None:
    b = PromptBuilder(block_tokens=32)
    over = b.prompt(TraceRecord(0, 512 + 256, 1, (5,)), filler_key=1)
    assert len(over) == 32 + 16 and over[:32] == list(b.block(5))
    assert len(b.prompt(TraceRecord(0, 40, 1, ()))) == 3
    assert b.prompt(TraceRecord(0, 0, 1, ())) != [], "never an empty prompt"


def test_text_prompts_share_prefixes_word_for_word() -> None:
    from bench.trace import TEXT_ID_SPACE, words_of
    from workers.tinymodel import WORDS

    builder = PromptBuilder(8, TEXT_ID_SPACE)
    a = TraceRecord(0.0, 3 * 512, 1, (1, 2, 3))
    b = TraceRecord(1.0, 3 * 512, 1, (1, 2, 4))
    ta, tb = (words_of(builder.prompt(r), WORDS) for r in (a, b))
    assert len(ta.split()) == len(tb.split()) == 24
    assert ta.split()[:16] == tb.split()[:16] and ta != tb
    assert set(ta.split()) <= set(WORDS)


def test_the_default_trace_is_the_shared_one_beside_this_checkout() -> None:
    from bench.trace import default_trace_path

    repo = Path(__file__).resolve().parents[3]
    beside = (repo / "../shared/traces/mooncake/conversation_trace.jsonl").resolve()
    assert default_trace_path() == (beside if beside.is_file() else None)
