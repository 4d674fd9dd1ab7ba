"""The simulated engine's step-time models: Dynamo mocker's polynomial (the default) and the
linear one, as the scheduler charges them (virtual time, no sleeping)."""

from __future__ import annotations

import argparse

import pytest

from workers import cli as worker_cli
from workers.perf_model import polynomial_decode_ms, polynomial_prefill_ms
from workers.scheduler import EngineConfig, EngineCore

CFG = EngineConfig(num_gpu_blocks=64, block_size=16, max_num_batched_tokens=64)


def test_polynomial_formulas() -> None:
    assert polynomial_prefill_ms(0) == 0.0
    assert polynomial_prefill_ms(768) == pytest.approx(28.41, abs=0.01)
    assert polynomial_prefill_ms(8192) == pytest.approx(169.1, abs=0.1)
    assert polynomial_decode_ms(0, 65536) == pytest.approx(5.74)
    assert polynomial_decode_ms(6554, 65536) == pytest.approx(10.88, abs=0.01)
    assert polynomial_decode_ms(65536, 65536) == pytest.approx(34.01)
    assert polynomial_decode_ms(10**9, 65536) == pytest.approx(34.01)  # usage capped at 1


def test_default_model_is_the_mockers_polynomial() -> None:
    assert EngineConfig().perf_model == "polynomial"
    with pytest.raises(ValueError, match="perf_model"):
        EngineConfig(perf_model="cubic")


def test_a_step_pays_prefill_of_its_uncached_tokens_and_decode_only_when_it_emits() -> None:
    core = EngineCore(CFG)
    core.add("r", list(range(100)), max_tokens=2)
    first = core.step()  # a 64-token chunk: prefill only, nothing emitted
    assert not first.emitted
    assert first.duration == pytest.approx(polynomial_prefill_ms(64) / 1000)
    second = core.step()  # the last 36 prompt tokens, then the first token
    assert len(second.emitted) == 1
    pinned = 7  # ceil(100 / 16) prompt blocks
    assert second.duration == pytest.approx(
        (polynomial_prefill_ms(36) + polynomial_decode_ms(pinned * 16, 64 * 16)) / 1000)
    # the mocker's order: the step's tokens are out once its prefill part is done
    assert first.tokens_at == first.duration
    assert second.tokens_at == pytest.approx(polynomial_prefill_ms(36) / 1000)
    third = core.step()  # a pure decode step: no prefill term
    assert third.prefill_tokens == 0
    assert third.duration == pytest.approx(polynomial_decode_ms(pinned * 16, 64 * 16) / 1000)
    assert third.tokens_at == 0.0


def test_the_linear_model_sends_tokens_at_the_end_of_the_step() -> None:
    core = EngineCore(EngineConfig(num_gpu_blocks=64, block_size=16, perf_model="linear"))
    core.add("r", list(range(40)), max_tokens=2)
    for out in (core.step(), core.step()):
        assert len(out.emitted) == 1 and out.tokens_at == out.duration > 0


def test_cached_prefix_is_free_and_speedup_divides() -> None:
    core = EngineCore(EngineConfig(num_gpu_blocks=64, block_size=16, speedup_ratio=4.0))
    core.add("a", list(range(48)), max_tokens=1)
    core.step()
    core.add("b", list(range(32)) + list(range(100, 116)), max_tokens=1)  # 2 blocks cached
    out = core.step()
    assert out.prefill_tokens == 16
    assert out.duration == pytest.approx(
        (polynomial_prefill_ms(16) + polynomial_decode_ms(3 * 16, 64 * 16)) / 1000 / 4)


def _worker_settings(argv: list[str]) -> EngineConfig:
    p = argparse.ArgumentParser()
    worker_cli.add_arguments(p)
    return worker_cli.settings_from_args(p.parse_args(argv)).engine


def test_worker_flags_choose_the_model_and_refuse_linear_constants_without_it() -> None:
    assert _worker_settings([]).perf_model == "polynomial"
    linear = _worker_settings(["--perf-model", "linear", "--decode-ms-base", "20"])
    assert (linear.perf_model, linear.decode_ms_base, linear.prefill_ms_per_token) == \
        ("linear", 20.0, EngineConfig().prefill_ms_per_token)
    with pytest.raises(ValueError, match="--decode-ms-base sets the linear step-time model"):
        _worker_settings(["--decode-ms-base", "20"])
