"""`jetrouter serve` declares --router-track-output-blocks and --router-prefill-load-model: they
show in `--help`, reach the replica's config, and a bad model is one line and exit status 2."""

from __future__ import annotations

import pytest

from api.cli import build_parser
from api.serve import build_config
from tests.unit.api.test_cli_flags import run_cli


def test_serve_help_shows_both_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["serve", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--router-track-output-blocks" in text
    assert "--router-prefill-load-model {none,linear}" in text


def test_flags_reach_the_replica_config() -> None:
    def config(*argv: str):  # type: ignore[no-untyped-def]
        return build_config(build_parser(["serve"]).parse_args(["serve", *argv]))

    default = config()
    assert (default.track_output_blocks, default.prefill_load_model) == (False, "none")
    on = config("--router-track-output-blocks", "--router-prefill-load-model", "linear")
    assert (on.track_output_blocks, on.prefill_load_model) == (True, "linear")


def test_an_unknown_prefill_load_model_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["serve", "--router-prefill-load-model", "aic"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--router-prefill-load-model" in err[0], err
