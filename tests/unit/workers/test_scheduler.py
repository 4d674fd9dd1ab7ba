"""The engine core's scheduling and timing, on a virtual clock (step durations added up)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from workers.generation import expected_tokens
from workers.kvcache import Removed, Stored
from workers.scheduler import EngineConfig, EngineCore, RequestTooLarge, SimRequest

CFG = EngineConfig(num_gpu_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                   perf_model="linear", prefill_ms_per_token=0.05, decode_ms_base=8.0,
                   decode_ms_per_seq=0.05)


def ms(prefill_tokens: int, decode_seqs: int, cfg: EngineConfig = CFG) -> float:
    return (cfg.decode_ms_base + cfg.decode_ms_per_seq * decode_seqs
            + cfg.prefill_ms_per_token * prefill_tokens) / 1000


def run_until_done(core: EngineCore, *reqs: SimRequest, limit: int = 10_000
                   ) -> dict[str, float]:
    """Step until every request finished; returns each one's virtual finish time."""
    clock = 0.0
    done: dict[str, float] = {}
    for _ in range(limit):
        if all(r.done for r in reqs):
            return done
        out = core.step()
        clock += out.duration
        for r in out.finished:
            done[r.request_id] = clock
    raise AssertionError("requests did not finish")


def test_chunked_prefill_then_decode_timing() -> None:
    core = EngineCore(CFG)
    req = core.add("r", list(range(150)), max_tokens=3)
    steps = [core.step() for _ in range(5)]
    # 150 prompt tokens in chunks of the 64-token budget: 64, 64, 22; first token after the 3rd.
    assert [(s.prefill_tokens, s.decode_seqs) for s in steps] == [
        (64, 0), (64, 0), (22, 0), (0, 1), (0, 1)]
    assert [s.duration for s in steps] == pytest.approx(
        [ms(64, 0), ms(64, 0), ms(22, 0), ms(0, 1), ms(0, 1)])
    assert [len(s.emitted) for s in steps] == [0, 0, 1, 1, 1]
    assert req.done and steps[-1].finished == [req]
    assert req.output == expected_tokens(list(range(150)), 3)
    assert core.cache.stats().pinned == 0


def test_prefix_cache_hit_skips_cached_tokens() -> None:
    core = EngineCore(CFG)
    prompt = list(range(150))
    first = core.add("a", prompt, max_tokens=1)
    run_until_done(core, first)
    assert first.cached_tokens == 0
    second = core.add("b", [*prompt, 7, 8], max_tokens=1)
    out = core.step()
    assert second.cached_tokens == 144  # 9 full blocks of 16 were cached
    assert out.prefill_tokens == 152 - 144
    assert out.duration == pytest.approx(ms(8, 0))
    assert second.output == expected_tokens([*prompt, 7, 8], 1)


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    core = EngineCore(CFG)
    prompt = list(range(32))
    run_until_done(core, core.add("a", prompt, max_tokens=2))
    again = core.add("b", prompt, max_tokens=1)
    out = core.step()
    assert again.cached_tokens == 32 and out.prefill_tokens == 1 and again.done


def test_decode_and_prefill_share_a_step() -> None:
    core = EngineCore(CFG)
    a = core.add("a", list(range(20)), max_tokens=5)
    core.step()  # a prefilled, first token out
    core.add("b", list(range(100, 140)), max_tokens=1)
    out = core.step()
    assert (out.prefill_tokens, out.decode_seqs) == (40, 1)
    assert out.duration == pytest.approx(ms(40, 1))
    assert len(a.output) == 2


def test_speedup_ratio_divides_times() -> None:
    fast = replace(CFG, speedup_ratio=4.0)
    core = EngineCore(fast)
    core.add("r", list(range(10)), max_tokens=1)
    assert core.step().duration == pytest.approx(ms(10, 0) / 4)


def test_max_num_seqs_makes_later_requests_wait() -> None:
    cfg = replace(CFG, max_num_seqs=2)
    core = EngineCore(cfg)
    reqs = [core.add(f"r{i}", [i] * 10, max_tokens=3) for i in range(3)]
    core.step()
    assert [len(r.output) for r in reqs] == [1, 1, 0]
    assert len(core.waiting) == 1
    finished = run_until_done(core, *reqs)
    assert finished["r2"] > max(finished["r0"], finished["r1"])


