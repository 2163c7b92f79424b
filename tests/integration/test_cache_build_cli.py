"""`spine cache build` writes a table that `spine up --deterministic` maps; `spine call
--deterministic` sends a reproducible (seeded, so cacheable) request; bad prompt files are
refused naming the line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from runtime.processes.launch import launch, spine_up_argv
from spine.cli import main


def counter(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def spine(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spine", *args], capture_output=True, text=True, timeout=120)


def test_a_built_table_is_mapped_by_spine_up_and_call_deterministic_is_seeded(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"model": "default", "prompt": "from the cli", "max_tokens": 5}) + "\n\n"
                       + json.dumps({"model": "tiny-lm", "system": "Be brief.", "prompt": "two", "max_tokens": 3}))
    built = spine("cache", "build", "--prompts", str(prompts), "--out", str(tmp_path / "table.bin"))
    assert built.returncode == 0, built.stderr
    summary = json.loads(built.stdout)
    assert (summary["model"], summary["entries"]) == ("tiny-lm", 2)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"cache": {"pregenerated": str(tmp_path / "table.bin")}}))
    run = tmp_path / "run"
    launched = launch("spine up", spine_up_argv(config, "collapsed", listen="127.0.0.1:0", http_listen="off",
                                                run_dir=run, extra=("--deterministic",)), log_path=tmp_path / "spine.log")
    process = launched.process
    try:
        ready = launched.wait_ready(120)
        assert yaml.safe_load((run / "config.yaml").read_text())["inference"]["deterministic"] is True

        def call(*args: str) -> dict[str, object]:
            done = spine("--config", str(config), "call", "--address", ready["address"], "--json", *args)
            assert done.returncode == 0, done.stdout + done.stderr
            return json.loads(done.stdout)  # type: ignore[no-any-return]

        answer = call("--prompt", "from the cli", "--max-tokens", "5")
        assert counter(ready["metrics"], "spine_cache_pregenerated_hits_total") == 1
        assert len(answer["token_ids"]) <= 5  # type: ignore[arg-type]
        hits = counter(ready["metrics"], "spine_cache_hits_total")
        sampled = [call("--prompt", "sampled", "--temperature", "0.9", "--deterministic") for _ in range(2)]
        assert sampled[0]["token_ids"] == sampled[1]["token_ids"]
        assert counter(ready["metrics"], "spine_cache_hits_total") == hits + 1  # seeded: the second is cached
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert process.returncode == 0


@pytest.mark.parametrize(("line", "problem"), [
    ('{"model": "tiny-lm", "prompt": "x"}', "prompts.jsonl:1: max_tokens: expected an integer >= 1"),
    ('{"model": "gpt-9", "prompt": "x", "max_tokens": 2}', "prompts.jsonl:1: model: 'gpt-9' is not a model id"),
    ('{"model": "tiny-lm", "prompt": "x", "max_tokens": 2, "temperature": 1}', "unknown field(s) ['temperature']"),
    ("not json", "prompts.jsonl:1: not valid JSON"),
    ('{"model": "tiny-lm", "prompt": "x", "max_tokens": 2}\n{"model": "mini", "prompt": "x", "max_tokens": 2}',
     "a table holds one model's answers"),
])
def test_a_bad_prompts_file_is_refused_naming_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       line: str, problem: str) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(line)
    assert main(["cache", "build", "--prompts", str(prompts), "--out", str(tmp_path / "t.bin")]) == 2
    assert problem in capsys.readouterr().err
    assert not (tmp_path / "t.bin").exists()
