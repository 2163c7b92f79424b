"""`spine call` with no --model calls the router's `default` alias: the README's smoke test keeps
working once the router's models are replaced by the operator's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.config.file import placements_for
from runtime.stack import Stack
from spine.cli import main
from tests.conftest import config_for_tests


def test_spine_call_without_a_model_calls_the_default_alias_whatever_its_id(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = config_for_tests(inference={"model_id": "tiny-lm-mini", "models": []},
                              router={"models": [{"id": "tiny-lm-mini", "backend": "inference", "aliases": ["default"]}]})
    stack = Stack(config, placements_for("collapsed", config), run_dir=tmp_path / "run").start()
    try:
        code = main(["call", "--address", stack.address, "--max-tokens", "2", "--json"])
        answer = json.loads(capsys.readouterr().out)
        old = main(["call", "--address", stack.address, "--max-tokens", "2", "--json", "--model", "tiny-lm"])
        refused = json.loads(capsys.readouterr().out)
    finally:
        stack.stop()
    assert code == 0 and (answer["status"], answer["model"]) == ("OK", "default")
    assert old == 1 and refused["status"] == "NOT_FOUND"  # the old default's id is served no more