def test_request_waits_for_blocks_and_runs_once_they_free() -> None:
    cfg = replace(CFG, num_gpu_blocks=6, max_num_batched_tokens=512)
    core = EngineCore(cfg)
    big = core.add("big", list(range(80)), max_tokens=2)  # 5 blocks, 6 with its output
    small = core.add("small", list(range(500, 540)), max_tokens=1)  # needs 3 blocks
    out = core.step()
    assert [r.request_id for r, _ in out.emitted] == ["big"]
    assert list(core.waiting) == [small]
    run_until_done(core, big, small)
    assert small.output == expected_tokens(list(range(500, 540)), 1)


def test_preemption_under_memory_pressure_keeps_outputs_exact() -> None:
    cfg = replace(CFG, num_gpu_blocks=8, max_num_batched_tokens=256)
    core = EngineCore(cfg)
    prompts = [[i] * 30 for i in range(3)]
    reqs = [core.add(f"r{i}", p, max_tokens=40) for i, p in enumerate(prompts)]
    run_until_done(core, *reqs)
    assert sum(r.preemptions for r in reqs) > 0  # 3 x 70 tokens cannot fit in 8 x 16 at once
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output == expected_tokens(p, 40)
    assert core.cache.stats().pinned == 0


def test_kv_changes_announce_committed_blocks_in_chain_order() -> None:
    core = EngineCore(CFG)
    core.add("r", list(range(40)), max_tokens=1)
    out = core.step()
    (stored,) = out.changes
    assert isinstance(stored, Stored) and stored.parent_id is None and len(stored.blocks) == 2


def test_eviction_is_announced() -> None:
    cfg = replace(CFG, num_gpu_blocks=4)
    core = EngineCore(cfg)
    a = core.add("a", list(range(48)), max_tokens=1)
    run_until_done(core, a)
    a_blocks = core.cache.match_prefix(core._hashes(a, 3))
    assert len(a_blocks) == 3
    core.add("b", list(range(1000, 1048)), max_tokens=1)  # 3 blocks, only 1 free: evict 2
    changes = core.step().changes
    assert changes[0] == Removed([a_blocks[2].block_id, a_blocks[1].block_id])
    assert core.cache.is_cached(a_blocks[0].block_id)


def test_abort_frees_blocks() -> None:
    core = EngineCore(CFG)
    req = core.add("r", list(range(100)), max_tokens=50)
    core.step()
    assert core.cache.stats().pinned > 0
    core.abort(req)
    assert core.cache.stats().pinned == 0 and not core.has_work()


def test_impossible_requests_are_refused_up_front() -> None:
    core = EngineCore(CFG)
    with pytest.raises(RequestTooLarge):
        core.add("r", list(range(64 * 16)), max_tokens=1)
    with pytest.raises(ValueError):
        core.add("r", [], max_tokens=1)


def test_transferred_prompt_is_not_prefilled_and_pays_per_missing_block() -> None:
    cfg = replace(CFG, transfer_ms_per_block=0.5)
    prompt = list(range(64))  # 4 blocks
    core = EngineCore(cfg)
    req = core.add("t", prompt, max_tokens=1, transferred_tokens=64)
    first = core.step()
    # The blocks arrive by transfer; only the last prompt token is computed here.
    assert first.prefill_tokens == 1 and req.received_blocks == 4
    assert first.duration == pytest.approx(ms(1, 0, cfg) + 4 * 0.5 / 1000)
    assert [t for _, t in first.emitted] == expected_tokens(prompt, 1)
    # The blocks it received are in its prefix cache now: a second transfer of the same prompt
    # pays for none of them (and a partial handle transfers only what matches).
    again = core.add("t2", prompt + list(range(100, 116)), max_tokens=1, transferred_tokens=80)
    second = core.step()
    assert again.received_blocks == 1 and again.cached_tokens == 64
    assert second.duration == pytest.approx(ms(1, 0, cfg) + 0.5 / 1000)
